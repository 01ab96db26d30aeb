"""The backward's d_logits epilogue (``@triton.jit``; the pointer and TMA kernels alike).

:func:`dlogits_tile` applies a tile's logit transform (bias, softcap, support), then
:func:`dlogits_finish`: ``zr = z - M``, ``p = exp(zr - log_sum)``,
``dz = g onehot - p (g - g_lse + g_ent (zr - mean_rel))``, times 1/T (and the softcap's slope),
rounded once to the weight dtype; :func:`dlogits_epilogue` runs it on a tile's two column halves.
From the forward's kept terms (:func:`kept_probabilities`;
:func:`tplogp.kernels.forward_epilogue.keep_tile`) ``p`` comes without the GEMM, then the same
:func:`dlogits_finish`. Masked columns and the entropy's floor: :mod:`.tile_ops`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp32_ops import LN2, LOG2E, PTX, exp2, log2, mul_rounded, store_rounded
from .tile_ops import RELATIVE_FLOOR, kept_pointers, softcap_tile, support_masked, target_column


@triton.jit
def dlogits_epilogue(
    acc,  # [BLOCK_N, BLOCK_V] fp32 logits tile (before bias and temperature)
    # the tile (token block, column block of the chunk), the rows, the chunk [v_lo, v_hi)
    i_n, i_v, N, v_lo, v_hi,
    # see bwd_dlogits_kernel
    p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge, p_mean_rel, p_gsz, p_dz, p_dbp,
    stride_dz, stride_dbp,
    inv_temp, softcap,
    HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    SOFTCAP: tl.constexpr = False, WITH_SUM_Z: tl.constexpr = False,
    p_sup=None, stride_sup=0,  # the support's bitmask of the chunk's columns (only SUPPORT)
    SUPPORT: tl.constexpr = False,
):
    """Tile (i_n, i_v)'s epilogue. Shared by the generic and the TMA (sm90) kernels: only how
    ``acc`` is loaded differs between them. ``SOFTCAP``: the tile's two column halves one after the
    other (a split of the registers that hold them, no data movement), so that the softcap's extra
    values (the tanh, its slope) are live for half a tile at a time: over a whole 128 x 256 tile
    they no longer fit the registers and spill."""
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    if SOFTCAP:
        HALF: tl.constexpr = BLOCK_V // 2
        first, second = tl.split(tl.permute(tl.reshape(acc, [BLOCK_N, 2, HALF]), [0, 2, 1]))
        _dlogits_columns(first, i_n, o_n, i_v * BLOCK_V, N, v_lo, v_hi, p_b, p_tgt, p_rmax, p_lsum,
                         p_g, p_gmg, p_ge, p_mean_rel, p_gsz, p_dz, p_dbp, stride_dz, stride_dbp,
                         inv_temp, softcap, HAS_BIAS, NEED_DB, WITH_ENTROPY, DOT_PRECISION, BLOCK_N,
                         HALF, SOFTCAP, WITH_SUM_Z, p_sup, stride_sup, SUPPORT)
        _dlogits_columns(second, i_n, o_n, i_v * BLOCK_V + HALF, N, v_lo, v_hi, p_b, p_tgt, p_rmax,
                         p_lsum, p_g, p_gmg, p_ge, p_mean_rel, p_gsz, p_dz, p_dbp, stride_dz,
                         stride_dbp, inv_temp, softcap, HAS_BIAS, NEED_DB, WITH_ENTROPY,
                         DOT_PRECISION, BLOCK_N, HALF, SOFTCAP, WITH_SUM_Z, p_sup, stride_sup,
                         SUPPORT)
    else:  # _dlogits_columns written out: through it, this path compiles with more register spills
        o_c = i_v * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V] column inside the chunk
        v0 = v_lo + i_v * BLOCK_V
        if ((i_n + 1) * BLOCK_N > N) | (v0 + BLOCK_V > v_hi):
            dlogits_tile(acc, i_n, o_n, o_c, v0, N, v_hi, p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg,
                         p_ge, p_mean_rel, p_gsz, p_dz, p_dbp, stride_dz, stride_dbp, inv_temp,
                         softcap, True, HAS_BIAS, NEED_DB, WITH_ENTROPY, DOT_PRECISION, BLOCK_V,
                         SOFTCAP, WITH_SUM_Z, p_sup, stride_sup, i_v * BLOCK_V, SUPPORT)
        else:
            dlogits_tile(acc, i_n, o_n, o_c, v0, N, v_hi, p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg,
                         p_ge, p_mean_rel, p_gsz, p_dz, p_dbp, stride_dz, stride_dbp, inv_temp,
                         softcap, False, HAS_BIAS, NEED_DB, WITH_ENTROPY, DOT_PRECISION, BLOCK_V,
                         SOFTCAP, WITH_SUM_Z, p_sup, stride_sup, i_v * BLOCK_V, SUPPORT)


@triton.jit
def _dlogits_columns(
    acc,  # [BLOCK_N, BLOCK_V] fp32 logits of the columns c0 .. c0 + BLOCK_V of the chunk
    i_n, o_n, c0, N, v_lo, v_hi,
    p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge, p_mean_rel, p_gsz, p_dz, p_dbp, stride_dz,
    stride_dbp, inv_temp, softcap,
    HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    SOFTCAP: tl.constexpr, WITH_SUM_Z: tl.constexpr,
    p_sup=None, stride_sup=0, SUPPORT: tl.constexpr = False,
):
    """:func:`dlogits_tile` of a block of columns: the unmasked form inside N and v_hi, the masked
    one past them."""
    o_c = c0 + tl.arange(0, BLOCK_V)  # [BLOCK_V] column inside the chunk
    v0 = v_lo + c0
    if ((i_n + 1) * BLOCK_N > N) | (v0 + BLOCK_V > v_hi):
        dlogits_tile(acc, i_n, o_n, o_c, v0, N, v_hi, p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge,
                     p_mean_rel, p_gsz, p_dz, p_dbp, stride_dz, stride_dbp, inv_temp, softcap, True,
                     HAS_BIAS, NEED_DB, WITH_ENTROPY, DOT_PRECISION, BLOCK_V, SOFTCAP, WITH_SUM_Z,
                     p_sup, stride_sup, c0, SUPPORT)
    else:
        dlogits_tile(acc, i_n, o_n, o_c, v0, N, v_hi, p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge,
                     p_mean_rel, p_gsz, p_dz, p_dbp, stride_dz, stride_dbp, inv_temp, softcap,
                     False, HAS_BIAS, NEED_DB, WITH_ENTROPY, DOT_PRECISION, BLOCK_V, SOFTCAP,
                     WITH_SUM_Z, p_sup, stride_sup, c0, SUPPORT)


@triton.jit
def dlogits_tile(
    acc,  # [BLOCK_N, BLOCK_V] fp32 logits tile (before bias and temperature)
    # token block, its rows, the tile's chunk columns, first shard column, bounds
    i_n, o_n, o_c, v0, N, v_hi,
    # see bwd_dlogits_kernel
    p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge, p_mean_rel, p_gsz, p_dz, p_dbp,
    stride_dz, stride_dbp,
    inv_temp, softcap,
    MASKED: tl.constexpr,  # the tile reaches past N or v_hi (edge tiles only)
    HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr = False,
    WITH_SUM_Z: tl.constexpr = False,
    # the support's bitmask of the chunk's columns, and the tile's first column in the chunk (o_c's
    # first; only SUPPORT)
    p_sup=None, stride_sup=0, c0=0,
    SUPPORT: tl.constexpr = False,
):
    """From a logits tile to its d_logits (rounded into the workspace) and, with a bias, its fp32
    column sums.

    Per element: ``zr = z - M`` (a rounded multiply, then the subtraction: exact 0 at the max, so
    1 - p does not cancel at a peaked row; see :func:`mul_rounded`),
    ``p = 2^(zr log2(e) - log_sum log2(e))`` (one FMA and one ex2), then :func:`dlogits_finish`.
    ``MASKED``: the tile's rows and columns are masked (edge tiles); interior tiles carry no masks.
    ``SOFTCAP``: the tile is softcapped first (:func:`softcap_tile`) and the finish multiplies by
    the slope ``1 - tanh^2``. ``SUPPORT``: the columns the support does not keep (its bitmask of
    the chunk's columns, :func:`support_masked` at ``o_c``) are ``-inf`` after the transform, as
    in the forward: ``p = 0`` there, so ``dz = 0`` (the target's column is always kept).
    """
    o_v = v0 + tl.arange(0, BLOCK_V)  # [BLOCK_V] column inside the shard
    m_n = o_n < N
    if HAS_BIAS:
        if MASKED:
            acc += tl.load(p_b + o_v, mask=o_v < v_hi, other=0.0).to(tl.float32)[None, :]
        else:
            acc += tl.load(p_b + o_v).to(tl.float32)[None, :]
    b_slope = acc  # (read only with SOFTCAP)
    if SOFTCAP:
        acc, b_t = softcap_tile(acc, softcap)
        b_slope = 1.0 - b_t * b_t
    if SUPPORT:
        acc = support_masked(acc, p_sup, stride_sup, o_n, m_n, c0, BLOCK_V)
    b_rmax = tl.load(p_rmax + o_n, mask=m_n, other=0.0)
    b_lsum2 = tl.load(p_lsum + o_n, mask=m_n, other=0.0) * LOG2E
    b_zr = mul_rounded(acc, inv_temp, PTX) - b_rmax[:, None]  # z - M, exactly 0 at the row max
    b_p = exp2(b_zr * LOG2E - b_lsum2[:, None], PTX)  # [BLOCK_N, BLOCK_V]
    dlogits_finish(b_p, b_zr, i_n, o_n, o_c, v0, N, v_hi, p_tgt, p_g, p_gmg, p_ge, p_mean_rel, p_dz,
                   p_dbp, stride_dz, stride_dbp, inv_temp, MASKED, NEED_DB, WITH_ENTROPY,
                   DOT_PRECISION, BLOCK_V, b_slope, p_gsz, SOFTCAP, WITH_SUM_Z)


@triton.jit
def dlogits_finish(
    b_p, b_zr,  # [BLOCK_N, BLOCK_V] fp32 probabilities and z - M (b_zr only read WITH_ENTROPY)
    i_n, o_n, o_c, v0, N, v_hi, p_tgt, p_g, p_gmg, p_ge, p_mean_rel, p_dz, p_dbp, stride_dz,
    stride_dbp, inv_temp, MASKED: tl.constexpr, NEED_DB: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_V: tl.constexpr,
    b_slope=None,  # [BLOCK_N, BLOCK_V] fp32 the softcap's 1 - tanh^2 (only SOFTCAP)
    p_gsz=None,  # [N] fp32 grad of sum_v z (only WITH_SUM_Z)
    SOFTCAP: tl.constexpr = False, WITH_SUM_Z: tl.constexpr = False,
):
    """``dz = onehot * g/T - p * coef/T`` (one FMA; the temperature folded into the per-row factors;
    a compare and a select for the one-hot term), ``+ g_sum_z/T`` on every column (``WITH_SUM_Z``),
    times the softcap's slope (``SOFTCAP``), rounded once into the workspace; with a bias its fp32
    column sums per token block. Shared by the recompute and the kept d_logits kernels."""
    o_t = tl.arange(0, BLOCK_V)  # [BLOCK_V] column inside the tile
    o_v = v0 + o_t
    m_n = o_n < N
    b_g = tl.load(p_g + o_n, mask=m_n, other=0.0) * inv_temp
    b_gmg = tl.load(p_gmg + o_n, mask=m_n, other=0.0) * inv_temp
    b_tgt = tl.load(p_tgt + o_n, mask=m_n, other=-1)
    if WITH_ENTROPY:  # z - M floored: p = 0 there, no 0 * -inf on masked columns (NaN stays NaN)
        b_ge = tl.load(p_ge + o_n, mask=m_n, other=0.0) * inv_temp
        b_mean_rel = tl.load(p_mean_rel + o_n, mask=m_n, other=0.0)
        b_zr = tl.maximum(b_zr, RELATIVE_FLOOR, propagate_nan=tl.PropagateNan.ALL)
        b_coef = b_gmg[:, None] + b_ge[:, None] * (b_zr - b_mean_rel[:, None])
    else:
        b_coef = b_gmg[:, None]
    t_col = target_column(b_tgt, v0, BLOCK_V)
    b_dz = tl.where(o_t[None, :] == t_col[:, None], b_g[:, None], 0.0) - b_p * b_coef
    if WITH_SUM_Z:  # d(sum_v z)/dz_v = 1: the same on every column of the row
        b_dz += (tl.load(p_gsz + o_n, mask=m_n, other=0.0) * inv_temp)[:, None]
    if SOFTCAP:
        b_dz = b_dz * b_slope
    p_out = p_dz + o_n.to(tl.int64)[:, None] * stride_dz + o_c[None, :]
    m_out = None  # interior tiles: no masks
    m_db = None
    if MASKED:
        m_v = o_v < v_hi
        m_out = m_n[:, None] & m_v[None, :]
        m_db = m_v
        b_dz = tl.where(m_out, b_dz, 0.0)
    store_rounded(p_out, b_dz, m_out, DOT_PRECISION)
    if NEED_DB:
        tl.store(p_dbp + i_n.to(tl.int64) * stride_dbp + o_v, tl.sum(b_dz, 0), mask=m_db)


@triton.jit
def kept_probabilities(p_kept, p_scale, stride_kept, stride_scale, n0, N, v0, v_hi, b_rmax, b_lsum2,
                       WITH_ENTROPY: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_V: tl.constexpr, inv_temp=1.0, softcap=1.0,
                       SOFTCAP: tl.constexpr = False):
    """``(p, zr)`` of the ``[BLOCK_N, BLOCK_V]`` tile at row ``n0``, shard column ``v0`` from the
    kept terms ``e`` and their row scale ``m`` (natural units):
    ``p = e * 2^((m - M) log2(e) - log_sum log2(e))`` (one multiply per element, one ex2 per row),
    and with entropy ``zr = z - M = ln(e) + (m - M)`` (one lg2 per element: a MUFU
    :func:`.fp32_ops.log2` for 16-bit terms; ``e`` is clamped to 2^-126 first, so a flushed term
    gives a finite zr and p = 0). At the row max ``e = 1`` and ``m = M`` exactly, so ``1 - p`` does
    not cancel at a peaked target. ``MASKED``: rows at or past N and columns at or past ``v_hi``
    read as 0 (edge tiles only). ``BLOCK_V`` is the forward's tile width (one scale per row).
    Returns ``(p, zr, slope)``: ``SOFTCAP``: the scale is the running max ``t_m`` of the tanh
    (:func:`keep_tile`), ``m = (softcap t_m) / T`` rounded as the forward rounds it, and the slope
    ``1 - tanh^2 = (1 - t)(1 + t)`` with ``t = t_m + ln(e) T / softcap`` clamped to ``[-1, 1]``
    (else ``p``, not read). Where the cap saturates, ``1 - t`` is a few ulp of 1: the max's own tanh
    (``e = 1``, ``t = t_m``) keeps them, where ``z T / softcap`` (two roundings after the tanh) is
    an ulp or two off, often past 1."""
    p_in = kept_pointers(p_kept, stride_kept, n0, v0, BLOCK_N, BLOCK_V)
    o_r = n0 + tl.arange(0, BLOCK_N)
    m_r = o_r < N
    if MASKED:
        m_c = (v0 + tl.arange(0, BLOCK_V)) < v_hi
        b_e = tl.load(p_in, mask=m_r[:, None] & m_c[None, :], other=0.0).to(tl.float32)
    else:
        b_e = tl.load(p_in).to(tl.float32)
    b_m = tl.load(p_scale + o_r.to(tl.int64) * stride_scale + v0 // BLOCK_V, mask=m_r, other=0.0)
    b_tm = b_m  # [BLOCK_N] the tanh's running max (read only with SOFTCAP)
    if SOFTCAP:
        b_m = (b_tm * softcap) * inv_temp
        # m - M <= 0, exact 0 in the tile holding the row max, even where the subtraction takes the
        # product unrounded
        b_shift = tl.where(b_m == b_rmax, 0.0, b_m - b_rmax)
    else:
        b_shift = b_m - b_rmax  # m - M <= 0; exact 0 in the tile holding the row max
    b_f = exp2(b_shift * LOG2E - b_lsum2, PTX)  # [BLOCK_N]
    b_p = b_e * b_f[:, None]
    # log2(e): from 16-bit terms one MUFU lg2 per element (their rounding is far above its error)
    FAST_LOG: tl.constexpr = PTX and p_kept.dtype.element_ty != tl.float32
    b_log_e = b_p  # not read without entropy or a softcap
    if WITH_ENTROPY or SOFTCAP:
        b_log_e = log2(tl.maximum(b_e, 1.1754943508222875e-38), FAST_LOG)
    b_zr = b_p  # not read without entropy
    if WITH_ENTROPY:
        b_zr = b_log_e * LN2 + b_shift[:, None]
    b_slope = b_p  # not read without a softcap
    if SOFTCAP:
        b_t = b_log_e * (LN2 / (softcap * inv_temp)) + b_tm[:, None]
        b_t = tl.clamp(b_t, -1.0, 1.0)
        b_slope = (1.0 - b_t) * (1.0 + b_t)
    return b_p, b_zr, b_slope
