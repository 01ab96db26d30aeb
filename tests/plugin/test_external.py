"""External mode: pytest launched by torchrun on CPU uses the existing process group and reports
from rank 0."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

BODY = '''
import os
import random
import numpy as np
import pytest
import torch
import torch.distributed as dist

@pytest.mark.tp
def test_collective(tp):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == tp.world_size == 2 and tp.external
    # random, torch and numpy seeded with the test's seed, as in the pool
    seed = torch.initial_seed()
    assert random.random() == random.Random(seed).random()
    assert np.random.rand() == np.random.RandomState(seed).rand()

@pytest.mark.tp
def test_fails_on_rank_1(tp):
    print(f"hello from rank {tp.rank}")
    assert tp.rank != 1, "rank 1 disagrees"

@pytest.mark.tp(world_size=[2, 4])
def test_sizes(tp):
    pass

def test_plain():
    pass
'''

MISMATCH = '''
import os

def test_everywhere():
    pass

if os.environ.get("RANK") == "1":
    def test_only_on_rank_1():
        pass
'''


@pytest.mark.slow
def test_torchrun_collection_mismatch(pytester: pytest.Pytester, tag: str, torchrun) -> None:
    pytester.makepyfile(test_body=MISMATCH)
    result = torchrun("test_body.py")
    result.stdout.fnmatch_lines(["*rank 1 collected different tests than rank "
                                 "0*test_only_on_rank_1*"])
    assert result.ret != 0


HANG = '''
@pytest.mark.tp
def test_fails_first(tp):
    assert tp.rank == 0, "rank 1 disagrees"

@pytest.mark.tp(timeout=2)
def test_hangs(tp):
    print(f"rank {tp.rank} before the barrier")
    if tp.rank == 1:
        dist.barrier()              # rank 0 never joins

@pytest.mark.tp
def test_never_runs(tp):
    pass
'''


@pytest.mark.slow
def test_torchrun_mode_and_a_hang_that_keeps_the_report(pytester: pytest.Pytester, tag: str,
                                                        torchrun) -> None:
    """Under torchrun only rank 0 reports: its header, a one-rank failure with each rank's
    captured output, a world size torchrun did not start skipped, plain tests run. Then a hang:
    rank 0 reports the outcomes so far, which rank hung where, the tests not run as errors, and
    writes JUnit."""
    import xml.etree.ElementTree as ET

    pytester.makepyfile(test_body=BODY + HANG)
    result = torchrun("test_body.py", "-rA", "-vv", "--junitxml=junit.xml", "-o",
                      "junit_logging=all")
    assert result.ret != 0
    out = result.stdout.str()
    assert out.count("test session starts") == 1, out  # only rank 0 reports
    result.stdout.fnmatch_lines([
        "tplogp: external mode (torchrun): world size 2, backend gloo, device cpu; this report is "
        "rank 0's*",
        "*FAILED test_body.py::test_fails_on_rank_1[[]tp2[]] - rank 1: AssertionError: rank 1 "
        "disagrees*",
    ])
    result.stdout.fnmatch_lines(["*Captured stdout rank 0 call*", "hello from rank 0",
                                 "*Captured stdout rank 1 call*", "hello from rank 1"])
    result.stdout.fnmatch_lines(["*SKIPPED*needs world size 4; torchrun started 2 ranks*"])
    # the hang, after the tests above (their outcomes are in the one report)
    result.stdout.fnmatch_lines([
        "*test_hangs[[]tp2[]] passed its deadline of 2 s*(1 test(s) not run, reported as errors)*",
        "*FAILED test_body.py::test_fails_first[[]tp2[]] - rank 1: AssertionError*",
        "*FAILED test_body.py::test_hangs[[]tp2[]] - deadline of 2 s exceeded*",
    ], consecutive=False)
    result.stdout.fnmatch_lines(["*rank 1 (pid *) waiting in barrier (torch/distributed/*) called "
                                 "from test_hangs (*test_body.py:*)*"])
    result.stdout.fnmatch_lines(["*ERROR at setup of test_never_runs[[]tp2[]]*",
                                 "E   not run: test_body.py::test_hangs[[]tp2[]] passed its "
                                 "deadline of 2 s and a process group cannot be respawned under "
                                 "torchrun, so the job ended"])
    result.stdout.fnmatch_lines(["ERROR test_body.py::test_never_runs[[]tp2[]] - not run: *",
                                 "*3 failed, 3 passed, 1 skipped, 1 error*"])
    cases = {c.get("name"): c for c in ET.parse(pytester.path / "junit.xml").getroot().iter(
        "testcase")}
    hang = cases["test_hangs[tp2]"]
    assert hang.find("failure").get("message").startswith(
        "deadline of 2 s exceeded: rank 1 still running")
    assert "[rank 0] rank 0 before the barrier" in hang.find("system-out").text
    assert cases["test_fails_first[tp2]"].find("failure") is not None
    assert "not run: " in cases["test_never_runs[tp2]"].find("error").get("message")


PEER_RAISES = '''
import pytest
import torch
import torch.distributed as dist

@pytest.mark.tp(world_size=3)
def test_before(tp):
    tp.assert_close(torch.ones(2), torch.ones(2))  # the first assert_close imports DTensor: seconds

@pytest.mark.tp(world_size=3)
def test_rank_raises(tp):
    if tp.rank == 2:
        raise RuntimeError("rank 2 gives up before the collective")
    tp.assert_close(torch.ones(2), torch.ones(2))      # ranks 0 and 1 wait here for rank 2

@pytest.mark.tp(world_size=3)
def test_next(tp):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 3

def test_plain_after():
    pass
'''


@pytest.mark.slow
def test_torchrun_peer_raises_inside_a_collective(pytester: pytest.Pytester, tag: str,
                                                  torchrun) -> None:
    """A rank raises while its peers wait in a collective: FAILED on rank 0's report, terminal and
    JUnit, after the straggler grace (not the deadline), with the stuck ranks' stacks; the tests
    that could not run are errors."""
    import xml.etree.ElementTree as ET

    pytester.makepyfile(test_body=PEER_RAISES)
    result = torchrun("test_body.py", "-rA", "-vv", "--junitxml=junit.xml", "--tp-timeout=100",
                      nproc=3)
    assert result.ret != 0
    out = result.stdout.str()
    assert "PASSED test_body.py::test_rank_raises" not in out, out
    result.stdout.fnmatch_lines([
        "E   rank 2: RuntimeError: rank 2 gives up before the collective; ranks 0-1 did not finish "
        "within 3 s after a peer failed or skipped (stuck in a collective?)",
    ])
    # ranks 0 and 1 wait in the same place: one line, one stack; no pytest, pluggy or plugin-thread
    # frames
    result.stdout.fnmatch_lines([
        "  ranks 0-1 (pids *, *) waiting in *(torch/distributed/*) called from test_rank_raises "
        "(*test_body.py:13)",
        "--- ranks 0-1 stack (faulthandler, SIGUSR1) ---",
        "*File*test_body.py*line 13 in test_rank_raises*",
        "  (* frame(s) of pytest_tplogp, pytest and pluggy below the test and 1 thread(s) of "
        "pytest_tplogp not shown)",
    ])
    for harness in ("/_pytest/", "/pluggy/", "in _own_stack", "Thread 0x"):
        assert harness not in out, harness
    result.stdout.fnmatch_lines([
        "test_body.py::test_before[[]tp3[]] PASSED*",
        "test_body.py::test_rank_raises[[]tp3[]] FAILED*",
        "test_body.py::test_next[[]tp3[]] ERROR*",
        "test_body.py::test_plain_after ERROR*",
    ])
    result.stdout.fnmatch_lines(["ERROR test_body.py::test_next[[]tp3[]] - not run: "
                                 "test_body.py::test_rank_raises[[]tp3[]] left ranks in a "
                                 "collective 3 s after a peer failed*"])
    result.stdout.fnmatch_lines(["FAILED test_body.py::test_rank_raises[[]tp3[]] - rank 2: "
                                 "RuntimeError: rank 2 gives up*"])
    result.stdout.fnmatch_lines(["*1 failed, 1 passed, 2 errors*"])
    cases = {c.get("name"): c for c in ET.parse(pytester.path / "junit.xml").getroot().iter(
        "testcase")}
    assert (set(cases) == {"test_before[tp3]", "test_rank_raises[tp3]", "test_next[tp3]",
                           "test_plain_after"})
    failed = cases["test_rank_raises[tp3]"]
    assert failed.find("failure").get("message").startswith("rank 2: RuntimeError: rank 2 gives up")
    # the straggler grace, not the 100 s deadline
    assert float(failed.get("time")) < 30, failed.get("time")
    for name in ("test_next[tp3]", "test_plain_after"):
        assert "not run: " in cases[name].find("error").get("message"), name


RESTARTS = '''
import pytest
import torch
import torch.distributed as dist

@pytest.mark.tp
def test_before(tp):
    dist.barrier()

@pytest.mark.tp
def test_rank_raises(tp):
    if tp.rank == 1:
        raise RuntimeError("rank 1 gives up before the collective")
    dist.barrier()                  # rank 0 waits here: the job ends after the straggler grace

@pytest.mark.tp
def test_next(tp):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2

def test_plain_after():
    pass
'''


@pytest.mark.slow
def test_torchrun_restarts_resume_at_the_next_test(pytester: pytest.Pytester, tag: str,
                                                   torchrun) -> None:
    """With torchrun --max-restarts, a test that leaves ranks in a collective ends the attempt,
    reported once; the restarted workers rendezvous afresh (no stale gloo addresses), skip the tests
    done and run the rest; the job still fails, and the attempt after the last test finds nothing
    left to run."""
    pytester.makepyfile(test_body=RESTARTS)
    result = torchrun("test_body.py", "-rA", "-v", "--junitxml=junit.xml",
                      launcher=("--max-restarts=2",))
    assert result.ret != 0
    out = result.stdout.str() + result.stderr.str()
    for wrong in ("INTERNALERROR", "connectFullMesh", "not run: "):
        assert wrong not in out, out
    result.stdout.fnmatch_lines([
        "test_body.py::test_before[[]tp2[]] PASSED*",
        "test_body.py::test_rank_raises[[]tp2[]] FAILED*",
        "tplogp (torchrun): test_body.py::test_rank_raises[[]tp2[]] left ranks in a collective 3 s "
        "after a peer failed; * this attempt ends; torchrun restarts the job (2 restart(s) left) "
        "and it resumes at the next test.",
        "tplogp (torchrun): restart 1 of 2: the first 2 test(s) ran in earlier attempts (1 failed, "
        "reported above); resuming at test_body.py::test_next[[]tp2[]]",
        "test_body.py::test_next[[]tp2[]] PASSED*",
        "test_body.py::test_plain_after PASSED*",
        "*2 passed, 2 deselected*",
    ])
    assert out.count("FAILED test_body.py::test_rank_raises") == 1, out
    assert ("restart 2 of 2: the first 4 test(s) ran in earlier attempts (1 failed, reported "
            "above); none left to run") in out, out
    assert (pytester.path / "junit.xml").exists()
    assert (pytester.path / "junit.restart1.xml").exists()
