"""Top-p alone's first round on one rank's shard (:mod:`tplogp.op.sampler_support` states the
algorithm): a token's max, ``sum exp(z - max)`` and the counts of ``BINS`` bins on a grid fixed
before the pass below its running max, with the masses of their groups of ``COARSE``
(:func:`grid_candidates`); the masses' per-bin bounds every rank's bins merge into
(:func:`bin_masses`) and the bin a collecting round goes down to (:func:`last_bin`). On one shard,
where one tile holds a token chunk's logits, the token collects from that tile as soon as its bins
are counted (:func:`_collect_in_window`). The tiles' arithmetic and the collecting steps are
:mod:`tplogp.op.sampler_passes`' (torch operations, or its tile kernels on a GPU:
:class:`tplogp.kernels.sampler_launch.GridRows`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backends.base import ShardCall
from ..backends.native_tiles import call_logits_tile
from . import sampler_passes as passes
from .sampler_passes import BINS, DETERMINISTIC_ROWS, bin_scale, moved_bins

# top-p alone collects down to the bin where the counted mass passes top_p by this much (the
# masses are sums of fp32 terms; the round decides in float64)
MASS_MARGIN = 1e-4
# the grid pass sums masses over groups of COARSE bins (MASS_BINS of them): a logit's mass goes to
# one of 16 sums, not 64 (a quarter of the work a logit; the fine bins' counts bound the rest)
COARSE = 4
MASS_BINS = BINS // COARSE


def grid_columns(m: int) -> int:
    """The columns of :func:`grid_candidates`' rows: those of
    :func:`~.sampler_passes.shard_candidates`' (``2 m + 3``), then the grid top's index, the
    ``BINS`` counts and the ``MASS_BINS`` masses."""
    return 2 * m + 4 + BINS + MASS_BINS


def _grid_scale(top_index: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """:func:`~.sampler_passes.bin_scale`'s rows for the window of ``BINS`` grid bins of ``width``
    (float64) whose top is ``top_index * width``: bin ``j`` is the grid step ``top_index - j - 1``;
    a row without a finite top (no logit above ``-inf``) drops every logit."""
    top = top_index * width
    scale = bin_scale(top - BINS * width, top)
    return scale.masked_fill_(~torch.isfinite(top)[:, None], float("inf"))


def grid_index(row_max: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """The index of a window's top on the grid of ``width`` (float64) for a row max (fp32): the
    least multiple of ``COARSE`` steps at least the max (the masses' groups of bins then move as
    whole groups)."""
    return torch.ceil(row_max.double() / (COARSE * width)) * COARSE


def grid_candidates(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], m: int,
                    width: torch.Tensor, call: ShardCall, tile_elements: int,
                    deterministic: bool, top_p: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per row of ``h`` (``width``: float64 ``[rows]``, its grid's step), packed as
    :func:`grid_columns`: no candidates (the floor the row max) but, in one pass over the logits,
    the row max, ``sum exp(z - max)`` (fp32 terms, float64 sums), the counts of the ``BINS`` bins of
    ``width`` on a grid fixed before the pass (its steps ``i * width``) below the running max and
    the masses (``exp(z - max)``, fp32 terms) of their ``MASS_BINS`` groups of ``COARSE``: the
    window's top is the least multiple of ``COARSE`` steps at least the max (:func:`grid_index`).
    When a chunk raises the max past it the window moves up, the bins held move down as many
    bins (those past the bottom dropped) and the masses are rescaled to the new max, as the sum
    is; the chunk's logits are then counted in the new window (:func:`~.sampler_passes.bins_of`).
    Every rank's window lies on the same grid, so the ranks' bins merge by their tops' indices.
    With ``top_p`` and one tile per row chunk, the rows then collect from that tile
    (:func:`_collect_in_window`)."""
    n, v, dev = h.shape[0], w.shape[0], h.device
    out = passes.candidate_rows(n, m, grid_columns(m) - (2 * m + 3), dev)
    if n == 0 or v == 0:
        return out
    tc = DETERMINISTIC_ROWS if deterministic else min(n, DETERMINISTIC_ROWS)
    kernels = passes.tile_kernels(dev)
    vc = passes.tile_columns(tile_elements, tc, kernels)
    whole = top_p is not None and vc >= v  # (the tile in hand holds all of a row chunk's logits)
    tiles_of = (lambda hc: (call_logits_tile(hc, w[v0:v0 + vc],
                                             None if b is None else b[v0:v0 + vc], call)
                            for v0 in range(0, v, vc)))
    if kernels is not None:
        _grid_kernels(out, h, m, width, min(vc, v), tiles_of, deterministic,
                      top_p if whole else None, kernels)
        return out
    for t0, t1, hc in passes.row_chunks(h, deterministic):
        pad = hc.shape[0] - (t1 - t0)
        rows_width = torch.cat([width[t0:t1], width.new_ones(pad)])
        tiles = list(tiles_of(hc)) if whole else tiles_of(hc)  # (whole: the one tile, kept)
        stats = _grid_tiles(tiles, rows_width)
        _grid_out(out[t0:t1], m, *stats)
        if whole:
            rows_p = torch.cat([top_p[t0:t1], top_p.new_ones(pad)])
            _collect_in_window(out[t0:t1], tiles[0], m, stats, rows_width, rows_p)
    return out


def _grid_kernels(out: torch.Tensor, h: torch.Tensor, m: int, width: torch.Tensor, cols: int,
                  tiles_of, deterministic: bool, top_p: Optional[torch.Tensor], kernels) -> None:
    """:func:`grid_candidates` by the tile kernels (a GPU's): one
    :class:`~tplogp.kernels.sampler_launch.GridRows` over every row: three launches a tile (its
    max, the window's move, the counting), one more move a token chunk (with ``top_p`` it also
    finds each row's last bin) and, with ``top_p``, the collecting from the tile in hand; no other
    operation per chunk: the statistics and candidates (buffers of every row, ``[rows, m]``) go
    into ``out`` once (``cols``: a tile's columns)."""
    n = h.shape[0]
    state = kernels.GridRows(width, cols, BINS, COARSE)
    if top_p is not None:
        vals = torch.full((n, m), float("-inf"), dtype=torch.float32, device=h.device)
        ids = torch.full((n, m), -1, dtype=torch.int64, device=h.device)
        held = torch.zeros(n, dtype=torch.int32, device=h.device)
        last = torch.empty(n, dtype=torch.int32, device=h.device)
        below = torch.full((n, kernels.collect_blocks(cols)), float("-inf"), dtype=torch.float32,
                           device=h.device)
        reach = top_p.double() + MASS_MARGIN  # (as last_bin compares, in float64)
    for t0, t1, hc in passes.row_chunks(h, deterministic):
        state.start(t0, t1)
        for z in tiles_of(hc):
            state.add_tile(z[:t1 - t0])  # (a deterministic chunk's padding rows: not counted)
        if top_p is None:
            state.finish()
            continue
        state.finish(reach[t0:t1], last[t0:t1])
        kernels.collect_in_bins(z[:t1 - t0], state.scale[t0:t1], last[t0:t1], BINS, vals[t0:t1],
                                ids[t0:t1], held[t0:t1], below[t0:t1])
    _grid_out(out, m, *state.result())
    if top_p is not None:
        _collected_out(out, m, vals, ids, held, below.amax(1))


def _grid_tiles(tiles, width: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The torch path of :func:`grid_candidates` over a row chunk's ``tiles`` (their columns in
    order): ``(row max, sum exp(z - max), top index, counts, masses)``."""
    rows, dev = width.shape[0], width.device
    drop = passes.drop_columns(dev)
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
        terms = torch.exp(z - base[:, None])  # (the sum keeps NaN and inf; the masses do not)
        sum_exp = sum_exp * rescale + terms.sum(1, dtype=torch.float64)
        new_index = grid_index(new_max, width)
        counts[:, :BINS] = moved_bins(counts[:, :BINS], new_index - top_index)
        masses[:, :MASS_BINS] = moved_bins(masses[:, :MASS_BINS], new_index - top_index,
                                           COARSE) * rescale.float()[:, None]
        row_max, top_index = new_max, new_index
        at = passes.dropped_spread(passes.bins_of(z, _grid_scale(top_index, width)), drop, v0)
        counts.scatter_add_(1, at, torch.ones_like(z))
        groups = torch.where(at < BINS, at // COARSE, at - BINS + MASS_BINS)
        masses.scatter_add_(1, groups, terms.nan_to_num_(nan=0.0))
        v0 += z.shape[1]
    return row_max, sum_exp, top_index, counts, masses


def _grid_out(out: torch.Tensor, m: int, row_max: torch.Tensor, sum_exp: torch.Tensor,
              top_index: torch.Tensor, counts: torch.Tensor, masses: torch.Tensor) -> None:
    """A row chunk's grid statistics written into its rows of :func:`grid_candidates`' ``out``
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


def window_last_bin(stats: tuple, width: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of one shard's grid statistics ``stats`` (:func:`_grid_tiles`' over all of its
    logits), the last bin its collecting takes (:func:`last_bin` of :func:`bin_masses` with the
    shard's own log-sum-exp; int64 ``[rows]``)."""
    row_max, sum_exp, top_index, counts, groups = stats
    base = torch.where(row_max == float("-inf"), 0.0, row_max).double()
    lse = base + torch.log(sum_exp)
    shifted = groups[:, :MASS_BINS].double() * torch.exp(row_max.double() - lse)[:, None]
    masses = bin_masses(counts[:, :BINS].double(), shifted.nan_to_num_(nan=0.0),
                        top_index * width, width, lse)
    return last_bin(masses, top_p)


def _collect_in_window(out: torch.Tensor, z: torch.Tensor, m: int, stats: tuple,
                       width: torch.Tensor, top_p: torch.Tensor) -> None:
    """The torch path's collecting of the grid rows of one shard (the whole vocabulary) whose
    logits ``z`` one tile holds (``[rows, V]``, a row chunk with its padding rows; ``stats``:
    :func:`_grid_tiles`' of that tile): the ids of the bins down to the first where the masses
    from the top pass ``top_p`` (:func:`bin_masses`, :func:`last_bin`) collected into ``out``'s
    candidates (:func:`_collected_out`; its rows: those of the chunk, not its padding)."""
    rows, dev = z.shape[0], z.device
    last = window_last_bin(stats, width, top_p)
    drop = passes.drop_columns(dev)
    vals = torch.full((rows, m + drop), float("-inf"), dtype=torch.float32, device=dev)
    ids = torch.full((rows, m + drop), -1, dtype=torch.int64, device=dev)
    held = torch.zeros(rows, 1, dtype=torch.int32, device=dev)
    below = torch.full((rows,), float("-inf"), dtype=torch.float32, device=dev)
    taken = passes.bins_of(z, _grid_scale(stats[2], width)) <= last[:, None]
    held = passes.collect_tile(z, taken, 0, m, vals, ids, held, below)
    keep = slice(0, out.shape[0])
    _collected_out(out, m, vals[keep, :m], ids[keep, :m], held[keep, 0], below[keep])


def _collected_out(out: torch.Tensor, m: int, vals: torch.Tensor, ids: torch.Tensor,
                   held: torch.Tensor, below: torch.Tensor) -> None:
    """Collected candidates (``vals`` fp32 and ``ids`` ``[rows, m]``; ``held``: how many the bins
    held, ``below``: the largest logit not collected, ``[rows]``) written into ``out``'s candidate
    columns and floor: ``inf`` where the bins held more than ``m`` ids (the row is then not
    decided: it collects in the next round)."""
    out[:, :m] = vals.double()
    out[:, m:2 * m] = torch.where(vals > float("-inf"), ids, -1)
    out[:, 2 * m] = torch.where(held > m, float("inf"), below.double())


__all__ = ["COARSE", "MASS_BINS", "MASS_MARGIN", "grid_columns", "grid_index", "grid_candidates",
           "bin_masses", "last_bin", "window_last_bin"]
