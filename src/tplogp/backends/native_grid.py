"""The native source's tensor-parallel-invariant level (``deterministic="tp_invariant"``,
:mod:`tplogp.support.invariant`; docs/operator.md, "Determinism"): per-block statistics and
gradients of a grid-aligned shard.

Algorithm (one shard whose first column starts a grid block):

* The vocabulary is cut into blocks of ``B = GRID_COLUMNS`` columns aligned to id 0. Each block's
  weight rows (and bias) are copied into one zero-padded ``[B, D]`` buffer (``[B]``), so every
  block, the last one included, has one shape and one alignment wherever the shard boundaries fall.
* Token chunks are :data:`~tplogp.backends.native_tiles.DETERMINISTIC_TOKEN_CHUNK` rows, the last
  one zero-padded: every logits GEMM is ``[chunk, D] x [D, B]`` with fp32 output, and every
  reduction and elementwise op runs on one ``[chunk, B]`` tile shape (BLAS picks kernels by shape
  and alignment). A column's logits, d_W and d_b rows then do not depend on the shard it came in.
* Forward (:func:`forward_blocks`), blocks outer, chunks inner: per block and token the stats
  ``m_b`` (max), ``s_b = sum exp(z - m_b)``, for entropy ``q_b = sum exp(z - m_b)(z - m_b)``, with
  the options the block's sum of ``z`` (padding columns: zero weight and bias, ``z = 0``) and the
  lowest column of its max (padding set to -inf first); the owned target's fp32 logit. No online
  merge: :mod:`tplogp.support.invariant` merges the blocks exactly.
* Backward (:func:`backward_blocks`), blocks outer, chunks inner: each tile recomputed, ``dz``
  formed as in the tiled backward (the one-hot, ``grad_sum_z``, the temperature, the logit
  transform's slope) with padding columns zeroed; ``d_hidden`` summed over the blocks in order in
  fp32, a block's d_W / d_b rows summed over the chunks in an fp32 ``[B, D]`` / ``[B]`` buffer and
  written (or added to ``accumulate``) once.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..support import fp32_gemm
from ..support.masked_rows import floored, rescale_max
from .base import BlockStats, ShardCall, ShardGrads
from .native_support import kept_columns, support_rows
from .native_tiles import (DETERMINISTIC_TOKEN_CHUNK, _finish_dz, _pad_rows, _token_chunk,
                           call_logits_tile, call_recomputed_dz)

# The grid: every logits GEMM is [DETERMINISTIC_TOKEN_CHUNK, D] x [D, GRID_COLUMNS] over one grid
# block (copied into a
# buffer of that shape: BLAS picks kernels by shape and alignment)
GRID_COLUMNS = 128


def forward_blocks(hidden, weight, bias, local_target, call: ShardCall) -> BlockStats:
    """Per-block stats of a grid-aligned shard (:class:`~tplogp.backends.base.BlockStats`): blocks
    outer (each copied once into its padded buffer), token chunks inner, one ``[chunk, B]`` logits
    tile each."""
    n, v = hidden.shape[0], weight.shape[0]
    cols, tc = call.grid_columns, DETERMINISTIC_TOKEN_CHUNK
    n_blocks = -(-v // cols)
    dev = hidden.device
    f32 = torch.float32
    block_max = torch.empty(n_blocks, n, device=dev, dtype=f32)
    block_sum = torch.empty(n_blocks, n, device=dev, dtype=f32)
    block_sez = torch.empty(n_blocks, n, device=dev, dtype=f32) if call.with_entropy else None
    block_sum_z = torch.empty(n_blocks, n, device=dev, dtype=f32) if call.with_sum_z else None
    block_argmax = torch.empty(n_blocks, n, device=dev, dtype=f32) if call.with_argmax else None
    target_logit = torch.zeros(n, device=dev, dtype=f32)
    if n == 0 or n_blocks == 0:
        return BlockStats(block_max, block_sum, target_logit, block_sez, block_sum_z, block_argmax)
    for i, (v0, v1, w_blk, b_blk) in enumerate(_grid_blocks(weight, bias, cols)):
        for t0 in range(0, n, tc):
            t1 = min(t0 + tc, n)
            z = call_logits_tile(_pad_rows(hidden[t0:t1], tc), w_blk, b_blk, call)  # [tc, B]
            if call.support is not None:  # outside the row's support: -inf (masked columns)
                z.masked_fill_(~_kept(call.support, t0, t1, tc, v0, cols), float("-inf"))
            rel = local_target[t0:t1] - v0
            own = (rel >= 0) & (rel < v1 - v0)
            picked = z[: t1 - t0].gather(1, rel.clamp(0, cols - 1).unsqueeze(1)).squeeze(1)
            target_logit[t0:t1] = torch.where(own, picked, target_logit[t0:t1])
            # one [tc, B] reduction (padding columns: zero weight and bias, z = 0)
            if block_sum_z is not None:
                block_sum_z[i, t0:t1] = z.sum(1)[: t1 - t0]
            if v1 - v0 < cols:  # the vocabulary's last block: its padding is no column
                z[:, v1 - v0:] = float("-inf")
            if block_argmax is not None:  # torch.argmax: the first (lowest) column of the max
                block_argmax[i, t0:t1] = z.argmax(1)[: t1 - t0].to(f32) + v0
            m = z.amax(1)
            z -= rescale_max(m).unsqueeze(1)  # z - m_b (-inf on padding and masked columns)
            e = torch.exp(z)
            block_max[i, t0:t1] = m[: t1 - t0]
            block_sum[i, t0:t1] = e.sum(1)[: t1 - t0]
            if block_sez is not None:  # (floored: e = 0 there, no -inf * 0)
                block_sez[i, t0:t1] = floored(z).mul_(e).sum(1)[: t1 - t0]
    return BlockStats(block_max, block_sum, target_logit, block_sez, block_sum_z, block_argmax)


def backward_blocks(hidden, weight, bias, local_target, row_max, log_sum, grad_logp, grad_entropy,
                    grad_lse, mean_rel, call: ShardCall, needs, d_hidden_ready=None,
                    accumulate=None, grad_sum_z=None) -> ShardGrads:
    """The invariant level's backward: grid blocks outer, deterministic token chunks inner, every
    GEMM ``[chunk, B]``-shaped; a block's d_W / d_b rows are summed over the chunks in an fp32
    ``[B, D]`` / ``[B]`` buffer and written (or added to ``accumulate``) once. ``dz`` by the tiled
    backward's two steps (:func:`~tplogp.backends.native_tiles._recomputed_dz`,
    :func:`~tplogp.backends.native_tiles._finish_dz`), on one tile shape."""
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    n, d = hidden.shape
    dev = hidden.device
    f32 = torch.float32
    cols, tc = call.grid_columns, DETERMINISTIC_TOKEN_CHUNK
    dw_acc, db_acc = accumulate if accumulate is not None else (None, None)
    d_hidden = torch.zeros(n, d, device=dev, dtype=f32) if need_h else None
    d_weight = (dw_acc if dw_acc is not None else torch.empty_like(weight)) if need_w else None
    d_bias = (db_acc if db_acc is not None else torch.empty_like(bias)) if need_b else None
    gemm_dtype = weight.dtype if dev.type == "cuda" else f32
    chunks = [_token_chunk(hidden, row_max, log_sum, grad_logp, grad_entropy, grad_lse, mean_rel,
                           local_target, t0, min(t0 + tc, n), tc, grad_sum_z) for t0 in range(0, n,
                                                                                              tc)]
    h_gemm = [ch.h if ch.h.dtype == gemm_dtype else ch.h.to(gemm_dtype) for ch in chunks]
    for v0, v1, w_blk, b_blk in _grid_blocks(weight, bias, cols):
        w_g = w_blk if w_blk.dtype == gemm_dtype else w_blk.to(gemm_dtype)
        acc_w = torch.zeros(cols, d, device=dev, dtype=f32) if need_w else None
        acc_b = torch.zeros(cols, device=dev, dtype=f32) if need_b else None
        for ch, h_g in zip(chunks, h_gemm):
            dz, slope = call_recomputed_dz(ch, w_blk, b_blk, call)
            if call.support is not None:  # p = 0 outside the row's support
                dz.masked_fill_(~_kept(call.support, ch.t0, ch.t1, tc, v0, cols), 0.0)
            dz = _finish_dz(dz, ch, v0, v1, call.inv_temperature, slope)
            del slope
            if acc_b is not None:
                acc_b += dz.sum(0)
            dz_g = dz if dz.dtype == gemm_dtype else dz.to(gemm_dtype)
            if d_hidden is not None:
                d_hidden[ch.t0:ch.t1] += fp32_gemm.mm(dz_g, w_g)[: ch.t1 - ch.t0]
            if acc_w is not None:
                acc_w += fp32_gemm.mm(dz_g.t(), h_g)
        if acc_w is not None:
            if dw_acc is not None:
                dw_acc[v0:v1] += acc_w[: v1 - v0]
            else:
                d_weight[v0:v1] = acc_w[: v1 - v0]
        if acc_b is not None:
            if db_acc is not None:
                db_acc[v0:v1] += acc_b[: v1 - v0]
            else:
                d_bias[v0:v1] = acc_b[: v1 - v0]
    if d_hidden is not None and d_hidden_ready is not None:
        d_hidden_ready(d_hidden)
    return ShardGrads(d_hidden, d_weight, d_bias)


def _kept(support: torch.Tensor, t0: int, t1: int, rows: int, v0: int, cols: int) -> torch.Tensor:
    """``[rows, cols]`` bool: the columns ``[v0, v0 + cols)`` that rows ``[t0, t1)`` of the support
    keep (padding rows and columns keep none). A function of the global id and the row alone, so
    the masked grid stays invariant to the shard boundaries."""
    return kept_columns(support_rows(support, t0, t1, rows), v0, v0 + cols)


def _grid_blocks(weight: torch.Tensor, bias: Optional[torch.Tensor], cols: int):
    """``(v0, v1, weight rows [cols, D], bias [cols] or None)`` per grid block of a grid-aligned
    shard, each copied into one zero-padded buffer (so that every GEMM sees one shape and one
    alignment)."""
    v, d = weight.shape
    w_blk = torch.empty(cols, d, device=weight.device, dtype=weight.dtype)
    b_blk = None if bias is None else torch.empty(cols, device=bias.device, dtype=bias.dtype)
    for v0 in range(0, v, cols):
        v1 = min(v0 + cols, v)
        w_blk[: v1 - v0] = weight[v0:v1]
        if v1 - v0 < cols:
            w_blk[v1 - v0:] = 0
        if b_blk is not None:
            b_blk[: v1 - v0] = bias[v0:v1]
            if v1 - v0 < cols:
                b_blk[v1 - v0:] = 0
        yield v0, v1, w_blk, b_blk
