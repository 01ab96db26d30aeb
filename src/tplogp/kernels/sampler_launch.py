"""The sampler's tile launches (:mod:`.sampler_kernels`): :func:`count_bins` and
:func:`collect_at_least` on one fp32 logits tile ``[rows, cols]`` (unit column stride), and
:class:`GridRows`, the grid pass's per-row state of every row that takes a token chunk's tile in
three launches (the tile's max, :func:`~.sampler_kernels.grid_move_kernel`, the counting kernel)
and ends the chunk with one more move, which can also write each row's last bin. Their
:class:`~.launch.Launch` is made once per tile layout (:func:`~.launch.cached`)."""

from __future__ import annotations

from typing import Optional

import torch
import triton

from .entry_checks import KernelInputError
from .launch import Launch, cached
from .sampler_kernels import bin_counts_kernel, collect_kernel, grid_move_kernel
from .tiles import cdiv

# counting: a program's columns, the columns it takes at a time (measured on an H100 at 256 x
# 128256: 4096 / 128 / 4 warps beat 64 or 8192 columns and 8 warps)
BIN_BLOCK, BIN_SUB, BIN_WARPS = 4096, 128, 4
COLLECT_BLOCK, COLLECT_WARPS = 1024, 4


def _check_tile(z: torch.Tensor) -> None:
    if z.dtype != torch.float32 or z.dim() != 2 or z.stride(1) != 1:
        raise KernelInputError(f"the sampler's tile kernels take a 2-D fp32 tile with unit column "
                               f"stride, got {z.dtype} {tuple(z.shape)} strides {z.stride()}")


def _bins_launch(rows: int, cols: int, stride_z: int, bins: int, coarse: int,
                 stride_s: int) -> Launch:
    """The counting kernel's launch: with ``stride_s`` (the partial sums' row stride) the masses
    of groups of ``coarse`` bins and the partial sums too, else the counts alone."""
    return Launch(bin_counts_kernel, (rows, cdiv(cols, BIN_BLOCK)), (cols, stride_z, stride_s),
                  BIN_WARPS, None,
                  dict(BINS=bins, COARSE=coarse, BLOCK=BIN_BLOCK, SUB=BIN_SUB,
                       WITH_MASS=stride_s > 0, WITH_SUM=stride_s > 0))


def count_bins(z: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor) -> None:
    """Add to ``counts`` (fp32 ``[rows, BINS]``, contiguous) how many logits of ``z`` fall in each
    bin of ``scale``'s rows (fp32 ``[rows, 3]``: bottom, top, ``BINS`` over their span)."""
    _check_tile(z)
    rows, cols = z.shape
    if rows == 0 or cols == 0:
        return
    launch = cached(_bins_launch, rows, cols, z.stride(0), counts.shape[1], 1, 0)
    launch(z, scale, scale, counts, counts, counts)


def _move_launch(rows: int, partials: int, bins: int, coarse: int, last: bool) -> Launch:
    """The window's move; with ``last`` also each row's last bin (:meth:`GridRows.finish`)."""
    return Launch(grid_move_kernel, (rows,), (), 1, None,
                  dict(P=partials, BINS=bins, COARSE=coarse, LAST=last))


class GridRows:
    """The grid pass's state of ``rows`` token rows (``tplogp.op.sampler_passes``' grid rows, on
    the GPU): the running max (fp32), the window top's grid index and ``sum exp(z - max)``
    (float64), the ``bins`` counts and the masses of their groups of ``coarse`` (fp32, two
    buffers each: a move writes the other), the partial sums of the tile last counted and the
    window's bin rows (``scale``, :func:`count_bins`'). A token chunk's rows take their tiles
    between :meth:`start` and :meth:`finish` (every chunk as many tiles); :meth:`result` gives
    every row's statistics once every chunk is finished."""

    def __init__(self, width: torch.Tensor, cols: int, bins: int, coarse: int) -> None:
        rows, dev = width.shape[0], width.device
        self.width = width.contiguous()
        self.row_max = torch.full((rows,), float("-inf"), dtype=torch.float32, device=dev)
        self.top_index = torch.full((rows,), float("-inf"), dtype=torch.float64, device=dev)
        self.sums = torch.zeros(rows, dtype=torch.float64, device=dev)
        self.partials = torch.zeros(rows, triton.next_power_of_2(cdiv(cols, BIN_BLOCK)),
                                    dtype=torch.float64, device=dev)
        self.counts = torch.zeros(2, rows, bins, dtype=torch.float32, device=dev)
        self.masses = torch.zeros(2, rows, bins // coarse, dtype=torch.float32, device=dev)
        self.coarse = coarse
        self.shift = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.scale = torch.zeros(rows, 3, dtype=torch.float32, device=dev)
        self.held = 0  # which of the two buffers holds the bins
        self._rows: tuple = ()
        self.start(0, rows)

    def start(self, r0: int, r1: int) -> None:
        """Take the rows ``r0 .. r1`` (a token chunk: no tile counted yet) for the next tiles."""
        rows = slice(r0, r1)
        self.held = 0  # (both buffers hold nothing of these rows yet)
        self._rows = (self.width[rows], self.row_max[rows], self.top_index[rows],
                      self.sums[rows], self.partials[rows], self.counts[:, rows],
                      self.masses[:, rows], self.shift[rows], self.scale[rows])

    def _move(self, tile_max: torch.Tensor, reach: Optional[torch.Tensor] = None,
              last: Optional[torch.Tensor] = None) -> None:
        width, row_max, top_index, sums, partials, counts, masses, shift, scale = self._rows
        held, with_last = self.held, reach is not None
        cached(_move_launch, row_max.shape[0], partials.shape[1], counts.shape[2], self.coarse,
               with_last)(
            tile_max, width, row_max, top_index, sums, partials, counts[held], masses[held],
            counts[1 - held], masses[1 - held], shift, scale,
            reach if with_last else width, last if with_last else counts[held])
        self.held = 1 - held

    def add_tile(self, z: torch.Tensor) -> None:
        """Move the started rows' window to ``z``'s max (``z``: their logits, ``[rows, cols]`` or
        fewer columns), then count ``z`` in it (module docstring)."""
        _check_tile(z)
        rows, cols = z.shape
        if cols == 0:
            return
        self._move(z.amax(1))
        _, _, _, _, partials, counts, masses, shift, scale = self._rows
        launch = cached(_bins_launch, rows, cols, z.stride(0), counts.shape[2], self.coarse,
                        partials.stride(0))
        launch(z, scale, shift, counts[self.held], masses[self.held], partials)

    def finish(self, reach: Optional[torch.Tensor] = None,
               last: Optional[torch.Tensor] = None) -> None:
        """Fold the started rows' last partial sums; with ``reach`` (float64 ``[rows]``: ``top_p``
        plus a margin) also write ``last`` (int32 ``[rows]``): the first bin where their masses
        from the top reach it, else the last (``tplogp.op.sampler_grid.last_bin``)."""
        self._move(self._rows[1], reach, last)  # (the max unchanged: nothing moves)

    def result(self) -> tuple[torch.Tensor, ...]:
        """``(row max, sum exp(z - max), top index, counts, masses)`` of every row."""
        return self.row_max, self.sums, self.top_index, self.counts[self.held], \
            self.masses[self.held]


def _collect_launch(rows: int, cols: int, stride_z: int, v0: int, m: int,
                    stride_b: int, bins: int) -> Launch:
    """The collecting kernel's launch: ``bins`` 0 takes the logits at least a threshold, else
    those in the bins ``0 .. last`` of ``bins`` bins."""
    by_bin = bins > 0
    return Launch(collect_kernel, (rows, cdiv(cols, COLLECT_BLOCK)),
                  (cols, stride_z, v0, m, stride_b), COLLECT_WARPS, None,
                  dict(BLOCK=COLLECT_BLOCK, BY_BIN=by_bin, BINS=max(bins, 1)))


def collect_blocks(cols: int) -> int:
    """The programs per row of :func:`collect_at_least` on ``cols`` columns: the columns of its
    ``below`` partials."""
    return cdiv(cols, COLLECT_BLOCK)


def collect_at_least(z: torch.Tensor, at_least: torch.Tensor, v0: int, vals: torch.Tensor,
                     ids: torch.Tensor, held: torch.Tensor, below: torch.Tensor) -> None:
    """Per row of ``z``, its logits at least ``at_least`` (fp32 ``[rows]``) stored with their ids
    (the column plus ``v0``) into free slots of ``vals`` (fp32 ``[rows, m]``) and ``ids`` (int64)
    taken from ``held`` (int32 ``[rows]``, the running count: it grows by every hit, also those
    past ``m``, which are not stored); ``below`` (fp32 ``[rows, collect_blocks(cols)]``, unit
    column stride) gets each program's largest logit under the threshold."""
    _check_tile(z)
    rows, cols = z.shape
    if rows == 0 or cols == 0:
        return
    launch = cached(_collect_launch, rows, cols, z.stride(0), v0, vals.shape[1], below.stride(0),
                    0)
    launch(z, at_least, at_least, at_least, vals, ids, held, below)


def collect_in_bins(z: torch.Tensor, scale: torch.Tensor, last: torch.Tensor, bins: int,
                    vals: torch.Tensor, ids: torch.Tensor, held: torch.Tensor,
                    below: torch.Tensor) -> None:
    """:func:`collect_at_least` of the logits in the bins ``0 .. last`` (int32 ``[rows]``) of
    ``scale``'s rows (:func:`count_bins`' ``bins`` bins: the ids counted there), from column 0."""
    _check_tile(z)
    rows, cols = z.shape
    if rows == 0 or cols == 0:
        return
    launch = cached(_collect_launch, rows, cols, z.stride(0), 0, vals.shape[1], below.stride(0),
                    bins)
    launch(z, scale, scale, last, vals, ids, held, below)


__all__ = ["count_bins", "collect_at_least", "collect_in_bins", "collect_blocks", "GridRows",
           "BIN_BLOCK",
           "COLLECT_BLOCK"]
