"""External mode: pytest launched by torchrun on CPU uses the existing process group and reports from rank 0."""

from __future__ import annotations

import shutil
import sys

import pytest

pytest_plugins = ["pytester"]

BODY = '''
import os
import pytest
import torch
import torch.distributed as dist

@pytest.mark.tp
def test_collective(tp):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == tp.world_size == 2 and tp.external

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


def test_torchrun_collection_mismatch(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body=MISMATCH)
    result = _torchrun(pytester, "test_body.py")
    result.stdout.fnmatch_lines(["*rank 1 collected different tests than rank 0*test_only_on_rank_1*"])
    assert result.ret != 0
