"""``@triton.jit`` tile operations shared by the forward, backward and Hopper kernels
(:mod:`.forward_kernels`, :mod:`.backward_kernels`, :mod:`.hopper_kernels`): launch order, the dot,
the exponential, the pointer kernels' K loop, the forward's online-softmax epilogue and the
backward's d_logits epilogue. Only how an operand tile reaches the dot differs between the pointer
and the TMA kernels; the arithmetic on a logits tile lives here, once.

Forward epilogue (:func:`stats_tile`: :func:`keep_tile`, then :func:`online_softmax_update`):
running per-row
statistics in raw units (``y = acc + b``, ``c = log2(e) / T``)::

    m' = max(m, max_v y);  a = (y - m') * c                  (log2 units; exact 0 at the max)
    s  = s * 2^((m - m') c) + sum 2^a
    q  = 2^((m - m') c) * (q + (m - m') c s) + sum 2^a a      (entropy only)
    t += y[target]                                           (read from the fp32 accumulator)

stored in natural units by :func:`natural_units` / :func:`store_stats`. Backward epilogue
(:func:`dlogits_tile`): ``zr = z - M``, ``p = exp(zr - log_sum)``,
``dz = g onehot - p (g - g_lse + g_ent (zr - mean_rel))``, times 1/T, rounded once to the weight
dtype. Kept terms (:func:`keep_tile`, :func:`kept_probabilities`): the forward stores each tile's
softmax terms ``exp(z - m)`` below a column bound (16 bits for 16-bit inputs) with the running max
``m`` per row and tile, the backward forms ``p`` from them instead of recomputing the GEMM
(:func:`dlogits_finish` is shared).

A masked column (``y = -inf``) gives ``2^a = 0`` and ``p = 0``: the forward's rescale subtracts
``max(m', -FLT_MAX)`` (no ``-inf - -inf`` while a row has no unmasked column yet) and the entropy's
``a`` and ``zr`` are floored at :data:`RELATIVE_FLOOR` (no ``0 * -inf``;
tplogp.support.masked_rows).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp32_ops import LN2, LOG2E, PTX, exp2, log2, mul_rounded, store_rounded, tanh

# z - M below RELATIVE_FLOOR (natural or log2 units) has p = 0 in fp32: the entropy's terms read
# z - M floored there, which changes no value but never forms 0 * -inf on a masked (-inf) column
# (tplogp.support.masked_rows)
RELATIVE_FLOOR = tl.constexpr(-1024.0)

@triton.jit
def softcap_tile(acc, softcap):
    """``(softcap * tanh(acc / softcap), tanh(acc / softcap))``: the final-logit softcap of a raw
    logits tile and its tanh (the backward's slope is ``1 - tanh^2``)."""
    b_t = tanh(acc * (1.0 / softcap), PTX)
    return b_t * softcap, b_t


@triton.jit
def grouped_ids(pid, num_a, num_b, GROUP_A: tl.constexpr):
    """Map a 1-D program id onto (i_a, i_b) so that GROUP_A consecutive a-blocks sweep b
    together."""
    num_in_group = GROUP_A * num_b
    i_group = pid // num_in_group
    first_a = i_group * GROUP_A
    group_size = tl.minimum(num_a - first_a, GROUP_A)
    i_a = first_a + (pid % num_in_group) % group_size
    i_b = (pid % num_in_group) // group_size
    return i_a, i_b


@triton.jit
def mma(b_a, b_b, acc, DOT_PRECISION: tl.constexpr):
    """acc + b_a @ b_b. DOT_PRECISION "upcast" computes 16-bit operands in fp32 (exact products;
    used by Triton's CPU interpreter, whose 16-bit dot is unreliable); otherwise it is tl.dot's
    input_precision."""
    if DOT_PRECISION == "upcast":
        return tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(b_a, b_b, acc, input_precision=DOT_PRECISION)


@triton.jit
def target_column(b_tgt, v0, BLOCK_V: tl.constexpr):
    """[BLOCK_N] int32: each row's target column inside the tile starting at vocab id ``v0``,
    or -1."""
    hit = (b_tgt >= v0) & (b_tgt < v0 + BLOCK_V)
    return tl.where(hit, b_tgt - v0, -1).to(tl.int32)


@triton.jit
def support_masked(x, p_sup, stride_sup, o_n, m_n, c0, BLOCK_V: tl.constexpr):
    """``x`` (``[BLOCK_N, BLOCK_V]``, the rows ``o_n``, the columns ``c0 .. c0 + BLOCK_V`` of the
    bitmask's range) with ``-inf`` at the columns the sampler's support does not keep: bit
    ``c % 32`` of word ``c // 32`` of the row's int32 bitmask ``p_sup`` (``stride_sup`` words a
    row; :mod:`.support_bits`) clear. Rows outside ``m_n`` and words past the row's read as 0
    (masked). Tiles of whole words (``BLOCK_V`` a multiple of 32, ``c0`` then one too: every config
    the tile tables give, and the softcap's half tiles of them) load their ``BLOCK_V / 32`` words a
    row once and expand them by broadcasting over a ``[BLOCK_N, BLOCK_V / 32, 32]`` view of ``x`` (a
    reshape of its registers, no data movement): no per-element address, a shift, an ``and`` and a
    select per element. Narrower tiles (a config shrunk to fit a small shared memory) load each
    element's word."""
    BLOCK_N: tl.constexpr = x.shape[0]
    if BLOCK_V % 32 == 0:
        WORDS: tl.constexpr = BLOCK_V // 32
        o_w = c0 // 32 + tl.arange(0, WORDS)
        words = tl.load(p_sup + o_n.to(tl.int64)[:, None] * stride_sup + o_w[None, :],
                        mask=m_n[:, None] & (o_w < stride_sup)[None, :], other=0)
        bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
        x = tl.where(bits != 0, tl.reshape(x, [BLOCK_N, WORDS, 32]), float("-inf"))
        x = tl.reshape(x, [BLOCK_N, BLOCK_V])
    else:
        o_c = c0 + tl.arange(0, BLOCK_V)
        words = tl.load(p_sup + o_n.to(tl.int64)[:, None] * stride_sup + (o_c >> 5)[None, :],
                        mask=m_n[:, None] & ((o_c >> 5) < stride_sup)[None, :], other=0)
        x = tl.where(((words >> (o_c & 31)[None, :]) & 1) != 0, x, float("-inf"))
    return x


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
def _kept_pointers(p_kept, stride_kept, n0, v0, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """Pointers to the ``[BLOCK_N, BLOCK_V]`` block at row ``n0``, column ``v0`` of the kept buffer:
    one 64-bit base, 32-bit offsets inside the block (fewer registers than 64-bit offsets per
    element)."""
    base = p_kept + n0.to(tl.int64) * stride_kept + v0
    return base + (tl.arange(0, BLOCK_N) * stride_kept)[:, None] + tl.arange(0, BLOCK_V)[None, :]


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
        store_rounded(_kept_pointers(p_kept, stride_kept, n0, v0, BLOCK_N, BLOCK_V), b_e, mask,
                      DOT_PRECISION)
        tl.store(p_scale + o_r.to(tl.int64) * stride_scale + v0 // BLOCK_V, b_scale, mask=m_r)


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
    p_in = _kept_pointers(p_kept, stride_kept, n0, v0, BLOCK_N, BLOCK_V)
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


@triton.jit
def logits_tile(
    p_h, p_w, o_n, o_v, m_n, m_v, D, stride_hn, stride_wv,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """acc[BLOCK_N, BLOCK_V] = hidden[o_n] @ weight[o_v]^T in fp32 (rows/cols outside the masks read
    as 0): the pointer kernels' K loop (the Hopper kernels load through tensor descriptors
    instead)."""
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
        acc = mma(b_a, b_b, acc, DOT_PRECISION)
        p_a += BLOCK_D
        p_b += BLOCK_D
    return acc

