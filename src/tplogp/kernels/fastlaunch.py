"""Direct launches of already-compiled Triton kernels: the host cost of a launch at small shapes.

``kernel[grid](*args, **options)`` runs Triton's JIT front end on every call: it binds and specializes every
argument, builds a cache-key string, looks the binary up and checks the kernel's globals, before the launcher
proper. On the H200 host that measured ~55-95 us per launch (docs/performance.md), more than the GPU work of a
whole forward at 4096x2048x8192. The binary it finds can be launched directly.

:class:`DirectKernel` wraps one ``@triton.jit`` function. It keys compiled binaries by a summary of the call
that is at least as fine as Triton's own specialization, so one key never maps to two binaries:

* constexpr parameters and launch options (``num_warps``, ...) by value;
* tensors by dtype and base-address residue mod 16 (Triton specializes on 16-byte alignment);
* integers by residue mod 16, ``== 1`` and 32-bit range (Triton specializes on divisibility by 16, on 1, and
  picks i32 or i64);
* tensor descriptors by dtype, block shape, padding, and the residues mod 16 of base, shape and strides;
* floats, ``None``, bools and strings by type (and by value for the last three);
* the current CUDA device.

A key seen for the first time goes through ``kernel[grid]`` (which compiles or finds the binary, launches it and
returns it); later calls launch the returned ``CompiledKernel`` with Triton's own launcher (``CompiledKernel.run``,
the call Triton's ``JITFunction.run`` ends with), honouring Triton's launch hooks. A finer key than Triton's only
costs one extra trip through the JIT. Under Triton's CPU interpreter, or with ``TPLOGP_DIRECT_LAUNCH=0``, every
call goes through ``kernel[grid]``. Environment changes that alter Triton's compilation (``TRITON_DEBUG``, ...)
after the first launch are not seen by the cache: set them before the first call.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Optional

import triton

_INT32 = (-(1 << 31), 1 << 31)


def direct_launch_enabled() -> bool:
    """Direct launches are on unless ``TPLOGP_DIRECT_LAUNCH=0`` or Triton runs its CPU interpreter."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return os.environ.get("TPLOGP_DIRECT_LAUNCH", "1").strip() not in ("0", "false", "False", "")


def _current_device() -> int:
    return triton.runtime.driver.active.get_current_device()


def _current_stream(device: int):
    return triton.runtime.driver.active.get_current_stream(device)


def _launch_hooks():
    from triton import knobs

    return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook


def _arg_key(value: Any, constexpr: bool):
    if constexpr:
        return value
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):  # a tensor
        return ("t", value.dtype, value.data_ptr() % 16)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return ("i", value % 16, value == 1, _INT32[0] <= value < _INT32[1])
    if isinstance(value, float):
        return "f"
    base = getattr(value, "base", None)
    if base is not None and hasattr(value, "block_shape"):  # triton.tools.tensor_descriptor.TensorDescriptor
        return ("d", base.dtype, base.data_ptr() % 16, tuple(value.block_shape), getattr(value, "padding", None),
                tuple(int(s) % 16 for s in value.shape), tuple(int(s) % 16 for s in value.strides))
    return ("o", type(value), value)  # anything else: by value (hashable or it raises, caught by the caller)


class DirectKernel:
    """A ``@triton.jit`` function launched as ``DirectKernel(fn)[grid](*args, **kwargs)`` (see module docstring)."""

    def __init__(self, fn):
        self.fn = fn
        self._params: Optional[list[tuple[str, Any, bool]]] = None  # (name, default, is_constexpr)
        self._names: frozenset = frozenset()
        self._binaries: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _signature(self) -> list[tuple[str, Any, bool]]:
        if self._params is None:
            sig = inspect.signature(self.fn.fn)
            constexpr_idx = set(getattr(self.fn, "constexprs", ()))
            self._params = [
                (p.name, p.default, i in constexpr_idx) for i, p in enumerate(sig.parameters.values())]
            self._names = frozenset(p[0] for p in self._params)
        return self._params

    def launch(self, grid, args: tuple, kwargs: dict) -> None:
        if not direct_launch_enabled():
            self.fn[grid](*args, **kwargs)
            return
        params = self._signature()
        values = list(args)
        key = []
        try:
            for i, (name, default, constexpr) in enumerate(params):
                if i < len(args):
                    v = args[i]
                elif name in kwargs:
                    v = kwargs[name]
                    values.append(v)
                else:
                    if default is inspect.Parameter.empty:
                        raise TypeError(f"{self.fn.__name__}: missing argument {name!r}")
                    v = default
                    values.append(v)
                key.append(_arg_key(v, constexpr))
            key.append(tuple(sorted((k, v) for k, v in kwargs.items() if k not in self._names)))
            key.append(_current_device())
            key = tuple(key)
            binary = self._binaries.get(key)
        except TypeError:  # an unhashable or unexpected argument: let Triton handle (and report) it
            self.fn[grid](*args, **kwargs)
            return
        if binary is None:
            binary = self.fn[grid](*args, **kwargs)
            if hasattr(binary, "result"):  # asynchronous compilation mode
                binary = binary.result()
            if binary is not None and hasattr(binary, "run") and hasattr(binary, "packed_metadata"):
                self._binaries[key] = binary
            return
        device = key[-1]
        stream = _current_stream(device)
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        enter, leave = _launch_hooks()
        metadata = binary.launch_metadata(grid, stream, *values) if enter is not None else None
        binary.run(g0, g1, g2, stream, binary.function, binary.packed_metadata, metadata, enter, leave, *values)
