"""``@triton.jit`` tile operations that every fused kernel shares (:mod:`.forward_kernels`,
:mod:`.backward_kernels`, :mod:`.hopper_kernels`, and the two epilogues :mod:`.forward_epilogue`
and :mod:`.backward_epilogue`): the launch order of row groups, the dot, the pointer kernels' K loop
(:func:`logits_tile`), the softcap's tanh, the target's column, a support's bitmask over a tile,
the kept terms' pointers. Only how an operand tile reaches the dot differs between the pointer and
the TMA kernels; the arithmetic on a logits tile lives in the two epilogues, once.

A masked column (``y = -inf``) gives ``2^a = 0`` and ``p = 0``: the forward's rescale subtracts
``max(m', -FLT_MAX)`` (no ``-inf - -inf`` while a row has no unmasked column yet) and the entropy's
``a`` and ``zr`` are floored at :data:`RELATIVE_FLOOR` (no ``0 * -inf``;
tplogp.support.masked_rows).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp32_ops import PTX, tanh

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
def kept_pointers(p_kept, stride_kept, n0, v0, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """Pointers to the ``[BLOCK_N, BLOCK_V]`` block at row ``n0``, column ``v0`` of the kept buffer:
    one 64-bit base, 32-bit offsets inside the block (fewer registers than 64-bit offsets per
    element)."""
    base = p_kept + n0.to(tl.int64) * stride_kept + v0
    return base + (tl.arange(0, BLOCK_N) * stride_kept)[:, None] + tl.arange(0, BLOCK_V)[None, :]


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
