"""The sampler's tile kernels (:mod:`tplogp.kernels.sampler_kernels`, CPU interpreter) against the
torch path of the same steps (:mod:`tplogp.op.sampler_passes`): the counting pass's bins bit for
bit and their masses against float64, the collected ids and values as sets, the running counts past
the buffer and the largest logit left out, on tiles wider than one program with ties at the
threshold, ``-inf``, ``+inf`` and NaN logits, and rows that collect nothing or everything."""

from __future__ import annotations

import pytest
import torch

from tests.support.interpreter import interpreter_only
from tplogp.op import sampler_grid, sampler_passes
from tplogp.op.sampler_passes import BINS, bin_scale
from tplogp.testing.tolerances import assert_no_worse

pytestmark = interpreter_only
pytest.importorskip("triton")

from tplogp.kernels import sampler_launch  # noqa: E402


def _tile(rows: int, cols: int, seed: int) -> torch.Tensor:
    """fp32 logits on a 1/8 grid (many exact ties), with ``-inf``, ``+inf`` and NaN in row 1, row
    2 all ``-inf``."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(-40, 41, (rows, cols), generator=g).float() / 8
    z[1, 5], z[1, cols - 1], z[1, 7] = float("-inf"), float("inf"), float("nan")
    z[2] = float("-inf")
    return z


def test_bins_match_the_torch_path():
    """Counts equal the torch path's bit for bit (the same bin function), ties at the bins' edges,
    ``-inf``, ``+inf`` and NaN logits, a row of ``-inf`` and a row whose bins lie above every
    logit included."""
    rows, cols = 5, sampler_launch.BIN_BLOCK + 300  # two programs per row
    z = _tile(rows, cols, seed=0)
    top = torch.tensor([5.0, 5.0, 0.0, 4.0, float("inf")], dtype=torch.float64)
    lo = torch.tensor([-1.0, -5.0, -1.0, 3.875, float("inf")], dtype=torch.float64)
    scale = bin_scale(lo, top)
    counts = torch.zeros(rows, BINS)
    sampler_launch.count_bins(z, scale, counts)
    at = sampler_passes.bins_of(z, scale)
    want_counts = torch.zeros(rows, BINS + 1).scatter_add_(1, at, torch.ones_like(z))[:, :BINS]
    assert torch.equal(counts, want_counts)
    assert counts[4].sum() == 0 and counts[2].sum() == 0 and counts[0].sum() > 0


@pytest.mark.parametrize("m", [4, 700])
def test_collect_matches_the_torch_path(m):
    """The same ids and values collected (in another order: compared as sets), the same running
    count (also past ``m``, where the row's buffer is full) and the same largest logit left out
    (NaN where the row has one)."""
    rows, cols, v0 = 5, 2 * sampler_launch.COLLECT_BLOCK + 77, 3000
    z = _tile(rows, cols, seed=1)
    at_least = torch.tensor([4.5, 4.875, -1.0, float("inf"), float("-inf")])
    vals = torch.full((rows, m), float("-inf"))
    ids = torch.full((rows, m), -1, dtype=torch.int64)
    held = torch.zeros(rows, dtype=torch.int32)
    below = torch.full((rows, sampler_launch.collect_blocks(cols)), float("-inf"))
    sampler_launch.collect_at_least(z, at_least, v0, vals, ids, held, below)

    t_vals = torch.full((rows, m + 1), float("-inf"))
    t_ids = torch.full((rows, m + 1), -1, dtype=torch.int64)
    t_below = torch.full((rows,), float("-inf"))
    t_held = sampler_passes.collect_tile(z, z >= at_least[:, None], v0, m, t_vals, t_ids,
                                          torch.zeros(rows, 1, dtype=torch.int32), t_below)
    assert held.tolist() == t_held[:, 0].tolist()
    assert held[3] == 0 and held[4] == cols  # none; all
    torch.testing.assert_close(below.amax(1), t_below, equal_nan=True)
    assert below.amax(1)[1].isnan()
    for r in range(rows):
        got = {(int(i), float(v)) for i, v in zip(ids[r], vals[r]) if i >= 0}
        hits = (z[r] >= at_least[r]).nonzero().squeeze(1)
        every = {(int(c) + v0, float(z[r, c])) for c in hits}
        assert len(got) == min(m, len(every)) and got <= every, r
        if len(every) <= m:
            want = {(int(i), float(v)) for i, v in zip(t_ids[r, :m], t_vals[r, :m]) if i >= 0}
            assert got == want == every, r


def test_grid_rows_match_the_torch_path():
    """The grid pass's state over tiles whose max rises past grid steps (the bins move down, the
    masses and the sum are rescaled): the same max, window top and counts bit for bit as the torch
    path's, the groups' masses and ``sum exp(z - max)`` within fp32 summation error of it, and the
    masses within fp32 error of float64 sums over the bins' logits; a row of ``-inf`` keeps
    nothing, a row with a NaN has a NaN max and sum, as the torch path's."""
    rows, cols = 5, sampler_launch.BIN_BLOCK + 300  # two programs per row, then a narrower tile
    g = torch.Generator().manual_seed(3)
    rising = torch.arange(3, dtype=torch.float32)[:, None, None] * 0.75  # the max rises per tile
    # (off the 1/8 grid: no logit within rounding of a bin's edge, where fp32 and float64 bins
    # may differ)
    tiles = [(torch.randint(-40, 41, (rows, cols), generator=g).float() / 8 + rising[i]
              + torch.rand(rows, cols, generator=g) / 64) for i in range(3)]
    tiles[2] = tiles[2][:, :700]
    for z in tiles:
        z[2] = float("-inf")
    tiles[1][1, 9] = float("nan")
    width = torch.tensor([0.3, 0.3, 0.3, 0.05, 1.7], dtype=torch.float64)
    state = sampler_launch.GridRows(width, cols, BINS, sampler_grid.COARSE)
    for z in tiles:
        state.add_tile(z)
    state.finish()
    got = state.result()
    want = sampler_grid._grid_tiles((z.clone() for z in tiles), width)
    for name, a, b in zip(("max", "top", "counts"), got[0:1] + got[2:4], want[0:1] + want[2:4]):
        b = b[:, :a.shape[1]] if b.dim() == 2 else b  # (less the drop column)
        assert torch.equal(a[[0, 2, 3, 4]], b[[0, 2, 3, 4]]), name
    assert got[1][2] == 0 and not got[4][2].any()  # (the row of -inf: nothing)
    assert got[0][1].isnan() and got[1][1].isnan() and want[1][1].isnan()
    assert got[3][2].sum() == 0 and got[1][2] == 0 and got[3][0].sum() > 100
    # the window's top: the least multiple of COARSE grid steps at least the max
    coarse = sampler_grid.COARSE
    row_max = torch.cat(tiles, 1)[0].max().double()
    assert got[2][0] == torch.ceil(row_max / (coarse * 0.3)) * coarse
    # the masses against float64: every logit of the window, moved with it, in its group
    whole = torch.cat(tiles, 1)[[0, 3, 4]].double()
    top = got[2][[0, 3, 4]] * width[[0, 3, 4]]
    at = ((top[:, None] - whole) / width[[0, 3, 4], None]).floor()
    inside = (at >= 0) & (at < BINS)
    terms = torch.exp(whole - whole.amax(1, keepdim=True)) * inside
    group = (at.clamp(0, BINS - 1) // coarse).long()
    truth = torch.zeros(3, BINS // coarse, dtype=torch.float64).scatter_add_(1, group, terms)
    # the masses and sums against float64, no worse than the torch path's (fp32 terms, other
    # orders)
    keep = [0, 3, 4]
    assert_no_worse("masses", got[4][keep], want[4][keep, :BINS // coarse], truth, torch.float32)
    sums = torch.exp(whole - whole.amax(1, keepdim=True)).sum(1)
    assert_no_worse("sums", got[1][keep], want[1][keep], sums, torch.float32)
    assert (got[4][0] > 0).sum() >= 3  # (several groups hold mass)


def test_grid_rows_last_bin_matches_the_torch_path():
    """The last move of a token chunk's rows writes the bin each row collects down to: the torch
    path's (``sampler_grid.window_last_bin``) for every row, over two chunks of rows started one
    after the other (each chunk's statistics its own), for top_p from 0.05 to 0.999 (edges in
    several groups of bins); a row of ``-inf`` takes the last bin."""
    rows, cols = 8, sampler_launch.BIN_BLOCK + 300
    g = torch.Generator().manual_seed(5)
    spread = torch.tensor([0.5, 1, 2, 4, 1, 2, 3, 8])[:, None]
    tiles = [torch.randn(rows, cols, generator=g) * spread + 3 * i for i in range(2)]
    for z in tiles:
        z[5] = float("-inf")
    width = torch.tensor([0.3, 0.2, 0.25, 0.4, 0.3, 0.3, 0.5, 0.7], dtype=torch.float64)
    top_p = torch.tensor([0.05, 0.5, 0.9, 0.999, 0.99, 0.9, 0.7, 0.95], dtype=torch.float64)
    state = sampler_launch.GridRows(width, cols, BINS, sampler_grid.COARSE)
    last = torch.full((rows,), -1, dtype=torch.int32)
    for r0, r1 in ((0, 3), (3, rows)):
        state.start(r0, r1)
        for z in tiles:
            state.add_tile(z[r0:r1])
        state.finish(top_p[r0:r1] + sampler_grid.MASS_MARGIN, last[r0:r1])
    want = sampler_grid.window_last_bin(state.result(), width, top_p)
    assert last.long().tolist() == want.tolist()
    assert last[5] == BINS - 1 and len(set(last.tolist())) >= 5
    torch_stats = sampler_grid._grid_tiles([z[:3].clone() for z in tiles], width[:3])
    assert want[:3].tolist() == sampler_grid.window_last_bin(torch_stats, width[:3],
                                                             top_p[:3]).tolist()


def test_collect_in_bins_takes_what_the_bins_counted():
    """Collecting by bin takes exactly the logits the counting kernel counted in the bins ``0 ..
    last`` (the same bin arithmetic: ties at the bins' edges on the 1/8 grid), none for a row whose
    bins lie above every logit, all of them down to the bottom for ``last = BINS - 1``; the largest
    logit left out."""
    rows, cols, m = 5, 2 * sampler_launch.COLLECT_BLOCK + 77, 3000
    z = _tile(rows, cols, seed=2)
    top = torch.tensor([5.0, 5.0, 0.0, 4.0, 9.0], dtype=torch.float64)
    lo = torch.tensor([-1.0, -5.0, -1.0, 3.875, 8.0], dtype=torch.float64)
    scale = bin_scale(lo, top)
    last = torch.tensor([10, 63, 5, 0, 63], dtype=torch.int32)
    vals = torch.full((rows, m), float("-inf"))
    ids = torch.full((rows, m), -1, dtype=torch.int64)
    held = torch.zeros(rows, dtype=torch.int32)
    below = torch.full((rows, sampler_launch.collect_blocks(cols)), float("-inf"))
    sampler_launch.collect_in_bins(z, scale, last, BINS, vals, ids, held, below)
    counts = torch.zeros(rows, BINS)
    sampler_launch.count_bins(z, scale, counts)
    taken = sampler_passes.bins_of(z, scale) <= last[:, None].long()
    assert held.tolist() == [int(counts[r, :int(last[r]) + 1].sum()) for r in range(rows)]
    assert held.tolist() == taken.sum(1).tolist() and held[4] == 0 and held[1] > held[0] > 0
    for r in range(rows):
        got = {int(i) for i in ids[r] if i >= 0}
        assert got == set(taken[r].nonzero().squeeze(1).tolist()), r
    left = z.masked_fill(taken, float("-inf")).amax(1)
    torch.testing.assert_close(below.amax(1), left, equal_nan=True)
