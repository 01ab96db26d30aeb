"""A CUDA rank's memory after each test: a leak told from a cache (rank-side; plain arithmetic).

What is measured is ``torch.cuda.memory_allocated()`` (bytes in live allocations of the caching
allocator, not its reserved cache) after ``torch.cuda.synchronize()``. Memory that legitimately
stays after a first use is allocated there too: cuBLAS's workspaces (torch allocates one per cuBLAS
handle and stream through the caching allocator, tens of MiB each on Hopper; a forward's GEMMs on
the test's thread and a backward's on autograd's device thread use two handles), and other
libraries' lazily made buffers. Measured against a baseline taken before any of them, every first
use looked like a leak and recycled the pool, and the next pool's first use again. So after each
test:

1. cuBLAS's workspaces are freed (``torch._C._cuda_clearCublasWorkspaces``, what PyTorch's own CUDA
   leak check calls; they are made again at the next GEMM) and the allocated bytes are read. At most
   :data:`SLACK_BYTES` above the pool's baseline: clean.
2. Above it: ``gc.collect()``, read again, and count the bytes of the live CUDA tensors that Python
   can reach (``gc.get_objects()``, each storage once). More live tensor bytes than at the baseline
   (beyond the slack): a leak, a tensor kept in a global, a cache or a module attribute; the pool is
   recycled.
3. Otherwise the growth is held outside Python tensors, by a library's cache that filled: the level
   becomes the baseline, and the test passes. A growth outside tensors after
   :data:`CACHE_GROWTH_LIMIT` tests in a row is not a cache that fills once but something that grows
   per test: the pool is recycled.
4. Whatever the verdict, the allocator's cached free blocks go back to the device
   (``torch.cuda.empty_cache``): a healthy pool now lives for the whole session, its ranks share
   GPUs with other pools and xdist workers, and each rank's cache would otherwise stay at the size
   of its largest test (on one H100, 24 ranks holding 2-3 GiB each ran the GPU suite's largest
   tests out of memory).
5. The per-thread stack goes back to the rank's starting size (:func:`stack_reset`): a kernel whose
   frame outgrows it (registers spilled to local memory) makes the driver grow the stack and
   reserve ``stack x resident threads`` for it, and keep it; a 5760-byte stack kept 1.2 GiB per
   process on an H100. Setting the limit back gives that memory back; a later such launch grows
   it again for its own time.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from typing import Any

#: Growth tolerated without a second look (allocator rounding, small lazily made buffers).
SLACK_BYTES = 1 << 20
#: Tests in a row whose memory grew outside live tensors before that growth counts as a leak.
CACHE_GROWTH_LIMIT = 3


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class MemoryCheck:
    """The pool's baseline and the verdict after each test (see the module docstring).
    ``allocated`` and ``tensor_bytes`` read the device (:func:`for_device`); ``collect`` frees
    unreachable cycles."""

    def __init__(self, allocated: Callable[[], int], tensor_bytes: Callable[[], int],
                 collect: Callable[[], Any] = gc.collect,
                 release: Callable[[], Any] = lambda: None) -> None:
        self.allocated = allocated
        self.tensor_bytes = tensor_bytes
        self.collect = collect
        self.release = release
        self.base = allocated()
        self.base_tensors = tensor_bytes()
        self.cache_growths = 0  # tests in a row whose growth was held outside live tensors

    def after_test(self) -> str:
        """"" when the memory is back to the baseline or a cache filled; else why the pool must be
        recycled. The allocator's cache is released either way (step 4)."""
        try:
            return self._verdict()
        finally:
            self.release()

    def _verdict(self) -> str:
        if self.allocated() <= self.base + SLACK_BYTES:
            self.cache_growths = 0
            return ""
        self.collect()
        now = self.allocated()
        if now <= self.base + SLACK_BYTES:
            self.cache_growths = 0
            return ""
        tensors = self.tensor_bytes()
        above = f"CUDA memory {_mib(now - self.base)} above the pool's baseline"
        if tensors > self.base_tensors + SLACK_BYTES:
            return (f"{above}, {_mib(tensors - self.base_tensors)} of it in live tensors (kept in "
                    f"a global, a cache or a module attribute?)")
        self.cache_growths += 1
        if self.cache_growths >= CACHE_GROWTH_LIMIT:
            return (f"{above}, held outside live tensors and grown after each of the last "
                    f"{self.cache_growths} tests (not a cache that fills once)")
        self.base = now  # a library's cache filled (workspaces, lazy buffers): the new baseline
        return ""


def for_device(torch: Any) -> MemoryCheck:
    """A :class:`MemoryCheck` of this rank's current CUDA device; its baseline is read now."""

    def allocated() -> int:
        torch.cuda.synchronize()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        return int(torch.cuda.memory_allocated())

    def tensor_bytes() -> int:
        seen: dict[int, int] = {}
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.is_cuda:
                    storage = obj.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
            except Exception:  # noqa: BLE001 - a DTensor has no storage: its local tensor counts
                continue
        return sum(seen.values())

    reset = stack_reset()

    def release() -> None:
        torch.cuda.empty_cache()
        reset()

    return MemoryCheck(allocated, tensor_bytes, release=release)


#: ``CU_LIMIT_STACK_SIZE`` of the CUDA driver API.
_STACK_SIZE = 0


def stack_reset() -> Callable[[], None]:
    """A callable that sets this thread's CUDA context's per-thread stack back to its size now,
    where a launch grew it (step 5 of the module docstring); a no-op without the driver library
    (``libcuda.so.1``) or a current context."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return lambda: None
    driver.cuCtxGetLimit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
    driver.cuCtxSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]

    def size() -> int:
        value = ctypes.c_size_t()
        return value.value if driver.cuCtxGetLimit(ctypes.byref(value), _STACK_SIZE) == 0 else -1

    start = size()
    if start <= 0:
        return lambda: None

    def reset() -> None:
        if size() > start:
            driver.cuCtxSetLimit(_STACK_SIZE, start)

    return reset
