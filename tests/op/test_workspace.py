"""``workspace_bytes`` as a memory-for-speed dial (native source): tiles up to the default tile
budget, the rest keeps tiles' softmax terms (16-bit for 16-bit inputs) with their row scales for the
backward. Every budget gives the default's values bit for bit and its gradients within the tolerance
table (fp32: the table's eps; 16-bit: the eager reference's error, three-way against float64); the
backward runs one recompute GEMM per tile not kept."""

from __future__ import annotations

import pytest
import torch

import tplogp
from tests.support.problems import make_problem, run_op, run_reference
from tplogp import get_op
from tplogp.backends import memory_budget
from tplogp.backends import native, native_tiles
from tplogp.tolerances import ERROR_SLACK, assert_no_worse, rel_error, slack_bound

TILE_BYTES = 8 << 10  # a small default tile budget, so that small problems have many tiles


@pytest.fixture
def small_tiles(monkeypatch):
    small = memory_budget.SourceBudget(TILE_BYTES, TILE_BYTES, keeps_whole=False)
    monkeypatch.setitem(memory_budget.SOURCE_BUDGETS, "native", small)
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)


def _count_gemms(monkeypatch):
    """Count the native source's logits GEMMs, the forward's and the backward's recomputes
    (``monkeypatch``: a fixture or a ``monkeypatch.context()``)."""
    calls = {"logits": 0}
    real = native_tiles._logits_tile  # (every logits tile of the source is made there)

    def logits_tile(*args, **kw):
        calls["logits"] += 1
        return real(*args, **kw)

    monkeypatch.setattr(native_tiles, "_logits_tile", logits_tile)
    return calls


def _plan(p, budget, deterministic=False):
    n, v = p.target.numel(), p.weight.shape[0]
    low_cpu = p.hidden.dtype != torch.float32
    tc, vc = native.plan_chunks(n, v, p.hidden.shape[-1], TILE_BYTES, deterministic, low_cpu,
                                dw_tile=low_cpu)
    tiles = -(-n // tc) * -(-v // vc)
    return tiles, native.kept_tiles(n, v, tc, vc, max(0, budget - TILE_BYTES), deterministic,
                                    native.kept_dtype(p.hidden.dtype).itemsize)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("deterministic", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["default", "deterministic"])
def test_every_budget_gives_the_default_results(small_tiles, monkeypatch, dtype, deterministic):
    p = make_problem((5, 13), 24, 211, dtype, True, seed=8, peaked=True)
    op = get_op("linear_logp", source="native")
    kw = dict(entropy=True, lse=True, temperature=0.8, deterministic=deterministic)
    default = run_op(op, p, **kw)
    n, v = p.target.numel(), p.weight.shape[0]
    full_logits = (-(-n // native.DETERMINISTIC_TOKEN_CHUNK) * native.DETERMINISTIC_TOKEN_CHUNK
                   if deterministic else n) * v * 4
    truth = run_reference(p, "float64", temperature=0.8, entropy=True, lse=True)
    ref = run_reference(p, "matching", temperature=0.8, entropy=True, lse=True)
    tiles = None
    for extra in (0, 4 * v * 4, full_logits // 4, full_logits // 2, 4 * full_logits):
        budget = TILE_BYTES + extra
        tiles, (kept, kept_words) = _plan(p, budget, deterministic)
        assert kept_words * 4 <= extra
        with monkeypatch.context() as m:  # the count for this budget only
            calls = _count_gemms(m)
            ours = run_op(op, p, workspace_bytes=budget, **kw)
        # forward: one GEMM per tile; backward: one per tile not kept
        assert calls["logits"] == 2 * tiles - kept, (extra, tiles, kept, calls)
        for name in ("logp", "entropy", "lse"):
            assert torch.equal(getattr(ours, name), getattr(default, name)), (name, extra)
        for name in ("d_hidden", "d_weight", "d_bias"):
            _within_table(name, getattr(ours, name), getattr(default, name), getattr(ref, name),
                          getattr(truth, name), dtype)
    # all kept at the top; 16-bit terms take about half of fp32 logits' bytes (plus the scales of
    # these small tiles)
    all_kept, words = _plan(p, TILE_BYTES + 4 * full_logits, deterministic)[1]
    assert tiles > 1 and all_kept == tiles
    share, rows = (1.0 if dtype == torch.float32 else 0.5), full_logits // (4 * v)
    assert share * full_logits <= words * 4 <= share * full_logits + tiles * 16 + 4 * rows * tiles


def _within_table(name, ours, default, ref, truth, dtype):
    """A gradient of a budget that keeps terms against the default's: within fp32's eps, or (16-bit)
    no worse than the eager reference against float64 and within that reference's error of the
    default."""
    if dtype == torch.float32:
        assert rel_error(ours, default) <= ERROR_SLACK[torch.float32].eps, (name, rel_error(ours, default))
        return
    assert_no_worse(name, ours, ref, truth, dtype)
    assert rel_error(ours, default) <= slack_bound(rel_error(ref, truth), dtype), (name, rel_error(ours, default))


def test_kept_logits_survive_a_repeated_backward(small_tiles):
    p = make_problem((40,), 16, 97, torch.float32, False, seed=2)
    op = get_op("linear_logp", source="native")
    h = p.hidden.clone().requires_grad_()
    out = op(h, p.weight, p.target, workspace_bytes=1 << 20)
    (out * p.g_logp).sum().backward(retain_graph=True)
    first = h.grad.clone()
    (out * p.g_logp).sum().backward()
    # the kept terms are read, not overwritten
    torch.testing.assert_close(h.grad, 2 * first, rtol=0, atol=0)


def test_nothing_is_kept_without_a_backward(small_tiles):
    p = make_problem((40,), 16, 97, torch.float32, False, seed=2)
    be = native.NativeBackend()
    from tplogp.backends.base import ShardCall

    t = p.target
    scoring = be.forward_stats(p.hidden, p.weight, None, t, ShardCall(workspace_bytes=1 << 20))
    training = be.forward_stats(p.hidden, p.weight, None, t,
                                ShardCall(workspace_bytes=1 << 20, for_backward=True))
    assert scoring.kept is None and training.kept is not None
    assert training.kept.numel() * 4 <= (1 << 20) - TILE_BYTES


@pytest.mark.tp(world_size=4, timeout=300)
def test_budgets_on_uneven_ranks(tp):
    """4 uneven gloo ranks: a budget that keeps every tile gives the default's values bit for bit
    and its gradients within the fp32 eps on every rank."""
    from pytest_tplogp import VocabShards

    vs = VocabShards("uneven", tp.world_size, vocab_size=301).__tp_bind__(tp)
    p = make_problem((3, 17), 20, 301, torch.float32, True, seed=6)
    p.weight, p.bias = vs.shard(p.weight).clone(), vs.shard(p.bias).clone()
    op = get_op("linear_logp", source="native")
    kw = dict(tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=301, entropy=True)
    default = run_op(op, p, **kw)
    kept = run_op(op, p,
                  workspace_bytes=tplogp.keep_logits_budget(51, vs.end - vs.start, source="native",
                                                                    device="cpu",
                                                                    dtype=torch.float32), **kw)
    for name in ("logp", "entropy"):
        tp.assert_all(torch.equal(getattr(kept, name), getattr(default, name)), name)
    for name in ("d_hidden", "d_weight", "d_bias"):
        tp.assert_all(rel_error(getattr(kept, name), getattr(default, name)) <= ERROR_SLACK[torch.float32].eps, name)


def test_low_precision_d_weight_needs_no_full_size_fp32_buffer(small_tiles):
    """A 16-bit d_W is summed per vocab tile in an fp32 tile buffer (within the tile budget) and
    rounded once: no fp32 tensor of d_W's size is made, however many token chunks; the result is no
    worse than the eager reference (tolerance table)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.support.problems import run_reference
    from tplogp.tolerances import assert_no_worse

    # d_hidden (fp32) smaller than d_W
    p = make_problem((150,), 24, 211, torch.bfloat16, True, seed=4)
    v, d = p.weight.shape
    big = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= v * d:
                    big.append((str(func), tuple(t.shape)))
            return out

    n, low_cpu = p.target.numel(), True
    tc, vc = native.plan_chunks(n, v, d, TILE_BYTES, False, low_cpu, dw_tile=True)
    assert -(-n // tc) > 1 and -(-v // vc) > 1  # several token chunks and vocab tiles
    with Sizes():
        ours = run_op(get_op("linear_logp", source="native"), p)
    assert not big, big
    ref, truth = run_reference(p, "matching"), run_reference(p, "float64")
    assert ours.d_weight.dtype == torch.bfloat16
    assert_no_worse("d_weight", ours.d_weight, ref.d_weight, truth.d_weight, torch.bfloat16)
