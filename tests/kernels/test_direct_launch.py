"""tplogp.kernels.direct_launch: which calls reuse a compiled kernel, and what reaches its launcher.

A stand-in JIT kernel records what the JIT front end and the compiled kernel's launcher receive, so the caching
logic is tested on the CPU. The real kernels run through it on the GPU (tests/gpu).
"""

from __future__ import annotations

import types

import pytest
import torch

from tplogp.kernels import direct_launch
from tplogp.kernels.direct_launch import DirectLauncher, arg_key, args_key


def _kernel_fn(p_x, p_y, N, scale, BLOCK: "tl.constexpr", FLAG: "tl.constexpr" = False):  # noqa: F821
    pass


class _FakeBinary:
    def __init__(self, log):
        self.function = object()
        self.packed_metadata = ("meta",)
        self.log = log

    def run(self, *args):
        self.log.append(("direct", args))


class _FakeJit:
    """What direct_launch needs of a ``@triton.jit`` object: ``fn`` and ``[grid](...)``."""

    def __init__(self):
        self.fn = _kernel_fn
        self.log: list = []
        self.compiled = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.compiled += 1
            self.log.append(("jit", grid, args, kwargs))
            return _FakeBinary(self.log)

        return run


@pytest.fixture
def fake(monkeypatch):
    jit = _FakeJit()
    launch = DirectLauncher(jit)
    launch._enabled = True  # as on a CUDA device
    launch._knobs = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(direct_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(direct_launch, "_raw_stream", lambda device: 1234)
    return jit, launch


def test_first_call_compiles_then_launches_directly_in_signature_order(fake):
    jit, launch = fake
    x, y = torch.zeros(64), torch.zeros(64)
    launch((3,), x, y, 32, 0.5, BLOCK=64, FLAG=False, num_warps=4)
    assert jit.log[0] == ("jit", (3,), (x, y, 32, 0.5), {"num_warps": 4, "BLOCK": 64, "FLAG": False})
    launch((5, 2), x, y, 48, 2.0, BLOCK=64, FLAG=False, num_warps=4)  # 32 and 48: both divisible by 16, one key
    kind, args = jit.log[1]
    assert kind == "direct" and jit.compiled == 1
    assert args[:4] == (5, 2, 1, 1234)  # grid x, y, z and the current stream
    assert args[5] == ("meta",) and args[6:9] == (None, None, None)  # no launch metadata and no hooks
    assert args[9:] == (x, y, 48, 2.0, 64, False)  # runtime args, then constexprs
    assert launch.direct_launches == 1 and launch.jit_launches == 1


@pytest.mark.parametrize("consts", [dict(BLOCK=64), dict(FLAG=False, BLOCK=64)], ids=["default", "out-of-order"])
def test_constexprs_not_all_given_in_order_keep_the_jit_path(fake, consts):
    jit, launch = fake
    x = torch.zeros(64)
    for _ in range(3):
        launch((1,), x, x, 16, 1.0, **consts, num_warps=4)
    assert jit.compiled == 3 and launch.direct_launches == 0


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int_one", "int_residue", "int64", "constexpr",
                                    "num_warps", "num_stages"])
def test_a_different_specialization_compiles_again(fake, change):
    jit, launch = fake
    buf = torch.zeros(128)
    base = dict(args=(buf[:64], buf[64:], 32, 1.0), consts=dict(BLOCK=64, FLAG=False), opts=dict(num_warps=4))
    launch((1,), *base["args"], **base["consts"], **base["opts"])
    args, consts, opts = list(base["args"]), dict(base["consts"]), dict(base["opts"])
    if change == "misaligned":
        args[0] = buf[1:65]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args[1] = torch.zeros(64, dtype=torch.float64)
    elif change == "int_one":
        args[2] = 1
    elif change == "int_residue":
        args[2] = 33
    elif change == "int64":
        args[2] = 1 << 32  # divisible by 16, like 32, but a 64-bit int for Triton
    elif change == "constexpr":
        consts["FLAG"] = True
    elif change == "num_warps":
        opts["num_warps"] = 8
    else:
        opts["num_stages"] = 3
    launch((1,), *args, **consts, **opts)
    assert jit.compiled == 2 and [e[0] for e in jit.log] == ["jit", "jit"]


def test_launch_hooks_and_the_env_switch_keep_the_jit_path(fake, monkeypatch):
    jit, launch = fake
    x = torch.zeros(64)
    launch._knobs = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[print]),
                                          launch_exit_hook=None)
    for _ in range(2):
        launch((1,), x, x, 16, 1.0, BLOCK=64, FLAG=False, num_warps=4)
    assert jit.compiled == 2  # a profiler's hook sees every launch
    monkeypatch.setenv("TPLOGP_DIRECT_LAUNCH", "0")
    off = DirectLauncher(jit)
    assert not off.enabled()
    launch._knobs = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    direct_launch.set_direct_launch(False)
    try:
        launch((1,), x, x, 16, 1.0, BLOCK=64, FLAG=False, num_warps=4)
    finally:
        direct_launch.set_direct_launch(None)
    assert jit.compiled == 3 and launch.direct_launches == 0


def test_bad_calls_name_what_was_expected(fake):
    _, launch = fake
    x = torch.zeros(64)
    with pytest.raises(TypeError, match="expected 4 runtime arguments, got 3"):
        launch((1,), x, x, 16, BLOCK=64, num_warps=4)
    with pytest.raises(TypeError, match="missing constexpr argument 'BLOCK'"):
        launch((1,), x, x, 16, 1.0, num_warps=4)


def test_arg_keys():
    assert arg_key(16) == arg_key(32) != arg_key(1)
    assert arg_key(17) != arg_key(1)  # 17 % 16 == 1 % 16, but 1 is Triton's constant
    assert arg_key(2.0) == arg_key(0.25)
    assert arg_key(True) != arg_key(1)
    assert arg_key(None) is None
    # the inline key of a whole argument list is arg_key's, argument by argument
    t = torch.zeros(8)
    mixed = (t, t[1:], 1, 16, 17, -5, 1 << 40, (1 << 63) + 3, 2.5, None, True, torch.nn.Parameter(t))
    assert args_key(mixed) == tuple(map(arg_key, mixed))
    with pytest.raises(TypeError, match="no launch key"):
        arg_key("text")


def test_stand_ins_without_fn_are_launched_through_getitem():
    jit = _FakeJit()
    calls = []

    class _Stub:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    direct_launch.launcher(_Stub())((2,), 1, 2, num_warps=4, BLOCK=8)
    assert calls == [((2,), (1, 2), {"num_warps": 4, "BLOCK": 8})]
    assert isinstance(direct_launch.launcher(jit), DirectLauncher)
    assert direct_launch.launcher(jit) is direct_launch.launcher(jit)


def test_sm90_descriptors_equal_from_tensor():
    pytest.importorskip("triton")
    from triton.tools.tensor_descriptor import TensorDescriptor

    from tplogp.kernels import hopper_launch

    t = torch.zeros(64, 40, dtype=torch.bfloat16)
    assert hopper_launch._descriptor(t, [16, 32]) == TensorDescriptor.from_tensor(t, [16, 32])


@pytest.mark.parametrize("module_name", ["generic_launch", "hopper_launch"])
def test_tplogp_launch_sites_qualify_for_direct_launches(module_name):
    """Every ``launcher(kernel)(grid, ...)`` call in the launchers passes all of the kernel's constexprs, in
    signature order (else it would silently stay on the slower JIT path); the launches described by a
    ``LaunchSpec`` are checked below."""
    pytest.importorskip("triton")
    import ast
    import importlib
    import inspect

    module = importlib.import_module(f"tplogp.kernels.{module_name}")
    tree = ast.parse(inspect.getsource(module))
    sites = 0
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Call)
                and getattr(node.func.func, "id", None) == "launcher"):
            kernel = getattr(module, node.func.args[0].id)
            names = tuple(k.arg for k in node.keywords if k.arg not in ("num_warps", "num_stages"))
            expected = DirectLauncher(kernel).const_names
            assert names == expected, f"{node.func.args[0].id}: constexprs {names}, signature order {expected}"
            assert len(node.args) == 1 + DirectLauncher(kernel).n_runtime, node.func.args[0].id
            sites += 1
    assert sites >= 2


def test_launch_specs_qualify_for_direct_launches():
    """The launches described by a :class:`~tplogp.kernels.bound_launch.LaunchSpec` (run per call, or bound once
    per layout) pass all of their kernel's constexprs in signature order, and as many runtime arguments as it
    takes."""
    pytest.importorskip("triton")
    from tplogp.kernels import generic_launch, tiles

    cfg = tiles.INTERPRETER
    specs = [(generic_launch.stats_spec(64, 256, 32, 32, 32, bias, entropy, 1.0, cfg, torch.bfloat16, kept)[0],
              generic_launch.fwd_stats_kernel, 7)
             for bias in (False, True) for entropy in (False, True) for kept in (None, (256, 8, 256))]
    specs += [(generic_launch.finalize_spec(64, 256, 2, entropy, check), generic_launch.finalize_single_kernel, 4)
              for entropy in (False, True) for check in (False, True)]
    specs += [(generic_launch.merge_spec(64, 3, entropy), generic_launch.merge_splits_kernel, 2)
              for entropy in (False, True)]
    specs += [(generic_launch.dlogits_kept_spec(64, 0, 256, 256, 8, 256, db * 256, 1.0, entropy, db, cfg, None),
               generic_launch.bwd_dlogits_kept_kernel, 11) for entropy in (False, True) for db in (False, True)]
    from tplogp.kernels import scale_launch

    specs += [(scale_launch.scale_spec(numels, dtypes), scale_launch.scale_round_kernel, 7)
              for numels, dtypes in (((100,), (torch.bfloat16,)),
                                     ((100, 30000, 7), (torch.float32, torch.bfloat16, torch.float16)))]
    for spec, kernel, tensors in specs:
        assert spec.jit_fn is kernel
        found = DirectLauncher(kernel)
        assert tuple(spec.constexprs) == found.const_names
        assert len(spec.scalars) + tensors == found.n_runtime


def test_triton_versions_outside_the_known_launcher_call_keep_the_jit_path():
    assert direct_launch.triton_version_supported("3.6.0")
    assert direct_launch.triton_version_supported("3.9.1+git1234")
    assert not direct_launch.triton_version_supported("3.5.1")
    assert not direct_launch.triton_version_supported("4.0.0")
    assert not direct_launch.triton_version_supported("main")
    assert direct_launch.triton_version_supported("3.7.0", ((3, 6), (3, 9)))
    assert not direct_launch.triton_version_supported("3.10.0", ((3, 6), (3, 9)))


@pytest.fixture
def bound_fake(fake, monkeypatch):
    jit, launch = fake
    monkeypatch.setitem(direct_launch._LAUNCHERS, id(jit), launch)
    from tplogp.kernels.bound_launch import LaunchSpec

    return jit, launch, LaunchSpec(jit, (3,), (32, 0.5), 4, None, dict(BLOCK=64, FLAG=False)).bind()


def test_a_bound_launch_runs_the_compiled_kernel_with_its_fixed_arguments(bound_fake):
    jit, launch, bound = bound_fake
    buf = torch.zeros(256)
    x, y = buf[:64], buf[64:128]
    bound.launch(x, y)  # the launcher's first launch: through the JIT
    assert jit.log[0] == ("jit", (3,), (x, y, 32, 0.5), {"num_warps": 4, "BLOCK": 64, "FLAG": False})
    bound.launch(x, y)  # the launcher's own key, then stored: a direct launch
    bound.launch(buf[128:192], y)  # another 16-byte-aligned tensor: the same compiled kernel, no key built
    assert jit.compiled == 1 and [e[0] for e in jit.log] == ["jit", "direct", "direct"]
    kind, args = jit.log[-1]
    assert args[:4] == (3, 1, 1, 1234) and args[5] == ("meta",) and args[6:9] == (None, None, None)
    assert args[9] is not x and torch.equal(args[9], buf[128:192]) and args[10:] == (y, 32, 0.5, 64, False)


def test_a_bound_launch_follows_the_alignment_and_the_launchers_switches(bound_fake):
    jit, launch, bound = bound_fake
    buf = torch.zeros(256)
    bound.launch(buf[:64], buf[64:128])
    bound.launch(buf[1:65], buf[64:128])  # 4 bytes past a 16-byte boundary: another specialization, compiled
    assert jit.compiled == 2
    bound.launch(buf[1:65], buf[64:128])
    assert jit.log[-1][0] == "direct" and jit.compiled == 2
    launch._knobs = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[print]),
                                          launch_exit_hook=None)
    bound.launch(buf[:64], buf[64:128])  # a launch hook (a profiler): every launch through the JIT
    assert jit.log[-1][0] == "jit" and jit.compiled == 3
