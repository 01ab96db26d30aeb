"""The passes of :mod:`tplogp.op.sampler_support` over one rank's shard of the logits (token chunks
x vocab chunks, fp32 GEMMs with the op's logit transform, within the call's transient budget): the
candidates of a round (:func:`shard_candidates`: a token's ``M`` largest logits and their ids, the
floor and the max; for a collecting token, the ids of its top bins, gathered into slots by a
running count; for a top-p-alone token of the first round, its max, softmax sum and the counts and
masses of ``BINS`` bins on a grid below its running max), and the counting pass
(:func:`shard_bins`: per token, how many logits fall in each of ``BINS`` bins between a bound and
the max). The rounds,
their collectives and the decisions in float64 are :mod:`tplogp.op.sampler_support`'s (its docstring
states the algorithm). No host read: every size is a Python int from shapes.

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
# top-p alone collects down to the bin where the counted mass passes top_p by this much (the
# masses are sums of fp32 terms; the round decides in float64)
MASS_MARGIN = 1e-4
# the grid pass sums masses over groups of COARSE bins (MASS_BINS of them): a logit's mass goes to
# one of 16 sums, not 64 (a quarter of the work a logit; the fine bins' counts bound the rest)
COARSE = 4
MASS_BINS = BINS // COARSE
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


def _bins_of(z: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
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
    """Per row, the least fp32 value ``t`` whose bin (:func:`_bins_of`) is at most ``last``: the
    logits of the bins ``0 .. last`` are exactly those at least ``t`` (the bin is non-increasing
    in the logit, and the bisection over the fp32 values between the bins' bottom and top
    evaluates it as the passes do); ``inf`` for ``last < 0``."""
    lo_key, hi_key = ordered(scale[:, 0]), ordered(scale[:, 1])
    for _ in range(33):  # (the keys of two fp32 values differ by less than 2^32)
        mid = (lo_key + hi_key) // 2
        fits = _bins_of(from_key(mid)[:, None], scale).squeeze(1) <= last
        hi_key, lo_key = torch.where(fits, mid, hi_key), torch.where(fits, lo_key, mid + 1)
    return from_key(hi_key).masked_fill(last < 0, float("inf"))


def _grid_columns(m: int) -> int:
    """The columns of :func:`shard_candidates`' rows when some take grid bins: ``2 m + 3``, then
    the grid top's index, the ``BINS`` counts and the ``MASS_BINS`` masses."""
    return 2 * m + 4 + BINS + MASS_BINS


def shard_candidates(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], m: int,
                      call: ShardCall, tile_elements: int,
                      deterministic: bool, edge: Optional[torch.Tensor] = None,
                      above: Optional[torch.Tensor] = None,
                      grid: Optional[torch.Tensor] = None,
                      grid_p: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per row of ``h``, packed as float64 ``[rows, 2 m + 3]``: ``m`` candidate logits and their
    shard-local ids (``-inf`` / ``-1`` pads), the floor (every id of the shard above it is a
    candidate), and two statistics. The first ``len(edge)`` rows (``edge``: float64 ``[rows, 3]``:
    the bound ``lo``, the max and the last bin ``b``) *collect*: their candidates are this
    shard's ids of the bins ``0 .. b`` between ``lo`` and the max (:func:`_bins_of`; ``m`` of
    them when more are, a row the round takes again), the floor the largest logit of the others,
    the statistics ``-inf`` (not read) and how many ids those bins hold. Or the first
    ``len(above)`` rows (``above``: float64 ``[rows]``, a min-p's ``log(min_p)``) collect the ids
    at least their running max plus ``above`` (rounded down to fp32: at least the ids of every
    logit at or above the row's max plus ``above``, whatever the later chunks' max), the floor
    the largest logit of the others, the statistics the row max and how many ids they hold (a row
    with more than ``m`` the round takes again). The other rows take the ``m`` largest logits,
    the floor the ``m + 1``-th (``-inf`` when the shard has at most ``m`` ids), the statistics the
    row max and 0. The last ``len(grid)`` rows
    (``grid``: float64 ``[rows]``, a bin width) take no candidates (the floor their row max) but
    the row max, ``sum exp(z - max)`` and bins on a grid (:func:`_grid_bins`), in the
    :func:`_grid_columns` after the others' (0 for the other rows); given their ``top_p``
    (``grid_p``: one shard, the whole vocabulary) and where one tile holds a row chunk's logits,
    they also collect the ids their bins say the support can reach, from that tile (the floor the
    largest logit left, ``inf`` where more than ``m`` were: :func:`_collect_in_window`)."""
    n, v, dev = h.shape[0], w.shape[0], h.device
    g = 0 if grid is None else grid.shape[0]
    width = _grid_columns(m) if g else 2 * m + 3
    out = torch.full((n, width), float("-inf"), dtype=torch.float64, device=dev)
    out[:, m:2 * m] = -1
    out[:, 2 * m + 2:] = 0
    if n == 0 or v == 0:
        return out
    if g:
        _grid_bins(out[n - g:], h[n - g:], w, b, m, grid, call, tile_elements, deterministic,
                   grid_p)
        n, h = n - g, h[:n - g]
        if n == 0:
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


def _row_chunks(h: torch.Tensor, deterministic: bool):
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


def _tile_columns(tile_elements: int, rows: int, kernels) -> int:
    """The vocab chunk of a counting, grid or collecting pass over ``rows`` token rows:
    ``tile_elements`` logits a tile where the tile kernels read it (beside it at most one fp32
    temporary of its size: the grid pass's softmax terms), half that where torch operations hold
    their int64 bins or slots beside it."""
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
    for t0, t1, hc in _row_chunks(h, deterministic):
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
    vc = _tile_columns(tile_elements, tc, kernels)
    drop = 0 if kernels is not None else drop_columns(dev)
    for t0, t1, hc in _row_chunks(h, deterministic):
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
                held = _collect_tile(z, z >= at_least[:, None], v0, m, vals, ids, held, below)
        if kernels is not None:
            below, held = below.amax(1), held[:, None]
        keep = slice(0, t1 - t0)
        out[t0:t1, :m] = vals[keep, :m].double()
        out[t0:t1, m:2 * m] = torch.where(vals[keep, :m] > float("-inf"), ids[keep, :m], -1)
        out[t0:t1, 2 * m] = below[keep].double()
        out[t0:t1, 2 * m + 1] = row_max[keep].double()
        out[t0:t1, 2 * m + 2] = held[keep, 0].double()


def _collect_tile(z: torch.Tensor, mask: torch.Tensor, v0: int, m: int, vals: torch.Tensor,
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


def _count_tile(z: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor, kernels,
                v0: int) -> None:
    """Add a tile's logits ``z`` (columns from ``v0``) to the bins of ``scale``'s rows
    (:func:`_bins_of`): ``counts`` ``[rows, BINS + drop columns]`` (the logits below a row's
    bottom go to the drop columns). One kernel where ``kernels`` run, else torch operations."""
    if kernels is not None:
        kernels.count_bins(z, scale, counts)
        return
    counts.scatter_add_(1, _dropped_spread(_bins_of(z, scale), counts.shape[1] - BINS, v0),
                        torch.ones_like(z))


def _dropped_spread(at: torch.Tensor, drop: int, v0: int) -> torch.Tensor:
    """Bins ``at`` (``[rows, cols]`` of a tile's columns from ``v0``; ``BINS``: dropped) with the
    dropped ones spread over ``drop`` columns after the bins (by column)."""
    if drop == 1:
        return at
    return torch.where(at < BINS, at, BINS + _spread(v0, v0 + at.shape[1], at.device))


def _grid_scale(top_index: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """:func:`bin_scale`'s rows for the window of ``BINS`` grid bins of ``width`` (float64) whose
    top is ``top_index * width``: bin ``j`` is the grid step ``top_index - j - 1``; a row without a
    finite top (no logit above ``-inf``) drops every logit."""
    top = top_index * width
    scale = bin_scale(top - BINS * width, top)
    return scale.masked_fill_(~torch.isfinite(top)[:, None], float("inf"))


def grid_index(row_max: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """The index of a window's top on the grid of ``width`` (float64) for a row max (fp32): the
    least multiple of ``COARSE`` steps at least the max (the masses' groups of bins then move as
    whole groups)."""
    return torch.ceil(row_max.double() / (COARSE * width)) * COARSE


def _grid_bins(out: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
               m: int, width: torch.Tensor, call: ShardCall, tile_elements: int,
               deterministic: bool, top_p: Optional[torch.Tensor] = None) -> None:
    """:func:`shard_candidates`' grid rows, written into ``out``: in one pass over the logits, the
    row max, ``sum exp(z - max)`` (fp32 terms, float64 sums), the counts of the ``BINS`` bins of
    ``width`` on a grid fixed before the pass (its steps ``i * width``) below the running max and
    the masses (``exp(z - max)``, fp32 terms) of their ``MASS_BINS`` groups of ``COARSE``: the
    window's top is the least multiple of ``COARSE`` steps at least the max (:func:`grid_index`).
    When a chunk raises the max past it the window moves up, the bins held move down as many
    bins (those past the bottom dropped) and the masses are rescaled to the new max, as the sum
    is; the chunk's logits are then counted in the new window (:func:`_bins_of`). Every rank's
    window lies on the same grid, so the ranks' bins merge by their tops' indices. With ``top_p``
    and one tile per row chunk, the rows then collect from that tile
    (:func:`_collect_in_window`)."""
    n, v, dev = h.shape[0], w.shape[0], h.device
    tc = DETERMINISTIC_ROWS if deterministic else min(n, DETERMINISTIC_ROWS)
    kernels = tile_kernels(dev)
    vc = _tile_columns(tile_elements, tc, kernels)
    whole = top_p is not None and vc >= v  # (the tile in hand holds all of a row chunk's logits)
    for t0, t1, hc in _row_chunks(h, deterministic):
        pad = hc.shape[0] - (t1 - t0)
        rows_width = torch.cat([width[t0:t1], width.new_ones(pad)])
        tiles = [call_logits_tile(hc, w[v0:v0 + vc], None if b is None else b[v0:v0 + vc], call)
                 for v0 in range(0, v, vc)] if whole else \
            (call_logits_tile(hc, w[v0:v0 + vc], None if b is None else b[v0:v0 + vc], call)
             for v0 in range(0, v, vc))
        if kernels is not None:  # (three launches a tile: kernels.GridRows)
            state = kernels.GridRows(rows_width, vc, BINS, COARSE)
            for z in tiles:
                state.add_tile(z)
            stats = state.result()
        else:
            stats = _grid_tiles(tiles, rows_width)
        _grid_out(out[t0:t1], m, *stats)
        if whole:
            rows_p = torch.cat([top_p[t0:t1], top_p.new_ones(pad)])
            _collect_in_window(out[t0:t1], tiles[0], m, stats, rows_width, rows_p, kernels)


def _grid_tiles(tiles, width: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The torch path of :func:`_grid_bins` over a row chunk's ``tiles`` (their columns in order):
    ``(row max, sum exp(z - max), top index, counts, masses)``."""
    rows, dev = width.shape[0], width.device
    drop = drop_columns(dev)
    row_max = torch.full((rows,), float("-inf"), dtype=torch.float32, device=dev)
    top_index = torch.full((rows,), float("-inf"), dtype=torch.float64, device=dev)
    sum_exp = torch.zeros(rows, dtype=torch.float64, device=dev)
    counts = torch.zeros(rows, BINS + drop, dtype=torch.float32, device=dev)
    masses = torch.zeros(rows, MASS_BINS + drop, dtype=torch.float32, device=dev)
    v0 = 0
    for z in tiles:
        new_max = torch.maximum(row_max, z.amax(1))
        base = torch.where(new_max == float("-inf"), 0.0, new_max)  # (masked rows: S = 0)
        rescale = torch.exp((row_max - base).double())
        sum_exp = sum_exp * rescale + torch.sub(z, base[:, None]).exp_().sum(
            1, dtype=torch.float64)
        new_index = grid_index(new_max, width)
        counts[:, :BINS] = moved_bins(counts[:, :BINS], new_index - top_index)
        masses[:, :MASS_BINS] = moved_bins(masses[:, :MASS_BINS], new_index - top_index,
                                           COARSE) * rescale.float()[:, None]
        row_max, top_index = new_max, new_index
        at = _dropped_spread(_bins_of(z, _grid_scale(top_index, width)), drop, v0)
        counts.scatter_add_(1, at, torch.ones_like(z))
        groups = torch.where(at < BINS, at // COARSE, at - BINS + MASS_BINS)
        masses.scatter_add_(1, groups, torch.exp(z - base[:, None]).nan_to_num_(nan=0.0))
        v0 += z.shape[1]
    return row_max, sum_exp, top_index, counts, masses


def _grid_out(out: torch.Tensor, m: int, row_max: torch.Tensor, sum_exp: torch.Tensor,
              top_index: torch.Tensor, counts: torch.Tensor, masses: torch.Tensor) -> None:
    """A row chunk's grid statistics written into its rows of :func:`shard_candidates`' ``out``
    (the chunk's padding rows left out)."""
    keep = slice(0, out.shape[0])
    out[:, 2 * m] = row_max[keep].double()
    out[:, 2 * m + 1] = row_max[keep].double()
    out[:, 2 * m + 2] = sum_exp[keep]
    out[:, 2 * m + 3] = top_index[keep]
    out[:, 2 * m + 4:2 * m + 4 + BINS] = counts[keep, :BINS].double()
    out[:, 2 * m + 4 + BINS:] = masses[keep, :MASS_BINS].double()


def bin_masses(counts: torch.Tensor, groups: torch.Tensor, top: torch.Tensor,
               width: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Per bin of a grid window (``counts`` ``[..., rows, BINS]``; ``groups``: the masses
    ``exp(z - lse)`` of its ``MASS_BINS`` groups of ``COARSE`` bins; the window's ``top``, its bins'
    ``width`` and ``lse``: float64 ``[rows]``), a mass whose sum from the top through any bin is at
    most the logits' there: a bin's is its count times ``exp(bottom - lse)`` (each of its logits at
    least its bottom), and the first bin of a group adds the group above's mass less those bounds
    of its bins. So the sum through a bin is its group's cumulative mass above it plus the bounds
    of its group's bins through it; exact at the end of every group but its own bins' bounds."""
    bottoms = top[:, None] - width[:, None] * torch.arange(1, BINS + 1, device=top.device)
    bounds = (counts * torch.exp(bottoms - lse[:, None])).nan_to_num_(nan=0.0)
    by_group = bounds.view(*bounds.shape[:-1], MASS_BINS, COARSE)
    rest = groups - by_group.sum(-1)  # (a group's mass past its bins' bounds)
    masses = by_group.clone()
    masses[..., 1:, 0] += rest[..., :-1]
    return masses.view_as(bounds)


def last_bin(masses: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the first bin where the masses (``[rows, BINS]``, :func:`bin_masses`) summed from
    the top pass ``top_p`` by ``MASS_MARGIN`` (the masses are sums of fp32 terms; the rounds
    decide in float64), else the last (int64 ``[rows]``)."""
    reached = masses.cumsum(1) >= top_p[:, None] + MASS_MARGIN
    return torch.where(reached.any(1), reached.long().argmax(1), BINS - 1)


def _collect_in_window(out: torch.Tensor, z: torch.Tensor, m: int, stats: tuple,
                       width: torch.Tensor, top_p: torch.Tensor, kernels) -> None:
    """The grid rows of one shard (the whole vocabulary) whose logits ``z`` one tile holds
    (``[rows, V]``, a row chunk with its padding rows; ``stats``: :func:`_grid_tiles`' of that
    tile): the ids of the bins down to the first where the masses from the top pass ``top_p``
    (:func:`bin_masses`, :func:`last_bin`) collected into ``out``'s candidates (its rows: those
    of the chunk, not its padding), the floor the largest logit left, ``inf`` where the bins held
    more than ``m`` ids (the row is then not decided: it collects in the next round)."""
    row_max, sum_exp, top_index, counts, groups = stats
    rows, dev = z.shape[0], z.device
    base = torch.where(row_max == float("-inf"), 0.0, row_max).double()
    lse = base + torch.log(sum_exp)
    shifted = groups[:, :MASS_BINS].double() * torch.exp(row_max.double() - lse)[:, None]
    masses = bin_masses(counts[:, :BINS].double(), shifted.nan_to_num_(nan=0.0),
                        top_index * width, width, lse)
    last = last_bin(masses, top_p)
    scale = _grid_scale(top_index, width)
    drop = 0 if kernels is not None else drop_columns(dev)
    vals = torch.full((rows, m + drop), float("-inf"), dtype=torch.float32, device=dev)
    ids = torch.full((rows, m + drop), -1, dtype=torch.int64, device=dev)
    if kernels is not None:
        held = torch.zeros(rows, dtype=torch.int32, device=dev)
        below = torch.full((rows, kernels.collect_blocks(z.shape[1])), float("-inf"),
                           dtype=torch.float32, device=dev)
        kernels.collect_in_bins(z, scale, last.to(torch.int32), BINS, vals, ids, held, below)
        below, held = below.amax(1), held[:, None]
    else:
        held = torch.zeros(rows, 1, dtype=torch.int32, device=dev)
        below = torch.full((rows,), float("-inf"), dtype=torch.float32, device=dev)
        held = _collect_tile(z, _bins_of(z, scale) <= last[:, None], 0, m, vals, ids, held,
                             below)
    keep = slice(0, out.shape[0])
    out[:, :m] = vals[keep, :m].double()
    out[:, m:2 * m] = torch.where(vals[keep, :m] > float("-inf"), ids[keep, :m], -1)
    out[:, 2 * m] = torch.where(held[keep, 0] > m, float("inf"), below[keep].double())


def shard_bins(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], scale: torch.Tensor,
               call: ShardCall, tile_elements: int, deterministic: bool) -> torch.Tensor:
    """Per row of ``h``: how many of this shard's logits fall in each of the ``BINS`` bins of
    :func:`_bins_of` (``scale``: :func:`bin_scale`'s rows; bin 0 at the top), float64
    ``[rows, BINS]``. The bins hold what :func:`_collect` takes exactly (the same logits: the
    same chunks)."""
    n, v, dev = h.shape[0], w.shape[0], h.device
    out = torch.zeros(n, BINS, dtype=torch.float64, device=dev)
    if n == 0 or v == 0:
        return out
    tc = DETERMINISTIC_ROWS if deterministic else min(n, DETERMINISTIC_ROWS)
    kernels = tile_kernels(dev)
    vc = _tile_columns(tile_elements, tc, kernels)
    drop = 0 if kernels is not None else drop_columns(dev)
    for t0, t1, hc in _row_chunks(h, deterministic):
        rows, pad = hc.shape[0], hc.shape[0] - (t1 - t0)
        rows_scale = torch.cat([scale[t0:t1], scale.new_full((pad, 3), float("inf"))])
        counts = torch.zeros(rows, BINS + drop, dtype=torch.float32, device=dev)
        for v0 in range(0, v, vc):
            v1 = min(v0 + vc, v)
            z = call_logits_tile(hc, w[v0:v1], None if b is None else b[v0:v1], call)
            _count_tile(z, rows_scale, counts, kernels, v0)
        out[t0:t1] = counts[: t1 - t0, :BINS].double()
    return out


__all__ = ["DETERMINISTIC_ROWS", "BINS", "COARSE", "MASS_BINS", "SPREAD", "grid_index",
           "MASS_MARGIN", "bin_scale", "bin_masses", "last_bin", "moved_bins", "ordered",
           "from_key",
           "drop_columns", "tile_kernels", "shard_candidates", "shard_bins"]
