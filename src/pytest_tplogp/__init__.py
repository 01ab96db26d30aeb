"""pytest_tplogp: run pytest test bodies on a persistent pool of torch.distributed ranks.

Layout (split by role, like pytest-xdist):

- ``plugin.py``   pytest hooks and fixtures (parent side); registered through ``pytest_plugins`` below so that the
  pytest11 entry point ``pytest_tplogp = "pytest_tplogp"`` and ``-p pytest_tplogp`` load it exactly once.
- ``pool.py``     the controller: one persistent rank pool per (world size, backend, device set), bounded waits,
  stack dumps on a deadline, kill + respawn.
- ``rank.py``     the rank-side worker loop; imports nothing of the controller (only ``protocol``, ``context``).
- ``context.py``  the ``tp`` rank context and the collective assertion helpers (usable under torchrun too).
- ``values.py``   picklable fixture values (vocab shards, references, op sources) shared by both sides.
- ``options.py``  settings, CLI > env > ini > default.  ``devices.py`` backend and GPU-block choice.
- ``report.py``   merging per-rank outcomes (grouped failures, agreed skips) into one pytest outcome.
- ``external.py`` pytest itself launched by torchrun: use the existing process group.

Importing this package imports neither torch nor pytest: rank processes import ``pytest_tplogp.rank`` cheaply, and
public names below are loaded on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

pytest_plugins = ["pytest_tplogp.plugin"]

__version__ = "0.1.0"

_LAZY = {
    "RankContext": "pytest_tplogp.context",
    "CollectiveAssertionError": "pytest_tplogp.context",
    "current_context": "pytest_tplogp.context",
    "VocabShards": "pytest_tplogp.values",
    "Reference": "pytest_tplogp.values",
    "OpSource": "pytest_tplogp.values",
    "RankValue": "pytest_tplogp.values",
    "RankFailure": "pytest_tplogp.report",
}

__all__ = [
    "CollectiveAssertionError",
    "OpSource",
    "RankContext",
    "RankFailure",
    "RankValue",
    "Reference",
    "VocabShards",
    "current_context",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_tplogp' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
