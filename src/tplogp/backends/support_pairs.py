"""A call with narrow supports run from its (token, id) pairs alone, forward and backward: no GEMM
over the shard's vocabulary, no ``[V, D]`` fp32 accumulator.

Where a call's supports are narrow (``K`` ids per token, at most :data:`MAX_IDS`) and their union
too wide to gather whole (:func:`tplogp.backends.native_support.chunk_rows`: the token-chunk way
would take it), every source runs it this way (:func:`tplogp.backends.native_support.by_pairs`,
asked by the sources' forwards and by :func:`tplogp.backends.native_support.gathered_backward`).
Forward and backward compute the pairs' logits the same way, in the same token chunks: the same
bits, so ``z - M`` is exact at a row's max and ``1 - p`` does not cancel there.

Rows by size (:func:`pair_rows`): each row's ids packed first, the rows grouped by their count
rounded up to ``BUCKET`` ids (one host read: the groups' sizes), each group run at its own width,
so a ragged support (a sampler's top-p sets) costs its ids, not ``N`` times its widest row; rows
without ids run nothing.

The pairs' logits (:func:`_pair_logits`), per token chunk of ``T`` rows (the gathered weight rows
within the budget's transient part): the weight rows of each row's ids ``W[S_t]`` (``[T, K, D]``),
``z[t, k] = cap(h_t . W[S_t[k]] + b) / T`` in fp32 (one batched product with fp32 accumulation, the
tiles' transform), ``-inf`` on padding.

Forward (:func:`forward_stats`): per row the tiles' statistics over its pairs (one tile of ``K``
columns): ``M = max z``, ``S = sum exp(z - M)``, with entropy ``sum exp(z - M)(z - M)``, the
target's logit (``-inf`` where the shard owns the target but the support does not keep it), the
argmax as the lowest id at the max. Nothing is kept.

Backward (:func:`backward`): per token chunk, the pairs' logits again, then
``dz = -p (c0 + grad_entropy (z - M)) + grad_logp [id = target]``, times the temperature's ``1/T``
and the transform's slope, 0 on padding (the tiles' formula, :mod:`tplogp.backends.native_tiles`),
``d_hidden[t] = sum_k dz[t, k] W[S_t[k]]`` (one batched product, ``dz`` in the weight's dtype as
the fused kernels' d_logits, fp32 accumulation). The pairs' ``(id, token, dz)`` are kept
(``20 N K`` bytes) and sorted by id; their ids' union has ``U`` ids. ``d_W`` then comes one of
three ways, the same values within the GEMMs' rounding:

* on a CUDA device, for the ``triton`` and ``sm90`` sources, one kernel over the ids' runs
  (:func:`_rows_by_kernel`, :mod:`tplogp.kernels.pairs_kernels`): each run's ``dz h[token]``
  summed in fp32 registers, each hidden row read once per pair, each row written once;

* from the union's columns (:func:`_rows_by_columns`, where ``U <= COLUMNS_PER_ID K``): per block
  of union columns, the pairs' ``dz`` (in the weight's dtype) placed in a zeroed ``[N, C]``
  matrix, and the block's rows one GEMM ``dz^T h`` (``2 N C D`` flops, fp32 accumulation),
  written once at their ids;
* from the ids' runs (:func:`_rows_summed`, wider unions): the pairs cut into blocks of whole
  runs of one id (``P D`` fp32 contributions within the transient part; one host read: the
  cuts), each block's ``dz h[token]`` summed per run (``segment_reduce``: no atomics, fp32) and
  written once, rounded once to the weight's dtype, at its id.

Either adds to the caller's fp32 accumulators instead (the fused loss); ``d_b`` is the runs' fp32
sums. Rows no support keeps get 0. The rule's constant, from one profile on an H100 (bf16, ``N =
8192``, ``D = 4096``): the runs' ``d_W`` kernels of ``N K = 524288`` pairs took about 30 ms and the
logits GEMMs over the full 128256 columns about 14 ms, so the columns should cost less while ``U``
is under about ``4000 K`` (the columns' way itself is not yet timed on a GPU).

Cost: about ``22 N K D`` bytes of memory traffic for the backward by runs with 16-bit weights
where torch has fp32-output batched GEMMs (the weight rows gathered, read twice; the hidden rows
gathered; the fp32 contributions written and summed), ``6 N K D + 2 N U D`` bytes and flops by
columns, and ``6 N K D`` for the forward, against the masked way's ``[N, V] x D`` GEMMs (three in
the backward).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch

from ..support import fp32_gemm
from ..support.masked_rows import floored, rescale_max, settle_rows
from . import memory_budget
from .base import ShardCall, ShardGrads, ShardStats, SingleShardOutputs
from .native_tiles import call_logit_transform

MAX_IDS = 64  # the widest support (ids per token) this way takes whatever its rows' sizes
BUCKET = 16  # a group's width: its rows' id counts rounded up to this
# d_W from the union's columns (GEMMs) while the union has at most this many ids per support id
COLUMNS_PER_ID = 4096


def _chunk_rows(source: str, weight: torch.Tensor, call: ShardCall, width: int) -> int:
    """Token rows per chunk of ``width`` ids: their gathered weight rows (and, where the batched
    products upcast them, their fp32 copies) within the call's transient budget."""
    transient = _transient(source, weight, call)
    per_row = width * weight.shape[1] * (
        weight.element_size() + (0 if fp32_gemm.bmm_keeps_dtype(weight) else 4))
    return max(1, transient // max(per_row, 1))


class PairRows(NamedTuple):
    """A support's rows grouped by size (:func:`pair_rows`)."""

    packed: torch.Tensor  # int64 [n, K]: each row's ids first (descending), -1 after
    order: torch.Tensor  # int64 [n]: the rows, by group
    groups: list  # (r0, r1, width): order[r0:r1] hold at most width ids each (width >= 1)

    def pairs(self) -> int:
        """The pairs the groups run (padding included)."""
        return sum((r1 - r0) * width for r0, r1, width in self.groups)


# a weak reference to the last support, its version counter (in-place writes change it) and its
# PairRows
_LAST: list = [None, -1, None]


def pair_rows(support: torch.Tensor) -> PairRows:
    """The rows of ``support`` (int64 ``[n, K]``, ``-1`` for none) grouped by their id count
    rounded up to ``BUCKET`` (module docstring); the last support's kept, so the forward, the
    backward and the way's choice read its sizes once."""
    ref, version, rows = _LAST
    if ref is not None and ref() is support and version == support._version:
        return rows
    n, k = support.shape
    packed = support.sort(dim=1, descending=True).values
    buckets = ((support >= 0).sum(1) + BUCKET - 1) // BUCKET
    order = buckets.argsort(stable=True)
    counts = torch.bincount(buckets, minlength=-(-k // BUCKET) + 1).tolist()  # (one host read)
    groups, r0 = [], counts[0]  # (rows without ids: nothing to run)
    for g, count in enumerate(counts[1:], start=1):
        if count:
            groups.append((r0, r0 + count, min(g * BUCKET, k)))
            r0 += count
    rows = PairRows(packed, order, groups)
    _LAST[:] = [weakref.ref(support), support._version, rows]
    return rows


def _chunks(source: str, weight: torch.Tensor, call: ShardCall):
    """``(row indices, their packed ids [T, width])`` of each token chunk of each group."""
    plan = pair_rows(call.support)
    for r0, r1, width in plan.groups:
        step = _chunk_rows(source, weight, call, width)
        for c0 in range(r0, r1, step):
            idx = plan.order[c0:min(c0 + step, r1)]
            yield idx, plan.packed.index_select(0, idx)[:, :width]


def _pair_logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 ids: torch.Tensor, call: ShardCall, slopes: Optional[list] = None):
    """``(z [T, K] fp32 with -inf on padding, the gathered rows [T, K, D])`` of token rows ``h``
    and their ids (module docstring); ``slopes`` gets the transform's slope appended, where it has
    one."""
    t, k = ids.shape
    safe = ids.clamp(min=0)
    w_rows = weight.index_select(0, safe.view(-1)).view(t, k, weight.shape[1])
    y = fp32_gemm.bmm(w_rows, h.unsqueeze(2)).squeeze(2)
    z = call_logit_transform(y, None if bias is None else bias[safe], call, slopes)
    return z.masked_fill_(ids < 0, float("-inf")), w_rows


def _row_stats(z: torch.Tensor, ids: torch.Tensor, local_target: torch.Tensor, v: int,
               with_entropy: bool, with_argmax: bool) -> tuple:
    """The tiles' statistics of rows' pairs (``z`` fp32 ``[T, K]``, ``-inf`` on padding, their
    shard-local ``ids``, ``-1`` on padding; ``v``: the shard's vocabulary): ``(M, S, target logit,
    sum exp(z - M)(z - M) or None, argmax or None)`` (module docstring)."""
    m = z.amax(1)
    rel = z - rescale_max(m).unsqueeze(1)
    e = torch.exp(rel)
    sum_exp_z = floored(rel).mul_(e).sum(1) if with_entropy else None
    hit = ids == local_target.unsqueeze(1)
    picked = torch.where(hit, z, float("-inf")).amax(1)  # (-inf: owned, not kept)
    argmax = None
    if with_argmax:
        top = (z == m.unsqueeze(1)) & (ids >= 0) & (m > float("-inf")).unsqueeze(1)
        lowest = torch.where(top, ids, v).amin(1)
        argmax = torch.where(lowest < v, lowest, 0).float()
    return m, e.sum(1), torch.where(local_target >= 0, picked, 0.0), sum_exp_z, argmax


def forward_stats(source: str, hidden: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor], local_target: torch.Tensor,
                  call: ShardCall) -> ShardStats:
    """The shard's statistics of a call run from its pairs (module docstring)."""
    n, dev = hidden.shape[0], hidden.device
    # (a row without ids: no logit, S = 0; its target, where the shard owns it, not kept)
    row_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
    sum_exp = torch.zeros_like(row_max)
    target_logit = torch.where(local_target >= 0, float("-inf"), 0.0).float()
    sum_exp_z = torch.zeros_like(row_max) if call.with_entropy else None
    argmax = torch.zeros_like(row_max) if call.with_argmax else None
    for idx, ids in _chunks(source, weight, call):
        lt = local_target.index_select(0, idx)
        z, _ = _pair_logits(hidden.index_select(0, idx), weight, bias, ids, call)
        found = _row_stats(z, ids, lt, weight.shape[0], call.with_entropy, call.with_argmax)
        for out, part in zip((row_max, sum_exp, target_logit, sum_exp_z, argmax), found):
            if out is not None:
                out.index_copy_(0, idx, part)
    return ShardStats(row_max, sum_exp, target_logit, sum_exp_z, None, None, argmax)


def given_stats(local_target: torch.Tensor, v: int, call: ShardCall) -> ShardStats:
    """The shard's statistics of a call whose support came with its logits
    (``ShardCall.support_logits``: the sampler's, :mod:`tplogp.op.sampler_support`): the pairs'
    statistics on those logits, no product computed. Nothing is kept."""
    m, s, target_logit, sum_exp_z, argmax = _row_stats(
        call.support_logits, call.support, local_target, v, call.with_entropy, call.with_argmax)
    return ShardStats(m, s, target_logit, sum_exp_z, None, None, argmax)


def _settled(st: ShardStats, target: torch.Tensor, v: int,
             target_flag: Optional[torch.Tensor]) -> SingleShardOutputs:
    """One shard's outputs from its statistics, settled as the native source settles its tiles'
    (``target`` outside ``[0, v)``: nobody's, NaN logp); a ``target_flag`` (the fused sources'
    in-kernel target check: ``tplogp.backends.base``) gets one such target, as their kernels
    write it, by a copy on the stream."""
    owned = (target >= 0) & (target < v)
    if target_flag is not None and target.numel():
        first_bad = (~owned).to(torch.int32).argmax().view(1)
        target_flag.copy_(torch.where(owned.all(), 0, target.index_select(0, first_bad)),
                          non_blocking=True)
    row_max, log_sum, lse, mean_rel = settle_rows(st.row_max, st.sum_exp, st.sum_exp_z)
    logp = torch.where(owned, (st.target_logit - row_max) - log_sum, float("nan"))
    return SingleShardOutputs(logp, lse, row_max, log_sum, mean_rel,
                              None if mean_rel is None else log_sum - mean_rel, None, None,
                              st.argmax)


def forward_single(source: str, hidden: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor], target: torch.Tensor, call: ShardCall,
                   target_flag: Optional[torch.Tensor] = None) -> SingleShardOutputs:
    """One shard's outputs of a call run from its pairs: :func:`forward_stats`, settled
    (:func:`_settled`)."""
    v = weight.shape[0]
    owned = (target >= 0) & (target < v)
    st = forward_stats(source, hidden, weight, bias, torch.where(owned, target, -1), call)
    return _settled(st, target, v, target_flag)


def given_single(target: torch.Tensor, v: int, call: ShardCall,
                 target_flag: Optional[torch.Tensor] = None) -> SingleShardOutputs:
    """One shard's outputs of a call whose support came with its logits: :func:`given_stats`,
    settled (:func:`_settled`)."""
    owned = (target >= 0) & (target < v)
    return _settled(given_stats(torch.where(owned, target, -1), v, call), target, v, target_flag)


def backward(source: str, hidden: torch.Tensor, weight: torch.Tensor,
             bias: Optional[torch.Tensor], local_target: torch.Tensor, row_max: torch.Tensor,
             log_sum: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: Optional[torch.Tensor],
             grad_lse: Optional[torch.Tensor], mean_rel: Optional[torch.Tensor], call: ShardCall,
             needs: tuple[bool, bool, bool], d_hidden_ready=None,
             accumulate: Optional[tuple] = None) -> ShardGrads:
    """The shard's gradients of a call run from its pairs (module docstring): ``d_hidden`` fp32
    (partial), ``d_weight`` / ``d_bias`` in the weight's / bias's dtype, or added to the caller's
    fp32 accumulators ``accumulate`` (returned)."""
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    n, d = hidden.shape
    v = weight.shape[0]
    # (rows without ids get no gradient)
    d_hidden = torch.zeros(n, d, dtype=torch.float32, device=hidden.device) if need_h else None
    pair_ids, pair_tokens, pair_dz = [], [], []
    for idx, ids in _chunks(source, weight, call):
        slopes: list = []  # (the transform's slope, where it has one)
        z, w_rows = _pair_logits(hidden.index_select(0, idx), weight, bias, ids, call, slopes)
        per_row = [None if t is None else t.index_select(0, idx)
                   for t in (local_target, row_max, log_sum, grad_logp, grad_entropy, grad_lse,
                             mean_rel)]
        dz = _pair_dz(z, ids, *per_row, call, slopes[0] if slopes else None)
        if need_w or need_b:
            pair_ids.append(ids.reshape(-1))
            pair_tokens.append(idx.repeat_interleave(ids.shape[1]))
            pair_dz.append(dz.reshape(-1))
        if need_h:  # (dz in the weight's dtype, as the fused kernels' d_logits)
            d_hidden.index_copy_(0, idx, fp32_gemm.bmm(dz.to(w_rows.dtype).unsqueeze(1),
                                                       w_rows).squeeze(1))
    if d_hidden_ready is not None and d_hidden is not None:
        d_hidden_ready(d_hidden)
    d_w = d_b = None
    if need_w or need_b:
        ids = torch.cat(pair_ids) if pair_ids else hidden.new_zeros(0, dtype=torch.int64)
        ids = torch.where(ids >= 0, ids, v)  # (padding: row v, dz 0)
        order = ids.argsort(stable=True)
        acc_w, acc_b = accumulate if accumulate is not None else (None, None)
        acc_w, acc_b = (acc_w if need_w else None), (acc_b if need_b else None)
        sorted_ids, transient = ids[order], _transient(source, weight, call)
        first = torch.ones_like(sorted_ids, dtype=torch.bool)  # the first pair of each id's run
        first[1:] = sorted_ids[1:] != sorted_ids[:-1]
        run_starts = first.nonzero().squeeze(1)  # (one host read: the union's size)
        dz_all = torch.cat(pair_dz) if pair_dz else hidden.new_zeros(0, dtype=torch.float32)
        tokens_all = torch.cat(pair_tokens) if pair_tokens else ids
        dz_sorted, tokens = dz_all[order], tokens_all[order]
        w_dtype, b_dtype = weight.dtype if need_w else None, bias.dtype if need_b else None
        k = max(1, -(-ids.numel() // max(n, 1)))  # (the pairs per token, on average)
        kernels = row_kernels(source, hidden.device)
        if kernels is not None:
            d_w, d_b = _rows_by_kernel(kernels, sorted_ids, dz_sorted, tokens, hidden, v,
                                       w_dtype, b_dtype, acc_w, acc_b, run_starts)
        elif run_starts.numel() <= COLUMNS_PER_ID * k:  # (module docstring)
            d_w, d_b = _rows_by_columns(sorted_ids, dz_sorted, tokens, hidden, v, w_dtype, b_dtype,
                                        transient, acc_w, acc_b, first, run_starts)
        else:
            d_w, d_b = _rows_summed(sorted_ids, dz_sorted, tokens, hidden, v, w_dtype, b_dtype,
                                    max(1, transient // (8 * d)), acc_w, acc_b)
    return ShardGrads(d_hidden, d_w, d_b)


def _transient(source: str, weight: torch.Tensor, call: ShardCall) -> int:
    return memory_budget.split(source, call.workspace_bytes, weight.device,
                               call.deterministic).transient


def _pair_dz(z, ids, target, row_max, log_sum, grad_logp, grad_entropy, grad_lse, mean_rel,
             call: ShardCall, slope: Optional[torch.Tensor]) -> torch.Tensor:
    """``dz`` of each pair of the token rows (fp32 ``[T, K]``, 0 on padding): the tiles' formula on
    the pairs' logits ``z`` (module docstring)."""
    z = z - row_max.unsqueeze(1)
    c0 = grad_logp.clone()
    if grad_lse is not None:
        c0 -= grad_lse
    p = torch.exp(z - log_sum.unsqueeze(1))
    if grad_entropy is not None:
        c0 -= grad_entropy * mean_rel
        dz = floored(z).mul_(grad_entropy.unsqueeze(1)).add_(c0.unsqueeze(1)).mul_(p).neg_()
    else:
        dz = p.mul_(c0.unsqueeze(1)).neg_()
    dz += torch.where(ids == target.unsqueeze(1), grad_logp.unsqueeze(1), 0.0)
    if call.inv_temperature != 1.0:
        dz *= call.inv_temperature
    if slope is not None:
        dz *= slope
    return dz.masked_fill_(ids < 0, 0.0)


FUSED_SOURCES = ("triton", "sm90")  # the sources whose calls run Triton kernels anyway


def row_kernels(source: str, device: torch.device):
    """:mod:`tplogp.kernels.pairs_launch` where the call runs on a CUDA device on one of the
    Triton sources (:data:`FUSED_SOURCES`), else None (``d_W`` by the union's columns or the ids'
    runs: ``native`` stays torch alone)."""
    if source not in FUSED_SOURCES or device.type != "cuda":
        return None
    from ..kernels import pairs_launch

    return pairs_launch


def _bias_rows(ids: torch.Tensor, dz: torch.Tensor, run_starts: torch.Tensor,
               union: torch.Tensor, v: int, b_dtype: Optional[torch.dtype],
               acc_b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``d_b`` (None without ``b_dtype``): each run's fp32 sum of ``dz`` (the pairs sorted by id,
    runs at ``run_starts``, their ids ``union``), written once at its id, or added to the fp32
    accumulator ``acc_b`` (the padding, id ``v``: 0 added to its last row)."""
    if b_dtype is None:
        return None
    lengths = torch.diff(run_starts, append=run_starts.new_full((1,), ids.numel()))
    sums = torch.segment_reduce(dz, "sum", lengths=lengths, unsafe=True)
    if acc_b is not None:
        return acc_b.index_add_(0, union.clamp(max=v - 1), sums)
    d_b = torch.zeros(v + 1, dtype=b_dtype, device=ids.device)
    return d_b.index_copy_(0, union, sums.to(b_dtype))[:v]


def _rows_by_kernel(kernels, ids: torch.Tensor, dz: torch.Tensor, token: torch.Tensor,
                    hidden: torch.Tensor, v: int, w_dtype: Optional[torch.dtype],
                    b_dtype: Optional[torch.dtype], acc_w: Optional[torch.Tensor],
                    acc_b: Optional[torch.Tensor], run_starts: torch.Tensor
                    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(d_W, d_b)`` as :func:`_rows_summed` gives them, ``d_W``'s rows by one kernel over the
    runs (:mod:`tplogp.kernels.pairs_kernels`: each run's hidden rows read once, each row written
    once); ``d_b`` the runs' fp32 sums. Padding is id ``v``: past the rows (``d_b``: a row past
    the result, or adding 0 to the caller's last row)."""
    union = ids.index_select(0, run_starts)
    d_w, d_b = None, _bias_rows(ids, dz, run_starts, union, v, b_dtype, acc_b)
    if w_dtype is not None:  # (the padding's run, id v, lies past the rows: not written)
        d_w = acc_w if acc_w is not None else torch.zeros(v, hidden.shape[1], dtype=w_dtype,
                                                          device=ids.device)
        starts = torch.cat([run_starts, run_starts.new_full((1,), ids.numel())])
        kernels.pair_rows(starts, union, token, dz.float().contiguous(), hidden, d_w,
                          acc_w is not None)
    return d_w, d_b


def _rows_by_columns(ids: torch.Tensor, dz: torch.Tensor, token: torch.Tensor,
                     hidden: torch.Tensor, v: int, w_dtype: Optional[torch.dtype],
                     b_dtype: Optional[torch.dtype], transient: int,
                     acc_w: Optional[torch.Tensor], acc_b: Optional[torch.Tensor],
                     first: torch.Tensor, run_starts: torch.Tensor
                     ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(d_W, d_b)`` as :func:`_rows_summed` gives them, from the union of the ids (``U``
    columns; ``first`` marks each id's first pair in the sorted ``ids``, at ``run_starts``): per
    block of union columns, the pairs' ``dz`` (in the GEMM's dtype, as the fused kernels' d_logits)
    placed in a zeroed ``[N, C]`` matrix at (token, column), and the block's ``d_W`` rows one GEMM
    ``dz^T h`` with fp32 accumulation, written once at their ids (each id once: no atomics);
    ``d_b`` the runs' fp32 sums of ``dz``. Padding is id ``v``: a row past the result, or adding
    0 to the caller's last row."""
    n, d, dev = hidden.shape[0], hidden.shape[1], ids.device
    union = ids.index_select(0, run_starts)
    u = union.numel()
    d_w, d_b = None, _bias_rows(ids, dz, run_starts, union, v, b_dtype, acc_b)
    if w_dtype is None:
        return d_w, d_b
    column = first.cumsum(0) - 1  # each pair's column in the union
    gemm_dtype = hidden.dtype if dev.type == "cuda" else torch.float32
    h = hidden if hidden.dtype == gemm_dtype else hidden.to(gemm_dtype)
    cols = max(1, transient // (n * torch.finfo(gemm_dtype).bits // 8 + 4 * d))
    starts = torch.arange(0, u + cols, cols, device=dev).clamp(max=u)
    bounds = torch.searchsorted(column, starts).tolist()  # the blocks' pairs (one host read)
    d_w = acc_w if acc_w is not None else torch.zeros(v + 1, d, dtype=w_dtype, device=dev)
    rows = union if acc_w is None else union.clamp(max=v - 1)
    for b, c0 in enumerate(range(0, u, cols)):
        c1, lo, hi = min(c0 + cols, u), bounds[b], bounds[b + 1]
        dense = torch.zeros(n, c1 - c0, dtype=gemm_dtype, device=dev)
        dense[token[lo:hi], column[lo:hi] - c0] = dz[lo:hi].to(gemm_dtype)
        block = fp32_gemm.mm(dense.t(), h)  # [C, D] fp32
        if acc_w is not None:
            d_w.index_add_(0, rows[c0:c1], block)
        else:
            d_w.index_copy_(0, rows[c0:c1], block.to(w_dtype))
    return (d_w if acc_w is not None else d_w[:v]), d_b


def _rows_summed(ids: torch.Tensor, dz: torch.Tensor, token: torch.Tensor, hidden: torch.Tensor,
                 v: int, w_dtype: Optional[torch.dtype], b_dtype: Optional[torch.dtype],
                 block: int, acc_w: Optional[torch.Tensor] = None,
                 acc_b: Optional[torch.Tensor] = None
                 ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(d_W [v, D], d_b [v])`` (each None where its dtype is) from the pairs sorted by id
    (``ids``, ``v`` for padding): per block of whole runs of one id (about ``block`` pairs; one
    host read: the cuts), each run's sums of ``dz h[token]`` and of ``dz`` in fp32, written once
    at its id in ``w_dtype`` / ``b_dtype``, or added to the fp32 accumulators ``acc_w`` /
    ``acc_b`` where given (and returned). No atomics where written: the same bits at every run."""
    pairs, dev = ids.shape[0], ids.device

    def output(acc, dtype, shape):  # the caller's accumulator, else rows made for the result
        return acc if acc is not None else torch.zeros(shape, dtype=dtype, device=dev)

    d_w = None if w_dtype is None else output(acc_w, w_dtype, (v + 1, hidden.shape[1]))
    d_b = None if b_dtype is None else output(acc_b, b_dtype, (v + 1,))
    starts = torch.arange(0, pairs, block, device=dev)
    cuts = torch.searchsorted(ids, ids[starts]).tolist() + [pairs]
    for s, e in zip(cuts[:-1], cuts[1:]):
        if s == e:
            continue
        run_ids = ids[s:e]
        first = torch.ones_like(run_ids, dtype=torch.bool)
        first[1:] = run_ids[1:] != run_ids[:-1]
        run = first.cumsum(0) - 1  # each pair's run, 0 .. (nondecreasing)
        slots = torch.arange(e - s, device=dev)
        begin = torch.searchsorted(run, slots)
        lengths = torch.searchsorted(run, slots, right=True) - begin  # (past the last run: 0)
        at = torch.where(lengths > 0, run_ids[begin.clamp(max=e - s - 1)], v)  # (empty: row v)
        for out, acc, values in ((d_w, acc_w, None), (d_b, acc_b, dz[s:e])):
            if out is None:
                continue
            if values is None:  # d_W: the contributions dz h[token], fp32
                values = torch.mul(hidden.index_select(0, token[s:e]), dz[s:e].unsqueeze(1))
            sums = torch.segment_reduce(values, "sum", lengths=lengths, unsafe=True)
            if acc is None:
                out.index_copy_(0, at, sums.to(out.dtype))
            else:  # (the empty runs' zeros and the padding's to the last row: adding 0)
                out.index_add_(0, at.clamp(max=v - 1), sums)
    if acc_w is None and d_w is not None:
        d_w = d_w[:v]
    if acc_b is None and d_b is not None:
        d_b = d_b[:v]
    return d_w, d_b


__all__ = ["MAX_IDS", "BUCKET", "PairRows", "pair_rows", "forward_stats", "forward_single",
           "given_stats", "given_single", "backward"]
