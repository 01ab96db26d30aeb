"""Which devices this pytest process may use, and which backend a pool gets.

- Visible GPUs are the entries of ``CUDA_VISIBLE_DEVICES`` when it is set (empty or ``-1`` = none), else
  ``0..torch.cuda.device_count()-1``. torch is imported only when the answer is not already in the environment;
  CUDA is never initialised here (``device_count`` only queries; ranks start from a fork server or are spawned,
  never forked from this process).
- Under pytest-xdist (``PYTEST_XDIST_WORKER`` = ``gwI``, ``PYTEST_XDIST_WORKER_COUNT`` = ``K``, ``n`` visible GPUs)
  worker ``I`` owns the disjoint block ``visible[I*B:(I+1)*B]`` with ``B = n // K`` (empty when ``K > n``).
  Outside xdist the block is every visible GPU.
- A test that needs one device (a plain ``gpu`` test, a pool of world size 1) gets the first GPU of the block, or,
  when there are more workers than GPUs, GPU ``visible[I mod n]``, shared with other workers.
- A pool of world size ``w > 1`` on NCCL needs ``w`` distinct GPUs (one per rank): ``block[:w]`` when ``B >= w``.
  Otherwise a ``gpu`` or ``nccl`` test is skipped with a reason that names the fix (``-n <= n // w``, or
  ``--tp-backend=gloo`` for a test that does not need a GPU). When ``n >= w``, so that fewer workers would run it,
  the reason starts with :data:`PLACEMENT_SKIP_PREFIX`, and the terminal summary counts those skips.
- Backend ``auto``: NCCL on those GPUs when they exist, gloo on CPU otherwise.
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


def one_gpu() -> str | None:
    """The GPU for a test that needs one device: the block's first, else ``visible[I mod n]`` (None: no GPU)."""
    block = gpu_block()
    if block:
        return block[0]
    gpus = visible_gpus()
    if not gpus:
        return None
    worker = xdist_worker()
    return gpus[(worker[0] if worker else 0) % len(gpus)]


def one_gpu_index() -> int | None:
    """The CUDA device index of :func:`one_gpu` in this process (its position among the visible GPUs)."""
    gpu = one_gpu()
    return None if gpu is None else visible_gpus().index(gpu)


def block_note() -> str:
    worker = xdist_worker()
    gpus = visible_gpus()
    if worker is None:
        return f"{len(gpus)} visible GPU(s)"
    index, count = worker
    note = f"xdist worker gw{index} of {count} owns {len(gpu_block())} of {len(gpus)} visible GPU(s)"
    if gpus and not gpu_block():
        note += f", shares GPU {one_gpu()} for one-device tests"
    return note


#: How the reason of a test skipped because its xdist worker's GPU block is too small begins (counted in the summary).
PLACEMENT_SKIP_PREFIX = "GPU placement: "


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


def gpus_for(world_size: int) -> tuple[str, ...] | None:
    """``world_size`` distinct GPUs for a pool on them (see the module docstring), or None when there are none."""
    if world_size == 1:
        gpu = one_gpu()
        return None if gpu is None else (gpu,)
    block = gpu_block()
    return block[:world_size] if len(block) >= world_size else None


def no_gpus_reason(world_size: int, needs_gpu: bool) -> str:
    """Why a pool of ``world_size`` NCCL ranks cannot be placed here, and what would place it."""
    n = len(visible_gpus())
    need = f"needs {world_size} distinct GPU(s) for NCCL (one per rank)"
    if n == 0:
        return f"{need}; this process has none (0 visible GPU(s))"
    if n < world_size:
        return f"{need}; {n} visible GPU(s)" + ("" if needs_gpu else ": run it with --tp-backend=gloo (ranks on CPU)")
    gloo = "" if needs_gpu else ", or --tp-backend=gloo (ranks on CPU)"
    return (f"{PLACEMENT_SKIP_PREFIX}{need}; {block_note()}: run with -n {n // world_size} or fewer "
            f"(-n <= GPUs // world size){gloo}")


def place(world_size: int, backend: str, *, needs_gpu: bool = False) -> Placement:
    """Backend and devices for a pool of ``world_size`` ranks (``backend`` is auto, gloo or nccl)."""
    if backend == "gloo":
        if needs_gpu:
            return Placement("gloo", ("cpu",), "test needs a GPU but --tp-backend=gloo runs the ranks on CPU")
        return Placement("gloo", ("cpu",))
    gpus = gpus_for(world_size)
    if backend == "nccl" or needs_gpu:
        if gpus is None:
            return Placement("nccl", ("cpu",), no_gpus_reason(world_size, needs_gpu))
        if not nccl_available():
            return Placement("nccl", ("cpu",), "torch was built without NCCL")
        return Placement("nccl", gpus)
    if gpus is not None and nccl_available():
        return Placement("nccl", gpus)
    return Placement("gloo", ("cpu",))
