"""The per-tile steps of the sampler's counting pass and collecting round
(:mod:`tplogp.op.sampler_passes`) on a GPU: each reads a logits tile once.

* :func:`bin_counts_kernel`: per row, how many logits fall in each of ``BINS`` equal bins between a
  bound ``lo`` and the row's max ``top`` (bin ``floor((top - z) s)``, ``s = BINS / (top - lo)``,
  clamped to ``[0, BINS)``; none below ``lo``), and their mass ``exp(z - lse)`` (NaN terms 0,
  ``+inf`` the largest fp32, as the torch path's). One program owns a row's ``BLOCK`` columns: per
  ``SUB`` columns a ``[BINS, SUB]`` one-hot of the logits' bins (0 / 1, exact in bf16) times a
  ``[SUB, 16]`` matrix of weights, 1 and the mass split into three bf16 parts (``e = hi + mid +
  lo`` to 24 bits), one tensor-core product accumulated in fp32 (the counts exact), summed into the
  row's bins at the end (one atomic add per bin and program). The bin is computed with the same two
  fp32 roundings as the torch path's ``_bins_of`` (a subtraction, then a multiplication: no fused
  multiply-add), so counts agree bit for bit; masses are fp32 terms summed in another order (they
  only choose the edge to collect from, with a margin; the round decides in float64).
* :func:`collect_kernel`: per row, the logits at least a threshold and their ids. One program owns
  a row's ``BLOCK`` columns: it counts its hits, reserves that many slots of the row's buffer by
  one atomic add on the row's running count (the value before the add is its first slot), and
  stores each hit at its slot from a cumulative sum over the block (slots past the buffer are not
  stored; the count still grows, so the caller sees that the row overflowed). Slots are taken in
  no fixed order across programs: the caller sorts the candidates. The largest logit below the
  threshold (NaN where the block has a NaN) goes to the program's own column of a partial buffer,
  reduced by the caller.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tile_ops import mma


@triton.jit
def bin_counts_kernel(
    z_ptr,  # [rows, cols] fp32 logits, row stride stride_z, read
    scale_ptr,  # [rows, 3] fp32: lo (the bins' bottom), top, BINS / (top - lo), read
    shift_ptr,  # [rows] fp32: the masses' log-sum-exp, read (WITH_MASS)
    counts_ptr,  # [rows, BINS] fp32, added to
    masses_ptr,  # [rows, BINS] fp32, added to (WITH_MASS)
    cols, stride_z,
    BINS: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, WITH_MASS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # tiles.dot_precision of bf16 ("upcast" in the interpreter)
):
    row = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1)
    lo = tl.load(scale_ptr + row * 3)
    top = tl.load(scale_ptr + row * 3 + 1)
    s = tl.load(scale_ptr + row * 3 + 2)
    shift = 0.0
    if WITH_MASS:
        shift = tl.load(shift_ptr + row)
    bins = tl.arange(0, BINS)
    channel = tl.arange(0, 16)  # the weights' columns: 1, then the mass in three bf16 parts
    acc = tl.zeros([BINS, 16], tl.float32)
    for start in range(0, BLOCK, SUB):
        o_c = i_b * BLOCK + start + tl.arange(0, SUB)
        m_c = o_c < cols
        b_z = tl.load(z_ptr + row * stride_z + o_c, mask=m_c, other=float("-inf"))
        at = tl.floor((top - b_z) * s)
        at = tl.minimum(tl.maximum(at, 0.0), BINS - 1.0).to(tl.int32)
        # [BINS, SUB] one-hot of the bins (0 or 1: exact in bf16)
        hit = (bins[:, None] == at[None, :]) & ((b_z >= lo) & m_c)[None, :]
        weights = tl.where(channel[None, :] == 0, 1.0, 0.0) + tl.zeros([SUB, 16], tl.float32)
        if WITH_MASS:
            # (as the torch path's nan_to_num: NaN terms 0, +inf the largest fp32)
            b_e = tl.exp(b_z - shift)
            b_e = tl.where(b_e != b_e, 0.0, tl.minimum(b_e, 3.4028234663852886e38))
            e_hi = b_e.to(tl.bfloat16).to(tl.float32)
            rest = b_e - e_hi
            e_mid = rest.to(tl.bfloat16).to(tl.float32)
            e_lo = rest - e_mid
            weights = tl.where(channel[None, :] == 1, e_hi[:, None], weights)
            weights = tl.where(channel[None, :] == 2, e_mid[:, None], weights)
            weights = tl.where(channel[None, :] == 3, e_lo[:, None], weights)
        acc = mma(tl.where(hit, 1.0, 0.0).to(tl.bfloat16), weights.to(tl.bfloat16), acc,
                  DOT_PRECISION)
    counts = tl.sum(tl.where(channel[None, :] == 0, acc, 0.0), 1)
    tl.atomic_add(counts_ptr + row * BINS + bins, counts)
    if WITH_MASS:
        in_mass = (channel[None, :] >= 1) & (channel[None, :] <= 3)
        tl.atomic_add(masses_ptr + row * BINS + bins, tl.sum(tl.where(in_mass, acc, 0.0), 1))


@triton.jit
def collect_kernel(
    z_ptr,  # [rows, cols] fp32 logits, row stride stride_z, read
    at_least_ptr,  # [rows] fp32: the threshold, read
    vals_ptr,  # [rows, m] fp32: the collected logits, written at their slots
    ids_ptr,  # [rows, m] int64: their shard-local ids (the column plus v0)
    held_ptr,  # [rows] int32: the row's running count, added to
    below_ptr,  # [rows, *] fp32, row stride stride_b: the largest logit under the threshold
    cols, stride_z, v0, m, stride_b,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1)
    o_c = i_b * BLOCK + tl.arange(0, BLOCK)
    m_c = o_c < cols
    b_z = tl.load(z_ptr + row * stride_z + o_c, mask=m_c, other=float("-inf"))
    take = (b_z >= tl.load(at_least_ptr + row)) & m_c
    below = tl.max(tl.where(take, float("-inf"), b_z), 0)
    below = tl.where(tl.sum((b_z != b_z).to(tl.int32), 0) > 0, float("nan"), below)
    tl.store(below_ptr + row * stride_b + i_b, below)
    n_take = tl.sum(take.to(tl.int32), 0)
    if n_take > 0:
        first = tl.atomic_add(held_ptr + row, n_take)
        slot = first + tl.cumsum(take.to(tl.int32), 0) - 1
        fits = take & (slot < m)
        tl.store(vals_ptr + row * m + slot, b_z, mask=fits)
        tl.store(ids_ptr + row * m + slot, (o_c + v0).to(tl.int64), mask=fits)
