"""tplogp.kernels imports downward only: its modules import each other in one direction (the order of the package
docstring) and nothing of tplogp above them (backends, the TP layer, the API). A finer check of the kernels layer
of ``tests/meta/test_import_graph.py``, on the same import graph."""

from __future__ import annotations

from pathlib import Path

import tplogp.kernels
from tests.support.import_graph import import_graph

KERNELS = Path(tplogp.kernels.__file__).parent
# lowest first; a module may import only modules before it
ORDER = ["tiles", "kept", "workspace", "support_bits", "launch", "fp32_ops", "tile_ops",
         "forward_epilogue", "backward_epilogue", "forward_kernels", "backward_kernels",
         "hopper_kernels", "scale_kernels", "sampler_kernels", "pairs_kernels", "launches",
         "entry_checks", "forward_programs", "backward_programs", "grid_programs", "scale_launch",
         "sampler_launch", "pairs_launch"]
# what kernels may import from the rest of tplogp (all torch-only leaves)
ALLOWED_OUTSIDE = {"tplogp.support.settings", "tplogp.support.tensors", "tplogp.support.fp32_gemm"}


def test_every_kernels_module_is_placed():
    assert sorted(p.stem for p in KERNELS.glob("*.py") if p.stem != "__init__") == sorted(ORDER)


def test_kernels_import_downward_only():
    graph = import_graph()  # the package-wide parse: function-level, relative and string imports
    for i, name in enumerate(ORDER):
        for target in graph[f"tplogp.kernels.{name}"]:
            if target.startswith("tplogp.kernels."):
                other = target.split(".")[2]
                assert other in ORDER[:i], f"kernels.{name} imports kernels.{other} (not below it)"
            else:
                assert target in ALLOWED_OUTSIDE, f"kernels.{name} imports {target} (an upper layer)"
