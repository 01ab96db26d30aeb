"""Which devices this pytest process may use, and which backend a pool gets.

- Visible GPUs are the entries of ``CUDA_VISIBLE_DEVICES`` when it is set (empty or ``-1`` = none),
  else ``0..torch.cuda.device_count()-1``. torch is imported only when the answer is not already in
  the environment; CUDA is never initialised here (``device_count`` only queries; ranks start from a
  fork server or are spawned, never forked from this process).
- Under pytest-xdist (``PYTEST_XDIST_WORKER`` = ``gwI``, ``PYTEST_XDIST_WORKER_COUNT`` = ``K``,
  ``n`` visible GPUs) worker ``I`` owns the disjoint block ``visible[I*B:(I+1)*B]`` with ``B = n //
  K`` (empty when ``K > n``). Outside xdist the block is every visible GPU.
- A test that needs one device (a plain ``gpu`` test, a pool of world size 1) gets the first GPU of
  the block, or, when there are more workers than GPUs, GPU ``visible[I mod n]``, shared with other
  workers.
- A pool of world size ``w > 1`` on NCCL needs ``w`` distinct GPUs (one per rank): ``block[:w]``
  when ``B >= w``. Otherwise a ``gpu`` or ``nccl`` test is skipped with a reason that names the fix
  (``-n <= n // w``, or ``--tp-backend=gloo`` for a test that does not need a GPU). When ``n >= w``,
  so that fewer workers would run it, the reason starts with :data:`PLACEMENT_SKIP_PREFIX`, and the
  terminal summary counts those skips.
- Sharing (``--tp-gpu-share=on``, the default): a ``gpu`` test whose ranks NCCL cannot place (fewer
  GPUs in the block than ranks, or a torch without NCCL) runs on gloo with CUDA tensors, its ranks
  sharing the block's GPUs (rank ``r`` on the ``r mod m``-th of the ``m`` GPUs; an empty block: the
  one-device GPU ``visible[I mod n]``). A ``gpu`` test under ``--tp-backend=gloo`` shares them too.
  With ``--tp-gpu-share=off`` such a test is skipped as described above. Tests that are not marked
  ``gpu`` never share: they run on CPU gloo ranks.
- Backend ``auto``: NCCL on those GPUs when they exist, gloo on CPU otherwise.

Every function that depends on the xdist worker takes ``worker`` (``(index, count)``, or None
outside xdist), which defaults to this process's (:func:`xdist_worker`): the session header asks as
worker ``gw0`` of the run's ``-n``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any


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


#: The ``worker`` argument's default: this process's xdist worker (:func:`xdist_worker`).
THIS_WORKER: Any = object()


def _worker(worker: Any) -> tuple[int, int] | None:
    return xdist_worker() if worker is THIS_WORKER else worker


def gpu_block(worker: Any = THIS_WORKER) -> tuple[str, ...]:
    """The GPUs a pytest process owns: every visible one, or worker ``I`` of ``K``'s disjoint
    block."""
    gpus = visible_gpus()
    worker = _worker(worker)
    if worker is None or not gpus:
        return gpus
    index, count = worker
    per = len(gpus) // max(count, 1)
    return gpus[index * per:(index + 1) * per]


def one_gpu(worker: Any = THIS_WORKER) -> str | None:
    """The GPU for a test that needs one device: the block's first, else ``visible[I mod n]`` (None:
    no GPU)."""
    block = gpu_block(worker)
    if block:
        return block[0]
    gpus = visible_gpus()
    if not gpus:
        return None
    worker = _worker(worker)
    return gpus[(worker[0] if worker else 0) % len(gpus)]


def one_gpu_index() -> int | None:
    """The CUDA device index of :func:`one_gpu` in this process (its position among the visible
    GPUs)."""
    gpu = one_gpu()
    return None if gpu is None else visible_gpus().index(gpu)


def block_note(worker: Any = THIS_WORKER) -> str:
    worker = _worker(worker)
    gpus = visible_gpus()
    if worker is None:
        return f"{len(gpus)} visible GPU(s)"
    index, count = worker
    block = gpu_block(worker)
    note = f"xdist worker gw{index} of {count} owns {len(block)} of {len(gpus)} visible GPU(s)"
    if gpus and not block:
        note += f", shares GPU {one_gpu(worker)} for one-device tests"
    return note


#: How the reason of a test skipped because its xdist worker's GPU block is too small begins
#: (counted in the summary).
PLACEMENT_SKIP_PREFIX = "GPU placement: "


@dataclass(frozen=True)
class Placement:
    backend: str
    devices: tuple[str, ...]  # GPU ids, or ("cpu",)
    skip_reason: str | None = None
    # gloo ranks sharing the GPUs of ``devices`` (rank r on devices[r % len(devices)])
    shared: bool = False

    @property
    def device_type(self) -> str:
        return "cpu" if self.devices == ("cpu",) else "cuda"


def nccl_available() -> bool:
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_nccl_available())
    except Exception:
        return False


def gpus_for(world_size: int, worker: Any = THIS_WORKER) -> tuple[str, ...] | None:
    """``world_size`` distinct GPUs for a pool on them (see the module docstring), or None when
    there are none."""
    if world_size == 1:
        gpu = one_gpu(worker)
        return None if gpu is None else (gpu,)
    block = gpu_block(worker)
    return block[:world_size] if len(block) >= world_size else None


def shared_gpus(world_size: int, worker: Any = THIS_WORKER) -> tuple[str, ...] | None:
    """The GPUs that ``world_size`` ranks share: the block's first ``world_size`` (all of a smaller
    block), else the one-device GPU; None without a GPU."""
    block = gpu_block(worker)
    if block:
        return block[:world_size]
    gpu = one_gpu(worker)
    return None if gpu is None else (gpu,)


def no_gpus_reason(world_size: int, needs_gpu: bool, worker: Any = THIS_WORKER) -> str:
    """Why a pool of ``world_size`` NCCL ranks cannot be placed here, and what would place it."""
    n = len(visible_gpus())
    need = f"needs {world_size} distinct GPU(s) for NCCL (one per rank)"
    if n == 0:
        return f"{need}; this process has none (0 visible GPU(s))"
    other = ("--tp-gpu-share=on and backend auto (ranks share the GPUs over gloo)" if needs_gpu else
             "--tp-backend=gloo (ranks on CPU)")
    if n < world_size:
        return f"{need}; {n} visible GPU(s): run it with {other}"
    return (f"{PLACEMENT_SKIP_PREFIX}{need}; {block_note(worker)}: run with -n {n // world_size} "
            f"or fewer (-n <= GPUs // world size), or {other}")


def sharing_note(placement: Placement, world_size: int, worker: Any = THIS_WORKER) -> str:
    """What a shared placement is and why (for the header and the test's report)."""
    gpus = ",".join(placement.devices)
    why = (f"NCCL needs {world_size} distinct GPUs and {block_note(worker)}" if nccl_available()
           else "torch was built without NCCL")
    return f"{world_size} ranks share GPU(s) {gpus} over gloo (CUDA tensors): {why}"


def place(world_size: int, backend: str, *, needs_gpu: bool = False, share: bool = False,
          worker: Any = THIS_WORKER) -> Placement:
    """Backend and devices for a pool of ``world_size`` ranks (``backend`` is auto, gloo or nccl;
    ``share``: a ``gpu`` test that NCCL cannot place shares the GPUs over gloo)."""
    if backend == "gloo":
        if not needs_gpu:
            return Placement("gloo", ("cpu",))
        gpus = shared_gpus(world_size, worker) if share else None
        if gpus is not None:
            return Placement("gloo", gpus, shared=True)
        if share:
            return Placement("gloo", ("cpu",),
                             f"needs a CUDA device; this process has none ({block_note(worker)})")
        return Placement("gloo", ("cpu",),
                         "test needs a GPU but --tp-backend=gloo runs the ranks on CPU "
                                           "(--tp-gpu-share=on runs it on the GPUs, over gloo)")
    gpus = gpus_for(world_size, worker)
    nccl = gpus is not None and nccl_available()  # without GPUs the parent never imports torch
    if gpus is not None and nccl and (backend == "nccl" or needs_gpu):
        return Placement("nccl", gpus)
    if needs_gpu and backend == "auto" and share:
        shared = shared_gpus(world_size, worker)
        if shared is not None:
            return Placement("gloo", shared, shared=True)
    if backend == "nccl" or needs_gpu:
        if gpus is None:
            return Placement("nccl", ("cpu",), no_gpus_reason(world_size, needs_gpu, worker))
        return Placement("nccl", ("cpu",), "torch was built without NCCL")
    if gpus is not None and nccl:
        return Placement("nccl", gpus)
    return Placement("gloo", ("cpu",))
