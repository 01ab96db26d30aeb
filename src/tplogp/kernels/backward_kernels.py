"""Backward kernels on pointer loads (any CUDA GPU Triton supports, and Triton's CPU interpreter):
the d_logits recompute, d_logits from the kept softmax terms, and the deterministic ``d_hidden``
GEMM (which the Hopper backward, :mod:`.hopper_kernels`, shares).

Algorithm (hybrid backward). The vocab shard is walked in chunks ``[v_lo, v_hi)`` sized so that the
``[N, chunk]`` workspace (weight dtype) fits the byte budget. Per chunk:

1. :func:`bwd_dlogits_kernel` recomputes each ``[BLOCK_N, BLOCK_V]`` logits tile in fp32 (same K
   loop as the
   forward) and forms, in fp32, ::

       zr = z - M                  (M: global row max; exact 0 at the max)
       p  = exp(zr - log_sum)      (log_sum = log sum exp(z - M): lse = M + log_sum, kept apart so
       that
                                    1 - p at a peaked target does not cancel against a rounded lse)
       dz = g * onehot(target) - p * (g - g_lse + g_ent * (zr - mean_rel)) + g_sum_z
       d_logits = dz * inv_temperature * (1 - tanh^2(y / softcap))     (the last factor with a
       softcap only)

   then rounds ``d_logits`` once to the weight dtype into the workspace; with a bias it also writes
   the fp32 column sums of the tile (per token block) so ``d_bias`` is summed in fp32 without
   atomics. Over the columns whose softmax terms the forward kept (a ``workspace_bytes`` above the
   default: ``exp(z - m)`` in 16 bits with an fp32 running max ``m`` per row and forward tile, with
   a softcap that of the tanh), :func:`bwd_dlogits_kept_kernel` forms ``p`` (and the softcap's
   slope) from them instead of recomputing the tile, and runs the same finish.
2. GEMMs with fp32 accumulation consume the workspace: ``d_hidden += d_logits @ W[chunk]`` (fp32
   accumulator) and ``d_W[chunk] = d_logits^T @ hidden`` (one GEMM over all N, so d_W needs no
   cross-chunk accumulator). By default cuBLAS does both; in deterministic mode
   :func:`dh_accum_kernel` does ``d_hidden`` with a fixed tiling that continues the fp32 accumulator
   chunk after chunk, so a row's ``d_hidden`` does not depend on N or on chunking.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp32_ops import LOG2E
from .backward_epilogue import dlogits_epilogue, dlogits_finish, kept_probabilities
from .tile_ops import grouped_ids, logits_tile, mma


@triton.jit
def bwd_dlogits_kernel(
    p_h,  # [N, D] hidden, in
    p_w,  # [V, D] weight shard, in
    p_b,  # [V] bias, in (unused unless HAS_BIAS)
    p_tgt,  # [N] int64 local target, in
    p_rmax,  # [N] fp32 global row max M, in
    p_lsum,  # [N] fp32 log sum exp(z - M) over the global vocab, in
    p_g,  # [N] fp32 grad of logp, in
    p_gmg,  # [N] fp32 grad_logp - grad_lse, in
    p_ge,  # [N] fp32 grad of entropy, in (only WITH_ENTROPY)
    p_mean_rel,  # [N] fp32 mean logit relative to the max, E_p[z] - M, in (only WITH_ENTROPY)
    p_gsz,  # [N] fp32 grad of sum_v z, in (only WITH_SUM_Z)
    p_dz,  # [N, v_hi - v_lo] d_logits workspace (weight dtype), out
    # [cdiv(N, BLOCK_N), V] fp32 partial column sums of d_logits, out (only HAS_BIAS and NEED_DB)
    p_dbp,
    # [N, cdiv(v_hi - v_lo, 32)] int32 bitmask of the chunk's columns that a sampler's support
    # keeps, in (only SUPPORT)
    p_sup,
    N, V, D, v_lo, v_hi,
    stride_hn, stride_wv, stride_dz, stride_dbp,
    stride_sup,  # words per row of p_sup (only SUPPORT)
    inv_temp, softcap,  # softcap: only SOFTCAP
    HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr, WITH_ENTROPY: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, WITH_SUM_Z: tl.constexpr,
    # the logits outside a row's support are -inf (backward_epilogue.dlogits_tile)
    SUPPORT: tl.constexpr,
):
    i_n, i_v = grouped_ids(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(v_hi - v_lo, BLOCK_V),
                           GROUP_N)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    o_v = v_lo + i_v * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V] column inside the shard
    acc = logits_tile(p_h, p_w, o_n, o_v, o_n < N, o_v < v_hi, D, stride_hn, stride_wv,
                       BLOCK_N, BLOCK_V, BLOCK_D, EVEN_D, DOT_PRECISION)  # [BLOCK_N, BLOCK_V]
    dlogits_epilogue(acc, i_n, i_v, N, v_lo, v_hi, p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge,
                     p_mean_rel, p_gsz,
                      p_dz, p_dbp, stride_dz, stride_dbp, inv_temp, softcap, HAS_BIAS, NEED_DB,
                      WITH_ENTROPY, DOT_PRECISION, BLOCK_N, BLOCK_V, SOFTCAP, WITH_SUM_Z, p_sup,
                      stride_sup, SUPPORT)


@triton.jit
def bwd_dlogits_kept_kernel(
    p_kept,  # [N, >= v_hi] softmax terms exp(z - m) kept by the forward (KEEP), in
    p_scale,  # [N, cdiv(v_keep, BLOCK_V)] fp32 their running max m per row and forward tile, in
    p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge, p_mean_rel, p_gsz,  # see bwd_dlogits_kernel
    p_dz,  # [N, v_hi - v_lo] d_logits workspace (weight dtype), out
    p_dbp,  # [cdiv(N, BLOCK_N), V] fp32 partial column sums of d_logits, out (only NEED_DB)
    N, v_lo, v_hi,
    stride_kept, stride_scale, stride_dz, stride_dbp,
    inv_temp, softcap,  # softcap: only SOFTCAP
    NEED_DB: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, WITH_SUM_Z: tl.constexpr,
):
    """:func:`bwd_dlogits_kernel` for columns whose softmax terms the forward kept: ``p`` (and with
    entropy ``z - M``) from the kept terms and their row scale
    (:func:`.backward_epilogue.kept_probabilities`; no GEMM; bias and temperature are in the terms
    already), then the same finish. ``BLOCK_V`` is the forward's tile width (one scale per row and tile);
    ``BLOCK_N`` the backward's (the d_bias partial rows)."""
    num_v = tl.cdiv(v_hi - v_lo, BLOCK_V)
    i_n = tl.program_id(0) // num_v
    i_v = tl.program_id(0) % num_v
    v0 = v_lo + i_v * BLOCK_V  # first column of the tile inside the shard (and the kept buffer)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_c = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_n = o_n < N
    b_rmax = tl.load(p_rmax + o_n, mask=m_n, other=0.0)
    b_lsum2 = tl.load(p_lsum + o_n, mask=m_n, other=0.0) * LOG2E
    if ((i_n + 1) * BLOCK_N > N) | (v0 + BLOCK_V > v_hi):
        b_p, b_zr, b_slope = kept_probabilities(p_kept, p_scale, stride_kept, stride_scale,
                                                i_n * BLOCK_N, N, v0, v_hi, b_rmax, b_lsum2,
                                                WITH_ENTROPY, True, BLOCK_N, BLOCK_V, inv_temp,
                                                softcap, SOFTCAP)
        dlogits_finish(b_p, b_zr, i_n, o_n, o_c, v0, N, v_hi, p_tgt, p_g, p_gmg, p_ge, p_mean_rel,
                       p_dz, p_dbp, stride_dz, stride_dbp, inv_temp, True, NEED_DB, WITH_ENTROPY,
                       DOT_PRECISION, BLOCK_V, b_slope, p_gsz, SOFTCAP, WITH_SUM_Z)
    else:
        b_p, b_zr, b_slope = kept_probabilities(p_kept, p_scale, stride_kept, stride_scale,
                                                i_n * BLOCK_N, N, v0, v_hi, b_rmax, b_lsum2,
                                                WITH_ENTROPY, False, BLOCK_N, BLOCK_V, inv_temp,
                                                softcap, SOFTCAP)
        dlogits_finish(b_p, b_zr, i_n, o_n, o_c, v0, N, v_hi, p_tgt, p_g, p_gmg, p_ge, p_mean_rel,
                       p_dz, p_dbp, stride_dz, stride_dbp, inv_temp, False, NEED_DB, WITH_ENTROPY,
                       DOT_PRECISION, BLOCK_V, b_slope, p_gsz, SOFTCAP, WITH_SUM_Z)


@triton.jit
def dh_accum_kernel(
    p_dz,  # [N, K] d_logits chunk (weight dtype), in
    p_w,  # [K, D] weight rows of the chunk, in
    p_dh,  # [N, D] fp32 d_hidden accumulator, in/out
    N, K, D,
    stride_dz, stride_wv, stride_dh,
    ACCUMULATE: tl.constexpr,  # False on the first chunk (the accumulator is not read)
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dh[n, d] (+)= sum_k dz[n, k] w[k, d] with a fixed K order: a row's result depends on nothing
    else."""
    i_n, i_d = grouped_ids(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(D, BLOCK_D), GROUP_N)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    o_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    m_n = o_n < N
    m_d = o_d < D
    p_out = p_dh + o_n.to(tl.int64)[:, None] * stride_dh + o_d[None, :]  # [BLOCK_N, BLOCK_D]
    if ACCUMULATE:
        acc = tl.load(p_out, mask=m_n[:, None] & m_d[None, :], other=0.0)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    p_a = p_dz + o_n.to(tl.int64)[:, None] * stride_dz + o_k[None, :]  # [BLOCK_N, BLOCK_K]
    p_b = p_w + o_k.to(tl.int64)[:, None] * stride_wv + o_d[None, :]  # [BLOCK_K, BLOCK_D]
    for k0 in range(0, K, BLOCK_K):
        m_k = (k0 + o_k) < K
        b_a = tl.load(p_a, mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_b = tl.load(p_b, mask=m_k[:, None] & m_d[None, :], other=0.0)
        acc = mma(b_a, b_b, acc, DOT_PRECISION)
        p_a += BLOCK_K
        p_b += BLOCK_K * stride_wv
    tl.store(p_out, acc, mask=m_n[:, None] & m_d[None, :])

