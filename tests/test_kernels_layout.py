"""tplogp.kernels imports downward only: its modules import each other in one direction (the order of the package
docstring) and nothing of tplogp above them (backends, the TP layer, the API)."""

from __future__ import annotations

import ast
from pathlib import Path

import tplogp.kernels

KERNELS = Path(tplogp.kernels.__file__).parent
# lowest first; a module may import only modules before it
ORDER = ["tiles", "direct_launch", "common", "generic_kernels", "hopper_kernels", "generic_launch", "hopper_launch"]
# what kernels may import from the rest of tplogp (all torch-only leaves)
ALLOWED_OUTSIDE = {"tplogp.settings", "tplogp.tensors", "tplogp.fp32_gemm"}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = "tplogp.kernels" + (f".{node.module}" if node.module else "")
            elif node.level == 2:
                base = "tplogp" + (f".{node.module}" if node.module else "")
            else:
                base = node.module or ""
            if node.module is None:  # from . import x / from .. import x
                found.update(f"{base}.{alias.name}" for alias in node.names)
            else:
                found.add(base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("tplogp")}


def test_every_kernels_module_is_placed():
    assert sorted(p.stem for p in KERNELS.glob("*.py") if p.stem != "__init__") == sorted(ORDER)


def test_kernels_import_downward_only():
    for i, name in enumerate(ORDER):
        for target in _imports(KERNELS / f"{name}.py"):
            if target.startswith("tplogp.kernels."):
                other = target.split(".")[2]
                assert other in ORDER[:i], f"kernels.{name} imports kernels.{other} (not below it)"
            else:
                assert target in ALLOWED_OUTSIDE, f"kernels.{name} imports {target} (an upper layer)"
