"""External mode: pytest launched by torchrun on CPU uses the existing process group and reports from rank 0."""

from __future__ import annotations

import shutil
import sys

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


def _torchrun(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    exe = shutil.which("torchrun")
    cmd = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    return pytester.run(*cmd, "--standalone", "--nproc_per_node=2", "-m", "pytest", "-p", "pytest_tplogp",
                        "-p", "no:cacheprovider", *args, timeout=180)


@pytest.mark.slow
def test_torchrun_mode(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body=BODY)
    result = _torchrun(pytester, "test_body.py", "-rA", "-vv")
    out = result.stdout.str()
    assert out.count("test session starts") == 1, out  # only rank 0 reports
    result.stdout.fnmatch_lines([
        "tplogp: external mode (torchrun): world size 2, backend gloo, device cpu; this report is rank 0's*",
        "*FAILED test_body.py::test_fails_on_rank_1[[]tp2[]] - rank 1: AssertionError: rank 1 disagrees*",
    ])
    result.stdout.fnmatch_lines(["*Captured stdout rank 0 call*", "hello from rank 0",
                                 "*Captured stdout rank 1 call*", "hello from rank 1"])
    result.stdout.fnmatch_lines(["*SKIPPED*needs world size 4; torchrun started 2 ranks*"])
    result.stdout.fnmatch_lines(["*1 failed, 3 passed, 1 skipped*"])
    assert result.ret != 0


@pytest.mark.slow
def test_torchrun_collection_mismatch(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body=MISMATCH)
    result = _torchrun(pytester, "test_body.py")
    result.stdout.fnmatch_lines(["*rank 1 collected different tests than rank 0*test_only_on_rank_1*"])
    assert result.ret != 0


HANG = '''
import pytest
import torch.distributed as dist

@pytest.mark.tp
def test_fails_first(tp):
    assert tp.rank == 0, "rank 1 disagrees"

@pytest.mark.tp(timeout=3)
def test_hangs(tp):
    print(f"rank {tp.rank} before the barrier")
    if tp.rank == 1:
        dist.barrier()              # rank 0 never joins

@pytest.mark.tp
def test_never_runs(tp):
    pass
'''


@pytest.mark.slow
def test_torchrun_hang_keeps_the_report(pytester: pytest.Pytester, tag: str) -> None:
    """A hang under torchrun: rank 0 reports the outcomes so far, which rank hung where, and writes JUnit."""
    import xml.etree.ElementTree as ET

    pytester.makepyfile(test_body=HANG)
    result = _torchrun(pytester, "test_body.py", "-rA", "--junitxml=junit.xml", "-o", "junit_logging=all")
    assert result.ret != 0
    result.stdout.fnmatch_lines([
        "*test_hangs[[]tp2[]] passed its deadline of 3 s*(1 test(s) not run)*",
        "*FAILED test_body.py::test_fails_first[[]tp2[]] - rank 1: AssertionError*",
        "*FAILED test_body.py::test_hangs[[]tp2[]] - deadline of 3 s exceeded*",
    ], consecutive=False)
    result.stdout.fnmatch_lines(["*rank 1 (pid *) waiting in barrier (torch/distributed/*) called from test_hangs "
                                 "(*test_body.py:*)*"])
    result.stdout.fnmatch_lines(["*2 failed*"])
    cases = {c.get("name"): c for c in ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")}
    hang = cases["test_hangs[tp2]"]
    assert hang.find("failure").get("message").startswith("deadline of 3 s exceeded: rank 1 still running")
    assert "[rank 0] rank 0 before the barrier" in hang.find("system-out").text
    assert cases["test_fails_first[tp2]"].find("failure") is not None
