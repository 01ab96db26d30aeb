"""A kernel launch described once (:class:`LaunchSpec`) and, for a layout that repeats, bound to its compiled kernel
(:class:`BoundLaunch`): the tensors alone change from call to call.

:class:`~tplogp.kernels.direct_launch.DirectLauncher` rebuilds a launch key from all of a launch's arguments on
every call (each int's specialization, each tensor's dtype and alignment, the constexpr values). For a layout that
repeats, only the tensors change from call to call: their addresses, hence their 16-byte alignment, which Triton
specializes on. A :class:`LaunchSpec` holds the kernel, the grid, the scalar arguments that follow the tensors in the
kernel's signature, ``num_warps`` / ``num_stages`` and the constexprs, computed from sizes alone; its
:meth:`~LaunchSpec.launch` goes through the direct launcher per call, and :meth:`~LaunchSpec.bind` makes the
:class:`BoundLaunch` a layout keeps.

Algorithm of a bound launch: per call, the alignment signature is the tuple of ``data_ptr() % 16`` of the tensors
(the tensors' dtypes are fixed by the layout, like the scalars). The compiled kernel of a signature comes from the
direct launcher the first time the signature is seen (a launch through it, which compiles or finds the kernel as
always); after that the call runs the compiled kernel's launcher directly. Everything the direct launcher honours
holds here too, because any launch it would not make directly (interpreter, ``TPLOGP_DIRECT_LAUNCH=0``, a launch
hook such as a profiler's, an unsupported Triton) goes through it every time.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from . import direct_launch
from .direct_launch import launcher


class LaunchSpec(NamedTuple):
    """One launch of ``jit_fn`` but its tensors: the grid, the scalar arguments that follow the pointers in the
    kernel's signature (its runtime arguments are its pointers first, then its scalars), ``num_warps`` /
    ``num_stages`` and every constexpr (in signature order)."""

    jit_fn: Any
    grid: tuple
    scalars: tuple
    num_warps: int
    num_stages: Optional[int]
    constexprs: dict

    def launch(self, *tensors: torch.Tensor) -> None:
        """One launch through the direct launcher (its key built from every argument)."""
        launcher(self.jit_fn)(self.grid, *tensors, *self.scalars, num_warps=self.num_warps,
                              num_stages=self.num_stages, **self.constexprs)

    def bind(self) -> "BoundLaunch":
        return BoundLaunch(self)


class BoundLaunch:
    """``bound.launch(*tensors)``: ``spec``'s launch with these tensors, the compiled kernel found by their
    alignment (module docstring)."""

    __slots__ = ("spec", "_grid3", "_tail", "_entries")

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        grid = spec.grid
        self._grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self._tail = spec.scalars + tuple(spec.constexprs.values())  # what follows the tensors in a direct launch
        self._entries: dict = {}  # (device, alignments) -> the compiled kernel's (run, function, metadata)

    def launch(self, *tensors: torch.Tensor) -> None:
        spec = self.spec
        found = launcher(spec.jit_fn)  # (looked up per call: a launcher replaced by a test is honoured)
        if not (isinstance(found, direct_launch.DirectLauncher) and found.hot()):
            spec.launch(*tensors)
            return
        device = direct_launch._current_device()
        key = (device, *[t.data_ptr() % 16 for t in tensors])
        entry = self._entries.get(key)
        if entry is None:  # this alignment's first launch: through the direct launcher, then its compiled kernel kept
            spec.launch(*tensors)
            entry = found.entry(tensors + spec.scalars, spec.num_warps, spec.num_stages, spec.constexprs)
            if entry is not None:
                self._entries[key] = entry
            return
        run, function, metadata = entry
        grid = self._grid3
        found.direct_launches += 1
        run(grid[0], grid[1], grid[2], direct_launch._raw_stream(device), function, metadata, None, None, None,
            *tensors, *self._tail)


__all__ = ["BoundLaunch", "LaunchSpec"]
