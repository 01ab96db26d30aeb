"""tplogp.kernels.launch: a Launch made once per (kernel, layout) launches its kernel with the
call's tensors alone.

In Triton's CPU interpreter a real kernel runs through it (the interpreter returns no compiled
kernel: every call goes through the JIT). A stand-in JIT kernel, whose "compiled kernel" records
what its launcher receives, tests on the CPU what a GPU does: the first call of an alignment goes
through the JIT, later ones call the compiled kernel's launcher with the bound arguments. The real
kernels run through it on the GPU (tests/gpu/test_triton_gpu.py).
"""

from __future__ import annotations

import types

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tplogp.kernels import launch as launch_module  # noqa: E402
from tplogp.kernels.launch import Launch, cached, launcher_call_known  # noqa: E402
from tplogp.kernels.tiles import interpreting  # noqa: E402


@triton.jit
def _axpb_kernel(p_x, p_out, N, a, B: tl.constexpr, BLOCK: tl.constexpr):
    """out = a * x + B over N elements."""
    o_e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    m_e = o_e < N
    tl.store(p_out + o_e, tl.load(p_x + o_e, mask=m_e) * a + B, mask=m_e)


@pytest.mark.skipif(not interpreting(),
                    reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1)")
def test_a_launch_bound_once_runs_its_kernel_for_every_calls_tensors():
    n = 37  # two programs of 32, the second masked
    launch = Launch(_axpb_kernel, (2,), (n, 0.5), 4, None, dict(B=3.0, BLOCK=32))
    # the same layout, new tensors each call (one of them a view 4 bytes off alignment)
    for seed in range(3):
        x = torch.randn(n + 1, generator=torch.Generator().manual_seed(seed))[seed % 2:][:n]
        out = torch.full((n,), float("nan"))
        launch(x, out)
        assert torch.equal(out, x * 0.5 + 3.0)
    assert not launch._compiled  # the interpreter compiles nothing: each call went through the JIT


def test_a_launch_checks_its_constexprs_and_tensor_count_once():
    with pytest.raises(TypeError, match="every constexpr, in signature order"):
        Launch(_axpb_kernel, (1,), (4, 1.0), 4, None, dict(BLOCK=32, B=1.0))  # out of order
    with pytest.raises(TypeError, match="every constexpr"):
        # B passed as a runtime argument
        Launch(_axpb_kernel, (1,), (4, 1.0, 1.0), 4, None, dict(BLOCK=32))
    launch = Launch(_axpb_kernel, (1,), (4, 1.0), 4, None, dict(B=1.0, BLOCK=32))
    assert launch.n_tensors == 2
    with pytest.raises(TypeError, match="expected 2 tensors, got 1"):
        launch(torch.zeros(4))


# ------------------------------------------------------------------------ a stand-in for a GPU's
# compiled kernels


def _kernel_fn(p_x, p_y, N, scale, BLOCK: "tl.constexpr",
               FLAG: "tl.constexpr" = False):  # noqa: F821
    pass


class _FakeCompiled:
    """What a Launch keeps of a ``CompiledKernel``: ``run``, ``function``, ``packed_metadata``."""

    def __init__(self, log):
        self.function = object()
        self.packed_metadata = ("meta",)
        self.log = log

    def run(self, *args):
        self.log.append(("direct", args))


class _FakeJit:
    """What a Launch needs of a ``@triton.jit`` object: ``fn`` and ``[grid](...)``, which returns
    the compiled kernel (None: the interpreter's)."""

    def __init__(self, compiles=True):
        self.fn = _kernel_fn
        self.log: list = []
        self.compiled = 0
        self.compiles = compiles

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.compiled += 1
            self.log.append(("jit", grid, args, kwargs))
            return _FakeCompiled(self.log) if self.compiles else None

        return run


class _Driver:
    def __init__(self):
        self.device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1000 + device


@pytest.fixture
def gpu_like(monkeypatch):
    """Triton's launcher call known, no launch hooks, device 0 current, its stream 1000."""
    runtime = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[]),
                                    launch_exit_hook=None)
    monkeypatch.setattr(launch_module, "_RUNTIME", runtime)
    driver = _Driver()
    monkeypatch.setattr(launch_module, "_active_driver", lambda: driver)
    return runtime, driver


def test_the_first_call_goes_through_the_jit_then_the_compiled_kernel_runs_with_the_bound_arguments(gpu_like):
    jit = _FakeJit()
    launch = Launch(jit, (3,), (32, 0.5), 4, None, dict(BLOCK=64, FLAG=False))
    buf = torch.zeros(256)
    x, y = buf[:64], buf[64:128]
    launch(x, y)
    assert jit.log == [("jit", (3,), (x, y, 32, 0.5), {"num_warps": 4, "BLOCK": 64, "FLAG": False})]
    launch(x, y)
    launch(buf[128:192], y)  # another 16-byte-aligned tensor: the same compiled kernel
    assert jit.compiled == 1 and [e[0] for e in jit.log] == ["jit", "direct", "direct"]
    _, args = jit.log[-1]
    assert args[:4] == (3, 1, 1, 1000) and args[5] == ("meta",) and args[6:9] == (None, None, None)
    assert args[9].data_ptr() == buf[128:192].data_ptr() and args[10] is y and args[11:] == (32, 0.5, 64, False)


def test_another_alignment_device_or_a_launch_hook_goes_through_the_jit(gpu_like):
    runtime, driver = gpu_like
    jit = _FakeJit()
    launch = Launch(jit, (2, 3), (32, 0.5), 8, 3, dict(BLOCK=64, FLAG=True))
    buf = torch.zeros(256)
    launch(buf[:64], buf[64:128])
    assert jit.log[0][3] == {"num_warps": 8, "num_stages": 3, "BLOCK": 64, "FLAG": True}
    # 4 bytes past a 16-byte boundary: another specialization, compiled
    launch(buf[1:65], buf[64:128])
    launch(buf[1:65], buf[64:128])
    assert jit.compiled == 2 and jit.log[-1][0] == "direct" and jit.log[-1][1][:3] == (2, 3, 1)
    driver.device = 1  # another device: its own compiled kernel, then its stream
    launch(buf[:64], buf[64:128])
    launch(buf[:64], buf[64:128])
    assert jit.compiled == 3 and jit.log[-1][1][3] == 1001
    runtime.launch_enter_hook.calls.append(print)  # a profiler's hook: every launch through the JIT
    launch(buf[:64], buf[64:128])
    assert jit.log[-1][0] == "jit" and jit.compiled == 4


def test_another_dtype_of_the_same_layout_gets_its_own_compiled_kernel(gpu_like):
    """fp16 and bf16 tensors share a layout's every size, stride and dot precision (the per-call
    cache's key): a kernel compiled for bf16 pointers reads fp16 bits as bf16 (a deterministic
    d_hidden of about 1e-14, all but zero), so each dtype goes through the JIT once and then runs
    its own compiled kernel."""
    jit = _FakeJit()
    launch = Launch(jit, (1,), (32, 0.5), 4, None, dict(BLOCK=64, FLAG=False))
    bf16 = [torch.zeros(64, dtype=torch.bfloat16) for _ in range(2)]
    fp16 = [torch.zeros(64, dtype=torch.float16) for _ in range(2)]
    launch(*bf16)
    launch(*fp16)
    assert jit.compiled == 2 and [e[0] for e in jit.log] == ["jit", "jit"]
    assert [t.dtype for t in jit.log[1][2][:2]] == [torch.float16] * 2
    by_dtype = {}
    for t, compiled in ((bf16, "bf16"), (fp16, "fp16")):
        launch(*t)
        by_dtype[compiled] = jit.log[-1]
    assert jit.compiled == 2 and all(e[0] == "direct" for e in by_dtype.values())
    assert by_dtype["bf16"][1][9].dtype == torch.bfloat16
    assert by_dtype["fp16"][1][9].dtype == torch.float16
    # a mix within one launch is a specialization of its own too
    launch(bf16[0], fp16[1])
    assert jit.compiled == 3 and jit.log[-1][0] == "jit"


def test_without_a_compiled_kernel_every_call_goes_through_the_jit(gpu_like):
    """Triton's interpreter returns no compiled kernel: nothing is kept, each call is a JIT
    launch."""
    jit = _FakeJit(compiles=False)
    launch = Launch(jit, (1,), (32, 0.5), 4, None, dict(BLOCK=64, FLAG=False))
    x = torch.zeros(64)
    for _ in range(3):
        launch(x, x)
    assert jit.compiled == 3 and not launch._compiled


def test_an_unknown_triton_launcher_call_keeps_every_launch_in_the_jit(gpu_like, monkeypatch):
    # (_runtime_knobs() on another Triton release)
    monkeypatch.setattr(launch_module, "_RUNTIME", None)
    jit = _FakeJit()
    launch = Launch(jit, (1,), (32, 0.5), 4, None, dict(BLOCK=64, FLAG=False))
    x = torch.zeros(64)
    launch(x, x)
    launch(x, x)
    assert jit.compiled == 2 and not launch._compiled
    assert launcher_call_known("3.6.0") and launcher_call_known("3.9.1+git1234")
    assert not launcher_call_known("3.5.1") and not launcher_call_known("3.10.0")
    assert not launcher_call_known("4.0.0") and not launcher_call_known("main")


def test_the_compiled_kernels_of_a_launch_stay_bounded(gpu_like):
    _, driver = gpu_like
    jit = _FakeJit()
    launch = Launch(jit, (1,), (32, 0.5), 4, None, dict(BLOCK=64, FLAG=False))
    x = torch.zeros(64)
    for device in range(launch_module.MAX_COMPILED):
        driver.device = device
        launch(x, x)
    assert len(launch._compiled) == launch_module.MAX_COMPILED
    driver.device = launch_module.MAX_COMPILED
    launch(x, x)  # one more key: the dict was emptied first
    assert len(launch._compiled) == 1 and jit.compiled == launch_module.MAX_COMPILED + 1


@pytest.mark.skipif(launch_module.TensorDescriptor is None,
                    reason="Triton without host tensor descriptors")
def test_descriptor_operands_are_made_per_call_and_keyed_by_their_tensors(gpu_like):
    jit = _FakeJit()
    launch = Launch(jit, (1,), (32, 0.5), 4, None, dict(BLOCK=64, FLAG=False), ((0, [16, 32]),))
    x, y = torch.zeros(64, 32), torch.zeros(64)
    launch(x, y)
    desc = jit.log[0][2][0]
    assert isinstance(desc, launch_module.TensorDescriptor) and desc.base is x and list(desc.block_shape) == [16, 32]
    assert tuple(desc.shape) == (64, 32) and tuple(desc.strides) == (32, 1)
    other = torch.zeros(64, 32)
    launch(other, y)
    # a new descriptor, the same compiled kernel
    assert jit.compiled == 1 and jit.log[-1][1][9].base is other


# ------------------------------------------------------------------------------------ the cache of
# the per-call paths


def test_the_per_call_cache_makes_one_object_per_key_and_stays_bounded(monkeypatch):
    monkeypatch.setattr(launch_module, "_CACHE", {})
    monkeypatch.setattr(launch_module, "MAX_CACHED", 4)
    made = []

    def build(*key):
        made.append(key)
        return object()

    first = cached(build, 1, "a")
    assert cached(build, 1, "a") is first and made == [(1, "a")]
    assert cached(build, 2, "a") is not first  # another layout: another object
    for i in range(3, 5):
        cached(build, i, "a")
    assert len(launch_module._CACHE) == 4
    cached(build, 5, "a")  # the fifth key found the cache full: emptied first
    assert len(launch_module._CACHE) == 1 and cached(build, 1, "a") is not first


def test_a_calls_options_reach_the_builders_as_one_bundle_made_once_per_call():
    """``ShardCall.kernel_options`` is made once per ShardCall, equal for equal options (one cache
    key); the builders turn it into the kernels' arguments: the temperature and the cap as scalars
    (1.0 for no cap), the cap's presence and the optional stats as constexprs."""
    from tplogp.backends.base import ShardCall
    from tplogp.kernels import launches, tiles

    call = ShardCall(inv_temperature=2.0, with_entropy=True, softcap=30, with_argmax=True)
    options = call.kernel_options
    assert options is call.kernel_options
    assert options == launches.KernelOptions(launches.LogitTransform(2.0, 30.0), True, False, True)
    assert ShardCall().kernel_options == launches.KernelOptions()
    cfg = tiles.SM90
    stats = launches.stats_launch(64, 256, 32, 32, 32, False, options, cfg, None, None)
    assert stats.scalars[8:10] == (2.0, 30.0)
    assert (stats.constexprs["SOFTCAP"], stats.constexprs["WITH_ENTROPY"],
            stats.constexprs["WITH_SUM_Z"], stats.constexprs["WITH_ARGMAX"]) == (True, True, False,
                                                                                True)
    plain = launches.dlogits_kept_launch(64, 0, 256, 256, 8, 256, 256,
                                         ShardCall().kernel_options.transform, False, False, cfg,
                                         None)
    assert plain.scalars[-2:] == (1.0, 1.0) and not plain.constexprs["SOFTCAP"]
    capped = launches.dlogits_launch(64, 256, 32, 0, 256, 32, 32, 256, 256, False, False, True,
                                     options.transform, cfg, None, with_sum_z=True)
    assert capped.scalars[-2:] == (2.0, 30.0)
    assert capped.constexprs["SOFTCAP"] and capped.constexprs["WITH_SUM_Z"]


def test_every_kernel_launch_is_built_with_its_constexprs_in_signature_order():
    """Each builder's Launch passes the kernel's constexprs in order (:class:`Launch` checks it when
    made), for every variant: pointer and TMA, kept terms or not, each flag."""
    from tplogp.kernels import launches, scale_launch, tiles

    cfg = tiles.SM90
    made = []
    for bias in (False, True):
        for entropy in (False, True):
            for kept in (None, (256, 8, 256)):
                options = launches.KernelOptions(with_entropy=entropy)
                made.append(launches.stats_launch(64, 256, 32, 32, 32, bias, options, cfg, None,
                                                  kept))
                made.append(launches.stats_launch(64, 256, 32, 32, 32, bias, options, cfg, None,
                                                  kept, tma=True, keep_tma=kept is not None))
                for tma in (False, True):  # a sampler's support: its bitmask's launches
                    made.append(launches.stats_launch(64, 256, 32, 32, 32, bias, options, cfg,
                                                      None, kept, tma=tma, support=True))
            identity = launches.LogitTransform()
            for db in (False, True):
                made.append(launches.dlogits_launch(64, 256, 32, 0, 256, 32, 32, 256, 256, bias, db,
                                                    entropy, identity, cfg, None))
                made.append(launches.dlogits_launch(64, 256, 32, 0, 256, 32, 32, 256, 256, bias, db,
                                                    entropy, identity, cfg, None, tma=True))
                for tma in (False, True):
                    made.append(launches.dlogits_launch(64, 256, 32, 0, 256, 32, 32, 256, 256,
                                                        bias, db, entropy, identity, cfg, None,
                                                        tma=tma, support=True))
                made.append(launches.dlogits_kept_launch(64, 0, 256, 256, 8, 256, 256, identity,
                                                         entropy, db, cfg, None))
    made += [launches.merge_launch(64, 3, e) for e in (False, True)]
    made += [launches.finalize_launch(64, 256, 2, e, c) for e in (False, True) for c in (False,
                                                                                         True)]
    made += [launches.dh_launch(64, 256, 32, 256, 32, 32, acc, cfg, None) for acc in (False, True)]
    made.append(scale_launch.scale_launch(((5, torch.float32, torch.bfloat16, False),
                                           (7, torch.bfloat16, torch.bfloat16, True))))
    tensors = {"fwd_stats_kernel": 8, "fwd_stats_tma_kernel": 8, "bwd_dlogits_kernel": 14,
               "bwd_dlogits_tma_kernel": 14, "bwd_dlogits_kept_kernel": 12,
               "merge_splits_kernel": 2, "finalize_single_kernel": 4, "dh_accum_kernel": 3,
               "scale_round_kernel": 7}
    for launch in made:
        assert launch.n_tensors == tensors[launch.kernel.fn.__name__], launch.kernel.fn.__name__
