"""Hopper (sm_90) variants of the fused kernels: tensor-memory-accelerator (TMA) tile loads.

Same algorithm and the same epilogues (:mod:`.forward_epilogue`, :mod:`.backward_epilogue`) as
:mod:`.forward_kernels` and :mod:`.backward_kernels` (read their docstrings); the difference is how
operand tiles reach shared memory. ``hidden`` and ``weight`` are read through host-built tensor descriptors, so each
``[BLOCK_N, BLOCK_D]`` / ``[BLOCK_V, BLOCK_D]`` tile is one bulk tensor copy (out-of-range rows and
columns come back as zeros, no mask arithmetic), feeding wgmma from shared memory. Optionally the K
loop is warp-specialized (producer warps issue the copies, consumer warpgroups run the MMAs and the
softmax epilogue).

Usable only when the descriptors are legal: 16-byte aligned base pointers and row strides
(``D * itemsize % 16``). The programs (:mod:`.forward_programs`, :mod:`.backward_programs`) launch the pointer kernels otherwise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp32_ops import LOG2E
from .backward_epilogue import dlogits_epilogue
from .forward_epilogue import natural_units, split_bounds, stats_program, stats_tile, store_stats
from .tile_ops import grouped_ids, mma


@triton.jit
def _logits_tile_tma(
    d_h, d_w, off_n, off_v, D,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """fp32 ``[BLOCK_N, BLOCK_V]`` logits tile from two tensor descriptors."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for d0 in tl.range(0, D, BLOCK_D, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
        b_a = d_h.load([off_n, d0])  # [BLOCK_N, BLOCK_D]
        b_b = d_w.load([off_v, d0])  # [BLOCK_V, BLOCK_D]
        acc = mma(b_a, b_b.T, acc, DOT_PRECISION)
    return acc


@triton.jit
def fwd_stats_tma_kernel(
    d_h,  # descriptor over hidden [N, D], block [BLOCK_N, BLOCK_D]
    d_w,  # descriptor over weight [V, D], block [BLOCK_V, BLOCK_D]
    p_b,  # [V] bias (unused unless HAS_BIAS)
    p_tgt,  # [N] int64 local target (-1: not owned)
    p_parts,  # [3 or 4, S, N] fp32 split stats, out (see fwd_stats_kernel)
    # [N, v_keep] kept softmax terms, out (only KEEP; see fwd_stats_kernel); with KEEP_TMA a
    # descriptor
    p_kept,
    # over them, block [BLOCK_N, BLOCK_V]
    p_scale,  # [N, cdiv(v_keep, BLOCK_V)] fp32 their running max per row and tile, out (only KEEP)
    p_sup,  # [N, cdiv(V, 32)] int32 the support's bitmask, in (only SUPPORT; see fwd_stats_kernel)
    N, V, D,
    stride_kept, stride_scale, v_keep,
    inv_temp, softcap,  # softcap: only SOFTCAP
    num_splits, plane,  # plane = S * N
    stride_sup,  # words per row of p_sup (only SUPPORT)
    SPLIT_V: tl.constexpr,
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr, KEEP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, NUM_STAGES: tl.constexpr,
    KEEP_TMA: tl.constexpr,  # the kept terms leave through TMA stores (forward_epilogue.keep_tile)
    SOFTCAP: tl.constexpr, WITH_SUM_Z: tl.constexpr, WITH_ARGMAX: tl.constexpr,
    SUPPORT: tl.constexpr,
):
    i_n, i_s, o_n, m_n, b_max, b_sum, b_tl, b_sez, b_sz, b_am = stats_program(N, num_splits,
                                                                              BLOCK_N, GROUP_N)
    b_tgt = tl.load(p_tgt + o_n, mask=m_n, other=-1)
    c = inv_temp * LOG2E
    v_lo, v_full, v_hi = split_bounds(i_s, V, SPLIT_V, BLOCK_V)
    for v0 in range(v_lo, v_full, BLOCK_V):  # full tiles
        acc = _logits_tile_tma(d_h, d_w, i_n * BLOCK_N, v0, D, BLOCK_N, BLOCK_V, BLOCK_D,
                               DOT_PRECISION, WARP_SPECIALIZE, NUM_STAGES)  # [BLOCK_N, BLOCK_V]
        b_max, b_sum, b_tl, b_sez, b_sz, b_am = stats_tile(
            acc, i_n * BLOCK_N, N, v0, V, p_b, b_tgt, b_max, b_sum, b_tl, b_sez, b_sz, b_am, c,
            softcap, p_kept, p_scale, stride_kept, stride_scale, v_keep, inv_temp, False, HAS_BIAS,
            WITH_ENTROPY, KEEP, DOT_PRECISION, BLOCK_N, BLOCK_V, KEEP_TMA, SOFTCAP, WITH_SUM_Z,
            WITH_ARGMAX, p_sup, stride_sup, SUPPORT)
    if v_full < v_hi:  # the shard's last tile, cut by V
        acc = _logits_tile_tma(d_h, d_w, i_n * BLOCK_N, v_full, D, BLOCK_N, BLOCK_V, BLOCK_D,
                               DOT_PRECISION, WARP_SPECIALIZE, NUM_STAGES)
        b_max, b_sum, b_tl, b_sez, b_sz, b_am = stats_tile(
            acc, i_n * BLOCK_N, N, v_full, V, p_b, b_tgt, b_max, b_sum, b_tl, b_sez, b_sz, b_am, c,
            softcap, p_kept, p_scale, stride_kept, stride_scale, v_keep, inv_temp, True, HAS_BIAS,
            WITH_ENTROPY, KEEP, DOT_PRECISION, BLOCK_N, BLOCK_V, KEEP_TMA, SOFTCAP, WITH_SUM_Z,
            WITH_ARGMAX, p_sup, stride_sup, SUPPORT)
    b_max, b_tl, b_sez, b_sz = natural_units(b_max, b_tl, b_sez, b_sz, inv_temp, softcap, SOFTCAP)
    store_stats(p_parts, plane, i_s.to(tl.int64) * N + o_n, m_n, b_max, b_sum, b_tl, b_sez,
                WITH_ENTROPY, b_sz, b_am, WITH_SUM_Z, WITH_ARGMAX)


@triton.jit
def bwd_dlogits_tma_kernel(
    d_h,  # descriptor over hidden [N, D], block [BLOCK_N, BLOCK_D]
    d_w,  # descriptor over weight [V, D], block [BLOCK_V, BLOCK_D]
    p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge, p_mean_rel, p_gsz,  # see bwd_dlogits_kernel
    p_dz,  # [N, v_hi - v_lo] d_logits workspace, out
    p_dbp,  # [cdiv(N, BLOCK_N), V] fp32 partial d_bias, out (only NEED_DB)
    p_sup,  # [N, cdiv(v_hi - v_lo, 32)] int32 the support's bitmask of the chunk (only SUPPORT)
    N, V, D, v_lo, v_hi,
    stride_dz, stride_dbp,
    stride_sup,  # words per row of p_sup (only SUPPORT)
    inv_temp, softcap,
    HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, NUM_STAGES: tl.constexpr,
    SOFTCAP: tl.constexpr, WITH_SUM_Z: tl.constexpr,
    SUPPORT: tl.constexpr,
):
    i_n, i_v = grouped_ids(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(v_hi - v_lo, BLOCK_V),
                           GROUP_N)
    acc = _logits_tile_tma(d_h, d_w, i_n * BLOCK_N, v_lo + i_v * BLOCK_V, D, BLOCK_N, BLOCK_V,
                           BLOCK_D,
                           DOT_PRECISION, WARP_SPECIALIZE, NUM_STAGES)  # [BLOCK_N, BLOCK_V]
    dlogits_epilogue(acc, i_n, i_v, N, v_lo, v_hi, p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge,
                     p_mean_rel, p_gsz,
                      p_dz, p_dbp, stride_dz, stride_dbp, inv_temp, softcap, HAS_BIAS, NEED_DB,
                      WITH_ENTROPY, DOT_PRECISION, BLOCK_N, BLOCK_V, SOFTCAP, WITH_SUM_Z, p_sup,
                      stride_sup, SUPPORT)
