"""GPU placement under pytest-xdist, on faked GPUs: ``CUDA_VISIBLE_DEVICES`` names devices that need
not exist, and the placement (decided in each worker before anything touches CUDA) is what is
checked, not a kernel."""

from __future__ import annotations

import pytest
from tests.support.plugin_helpers import leftover_processes

pytest_plugins = ["pytester"]


def devices_without_nccl() -> bool:
    from pytest_tplogp import devices

    return not devices.nccl_available()

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
    pass  # no worker owns 2 GPUs: shared over gloo, or skipped for placement (--tp-gpu-share=off)
'''


@pytest.mark.slow
def test_placement_under_xdist_on_faked_gpus(pytester: pytest.Pytester, tag: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    pytester.makepyfile(test_body=PLACEMENT_BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-p", "xdist", "-n", "3", "-rs",
                                           "--tp-gpu-share=off")
    result.assert_outcomes(passed=3, skipped=2)
    result.stdout.fnmatch_lines([
        "SKIPPED [[]1[]] test_body.py:*: GPU placement: needs 2 distinct GPU(s) for NCCL (one per "
        "rank); xdist worker gw? of 3 owns 0 of 2 visible GPU(s), shares GPU ? for one-device "
        "tests: run with -n 1 or fewer (-n <= GPUs // world size), or --tp-gpu-share=on and "
        "backend auto (ranks share the GPUs over gloo)",
    ])
    result.stdout.fnmatch_lines(["tplogp: 2 GPU test(s) skipped for placement: their xdist worker "
                                 "owns fewer GPUs than they need (run with -n <= GPUs // world "
                                 "size*"])
    # (no GPU at all: the multi-GPU tests skip for want of GPUs, which is not placement:
    # test_selection.py::test_parent_side_skips_spawn_nothing)
    assert leftover_processes(tag) == []


@pytest.mark.slow
def test_sharing_is_the_default_and_says_so(pytester: pytest.Pytester, tag: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Two faked GPUs, -n 3: the header says that gpu TP tests share; each worker places the
    world-size-2 test on gloo ranks sharing its one-device GPU. Faked GPUs cannot start such a pool,
    so its start error and the test's report name the placement (on a real GPU the test runs:
    tests/plugin/test_gpu.py)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    pytester.makepyfile(test_body=PLACEMENT_BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-p", "xdist", "-n", "3", "-rA",
                                           "-k", "two")
    # why: NCCL's rule (a GPU per rank), or a torch without NCCL, as this CPU build of torch is
    why = ["NCCL needs 2 distinct GPUs and xdist worker gw? of 3 owns 0 of 2 visible GPU(s)*",
           "torch was built without NCCL"][devices_without_nccl()]
    result.stdout.fnmatch_lines([
        "tplogp: gpu tests at world size 2: 2 ranks share GPU(s) 0 over gloo (CUDA tensors): "
        f"{why.replace('gw?', 'gw0')}; --tp-gpu-share=off skips them"])
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*tplogp pool (world size 2, gloo, 2 ranks sharing cuda:?) could "
                                 "not start*"])
    result.stdout.fnmatch_lines(["*Captured tplogp placement setup*",
                                 f"2 ranks share GPU(s) ? over gloo (CUDA tensors): {why}"])
    result.stdout.no_fnmatch_line("*skipped for placement*")
    assert leftover_processes(tag) == []
