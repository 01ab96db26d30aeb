"""The per-tile steps of the sampler's counting pass and collecting round
(:mod:`tplogp.op.sampler_passes`) on a GPU: each reads a logits tile once.

* :func:`bin_counts_kernel`: per row, how many logits fall in each of ``BINS`` equal bins between a
  bound ``lo`` and the row's max ``top`` (bin ``floor((top - z) s)``, ``s = BINS / (top - lo)``,
  clamped to ``[0, BINS)``; none below ``lo``) and, with ``WITH_MASS``, the mass ``exp(z - shift)``
  (NaN terms 0, ``+inf`` the largest fp32, as the torch path's) of each group of ``COARSE`` bins.
  One program owns a row's ``BLOCK`` columns, ``SUB`` at a time: the counts by Triton's histogram
  (a warp's ballots over the bits of the bin), the masses by a ``[MASS_BINS, SUB]`` compare and
  select added into a register accumulator (one add per logit and group: a quarter of what all
  ``BINS`` would cost; no tensor-core product, whose one-hot went through shared memory), each
  reduced once and added into the row's bins at the end (one atomic add per bin and program). The
  bin is computed with the same two fp32 roundings as the torch path's ``bins_of`` (a
  subtraction, then a multiplication: no fused multiply-add), so counts agree bit for bit; masses
  are fp32 terms summed in another order (they only choose the edge to collect from, with a
  margin; the round decides in float64).
* :func:`grid_move_kernel`: a top-p-alone row's window on its grid (the first round's grid pass)
  after a tile raised its max: one program per row. It folds the previous tile's partial softmax
  sums into the row's float64 sum, rescales it to the new max (``exp(old max - new max)``, float64,
  as the torch path's), moves the ``BINS`` counts and masses down by as many grid steps as the
  window's top rose (``COARSE ceil(max / (COARSE width))``; the bins past the bottom dropped,
  masses rescaled) into
  the other of two buffers (no program reads what another writes; the window's top is a multiple
  of ``COARSE`` steps, so the masses' groups move whole), and writes the window's bin
  rows (bottom rounded up to fp32, top, ``BINS`` over the span) and the masses' shift (the new
  max, 0 while the row has no logit above ``-inf``) for :func:`bin_counts_kernel`, which then
  counts the tile in the new window and, with ``WITH_SUM``, writes each program's sum of
  ``exp(z - shift)`` over all of its columns (fp32 terms, summed in float64: NaN and ``+inf``
  kept, as the torch path's sum keeps them) to its own column of the partials. With ``LAST``
  (after a row's last tile) it also writes the first bin where the masses from the top reach a
  row's ``reach`` (``top_p`` plus a margin: ``tplogp.op.sampler_grid.last_bin`` of
  ``bin_masses``, in float64: the groups above the bin, then its group's counts times their
  bottoms' ``exp(bottom - lse)``), else the last bin.
* :func:`collect_kernel`: per row, the logits at least a threshold (or, ``BY_BIN``, those of the
  bins up to a last one, the bin computed as :func:`bin_counts_kernel` does: the ids it counted
  there) and their ids. One program owns
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


@triton.jit
def bin_counts_kernel(
    z_ptr,  # [rows, cols] fp32 logits, row stride stride_z, read
    scale_ptr,  # [rows, 3] fp32: lo (the bins' bottom), top, BINS / (top - lo), read
    shift_ptr,  # [rows] fp32: the masses' shift, read (WITH_MASS)
    counts_ptr,  # [rows, BINS] fp32, added to
    masses_ptr,  # [rows, BINS // COARSE] fp32, added to (WITH_MASS)
    sums_ptr,  # [rows, *] float64, row stride stride_s: each program's sum of exp(z - shift)
    cols, stride_z, stride_s,
    BINS: tl.constexpr, COARSE: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
    WITH_MASS: tl.constexpr, WITH_SUM: tl.constexpr,  # (WITH_SUM: with WITH_MASS)
):
    row = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1)
    lo = tl.load(scale_ptr + row * 3)
    top = tl.load(scale_ptr + row * 3 + 1)
    s = tl.load(scale_ptr + row * 3 + 2)
    shift = 0.0
    if WITH_MASS:
        shift = tl.load(shift_ptr + row)
    # (a dropped logit takes bin BINS: counted past the row's bins, in no group)
    counts = tl.zeros([2 * BINS], tl.int32)
    groups = tl.arange(0, BINS // COARSE)
    masses = tl.zeros([BINS // COARSE, SUB], tl.float32)
    total = tl.zeros([SUB], tl.float64)
    for start in range(0, BLOCK, SUB):
        o_c = i_b * BLOCK + start + tl.arange(0, SUB)
        m_c = o_c < cols
        b_z = tl.load(z_ptr + row * stride_z + o_c, mask=m_c, other=float("-inf"))
        at = tl.floor((top - b_z) * s)
        at = tl.minimum(tl.maximum(at, 0.0), BINS - 1.0).to(tl.int32)
        at = tl.where((b_z >= lo) & m_c, at, BINS)
        counts += tl.histogram(at, 2 * BINS)
        if WITH_MASS:
            b_e = tl.exp(b_z - shift)
            if WITH_SUM:  # (the masked columns' -inf gives 0)
                total += b_e.to(tl.float64)
            # (as the torch path's nan_to_num: NaN terms 0, +inf the largest fp32)
            b_e = tl.where(b_e != b_e, 0.0, tl.minimum(b_e, 3.4028234663852886e38))
            masses += tl.where(groups[:, None] == at[None, :] // COARSE, b_e[None, :], 0.0)
    bins = tl.arange(0, 2 * BINS)
    tl.atomic_add(counts_ptr + row * BINS + bins, counts.to(tl.float32), mask=bins < BINS)
    if WITH_MASS:
        tl.atomic_add(masses_ptr + row * (BINS // COARSE) + groups, tl.sum(masses, 1))
    if WITH_SUM:
        tl.store(sums_ptr + row * stride_s + i_b, tl.sum(total, 0))


@triton.jit
def grid_move_kernel(
    tile_max_ptr,  # [rows] fp32: the tile's max per row (NaN where it has a NaN), read
    width_ptr,  # [rows] float64: the grid's step, read
    row_max_ptr,  # [rows] fp32: the running max, updated
    top_index_ptr,  # [rows] float64: the window top's grid index (-inf: none yet), updated
    sum_ptr,  # [rows] float64: sum exp(z - running max) of the tiles before, updated
    partial_ptr,  # [rows, P] float64: the previous tile's programs' sums (zeroed once read)
    counts_ptr,  # [rows, BINS] fp32: the bins held, read
    masses_ptr,  # [rows, BINS // COARSE] fp32: their groups' masses, read
    counts_out_ptr,  # [rows, BINS] fp32: moved, written
    masses_out_ptr,  # [rows, BINS // COARSE] fp32: moved and rescaled, written
    shift_ptr,  # [rows] fp32: the masses' shift for the tile, written
    scale_ptr,  # [rows, 3] fp32: the window's bin rows, written
    reach_ptr,  # [rows] float64: the mass the bins through the last reach (top_p + a margin)
    last_ptr,  # [rows] int32: the last bin the row collects, written (LAST)
    P: tl.constexpr, BINS: tl.constexpr, COARSE: tl.constexpr, LAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    old = tl.load(row_max_ptr + row)
    t_max = tl.load(tile_max_ptr + row)
    new = tl.where((t_max != t_max) | (old != old), float("nan"), tl.maximum(old, t_max))
    base = tl.where(new == float("-inf"), 0.0, new)
    o_p = tl.arange(0, P)
    partial = tl.load(partial_ptr + row * P + o_p)
    tl.store(partial_ptr + row * P + o_p, tl.zeros([P], tl.float64))
    rescale = tl.exp((old - base).to(tl.float64))
    total = (tl.load(sum_ptr + row) + tl.sum(partial, 0)) * rescale
    width = tl.load(width_ptr + row)
    index = tl.math.ceil(new.to(tl.float64) / (COARSE * width)) * COARSE
    held_index = tl.load(top_index_ptr + row)
    finite = (index == index) & (index != float("inf")) & (index != float("-inf"))
    # (no window before, or none now: every bin out)
    moved = tl.where(finite, index, 0.0) - tl.where(held_index > float("-inf"), held_index,
                                                       -2.0 * BINS)
    moved = tl.where(finite & (moved <= BINS), moved, BINS).to(tl.int32)
    bins = tl.arange(0, BINS)
    source = bins - moved
    counts = tl.load(counts_ptr + row * BINS + source, mask=source >= 0, other=0.0)
    tl.store(counts_out_ptr + row * BINS + bins, counts)
    groups = tl.arange(0, BINS // COARSE)
    source = groups - moved // COARSE
    masses = tl.load(masses_ptr + row * (BINS // COARSE) + source, mask=source >= 0, other=0.0)
    tl.store(masses_out_ptr + row * (BINS // COARSE) + groups, masses * rescale.to(tl.float32))
    tl.store(row_max_ptr + row, new)
    tl.store(top_index_ptr + row, index)
    tl.store(sum_ptr + row, total)
    tl.store(shift_ptr + row, base)
    # the window: BINS grid steps below its top (sampler_grid._grid_scale's rows)
    top = tl.where(finite, index, 0.0) * width
    lo = top - BINS * width
    lo32 = lo.to(tl.float32)
    bits = lo32.to(tl.int32, bitcast=True)
    up = tl.where(lo32 > 0, bits + 1, tl.where(lo32 < 0, bits - 1, 1)).to(tl.float32,
                                                                           bitcast=True)
    lo32 = tl.where(lo32.to(tl.float64) < lo, up, lo32)
    s = tl.minimum(BINS / (top - lo), 3.4028234663852886e38).to(tl.float32)
    tl.store(scale_ptr + row * 3, tl.where(finite, lo32, float("inf")))
    tl.store(scale_ptr + row * 3 + 1, tl.where(finite, top.to(tl.float32), float("inf")))
    tl.store(scale_ptr + row * 3 + 2, tl.where(finite, s, float("inf")))
    if LAST:  # the first bin where the masses from the top reach `reach` (sampler_grid.last_bin)
        lse = base.to(tl.float64) + tl.log(total)
        groups_lse = masses.to(tl.float64) * tl.exp(new.to(tl.float64) - lse)
        groups_lse = tl.where(groups_lse == groups_lse, groups_lse, 0.0)
        j = groups[:, None] * COARSE + tl.arange(0, COARSE)[None, :]
        bottoms = top - width * (j + 1).to(tl.float64)
        bounds = tl.reshape(counts, (BINS // COARSE, COARSE)).to(tl.float64) * tl.exp(bottoms - lse)
        bounds = tl.where(bounds == bounds, bounds, 0.0)
        # through bin j of group G: the groups above G, then G's bins' bounds through j
        through = (tl.cumsum(groups_lse, 0) - groups_lse)[:, None] + tl.cumsum(bounds, 1)
        reached = through >= tl.load(reach_ptr + row)
        first = tl.min(tl.min(tl.where(reached, j, BINS), 1), 0)
        tl.store(last_ptr + row, tl.minimum(first, BINS - 1))


@triton.jit
def collect_kernel(
    z_ptr,  # [rows, cols] fp32 logits, row stride stride_z, read
    at_least_ptr,  # [rows] fp32: the threshold, read (not BY_BIN)
    scale_ptr,  # [rows, 3] fp32: the bins' rows, read (BY_BIN)
    last_ptr,  # [rows] int32: the last bin taken, read (BY_BIN)
    vals_ptr,  # [rows, m] fp32: the collected logits, written at their slots
    ids_ptr,  # [rows, m] int64: their shard-local ids (the column plus v0)
    held_ptr,  # [rows] int32: the row's running count, added to
    below_ptr,  # [rows, *] fp32, row stride stride_b: the largest logit under the threshold
    cols, stride_z, v0, m, stride_b,
    BLOCK: tl.constexpr, BY_BIN: tl.constexpr, BINS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1)
    o_c = i_b * BLOCK + tl.arange(0, BLOCK)
    m_c = o_c < cols
    b_z = tl.load(z_ptr + row * stride_z + o_c, mask=m_c, other=float("-inf"))
    if BY_BIN:  # the logits of bins 0 .. last, each bin as bin_counts_kernel computes it
        at = tl.floor((tl.load(scale_ptr + row * 3 + 1) - b_z) * tl.load(scale_ptr + row * 3 + 2))
        at = tl.minimum(tl.maximum(at, 0.0), BINS - 1.0)
        take = (b_z >= tl.load(scale_ptr + row * 3)) & (at <= tl.load(last_ptr + row)) & m_c
    else:
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
