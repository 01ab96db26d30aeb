"""Which modules the suite's files import, and the imports that break the suite's rule: a file under ``tests/``
may import the shared helpers (``tests.support`` and below) and modules outside the suite, never another test
module (a ``tests.*`` module outside ``tests.support``, or a module named ``test_*`` / ``conftest`` imported by its
bare name). Files are parsed with ``ast`` (nothing is imported): module-level and function-level imports, relative
ones resolved, and dotted string constants that name a suite module (``importlib.import_module``, ``pytest_plugins``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.import_graph import resolve_from

_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def _module_of(path: Path, root: Path) -> tuple[str, bool]:
    """The dotted name of ``path`` in the package whose directory is ``root`` (named ``root.name``)."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def imported_names(path: Path, root: Path) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every module (or ``package.name``) that ``path`` imports or names."""
    module, is_package = _module_of(path, root)
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = resolve_from(module, is_package, node)
            found += [(node.lineno, f"{target}.{alias.name}" if target else alias.name) for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.match(node.value) \
                and node.value.split(".")[0] == root.name:
            found.append((node.lineno, node.value))
    return found


def breaks_rule(name: str, suite: str) -> bool:
    """Whether importing ``name`` (a module, or ``module.attribute``) from a file of the suite package ``suite``
    imports a test module."""
    parts = name.split(".")
    if parts[0] == suite:
        return len(parts) > 1 and parts[1] != "support"
    return any(p.startswith("test_") or p == "conftest" for p in parts)


def violations(root: Path) -> list[str]:
    """``"file:line imports name"`` for every import under ``root`` (the suite's directory) that breaks the rule."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        for line, name in imported_names(path, root):
            if breaks_rule(name, root.name):
                bad.append(f"{path.relative_to(root.parent)}:{line} imports {name}")
    return bad
