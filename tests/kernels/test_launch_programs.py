"""The triton source's per-layout launch programs (``tplogp.kernels.forward_programs.ForwardProgram`` and
``KeptBackward``): the op's calls (``ShardCall.inputs_checked``) of a layout reuse one program, made
at the layout's first call, whose launches are made once (``tplogp.kernels.launch.Launch``), held by
the source under the call's settings (``ShardCall.key``) and the tensors' layout, for eager and
compiled calls alike. A program runs the same kernels with the same arguments as the per-call path,
so its outputs, kept terms and gradients are bitwise the per-call path's. Triton's CPU interpreter.
"""

from __future__ import annotations

import pytest
import torch

from tplogp.backends.base import KeptBuffers, ShardCall
from tplogp.kernels.tiles import interpreting

pytestmark = pytest.mark.skipif(not interpreting(),
                                reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1)")

N, D, V = 24, 32, 200


def _inputs(n: int = N, bias: bool = False, bad_target: bool = False):
    g = torch.Generator().manual_seed(n)
    hidden = torch.randn(n, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.3
    target = torch.randint(0, V, (n,), generator=g)
    if bad_target:
        target[3] = V + 5
    return hidden, weight, (torch.randn(V, generator=g) if bias else None), target


def _backend():
    from tplogp.backends.triton_backend import TritonBackend

    return TritonBackend()


def _programs(backend, call: ShardCall) -> dict:
    """The programs ``backend`` holds for ``call``'s settings: ``{(kind, check_targets, rows):
    found}`` for the forwards, ``{("backward", needs, rows): found}`` for the backwards."""
    out = {}
    for key, found in backend._programs.items():
        if key[0] == call.key:
            rows = key[5][0] if key[1] == "backward" else key[3][0]
            out[(key[1], key[2], rows)] = found
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _tensors(out) -> list:
    flat = list(out[:6])
    if isinstance(out.kept, KeptBuffers):
        flat += [out.kept.values, out.kept.scales]
    return flat


@pytest.mark.parametrize("entropy", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["logp", "entropy"])
@pytest.mark.parametrize("bias", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["no-bias", "bias"])
@pytest.mark.parametrize("keep", [False, True], ids=["no-keep", "keep"])
def test_a_program_gives_the_per_call_paths_bits(entropy, bias, keep):
    backend = _backend()
    hidden, weight, b, target = _inputs(bias=bias, bad_target=True)
    settings = dict(inv_temperature=1.0 / 0.7, with_entropy=entropy, for_backward=keep,
                    scales_apart=True)
    planned, per_call = ShardCall(inputs_checked=True, **settings), ShardCall(**settings)
    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(3)]
    for flag in flags[:2]:  # the first call makes the program, the second runs it
        got = backend.forward_single(hidden, weight, b, target, planned, target_flag=flag)
    want = backend.forward_single(hidden, weight, b, target, per_call, target_flag=flags[2])
    held = _programs(backend, planned)
    assert list(held) == [("single", True, N)] and held[("single", True, N)][0]
    assert not _programs(backend, per_call)
    assert (got.kept is not None) == keep == (want.kept is not None)
    for x, y in zip(_tensors(got), _tensors(want)):
        if x is None:
            assert y is None
        else:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y))
    assert int(flags[1]) == int(flags[2]) == V + 5  # the target check ran in the finishing kernel


@pytest.mark.parametrize("entropy", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["logp", "entropy"])
@pytest.mark.parametrize("keep", [False, True], ids=["no-keep", "keep"])
def test_a_tp_shards_stats_program_gives_the_per_call_paths_bits(entropy, keep):
    """``forward_stats`` (a shard of a group: shard-local targets, -1 where another rank owns the
    target)."""
    backend = _backend()
    hidden, weight, b, target = _inputs(bias=True)
    local = torch.where(target < V // 2, target, -1)
    settings = dict(inv_temperature=1.3, with_entropy=entropy, for_backward=keep, scales_apart=True)
    planned, per_call = ShardCall(inputs_checked=True, **settings), ShardCall(**settings)
    for _ in range(2):
        got = backend.forward_stats(hidden, weight, b, local, planned)
    want = backend.forward_stats(hidden, weight, b, local, per_call)
    held = _programs(backend, planned)
    assert list(held) == [("stats", False, N)] and held[("stats", False, N)][0]

    def flat(out) -> list:
        return list(out[:4]) + ([out.kept.values, out.kept.scales] if out.kept is not None else [])

    assert (got.kept is None) == (want.kept is None) == (not keep)
    for x, y in zip(flat(got), flat(want)):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y))


def test_calls_of_a_layout_share_one_program_and_another_row_count_makes_another():
    backend = _backend()
    call = ShardCall(inputs_checked=True, for_backward=True, scales_apart=True)
    hidden, weight, _, target = _inputs()
    key = ("single", False, N)
    backend.forward_single(hidden, weight, None, target, call)
    first = _programs(backend, call)[key][0]
    backend.forward_single(hidden, weight, None, target, call)
    assert _programs(backend, call)[key][0] is first and len(backend._programs) == 1
    # an equal ShardCall (the same settings) finds the same program
    again = ShardCall(inputs_checked=True, for_backward=True, scales_apart=True)
    backend.forward_single(hidden, weight, None, target, again)
    assert again is not call and _programs(backend, again)[key][0] is first
    short = _inputs(n=N - 5)
    out = backend.forward_single(short[0], weight, None, short[3], call)
    assert set(_programs(backend, call)) == {key, ("single", False, N - 5)}
    assert out.logp.shape == (N - 5,)
    # the same row count, another layout: another program, the first one kept
    other_weight = torch.randn(V + 8, D)
    out = backend.forward_single(hidden, other_weight, None, target, call)
    programs = [p for k, p in backend._programs.items() if k[1:4] == ("single", False, (N, D))]
    assert len(programs) == 2 and first in [p[0] for p in programs] and out.logp.shape == (N,)


def test_a_change_of_dot_precision_makes_another_program(monkeypatch):
    """The kernels' dot precision (``tiles.dot_precision``: fp32 operands follow
    ``torch.get_float32_matmul_precision()``, ``"high"`` giving TF32 on the GPU) is part of the
    source's program key: a program found under one precision is not run under another, and going
    back finds the first key again. (The interpreter computes every fp32 dot in IEEE fp32: the
    precision is set here as a GPU would read it, for the key alone.)"""
    from tplogp.kernels import tiles

    backend = _backend()
    call = ShardCall(inputs_checked=True)
    hidden, weight, _, target = _inputs()
    for precision in ("ieee", "tf32", "ieee"):
        monkeypatch.setattr(tiles, "dot_precision", lambda dtype, p=precision: p)
        assert backend._program(hidden, weight, None, call, "single", False)
    assert sorted(key[-1] for key in backend._programs) == ["ieee", "tf32"]


def test_the_ops_calls_run_programs_for_their_layouts_row_count_only(monkeypatch):
    """The op's plan gives its ShardCall the layout's token count (``ShardCall.rows``): rows
    compacted away by ``ignore_index``, whose count changes from call to call, run no program (nor
    make one); the same layout without ignored targets does."""
    import tplogp
    from tplogp.op.plan import plan_call

    op = tplogp.get_op("linear_logp", source="triton")
    hidden, weight, _, target = _inputs()
    # (the registry's backend is the process's: its programs from other tests set aside)
    monkeypatch.setattr(_backend_of(op, hidden), "_programs", {})
    hidden.requires_grad_()
    for ignored in (3, 5, 8):
        t = target.clone()
        t[:ignored] = -100
        op(hidden, weight, t, ignore_index=-100).sum().backward()
    plan, _ = plan_call(_backend_of(op, hidden), hidden, weight, target, None, None, 0, None,
                        tplogp.op.plan.LogpOptions(ignore_index=-100), True)
    backend = _backend_of(op, hidden)
    assert plan.call_for_backward.rows == N and not _programs(backend, plan.call_for_backward)
    assert not _programs(backend, plan.call_for_backward.consuming)
    for _ in range(2):
        op(hidden, weight, target).sum().backward()
    plan, _ = plan_call(_backend_of(op, hidden), hidden, weight, target, None, None, 0, None,
                        tplogp.op.plan.LogpOptions(), True)
    assert ("single", True, N) in _programs(backend, plan.call_for_backward)
    assert any(k[0] == "backward" for k in _programs(backend, plan.call_for_backward.consuming))


def _backend_of(op, hidden):
    from tplogp.backends.kernel_registry import backend_for_call

    return backend_for_call(op.source, hidden.device, hidden.dtype)


def test_the_flat_kept_buffer_runs_the_layouts_program_and_empty_shards_plan_each_call():
    """The op's flat kept buffer (``scales_apart`` off, torch.compile's path; here into a buffer
    the caller passes, as the op's forward does) runs a program of the source's like the eager
    calls, bitwise the per-call path's; an empty shard takes the per-call path (``False`` marks
    it)."""
    backend = _backend()
    hidden, weight, _, target = _inputs()
    flat = ShardCall(inputs_checked=True, for_backward=True)
    words = backend.kept_shape(N, D, V, hidden.dtype, hidden.device, flat)
    outs = []
    for _ in range(2):
        buffer = torch.full(words, float("nan"))
        outs.append(backend.forward_single(hidden, weight, None, target, flat, kept_out=buffer))
        assert outs[-1].kept is buffer
    (found,) = _programs(backend, flat).values()
    assert found and found[0].stats is not None
    want = backend.forward_single(hidden, weight, None, target,
                                  ShardCall(for_backward=True))
    for got in outs:
        for x, y in zip(list(got[:4]) + [got.kept], list(want[:4]) + [want.kept]):
            assert x.shape == y.shape and torch.equal(_bits(x), _bits(y))
    empty = ShardCall(inputs_checked=True)
    out = backend.forward_single(hidden[:0], weight, None, target[:0], empty)
    assert _programs(backend, empty) == {("single", False, 0): False} and out.logp.shape == (0,)


def test_the_call_key_holds_every_setting_but_the_support():
    """``ShardCall.key``, what the programs are keyed by: one entry per field but the support's
    (the support, its union, whether it is narrowed, whether a row keeps every id, its logits:
    support calls run no program), so calls that differ in a setting never share a program."""
    import dataclasses

    of_support = ("support", "support_union", "support_narrowed", "support_keeps_all",
                  "support_logits")
    names = [f.name for f in dataclasses.fields(ShardCall) if f.name not in of_support]
    call = ShardCall(inv_temperature=2.0, with_entropy=True, softcap=30.0, with_sum_z=True,
                     with_argmax=True, deterministic=True, workspace_bytes=7, for_backward=True,
                     consume_kept=True, d_hidden_in_input_dtype=True, inputs_checked=True,
                     scales_apart=True, rows=5, grid_columns=64, env=("a", None, False))
    assert call.key == tuple(getattr(call, name) for name in names)
    for name in names:
        assert dataclasses.replace(call, **{name: ShardCall.__dataclass_fields__[name].default}
                                   ).key != call.key, name
    assert dataclasses.replace(call, support=torch.zeros(5, 2, dtype=torch.int64),
                               support_union=torch.arange(3), support_narrowed=True,
                               support_logits=torch.zeros(5, 2)).key == call.key


@pytest.mark.parametrize("entropy", [False, True], ids=["logp", "entropy"])
@pytest.mark.parametrize("bias", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["no-bias", "bias"])
@pytest.mark.parametrize("lse", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["no-lse", "lse"])
def test_a_consuming_backward_program_gives_the_per_call_paths_gradients(entropy, bias, lse):
    """Every term kept, a backward that consumes them: the layout's ``KeptBackward`` kept by the
    source (made by the first backward, run by the second) against the per-call path (its layout's
    from the per-call cache), bitwise, on kept terms of the same forward.
    (tests/kernels/test_consume_kept.py checks the per-call consuming backward against the read-only
    one, which recomputes through a workspace.)"""
    backend = _backend()
    hidden, weight, b, target = _inputs(bias=bias)
    hidden, weight = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    b = None if b is None else b.to(torch.bfloat16)
    budget = 1 << 30  # keeps every term
    settings = dict(inv_temperature=1.0 / 0.7, with_entropy=entropy, for_backward=True,
                    scales_apart=True, workspace_bytes=budget, d_hidden_in_input_dtype=True)
    planned, per_call = ShardCall(inputs_checked=True, **settings), ShardCall(**settings)
    g = torch.Generator().manual_seed(3)
    grads = (torch.randn(N, generator=g), torch.randn(N, generator=g) if entropy else None,
             torch.randn(N, generator=g) if lse else None)
    needs = (True, True, bias)

    def backward(call):
        out = backend.forward_single(hidden, weight, b, target, call)
        assert out.kept.values.shape == (N, V)
        return backend.backward(hidden, weight, b, target, out.row_max, out.log_sum, grads[0],
                                grads[1], grads[2], out.mean_rel if entropy else None,
                                call.consuming, needs,
                                kept=KeptBuffers(out.kept.values, out.kept.scales))

    for _ in range(2):
        got = backward(planned)
    want = backward(per_call)
    held = _programs(backend, planned.consuming)
    assert ("backward", needs, N) in held and not _programs(backend, per_call.consuming)
    for x, y in zip(got, want):
        assert (x is None) == (y is None) == (x is got.d_bias and not bias)
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(_bits(x), _bits(y))


def test_the_per_call_path_takes_one_program_per_layout_from_the_cache(monkeypatch):
    """Calls that plan each call (a plain ShardCall) build the same program as the source's, once
    per layout key, in the one per-call cache; another layout (here another vocab size) builds
    another, with its own launches."""
    from tplogp.kernels import forward_programs, launch

    monkeypatch.setattr(launch, "_CACHE", {})
    backend = _backend()
    hidden, weight, _, target = _inputs()
    for _ in range(2):
        backend.forward_single(hidden, weight, None, target, ShardCall())
    (found,) = launch._CACHE.values()
    assert isinstance(found, forward_programs.ForwardProgram) and found.single
    wider = torch.randn(V + 40, D)
    backend.forward_single(hidden, wider, None, target, ShardCall())
    assert len(launch._CACHE) == 2
    other = [p for p in launch._CACHE.values() if p is not found][0]
    assert other.stats is not found.stats and other.finish is not found.finish
    assert other.stats.kernel is found.stats.kernel and other.stats.scalars != found.stats.scalars


def test_the_layout_and_program_caches_stay_bounded():
    """The source's programs and its layout cache are emptied when a new key would pass their
    limit; a key they already hold is replaced without emptying them."""
    from tplogp.backends import triton_backend, triton_layouts

    programs: dict = {}
    limit = triton_backend.MAX_PROGRAMS
    for i in range(limit):
        triton_layouts.remember(programs, ("single", i), i, limit)
    triton_layouts.remember(programs, ("single", 0), "again", limit)  # held: nothing dropped
    assert len(programs) == limit and programs[("single", 0)] == "again"
    assert triton_layouts.remember(programs, ("single", -1), "new", limit) == "new"
    assert programs == {("single", -1): "new"}
    backend = _backend()
    for n in range(1, triton_layouts.MAX_LAYOUTS + 2):
        backend._launch_layout(torch.empty(n, D), torch.empty(V, D), ShardCall())
    assert len(backend._layout_cache) == 1  # the 257th layout found the cache full
