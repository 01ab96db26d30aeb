"""On one CUDA GPU: the profiler shows the backward's d_hidden all-reduce issued before the d_W GEMM (the backend
hands d_hidden over as soon as it is complete). A one-rank NCCL group runs the same hook the TP layer installs
(``OverlappedAllReduce.start``). Set ``TPLOGP_OVERLAP_TRACE=path.json`` to keep the chrome trace. Skipped without
CUDA."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from tests.support.cuda import cuda_backend  # noqa: E402


@pytest.fixture
def one_rank_nccl(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _gemm_and_reduce_order(events):
    """CPU-side launch order of the collective and the GEMMs in a profiler event list."""
    order = []
    for e in sorted(events, key=lambda e: e.time_range.start):
        name = e.name.lower()
        if "allreduce" in name or "all_reduce" in name:
            order.append("all_reduce")
        elif name in ("aten::mm", "aten::addmm", "aten::addmm_"):
            order.append("gemm")
    return order


@pytest.mark.parametrize("source", ["native", "triton", "sm90"])
def test_all_reduce_issued_before_the_d_w_gemm(source, one_rank_nccl):
    from tplogp.support.comm import OverlappedAllReduce
    from tplogp.backends.base import ShardCall

    be = cuda_backend(source)
    n, d, v = 2048, 1024, 8192
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16, generator=gen) / 32
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    call = ShardCall()
    st = be.forward_stats(h, w, None, t, call)
    g = torch.randn(n, device="cuda", generator=gen)
    args = (h, w, None, t, st.row_max, torch.log(st.sum_exp), g, None, None, None, call, (True, True, False))

    def backward():
        reduce = OverlappedAllReduce(one_rank_nccl, torch.device("cuda", torch.cuda.current_device()))
        grads = be.backward(*args, d_hidden_ready=reduce.start)
        return reduce.finish(grads.d_hidden), grads.d_weight

    backward()  # warm-up (NCCL communicator, kernels)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        d_hidden, d_weight = backward()
        torch.cuda.synchronize()
    trace = os.environ.get("TPLOGP_OVERLAP_TRACE")
    if trace:
        prof.export_chrome_trace(trace)
    order = _gemm_and_reduce_order(prof.events())
    assert "all_reduce" in order and order[-1] == "gemm" and order.index("all_reduce") < len(order) - 1, order
    ref_h = be.backward(*args)
    torch.testing.assert_close(d_hidden, ref_h.d_hidden, rtol=0, atol=0)
    torch.testing.assert_close(d_weight, ref_h.d_weight, rtol=0, atol=0)
