"""The sampler's tile kernels (:mod:`tplogp.kernels.sampler_kernels`, CPU interpreter) against the
torch path of the same steps (:mod:`tplogp.op.sampler_passes`): the counting pass's bins bit for
bit and their masses against float64, the collected ids and values as sets, the running counts past
the buffer and the largest logit left out, on tiles wider than one program with ties at the
threshold, ``-inf``, ``+inf`` and NaN logits, and rows that collect nothing or everything."""

from __future__ import annotations

import pytest
import torch

from tests.support.interpreter import interpreter_only
from tplogp.op import sampler_passes
from tplogp.op.sampler_passes import BINS, bin_scale

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
    """Counts equal the torch path's bit for bit (the same bin function); masses within fp32
    summation error of float64."""
    rows, cols = 5, sampler_launch.BIN_BLOCK + 300  # two programs per row
    z = _tile(rows, cols, seed=0)
    top = torch.tensor([5.0, 5.0, 0.0, 4.0, float("inf")], dtype=torch.float64)
    lo = torch.tensor([-1.0, -5.0, -1.0, 3.875, float("inf")], dtype=torch.float64)
    scale = bin_scale(lo, top)
    lse = torch.tensor([6.0, 7.0, 0.0, 6.5, 0.0])
    counts = torch.zeros(rows, BINS)
    masses = torch.zeros(rows, BINS)
    sampler_launch.count_bins(z, scale, lse, counts, masses)
    at = sampler_passes._bins_of(z, scale)
    want_counts = torch.zeros(rows, BINS + 1).scatter_add_(1, at, torch.ones_like(z))[:, :BINS]
    terms = torch.exp(z.double() - lse.double()[:, None]).nan_to_num(
        nan=0.0, posinf=torch.finfo(torch.float32).max)
    want_masses = torch.zeros(rows, BINS + 1, dtype=torch.float64).scatter_add_(1, at, terms)
    assert torch.equal(counts, want_counts)
    assert counts[4].sum() == 0 and counts[2].sum() == 0 and counts[0].sum() > 0
    torch.testing.assert_close(masses.double(), want_masses[:, :BINS], rtol=1e-5, atol=1e-12)
    # without the masses: the counts alone, the masses' buffer untouched
    counts2, untouched = torch.zeros(rows, BINS), torch.zeros(rows, BINS)
    sampler_launch.count_bins(z, scale, None, counts2, untouched)
    assert torch.equal(counts2, want_counts) and not untouched.any()


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
    t_held = sampler_passes._collect_tile(z, at_least, v0, m, t_vals, t_ids,
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
    path's, the masses and ``sum exp(z - max)`` within fp32 summation error of it; a row of
    ``-inf`` keeps nothing, a row with a NaN has a NaN max and sum, as the torch path's."""
    rows, cols = 5, sampler_launch.BIN_BLOCK + 300  # two programs per row, then a narrower tile
    g = torch.Generator().manual_seed(3)
    rising = torch.arange(3, dtype=torch.float32)[:, None, None] * 0.75  # the max rises per tile
    tiles = [(torch.randint(-40, 41, (rows, cols), generator=g).float() / 8 + rising[i])
             for i in range(3)]
    tiles[2] = tiles[2][:, :700]
    for z in tiles:
        z[2] = float("-inf")
    tiles[1][1, 9] = float("nan")
    width = torch.tensor([0.3, 0.3, 0.3, 0.05, 1.7], dtype=torch.float64)
    state = sampler_launch.GridRows(width, cols, BINS)
    for z in tiles:
        state.add_tile(z)
    got = state.result()
    want = sampler_passes._grid_tiles((z.clone() for z in tiles), width)
    for name, a, b in zip(("max", "sum", "top", "counts", "masses"), got, want):
        b = b[:, :BINS] if b.dim() == 2 else b
        if name in ("max", "top", "counts"):
            assert torch.equal(a[[0, 2, 3, 4]], b[[0, 2, 3, 4]]), name
        else:
            torch.testing.assert_close(a[[0, 2, 3, 4]], b[[0, 2, 3, 4]], rtol=1e-5, atol=1e-12)
    assert got[0][1].isnan() and got[1][1].isnan() and want[1][1].isnan()
    assert got[3][2].sum() == 0 and got[1][2] == 0 and got[3][0].sum() > 100
    # the bins moved: the first tile's logits sit in lower bins than where they were counted
    assert got[2][0] == torch.ceil(torch.tensor(tiles[2][0].max().item() / 0.3, dtype=torch.float64))
