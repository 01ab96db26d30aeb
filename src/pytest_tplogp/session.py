"""Per-session state of the active plugin, kept in ``config.stash``, and the stash keys shared by
the modules.

The pool manager is created lazily when the first TP test's setup completes
(``hooks.pytest_runtest_setup``), so a run that only collects, or whose TP tests all skip at setup
(in the plugin or in a fixture), spawns nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from .options import Settings


@dataclass
class State:
    settings: Settings
    external: Any = None  # external.ExternalMode under torchrun
    _manager: Any = None
    registered_sizes: set = field(default_factory=set)

    @property
    def manager(self) -> Any:
        if self._manager is None:
            from .pools import PoolManager

            threads = self.settings.threads or None
            self._manager = PoolManager(num_threads=threads,
                                        start_method=self.settings.start_method,
                                        pdb_rank=self.settings.pdb_rank)
        return self._manager


STATE = pytest.StashKey[State]()
#: How the run asked for the plugin ("-p pytest_tplogp", "--tp", ...), for the header.
ACTIVATED_BY = pytest.StashKey[str]()
#: On a TP test item: its placement (``placement.Plan``), decided at setup.
PLAN = pytest.StashKey[Any]()
#: The user property (JUnit ``<property>``) of a gpu TP test whose ranks share GPUs over gloo: what
#: and why.
SHARING_PROPERTY = "tplogp_gpu_sharing"
#: The user property (JUnit ``<property>``) of a TP test after which its pool was recycled: why.
RECYCLE_PROPERTY = "tplogp_pool_recycled"
#: On a TP test item whose ranks all skipped: the merged reason (the report points at the test, not
#: the plugin).
SKIPPED_ON_RANKS = pytest.StashKey[str]()


def register_marker(config: pytest.Config, name: str, text: str) -> None:
    """Declare a marker unless the project already declares one of that name."""
    existing = {line.split(":", 1)[0].split("(", 1)[0].strip() for line in config.getini("markers")}
    if name not in existing:
        config.addinivalue_line("markers", f"{name}: {text}")
