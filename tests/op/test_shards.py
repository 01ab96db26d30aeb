"""Shard layouts: the runbook's even/uneven boundaries and the partition check."""

import pytest

from tplogp.support.shards import (
    ShardLayoutError,
    chunk_boundaries,
    even_boundaries,
    shard_boundaries,
    shard_range,
    uneven_boundaries,
    validate_boundaries,
    validate_ranges,
)


@pytest.mark.parametrize("vocab", [4, 7, 101, 4096, 8192, 128256])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_boundaries_partition_the_vocab(vocab, world, uneven):
    if vocab < world:
        pytest.skip("fewer ids than ranks")
    b = shard_boundaries(vocab, world, uneven=uneven)
    assert len(b) == world + 1 and b[0] == 0 and b[-1] == vocab
    sizes = [e - s for s, e in zip(b, b[1:])]
    assert all(s > 0 for s in sizes)
    assert validate_boundaries(b, vocab) == vocab
    if uneven and world > 1 and vocab > world:
        assert len(set(sizes)) > 1, f"uneven layout came out even: {b}"
    if not uneven:
        assert max(sizes) - min(sizes) <= 1


def test_runbook_layouts():
    assert even_boundaries(8192, 4) == [0, 2048, 4096, 6144, 8192]
    assert uneven_boundaries(4096, 4) == [0, 409, 1228, 2457, 4096]


@pytest.mark.parametrize("vocab", [1, 3, 7, 10, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_chunk_boundaries_are_torch_chunk(vocab, world):
    """The split of a DTensor placed Shard(0): torch.chunk's, trailing ranks empty when the chunks
    run out."""
    import torch

    sizes = [len(c) for c in torch.arange(vocab).chunk(world)]
    sizes += [0] * (world - len(sizes))
    b = chunk_boundaries(vocab, world)
    assert [e - s for s, e in zip(b, b[1:])] == sizes
    assert validate_boundaries(b, vocab) == vocab


def test_shard_range():
    b = [0, 3, 10]
    assert shard_range(b, 1) == (3, 10) and shard_range(b, 1).size == 7
    with pytest.raises(ValueError, match="rank 2 out of range"):
        shard_range(b, 2)


@pytest.mark.parametrize(
    "ranges, vocab, message",
    [
        ([(0, 5), (4, 10)], None, r"overlap: rank 0 owns \[0, 5\) and rank 1 owns \[4, 10\)"),
        ([(0, 5), (6, 10)], None,
         r"gap: ids \[5, 6\) between rank 0 \[0, 5\) and rank 1 \[6, 10\)"),
        ([(1, 5), (5, 10)], None, r"gap: ids \[0, 1\) are owned by no rank"),
        ([(0, 5), (5, 10)], 12, r"last rank \(1\) ends at 10 but global_vocab_size is 12"),
        ([(0, 5), (5, 10)], 8, r"ids past the end"),
        ([(0, 5), (7, 6)], None, r"rank 1 has an invalid vocab range \[7, 6\)"),
    ],
    ids=["overlap", "gap-middle", "gap-start", "short", "long", "inverted"],
)
def test_bad_layouts_name_ranks_and_ranges(ranges, vocab, message):
    with pytest.raises(ShardLayoutError, match=message):
        validate_ranges(ranges, vocab)


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="vocab_size \\(2\\) must be >= world_size \\(4\\)"):
        shard_boundaries(2, 4)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        even_boundaries(10, 0)
