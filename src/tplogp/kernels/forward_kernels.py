"""Forward kernels on pointer loads (any CUDA GPU Triton supports, and Triton's CPU interpreter):
per-shard softmax statistics in the epilogue of the logits GEMM, never writing logits; the split
merge and the one-shard finalize (which the Hopper forward, :mod:`.hopper_kernels`, shares).

Algorithm. The vocab shard ``[0, V)`` is cut into splits of ``split_tiles * BLOCK_V`` ids (a
function of V and the config only, never of N). One program owns a ``BLOCK_N`` token block and one
split; for each ``[BLOCK_N, BLOCK_V]`` tile it runs the K loop over the hidden dim (fp32
accumulator), then folds the tile into running per-row statistics (online softmax; in natural units
here, computed in raw log2 units by
:func:`.forward_epilogue.online_softmax_update`)::

    z      = (acc + b) * inv_temperature                 # masked columns -> -inf
    m'     = max(m, max_v z)
    s      = s * exp(m - m') + sum_v exp(z - m')
    q      = exp(m - m') * (q + (m - m') * s_old) + sum_v exp(z - m') (z - m')      # entropy only
    t     += z[target]    (exactly one tile of one split holds it; read from the fp32 accumulator)

Each program writes its split's (m, s, t, q) into one ``[3 or 4, S, N]`` buffer;
:func:`merge_splits_kernel` folds the S splits in a fixed order (log-add-exp), so the result is
bitwise reproducible and a row's stats do not depend on the other rows. When one shard is the whole
vocab, :func:`finalize_single_kernel` does the same fold and also finishes the per-token outputs
(logp, lse, entropy), so the TP layer runs no merge ops. Launch order is grouped (``GROUP_N`` token
blocks walk the vocab together) so a W tile read from HBM is reused from L2 by every token block of
the group. No collectives here: the TP layer merges ranks.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .fp32_ops import LOG2E
from .forward_epilogue import natural_units, split_bounds, stats_program, stats_tile, store_stats
from .tile_ops import logits_tile


@triton.jit
def fwd_stats_kernel(
    p_h,  # [N, D] hidden, in
    p_w,  # [V, D] weight shard, in
    p_b,  # [V] bias, in (unused unless HAS_BIAS)
    p_tgt,  # [N] int64 local target, in (-1: not owned)
    # [3 to 6, S, N] fp32 per split: row max, sum exp(z - max), target logit (0 if not in the split)
    p_parts,
              # [, sum exp(z - max) (z - max) WITH_ENTROPY][, sum z WITH_SUM_Z][, argmax
              # WITH_ARGMAX], out
    # [N, v_keep] softmax terms exp(z - m) of the columns below v_keep (bf16 or fp32), out (only
    # KEEP)
    p_kept,
    p_scale,  # [N, cdiv(v_keep, BLOCK_V)] fp32 running max m per row and tile, out (only KEEP)
    # [N, cdiv(V, 32)] int32 bitmask of the columns a sampler's support keeps, in (only SUPPORT)
    p_sup,
    N, V, D,
    stride_hn, stride_wv, stride_kept, stride_scale, v_keep,
    inv_temp, softcap,  # softcap: only SOFTCAP
    num_splits, plane,  # plane = S * N
    stride_sup,  # words per row of p_sup (only SUPPORT)
    SPLIT_V: tl.constexpr,  # vocab ids per split (multiple of BLOCK_V)
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr, EVEN_D: tl.constexpr, KEEP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, WITH_SUM_Z: tl.constexpr, WITH_ARGMAX: tl.constexpr,
    # the logits outside a row's support are -inf (forward_epilogue.stats_tile)
    SUPPORT: tl.constexpr,
):
    i_n, i_s, o_n, m_n, b_max, b_sum, b_tl, b_sez, b_sz, b_am = stats_program(N, num_splits,
                                                                              BLOCK_N, GROUP_N)
    b_tgt = tl.load(p_tgt + o_n, mask=m_n, other=-1)  # [BLOCK_N] int64
    c = inv_temp * LOG2E
    o_t = tl.arange(0, BLOCK_V)
    v_lo, v_full, v_hi = split_bounds(i_s, V, SPLIT_V, BLOCK_V)
    for v0 in range(v_lo, v_full, BLOCK_V):  # full tiles
        o_v = v0 + o_t
        acc = logits_tile(p_h, p_w, o_n, o_v, m_n, o_v < V, D, stride_hn, stride_wv,
                           BLOCK_N, BLOCK_V, BLOCK_D, EVEN_D, DOT_PRECISION)  # [BLOCK_N, BLOCK_V]
        b_max, b_sum, b_tl, b_sez, b_sz, b_am = stats_tile(
            acc, i_n * BLOCK_N, N, v0, V, p_b, b_tgt, b_max, b_sum, b_tl, b_sez, b_sz, b_am, c,
            softcap, p_kept, p_scale, stride_kept, stride_scale, v_keep, inv_temp, False, HAS_BIAS,
            WITH_ENTROPY, KEEP, DOT_PRECISION, BLOCK_N, BLOCK_V, False, SOFTCAP, WITH_SUM_Z,
            WITH_ARGMAX, p_sup, stride_sup, SUPPORT)
    if v_full < v_hi:  # the shard's last tile, cut by V
        o_v = v_full + o_t
        acc = logits_tile(p_h, p_w, o_n, o_v, m_n, o_v < V, D, stride_hn, stride_wv,
                           BLOCK_N, BLOCK_V, BLOCK_D, EVEN_D, DOT_PRECISION)
        b_max, b_sum, b_tl, b_sez, b_sz, b_am = stats_tile(
            acc, i_n * BLOCK_N, N, v_full, V, p_b, b_tgt, b_max, b_sum, b_tl, b_sez, b_sz, b_am, c,
            softcap, p_kept, p_scale, stride_kept, stride_scale, v_keep, inv_temp, True, HAS_BIAS,
            WITH_ENTROPY, KEEP, DOT_PRECISION, BLOCK_N, BLOCK_V, False, SOFTCAP, WITH_SUM_Z,
            WITH_ARGMAX, p_sup, stride_sup, SUPPORT)
    b_max, b_tl, b_sez, b_sz = natural_units(b_max, b_tl, b_sez, b_sz, inv_temp, softcap, SOFTCAP)
    store_stats(p_parts, plane, i_s.to(tl.int64) * N + o_n, m_n, b_max, b_sum, b_tl, b_sez,
                WITH_ENTROPY, b_sz, b_am, WITH_SUM_Z, WITH_ARGMAX)


@triton.jit
def _fold_splits(p_parts, plane, o_n, m_n, N, S, WITH_ENTROPY: tl.constexpr,
                 WITH_SUM_Z: tl.constexpr = False, WITH_ARGMAX: tl.constexpr = False):
    """Fold the S per-split stats ``p_parts [3 or 4, S, N]`` (``plane = S * N``, computed on the
    host so that Triton types it 64-bit when it needs to be; ``S`` or ``N`` may be the constant 1
    here) of the rows ``o_n`` in split order (fixed order: bitwise reproducible). No split is empty
    (each holds at least one vocab id). Returns (max, sum exp(z - max), target logit, sum
    exp(z - max)(z - max) or 0, sum z or 0, argmax or 0): the sums of z add, the argmax is a later
    split's only where its max is larger (the lowest id on ties)."""
    p_max = p_parts
    p_sum = p_max + plane
    p_tl = p_sum + plane
    p_sez = p_tl + plane  # only read WITH_ENTROPY
    b_max = tl.load(p_max + o_n, mask=m_n, other=0.0)
    b_sum = tl.load(p_sum + o_n, mask=m_n, other=0.0)
    b_tl = tl.load(p_tl + o_n, mask=m_n, other=0.0)
    b_sez = tl.zeros(o_n.shape, dtype=tl.float32)
    if WITH_ENTROPY:
        b_sez = tl.load(p_sez + o_n, mask=m_n, other=0.0)
    p_sz = p_tl + plane * (2 if WITH_ENTROPY else 1)  # only read WITH_SUM_Z
    p_am = p_sz + plane * (1 if WITH_SUM_Z else 0)  # only read WITH_ARGMAX
    b_sz = tl.zeros(o_n.shape, dtype=tl.float32)
    b_am = tl.zeros(o_n.shape, dtype=tl.float32)
    if WITH_SUM_Z:
        b_sz = tl.load(p_sz + o_n, mask=m_n, other=0.0)
    if WITH_ARGMAX:
        b_am = tl.load(p_am + o_n, mask=m_n, other=0.0)
    p_ssz, p_sam = p_sz + o_n, p_am + o_n
    p_smax, p_ssum, p_stl, p_ssez = p_max + o_n, p_sum + o_n, p_tl + o_n, p_sez + o_n  # split 0
    for _ in range(1, S):
        p_smax += N  # pointer steps: 64-bit arithmetic even when S * N exceeds 2^31
        p_ssum += N
        p_stl += N
        c_max = tl.load(p_smax, mask=m_n, other=0.0)
        c_sum = tl.load(p_ssum, mask=m_n, other=0.0)
        b_tl += tl.load(p_stl, mask=m_n, other=0.0)
        if WITH_SUM_Z:
            p_ssz += N
            b_sz += tl.load(p_ssz, mask=m_n, other=0.0)
        if WITH_ARGMAX:
            p_sam += N
            b_am = tl.where(c_max > b_max, tl.load(p_sam, mask=m_n, other=0.0), b_am)
        new_max = tl.maximum(b_max, c_max)
        # m - M, 0 for a split with no unmasked column (sum 0, max -inf: it adds 0, no -inf - -inf)
        d_a = tl.where(b_sum > 0, b_max - new_max, 0.0)
        d_c = tl.where(c_sum > 0, c_max - new_max, 0.0)
        w_a = tl.exp(d_a)
        w_c = tl.exp(d_c)
        if WITH_ENTROPY:
            p_ssez += N
            c_sez = tl.load(p_ssez, mask=m_n, other=0.0)
            b_sez = w_a * (b_sez + d_a * b_sum) + w_c * (c_sez + d_c * c_sum)
        b_sum = w_a * b_sum + w_c * c_sum
        b_max = new_max
    return b_max, b_sum, b_tl, b_sez, b_sz, b_am


@triton.jit
def merge_splits_kernel(
    # [3 to 6, S, N] fp32 per-split stats (max, sum, target logit[, sez][, sum z][, argmax]), in
    p_parts,
    o_stats,  # [3 to 6, N] fp32 merged stats, out
    N, S, plane,  # plane = S * N
    WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr, WITH_SUM_Z: tl.constexpr,
    WITH_ARGMAX: tl.constexpr,
):
    """Fold S splits into one shard's stats (for the TP layer's cross-rank merge)."""
    o_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    m_n = o_n < N
    b_max, b_sum, b_tl, b_sez, b_sz, b_am = _fold_splits(p_parts, plane, o_n, m_n, N, S,
                                                         WITH_ENTROPY, WITH_SUM_Z, WITH_ARGMAX)
    store_stats(o_stats, N, o_n, m_n, b_max, b_sum, b_tl, b_sez, WITH_ENTROPY, b_sz, b_am,
                WITH_SUM_Z, WITH_ARGMAX)


@triton.jit
def finalize_single_kernel(
    p_parts,  # [3 to 6, S, N] fp32 per-split stats, in
    p_tgt,  # [N] target ids, in (owned iff 0 <= id < V)
    # [4 to 8, N] fp32, out: logp, lse, row max M, log S, with entropy E_p[z] - M and entropy, then
    # sum z
    o_out,
            # (WITH_SUM_Z) and argmax (WITH_ARGMAX)
    # [1] int64 target verdict, out (only CHECK_TARGETS; 0 on entry): a target id outside [0, V), if
    # any
    p_flag,
    N, V, S, plane,  # plane = S * N
    WITH_ENTROPY: tl.constexpr, ACCURATE_LOG: tl.constexpr, BLOCK: tl.constexpr,
    CHECK_TARGETS: tl.constexpr, WITH_SUM_Z: tl.constexpr, WITH_ARGMAX: tl.constexpr,
):
    """One shard is the whole vocab: fold the splits and finish the per-token outputs in the same
    pass.

    ``logp = (t - M) - log S`` (NaN where no vocab id is the target), ``lse = M + log S``,
    ``E_p[z] - M = q / S``, ``entropy = log S - (E_p[z] - M)``: the same fp32 formulas as the TP
    layer's merge. A row with every column masked (``S = 0``) is settled as
    :func:`tplogp.support.masked_rows.settle_rows` settles it.
    ``CHECK_TARGETS`` (the call's default target check,
    :class:`tplogp.op.verdicts.KernelTargetCheck`): a program that finds ids outside
    ``[0, V)`` stores one of them (never 0, which is inside) to ``p_flag``; several such programs
    store such ids alike, and the host reads the flag once the kernel is done.
    """
    o_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    m_n = o_n < N
    b_max, b_sum, b_tl, b_sez, b_sz, b_am = _fold_splits(p_parts, plane, o_n, m_n, N, S,
                                                         WITH_ENTROPY, WITH_SUM_Z, WITH_ARGMAX)
    # an empty row (every column masked, S = 0): lse -inf, and M = log S = E_p[z] - M = 0 for logp
    # (-inf), the entropy (0) and the backward (tplogp.support.masked_rows)
    empty = b_sum == 0.0
    b_lse_max = b_max
    b_max = tl.where(empty, 0.0, b_max)
    b_sum = tl.where(empty, 1.0, b_sum)
    if ACCURATE_LOG:
        b_lsum = libdevice.log(b_sum)
    else:
        b_lsum = tl.log(b_sum)
    b_tgt = tl.load(p_tgt + o_n, mask=m_n, other=-1)
    owned = (b_tgt >= 0) & (b_tgt < V)
    b_logp = tl.where(owned, (b_tl - b_max) - b_lsum, float("nan"))
    if CHECK_TARGETS:
        b_bad = tl.where(m_n & (owned == 0), b_tgt, 0)
        b_lo = tl.min(b_bad, 0)
        b_pick = tl.where(b_lo < 0, b_lo, tl.max(b_bad, 0))
        tl.store(p_flag, b_pick, mask=b_pick != 0)
    tl.store(o_out + o_n, b_logp, mask=m_n)
    tl.store(o_out + N + o_n, tl.where(empty, b_lse_max, b_max + b_lsum), mask=m_n)
    tl.store(o_out + 2 * N + o_n, b_max, mask=m_n)
    tl.store(o_out + 3 * N + o_n, b_lsum, mask=m_n)
    if WITH_ENTROPY:
        b_mrel = b_sez / b_sum
        tl.store(o_out + 4 * N + o_n, b_mrel, mask=m_n)
        tl.store(o_out + 5 * N + o_n, b_lsum - b_mrel, mask=m_n)
    p_extra = o_out + (6 if WITH_ENTROPY else 4) * N
    if WITH_SUM_Z:
        tl.store(p_extra + o_n, b_sz, mask=m_n)
        p_extra += N
    if WITH_ARGMAX:
        tl.store(p_extra + o_n, b_am, mask=m_n)

