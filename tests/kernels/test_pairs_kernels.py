"""The pairs' ``d_W`` kernel (:mod:`tplogp.kernels.pairs_kernels`, CPU interpreter) against the
ids' runs summed in torch (:func:`tplogp.backends.support_pairs._rows_summed`): written in fp32 and
bf16 (rounded once), added to fp32 accumulators, the padding's run (id ``v``) writing nothing, ids
without pairs left at 0, ``D`` past one block."""

from __future__ import annotations

import pytest
import torch

from tests.support.interpreter import interpreter_only
from tplogp.backends import support_pairs

pytestmark = interpreter_only
pytest.importorskip("triton")

from tplogp.kernels import pairs_launch  # noqa: E402


def _pairs(seed: int, n: int = 9, v: int = 40, p: int = 60):
    """Pairs sorted by id (a tail of padding, id ``v``), their tokens and dz, and run starts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(0, v, (p,), generator=g), torch.full((7,), v)])
    ids = ids.sort().values
    tokens = torch.randint(0, n, (ids.numel(),), generator=g)
    dz = torch.randn(ids.numel(), generator=g).masked_fill(ids == v, 0.0)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = ids[1:] != ids[:-1]
    return ids, tokens, dz, first.nonzero().squeeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
def test_pair_rows_are_the_runs_sums(dtype, accumulate):
    n, v, d = 9, 40, pairs_launch.PAIR_BLOCK_D + 37
    ids, tokens, dz, run_starts = _pairs(seed=1, n=n, v=v)
    hidden = torch.randn(n, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    want, _ = support_pairs._rows_summed(ids, dz, tokens, hidden, v, torch.float32, None, 16)
    union = ids.index_select(0, run_starts)
    starts = torch.cat([run_starts, run_starts.new_full((1,), ids.numel())])
    if accumulate:
        out = torch.full((v, d), 0.5)
        pairs_launch.pair_rows(starts, union, tokens, dz, hidden, out, True)
        torch.testing.assert_close(out, want + 0.5, rtol=1e-6, atol=1e-5)
    else:
        out = torch.zeros(v, d, dtype=dtype)
        pairs_launch.pair_rows(starts, union, tokens, dz, hidden, out, False)
        torch.testing.assert_close(out, want.to(dtype), rtol=0, atol=0) if dtype == torch.bfloat16 \
            else torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-5)
    absent = torch.ones(v, dtype=torch.bool)
    absent[union[union < v]] = False
    assert not out[absent].sub(0.5 if accumulate else 0.0).any()
