"""A call with narrow supports run from its (token, id) pairs alone, forward and backward: no GEMM
over the shard's vocabulary, no ``[V, D]`` fp32 accumulator.

Where a call's supports are narrow (``K`` ids per token, at most :data:`MAX_IDS`) and their union
too wide to gather whole (:func:`tplogp.backends.native_support.chunk_rows`: the token-chunk way
would take it), every source runs it this way (:func:`tplogp.backends.native_support.by_pairs`,
asked by the sources' forwards and by :func:`tplogp.backends.native_support.gathered_backward`).
Forward and backward compute the pairs' logits the same way, in the same token chunks: the same
bits, so ``z - M`` is exact at a row's max and ``1 - p`` does not cancel there.

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
and the softcap's slope, 0 on padding (the tiles' formula, :mod:`tplogp.backends.native_tiles`),
``d_hidden[t] = sum_k dz[t, k] W[S_t[k]]`` (one batched product, ``dz`` in the weight's dtype as
the fused kernels' d_logits, fp32 accumulation). The pairs' ``(id, token, dz)`` are kept
(``20 N K`` bytes). Then ``d_W`` row by row: the pairs sorted by id, cut into blocks of whole runs
of one id (``P D`` fp32 contributions within the transient part; one host read: the cuts), each
block's ``dz h[token]`` summed per run (``segment_reduce``: no atomics, fp32) and written once,
rounded once to the weight's dtype, at its id (or added to the caller's fp32 accumulators: the
fused loss); ``d_b`` likewise. Rows no support keeps get 0.

Cost: about ``22 N K D`` bytes of memory traffic for the backward with 16-bit weights where torch
has fp32-output batched GEMMs (the weight rows gathered, read twice; the hidden rows gathered; the
fp32 contributions written and summed) and ``6 N K D`` for the forward, against the masked way's
``[N, V] x D`` GEMMs (three in the backward): at ``N K = 524288`` (8192 tokens, 64 ids) and
``D = 4096``, 47 GB and 13 GB.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..support import fp32_gemm
from ..support.masked_rows import floored, rescale_max, settle_rows
from . import memory_budget
from .base import ShardCall, ShardGrads, ShardStats, SingleShardOutputs
from .native_tiles import logit_transform

MAX_IDS = 64  # the widest support (ids per token) this way takes


def _chunk_rows(source: str, weight: torch.Tensor, call: ShardCall) -> int:
    """Token rows per chunk: their gathered weight rows (and, where the batched products upcast
    them, their fp32 copies) within the call's transient budget."""
    transient = _transient(source, weight, call)
    per_row = call.support.shape[1] * weight.shape[1] * (
        weight.element_size() + (0 if fp32_gemm.bmm_keeps_dtype(weight) else 4))
    return max(1, transient // max(per_row, 1))


def _pair_logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 ids: torch.Tensor, call: ShardCall, slopes: Optional[list] = None):
    """``(z [T, K] fp32 with -inf on padding, the gathered rows [T, K, D])`` of token rows ``h``
    and their ids (module docstring); with a softcap, ``slopes`` gets the slope appended."""
    t, k = ids.shape
    safe = ids.clamp(min=0)
    w_rows = weight.index_select(0, safe.view(-1)).view(t, k, weight.shape[1])
    y = fp32_gemm.bmm(w_rows, h.unsqueeze(2)).squeeze(2)
    z = logit_transform(y, None if bias is None else bias[safe], call.inv_temperature,
                        call.softcap, slopes)
    return z.masked_fill_(ids < 0, float("-inf")), w_rows


def forward_stats(source: str, hidden: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor], local_target: torch.Tensor,
                  call: ShardCall) -> ShardStats:
    """The shard's statistics of a call run from its pairs (module docstring)."""
    n, dev = hidden.shape[0], hidden.device
    row_max = torch.empty(n, dtype=torch.float32, device=dev)
    sum_exp = torch.empty_like(row_max)
    target_logit = torch.empty_like(row_max)
    sum_exp_z = torch.empty_like(row_max) if call.with_entropy else None
    argmax = torch.empty_like(row_max) if call.with_argmax else None
    rows = _chunk_rows(source, weight, call)
    for t0 in range(0, n, rows):
        t1 = min(t0 + rows, n)
        ids, lt = call.support[t0:t1], local_target[t0:t1]
        z, _ = _pair_logits(hidden[t0:t1], weight, bias, ids, call)
        m = z.amax(1)
        rel = z - rescale_max(m).unsqueeze(1)
        e = torch.exp(rel)
        row_max[t0:t1] = m
        sum_exp[t0:t1] = e.sum(1)
        if sum_exp_z is not None:
            sum_exp_z[t0:t1] = floored(rel).mul_(e).sum(1)
        hit = ids == lt.unsqueeze(1)
        picked = torch.where(hit, z, float("-inf")).amax(1)  # (-inf: owned, not kept)
        target_logit[t0:t1] = torch.where(lt >= 0, picked, 0.0)
        if argmax is not None:
            top = (z == m.unsqueeze(1)) & (ids >= 0) & (m > float("-inf")).unsqueeze(1)
            lowest = torch.where(top, ids, weight.shape[0]).amin(1)
            argmax[t0:t1] = torch.where(lowest < weight.shape[0], lowest, 0).float()
    return ShardStats(row_max, sum_exp, target_logit, sum_exp_z, None, None, argmax)


def forward_single(source: str, hidden: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor], target: torch.Tensor, call: ShardCall,
                   target_flag: Optional[torch.Tensor] = None) -> SingleShardOutputs:
    """One shard's outputs of a call run from its pairs: :func:`forward_stats` settled as the
    native source settles its tiles' (``target`` outside ``[0, V)``: nobody's, NaN logp); a
    ``target_flag`` (the fused sources' in-kernel target check: ``tplogp.backends.base``) gets one
    such target, as their kernels write it, by a copy on the stream."""
    owned = (target >= 0) & (target < weight.shape[0])
    if target_flag is not None and target.numel():
        first_bad = (~owned).to(torch.int32).argmax().view(1)
        target_flag.copy_(torch.where(owned.all(), 0, target.index_select(0, first_bad)),
                          non_blocking=True)
    st = forward_stats(source, hidden, weight, bias, torch.where(owned, target, -1), call)
    row_max, log_sum, lse, mean_rel = settle_rows(st.row_max, st.sum_exp, st.sum_exp_z)
    logp = torch.where(owned, (st.target_logit - row_max) - log_sum, float("nan"))
    return SingleShardOutputs(logp, lse, row_max, log_sum, mean_rel,
                              None if mean_rel is None else log_sum - mean_rel, None, None,
                              st.argmax)


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
    v, k = weight.shape[0], call.support.shape[1]
    rows = _chunk_rows(source, weight, call)
    d_hidden = torch.empty(n, d, dtype=torch.float32, device=hidden.device) if need_h else None
    dz_all = torch.empty(n, k, dtype=torch.float32, device=hidden.device)
    for t0 in range(0, n, rows):
        t1 = min(t0 + rows, n)
        ids = call.support[t0:t1]
        slopes: Optional[list] = [] if call.softcap is not None else None
        z, w_rows = _pair_logits(hidden[t0:t1], weight, bias, ids, call, slopes)
        dz = _pair_dz(z, ids, local_target[t0:t1], row_max[t0:t1], log_sum[t0:t1],
                      grad_logp[t0:t1], None if grad_entropy is None else grad_entropy[t0:t1],
                      None if grad_lse is None else grad_lse[t0:t1],
                      None if mean_rel is None else mean_rel[t0:t1], call,
                      slopes[0] if slopes else None)
        dz_all[t0:t1] = dz
        if need_h:  # (dz in the weight's dtype, as the fused kernels' d_logits)
            d_hidden[t0:t1] = fp32_gemm.bmm(dz.to(w_rows.dtype).unsqueeze(1), w_rows).squeeze(1)
    if d_hidden_ready is not None and d_hidden is not None:
        d_hidden_ready(d_hidden)
    d_w = d_b = None
    if need_w or need_b:
        ids = torch.where(call.support >= 0, call.support, v).view(-1)  # (padding: row v, dz 0)
        order = ids.argsort(stable=True)
        acc_w, acc_b = accumulate if accumulate is not None else (None, None)
        d_w, d_b = _rows_summed(ids[order], dz_all.view(-1)[order], order // k, hidden, v,
                                weight.dtype if need_w else None,
                                bias.dtype if need_b else None,
                                max(1, _transient(source, weight, call) // (8 * d)),
                                acc_w if need_w else None, acc_b if need_b else None)
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


__all__ = ["MAX_IDS", "forward_stats", "forward_single", "backward"]
