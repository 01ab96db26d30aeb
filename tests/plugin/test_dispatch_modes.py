"""pytest-xdist (own pool per worker, no ports), and the operator fixtures end to end. (tp_pool's
explicit dispatch: test_collective_state.py.)"""

from __future__ import annotations

import pytest
from tests.support.plugin_helpers import leftover_processes

pytest_plugins = ["pytester"]

XDIST_BODY = '''
import os
import pytest
import torch
import torch.distributed as dist

@pytest.mark.tp
@pytest.mark.parametrize("i", range(6))
def test_many(tp, i):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == tp.world_size
    print(os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.tp
def test_fails_on_rank_1(tp):
    assert tp.rank == 0
'''


@pytest.mark.slow
def test_under_xdist(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body=XDIST_BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-n", "2", "-p", "xdist", "-rf",
                                           "-vv", "--tb=line")
    result.assert_outcomes(passed=6, failed=1)
    # the controller's summary line carries the headline, as without xdist (no "E   " of the report
    # body)
    result.stdout.fnmatch_lines(["FAILED test_body.py::test_fails_on_rank_1[[]tp2[]] - rank 1: "
                                 "AssertionError: assert 1 == 0"])
    # --tb=line crosses xdist's report transport: the failure is one line, not the whole grouped
    # report
    assert (not any("Captured" in line or line.startswith("E ")
                    for line in result.outlines)), result.outlines
    result.stdout.fnmatch_lines(["*test_body.py:*: rank 1: AssertionError: assert 1 == 0"])
    assert leftover_processes(tag) == []


OP_BODY = '''
import pytest
import torch
import torch.nn.functional as F
from tplogp.tolerances import assert_no_worse

# One shape, chosen for the uneven layouts of the default 1031-token vocabulary at world size 2.
@pytest.mark.tp
def test_logp_matches_reference(tp, vocab_shards, op_source, dtype, bias, reference):
    tokens, hidden_dim = 8, 16
    h = torch.randn(tokens, hidden_dim).to(dtype)      # seeded per test: identical on every rank
    w = torch.randn(vocab_shards.vocab_size, hidden_dim).to(dtype)
    b = torch.randn(vocab_shards.vocab_size).to(dtype) if bias else None
    t = torch.randint(0, vocab_shards.vocab_size, (tokens,))
    out = op_source(h, vocab_shards.shard(w), t, None if b is None else vocab_shards.shard(b),
                    tp_group=tp.group, vocab_start_index=vocab_shards.start,
                    global_vocab_size=vocab_shards.vocab_size)
    expected = reference.fp32(h, w, t, b)
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    tp.assert_close(out.float(), expected, atol=tol, rtol=tol)
    # the project's rule: error vs float64 no worse than the same-dtype reference's (tolerances)
    with tp.agree():
        matching, truth = reference.matching(h, w, t, b), reference.float64(h, w, t, b)
        assert_no_worse("logp", out, matching, truth, dtype)
'''


@pytest.mark.slow
def test_operator_fixtures_end_to_end(pytester: pytest.Pytester, tag: str) -> None:
    pytest.importorskip("tplogp.backends.kernel_registry")
    pytester.makepyfile(test_body=OP_BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp.lmhead", "-rA",
                                           "--tp-op-source=registry,native,sm90",
                                           "--tp-dtype=fp32,bf16")
    # 2 shard layouts x 2 dtypes x 2 bias settings for each runnable source; sm90 is skipped on CPU
    result.assert_outcomes(passed=16, skipped=8)
    result.stdout.fnmatch_lines(["*op source sm90 unavailable on cpu*"])
