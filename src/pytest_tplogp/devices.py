"""Which devices this pytest process may use, and which backend a pool gets.

- Visible GPUs are the entries of ``CUDA_VISIBLE_DEVICES`` when it is set (empty or ``-1`` = none), else
  ``0..torch.cuda.device_count()-1``. torch is imported only when the answer is not already in the environment;
  CUDA is never initialised here (``device_count`` only queries; ranks start from a fork server or are spawned,
  never forked from this process).
- Under pytest-xdist (``PYTEST_XDIST_WORKER`` = ``gwI``, ``PYTEST_XDIST_WORKER_COUNT`` = ``K``) worker ``I`` owns
  the disjoint block ``visible[I*B:(I+1)*B]`` with ``B = len(visible) // K``: workers never share a GPU. A worker
  whose block is too small for a test gets a skip that says so (or, under ``--tp-backend=nccl``, a clear reason).
- Backend ``auto``: NCCL with one GPU per rank when the block has ``world_size`` GPUs, gloo on CPU otherwise.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass


@functools.cache
def visible_gpus() -> tuple[str, ...]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        items = tuple(x.strip() for x in env.split(",") if x.strip())
        return () if items in ((), ("-1",)) else items
    import glob

    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/kfd"):
        return ()  # no GPU device nodes: answer without importing torch
    try:
        import torch

        return tuple(str(i) for i in range(torch.cuda.device_count()))
    except Exception:
        return ()


def xdist_worker() -> tuple[int, int] | None:
    """``(index, count)`` of this pytest-xdist worker, or None outside xdist."""
    wid = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not wid.startswith("gw") or not count:
        return None
    try:
        return int(wid[2:]), int(count)
    except ValueError:
        return None


@functools.cache
def gpu_block() -> tuple[str, ...]:
    """The GPUs this pytest process owns (all visible ones, or this xdist worker's disjoint block)."""
    gpus = visible_gpus()
    worker = xdist_worker()
    if worker is None or not gpus:
        return gpus
    index, count = worker
    per = len(gpus) // max(count, 1)
    return gpus[index * per:(index + 1) * per]


def block_note() -> str:
    worker = xdist_worker()
    gpus = visible_gpus()
    if worker is None:
        return f"{len(gpus)} visible GPU(s)"
    index, count = worker
    return f"xdist worker gw{index} of {count} owns {len(gpu_block())} of {len(gpus)} visible GPU(s)"


@dataclass(frozen=True)
class Placement:
    backend: str
    devices: tuple[str, ...]  # GPU ids, or ("cpu",)
    skip_reason: str | None = None

    @property
    def device_type(self) -> str:
        return "cpu" if self.devices == ("cpu",) else "cuda"


def nccl_available() -> bool:
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_nccl_available())
    except Exception:
        return False


def place(world_size: int, backend: str, *, needs_gpu: bool = False) -> Placement:
    """Backend and devices for a pool of ``world_size`` ranks (``backend`` is auto, gloo or nccl)."""
    block = gpu_block() if (backend != "gloo" or needs_gpu) else ()
    enough = len(block) >= world_size
    if backend == "gloo":
        if needs_gpu:
            return Placement("gloo", ("cpu",), "test needs a GPU but --tp-backend=gloo runs the ranks on CPU")
        return Placement("gloo", ("cpu",))
    if backend == "nccl" or needs_gpu:
        if not enough or not nccl_available():
            why = (f"needs {world_size} GPU(s) for NCCL (one per rank); this process has {len(block)} "
                   f"({block_note()})" if not enough else "torch was built without NCCL")
            return Placement("nccl", ("cpu",), why)
        return Placement("nccl", block[:world_size])
    if enough and nccl_available():
        return Placement("nccl", block[:world_size])
    return Placement("gloo", ("cpu",))
