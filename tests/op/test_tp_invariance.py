"""``deterministic="tp_invariant"``: logp, entropy, lse, the fused loss (one chunk, and several
chunks summed in fp32 accumulators) and the weight / bias gradient rows with the same bits at every
TP degree as at TP=1, for shards that cut the grid's blocks (uneven, prime vocabularies), on the
native source and on the triton and sm90 kernels in Triton's interpreter; and the re-shard's
bookkeeping."""

from __future__ import annotations

import pytest
import torch

import tplogp
from tests.support import tolerances as tol
from tests.support.interpreter import INTERPRETING, KERNELS
from tplogp import LinearLogpInputError, losses
from tplogp.support import invariant
from tplogp.api import linear_logp_on
from tplogp.backends.base import BlockStats
from tplogp.support.shards import even_boundaries, uneven_boundaries
from tplogp.tolerances import rel_error

LEVEL = invariant.LEVEL
CPU = torch.device("cpu")
# 14 tokens as [2, 7]; D = 24 (not a multiple of the interpreter's BLOCK_D of 32); prime
# vocabularies of 3 grid
# blocks (128 columns: native's, and the interpreter's split): uneven shards of 2, 3 and 4 ranks cut
# blocks, and at 4 ranks the second rank starts no block (its rows all travel).
LEAD, D = (2, 7), 24
VOCAB = {"native": 331, "triton": 263, "sm90-kernels": 263}
# bf16 on the sm90 kernels: the low-precision path (d_W rows rounded once per grid block)
DTYPE = {"native": torch.float32, "triton": torch.float32, "sm90-kernels": torch.bfloat16}


def _source(name: str):
    """The source: native by name, the Triton kernels as backend objects (the sm90 kernels through
    their launchers, :data:`tests.support.interpreter.KERNELS`)."""
    return "native" if name == "native" else KERNELS[name]()


def _problem(v: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(7)
    n = LEAD[0] * LEAD[1]
    hidden = torch.randn(n, D, generator=g).reshape(*LEAD, D)
    weight = torch.randn(v, D, generator=g) / D ** 0.5
    bias = torch.randn(v, generator=g) * 0.1
    target = torch.randint(0, v, (n,), generator=g)
    target[::5] = -100
    grads = [torch.randn(n, generator=g).reshape(LEAD) for _ in range(3)]
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), target.reshape(LEAD), grads


def _logp_run(source, hidden, weight, bias, target, grads, **kw):
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    out = linear_logp_on(source, h, w, target, b, options=tplogp.op.plan.LogpOptions(
        temperature=0.7, return_entropy=True, return_lse=True, ignore_index=-100,
        deterministic=LEVEL), **kw)
    sum(o * g for o, g in zip(out, grads)).sum().backward()
    return [o.detach() for o in out], h.grad, w.grad, b.grad


def _loss_run(source, hidden, weight, bias, target, **kw):
    w, b = (t.clone().requires_grad_() for t in (weight, bias))
    value = tplogp.linear_logp_loss(hidden, w, target, b,
                                    loss=losses.cross_entropy() + losses.entropy_bonus(0.01),
                                    ignore_index=-100, deterministic=LEVEL, source=source, **kw)
    value.backward()
    return value.detach(), w.grad, b.grad


@pytest.mark.tp(world_size=[2, 3, 4], timeout=300)
def test_native_bitwise_equal_to_one_shard(tp):
    """Every rank runs the call on its uneven shard and once more on the whole vocabulary without a
    group (TP=1): logp, entropy, lse and its weight / bias gradient rows are equal bit for bit, and
    so are the fused loss's value and gradient rows; hidden.grad is close (its all-reduce sums fp32
    partials) and equal from run to run."""
    _check_bitwise(tp, "native")


# The interpreter is slow: 3 ranks (each cuts a grid block; the first ranks' last blocks take rows
# from the next).
@pytest.mark.tp(world_size=3, timeout=300)
@pytest.mark.parametrize("name", ["triton", "sm90-kernels"])
def test_kernels_bitwise_equal_to_one_shard(tp, name):
    """As the native test, for the triton and sm90 kernels in Triton's interpreter."""
    tp.skip_if(not INTERPRETING, "the Triton kernels run here in the interpreter (GPU: tests/gpu)")
    _check_bitwise(tp, name)


def _check_bitwise(tp, name: str) -> None:
    source = _source(name)
    v = VOCAB[name]
    hidden, weight, bias, target, grads = _problem(v, DTYPE[name])
    bounds = uneven_boundaries(v, tp.world_size)
    s, e = bounds[tp.rank], bounds[tp.rank + 1]
    kw = dict(tp_group=tp.group, vocab_start_index=s, global_vocab_size=v)
    outs, dh, dw, db = _logp_run(source, hidden, weight[s:e], bias[s:e], target, grads, **kw)
    ref, ref_dh, ref_dw, ref_db = _logp_run(source, hidden, weight, bias, target, grads)
    bad = [n for n, a, r in zip(("logp", "entropy", "lse"), outs, ref) if not torch.equal(a, r)]
    bad += [n for n, a, r in (("weight.grad", dw, ref_dw[s:e]), ("bias.grad", db, ref_db[s:e]))
            if not torch.equal(a, r)]
    tp.assert_all(not bad, f"rank {tp.rank} [{s}, {e}): not bitwise equal to TP=1: {bad}")
    # the same fp32 math summed in another order (bf16: then rounded once to the weight dtype)
    bound = tol.REL_FP32_SAME_MATH if DTYPE[name] == torch.float32 else tol.REL_16BIT_ROUNDING_FLIPS
    tp.assert_all(rel_error(dh, ref_dh) <= bound,
                  f"hidden.grad off by {rel_error(dh, ref_dh):.2e} (relative)")
    again = _logp_run(source, hidden, weight[s:e], bias[s:e], target, grads, **kw)[1]
    tp.assert_all(torch.equal(again, dh), "hidden.grad differs from run to run")

    # one chunk (the default budget), then chunks of 5 tokens: d_W / d_b summed over them in fp32
    # accumulators
    chunked = tplogp.loss_chunk_budget(5, D, v, dtype=weight.dtype, bias_dtype=bias.dtype,
                                       source=source, device=CPU)
    for budget in (None, chunked):
        loss, lw, lb = _loss_run(source, hidden, weight[s:e], bias[s:e], target,
                                 workspace_bytes=budget, **kw)
        ref_loss, ref_lw, ref_lb = _loss_run(source, hidden, weight, bias, target,
                                             workspace_bytes=budget)
        tp.assert_all(torch.equal(loss, ref_loss),
                      f"fused loss {loss.item()!r} vs TP=1 {ref_loss.item()!r} "
                                                   f"(workspace_bytes={budget})")
        tp.assert_all(torch.equal(lw, ref_lw[s:e]) and torch.equal(lb, ref_lb[s:e]),
                      f"fused loss: weight / bias gradient rows differ from TP=1 (workspace_bytes={budget})")


@pytest.mark.tp(world_size=2)
def test_shard_ranges_come_from_the_group_record(tp):
    """With a group the re-shard takes every rank's range from the call's group record
    (``plan.Call.shard_ranges``) and exchanges no boundaries of its own, in ``linear_logp`` and in
    the fused loss."""
    from unittest import mock

    v = VOCAB["native"]
    hidden, weight, bias, target, grads = _problem(v)
    bounds = uneven_boundaries(v, tp.world_size)
    s, e = bounds[tp.rank], bounds[tp.rank + 1]
    kw = dict(tp_group=tp.group, vocab_start_index=s, global_vocab_size=v)
    with mock.patch.object(invariant, "shard_bounds", wraps=invariant.shard_bounds) as exchange:
        _logp_run("native", hidden, weight[s:e], bias[s:e], target, grads, **kw)
        _loss_run("native", hidden, weight[s:e], bias[s:e], target, **kw)
    tp.assert_all(exchange.call_count == 0,
                  f"{exchange.call_count} exchange(s) of the shard boundaries")


# The model options: softcap and temperature, the argmax with ties forced across shards, and a loss
# that reads the sum of the logits (label smoothing) and the lse (z-loss). Ties per vocabulary:
# (row, lower id, higher id), the rows' hidden and the two weight rows the same small integers
# (exact dot products), the bias the same: the two logits are equal bit for bit. The lower ids are
# foreign rows at 3 ranks (computed by the rank before their owner: 60, 50, 150), the higher ones on
# a later rank at every TP degree.
TIES = {331: ((1, 60, 328), (8, 150, 260)), 263: ((1, 50, 250), (8, 150, 200))}
SOFTCAP = 8.0


def _options_problem(v: int, dtype: torch.dtype = torch.float32):
    hidden, weight, bias, target, grads = _problem(v)
    g = torch.Generator().manual_seed(11)
    flat = hidden.view(-1, D)
    for row, lo, hi in TIES[v]:
        flat[row] = torch.randint(-1, 2, (D,), generator=g).float()
        weight[lo] = weight[hi] = flat[row]
        bias[lo] = bias[hi] = 0.25
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), target, grads


def _options_logp_run(source, hidden, weight, bias, target, grads, deterministic=LEVEL, **kw):
    """(logp, entropy, lse, argmax), weight.grad, bias.grad with the softcap, the temperature and
    the argmax."""
    w, b = (t.clone().requires_grad_() for t in (weight, bias))
    out = linear_logp_on(source, hidden, w, target, b, options=tplogp.op.plan.LogpOptions(
        temperature=0.7, softcap=SOFTCAP, return_entropy=True, return_lse=True, return_argmax=True,
        ignore_index=-100, deterministic=deterministic), **kw)
    sum(o * g for o, g in zip(out[:3], grads)).sum().backward()
    return [o.detach() for o in out], w.grad, b.grad


def _options_loss_run(source, hidden, weight, bias, target, deterministic=LEVEL, **kw):
    w, b = (t.clone().requires_grad_() for t in (weight, bias))
    value = tplogp.linear_logp_loss(hidden, w, target, b,
                                    loss=losses.cross_entropy(label_smoothing=0.1) + losses.z_loss(1e-3),
                                    temperature=0.7, softcap=SOFTCAP, ignore_index=-100,
                                    with_entropy=False, deterministic=deterministic, source=source,
                                    **kw)
    value.backward()
    return value.detach(), w.grad, b.grad


@pytest.mark.tp(world_size=[2, 3, 4], timeout=300)
def test_native_model_options_bitwise_equal_to_one_shard(tp):
    """With softcap and temperature: logp, entropy, lse, the argmax (ties across shards -> the
    lowest id) and the weight / bias gradient rows equal TP=1 bit for bit, and so do the value and
    gradient rows of a fused label-smoothed cross-entropy plus z-loss (the sum of the logits merged
    in fixed point)."""
    _check_options_bitwise(tp, "native")


@pytest.mark.tp(world_size=3, timeout=300)
def test_triton_model_options_bitwise_equal_to_one_shard(tp):
    """As the native test, for the triton kernels in Triton's interpreter."""
    tp.skip_if(not INTERPRETING, "the Triton kernels run here in the interpreter (GPU: tests/gpu)")
    _check_options_bitwise(tp, "triton")


def _check_options_bitwise(tp, name: str) -> None:
    source = _source(name)
    v = VOCAB[name]
    hidden, weight, bias, target, grads = _options_problem(v)
    bounds = uneven_boundaries(v, tp.world_size)
    s, e = bounds[tp.rank], bounds[tp.rank + 1]
    kw = dict(tp_group=tp.group, vocab_start_index=s, global_vocab_size=v)
    outs, dw, db = _options_logp_run(source, hidden, weight[s:e], bias[s:e], target, grads, **kw)
    ref, ref_dw, ref_db = _options_logp_run(source, hidden, weight, bias, target, grads)
    bad = [n for n, a,
           r in zip(("logp", "entropy", "lse", "argmax"), outs, ref) if not torch.equal(a, r)]
    bad += [n for n, a, r in (("weight.grad", dw, ref_dw[s:e]), ("bias.grad", db, ref_db[s:e]))
            if not torch.equal(a, r)]
    tp.assert_all(not bad, f"rank {tp.rank} [{s}, {e}): not bitwise equal to TP=1: {bad}")
    argmax = outs[3].view(-1)
    ties = [(row, int(argmax[row]), lo) for row, lo, _ in TIES[v] if int(argmax[row]) != lo]
    tp.assert_all(not ties, f"tied rows' argmax (row, got, lowest id): {ties}")

    loss, lw, lb = _options_loss_run(source, hidden, weight[s:e], bias[s:e], target, **kw)
    ref_loss, ref_lw, ref_lb = _options_loss_run(source, hidden, weight, bias, target)
    tp.assert_all(torch.equal(loss, ref_loss),
                  f"fused loss {loss.item()!r} vs TP=1 {ref_loss.item()!r}")
    tp.assert_all(torch.equal(lw, ref_lw[s:e]) and torch.equal(lb, ref_lb[s:e]),
                  "fused loss: weight / bias gradient rows differ from TP=1")
    # the same function as native's (which test_model_options_close_to_the_default checks)
    if name != "native":
        native = _options_logp_run("native", hidden, weight, bias, target, grads)
        native_loss = _options_loss_run("native", hidden, weight, bias, target)
        ours = [*ref[:3], ref_dw, ref_db, ref_loss, ref_lw, ref_lb]
        theirs = [*native[0][:3], *native[1:], *native_loss]
        off = [rel_error(a, r) for a,
               r in zip(ours, theirs) if rel_error(a, r) > tol.REL_FP32_SAME_MATH]
        tp.assert_all(not off and torch.equal(ref[3], native[0][3]), f"TP=1 off native's by {off}")


def test_model_options_close_to_the_default():
    """With the model options the level computes the default path's function: outputs, argmax (ties
    included) and gradients within fp32 tolerances, and the label-smoothed, z-lossed fused loss
    too."""
    hidden, weight, bias, target, grads = _options_problem(VOCAB["native"])
    ours, base = (_options_logp_run("native", hidden, weight, bias, target, grads,
                                    deterministic=det)
                  for det in (LEVEL, False))
    assert torch.equal(ours[0][3], base[0][3])
    for a, r in zip(ours[0][:3] + list(ours[1:]), base[0][:3] + list(base[1:])):
        assert rel_error(a, r) <= tol.REL_FP32_SAME_MATH, rel_error(a, r)
    ours, base = (_options_loss_run("native", hidden, weight, bias, target, deterministic=det)
                  for det in (LEVEL, False))
    for a, r in zip(ours, base):
        assert rel_error(a, r) <= tol.REL_FP32_SAME_MATH, rel_error(a, r)


def test_close_to_the_default_and_even_shards_agree():
    """The invariant level computes the same function: close to the default path (fp32 tolerances),
    and a call on the whole vocabulary gives the same bits whatever the row count of the other rows
    (batch invariance)."""
    hidden, weight, bias, target, grads = _problem(VOCAB["native"])
    ours = _logp_run("native", hidden, weight, bias, target, grads)
    opts = tplogp.op.plan.LogpOptions(temperature=0.7, return_entropy=True, return_lse=True,
                                      ignore_index=-100)
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    base = linear_logp_on("native", h, w, target, b, options=opts)
    sum(o * g for o, g in zip(base, grads)).sum().backward()
    for a, r in zip(ours[0], base):
        assert rel_error(a, r) <= tol.REL_FP32_SAME_MATH, rel_error(a, r)
    for a, r in ((ours[1], h.grad), (ours[2], w.grad), (ours[3], b.grad)):
        assert rel_error(a, r) <= tol.REL_FP32_SAME_MATH, rel_error(a, r)
    head = linear_logp_on("native", hidden[:1], weight, target[:1], bias,
                          options=tplogp.op.plan.LogpOptions(
        temperature=0.7, return_entropy=True, return_lse=True, ignore_index=-100,
        deterministic=LEVEL))
    for a, r in zip(head, ours[0]):
        assert torch.equal(a, r[:1])


# Boundaries chosen to stress the bookkeeping: even and uneven cuts, ranks smaller than a block,
# ranks that start no block, a rank ending exactly on the grid, and a vocabulary whose last block is
# cut.
BOUNDS = [even_boundaries(331, 4), uneven_boundaries(331, 4), [0, 3, 5, 64, 70, 200, 331],
          [0, 128, 130, 331], [0, 1, 2, 3, 331]]


@pytest.mark.parametrize("bounds", BOUNDS, ids=["even4", "uneven4", "tiny", "aligned", "ones"])
def test_regrid_moves_every_row_once(bounds):
    """Simulated exchange over every rank's :class:`~tplogp.support.invariant.Regrid`: each rank's
    rows ``[lo, hi)`` are the global rows, the grid ranges tile the vocabulary, and the gradients
    sent back land on their owners' rows."""
    v, cols = bounds[-1], 64
    ranges = list(zip(bounds, bounds[1:]))
    grids = [invariant.Regrid(None, None, r, ranges, cols, v) for r in range(len(ranges))]
    rows = torch.arange(v)
    heads = [rows[a: a + g.head] for (a, _), g in zip(ranges, grids)]
    covered = []
    for g in grids:
        assert g.lo % cols == 0 or g.lo == g.hi
        mine = torch.cat([rows[g.start + g.head: g.end]] + [heads[k][:n] for k, n in g.takes])
        assert torch.equal(mine, torch.arange(g.lo, g.hi)), (g.rank, g.lo, g.hi)
        covered.append(mine)
    assert torch.equal(torch.cat(covered), rows)
    tails = [torch.arange(g.lo, g.hi)[max(0, g.end - g.lo):] for g in grids]
    for g in grids:
        back = torch.arange(g.lo, g.hi)[: max(0, g.end - g.lo)]
        if g.head_source is not None:
            j, offset = g.head_source
            back = torch.cat([tails[j][offset: offset + g.head], back])
        assert torch.equal(back, torch.arange(g.start, g.end))


def test_fixed_point_sum_is_exact_in_any_order():
    """The int64 sum of the fixed-point shares has one value for every order and grouping (what
    makes the merge independent of the rank count); the conversion's error stays below its bound."""
    g = torch.Generator().manual_seed(3)
    shares = torch.rand(1000, generator=g) * 64
    fixed = invariant.to_fixed(shares)
    perm = torch.randperm(1000, generator=g)
    assert fixed.sum() == fixed[perm].sum() == sum(fixed[i: i + 7].sum() for i in range(0, 1000, 7))
    exact = shares.double().sum()
    assert abs(float(invariant.from_fixed(fixed.sum())) - exact) <= 1e-7 * exact


def _merged(block_max, argmax=None, sum_z=None, columns: int = 64):
    """:func:`~tplogp.support.invariant.merge_blocks` of made-up block stats ``[blocks, N]`` on one
    shard."""
    blocks, n = block_max.shape
    stats = BlockStats(block_max, torch.ones_like(block_max), torch.zeros(n), None, sum_z, argmax)
    regrid = invariant.Regrid(None, None, 0, [(0, blocks * columns)], columns, blocks * columns)
    return invariant.merge_blocks(stats, torch.ones(n, dtype=torch.bool), regrid, False,
                                  sum_z is not None, argmax is not None)


def test_merge_finds_the_max_and_its_lowest_id():
    """The max's int64 key orders negative maxima, -inf and signed zeros like the floats: the merge
    gives the largest max and, among the blocks reaching it, the lowest id (each block's column: its
    id within the block plus 64 per block before it)."""
    inf = float("inf")
    block_max = torch.tensor([[-3.0, -0.0, -inf, 2.5, -1e-30],
                              [-1.0, 0.0, -inf, 2.5, -1e-30],
                              [-1.0, -2.0, -7.0, 1.0, -1e-20]])
    local = torch.tensor([[5.0, 9.0, 0.0, 63.0, 1.0],
                          [4.0, 3.0, 0.0, 0.0, 0.0],
                          [1.0, 0.0, 2.0, 1.0, 7.0]])
    big_m, *_, argmax = _merged(block_max, argmax=local + 64 * torch.arange(3.0).unsqueeze(1))
    assert torch.equal(big_m, torch.tensor([-1.0, 0.0, -7.0, 2.5, -1e-30]))
    assert torch.equal(argmax, torch.tensor([68.0, 9.0, 130.0, 63.0, 1.0]))


def test_sum_of_logits_fixed_point_bound():
    """The blocks' sums of z in per-row scaled fixed point: one value for any order of the blocks,
    within the stated bound ``R 2^(2c - 62)`` (``R``: the row's largest |block sum|; at most ``2^c``
    blocks) of the exact sum plus the result's fp32 rounding, where the fp32 sum of the blocks would
    be off by far more (a row whose block sums cancel), and NaN for a row with a non-finite block
    sum."""
    g = torch.Generator().manual_seed(5)
    blocks, c = 1000, 10
    sums = torch.randn(blocks, 5, generator=g)
    sums[:, 0] *= 1e4
    sums[500:, 1] = -sums[:500, 0] + 1e-3 * sums[500:, 1]  # cancels down to ~0.03, R ~ 4e4
    sums[:500, 1] = sums[:500, 0]
    sums[:, 2] *= torch.logspace(-30, 30, blocks)  # a 60-decade spread
    sums[0, 3] = 3e38  # near fp32's largest
    sums[:, 4] = 0.0
    sums[7, 4] = float("inf")
    sum_z = _merged(torch.zeros(blocks, 5), sum_z=sums)[6]
    again = _merged(torch.zeros(blocks, 5), sum_z=sums[torch.randperm(blocks, generator=g)])[6]
    assert torch.equal(sum_z[:4], again[:4]) and sum_z[4].isnan() and again[4].isnan()
    exact = sums[:, :4].double().sum(0)
    bound = sums[:, :4].abs().amax(0).double() * 2.0 ** (2 * c - 62)
    rounding = torch.finfo(torch.float32).eps * exact.abs()
    assert ((sum_z[:4].double() - exact).abs() <= bound + rounding).all(), (sum_z[:4].double() - exact, bound)
    # the fp32 sum: no such bound
    assert (sums[:, 1].sum() - exact[1]).abs() > 1e3 * (bound[1] + rounding[1])


def test_level_is_checked():
    hidden, weight, bias, target, _ = _problem(VOCAB["native"])
    with pytest.raises(LinearLogpInputError, match="deterministic must be"):
        tplogp.linear_logp(hidden, weight, target, deterministic="tp")
    with pytest.raises(LinearLogpInputError, match="below 8388608"):
        tplogp.linear_logp(hidden, weight, target, deterministic=LEVEL, global_vocab_size=1 << 23)
