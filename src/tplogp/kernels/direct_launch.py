"""Launch compiled Triton kernels without Triton's JIT front end on every call.

``kernel[grid](*args)`` binds the arguments, specializes each one (pointer dtype and 16-byte alignment; integers
equal to 1, divisible by 16, 32- or 64-bit; descriptor dtype and block shape), hashes that specialization, finds the
compiled kernel and only then launches it. On the H200 hosts measured this front end cost 25-52 us per launch
(Triton 3.6, commits ``1769fc5`` and ``914737c``: docs/kernels.md, "Host path and direct launches"); a small
shape's latency is mostly host time before the first kernel, so it is worth removing.

Algorithm: per JIT kernel, a dict maps a *launch key* to the ``CompiledKernel`` that the JIT returned the first time
it launched arguments with that key. The key is at least as fine as Triton's specialization, so two calls with one
key always have one compiled kernel:

* tensors: dtype and ``data_ptr() % 16`` (Triton: dtype, and alignment to 16 bytes or not);
* ints: ``== 1``, ``% 16`` and the 32-bit / 64-bit / unsigned-64-bit range (Triton: constant 1, divisible by 16,
  i32 / i64 / u64);
* floats: their type (Triton does not specialize on float values); ``None``: itself;
* tensor descriptors: dtype, block shape, padding, base alignment and every shape / stride ``% 16``;
* constexpr values, ``num_warps``, ``num_stages`` and the current CUDA device (Triton keys on it too).

Later calls with a known key call the compiled kernel's launcher (``CompiledKernel.run``, the call that ends
Triton's own ``JITFunction.run``) with the arguments in signature order. Falls back to the plain JIT call, every
time, under Triton's interpreter, when ``TPLOGP_DIRECT_LAUNCH=0``, when a launch hook is registered (a profiler:
its hooks then see every launch), on a Triton release outside ``SUPPORTED_TRITON`` and when this Triton's
``CompiledKernel`` lacks the launcher attributes.
Skipped by design: Triton's check that the kernel's global ``constexpr`` values have not changed since it was
compiled (tplogp's kernels never reassign theirs), and Triton's debug / instrumentation knobs changed at run time
after a kernel's first launch (the JIT would compile a new variant; set ``TPLOGP_DIRECT_LAUNCH=0`` when toggling
them inside one process).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch

from .. import settings
from .tiles import interpreting

_INT32 = (-(1 << 31), (1 << 31) - 1)
_OVERRIDE: Optional[bool] = None  # set_direct_launch(); None: TPLOGP_DIRECT_LAUNCH decides
_U64_LOW = 1 << 63


def _int_key(arg: int) -> tuple:
    return (arg == 1, arg % 16, _INT32[0] <= arg <= _INT32[1], arg >= _U64_LOW)


def arg_key(arg: Any) -> Any:
    """The part of the launch key for one runtime argument (see the module docstring)."""
    cls = type(arg)
    if cls is int:  # the exact built-in types first: this runs on every launch
        return _int_key(arg)
    if cls is float:
        return float
    if arg is None:
        return None
    base = getattr(arg, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(arg, "block_shape"):  # a host TensorDescriptor
        return (cls, base.dtype, tuple(arg.block_shape), getattr(arg, "padding", None), base.data_ptr() % 16,
                tuple([s % 16 for s in arg.shape]), tuple([s % 16 for s in arg.strides]))
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16)
    if isinstance(arg, bool):
        return ("bool", arg)
    if isinstance(arg, int):  # int subclasses (bool is handled above)
        return _int_key(arg)
    if isinstance(arg, float):  # float subclasses (numpy.float64)
        return float
    raise TypeError(f"direct_launch: no launch key for an argument of type {cls.__name__}")


def _is_constexpr(param: inspect.Parameter) -> bool:
    # what Triton's KernelParam.is_constexpr tests (the annotation may be a string under future annotations)
    return "constexpr" in str(param.annotation)


# Triton releases whose ``CompiledKernel.run`` takes (grid x, y, z, stream, function, packed metadata, launch
# metadata, enter hook, exit hook, *args), the call ``JITFunction.run`` ends with (read in 3.6.0 and 3.9.0; launched
# on the H200 with 3.6.0). Other releases keep Triton's JIT path.
SUPPORTED_TRITON = ((3, 6), (3, 9))


def triton_version_supported(version: str, supported: tuple = SUPPORTED_TRITON) -> bool:
    """Whether a Triton version string's (major, minor) lies in the inclusive range ``supported``."""
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return supported[0] <= major_minor <= supported[1]


def _runtime_knobs() -> Any:
    """``triton.knobs.runtime`` when this Triton's launcher call is one direct launches know, else None."""
    try:
        import triton
        from triton import knobs
    except ImportError:  # pragma: no cover - a Triton without knobs: direct launches stay off
        return None
    return knobs.runtime if triton_version_supported(triton.__version__) else None


def _hooks_registered(runtime: Any) -> bool:
    """A Triton launch hook (for example a profiler's) is set: launches must go through the JIT."""
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # an empty HookChain has calls == []
            return True
    return False


def _raw_stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)


def _current_device() -> int:
    return torch._C._cuda_getDevice()  # what torch.cuda.current_device() returns, without its Python wrapper


def args_key(args: tuple) -> tuple:
    """:func:`arg_key` of every runtime argument, with the two common types (tensors, ints) inline: this runs on
    every launch, and a function call per argument costs microseconds on a slow host."""
    tensor, lo, hi, u64 = torch.Tensor, _INT32[0], _INT32[1], _U64_LOW
    out = []
    append = out.append
    for a in args:
        cls = type(a)
        if cls is tensor:
            append((a.dtype, a.data_ptr() % 16))
        elif cls is int:
            append((a == 1, a % 16, lo <= a <= hi, a >= u64))
        else:
            append(arg_key(a))
    return tuple(out)


class DirectLauncher:
    """``launcher(grid, *runtime_args, num_warps=, num_stages=, **constexprs)`` for one ``@triton.jit`` kernel.

    Runtime arguments are positional, in signature order; every constexpr parameter follows them in the kernel's
    signature and is passed by keyword. Direct launches need every constexpr passed, in signature order (the hot
    path then reads them without a lookup); other calls always go through the JIT.
    """

    def __init__(self, jit_fn: Any):
        self.jit_fn = jit_fn
        params = list(inspect.signature(jit_fn.fn).parameters.values())
        is_const = [_is_constexpr(p) for p in params]
        n_runtime = is_const.index(True) if True in is_const else len(is_const)
        if any(not c for c in is_const[n_runtime:]):
            raise ValueError(f"{jit_fn.fn.__name__}: constexpr parameters must follow the runtime ones")
        self.n_runtime = n_runtime
        self.const_names = tuple(p.name for p in params[n_runtime:])
        self.const_defaults = {p.name: p.default for p in params[n_runtime:]
                               if p.default is not inspect.Parameter.empty}
        self.binaries: dict = {}
        self._enabled: Optional[bool] = None
        self._knobs: Any = None
        self.direct_launches = 0  # counters, for tests and benchmarks
        self.jit_launches = 0

    def enabled(self) -> bool:
        if _OVERRIDE is False:
            return False
        if self._enabled is None:
            self._knobs = _runtime_knobs()
            self._enabled = (not interpreting() and settings.direct_launch()
                             and self._knobs is not None and torch.cuda.is_available())
        return self._enabled

    def hot(self) -> bool:
        """Whether a launch with a known key runs its compiled kernel directly (:meth:`__call__`'s hot path): on,
        known to be enabled (after a first launch), and no launch hook registered."""
        return _OVERRIDE is None and bool(self._enabled) and not _hooks_registered(self._knobs)

    def entry(self, args: tuple, num_warps: int, num_stages: Optional[int], constexprs: dict) -> Optional[tuple]:
        """The ``(run, function, metadata)`` that a launch of these arguments runs directly, or None when none is
        stored (such launches go through Triton's JIT). For :class:`~tplogp.kernels.bound_launch.BoundLaunch`,
        which keeps it for the launches of one layout."""
        key = (_current_device(), num_warps, num_stages, tuple(constexprs.values()), args_key(args))
        return self.binaries.get(key)

    def __call__(self, grid: tuple, *args: Any, num_warps: int, num_stages: Optional[int] = None,
                 **constexprs: Any) -> None:
        if _OVERRIDE is None and self._enabled and not _hooks_registered(self._knobs):
            # Hot path (a few microseconds on a slow host matter here). Keys are only stored by calls that passed
            # every constexpr in signature order (see _first), so ``constexprs.values()`` is the signature order.
            device = _current_device()
            key = (device, num_warps, num_stages, tuple(constexprs.values()), args_key(args))
            entry = self.binaries.get(key)
            if entry is not None:
                self.direct_launches += 1
                run, function, metadata = entry
                run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, _raw_stream(device),
                    function, metadata, None, None, None, *args, *key[3])
                return
        self._first(grid, args, num_warps, num_stages, constexprs)

    def _first(self, grid, args, num_warps, num_stages, constexprs) -> None:
        """Check the call, launch through the JIT and, when direct launches are on, remember the compiled kernel."""
        name = self.jit_fn.fn.__name__
        if len(args) != self.n_runtime:
            raise TypeError(f"{name}: expected {self.n_runtime} runtime arguments, got {len(args)}")
        missing = [n for n in self.const_names if n not in constexprs and n not in self.const_defaults]
        if missing:
            raise TypeError(f"{name}: missing constexpr argument {missing[0]!r}")
        if not self.enabled() or _hooks_registered(self._knobs):
            self._jit(grid, args, num_warps, num_stages, constexprs)
            return
        binary = self._jit(grid, args, num_warps, num_stages, constexprs)
        if tuple(constexprs) != self.const_names:  # not every constexpr, or not in signature order: JIT only
            return
        if (getattr(binary, "function", None) is None or not hasattr(binary, "packed_metadata")
                or not callable(getattr(binary, "run", None))):
            return  # a Triton whose compiled kernels lack the launcher attributes: JIT only
        key = (_current_device(), num_warps, num_stages, tuple(constexprs.values()), args_key(args))
        self.binaries[key] = (binary.run, binary.function, binary.packed_metadata)

    def _jit(self, grid, args, num_warps, num_stages, constexprs):
        self.jit_launches += 1
        return _jit_launch(self.jit_fn, grid, args, num_warps, num_stages, constexprs)


def _jit_launch(jit_fn, grid, args, num_warps, num_stages, constexprs):
    options = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    return jit_fn[grid](*args, **options, **constexprs)


_LAUNCHERS: dict = {}


def set_direct_launch(enabled: Optional[bool]) -> None:
    """Turn direct launches off (``False``) for every kernel, or back to the default (``None``: on where supported,
    unless ``TPLOGP_DIRECT_LAUNCH=0``). For tests and benchmarks that compare the two paths."""
    global _OVERRIDE
    _OVERRIDE = False if enabled is False else None
    if _OVERRIDE is False:
        return
    for found in _LAUNCHERS.values():
        found._enabled = None  # re-read the environment on the next launch


def launcher(jit_fn: Any) -> Callable[..., None]:
    """The :class:`DirectLauncher` of a ``@triton.jit`` kernel (one per kernel object; looked up at each launch, so
    a kernel attribute replaced by a test or a benchmark is honoured). Anything that is not a Triton kernel (a
    stand-in with ``__getitem__``) is launched as ``obj[grid](...)``."""
    found = _LAUNCHERS.get(id(jit_fn))
    if found is None or found.jit_fn is not jit_fn:
        if not callable(getattr(jit_fn, "fn", None)):
            return lambda grid, *args, num_warps, num_stages=None, **constexprs: _jit_launch(
                jit_fn, grid, args, num_warps, num_stages, constexprs)
        found = _LAUNCHERS[id(jit_fn)] = DirectLauncher(jit_fn)
    return found
