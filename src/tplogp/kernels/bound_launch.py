"""A kernel launch whose every argument but its tensors is fixed: one launch of one call layout.

:class:`~tplogp.kernels.direct_launch.DirectLauncher` rebuilds a launch key from all of a launch's arguments on
every call (each int's specialization, each tensor's dtype and alignment, the constexpr values). For a layout that
repeats, only the tensors change from call to call: their addresses, hence their 16-byte alignment, which Triton
specializes on. A :class:`BoundLaunch` is made once per layout with the grid, the scalar arguments that follow the
tensors in the kernel's signature, ``num_warps`` / ``num_stages`` and the constexprs; a call passes the tensors
alone.

Algorithm: per call, the alignment signature is the tuple of ``data_ptr() % 16`` of the tensors (the tensors'
dtypes are fixed by the layout, like the scalars). The compiled kernel of a signature comes from the direct
launcher the first time the signature is seen (a launch through it, which compiles or finds the kernel as always);
after that the call runs the compiled kernel's launcher directly. Everything the direct launcher honours holds
here too, because any launch it would not make directly (interpreter, ``TPLOGP_DIRECT_LAUNCH=0``, a launch hook
such as a profiler's, an unsupported Triton) goes through it every time.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import direct_launch
from .direct_launch import launcher


class BoundLaunch:
    """``bound(*tensors)`` launches ``jit_fn`` on ``grid`` with ``tensors`` followed by the fixed ``scalars`` (the
    kernel's runtime arguments in signature order: its pointer arguments first, then its scalars) and the
    constexprs (every one, in signature order). See the module docstring."""

    __slots__ = ("_jit_fn", "grid", "scalars", "num_warps", "num_stages", "constexprs", "_grid3", "_tail",
                 "_entries")

    def __init__(self, jit_fn: Any, grid: tuple, scalars: tuple, num_warps: int, num_stages: Optional[int],
                 constexprs: dict) -> None:
        self._jit_fn = jit_fn
        self.grid = tuple(grid)
        self._grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.scalars = tuple(scalars)
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.constexprs = dict(constexprs)
        self._tail = self.scalars + tuple(self.constexprs.values())  # what follows the tensors in a direct launch
        self._entries: dict = {}  # (device, alignments) -> the compiled kernel's (run, function, metadata)

    def __call__(self, *tensors: torch.Tensor) -> None:
        found = launcher(self._jit_fn)  # (looked up per call: a kernel replaced by a test is honoured)
        if isinstance(found, direct_launch.DirectLauncher) and found.hot():
            device = direct_launch._current_device()
            key = (device, *[t.data_ptr() % 16 for t in tensors])
            entry = self._entries.get(key)
            if entry is not None:
                run, function, metadata = entry
                grid = self._grid3
                found.direct_launches += 1
                run(grid[0], grid[1], grid[2], direct_launch._raw_stream(device), function, metadata, None, None,
                    None, *tensors, *self._tail)
                return
            found(self.grid, *tensors, *self.scalars, num_warps=self.num_warps, num_stages=self.num_stages,
                  **self.constexprs)
            entry = found.entry(tensors + self.scalars, self.num_warps, self.num_stages, self.constexprs)
            if entry is not None:
                self._entries[key] = entry
            return
        found(self.grid, *tensors, *self.scalars, num_warps=self.num_warps, num_stages=self.num_stages,
              **self.constexprs)


__all__ = ["BoundLaunch"]
