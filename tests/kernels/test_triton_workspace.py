"""``workspace_bytes`` on the triton source and the sm90 kernels (CPU interpreter): up to the
default d_logits workspace goes to the backward's chunks, the rest keeps the softmax terms (bf16 for
16-bit inputs) of the shard's first columns with their row scales from forward to backward, whose
d_logits are then formed from them, not recomputed. Every budget gives the default's values bit for
bit, and its gradients within the tolerance table (fp32: the table's eps; 16-bit: within the eager
reference's error, three-way against float64). Also: the overlapped all-reduce's issue order on the
triton source.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.problems import make_problem, run_op, run_reference
from tplogp.kernels import kept as kept_layout
from tplogp.backends import memory_budget
from tplogp.kernels import tiles, workspace
from tplogp.tolerances import ERROR_SLACK, assert_no_worse, rel_error, slack_bound

# the interpreter tests' skip condition and kernel sets: triton, and the sm90 kernels bypassing
# their Hopper check
from tests.support.interpreter import KERNELS as BACKENDS, interpreter_only  # noqa: E402
from tests.support import tolerances as tol

pytestmark = interpreter_only
pytest.importorskip("triton")

from tplogp.backends.triton_backend import TritonBackend  # noqa: E402
from tplogp.kernels import backward_programs  # noqa: E402
from tplogp.api import linear_logp_on  # noqa: E402
from tplogp.op.plan import LogpOptions  # noqa: E402

from tplogp.backends.base import ShardCall  # noqa: E402

DEFAULT = memory_budget.DLOGITS_WORKSPACE_BYTES
CPU = CPU_DEVICE = torch.device("cpu")
# odd N (two row tiles, the second masked); D a multiple of 8 (the sm90 kernels' descriptor path);
# V > 2 chunk alignments
N, D, V = 37, 48, 600


def _op(be):
    def op(h, w, y, b=None, tp_group=None, vocab_start_index=0, global_vocab_size=None, **kw):
        return linear_logp_on(be, h, w, y, b, tp_group=tp_group,
                              vocab_start_index=vocab_start_index,
                              global_vocab_size=global_vocab_size, options=LogpOptions(**kw))
    return op


def _count_columns(monkeypatch):
    """Record the vocab columns whose d_logits were read from kept logits and those recomputed."""
    seen = {"kept": 0, "recomputed": 0}
    # (TMA or pointer kernels)
    real_kept, real_recompute = backward_programs.launch_dlogits_kept, backward_programs.launch_dlogits

    def kept(*args, **options):
        seen["kept"] += args[11] - args[10]  # v_hi - v_lo
        return real_kept(*args, **options)

    def recompute(*args, **options):
        seen["recomputed"] += args[13] - args[12]  # v_hi - v_lo
        return real_recompute(*args, **options)

    monkeypatch.setattr(backward_programs, "launch_dlogits_kept", kept)
    monkeypatch.setattr(backward_programs, "launch_dlogits", recompute)
    return seen


# Every pair of (kernels, dtype, mode) values once: four of the eight combinations cover all pairs,
# and each one runs four interpreted forward+backward calls (the full product doubled this module's
# time).
@pytest.mark.slow
@pytest.mark.parametrize("kernels, dtype, deterministic", [
    pytest.param("triton", torch.float32, False, id="default-fp32-triton"),
    pytest.param("triton", torch.bfloat16, True, id="deterministic-bf16-triton"),
    pytest.param("sm90-kernels", torch.float32, True, id="deterministic-fp32-sm90-kernels"),
    pytest.param("sm90-kernels", torch.bfloat16, False, id="default-bf16-sm90-kernels"),
])
def test_every_budget_gives_the_default_results(monkeypatch, kernels, dtype, deterministic):
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    p = make_problem((N,), D, V, dtype, True, seed=8, peaked=True)
    op = _op(BACKENDS[kernels]())
    kw = dict(entropy=True, lse=True, temperature=0.8, deterministic=deterministic)
    default = run_op(op, p, **kw)
    truth = run_reference(p, "float64", temperature=0.8, entropy=True, lse=True)
    ref = run_reference(p, "matching", temperature=0.8, entropy=True, lse=True)
    be = BACKENDS[kernels]()
    # (budget, kept columns): none, two 256-column units, the whole shard
    budgets = [(1, 0), (DEFAULT + be.kept_bytes(N, 520, dtype, CPU), 512), (4 * DEFAULT, V)]
    for budget, cols in budgets:
        assert be._keep_columns(N, V, dtype, CPU,
                                ShardCall(workspace_bytes=budget, for_backward=True)) == cols
        with monkeypatch.context() as m:
            seen = _count_columns(m)
            ours = run_op(op, p, workspace_bytes=budget, **kw)
        assert seen == {"kept": cols, "recomputed": V - cols}, (budget, seen)
        for name in ("logp", "entropy", "lse"):
            assert torch.equal(getattr(ours, name), getattr(default, name)), (name, budget)
        for name in ("d_hidden", "d_weight", "d_bias"):
            a, b = getattr(ours, name), getattr(default, name)
            if cols == 0 and deterministic:
                assert torch.equal(a, b), (name, budget)
            elif dtype == torch.float32:
                assert rel_error(a, b) <= ERROR_SLACK[torch.float32].eps, (name, budget,
                                                                           rel_error(a, b))
            else:
                assert_no_worse(f"{kernels} {budget} {name}", a, getattr(ref, name),
                                getattr(truth, name), dtype)
                bound = slack_bound(rel_error(getattr(ref, name), getattr(truth, name)), dtype)
                assert rel_error(a, b) <= bound, (name, budget, rel_error(a, b))


def test_kept_logits_only_with_a_backward_and_within_the_budget(monkeypatch):
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    p = make_problem((N,), D, V, torch.bfloat16, True, seed=2)
    be = TritonBackend()
    budget = DEFAULT + N * 300 * 4
    scoring = be.forward_single(p.hidden, p.weight, p.bias, p.target,
                                ShardCall(workspace_bytes=budget))
    call = ShardCall(workspace_bytes=budget, for_backward=True, inv_temperature=1.25)
    training = be.forward_single(p.hidden, p.weight, p.bias, p.target, call)
    no_keep = be.forward_stats(p.hidden, p.weight, p.bias, p.target,
                               ShardCall(workspace_bytes=DEFAULT,
                                                                              for_backward=True))
    assert scoring.kept is None and no_keep.kept is None
    assert training.kept.dtype == torch.float32 and training.kept.numel() * 4 <= budget - DEFAULT
    block_v = tiles.INTERPRETER.block_v
    # 2 bytes per term + the scales
    assert training.kept.numel() * 4 == kept_layout.kept_bytes(N, 512, 2, block_v)
    terms, scales = kept_layout.kept_views(training.kept, N, 512, torch.bfloat16, block_v)
    # what the stats kernel keeps: exp(z - m) in bf16, m the running max (natural units) per row and
    # tile
    z = (p.hidden.float() @ p.weight.float().T + p.bias.float())[:, :512] * 1.25
    assert terms.dtype == torch.bfloat16 and scales.shape == (N, 512 // block_v)
    m = scales.repeat_interleave(block_v, 1)
    assert float(terms.float().max()) <= 1.0
    assert rel_error(terms.float(), torch.exp(z - m)) <= tol.REL_BF16_KEPT_TERMS
    # a running max covers its own tile
    assert torch.all(scales >= z.view(N, -1, block_v).amax(2) - 1e-4)


@pytest.mark.slow
def test_environment_budget_and_repeated_backward(monkeypatch):
    """TPLOGP_WORKSPACE_MB has the call's meaning; kept terms are read, not overwritten, by a
    backward that retains the graph (a second backward through it gives the same gradients)."""
    p = make_problem((N,), D, V, torch.float32, True, seed=3)
    op = _op(TritonBackend())
    default = run_op(op, p)
    monkeypatch.setenv("TPLOGP_WORKSPACE_MB", str((DEFAULT >> 20) + 1))
    with monkeypatch.context() as m:
        seen = _count_columns(m)
        env = run_op(op, p)
    assert seen["kept"] == V and rel_error(env.d_weight, default.d_weight) <= ERROR_SLACK[torch.float32].eps
    h = p.hidden.clone().requires_grad_()
    out = op(h, p.weight, p.target)
    (out * p.g_logp).sum().backward(retain_graph=True)
    first = h.grad.clone()
    (out * p.g_logp).sum().backward()
    assert torch.equal(h.grad, 2 * first)


@pytest.mark.slow
@pytest.mark.tp(world_size=4, timeout=300)
def test_overlapped_all_reduce_issue_order_and_kept_budget_on_uneven_ranks(tp):
    """Triton source, 4 uneven gloo ranks, two vocab chunks per rank: the async all-reduce of
    d_hidden is issued after the last chunk's d_hidden GEMM and before its d_W GEMM; a budget that
    keeps every logit's term gives the default's values bit for bit and its gradients within the
    fp32 eps on every rank."""
    from pytest_tplogp import VocabShards

    v = 1201
    vs = VocabShards("uneven", tp.world_size, vocab_size=v).__tp_bind__(tp)
    p = make_problem((2, 9), 16, v, torch.float32, True, seed=4)
    p.weight, p.bias = vs.shard(p.weight).clone(), vs.shard(p.bias).clone()
    op = _op(TritonBackend())
    n, v_local = p.target.numel(), vs.end - vs.start
    kw = dict(tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=v,
              deterministic=True)
    events = []
    real_all_reduce, real_dw, real_dh = dist.all_reduce, backward_programs.mm_into, backward_programs.dh_gemm

    def all_reduce(t, *args, **kwargs):
        events.append("all_reduce" if kwargs.get("async_op") else "blocking all_reduce")
        return real_all_reduce(t, *args, **kwargs)

    def dw(*args):
        events.append("d_W")
        return real_dw(*args)

    def dh(*args):
        events.append("d_hidden")
        return real_dh(*args)

    dist.all_reduce, backward_programs.mm_into, backward_programs.dh_gemm = all_reduce, dw, dh
    try:
        ours = run_op(op, p, workspace_bytes=1, **kw)  # 256-column chunks
    finally:
        dist.all_reduce, backward_programs.mm_into, backward_programs.dh_gemm = real_all_reduce, real_dw, real_dh
    chunks = -(-v_local // workspace.CHUNK_ALIGN)
    expected = ["d_hidden", "d_W"] * (chunks - 1) + ["d_hidden", "all_reduce", "d_W"]
    tp.assert_all(events == expected, f"issue order {events}, expected {expected}")
    most = torch.tensor(chunks)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=tp.group)
    assert most.item() >= 2  # the larger shards run several chunks
    default = run_op(op, p, **kw)
    kept = run_op(op, p,
                  workspace_bytes=DEFAULT + TritonBackend().kept_bytes(n, v_local, torch.float32,
                                                                       CPU_DEVICE), **kw)
    tp.assert_all(torch.equal(kept.logp, default.logp), "logp differs with kept terms")
    for name in ("d_hidden", "d_weight", "d_bias"):
        tp.assert_all(rel_error(getattr(kept, name), getattr(default, name)) <= ERROR_SLACK[torch.float32].eps,
                      f"{name}: kept terms vs default")
        tp.assert_all(rel_error(getattr(ours, name), getattr(default, name)) <= ERROR_SLACK[torch.float32].eps,
                      f"{name}: chunked backward vs default")


def test_shard_layout_is_planned_once_per_layout(monkeypatch):
    """The source's per-layout plan (tile config, kept columns, workspace split) is reused for the
    same layout and planned afresh when the shard size, the budget or ``TPLOGP_WORKSPACE_MB``
    changes (no kernel runs)."""
    be = TritonBackend()
    calls = []
    plan = be._plan_layout
    monkeypatch.setattr(be, "_plan_layout", lambda *a: calls.append(a) or plan(*a))
    budget = DEFAULT + kept_layout.kept_bytes(N, V, 4, be._keep_block_v(CPU, torch.float32))
    first = be._layout(N, V, torch.float32, CPU, budget)
    assert be._layout(N, V, torch.float32, CPU, budget) is first and len(calls) == 1
    assert first.keep_cols == V and first.transient_bytes == DEFAULT
    assert be.kept_shape(N, D, V, torch.float32, CPU,
                         ShardCall(workspace_bytes=budget, for_backward=True)) == (
        first.kept_values + first.kept_scales,)
    assert be._layout(N, V, torch.float32, CPU, DEFAULT).keep_cols == 0 and len(calls) == 2
    assert be._layout(N + 1, V, torch.float32, CPU, budget) is not first and len(calls) == 3
    monkeypatch.setenv("TPLOGP_WORKSPACE_MB", str((DEFAULT >> 20) + 1))
    env = be._layout(N, V, torch.float32, CPU, None)
    assert len(calls) == 4 and env.keep_cols > 0


def test_default_budget_keeps_small_calls_whole(monkeypatch):
    """Without a budget a call whose kept terms and scales fit the default d_logits workspace keeps
    the whole shard (its backward writes d_logits in their place: 3 GEMMs, the default's peak plus
    the scales); a larger call, a deterministic one and an explicit budget of the default workspace
    keep nothing; ``TPLOGP_WORKSPACE_MB`` is a budget like the call's (no kernel runs)."""
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    be = TritonBackend()
    block_v = be._keep_block_v(CPU, torch.bfloat16)

    def cols(n, v, budget=None, deterministic=False):
        return be._keep_columns(n, v, torch.bfloat16, CPU,
                                ShardCall(workspace_bytes=budget, for_backward=True,
                                                                     deterministic=deterministic))

    assert cols(N, V) == V
    # no backward: nothing kept
    assert be._keep_columns(N, V, torch.bfloat16, CPU, ShardCall()) == 0
    # the largest token count that fits, and one more
    fits = DEFAULT // (2 * 8192)
    while kept_layout.kept_bytes(fits, 8192, 2, block_v) > DEFAULT:
        fits -= 1
    assert cols(fits, 8192) == 8192 and cols(fits + 1, 8192) == 0
    assert kept_layout.kept_bytes(fits + 1, 8192, 2, block_v) > DEFAULT
    assert cols(N, V, deterministic=True) == 0
    assert cols(N, V, budget=DEFAULT) == 0
    monkeypatch.setenv("TPLOGP_WORKSPACE_MB", str(DEFAULT >> 20))
    assert cols(N, V) == 0  # the variable is a budget: the default workspace alone keeps nothing


@pytest.mark.slow
def test_default_budget_runs_the_kept_schedule(monkeypatch):
    """A default call small enough to keep forms every d_logits column from the kept terms (no
    recompute) and gives the same logp bits as a call that keeps nothing, and gradients within the
    eager reference's error."""
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    p = make_problem((N,), D, V, torch.bfloat16, True, seed=5)
    op = _op(TritonBackend())
    with monkeypatch.context() as m:
        seen = _count_columns(m)
        default = run_op(op, p, entropy=True)
    assert seen == {"kept": V, "recomputed": 0}
    no_keep = run_op(op, p, entropy=True, workspace_bytes=DEFAULT)
    truth = run_reference(p, "float64", entropy=True)
    ref = run_reference(p, "matching", entropy=True)
    for name in ("logp", "entropy"):
        assert torch.equal(getattr(default, name), getattr(no_keep, name)), name
    for name in ("d_hidden", "d_weight", "d_bias"):
        assert_no_worse(f"default keep {name}", getattr(default, name), getattr(ref, name),
                        getattr(truth, name), torch.bfloat16)


@pytest.mark.slow
def test_kept_buffer_is_freed_after_the_backward(monkeypatch):
    """What is kept (the terms' buffer and, eagerly, the scales in their own allocation) lives from
    the forward to the end of its backward, no longer: nothing the call path keeps refers to it
    afterwards (a reference from the buffer to a view of itself would keep it alive for good)."""
    import gc
    import weakref

    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    be = TritonBackend()
    made = []
    real = be._kept_buffer

    def kept_buffer(*args):
        # eagerly the terms' buffer and the scales, in two allocations (KeptBuffers)
        kept = real(*args)
        made.append((weakref.ref(kept.values), weakref.ref(kept.scales)))
        return kept

    monkeypatch.setattr(be, "_kept_buffer", kept_buffer)
    p = make_problem((N,), D, V, torch.bfloat16, True, seed=4)
    op = _op(be)
    # the in-place backward, and one that reads the terms (retained graph)
    for retain in (False, True):
        h, w = p.hidden.clone().requires_grad_(), p.weight.clone().requires_grad_()
        out = op(h, w, p.target, p.bias)
        out.sum().backward(retain_graph=retain)
        # the call kept its terms (the default, at this size)
        assert len(made) == (2 if retain else 1)
        del out
        gc.collect()
        alive = [ref() is not None for ref in made[-1]]
        assert alive == [False, False], f"kept terms / scales alive after the backward (retain_graph={retain})"
