"""The examples of docs/training.md, docs/plugin.md and docs/operator.md: each ```python block preceded by ``<!-- example: NAME -->``."""

from __future__ import annotations

import os
import re
from pathlib import Path

TRAINING_DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"
PLUGIN_DOC = Path(__file__).resolve().parents[2] / "docs" / "plugin.md"
OPERATOR_DOC = Path(__file__).resolve().parents[2] / "docs" / "operator.md"
_EXAMPLE = re.compile(r"<!-- example: (\S+) -->\n```python\n(.*?)```", re.S)


def examples(doc: Path = TRAINING_DOC) -> dict[str, str]:
    """``{name: code}`` of every marked example of ``doc``."""
    return dict(_EXAMPLE.findall(doc.read_text()))


def run_example(name: str, **namespace) -> None:
    """Execute example ``name`` with ``namespace`` predefined (e.g. ``tp_group``); the environment is restored."""
    code = examples()[name]
    saved = dict(os.environ)
    try:
        exec(compile(code, f"{TRAINING_DOC.name}:{name}", "exec"), dict(namespace))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def define_example(name: str, namespace: dict, doc: Path = PLUGIN_DOC) -> None:
    """Execute example ``name`` of ``doc`` into ``namespace`` (a test module's globals: an example that is a test
    file defines its tests there, where pytest collects them and the ranks of pytest_tplogp find them by name)."""
    exec(compile(examples(doc)[name], str(doc), "exec"), namespace)
