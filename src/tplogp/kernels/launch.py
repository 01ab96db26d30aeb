"""The one way tplogp launches a Triton kernel: a :class:`Launch`, made once per (kernel, layout).

A layout (the shard's sizes, strides and dtypes, the tile config, the call's options) fixes
everything about a launch but its tensors: the grid, the scalar arguments,
``num_warps`` / ``num_stages`` and the constexprs. A :class:`Launch` holds those;
``launch(*tensors)`` launches the kernel with the call's tensors (pointers first in the kernel's
signature, then the scalars, then the constexprs). Per-layout programs (:mod:`.forward_programs`, :mod:`.backward_programs`) hold their
launches; the source holds the programs of the op's calls, and per-call paths take theirs from
:func:`cached`, the bounded cache of launches and programs below the sources.

Algorithm: of what Triton specializes a compiled kernel on, only the tensors' dtypes and 16-byte
alignment and the current device can change between calls of one layout (the dtypes because fp16
and bf16 share every size, stride and the dot precision of a layout, and a kernel compiled for one
reads the other's bits as its own). So a launch keys its compiled kernels by ``(device, the dtype
and data_ptr() % 16 of each tensor)``. The first call with a key goes through Triton's JIT
(``kernel[grid](...)``), which compiles or finds the kernel and returns its ``CompiledKernel``; the
launch keeps that kernel's launcher (``CompiledKernel.run``, the call ``JITFunction.run`` ends with)
and later calls with the key call it directly on the current stream. Through the JIT every time, in
this one place: under Triton's CPU interpreter (it returns no compiled kernel), while a Triton
launch hook is registered (a profiler's: its hooks then see every launch), and on Triton releases
whose launcher call is not the one above.

Tensor descriptors (the Hopper kernels' TMA operands) are made per call from the tensors at the
positions the launch names, after the key is taken from the tensors themselves: the layout fixes the
descriptors' shapes, strides and block shapes, so their base alignment is what the key holds.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import triton

try:  # host-side tensor descriptors (Triton >= 3.3): the TMA launches' operands
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - old Triton: the sm90 source reports itself unavailable
    TensorDescriptor = None

# Triton releases whose ``CompiledKernel.run`` takes (grid x, y, z, stream, function, packed
# metadata, launch metadata, enter hook, exit hook, *arguments): read in 3.6 and 3.9. Others launch
# through the JIT every time.
LAUNCHER_TRITON = ((3, 6), (3, 9))
MAX_CACHED = 256  # launches and programs held by :func:`cached` (emptied when full)
MAX_COMPILED = 16  # compiled kernels a launch keeps, by device and alignments (emptied when full)


def launcher_call_known(version: str, known: tuple = LAUNCHER_TRITON) -> bool:
    """Whether a Triton version string's (major, minor) lies in the inclusive range ``known``."""
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return known[0] <= major_minor <= known[1]


def _runtime_knobs() -> Any:
    """``triton.knobs.runtime`` (its launch hooks) where this Triton's launcher call is known, else
    None."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not launcher_call_known(triton.__version__):
        return None
    return knobs.runtime


_RUNTIME = _runtime_knobs()


def _hooked(runtime: Any) -> bool:
    """A Triton launch hook is registered (an empty ``HookChain`` is none)."""
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _active_driver() -> Any:
    """Triton's driver of the current device: its current device and stream getters, the ones its
    JIT calls."""
    from triton.runtime import driver

    return driver.active


def _is_constexpr(param: inspect.Parameter) -> bool:
    # what Triton tests (a string annotation under future annotations)
    return "constexpr" in str(param.annotation)


def _specialization(device: Any, tensors: tuple) -> tuple:
    """The key of a launch's compiled kernel for ``tensors`` on ``device``: each tensor's dtype and
    16-byte alignment (module docstring)."""
    return (device, *[(t.dtype, t.data_ptr() % 16) for t in tensors])


class Launch:
    """``launch(*tensors)``: one ``@triton.jit`` kernel with everything but its tensors bound
    (module docstring).

    ``scalars``: the runtime arguments after the tensors, in signature order; ``constexprs``: every
    constexpr parameter, in signature order (checked here, once). ``descriptors``:
    ``((position, block shape), ...)`` of the tensors that go to the kernel as tensor
    descriptors."""

    __slots__ = ("kernel", "grid", "scalars", "num_warps", "num_stages", "constexprs",
                 "descriptors", "n_tensors", "_grid3", "_tail", "_compiled", "_device", "_stream")

    def __init__(self, kernel: Any, grid: tuple, scalars: tuple, num_warps: int,
                 num_stages: Optional[int], constexprs: dict, descriptors: tuple = ()) -> None:
        params = list(inspect.signature(kernel.fn).parameters.values())
        n_const = len(constexprs)
        names = tuple(p.name for p in params[len(params) - n_const:])
        if (names != tuple(constexprs)
            or not all(_is_constexpr(p) for p in params[len(params) - n_const:])
                or any(_is_constexpr(p) for p in params[:len(params) - n_const])):
            raise TypeError(f"{kernel.fn.__name__}: a launch passes every constexpr, in signature order "
                            f"{[p.name for p in params if _is_constexpr(p)]}; got {list(constexprs)}")
        self.kernel = kernel
        self.grid = grid
        self.scalars = tuple(scalars)
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.constexprs = constexprs
        self.descriptors = descriptors
        self._grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        # what follows the tensors in a launcher call
        self._tail = self.scalars + tuple(constexprs.values())
        self.n_tensors = len(params) - len(self._tail)
        # (device, alignments) -> the compiled kernel's (run, function, metadata)
        self._compiled: dict = {}
        # Triton's current device and stream getters, once a kernel is kept
        self._device: Optional[Callable] = None
        self._stream: Optional[Callable] = None

    def __call__(self, *tensors: Any) -> None:
        if self._device is not None and not _hooked(_RUNTIME):
            device = self._device()
            found = self._compiled.get(_specialization(device, tensors))
            if found is not None:
                run, function, metadata = found
                grid = self._grid3
                run(grid[0], grid[1], grid[2], self._stream(device), function, metadata, None, None,
                    None, *(self._describe(tensors) if self.descriptors else tensors), *self._tail)
                return
        self._through_jit(tensors)

    def _describe(self, tensors: tuple) -> list:
        args = list(tensors)
        for i, block in self.descriptors:
            t = args[i]
            args[i] = TensorDescriptor(t, t.shape, t.stride(), block)
        return args

    def _through_jit(self, tensors: tuple) -> None:
        """Launch through Triton's JIT; keep the compiled kernel's launcher for this key where one
        exists."""
        if len(tensors) != self.n_tensors:
            raise TypeError(f"{self.kernel.fn.__name__}: expected {self.n_tensors} tensors, got {len(tensors)}")
        args = self._describe(tensors) if self.descriptors else tensors
        options = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        compiled = self.kernel[self.grid](*args, *self.scalars, **options, **self.constexprs)
        # the one interpreter branch: Triton's interpreter returns no compiled kernel, so nothing is
        # kept
        if _RUNTIME is None or _hooked(_RUNTIME) or not hasattr(compiled, "packed_metadata"):
            return
        active = _active_driver()
        device = active.get_current_device()
        if len(self._compiled) >= MAX_COMPILED:
            self._compiled.clear()
        self._compiled[_specialization(device, tensors)] = (
            compiled.run, compiled.function, compiled.packed_metadata)
        self._device, self._stream = active.get_current_device, active.get_current_stream


_CACHE: dict = {}


def cached(build: Callable, *key: Any) -> Any:
    """``build(*key)``, made once per key and held in the one bounded cache of launches and programs
    (emptied when it holds ``MAX_CACHED``): the per-call paths' launches and programs of a layout.
    ``key`` holds everything ``build`` reads (sizes, strides, dtypes, the tile config, the
    options)."""
    full = (build, *key)
    found = _CACHE.get(full)
    if found is None:
        if len(_CACHE) >= MAX_CACHED:
            _CACHE.clear()
        found = _CACHE[full] = build(*key)
    return found


__all__ = ["Launch", "MAX_CACHED", "MAX_COMPILED", "cached", "launcher_call_known"]
