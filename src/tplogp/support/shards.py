"""Vocab shard boundaries: one tested helper for building and checking them.

A layout over ``world_size`` ranks is a boundary list ``[b_0 = 0, b_1, ..., b_W = vocab_size]``;
rank ``r`` owns the half-open range ``[b_r, b_{r+1})``. Shards are never derived as
``rank * V_local``: uneven shards are first-class.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


class ShardLayoutError(ValueError):
    """The shard ranges of a process group do not form a contiguous partition of the vocabulary."""


class ShardRange(NamedTuple):
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def even_boundaries(vocab_size: int, world_size: int) -> list[int]:
    """Near-even split: the first ``vocab_size % world_size`` shards get one extra id."""
    _check_sizes(vocab_size, world_size)
    base, extra = divmod(vocab_size, world_size)
    bounds = [0]
    for r in range(world_size):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return bounds


def uneven_boundaries(vocab_size: int, world_size: int) -> list[int]:
    """Deliberately unequal shards (weights 1, 2, 3, ...; rank 0 smallest) so that range handling is
    exercised.

    Every shard is non-empty when ``vocab_size >= world_size``; for ``world_size == 1`` it is the
    whole vocab.
    """
    _check_sizes(vocab_size, world_size)
    if world_size == 1:
        return [0, vocab_size]
    weights = list(range(1, world_size + 1))
    total = sum(weights)
    bounds = [0]
    acc = 0
    for r in range(world_size - 1):
        acc += weights[r]
        b = (vocab_size * acc) // total
        b = max(b, bounds[-1] + 1)  # non-empty
        b = min(b, vocab_size - (world_size - 1 - r))  # leave one id for each later shard
        bounds.append(b)
    bounds.append(vocab_size)
    if len(set(b_next - b for b, b_next in zip(bounds, bounds[1:]))) == 1 and vocab_size > world_size:
        # weights collapsed to equal sizes (tiny vocab): shift one id so the shards really differ.
        bounds[1] -= 1
    return bounds


def chunk_boundaries(vocab_size: int, world_size: int) -> list[int]:
    """``torch.chunk``'s split, the one a DTensor placed ``Shard(0)`` uses: chunks of
    ``ceil(V / W)`` ids, the last ones smaller or empty."""
    size = -(-vocab_size // world_size)
    return [min(r * size, vocab_size) for r in range(world_size + 1)]


def shard_boundaries(vocab_size: int, world_size: int, uneven: bool = False) -> list[int]:
    """The runbook's layouts: near-even by default, :func:`uneven_boundaries` with
    ``uneven=True``."""
    return uneven_boundaries(vocab_size, world_size) if uneven else even_boundaries(vocab_size,
                                                                                    world_size)


def shard_range(boundaries: Sequence[int], rank: int) -> ShardRange:
    """Rank ``rank``'s ``[start, end)`` from a boundary list."""
    if not 0 <= rank < len(boundaries) - 1:
        raise ValueError(f"rank {rank} out of range for {len(boundaries) - 1} shards")
    return ShardRange(int(boundaries[rank]), int(boundaries[rank + 1]))


def validate_ranges(ranges: Sequence[tuple[int, int]], vocab_size: int | None = None) -> int:
    """Check that per-rank ``(start, end)`` ranges, in rank order, tile ``[0, vocab_size)`` exactly.

    Returns the vocab size (inferred as the last end when ``vocab_size`` is None). Raises
    :class:`ShardLayoutError` naming the ranks and ranges at the first overlap, gap or bad range.
    """
    if not ranges:
        raise ShardLayoutError("no shard ranges given")
    for r, (start, end) in enumerate(ranges):
        if start < 0 or end < start:
            raise ShardLayoutError(f"rank {r} has an invalid vocab range [{start}, {end}): need 0 <= start <= end")
    if ranges[0][0] != 0:
        raise ShardLayoutError(
            f"vocab shards leave a gap: ids [0, {ranges[0][0]}) are owned by no rank "
            f"(rank 0 starts at {ranges[0][0]}); shards must tile [0, vocab_size) in rank order"
        )
    for r in range(1, len(ranges)):
        (ps, pe), (s, e) = ranges[r - 1], ranges[r]
        if s < pe:
            raise ShardLayoutError(
                f"vocab shards overlap: rank {r - 1} owns [{ps}, {pe}) and rank {r} owns [{s}, {e}); "
                f"each id must belong to exactly one rank"
            )
        if s > pe:
            raise ShardLayoutError(
                f"vocab shards leave a gap: ids [{pe}, {s}) between rank {r - 1} [{ps}, {pe}) and rank {r} [{s}, {e}) "
                f"are owned by no rank"
            )
    total = ranges[-1][1]
    if vocab_size is not None and total != vocab_size:
        kind = "a gap at the end" if total < vocab_size else "ids past the end"
        raise ShardLayoutError(
            f"vocab shards leave {kind}: the last rank ({len(ranges) - 1}) ends at {total} "
            f"but global_vocab_size is {vocab_size}"
        )
    return total


def validate_boundaries(boundaries: Sequence[int], vocab_size: int | None = None) -> int:
    """:func:`validate_ranges` for a boundary list ``[0, b_1, ..., vocab_size]``."""
    if len(boundaries) < 2:
        raise ShardLayoutError(f"a boundary list needs at least 2 entries, got {list(boundaries)}")
    return validate_ranges(list(zip(boundaries[:-1], boundaries[1:])), vocab_size)


def _check_sizes(vocab_size: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if vocab_size < world_size:
        raise ValueError(f"vocab_size ({vocab_size}) must be >= world_size ({world_size}) so every shard is non-empty")
