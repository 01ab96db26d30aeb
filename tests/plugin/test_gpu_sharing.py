"""Where a ``gpu`` TP test's ranks run on 1, 2, 4 and 8 GPUs, with and without pytest-xdist: NCCL
with a GPU per rank when the worker's block holds enough GPUs, else gloo ranks sharing the worker's
GPUs (on by default), or today's skip with ``--tp-gpu-share=off``. In-process, on faked
``CUDA_VISIBLE_DEVICES``: the rules, not a kernel."""

from __future__ import annotations

import pytest

from pytest_tplogp import devices
from pytest_tplogp.options import Settings
from pytest_tplogp.pool import PoolKey

WORLD_SIZES = (1, 2, 4, 8)
# GPU counts of the machines the rules must serve, each with the worker counts people run there
# (None: no xdist)
MACHINES = [(1, [None, 1, 2, 4]), (2, [None, 1, 2, 4]), (4, [None, 1, 2, 4]),
            (8, [None, 1, 2, 4, 8])]


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch):
    """``machine(n)``: n visible GPUs ("0".."n-1") and NCCL available; the worker is passed to each
    rule."""
    monkeypatch.setattr(devices, "nccl_available", lambda: True)

    def set_gpus(n: int) -> None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(n)))
        devices.visible_gpus.cache_clear()

    yield set_gpus
    devices.visible_gpus.cache_clear()


def _workers(count: int | None) -> list:
    return [None] if count is None else [(i, count) for i in range(count)]


@pytest.mark.parametrize("gpus, counts", MACHINES, ids=[f"{n}gpu" for n, _ in MACHINES])
def test_every_gpu_test_is_placed_nccl_when_it_fits_else_shared(machine, gpus: int,
                                                                counts: list) -> None:
    machine(gpus)
    for count in counts:
        nccl_gpus: list[set] = []
        for worker in _workers(count):
            block = devices.gpu_block(worker)
            for w in WORLD_SIZES:
                where = f"{gpus} GPU(s), worker {worker}, world size {w}"
                p = devices.place(w, "auto", needs_gpu=True, share=True, worker=worker)
                assert p.skip_reason is None, where
                # a GPU per rank: NCCL on distinct GPUs of this worker
                if w == 1 or len(block) >= w:
                    assert p == devices.Placement("nccl", devices.gpus_for(w, worker)), where
                    assert len(set(p.devices)) == w, where
                    assert w == 1 or set(p.devices) <= set(block), where
                    nccl_gpus.append((worker, set(p.devices)) if w > 1 else (worker, set()))
                    continue
                assert p.backend == "gloo" and p.shared, where
                if block:  # the worker's own GPUs, as many as there are ranks
                    assert p.devices == block[:w], where
                else:  # more workers than GPUs: the one GPU this worker uses for one-device tests
                    assert p.devices == (devices.one_gpu(worker),), where
                key = PoolKey(w, p.backend, p.devices)
                on = [key.device_index(r) for r in range(w)]
                # every shared GPU is used
                assert sorted(set(on)) == list(range(len(p.devices))), where
                assert max(on.count(i) for i in set(on)) - min(
                    on.count(i) for i in set(on)) <= 1, where  # evenly
                off = devices.place(w, "auto", needs_gpu=True, share=False, worker=worker)
                assert off.skip_reason is not None and "needs" in off.skip_reason, where
                plain = devices.place(w, "auto", needs_gpu=False, share=True, worker=worker)
                # not a gpu test: CPU, never shared
                assert plain == devices.Placement("gloo", ("cpu",)), where
        # NCCL pools of different workers never share a GPU (each worker's block is its own)
        for i, (wi, gi) in enumerate(nccl_gpus):
            for wj, gj in nccl_gpus[i + 1:]:
                assert wi == wj or not (gi & gj), (gpus, count, wi, wj)


@pytest.mark.parametrize("gpus, count, world_size, expected", [
    # one H200, -n 4: four ranks on GPU 0 in every worker
    (1, 4, 4, ("gloo", ("0",))),
    (1, None, 2, ("gloo", ("0",))),
    (2, None, 4, ("gloo", ("0", "1"))),          # ranks 0, 2 on GPU 0; 1, 3 on GPU 1
    (2, 2, 2, ("gloo", ("1",))),                 # worker gw1's block is GPU 1
    (4, None, 4, ("nccl", ("0", "1", "2", "3"))),
    (4, 1, 4, ("nccl", ("0", "1", "2", "3"))),   # 4 GPUs and -n 1: NCCL
    (4, 2, 4, ("gloo", ("2", "3"))),
    (8, 4, 4, ("gloo", ("6", "7"))),
    (8, 2, 4, ("nccl", ("4", "5", "6", "7"))),
    (8, 8, 2, ("gloo", ("7",))),
], ids=lambda v: "x" if v is None else str(v) if not isinstance(v, tuple)
else "-".join(map(str, v[1])))
def test_last_worker_placement(machine, gpus: int, count: int | None, world_size: int,
                               expected: tuple) -> None:
    machine(gpus)
    worker = None if count is None else (count - 1, count)
    p = devices.place(world_size, "auto", needs_gpu=True, share=True, worker=worker)
    assert (p.backend, p.devices) == expected and p.shared == (expected[0] == "gloo")


def test_explicit_backends(machine) -> None:
    machine(1)
    # --tp-backend=nccl keeps NCCL's rule: a gpu test that does not fit is skipped, sharing or not
    nccl = devices.place(2, "nccl", needs_gpu=True, share=True, worker=None)
    assert nccl.skip_reason == ("needs 2 distinct GPU(s) for NCCL (one per rank); 1 visible "
                                "GPU(s): run it with --tp-gpu-share=on and backend auto (ranks "
                                "share the GPUs over gloo)")
    # --tp-backend=gloo: a gpu test shares the GPUs (CUDA tensors over gloo), even where NCCL would
    # fit
    machine(4)
    assert devices.place(2, "gloo", needs_gpu=True, share=True, worker=None) == devices.Placement(
        "gloo", ("0", "1"), shared=True)
    assert devices.place(2, "gloo", needs_gpu=True, share=False,
                         worker=None).skip_reason.startswith(
        "test needs a GPU but --tp-backend=gloo runs the ranks on CPU")
    machine(0)
    assert devices.place(2, "auto", needs_gpu=True, share=True, worker=None).skip_reason == (
        "needs 2 distinct GPU(s) for NCCL (one per rank); this process has none (0 visible GPU(s))")


def test_no_nccl_shares_even_with_a_gpu_per_rank(machine, monkeypatch: pytest.MonkeyPatch) -> None:
    machine(4)
    monkeypatch.setattr(devices, "nccl_available", lambda: False)
    p = devices.place(4, "auto", needs_gpu=True, share=True, worker=None)
    assert p == devices.Placement("gloo", ("0", "1", "2", "3"), shared=True)
    assert devices.sharing_note(p, 4, None) == ("4 ranks share GPU(s) 0,1,2,3 over gloo (CUDA "
                                                "tensors): torch was built without NCCL")
    assert devices.place(4, "auto", needs_gpu=True, share=False, worker=None).skip_reason == (
        "torch was built without NCCL")


def test_sharing_is_described(machine) -> None:
    machine(1)
    p = devices.place(4, "auto", needs_gpu=True, share=True, worker=(2, 4))
    assert devices.sharing_note(p, 4, (2, 4)) == (
        "4 ranks share GPU(s) 0 over gloo (CUDA tensors): NCCL needs 4 distinct GPUs and xdist "
        "worker gw2 of 4 owns 0 of 1 visible GPU(s), shares GPU 0 for one-device tests")
    assert PoolKey(4, "gloo", ("0",)).describe() == "world size 4, gloo, 4 ranks sharing cuda:0"
    assert PoolKey(2, "nccl", ("0", "1")).describe() == "world size 2, nccl, cuda:0,1"
    assert Settings().gpu_share is True
