"""The import graph of the packages under ``src``, parsed with ``ast`` (nothing is imported).

Every import inside the two packages becomes an edge: module-level and function-level ``import`` / ``from ... import``
(relative ones resolved), and module names given as dotted string constants (what ``importlib.import_module`` is
called with). Importing a submodule also runs its parents' ``__init__``; those implicit edges are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Optional

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGES = ("tplogp", "pytest_tplogp")


def module_files() -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of the packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((SRC / package).rglob("*.py")):
            parts = list(path.relative_to(SRC).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name of a ``from ... import`` in ``module`` (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: Iterable[str]) -> set[str]:
    """The modules of the packages that ``module`` imports anywhere in its file."""
    known = set(known)
    is_package = path.name == "__init__.py"
    edges: set[str] = set()

    def add(name: str, imported: Optional[str] = None) -> None:
        if imported and f"{name}.{imported}" in known:  # from pkg import submodule
            edges.add(f"{name}.{imported}")
        elif name in known:
            edges.add(name)

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = resolve_from(module, is_package, node)
            for alias in node.names:
                add(target, alias.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in known:
            edges.add(node.value)  # importlib.import_module("tplogp.backends.native") and the like
    edges.discard(module)
    return edges


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, files) for name, path in files.items()}
