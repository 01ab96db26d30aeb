"""The passes of :mod:`tplogp.op.sampler_support` over one rank's shard of the logits (token chunks
x vocab chunks, fp32 GEMMs with the op's logit transform, within the call's transient budget): the
candidates of a round (:func:`shard_candidates`: a token's ``M`` largest logits and their ids, the
floor and the max; for a collecting token, the ids of its top bins, gathered into slots by a
running count), the counting pass (:func:`shard_bins`: per token, how many logits fall in each of
``BINS`` bins between a bound and the max), and the tiles' arithmetic both share with top-p alone's
grid pass (:mod:`tplogp.op.sampler_grid`). The rounds, their collectives and the decisions in
float64 are :mod:`tplogp.op.sampler_support`'s (its docstring states the algorithm). No host read:
every size is a Python int from shapes.

The bins' and the collecting round's work on a tile runs as torch operations, or, on a CUDA
device where the ``triton`` source runs, as one kernel each (:func:`tile_kernels`:
:mod:`tplogp.kernels.sampler_kernels`, which states how), reading the tile once; both count the
same bins and collect the same ids.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backends import kernel_registry
from ..backends.base import ShardCall
from ..backends.native_tiles import call_logits_tile

DETERMINISTIC_ROWS = 256  # the fixed token chunk of a deterministic call (padded)
BINS = 64  # the bins of the counting pass
# the columns of a row's scatter buffers that take the logits a pass drops, on a GPU (spread over
# them by column: one per row would take every dropped logit's atomic add or store one after
# another; a CPU's scatter has no such contention and keeps one)
SPREAD = 64


def _ceil32(x: torch.Tensor) -> torch.Tensor:
    """The least fp32 value at least ``x`` (float64): an fp32 logit ``z`` is at least ``x`` exactly
    when it is at least this value."""
    y = x.float()
    return torch.where(y.double() < x, torch.nextafter(y, y.new_full((), float("inf"))), y)


def bin_scale(lo: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Per row ``[rows, 3]`` fp32: the bins' bottom (the least fp32 value at least ``lo``), top and
    ``BINS`` over their span (finite)."""
    scale = (BINS / (top - lo)).clamp(max=torch.finfo(torch.float32).max)
    return torch.stack([_ceil32(lo), top.float(), scale.float()], 1)


def bins_of(z: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The bin of each fp32 logit ``z`` ``[rows, cols]`` (``scale``: :func:`bin_scale`'s rows):
    ``floor((top - z) BINS / (top - lo))`` within ``[0, BINS)`` (0 at the top) for ``z`` at least
    ``lo``, else ``BINS``. Non-increasing in ``z`` (each step of it is), so the ids of bins
    ``0 .. b`` are a top set of the logits; the counting pass and the collecting round compute it
    alike."""
    at = (scale[:, 1:2] - z).mul_(scale[:, 2:3]).floor_().clamp_(0, BINS - 1)
    return at.masked_fill_(~(z >= scale[:, 0:1]), BINS).to(torch.int64)


def ordered(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` as int64 keys in the order of the values (``-0`` just below ``+0``)."""
    bits = x.contiguous().view(torch.int32).long()
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def from_key(key: torch.Tensor) -> torch.Tensor:
    """The fp32 values of :func:`ordered`'s keys."""
    return torch.where(key < 0, key ^ 0x7FFFFFFF, key).to(torch.int32).view(torch.float32)


def drop_columns(device: torch.device) -> int:
    """How many columns of a row's scatter buffers take the dropped logits (``SPREAD``)."""
    return SPREAD if device.type == "cuda" else 1


def _spread(v0: int, v1: int, device: torch.device):
    """Which of the drop columns each column ``v0 .. v1`` of a chunk's dropped logits takes: int64
    ``[v1 - v0]`` on a GPU, else 0 (the one column)."""
    if drop_columns(device) == 1:
        return 0
    return torch.arange(v0, v1, device=device) % SPREAD


def tile_kernels(device: torch.device):
    """:mod:`tplogp.kernels.sampler_launch` on a CUDA ``device`` where the ``triton`` source runs,
    else None (the tiles' torch operations)."""
    return kernel_registry.gpu_kernels(device, "sampler_launch")


def _threshold(scale: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Per row, the least fp32 value ``t`` whose bin (:func:`bins_of`) is at most ``last``: the
    logits of the bins ``0 .. last`` are exactly those at least ``t`` (the bin is non-increasing
    in the logit, and the bisection over the fp32 values between the bins' bottom and top
    evaluates it as the passes do); ``inf`` for ``last < 0``."""
    lo_key, hi_key = ordered(scale[:, 0]), ordered(scale[:, 1])
    for _ in range(33):  # (the keys of two fp32 values differ by less than 2^32)
        mid = (lo_key + hi_key) // 2
        fits = bins_of(from_key(mid)[:, None], scale).squeeze(1) <= last
        hi_key, lo_key = torch.where(fits, mid, hi_key), torch.where(fits, lo_key, mid + 1)
    return from_key(hi_key).masked_fill(last < 0, float("inf"))


def candidate_rows(n: int, m: int, columns: int, device: torch.device) -> torch.Tensor:
    """``n`` rows of :func:`shard_candidates`' packing with nothing found yet (``-inf`` values,
    ``-1`` ids, an ``-inf`` floor and max, 0 after them), ``columns`` more columns of 0."""
    out = torch.full((n, 2 * m + 3 + columns), float("-inf"), dtype=torch.float64, device=device)
    out[:, m:2 * m] = -1
    out[:, 2 * m + 2:] = 0
    return out


def shard_candidates(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], m: int,
                      call: ShardCall, tile_elements: int,
                      deterministic: bool, edge: Optional[torch.Tensor] = None,
                      above: Optional[torch.Tensor] = None, columns: int = 0) -> torch.Tensor:
    """Per row of ``h``, packed as float64 ``[rows, 2 m + 3]``: ``m`` candidate logits and their
    shard-local ids (``-inf`` / ``-1`` pads), the floor (every id of the shard above it is a
    candidate), and two statistics. The first ``len(edge)`` rows (``edge``: float64 ``[rows, 3]``:
    the bound ``lo``, the max and the last bin ``b``) *collect*: their candidates are this
    shard's ids of the bins ``0 .. b`` between ``lo`` and the max (:func:`bins_of`; ``m`` of
    them when more are, a row the round takes again), the floor the largest logit of the others,
    the statistics ``-inf`` (not read) and how many ids those bins hold. Or the first
    ``len(above)`` rows (``above``: float64 ``[rows]``, a min-p's ``log(min_p)``) collect the ids
    at least their running max plus ``above`` (rounded down to fp32: at least the ids of every
    logit at or above the row's max plus ``above``, whatever the later chunks' max), the floor
    the largest logit of the others, the statistics the row max and how many ids they hold (a row
    with more than ``m`` the round takes again). The other rows take the ``m`` largest logits,
    the floor the ``m + 1``-th (``-inf`` when the shard has at most ``m`` ids), the statistics the
    row max and 0. ``columns`` more columns of 0 follow (the width of the grid rows a round
    gathers with these: :func:`tplogp.op.sampler_grid.grid_columns`)."""
    n, v = h.shape[0], w.shape[0]
    out = candidate_rows(n, m, columns, h.device)
    if n == 0 or v == 0:
        return out
    c = 0 if edge is None else edge.shape[0]
    if c:
        threshold = _threshold(bin_scale(edge[:, 0], edge[:, 1]), edge[:, 2].to(torch.int64))
        _collect(out[:c], h[:c], w, b, m, call, tile_elements, deterministic, threshold=threshold)
    elif above is not None and above.shape[0]:
        c = above.shape[0]
        _collect(out[:c], h[:c], w, b, m, call, tile_elements, deterministic, offset=above)
    if c < n:
        _largest(out[c:], h[c:], w, b, m, call, tile_elements, deterministic)
    return out


def row_chunks(h: torch.Tensor, deterministic: bool):
    """``(t0, t1, rows)``: the token chunks of ``h`` (a deterministic call's padded with zero rows
    to the fixed chunk: a row's bits, whatever the batch)."""
    n = h.shape[0]
    tc = DETERMINISTIC_ROWS if deterministic else min(n, DETERMINISTIC_ROWS)
    for t0 in range(0, n, tc):
        t1 = min(t0 + tc, n)
        hc = h[t0:t1]
        if deterministic and hc.shape[0] < tc:
            hc = torch.cat([hc, hc.new_zeros(tc - hc.shape[0], hc.shape[1])])
        yield t0, t1, hc


def tile_columns(tile_elements: int, rows: int, kernels) -> int:
    """The vocab chunk of a counting, grid or collecting pass over ``rows`` token rows:
    ``tile_elements`` logits a tile where the tile kernels read it (they make no temporary of its
    size), half that where torch operations hold their int64 bins or slots and fp32 terms beside
    it."""
    return max(64, tile_elements // (rows if kernels is not None else 2 * rows))


def _merged(vals: list, ids: list, take: int) -> tuple[list, list]:
    """The ``take`` largest of candidate chunks ``vals`` (fp32 ``[rows, *]`` each) with their
    ``ids``, as one chunk: one ``topk`` of them all."""
    top, at = torch.cat(vals, 1).topk(take, dim=1)
    return [top], [torch.cat(ids, 1).gather(1, at)]


def _largest(out: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
             m: int, call: ShardCall, tile_elements: int, deterministic: bool) -> None:
    """:func:`shard_candidates`' rows that take the ``m`` largest logits, written into ``out``."""
    n, v, dev = h.shape[0], w.shape[0], h.device
    # the m largest and one more: its value is the floor (every id above it is among the m)
    take = min(m + 1, v)
    tc = DETERMINISTIC_ROWS if deterministic else min(n, DETERMINISTIC_ROWS)
    # (a chunk at least as wide as the candidates: their topk costs at most the logits' size)
    vc = max(64, take, tile_elements // tc - take)
    for t0, t1, hc in row_chunks(h, deterministic):
        rows = hc.shape[0]
        row_max = torch.full((rows,), float("-inf"), dtype=torch.float32, device=dev)
        chunk_vals, chunk_ids, held = [], [], 0
        for v0 in range(0, v, vc):
            v1 = min(v0 + vc, v)
            z = call_logits_tile(hc, w[v0:v1], None if b is None else b[v0:v1], call)
            # the chunk's largest (the first is its max, NaN first as in max)
            z_vals, z_at = z.topk(min(take, v1 - v0), dim=1)
            row_max = torch.maximum(row_max, z_vals[:, 0])
            chunk_vals.append(z_vals)
            chunk_ids.append(z_at + v0 if v0 else z_at)
            held += z_vals.shape[1]
            if held > vc and len(chunk_vals) > 1:  # (at most a chunk's width held: merged)
                chunk_vals, chunk_ids = _merged(chunk_vals, chunk_ids, take)
                held = take
        # the row's largest among the chunks' (every chunk's ``take`` largest hold the row's)
        if len(chunk_vals) > 1:
            chunk_vals, chunk_ids = _merged(chunk_vals, chunk_ids, take)
        vals, ids = chunk_vals[0], chunk_ids[0]
        keep, sent = slice(0, t1 - t0), min(m, v)
        out[t0:t1, :sent] = vals[keep, :sent].double()
        out[t0:t1, m:m + sent] = ids[keep, :sent].double()
        if v > m:
            out[t0:t1, 2 * m] = vals[keep, m].double()
        out[t0:t1, 2 * m + 1] = row_max[keep].double()


def _below32(x: torch.Tensor) -> torch.Tensor:
    """fp32 values at most ``x`` (float64), each within two ulp of it; ``+inf`` stays."""
    y = x.float()
    return torch.where(y == float("inf"), y, torch.nextafter(y, y.new_full((), float("-inf"))))


def _collect(out: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
             m: int, call: ShardCall, tile_elements: int, deterministic: bool,
             threshold: Optional[torch.Tensor] = None,
             offset: Optional[torch.Tensor] = None) -> None:
    """:func:`shard_candidates`' collecting rows, written into ``out``: per vocab chunk, the ids at
    least the row's ``threshold`` (fp32; the edge's, :func:`_threshold`), or at least its running
    max plus ``offset`` (float64, rounded down to fp32; the row max then goes to the statistics),
    get their slots from a running count (and, on the torch path, a cumulative sum along the row)
    and go into ``[rows, m]`` buffers (slots past ``m`` dropped): no host read, whatever the
    count."""
    n, v, dev = h.shape[0], w.shape[0], h.device
    tc = DETERMINISTIC_ROWS if deterministic else min(n, DETERMINISTIC_ROWS)
    kernels = tile_kernels(dev)
    vc = tile_columns(tile_elements, tc, kernels)
    drop = 0 if kernels is not None else drop_columns(dev)
    for t0, t1, hc in row_chunks(h, deterministic):
        rows = hc.shape[0]
        pad = rows - (t1 - t0)  # (padding rows: nothing collected)
        if offset is None:
            at_least = torch.cat([threshold[t0:t1], threshold.new_full((pad,), float("inf"))])
        else:
            shift = torch.cat([offset[t0:t1], offset.new_full((pad,), float("inf"))])
        row_max = torch.full((rows,), float("-inf"), dtype=torch.float32, device=dev)
        vals = torch.full((rows, m + drop), float("-inf"), dtype=torch.float32, device=dev)
        ids = torch.full((rows, m + drop), -1, dtype=torch.int64, device=dev)
        if kernels is not None:
            blocks = [kernels.collect_blocks(min(v0 + vc, v) - v0) for v0 in range(0, v, vc)]
            held = torch.zeros(rows, dtype=torch.int32, device=dev)
            below = torch.full((rows, sum(blocks)), float("-inf"), dtype=torch.float32,
                               device=dev)
        else:
            held = torch.zeros(rows, 1, dtype=torch.int32, device=dev)
            below = torch.full((rows,), float("-inf"), dtype=torch.float32, device=dev)
        b0 = 0
        for i, v0 in enumerate(range(0, v, vc)):
            v1 = min(v0 + vc, v)
            z = call_logits_tile(hc, w[v0:v1], None if b is None else b[v0:v1], call)
            if offset is not None:  # (the running max: the threshold only falls behind it)
                row_max = torch.maximum(row_max, z.amax(1))
                # (a row of -inf logits so far: nothing to collect yet)
                at_least = _below32(torch.where(row_max == float("-inf"), float("inf"),
                                                row_max.double() + shift))
            if kernels is not None:
                kernels.collect_at_least(z, at_least, v0, vals, ids, held,
                                         below[:, b0:b0 + blocks[i]])
                b0 += blocks[i]
            else:
                held = collect_tile(z, z >= at_least[:, None], v0, m, vals, ids, held, below)
        if kernels is not None:
            below, held = below.amax(1), held[:, None]
        keep = slice(0, t1 - t0)
        out[t0:t1, :m] = vals[keep, :m].double()
        out[t0:t1, m:2 * m] = torch.where(vals[keep, :m] > float("-inf"), ids[keep, :m], -1)
        out[t0:t1, 2 * m] = below[keep].double()
        out[t0:t1, 2 * m + 1] = row_max[keep].double()
        out[t0:t1, 2 * m + 2] = held[keep, 0].double()


def collect_tile(z: torch.Tensor, mask: torch.Tensor, v0: int, m: int, vals: torch.Tensor,
                 ids: torch.Tensor, held: torch.Tensor, below: torch.Tensor) -> torch.Tensor:
    """The torch path of one tile of :func:`_collect` (columns from ``v0``): its ids where
    ``mask`` scattered into ``vals`` / ``ids`` at the slots after ``held`` (``[rows, 1]``; past
    ``m``: the drop columns), ``below`` raised in place to the largest logit not taken; the new
    running count."""
    rows, cols, dev = z.shape[0], z.shape[1], z.device
    torch.maximum(below, z.masked_fill(mask, float("-inf")).max(1).values, out=below)
    slot = mask.to(torch.int32).cumsum(1, dtype=torch.int32).add_(held - 1)
    held = slot[:, -1:] + 1
    slot = torch.where(mask & (slot < m), slot, m + _spread(v0, v0 + cols, dev))
    vals.scatter_(1, slot, z)
    ids.scatter_(1, slot, torch.arange(v0, v0 + cols, device=dev).expand(rows, -1))
    return held


def moved_bins(bins: torch.Tensor, moved: torch.Tensor, step: int = 1) -> torch.Tensor:
    """``bins`` (``[..., n]``, bin 0 at the top, each ``step`` grid steps wide) of a window whose
    top rose by ``moved`` grid steps (float64, a multiple of ``step``, broadcast over the leading
    dimensions; NaN or ``inf``: every bin out): bin ``j`` takes the old bin ``j - moved / step``,
    the bins past the bottom are dropped, the new top ones are empty."""
    n = bins.shape[-1]
    moved = torch.nan_to_num(moved / step, nan=n, posinf=n).clamp(max=n).long()
    source = torch.arange(n, device=bins.device) - moved[..., None]
    inside = source >= 0
    return bins.gather(-1, source.clamp_(min=0)) * inside


def dropped_spread(at: torch.Tensor, drop: int, v0: int) -> torch.Tensor:
    """Bins ``at`` (``[rows, cols]`` of a tile's columns from ``v0``; ``BINS``: dropped) with the
    dropped ones spread over ``drop`` columns after the bins (by column)."""
    if drop == 1:
        return at
    return torch.where(at < BINS, at, BINS + _spread(v0, v0 + at.shape[1], at.device))


def shard_bins(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], scale: torch.Tensor,
               call: ShardCall, tile_elements: int, deterministic: bool) -> torch.Tensor:
    """Per row of ``h``: how many of this shard's logits fall in each of the ``BINS`` bins of
    :func:`bins_of` (``scale``: :func:`bin_scale`'s rows; bin 0 at the top), float64
    ``[rows, BINS]``. The bins hold what :func:`_collect` takes exactly (the same logits: the
    same chunks)."""
    n, v, dev = h.shape[0], w.shape[0], h.device
    out = torch.zeros(n, BINS, dtype=torch.float64, device=dev)
    if n == 0 or v == 0:
        return out
    tc = DETERMINISTIC_ROWS if deterministic else min(n, DETERMINISTIC_ROWS)
    kernels = tile_kernels(dev)
    vc = tile_columns(tile_elements, tc, kernels)
    drop = 0 if kernels is not None else drop_columns(dev)
    for t0, t1, hc in row_chunks(h, deterministic):
        rows, pad = hc.shape[0], hc.shape[0] - (t1 - t0)
        rows_scale = torch.cat([scale[t0:t1], scale.new_full((pad, 3), float("inf"))])
        counts = torch.zeros(rows, BINS + drop, dtype=torch.float32, device=dev)
        for v0 in range(0, v, vc):
            v1 = min(v0 + vc, v)
            z = call_logits_tile(hc, w[v0:v1], None if b is None else b[v0:v1], call)
            if kernels is not None:
                kernels.count_bins(z, rows_scale, counts)
            else:
                counts.scatter_add_(1, dropped_spread(bins_of(z, rows_scale), drop, v0),
                                    torch.ones_like(z))
        out[t0:t1] = counts[: t1 - t0, :BINS].double()
    return out


__all__ = ["DETERMINISTIC_ROWS", "BINS", "SPREAD", "bin_scale", "moved_bins", "ordered", "from_key",
           "drop_columns", "tile_kernels", "candidate_rows", "shard_candidates", "shard_bins"]
