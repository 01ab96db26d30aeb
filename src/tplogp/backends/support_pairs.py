"""The backward of a call with narrow supports from its (token, id) pairs alone: no GEMM over the
shard's vocabulary, no ``[V, D]`` fp32 accumulator.

Where a call's supports are narrow (``K`` ids per token at most :data:`MAX_IDS`; a 16-bit weight:
:func:`applies`) but their union is the whole shard, and the op's own backward has no fp32
``d_W`` accumulators within its budget for the token-chunk way
(:func:`tplogp.backends.native_support.accumulators_fit`), every source's backward takes this way
(:func:`tplogp.backends.native_support.gathered_backward`) instead of masking the whole shard.

Algorithm (:func:`backward`), per token chunk of ``T`` rows (``T K D`` gathered weight elements
within the budget's transient part): the weight rows of each row's ids ``W[S_t]`` (``[T, K, D]``),
the logits of the pairs ``z[t, k] = cap(h_t . W[S_t[k]] + b) / T`` in fp32 (as the tiles'), then
``dz = -p (c0 + grad_entropy (z - M)) + grad_logp [id = target]``, times the temperature's ``1/T``
and the softcap's slope, 0 on padding (the tiles' formula, :mod:`tplogp.backends.native_tiles`, on
the pairs' columns), ``d_hidden[t] = sum_k dz[t, k] W[S_t[k]]`` (one batched product, ``dz`` in the
weight's dtype as the fused kernels' d_logits, fp32 accumulation). The pairs'
``(id, token, dz)`` are kept (``20 N K`` bytes). Then ``d_W`` row by row: the pairs sorted by id,
cut into blocks of whole runs of one id (``P D`` fp32 contributions within the transient part;
one host read: the cuts), each block's ``dz h[token]`` summed per run (``segment_reduce``: no
atomics, fp32) and written once, rounded once to the weight's dtype, at its id; ``d_b`` is
``dz`` summed per id. Rows no support keeps get 0.

Cost: about ``22 N K D`` bytes of memory traffic for 16-bit weights where torch has fp32-output
batched GEMMs (the weight rows gathered, read twice; the hidden rows gathered; the fp32
contributions written and summed), against the masked way's three ``[N, V] x D`` GEMMs: at
``N K = 524288`` (8192 tokens, 64 ids) and ``D = 4096``, 47 GB.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..support import fp32_gemm
from ..support.masked_rows import floored
from . import memory_budget
from .base import ShardCall, ShardGrads
from .native_tiles import _transformed

MAX_IDS = 64  # the widest support (ids per token) this way takes


def applies(call: ShardCall, weight: torch.Tensor, grad_sum_z: Optional[torch.Tensor]) -> bool:
    """Whether this way computes the call's backward: supports of at most ``MAX_IDS`` ids, a 16-bit
    weight, and no gradient of the sum of the logits (which reaches every column). Not fp32: the
    pairs' logits are not the forward's bits (another GEMM), so ``z - M`` at a peaked row's max is
    off by the logits' rounding (about ``|z| 2^-24``) and ``1 - p`` with it, beyond an fp32
    reference's error there; a 16-bit call's reference error is far larger."""
    return (call.support is not None and 0 < call.support.shape[1] <= MAX_IDS
            and weight.dtype in (torch.bfloat16, torch.float16) and grad_sum_z is None)


def backward(source: str, hidden: torch.Tensor, weight: torch.Tensor,
             bias: Optional[torch.Tensor], local_target: torch.Tensor, row_max: torch.Tensor,
             log_sum: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: Optional[torch.Tensor],
             grad_lse: Optional[torch.Tensor], mean_rel: Optional[torch.Tensor], call: ShardCall,
             needs: tuple[bool, bool, bool], d_hidden_ready=None) -> ShardGrads:
    """The shard's gradients of a call with narrow supports (module docstring): ``d_hidden`` fp32
    (partial), ``d_weight`` / ``d_bias`` in the weight's / bias's dtype."""
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    n, d = hidden.shape
    v, k = weight.shape[0], call.support.shape[1]
    transient = memory_budget.split(source, call.workspace_bytes, weight.device,
                                    call.deterministic).transient
    rows = max(1, transient // (6 * k * d))
    d_hidden = torch.empty(n, d, dtype=torch.float32, device=hidden.device) if need_h else None
    dz_all = torch.empty(n, k, dtype=torch.float32, device=hidden.device)
    for t0 in range(0, n, rows):
        t1 = min(t0 + rows, n)
        ids = call.support[t0:t1]
        valid = ids >= 0
        w_rows = weight.index_select(0, ids.clamp(min=0).view(-1)).view(t1 - t0, k, d)
        dz = _pair_dz(hidden[t0:t1], w_rows, bias, ids, valid, local_target[t0:t1],
                      row_max[t0:t1], log_sum[t0:t1], grad_logp[t0:t1],
                      None if grad_entropy is None else grad_entropy[t0:t1],
                      None if grad_lse is None else grad_lse[t0:t1],
                      None if mean_rel is None else mean_rel[t0:t1], call)
        dz_all[t0:t1] = dz
        if need_h:  # (dz in the weight's 16-bit dtype, as the fused kernels' d_logits)
            d_hidden[t0:t1] = fp32_gemm.bmm(dz.to(w_rows.dtype).unsqueeze(1), w_rows).squeeze(1)
    if d_hidden_ready is not None and d_hidden is not None:
        d_hidden_ready(d_hidden)
    d_w = d_b = None
    if need_w or need_b:
        ids = torch.where(call.support >= 0, call.support, v).view(-1)  # (padding: row v, dz 0)
        order = ids.argsort(stable=True)
        d_w, d_b = _rows_summed(ids[order], dz_all.view(-1)[order], order // k, hidden, v,
                                weight.dtype if need_w else None,
                                bias.dtype if need_b else None, max(1, transient // (8 * d)))
    return ShardGrads(d_hidden, d_w, d_b)


def _pair_dz(h, w_rows, bias, ids, valid, target, row_max, log_sum, grad_logp, grad_entropy,
             grad_lse, mean_rel, call: ShardCall) -> torch.Tensor:
    """``dz`` of each pair of the token rows (fp32 ``[T, K]``, 0 on padding): the tiles' formula on
    the pairs' logits (module docstring)."""
    y = fp32_gemm.bmm(w_rows, h.unsqueeze(2)).squeeze(2)
    slopes: Optional[list] = [] if call.softcap is not None else None
    z = _transformed(y, None if bias is None else bias[ids.clamp(min=0)], call.inv_temperature,
                     call.softcap, slopes)
    z -= row_max.unsqueeze(1)
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
    if slopes:
        dz *= slopes[0]
    return dz.masked_fill_(~valid, 0.0)


def _rows_summed(ids: torch.Tensor, dz: torch.Tensor, token: torch.Tensor, hidden: torch.Tensor,
                 v: int, w_dtype: Optional[torch.dtype], b_dtype: Optional[torch.dtype],
                 block: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(d_W [v, D] in w_dtype, d_b [v] in b_dtype)`` (each None where its dtype is) from the
    pairs sorted by id (``ids``, ``v`` for padding): per block of whole runs of one id (about
    ``block`` pairs; one host read: the cuts), each run's sums of ``dz h[token]`` and of ``dz`` in
    fp32, written once at its id (module docstring). No atomics: the same bits at every run."""
    pairs, dev = ids.shape[0], ids.device
    d_w = None if w_dtype is None else torch.zeros(v + 1, hidden.shape[1], dtype=w_dtype,
                                                   device=dev)
    d_b = None if b_dtype is None else torch.zeros(v + 1, dtype=b_dtype, device=dev)
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
        if d_w is not None:
            parts = torch.mul(hidden.index_select(0, token[s:e]), dz[s:e].unsqueeze(1))  # fp32
            sums = torch.segment_reduce(parts, "sum", lengths=lengths, unsafe=True)
            d_w.index_copy_(0, at, sums.to(w_dtype))
        if d_b is not None:
            sums = torch.segment_reduce(dz[s:e], "sum", lengths=lengths, unsafe=True)
            d_b.index_copy_(0, at, sums.to(b_dtype))
    return (None if d_w is None else d_w[:v]), (None if d_b is None else d_b[:v])


__all__ = ["MAX_IDS", "applies", "backward"]
