"""The examples of docs/training.md: each ```python block preceded by ``<!-- example: NAME -->``."""

from __future__ import annotations

import os
import re
from pathlib import Path

TRAINING_DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"
_EXAMPLE = re.compile(r"<!-- example: (\S+) -->\n```python\n(.*?)```", re.S)


def examples() -> dict[str, str]:
    """``{name: code}`` of every marked example."""
    return dict(_EXAMPLE.findall(TRAINING_DOC.read_text()))


def run_example(name: str, **namespace) -> None:
    """Execute example ``name`` with ``namespace`` predefined (e.g. ``tp_group``); the environment is restored."""
    code = examples()[name]
    saved = dict(os.environ)
    try:
        exec(compile(code, f"{TRAINING_DOC.name}:{name}", "exec"), dict(namespace))
    finally:
        os.environ.clear()
        os.environ.update(saved)
