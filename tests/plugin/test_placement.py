"""GPU placement under pytest-xdist, on faked GPUs: ``CUDA_VISIBLE_DEVICES`` names devices that need not exist, and
the placement (decided in each worker before anything touches CUDA) is what is checked, not a kernel."""

from __future__ import annotations

import pytest
from tests.support.plugin_helpers import leftover_processes

pytest_plugins = ["pytester"]

PLACEMENT_BODY = '''
import os
import pytest
from pytest_tplogp import devices

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(3))
def test_one_device(i):
    # more workers (3) than GPUs (2): worker gwI runs on GPU I mod 2, none is skipped
    worker = int(os.environ["PYTEST_XDIST_WORKER"][2:])
    assert devices.one_gpu() == ("0", "1")[worker % 2]
    print("one-device test ran")

@pytest.mark.gpu
@pytest.mark.tp(world_size=2)
@pytest.mark.parametrize("i", range(2))
def test_two_distinct_gpus(tp, i):
    pass  # no worker owns 2 GPUs: skipped for placement, before anything is spawned
'''


@pytest.mark.slow
def test_placement_under_xdist_on_faked_gpus(pytester: pytest.Pytester, tag: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    pytester.makepyfile(test_body=PLACEMENT_BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-p", "xdist", "-n", "3", "-rs")
    result.assert_outcomes(passed=3, skipped=2)
    result.stdout.fnmatch_lines([
        "SKIPPED [[]1[]] test_body.py:*: GPU placement: needs 2 distinct GPU(s) for NCCL (one per rank); xdist worker "
        "gw? of 3 owns 0 of 2 visible GPU(s), shares GPU ? for one-device tests: run with -n 1 or fewer "
        "(-n <= GPUs // world size)",
    ])
    result.stdout.fnmatch_lines(["tplogp: 2 GPU test(s) skipped for placement: their xdist worker owns fewer GPUs "
                                 "than they need (run with -n <= GPUs // world size*"])
    # no GPU at all: the multi-GPU tests skip for want of GPUs, which is not placement (no summary line)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-rs", "-k", "two")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["SKIPPED [[]2[]] *needs 2 distinct GPU(s) for NCCL (one per rank); this process has none*"])
    result.stdout.no_fnmatch_line("*skipped for placement*")
    assert leftover_processes(tag) == []
