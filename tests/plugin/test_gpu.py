"""GPU behaviour (NCCL pool, memory fresh-state check, GPU placement under xdist); skipped without a
GPU."""

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
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-rA", "-W", "always", "-k",
                                           "not one_gpu",
                                           f"--tp={ws}")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([f"tplogp: world size {ws}, backend nccl (auto), devices cuda:*"])
    result.stdout.fnmatch_lines(["*pool recycled after this test: fresh-state check failed: CUDA "
                                 "memory *MiB above*"])


def _first_gpus(n: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` naming the first ``n`` of this process's visible GPUs."""
    from pytest_tplogp import devices

    return ",".join(devices.visible_gpus()[:n])


@pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 CUDA GPUs")
def test_xdist_gpu_blocks_are_disjoint(pytester: pytest.Pytester, tag: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", _first_gpus(2))
    pytester.makepyfile(test_body=BODY)
    # two workers on two GPUs: one GPU each, so world size 2 on NCCL does not fit and is skipped for
    # placement
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-p", "xdist", "-n", "2", "-rA",
                                           "-k",
                                           "nccl or one_gpu", "--tp-backend=nccl")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*GPU placement: needs 2 distinct GPU(s) for NCCL*xdist worker "
                                 "gw? of 2 owns 1 of 2 visible GPU(s): run with -n 1 or fewer*"])
    result.stdout.fnmatch_lines(["tplogp: 1 GPU test(s) skipped for placement*"])


SHARED_BODY = '''
import os
import pytest
import torch

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(4))
def test_plain_gpu_test(i):
    x = torch.ones(8, device="cuda")
    assert x.device.index == torch.cuda.current_device() == 0 and x.sum().item() == 8

@pytest.mark.gpu
@pytest.mark.tp(world_size=1)
@pytest.mark.parametrize("i", range(2))
def test_one_rank_nccl(tp, i):
    assert tp.backend == "nccl" and tp.device.type == "cuda"
'''


def test_more_workers_than_gpus_share_one(pytester: pytest.Pytester, tag: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU and two workers: every test that needs one device runs (worker I on GPU I mod 1),
    none is skipped."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", _first_gpus(1))
    pytester.makepyfile(test_body=SHARED_BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-p", "xdist", "-n", "2", "-rA")
    result.assert_outcomes(passed=6)
    result.stdout.no_fnmatch_line("*skipped for placement*")


SHARING_BODY = '''
import pytest
import torch
import torch.distributed as dist

@pytest.mark.gpu
@pytest.mark.tp(world_size=[2, 4])
def test_ranks_share_the_gpu(tp):
    current = torch.device("cuda", torch.cuda.current_device())
    assert tp.backend == "gloo" and tp.device == torch.device("cuda", 0) == current
    t = torch.full((3,), float(tp.rank + 1), device=tp.device)   # a CUDA tensor through gloo
    dist.all_reduce(t)
    assert t.device.type == "cuda" and t.tolist() == [sum(range(1, tp.world_size + 1))] * 3
'''


def test_ranks_share_one_gpu_over_gloo(pytester: pytest.Pytester, tag: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU, two xdist workers: world sizes 2 and 4 run with their ranks sharing the GPU over
    gloo (CUDA tensors), said in the header, each test's report and the summary; --tp-gpu-share=off
    skips them."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", _first_gpus(1))
    pytester.makepyfile(test_body=SHARING_BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-p", "xdist", "-n", "2", "-rA")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["tplogp: gpu tests at world size 2: 2 ranks share GPU(s) * over "
                                 "gloo (CUDA tensors)*"])
    result.stdout.fnmatch_lines(["*Captured tplogp placement setup*",
                                 "? ranks share GPU(s) * over gloo*"])
    result.stdout.fnmatch_lines(["tplogp: 2 gpu TP test(s) ran with ranks sharing GPUs over gloo*"])
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-p", "xdist", "-n", "2",
                                           "--tp-gpu-share=off")
    result.assert_outcomes(skipped=2)


MEMORY_BODY = '''
import pytest
import torch

LEAK = []

@pytest.mark.gpu
@pytest.mark.tp(world_size=1)
@pytest.mark.parametrize("i", range(3))
def test_gemm_forward_and_backward(tp, i):
    a = torch.randn(512, 512, device=tp.device, requires_grad=True)
    (a @ a.T).sum().backward()   # cuBLAS here and on autograd's device thread: workspaces stay
    assert a.grad.shape == a.shape

@pytest.mark.gpu
@pytest.mark.tp(world_size=1)
def test_leaks_a_tensor(tp):
    LEAK.append(torch.empty(16 << 20, dtype=torch.uint8, device=tp.device))

@pytest.mark.gpu
@pytest.mark.tp(world_size=1)
def test_after_the_leak(tp):
    assert not LEAK              # a fresh pool
'''


@pytest.mark.gpu
def test_library_workspaces_are_not_leaks_a_kept_tensor_is(pytester: pytest.Pytester,
                                                           tag: str) -> None:
    """GEMMs forward and backward leave cuBLAS workspaces in the caching allocator: no recycle. A
    tensor kept in a module global: one recycle, named, and counted in the terminal summary."""
    pytester.makepyfile(test_body=MEMORY_BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-rA", "-W", "always")
    result.assert_outcomes(passed=5)
    out = result.stdout.str()
    assert out.count("pool recycled after this test") == 1, out
    result.stdout.fnmatch_lines([
        "*test_leaks_a_tensor*",
        "*pool recycled after this test: fresh-state check failed: CUDA memory 16.0 MiB above the "
        "pool's baseline, 16.0 MiB of it in live tensors*"])
    result.stdout.fnmatch_lines(["tplogp: 1 pool recycle(s): 1 x fresh-state check failed: CUDA "
                                 "memory N MiB above the pool's baseline, N MiB of it in live "
                                 "tensors*"])
