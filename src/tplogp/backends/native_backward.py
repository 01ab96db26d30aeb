"""The native source's backward over tiles (:mod:`tplogp.backends.native`, "Backward"): vocab
tiles outer, token chunks inner; each tile's ``dz`` from its kept softmax terms (no GEMM) or from
the tile recomputed, then ``d_hidden`` and ``d_W`` by fp32-accumulating GEMMs.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..support import fp32_gemm
from ..support.masked_rows import floored
from .base import ShardCall
from .native_support import kept_columns, support_rows
from .native_tiles import (_finish_dz, _token_chunk, _TokenChunk, call_recomputed_dz, has_slope,
                           kept_slope)


def _log_terms(terms: torch.Tensor) -> torch.Tensor:
    """``log(e)`` in fp32 of a kept tile's terms ``e = exp(z - m)``, ``e`` clamped to 2^-126 first
    (a flushed term's log stays finite; its p is 0): what the transform's slope and the entropy's
    ``z - M`` are read from."""
    return terms.to(torch.float32, copy=True).clamp_min_(_TINY).log_()


# 2^-126: a flushed kept term's log stays finite (its p is 0)
_TINY = torch.finfo(torch.float32).tiny


def _dz_from_kept(terms: torch.Tensor, log_terms: Optional[torch.Tensor], scales: torch.Tensor,
                  ch: "_TokenChunk") -> torch.Tensor:
    """``dz`` (without the one-hot term) of a kept tile: ``p = e * exp(m - M - log S)`` from the
    kept terms ``e = exp(z
    - m)`` and their row scale ``m`` (out of place: a repeated backward reads them again), and with
    entropy ``zr = z - M = log(e) + (m - M)`` from ``log_terms`` (:func:`_log_terms`; overwritten).
    At the row max ``e = 1`` and ``m = M`` exactly, so ``1 - p`` does not cancel at a peaked
    target."""
    shift = scales - ch.m  # m - M <= 0
    p = terms.to(torch.float32, copy=True).mul_((shift - ch.ls).exp_().unsqueeze(1))
    if ch.ge is None:
        return p.mul_(ch.c0.unsqueeze(1)).neg_()
    # (floored: a tile kept before the row's first unmasked column has m = -inf)
    zr = floored(log_terms.add_(shift.unsqueeze(1)))
    return zr.mul_(ch.ge.unsqueeze(1)).add_(ch.c0.unsqueeze(1)).mul_(p).neg_()


def _accumulate_dw(acc: torch.Tensor, dz: torch.Tensor, h: torch.Tensor,
                   rows_per_block: int) -> None:
    """``acc += dz.T @ h`` into the fp32 accumulator without a full-size temporary.

    fp32 operands: one in-place ``addmm_``. Low-precision operands (CUDA): fp32-output GEMMs over
    blocks of ``rows_per_block`` vocab rows, so the temporary stays within the workspace budget.
    """
    if dz.dtype == torch.float32 and h.dtype == torch.float32:
        acc.addmm_(dz.t(), h)
        return
    for r0 in range(0, acc.shape[0], rows_per_block):
        r1 = min(r0 + rows_per_block, acc.shape[0])
        acc[r0:r1] += fp32_gemm.mm(dz[:, r0:r1].t(), h)


def backward_tiles(hidden, weight, bias, local_target, row_max, log_sum, grad_logp, grad_entropy,
               grad_lse, mean_rel, call: ShardCall, d_hidden, d_weight, d_bias32, tc: int,
               vc: int, kept_views: dict, rows_per_block: int, d_hidden_ready=None,
               grad_sum_z=None) -> None:
    """Vocab tiles outer, token chunks inner: each vocab tile's ``d_W`` rows are complete after
    its token chunks, so a low-precision ``d_W`` is summed in an fp32 ``[vocab_chunk, D]`` tile
    buffer (counted in the tile budget by :func:`tplogp.backends.native.plan_chunks`) and rounded
    once into the output.
    ``d_hidden`` sums the vocab tiles in order into its fp32 rows, and ``d_W`` each tile's token
    chunks in order: the sums of the token-outer order, bit for bit."""
    n, v = hidden.shape[0], weight.shape[0]
    # GEMM operand dtype for dz: the weight's dtype on CUDA (like an eager LM head, fp32
    # accumulation), fp32 on CPU where low-precision GEMMs have no fp32-output path.
    gemm_dtype = weight.dtype if hidden.device.type == "cuda" else torch.float32
    chunks = [_token_chunk(hidden, row_max, log_sum, grad_logp, grad_entropy, grad_lse,
                           mean_rel, local_target, t0, min(t0 + tc, n),
                           tc if call.deterministic else None, grad_sum_z=grad_sum_z)
              for t0 in range(0, n, tc)]
    dw_tile = None
    if d_weight is not None and d_weight.dtype != torch.float32:
        dw_tile = torch.empty(min(vc, v), hidden.shape[1], device=hidden.device,
                              dtype=torch.float32)
    for v0 in range(0, v, vc):
        v1 = min(v0 + vc, v)
        w = weight[v0:v1]
        w_g = w if w.dtype == gemm_dtype else w.to(gemm_dtype)
        acc = None
        if d_weight is not None:
            acc = d_weight[v0:v1] if dw_tile is None else dw_tile[: v1 - v0].zero_()
        for ch in chunks:
            t0, t1 = ch.t0, ch.t1
            keep = kept_views.get((t0, v0))
            slope = None  # the transform's d cap / d y
            if keep is not None:  # the forward kept the tile's terms: no GEMM
                terms, scales = keep
                sloped = has_slope(call)
                log_terms = None if not sloped and ch.ge is None else _log_terms(terms)
                if sloped:  # the scales are the running max of the tanh
                    slope, scales = kept_slope(log_terms, scales, call)
                dz = _dz_from_kept(terms, log_terms, scales, ch)
            else:  # recompute the tile
                dz, slope = call_recomputed_dz(ch, w, None if bias is None else bias[v0:v1],
                                               call)
            dz = _finish_dz(dz, ch, v0, v1, call.inv_temperature, slope)
            if call.support is not None:  # 0 outside the row's support (p = 0 there; the
                # target's one-hot too, when a computed support does not hold the target)
                ids = support_rows(call.support, t0, t1, ch.h.shape[0])
                dz[:, : v1 - v0].masked_fill_(~kept_columns(ids, v0, v1), 0.0)
            del slope
            if d_bias32 is not None:
                d_bias32[v0:v1] += dz.sum(0)
            dz_g = dz if dz.dtype == gemm_dtype else dz.to(gemm_dtype)
            del dz
            if d_hidden is not None:
                d_hidden[t0:t1] += fp32_gemm.mm(dz_g, w_g)[: t1 - t0]
                if t1 == n and v1 == v and d_hidden_ready is not None:
                    # complete: hand it over before this tile's d_W update
                    d_hidden_ready(d_hidden)
            if acc is not None:
                h_gemm = ch.h if ch.h.dtype == gemm_dtype else ch.h.to(gemm_dtype)
                _accumulate_dw(acc, dz_g, h_gemm, rows_per_block)
        if dw_tile is not None:
            d_weight[v0:v1] = acc  # rounded once to the weight dtype


__all__ = ["backward_tiles"]
