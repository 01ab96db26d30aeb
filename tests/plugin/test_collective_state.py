"""What a body leaves in the process groups, and who is blamed; tp_pool's explicit dispatch: one
pytester session (pools of world size 2, 3 and 4).

- ``tp.new_group(ranks, use_local_synchronization=True)``: only the members call it; the group is
  cached, so the pool is not recycled.
- An async collective issued on one rank only and never waited for fails the test that issued it
  (not the next one), which names the rank and the group; the pool is recycled and the next test
  passes. Collectives issued on every rank and never waited for, and sends between some ranks only,
  are no problem.
- A rank killed by a signal while its peers wait in a collective: the headline names it and the
  signal first, the peers' gloo errors after; the next test runs on a fresh pool.
- The terminal summary counts the pool recycles, with their reasons.
- ``tp_pool.run`` (explicit dispatch, test_pool.py) returns every rank's result, on a pool of the
  marker's world size or the default one, and raises a one-rank failure naming the rank.
"""

from __future__ import annotations

import pytest
from tests.support.plugin_helpers import leftover_processes

pytest_plugins = ["pytester"]

BODY = '''
import os, signal
import pytest
import torch
import torch.distributed as dist

@pytest.mark.tp(world_size=4)
def test_a_local_sync_group(tp):
    if tp.rank in (1, 2):       # only the members call it, as dist.new_group's local kind allows
        g = tp.new_group([2, 1], use_local_synchronization=True)
        assert tp.new_group([1, 2], use_local_synchronization=True) is g     # cached
        t = torch.full((1,), float(tp.rank))
        dist.all_reduce(t, group=g)
        assert t.item() == 3.0
        assert dist.get_process_group_ranks(g) == [1, 2]
    everyone = tp.new_group([1, 2])     # the collective kind: a group of its own, made by all
    assert tp.rank not in (1, 2) or dist.get_process_group_ranks(everyone) == [1, 2]

@pytest.mark.tp(world_size=2)
def test_b_leaves_an_unmatched_async_collective(tp):
    if tp.rank == 1:
        dist.all_reduce(torch.ones(1), async_op=True)       # never waited for; rank 0 never joins

@pytest.mark.tp(world_size=2)
def test_c_next_test_is_healthy(tp):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2

@pytest.mark.tp(world_size=4)
def test_d_unwaited_on_every_rank_and_uneven_sends_are_fine(tp):
    dist.all_reduce(torch.ones(1), async_op=True)   # every rank, never waited for: it completes
    if tp.rank == 0:
        dist.send(torch.ones(1), 1)                 # moves ranks 0 and 1's sequence numbers only
    elif tp.rank == 1:
        dist.recv(torch.ones(1), 0)

@pytest.mark.tp(world_size=4)
def test_e_rank_killed_mid_collective(tp):
    t = torch.ones(1000)
    dist.all_reduce(t)
    if tp.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(3):
        dist.all_reduce(t)

@pytest.mark.tp(world_size=4)
def test_f_after_the_death(tp):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 4
'''


POOL_BODY = '''
import pytest
import torch
import torch.distributed as dist

def gather_rank(tp, scale):
    t = torch.tensor([float(tp.rank)])
    dist.all_reduce(t)
    return (tp.rank, t.item() * scale)

def boom(tp):
    if tp.rank == 1:
        raise RuntimeError("boom on one rank")
    return tp.rank

@pytest.mark.tp(world_size=3)
def test_run_returns_every_rank(tp_pool):
    results = tp_pool.run(gather_rank, 2.0)
    n = tp_pool.world_size
    assert results == [(r, 2.0 * sum(range(n))) for r in range(n)]

def test_default_world_size(tp_pool):
    assert tp_pool.run(gather_rank, 1.0) == [(0, 1.0), (1, 1.0)]

def test_failure_is_raised(tp_pool):
    tp_pool.run(boom)
'''


def test_groups_blame_and_explicit_dispatch(pytester: pytest.Pytester, tag: str) -> None:
    """Every item of the module docstring, from one session."""
    pytester.makepyfile(test_body=BODY, test_pool=POOL_BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-vv", "-rA", "-W", "always",
                                           "--tp-timeout=60")
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["*test_a_local_sync_group*PASSED*"])
    result.stdout.fnmatch_lines([
        "*test_b_leaves_an_unmatched_async_collective*FAILED*",
        "*test_c_next_test_is_healthy*PASSED*",
        "*test_d_unwaited_on_every_rank_and_uneven_sends_are_fine*PASSED*"])
    result.stdout.fnmatch_lines([
        "E   collective left unmatched: rank 1 left 1 collective(s) never waited for and unmatched "
        "on the default group (sequence numbers rank 1: *; rank 0: *): an async_op=True "
        "collective issued on some ranks only*",
        "*pool (world size 2, gloo, cpu) killed (fresh-state check failed: collective(s) left "
        "unmatched)*"])
    assert out.count("pool recycled") == 0, out  # only after the test that left it: it failed
    result.stdout.fnmatch_lines(["*test_e_rank_killed_mid_collective*FAILED*",
                                 "*test_f_after_the_death*PASSED*"])
    result.stdout.fnmatch_lines(["E   rank 1 was killed by SIGKILL (signal 9); then on its peers:*",
                                 "FAILED test_body.py::test_e_rank_killed_mid_collective[[]tp4[]] "
                                 "- rank 1 was killed by SIGKILL (signal 9)*"])
    # the terminal summary counts the pool recycles with their reasons
    result.stdout.fnmatch_lines(["tplogp: 2 pool recycle(s): 1 x fresh-state check failed: "
                                 "collective(s) left unmatched; 1 x ranks died"])
    # tp_pool.run
    result.stdout.fnmatch_lines(["*test_run_returns_every_rank[[]tp3[]] PASSED*",
                                 "*FAILED test_pool.py::test_failure_is_raised[[]tp2[]] - rank 1: "
                                 "RuntimeError: boom on one rank*"])
    result.assert_outcomes(passed=6, failed=3)
    assert leftover_processes(tag) == []
