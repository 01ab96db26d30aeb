"""Fused forward: per-shard softmax statistics in the epilogue of the logits GEMM, never writing logits.

Algorithm. The vocab shard ``[0, V)`` is cut into splits of ``split_tiles * BLOCK_V`` ids (a function of V and the
config only, never of N). One program owns a ``BLOCK_N`` token block and one split; for each ``[BLOCK_N, BLOCK_V]``
tile it runs the K loop over the hidden dim (fp32 accumulator), then folds the tile into running per-row
statistics (online softmax)::

    z      = (acc + b) * inv_temperature                 # masked columns -> -inf
    m'     = max(m, max_v z)
    s      = s * exp(m - m') + sum_v exp(z - m')
    q      = exp(m - m') * (q + (m - m') * s_old) + sum_v exp(z - m') (z - m')      # entropy only
    t     += z[target]    (exactly one tile of one split holds it; read from the fp32 accumulator)

Each program writes its split's (m, s, t, q) to ``[S, N]`` buffers; :func:`_merge_splits_kernel` folds the S splits
in a fixed order (log-add-exp), so the result is bitwise reproducible and a row's stats do not depend on the other
rows. When one shard is the whole vocab, :func:`_finalize_single_kernel` does the same fold and also finishes the
per-token outputs (logp, lse, entropy), so the TP layer runs no merge ops. Launch order is grouped (``GROUP_N`` token blocks walk the vocab together) so a W tile read from HBM is
reused from L2 by every token block of the group. No collectives here: :mod:`tplogp.tp` merges ranks.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .configs import fast_exp2_available

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# PTX ex2.approx.ftz on CUDA builds (not under the CPU interpreter, not on ROCm): see _exp2.
FAST_EXP2 = tl.constexpr(fast_exp2_available())


@triton.jit
def _grouped_ids(pid, num_a, num_b, GROUP_A: tl.constexpr):
    """Map a 1-D program id onto (i_a, i_b) so that GROUP_A consecutive a-blocks sweep b together."""
    num_in_group = GROUP_A * num_b
    i_group = pid // num_in_group
    first_a = i_group * GROUP_A
    group_size = tl.minimum(num_a - first_a, GROUP_A)
    i_a = first_a + (pid % num_in_group) % group_size
    i_b = (pid % num_in_group) // group_size
    return i_a, i_b


@triton.jit
def _mma(b_a, b_b, acc, DOT_PRECISION: tl.constexpr):
    """acc + b_a @ b_b. DOT_PRECISION "upcast" computes 16-bit operands in fp32 (exact products; used by Triton's
    CPU interpreter, whose 16-bit dot is unreliable); otherwise it is tl.dot's input_precision."""
    if DOT_PRECISION == "upcast":
        return tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(b_a, b_b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _store_rounded(p_out, x, mask, DOT_PRECISION: tl.constexpr):
    """Store fp32 ``x`` in the pointer's dtype with round-to-nearest-even. Under Triton's CPU interpreter
    (DOT_PRECISION "upcast") the fp32 -> bf16 cast truncates, so the rounding is done on the bits first."""
    if DOT_PRECISION == "upcast" and p_out.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    tl.store(p_out, x.to(p_out.dtype.element_ty), mask=mask)


@triton.jit
def _logits_tile(
    p_h, p_w, o_n, o_v, m_n, m_v, D, stride_hn, stride_wv,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """acc[BLOCK_N, BLOCK_V] = hidden[o_n] @ weight[o_v]^T in fp32 (rows/cols outside the masks read as 0)."""
    o_d = tl.arange(0, BLOCK_D)
    p_a = p_h + o_n.to(tl.int64)[:, None] * stride_hn + o_d[None, :]  # [BLOCK_N, BLOCK_D]
    p_b = p_w + o_v.to(tl.int64)[None, :] * stride_wv + o_d[:, None]  # [BLOCK_D, BLOCK_V]
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        if EVEN_D:
            b_a = tl.load(p_a, mask=m_n[:, None], other=0.0)
            b_b = tl.load(p_b, mask=m_v[None, :], other=0.0)
        else:
            m_d = (d0 + o_d) < D
            b_a = tl.load(p_a, mask=m_n[:, None] & m_d[None, :], other=0.0)
            b_b = tl.load(p_b, mask=m_d[:, None] & m_v[None, :], other=0.0)
        acc = _mma(b_a, b_b, acc, DOT_PRECISION)
        p_a += BLOCK_D
        p_b += BLOCK_D
    return acc


@triton.jit
def _exp2(x, FAST: tl.constexpr):
    """``2 ** x`` in fp32. FAST: PTX ``ex2.approx.ftz.f32``, one MUFU instruction (results below 2^-126 flush to
    0: such a term is below 2^-126 of the row max's and changes no sum). Otherwise ``tl.exp2``, whose non-ftz form
    ptxas wraps in a denormal-range fix-up (about five instructions per element on sm_90)."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _target_column(b_tgt, v0, BLOCK_V: tl.constexpr):
    """[BLOCK_N] int32: each row's target column inside the tile starting at vocab id ``v0``, or -1."""
    hit = (b_tgt >= v0) & (b_tgt < v0 + BLOCK_V)
    return tl.where(hit, b_tgt - v0, -1).to(tl.int32)


@triton.jit
def _online_softmax_update(
    acc,  # [BLOCK_N, BLOCK_V] fp32 logits tile (before bias and temperature)
    o_t,  # [BLOCK_V] tl.arange(0, BLOCK_V): the column inside the tile (given, so Gluon callers can lay it out)
    v0, V, p_b,  # first vocab id of the tile, shard size, bias pointer (unused unless HAS_BIAS)
    b_tgt,  # [BLOCK_N] the rows' target ids (local; nobody's when outside the shard)
    b_max, b_sum, b_tl, b_sez,  # [BLOCK_N] running stats in raw units (see below)
    c,  # inv_temperature * log2(e)
    MASKED: tl.constexpr,  # the tile reaches past V (only a split's last tile can)
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr, FAST_EXP2: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Fold one tile into the running row statistics; returns (max, sum, tl, sez).

    The running stats stay in the tile's raw units until :func:`_store_stats`: ``y = acc + b``, max ``m`` of y,
    ``s = sum 2^((y - m) c)`` (= sum exp(z - M) with z = y / T, M = m / T), target ``y[target]``, and
    ``q = sum 2^((y - m) c) (y - m) c`` (log2 units). Per element that is a max, a subtraction, a multiply, one
    ex2 and a sum (plus, for the target, a compare and a select): the inverse temperature and log2(e) are one
    per-call constant, ``y - m`` is exact next to the max (so 1 - p does not cancel at a peaked row), and full tiles
    carry no column mask. Shared by the generic and the TMA (sm90) forward kernels. (One FMA ``y c - fl(m c)`` instead
    of the subtraction and the multiply saves an instruction but leaves the max's term at ``2^-e``, e the rounding of
    ``m c``: at a peaked row ``S`` then misses 1 by an ulp and the target's ``1 - p`` is that ulp instead of ~0.)
    """
    if MASKED:
        m_v = (v0 + o_t) < V
    if HAS_BIAS:
        if MASKED:
            acc += tl.load(p_b + v0 + o_t, mask=m_v, other=float("-inf")).to(tl.float32)[None, :]
        else:
            acc += tl.load(p_b + v0 + o_t).to(tl.float32)[None, :]
    elif MASKED:
        acc = tl.where(m_v[None, :], acc, float("-inf"))
    new_max = tl.maximum(b_max, tl.max(acc, 1))
    b_arg = (acc - new_max[:, None]) * c  # log2 units; -inf on masked columns
    b_e = _exp2(b_arg, FAST_EXP2)  # masked columns give 0
    b_shift = tl.where(b_max == float("-inf"), 0.0, (b_max - new_max) * c)  # <= 0
    b_scale = _exp2(b_shift, FAST_EXP2)
    if WITH_ENTROPY:
        if MASKED:
            b_arg = tl.where(m_v[None, :], b_arg, 0.0)  # no 0 * inf on masked columns
        b_sez = b_scale * (b_sez + b_shift * b_sum) + tl.sum(b_e * b_arg, 1)
    b_sum = b_sum * b_scale + tl.sum(b_e, 1)
    t_col = _target_column(b_tgt, v0, BLOCK_V)
    b_tl += tl.sum(tl.where(o_t[None, :] == t_col[:, None], acc, 0.0), 1)  # from the fp32 accumulator
    return new_max, b_sum, b_tl, b_sez


@triton.jit
def _stats_program(N, num_splits, BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr):
    """This program's token block and vocab split (grouped order), its rows and their mask, and zeroed running
    stats (max -inf, sum, target logit, sez): the common prologue of the forward kernels."""
    i_n, i_s = _grouped_ids(tl.program_id(0), tl.cdiv(N, BLOCK_N), num_splits, GROUP_N)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    b_max = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    b_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_tl = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_sez = tl.zeros([BLOCK_N], dtype=tl.float32)
    return i_n, i_s, o_n, o_n < N, b_max, b_sum, b_tl, b_sez


@triton.jit
def _fwd_stats_kernel(
    p_h,  # [N, D] hidden, in
    p_w,  # [V, D] weight shard, in
    p_b,  # [V] bias, in (unused unless HAS_BIAS)
    p_tgt,  # [N] int64 local target, in (-1: not owned)
    p_parts,  # [3 or 4, S, N] fp32 per split: row max, sum exp(z - max), target logit (0 if not in the split)
              # [, sum exp(z - max) (z - max) WITH_ENTROPY], out
    N, V, D,
    stride_hn, stride_wv,
    inv_temp,
    num_splits, plane,  # plane = S * N
    SPLIT_V: tl.constexpr,  # vocab ids per split (multiple of BLOCK_V)
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_n, i_s, o_n, m_n, b_max, b_sum, b_tl, b_sez = _stats_program(N, num_splits, BLOCK_N, GROUP_N)
    b_tgt = tl.load(p_tgt + o_n, mask=m_n, other=-1)  # [BLOCK_N] int64
    c = inv_temp * LOG2E
    o_t = tl.arange(0, BLOCK_V)
    v_lo, v_full, v_hi = _split_bounds(i_s, V, SPLIT_V, BLOCK_V)
    for v0 in range(v_lo, v_full, BLOCK_V):  # full tiles
        o_v = v0 + o_t
        acc = _logits_tile(p_h, p_w, o_n, o_v, m_n, o_v < V, D, stride_hn, stride_wv,
                           BLOCK_N, BLOCK_V, BLOCK_D, EVEN_D, DOT_PRECISION)  # [BLOCK_N, BLOCK_V]
        b_max, b_sum, b_tl, b_sez = _online_softmax_update(acc, o_t, v0, V, p_b, b_tgt, b_max, b_sum, b_tl, b_sez, c,
                                                           False, HAS_BIAS, WITH_ENTROPY, FAST_EXP2, BLOCK_V)
    if v_full < v_hi:  # the shard's last tile, cut by V
        o_v = v_full + o_t
        acc = _logits_tile(p_h, p_w, o_n, o_v, m_n, o_v < V, D, stride_hn, stride_wv,
                           BLOCK_N, BLOCK_V, BLOCK_D, EVEN_D, DOT_PRECISION)
        b_max, b_sum, b_tl, b_sez = _online_softmax_update(acc, o_t, v_full, V, p_b, b_tgt, b_max, b_sum, b_tl, b_sez, c,
                                                           True, HAS_BIAS, WITH_ENTROPY, FAST_EXP2, BLOCK_V)
    b_max, b_tl, b_sez = _natural_units(b_max, b_tl, b_sez, inv_temp)
    _store_stats(p_parts, plane, i_s.to(tl.int64) * N + o_n, m_n, b_max, b_sum, b_tl, b_sez, WITH_ENTROPY)


@triton.jit
def _split_bounds(i_s, V, SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr):
    """Vocab range of split ``i_s``: ``(v_lo, v_full, v_hi)``; ``[v_lo, v_full)`` is whole tiles, ``[v_full, v_hi)``
    the part of one more tile that lies below V (empty unless this is the last split and V % BLOCK_V != 0)."""
    v_lo = i_s * SPLIT_V
    v_hi = tl.minimum(v_lo + SPLIT_V, V)
    return v_lo, v_hi - (v_hi - v_lo) % BLOCK_V, v_hi


@triton.jit
def _natural_units(b_max, b_tl, b_sez, inv_temp):
    """Raw running stats (see _online_softmax_update) -> stored stats: max M = m / T, target logit z[target],
    sez = sum exp(z - M) (z - M) (log2 units times ln 2). The sum needs no change."""
    return b_max * inv_temp, b_tl * inv_temp, b_sez * LN2


@triton.jit
def _store_stats(p_stats, plane, offs, mask, b_max, b_sum, b_tl, b_sez, WITH_ENTROPY: tl.constexpr):
    """Store per-row (max, sum, target logit[, sez]) at ``offs`` of the planes of ``p_stats`` (``plane`` elements
    apart: ``[3 or 4, ...]`` buffer). Pointers step plane by plane: 64-bit even when 3 * plane exceeds 2^31."""
    tl.store(p_stats + offs, b_max, mask=mask)
    p_stats += plane
    tl.store(p_stats + offs, b_sum, mask=mask)
    p_stats += plane
    tl.store(p_stats + offs, b_tl, mask=mask)
    if WITH_ENTROPY:
        p_stats += plane
        tl.store(p_stats + offs, b_sez, mask=mask)


@triton.jit
def _fold_splits(p_parts, plane, o_n, m_n, N, S, WITH_ENTROPY: tl.constexpr):
    """Fold the S per-split stats ``p_parts [3 or 4, S, N]`` (``plane = S * N``, computed on the host so that Triton
    types it 64-bit when it needs to be; ``S`` or ``N`` may be the constant 1 here) of the rows ``o_n`` in split order
    (fixed order: bitwise reproducible). Split 0 is never empty; a later one may be (the ping-pong kernel's
    half-split of a consumer without a tile: max -inf, sum 0, target 0, sez 0) and then adds nothing. Returns (max,
    sum exp(z - max), target logit, sum exp(z - max)(z - max) or 0)."""
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
    p_smax, p_ssum, p_stl, p_ssez = p_max + o_n, p_sum + o_n, p_tl + o_n, p_sez + o_n  # split 0
    for _ in range(1, S):
        p_smax += N  # pointer steps: 64-bit arithmetic even when S * N exceeds 2^31
        p_ssum += N
        p_stl += N
        c_max = tl.load(p_smax, mask=m_n, other=0.0)
        c_sum = tl.load(p_ssum, mask=m_n, other=0.0)
        b_tl += tl.load(p_stl, mask=m_n, other=0.0)
        new_max = tl.maximum(b_max, c_max)
        d_a = b_max - new_max
        d_c = c_max - new_max
        w_a = tl.exp(d_a)
        w_c = tl.exp(d_c)
        if WITH_ENTROPY:
            p_ssez += N
            c_sez = tl.load(p_ssez, mask=m_n, other=0.0)
            d_c = tl.where(c_sum > 0, d_c, 0.0)  # an empty half-split (max -inf, sum 0) adds 0, not 0 * -inf
            b_sez = w_a * (b_sez + d_a * b_sum) + w_c * (c_sez + d_c * c_sum)
        b_sum = w_a * b_sum + w_c * c_sum
        b_max = new_max
    return b_max, b_sum, b_tl, b_sez


@triton.jit
def _merge_splits_kernel(
    p_parts,  # [3 or 4, S, N] fp32 per-split stats (max, sum, target logit[, sez]), in
    o_stats,  # [3 or 4, N] fp32 merged stats, out
    N, S, plane,  # plane = S * N
    WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):
    """Fold S splits into one shard's stats (for the TP layer's cross-rank merge)."""
    o_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    m_n = o_n < N
    b_max, b_sum, b_tl, b_sez = _fold_splits(p_parts, plane, o_n, m_n, N, S, WITH_ENTROPY)
    _store_stats(o_stats, N, o_n, m_n, b_max, b_sum, b_tl, b_sez, WITH_ENTROPY)


@triton.jit
def _finalize_single_kernel(
    p_parts,  # [3 or 4, S, N] fp32 per-split stats, in
    p_tgt,  # [N] target ids, in (owned iff 0 <= id < V)
    o_out,  # [4 or 6, N] fp32, out: logp, lse, row max M, log S, and with entropy E_p[z] - M, entropy
    N, V, S, plane,  # plane = S * N
    WITH_ENTROPY: tl.constexpr, ACCURATE_LOG: tl.constexpr, BLOCK: tl.constexpr,
):
    """One shard is the whole vocab: fold the splits and finish the per-token outputs in the same pass.

    ``logp = (t - M) - log S`` (NaN where no vocab id is the target), ``lse = M + log S``,
    ``E_p[z] - M = q / S``, ``entropy = log S - (E_p[z] - M)``: the same fp32 formulas as the TP layer's merge.
    """
    o_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    m_n = o_n < N
    b_max, b_sum, b_tl, b_sez = _fold_splits(p_parts, plane, o_n, m_n, N, S, WITH_ENTROPY)
    if ACCURATE_LOG:
        b_lsum = libdevice.log(b_sum)
    else:
        b_lsum = tl.log(b_sum)
    b_tgt = tl.load(p_tgt + o_n, mask=m_n, other=-1)
    owned = (b_tgt >= 0) & (b_tgt < V)
    b_logp = tl.where(owned, (b_tl - b_max) - b_lsum, float("nan"))
    tl.store(o_out + o_n, b_logp, mask=m_n)
    tl.store(o_out + N + o_n, b_max + b_lsum, mask=m_n)
    tl.store(o_out + 2 * N + o_n, b_max, mask=m_n)
    tl.store(o_out + 3 * N + o_n, b_lsum, mask=m_n)
    if WITH_ENTROPY:
        b_mrel = b_sez / b_sum
        tl.store(o_out + 4 * N + o_n, b_mrel, mask=m_n)
        tl.store(o_out + 5 * N + o_n, b_lsum - b_mrel, mask=m_n)
