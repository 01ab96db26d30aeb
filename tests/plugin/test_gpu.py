"""GPU behaviour (NCCL pool, memory fresh-state check, disjoint GPU blocks under xdist); skipped without 2 GPUs."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


pytestmark = pytest.mark.skipif(_gpu_count() < 1, reason="needs a CUDA GPU")

BODY = '''
import os
import pytest
import torch
import torch.distributed as dist

LEAK = []

@pytest.mark.gpu
@pytest.mark.tp
def test_nccl(tp):
    assert tp.backend == "nccl" and tp.device.type == "cuda"
    t = torch.ones(1, device=tp.device) * (tp.rank + 1)
    dist.all_reduce(t)
    assert t.item() == sum(range(1, tp.world_size + 1))
    tp.assert_all(torch.cuda.current_device() == tp.rank, "each rank owns its own GPU")

@pytest.mark.tp
def test_leaks_memory(tp):
    LEAK.append(torch.empty(64 << 20, dtype=torch.uint8, device=tp.device))

@pytest.mark.tp
def test_after_leak(tp):
    assert not LEAK   # a fresh pool: module state is gone
    dist.barrier()

@pytest.mark.tp(world_size=1)
def test_one_gpu(tp):
    print("visible", os.environ.get("CUDA_VISIBLE_DEVICES"))
'''


def test_nccl_pool_and_memory_check(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body=BODY)
    ws = min(2, _gpu_count())
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-rA", "-W", "always", "-k", "not one_gpu",
                                           f"--tp={ws}")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([f"tplogp: world size {ws}, backend nccl (auto), devices cuda:*"])
    result.stdout.fnmatch_lines(["*pool recycled after this test: fresh-state check failed: CUDA memory *MiB above*"])


@pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 CUDA GPUs")
def test_xdist_gpu_blocks_are_disjoint(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body=BODY)
    # two workers on (at least) two GPUs: one GPU each, so world size 2 on NCCL does not fit and is skipped
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-p", "xdist", "-n", "2", "-rA", "-k",
                                           "nccl or one_gpu", "--tp-backend=nccl")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*needs 2 GPU(s) for NCCL*xdist worker gw* of 2 owns * GPU(s)*"])
