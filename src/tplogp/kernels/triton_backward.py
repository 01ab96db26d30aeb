"""Fused backward pieces: recompute logits tiles and write ``d_logits`` into a bounded workspace.

Algorithm (hybrid backward). The vocab shard is walked in chunks ``[v_lo, v_hi)`` sized so that the ``[N, chunk]``
workspace (weight dtype) fits the byte budget. Per chunk:

1. :func:`_bwd_dlogits_kernel` recomputes each ``[BLOCK_N, BLOCK_V]`` logits tile in fp32 (same K loop as the
   forward) and forms, in fp32, ::

       zr = z - M                  (M: global row max; exact 0 at the max)
       p  = exp(zr - log_sum)      (log_sum = log sum exp(z - M): lse = M + log_sum, kept apart so that
                                    1 - p at a peaked target does not cancel against an rounded lse)
       dz = g * onehot(target) - p * (g - g_lse + g_ent * (zr - mean_zr))
       d_logits = dz * inv_temperature

   then rounds ``d_logits`` once to the weight dtype into the workspace; with a bias it also writes the fp32
   column sums of the tile (per token block) so ``d_bias`` is summed in fp32 without atomics.
2. GEMMs with fp32 accumulation consume the workspace: ``d_hidden += d_logits @ W[chunk]`` (fp32 accumulator) and
   ``d_W[chunk] = d_logits^T @ hidden`` (one GEMM over all N, so d_W needs no cross-chunk accumulator). By default
   cuBLAS does both; in deterministic mode :func:`_dh_accum_kernel` does ``d_hidden`` with a fixed tiling that
   continues the fp32 accumulator chunk after chunk, so a row's ``d_hidden`` does not depend on N or on chunking.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_forward import FAST_EXP2, LOG2E, _exp2, _grouped_ids, _logits_tile, _mma, _store_rounded, _target_column


@triton.jit
def _dlogits_epilogue(
    acc,  # [BLOCK_N, BLOCK_V] fp32 logits tile (before bias and temperature)
    i_n, i_v, N, v_lo, v_hi,  # the tile (token block, column block of the chunk), the rows, the chunk [v_lo, v_hi)
    p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge, p_mz, p_dz, p_dbp,  # see _bwd_dlogits_kernel
    stride_dz, stride_dbp,
    inv_temp,
    HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr, WITH_ENTROPY: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Tile (i_n, i_v)'s epilogue: the unmasked form for interior tiles, the masked one for tiles past N or v_hi.
    Shared by the generic and the TMA (sm90) kernels: only how ``acc`` is loaded differs between them."""
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    o_c = i_v * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V] column inside the chunk
    v0 = v_lo + i_v * BLOCK_V
    if ((i_n + 1) * BLOCK_N > N) | (v0 + BLOCK_V > v_hi):
        _dlogits_tile(acc, i_n, o_n, o_c, v0, N, v_hi, p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge, p_mz, p_dz,
                      p_dbp, stride_dz, stride_dbp, inv_temp, True, HAS_BIAS, NEED_DB, WITH_ENTROPY, DOT_PRECISION,
                      BLOCK_V)
    else:
        _dlogits_tile(acc, i_n, o_n, o_c, v0, N, v_hi, p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge, p_mz, p_dz,
                      p_dbp, stride_dz, stride_dbp, inv_temp, False, HAS_BIAS, NEED_DB, WITH_ENTROPY, DOT_PRECISION,
                      BLOCK_V)


@triton.jit
def _dlogits_tile(
    acc,  # [BLOCK_N, BLOCK_V] fp32 logits tile (before bias and temperature)
    i_n, o_n, o_c, v0, N, v_hi,  # token block, its rows, the tile's chunk columns, first shard column, bounds
    p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge, p_mz, p_dz, p_dbp,  # see _bwd_dlogits_kernel
    stride_dz, stride_dbp,
    inv_temp,
    MASKED: tl.constexpr,  # the tile reaches past N or v_hi (edge tiles only)
    HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr, WITH_ENTROPY: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """From a logits tile to its d_logits (rounded into the workspace) and, with a bias, its fp32 column sums.

    Per element: ``zr = z - M`` (one FMA; exact 0 at the max, so 1 - p does not cancel at a peaked row), ``p =
    2^(zr log2(e) - log_sum log2(e))`` (one FMA and one ex2), the one-hot term (a compare and a select), and ``dz =
    onehot * g/T - p * coef/T`` (one FMA; the temperature is folded into the per-row factors). ``MASKED``: the
    tile's rows and columns are masked (edge tiles); interior tiles carry no masks.
    """
    o_t = tl.arange(0, BLOCK_V)  # [BLOCK_V] column inside the tile
    o_v = v0 + o_t  # [BLOCK_V] column inside the shard
    m_n = o_n < N
    m_v = o_v < v_hi
    if HAS_BIAS:
        if MASKED:
            acc += tl.load(p_b + o_v, mask=m_v, other=0.0).to(tl.float32)[None, :]
        else:
            acc += tl.load(p_b + o_v).to(tl.float32)[None, :]
    b_rmax = tl.load(p_rmax + o_n, mask=m_n, other=0.0)
    b_lsum2 = tl.load(p_lsum + o_n, mask=m_n, other=0.0) * LOG2E
    b_g = tl.load(p_g + o_n, mask=m_n, other=0.0) * inv_temp
    b_gmg = tl.load(p_gmg + o_n, mask=m_n, other=0.0) * inv_temp
    b_tgt = tl.load(p_tgt + o_n, mask=m_n, other=-1)
    b_zr = acc * inv_temp - b_rmax[:, None]  # z - M
    b_p = _exp2(b_zr * LOG2E - b_lsum2[:, None], FAST_EXP2)  # [BLOCK_N, BLOCK_V]
    if WITH_ENTROPY:
        b_ge = tl.load(p_ge + o_n, mask=m_n, other=0.0) * inv_temp
        b_mz = tl.load(p_mz + o_n, mask=m_n, other=0.0)
        b_coef = b_gmg[:, None] + b_ge[:, None] * (b_zr - b_mz[:, None])
    else:
        b_coef = b_gmg[:, None]
    t_col = _target_column(b_tgt, v0, BLOCK_V)
    b_dz = tl.where(o_t[None, :] == t_col[:, None], b_g[:, None], 0.0) - b_p * b_coef
    p_out = p_dz + o_n.to(tl.int64)[:, None] * stride_dz + o_c[None, :]
    m_out = None  # interior tiles: no masks
    m_db = None
    if MASKED:
        m_out = m_n[:, None] & m_v[None, :]
        m_db = m_v
        b_dz = tl.where(m_out, b_dz, 0.0)
    _store_rounded(p_out, b_dz, m_out, DOT_PRECISION)
    if NEED_DB:
        tl.store(p_dbp + i_n.to(tl.int64) * stride_dbp + o_v, tl.sum(b_dz, 0), mask=m_db)


@triton.jit
def _bwd_dlogits_kernel(
    p_h,  # [N, D] hidden, in
    p_w,  # [V, D] weight shard, in
    p_b,  # [V] bias, in (unused unless HAS_BIAS)
    p_tgt,  # [N] int64 local target, in
    p_rmax,  # [N] fp32 global row max M, in
    p_lsum,  # [N] fp32 log sum exp(z - M) over the global vocab, in
    p_g,  # [N] fp32 grad of logp, in
    p_gmg,  # [N] fp32 grad_logp - grad_lse, in
    p_ge,  # [N] fp32 grad of entropy, in (only WITH_ENTROPY)
    p_mz,  # [N] fp32 mean logit relative to the max, E_p[z] - M, in (only WITH_ENTROPY)
    p_dz,  # [N, v_hi - v_lo] d_logits workspace (weight dtype), out
    p_dbp,  # [cdiv(N, BLOCK_N), V] fp32 partial column sums of d_logits, out (only HAS_BIAS and NEED_DB)
    N, V, D, v_lo, v_hi,
    stride_hn, stride_wv, stride_dz, stride_dbp,
    inv_temp,
    HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr, WITH_ENTROPY: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_n, i_v = _grouped_ids(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(v_hi - v_lo, BLOCK_V), GROUP_N)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    o_v = v_lo + i_v * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V] column inside the shard
    acc = _logits_tile(p_h, p_w, o_n, o_v, o_n < N, o_v < v_hi, D, stride_hn, stride_wv,
                       BLOCK_N, BLOCK_V, BLOCK_D, EVEN_D, DOT_PRECISION)  # [BLOCK_N, BLOCK_V]
    _dlogits_epilogue(acc, i_n, i_v, N, v_lo, v_hi, p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge, p_mz, p_dz, p_dbp,
                      stride_dz, stride_dbp, inv_temp, HAS_BIAS, NEED_DB, WITH_ENTROPY, DOT_PRECISION, BLOCK_N, BLOCK_V)


@triton.jit
def _dh_accum_kernel(
    p_dz,  # [N, K] d_logits chunk (weight dtype), in
    p_w,  # [K, D] weight rows of the chunk, in
    p_dh,  # [N, D] fp32 d_hidden accumulator, in/out
    N, K, D,
    stride_dz, stride_wv, stride_dh,
    ACCUMULATE: tl.constexpr,  # False on the first chunk (the accumulator is not read)
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dh[n, d] (+)= sum_k dz[n, k] w[k, d] with a fixed K order: a row's result depends on nothing else."""
    i_n, i_d = _grouped_ids(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(D, BLOCK_D), GROUP_N)
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
        acc = _mma(b_a, b_b, acc, DOT_PRECISION)
        p_a += BLOCK_K
        p_b += BLOCK_K * stride_wv
    tl.store(p_out, acc, mask=m_n[:, None] & m_d[None, :])
