"""The sequences of a call's tokens, for losses with per-sequence terms
(:mod:`tplogp.losses.grpo_family`).

A sequence is one row of ``[B, L]`` targets (the last dimension; ``[N]`` targets are one sequence),
or one span ``[cu_seqlens[i], cu_seqlens[i + 1])`` of the flattened tokens for packed input.
:class:`Segments` maps each of the call's rows (after ``ignore_index`` compaction) to its sequence
and position there, and sums per-row values per sequence through a dense ``[B, longest]`` buffer:
each slot is written once, so the sums are deterministic on every device (no atomics) and the same
on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch



@dataclass(frozen=True)
class Segments:
    """Rows' sequences: ``index[r]`` the sequence of row ``r``, ``position[r]`` its place in it;
    ``count`` sequences, the longest ``longest`` tokens."""

    index: torch.Tensor  # [n] int64
    position: torch.Tensor  # [n] int64
    count: int
    longest: int

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums ``[count]`` of per-row ``values [n]`` (fp32)."""
        dense = values.new_zeros(self.count, max(self.longest, 1))
        dense[self.index, self.position] = values
        return dense.sum(1)

    def part(self, rows: slice, sequences: slice) -> "Segments":
        """The segments of the rows ``rows``, which hold the whole sequences ``sequences`` (and no
        other), indexed from the first of them."""
        return Segments(self.index[rows] - sequences.start, self.position[rows],
                        sequences.stop - sequences.start, self.longest)


def segments_for(target_shape: torch.Size, offsets: Optional[list[int]],
                 keep_idx: Optional[torch.Tensor], device: torch.device) -> Segments:
    """The :class:`Segments` of a call with targets of ``target_shape`` (``offsets``: packed
    sequences' offsets from :func:`tplogp.op.validation.check_loss`, or None for the rows of the
    targets' last dimension), for the rows ``keep_idx`` kept (None: every row)."""
    n_all = 1
    for s in target_shape:
        n_all *= s
    rows = torch.arange(n_all, device=device)
    if offsets is None:
        length = target_shape[-1] if len(target_shape) else 1
        count = n_all // length if length else 0
        index, position, longest = rows // max(length, 1), rows % max(length, 1), length
    else:
        lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        count, longest = len(lengths), max(lengths, default=0)
        index = torch.repeat_interleave(torch.arange(count, device=device),
                                        torch.tensor(lengths, device=device, dtype=torch.int64),
                                        output_size=n_all)
        starts = torch.tensor(offsets[:-1], device=device, dtype=torch.int64)
        position = rows - starts[index]
    if keep_idx is not None:
        index, position = index.index_select(0, keep_idx), position.index_select(0, keep_idx)
    return Segments(index, position, count, longest)


def row_bounds(target_shape: torch.Size, offsets: Optional[list[int]],
               keep_idx: Optional[torch.Tensor]) -> list[int]:
    """Each sequence's first row among the call's rows (those ``keep_idx`` kept, None: every row),
    then the row count: ``count + 1`` nondecreasing host ints. Without compaction from the shape or
    the offsets alone (no device read); with it, one read of ``count + 1`` ints (the compaction has
    synchronized already)."""
    if offsets is None:
        n_all = 1
        for s in target_shape:
            n_all *= s
        length = target_shape[-1] if len(target_shape) else 1
        starts = list(range(0, n_all + 1, length)) if length else [0]
    else:
        starts = list(offsets)
    if keep_idx is None:
        return starts
    return torch.searchsorted(keep_idx,
                              torch.tensor(starts, device=keep_idx.device,
                                           dtype=keep_idx.dtype)).tolist()
