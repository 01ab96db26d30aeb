"""The forward statistics kernels' epilogue (``@triton.jit``; the pointer and TMA kernels alike).

Per logits tile, :func:`stats_tile` (:func:`keep_tile`, then :func:`online_softmax_update`): running
per-row statistics in raw units (``y = acc + b``, ``c = log2(e) / T``)::

    m' = max(m, max_v y);  a = (y - m') * c                  (log2 units; exact 0 at the max)
    s  = s * 2^((m - m') c) + sum 2^a
    q  = 2^((m - m') c) * (q + (m - m') c s) + sum 2^a a      (entropy only)
    t += y[target]                                           (read from the fp32 accumulator)

stored in natural units by :func:`natural_units` / :func:`store_stats`; the programs' order over
row groups and vocab splits (:func:`stats_program`, :func:`split_bounds`). Kept terms
(:func:`keep_tile`): each tile's softmax terms ``exp(z - m)`` below a column bound (16 bits for
16-bit inputs) with the running max ``m`` per row and tile, which the backward reads instead of
recomputing the GEMM (:func:`tplogp.kernels.backward_epilogue.kept_probabilities`). Masked columns
and the entropy's floor: :mod:`.tile_ops`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp32_ops import LN2, PTX, exp2, mul_rounded, store_rounded
from .tile_ops import (RELATIVE_FLOOR, grouped_ids, kept_pointers, softcap_tile, support_masked,
                       target_column)


@triton.jit
def online_softmax_update(
    acc,  # [BLOCK_N, BLOCK_V] fp32 logits tile (before bias and temperature)
    v0, V, p_b,  # first vocab id of the tile, shard size, bias pointer (unused unless HAS_BIAS)
    b_tgt,  # [BLOCK_N] the rows' target ids (local; nobody's when outside the shard)
    # [BLOCK_N] running stats in raw units, the max in tanh units with SOFTCAP (see below)
    b_max, b_sum, b_tl, b_sez,
    # [BLOCK_N] running sum of the tile's y and the lowest column of the running max (fp32)
    b_sz, b_am,
    c,  # inv_temperature * log2(e)
    softcap,  # the final-logit softcap (only SOFTCAP)
    MASKED: tl.constexpr,  # the tile reaches past V (only a split's last tile can)
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
    SOFTCAP: tl.constexpr = False, WITH_SUM_Z: tl.constexpr = False,
    WITH_ARGMAX: tl.constexpr = False,
    # the support's bitmask of the shard's columns and the tile's rows and their mask (only
    # SUPPORT)
    p_sup=None, stride_sup=0, o_n=None, m_n=None,
    SUPPORT: tl.constexpr = False,
):
    """Fold one tile into the running row statistics; returns (max, sum, tl, sez, sz, am, terms).

    The running stats stay in the tile's raw units until :func:`store_stats`: ``y = acc + b``, max
    ``m`` of y, ``s = sum 2^((y - m) c)`` (= sum exp(z - M) with z = y / T, M = m / T), target
    ``y[target]``, and ``q = sum 2^((y - m) c) (y - m) c`` (log2 units). Per element that is a max,
    a subtraction, a multiply, one ex2 and a sum (plus, for the target, a compare and a select): the
    inverse temperature and log2(e) are one per-call constant, ``y - m`` is exact next to the max
    (so 1 - p does not cancel at a peaked row), and full tiles carry no column mask. Also returns
    the tile's terms ``2^((y - m') c) = exp(z - M')`` (what :func:`keep_tile` stores). With
    ``SOFTCAP`` the tile is first ``y = softcap * tanh((acc + b) / softcap)`` and the running max is
    kept as that of the tanh, ``t_m`` (``m = softcap * t_m`` bit for bit: rounding is monotonic),
    which :func:`keep_tile` stores as the kept terms' scale; ``WITH_SUM_Z`` sums y over the columns,
    ``WITH_ARGMAX`` keeps the lowest column of the running max (a later tile replaces it only with a
    larger max). ``SUPPORT``: the columns outside a row's support (:func:`support_masked`) are set
    to ``-inf`` after the transform, as past V: the masked-vocabulary arithmetic then gives them
    ``2^a = 0``, so the statistics are those of the support alone. Shared by the generic and the
    TMA (sm90) forward kernels. (One FMA ``y c - fl(m c)`` instead of the subtraction and the
    multiply saves an instruction but leaves the max's term at ``2^-e``, e the rounding of ``m c``:
    at a peaked row ``S`` then misses 1 by an ulp and the target's ``1 - p`` is that ulp instead
    of ~0.)
    """
    o_t = tl.arange(0, BLOCK_V)  # [BLOCK_V] column inside the tile
    if MASKED:
        m_v = (v0 + o_t) < V
    b_run = b_max  # [BLOCK_N] the running max of y
    if SOFTCAP:  # y = softcap * tanh((acc + b) / softcap), masked columns -inf after it
        if HAS_BIAS:
            if MASKED:
                acc += tl.load(p_b + v0 + o_t, mask=m_v, other=0.0).to(tl.float32)[None, :]
            else:
                acc += tl.load(p_b + v0 + o_t).to(tl.float32)[None, :]
        _, b_t = softcap_tile(acc, softcap)
        if MASKED:
            b_t = tl.where(m_v[None, :], b_t, float("-inf"))
        if SUPPORT:
            b_t = support_masked(b_t, p_sup, stride_sup, o_n, m_n, v0, BLOCK_V)
        acc = mul_rounded(b_t, softcap, PTX)  # rounded as the max's own product (no FMA with - max)
        b_tmax_t = tl.max(b_t, 1)  # the tile's max of the tanh
        b_run = mul_rounded(b_max, softcap, PTX)
    elif HAS_BIAS:
        if MASKED:
            acc += tl.load(p_b + v0 + o_t, mask=m_v, other=float("-inf")).to(tl.float32)[None, :]
        else:
            acc += tl.load(p_b + v0 + o_t).to(tl.float32)[None, :]
    elif MASKED:
        acc = tl.where(m_v[None, :], acc, float("-inf"))
    if SUPPORT and not SOFTCAP:  # (with a softcap: on the tanh, above)
        acc = support_masked(acc, p_sup, stride_sup, o_n, m_n, v0, BLOCK_V)
    t_col = target_column(b_tgt, v0, BLOCK_V)
    # from the fp32 accumulator
    b_tl += tl.sum(tl.where(o_t[None, :] == t_col[:, None], acc, 0.0), 1)
    if WITH_SUM_Z:
        if MASKED:
            b_sz += tl.sum(tl.where(m_v[None, :], acc, 0.0), 1)
        else:
            b_sz += tl.sum(acc, 1)
    if SOFTCAP:
        b_tmax = b_tmax_t * softcap  # = the tile's max of y
    else:
        b_tmax = tl.max(acc, 1)
    if WITH_ARGMAX:  # tl.argmax: the lowest column of the tile's max (NaN read as -inf)
        b_col = tl.argmax(tl.where(acc == acc, acc, float("-inf")), 1)
        b_am = tl.where(b_tmax > b_run, (v0 + b_col).to(tl.float32), b_am)
    new_max = tl.maximum(b_run, b_tmax)
    # the max subtracted: -FLT_MAX while every column so far is masked (-inf), so that no
    # -inf - -inf forms (per row; the masked columns' -inf - -FLT_MAX is still -inf)
    b_sub = tl.maximum(new_max, -3.4028234663852886e38)
    # log2 units; -inf on masked columns (acc's last use: fewer registers)
    b_arg = (acc - b_sub[:, None]) * c
    b_e = exp2(b_arg, PTX)  # masked columns give 0
    b_shift = tl.where(b_run == float("-inf"), 0.0, (b_run - new_max) * c)  # <= 0
    b_scale = exp2(b_shift, PTX)
    if WITH_ENTROPY:  # floored: e = 0 there, and no 0 * -inf on masked columns (NaN stays NaN)
        b_arg = tl.maximum(b_arg, RELATIVE_FLOOR, propagate_nan=tl.PropagateNan.ALL)
        b_sez = b_scale * (b_sez + b_shift * b_sum) + tl.sum(b_e * b_arg, 1)
    b_sum = b_sum * b_scale + tl.sum(b_e, 1)
    if SOFTCAP:
        new_max = tl.maximum(b_max, b_tmax_t)
    return new_max, b_sum, b_tl, b_sez, b_sz, b_am, b_e


@triton.jit
def stats_tile(
    acc,  # [BLOCK_N, BLOCK_V] fp32 logits tile (before bias and temperature)
    # as in online_softmax_update
    n0, N, v0, V, p_b, b_tgt, b_max, b_sum, b_tl, b_sez, b_sz, b_am, c, softcap,
    # the kept terms and scales (only KEEP)
    p_kept, p_scale, stride_kept, stride_scale, v_keep, inv_temp,
    MASKED: tl.constexpr, HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr, KEEP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    KEEP_TMA: tl.constexpr = False, SOFTCAP: tl.constexpr = False, WITH_SUM_Z: tl.constexpr = False,
    WITH_ARGMAX: tl.constexpr = False,
    p_sup=None, stride_sup=0,  # the support's bitmask of the shard's columns (only SUPPORT)
    SUPPORT: tl.constexpr = False,
):
    """The forward's epilogue of one logits tile, shared by the generic and the TMA (sm90) stats
    kernels: fold the tile into the running row stats (:func:`online_softmax_update`; with
    ``SUPPORT`` the columns outside each row's support masked), then, with
    ``KEEP`` and the tile below ``v_keep``, store its softmax terms and the running max they are
    relative to (:func:`keep_tile`); returns (max, sum, tl, sez, sz, am; the max in tanh units with
    ``SOFTCAP``, and so the kept scale). ``KEEP_TMA`` (sm90): ``p_kept`` is a tensor descriptor over
    the kept terms and the tile leaves through one TMA store (see :func:`keep_tile`)."""
    o_r = n0 + tl.arange(0, BLOCK_N)  # (read only with SUPPORT)
    b_max, b_sum, b_tl, b_sez, b_sz, b_am, b_e = online_softmax_update(
        acc, v0, V, p_b, b_tgt, b_max, b_sum, b_tl, b_sez, b_sz, b_am, c, softcap, MASKED, HAS_BIAS,
        WITH_ENTROPY, BLOCK_V, SOFTCAP, WITH_SUM_Z, WITH_ARGMAX, p_sup, stride_sup, o_r, o_r < N,
        SUPPORT)
    if KEEP:
        keep_tile(p_kept, p_scale, stride_kept, stride_scale, n0, N, v0, v_keep, b_e,
                  b_max if SOFTCAP else b_max * inv_temp, MASKED, DOT_PRECISION, BLOCK_N, BLOCK_V,
                  KEEP_TMA)
    return b_max, b_sum, b_tl, b_sez, b_sz, b_am


@triton.jit
def stats_program(N, num_splits, BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr):
    """This program's token block and vocab split (grouped order), its rows and their mask, and
    zeroed running stats (max -inf, sum, target logit, sez, sum of logits, argmax): the common
    prologue of the forward kernels."""
    i_n, i_s = grouped_ids(tl.program_id(0), tl.cdiv(N, BLOCK_N), num_splits, GROUP_N)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    b_max = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    b_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_tl = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_sez = tl.zeros([BLOCK_N], dtype=tl.float32)
    return i_n, i_s, o_n, o_n < N, b_max, b_sum, b_tl, b_sez, b_sez, b_sez


@triton.jit
def split_bounds(i_s, V, SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr):
    """Vocab range of split ``i_s``: ``(v_lo, v_full, v_hi)``; ``[v_lo, v_full)`` is whole tiles,
    ``[v_full, v_hi)`` the part of one more tile that lies below V (empty unless this is the last
    split and V % BLOCK_V != 0)."""
    v_lo = i_s * SPLIT_V
    v_hi = tl.minimum(v_lo + SPLIT_V, V)
    return v_lo, v_hi - (v_hi - v_lo) % BLOCK_V, v_hi


@triton.jit
def natural_units(b_max, b_tl, b_sez, b_sz, inv_temp, softcap=1.0, SOFTCAP: tl.constexpr = False):
    """Raw running stats (see online_softmax_update) -> stored stats: max M = m / T (``SOFTCAP``:
    m = softcap t_m, from the tanh's max), target logit z[target], sez = sum exp(z - M) (z - M)
    (log2 units times ln 2), sum_z = sum y / T. The sum and the argmax need no change."""
    if SOFTCAP:
        b_max = b_max * softcap
    return b_max * inv_temp, b_tl * inv_temp, b_sez * LN2, b_sz * inv_temp


@triton.jit
def store_stats(p_stats, plane, offs, mask, b_max, b_sum, b_tl, b_sez, WITH_ENTROPY: tl.constexpr,
                b_sz=None, b_am=None, WITH_SUM_Z: tl.constexpr = False,
                WITH_ARGMAX: tl.constexpr = False):
    """Store per-row (max, sum, target logit[, sez][, sum_z][, argmax]) at ``offs`` of the planes of
    ``p_stats`` (``plane`` elements apart: ``[3 to 6, ...]`` buffer). Pointers step plane by plane:
    64-bit even when 3 * plane exceeds 2^31."""
    tl.store(p_stats + offs, b_max, mask=mask)
    p_stats += plane
    tl.store(p_stats + offs, b_sum, mask=mask)
    p_stats += plane
    tl.store(p_stats + offs, b_tl, mask=mask)
    if WITH_ENTROPY:
        p_stats += plane
        tl.store(p_stats + offs, b_sez, mask=mask)
    if WITH_SUM_Z:
        p_stats += plane
        tl.store(p_stats + offs, b_sz, mask=mask)
    if WITH_ARGMAX:
        p_stats += plane
        tl.store(p_stats + offs, b_am, mask=mask)


@triton.jit
def keep_tile(p_kept, p_scale, stride_kept, stride_scale, n0, N, v0, v_keep, b_e, b_scale,
              MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_V: tl.constexpr, KEEP_TMA: tl.constexpr = False):
    """Store the tile's softmax terms ``b_e = exp(z - m)`` (rounded once to the kept buffer's dtype:
    the inputs' 16-bit dtype) into ``[N, v_keep]`` and the rows' running max ``b_scale = m``
    (natural units, fp32; with a softcap that of the tanh, see :func:`kept_probabilities`) into the
    scales ``[N, cdiv(v_keep, BLOCK_V)]``, column ``v0 // BLOCK_V``, when the tile lies below
    ``v_keep``; rows at or past N and columns at or past ``v_keep`` are not written. One store per
    kept element and one fp32 per row and tile, nothing for the other tiles.

    A full tile (not ``MASKED``) below ``v_keep`` lies wholly below it: ``v_keep`` is the shard's V
    or a multiple of ``workspace.CHUNK_ALIGN`` (256), which every ``BLOCK_V`` (a power of two up to
    256) divides, as it divides the tile's start. So it needs the row mask alone (fewer predicate
    registers in the store).

    ``KEEP_TMA`` (sm90): ``p_kept`` is a tensor descriptor over ``[N, v_keep]`` with a
    ``[BLOCK_N, BLOCK_V]`` block; the tile is rounded (round-to-nearest-even, as
    :func:`store_rounded` on a GPU) and leaves through one TMA store, which clips rows past N and
    columns past ``v_keep`` itself. The per-element pointers and masks of the plain stores take
    registers that the 128x256 accumulator tile does not leave: that variant spills more than twice
    as much (docs/kernels.md)."""
    tl.static_assert(256 % BLOCK_V == 0)
    if KEEP_TMA:
        if v0 < v_keep:
            p_kept.store([n0, v0], b_e.to(p_kept.dtype))
            o_r = n0 + tl.arange(0, BLOCK_N)
            tl.store(p_scale + o_r.to(tl.int64) * stride_scale + v0 // BLOCK_V, b_scale,
                     mask=o_r < N)
    elif v0 < v_keep:
        o_r = n0 + tl.arange(0, BLOCK_N)
        m_r = o_r < N
        if MASKED:
            m_c = (v0 + tl.arange(0, BLOCK_V)) < v_keep
            mask = m_r[:, None] & m_c[None, :]
        else:
            mask = m_r[:, None]
        store_rounded(kept_pointers(p_kept, stride_kept, n0, v0, BLOCK_N, BLOCK_V), b_e, mask,
                      DOT_PRECISION)
        tl.store(p_scale + o_r.to(tl.int64) * stride_scale + v0 // BLOCK_V, b_scale, mask=m_r)
