"""pytest_tplogp: run pytest test bodies on a persistent pool of torch.distributed ranks.

Opt-in. The ``pytest11`` entry point loads only this module, which adds the plugin's options (all spelled
``--tp...``, ini keys ``tp_...``) and nothing else: no fixture, marker, skip or per-test hook. The full plugin
(``pytest_tplogp.plugin``) is registered at configure time when the run asks for it:

- ``-p pytest_tplogp`` (command line, ``PYTEST_ADDOPTS`` or ini ``addopts``), ``PYTEST_PLUGINS=pytest_tplogp``, or
  ``pytest_plugins = ["pytest_tplogp"]`` in a conftest.py / plugin module;
- any ``--tp...`` option on the command line (``--tp=4``, ``--tp-timeout=60``, ...);
- ini ``tplogp = true``.

Layout (one role per module, imports point downward):

- ``plugin.py``   pytest hooks and fixtures (parent side).
- ``pool.py``     the controller: one persistent rank pool per (world size, backend, device set), bounded waits,
  stack dumps on a deadline, kill + respawn.
- ``rank.py``     the rank-side worker loop; imports nothing of the controller (only ``protocol``, ``context``).
- ``context.py``  the ``tp`` rank context and the collective assertion helpers (usable under torchrun too).
- ``values.py``   picklable fixture values (vocab shards, references, op sources) shared by both sides.
- ``options.py``  settings, CLI > env > ini > default.  ``devices.py`` backend and GPU-block choice.
- ``report.py``   merging per-rank outcomes (grouped failures, agreed skips) into one pytest outcome.
- ``external.py`` pytest itself launched by torchrun: use the existing process group.

Importing this package imports neither torch nor pytest (only pluggy): rank processes import ``pytest_tplogp.rank`` cheaply, and
public names below are loaded on first access.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from pluggy import HookimplMarker  # what pytest.hookimpl is, without importing pytest

__version__ = "0.1.0"

#: The module that holds the full plugin (hooks and fixtures); registered only when a run asks for it.
FULL_PLUGIN = "pytest_tplogp.plugin"
#: The names under which a run can ask for the plugin explicitly.
_NAMES = ("pytest_tplogp", FULL_PLUGIN)

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


# ------------------------------------------------------------------------------------------ the opt-in shim hooks
def pytest_addoption(parser: Any) -> None:
    from . import options

    options.addoption(parser)


def _listed(specs: Any) -> bool:
    if isinstance(specs, str):
        specs = specs.split(",")
    try:
        return any(str(s).strip() in _NAMES for s in specs)
    except TypeError:
        return False


def why_active(config: Any) -> str | None:
    """How this run asked for the plugin (a short phrase for the header), or None when it did not."""
    from . import options

    if _listed(config.getoption("plugins", None) or ()):
        return "-p pytest_tplogp"
    if _listed(os.environ.get("PYTEST_PLUGINS", "")):
        return "PYTEST_PLUGINS"
    for plugin in config.pluginmanager.get_plugins():
        if _listed(getattr(plugin, "pytest_plugins", ())):
            name = config.pluginmanager.get_name(plugin) or "a plugin"
            return f"pytest_plugins in {os.path.basename(str(name))}"
    flag = options.given_on_command_line(config)
    if flag is not None:
        return flag
    if options.enabled_in_ini(config):
        return f"ini {options.ENABLE_INI} = true"
    return None


@HookimplMarker("pytest")(tryfirst=True)  # before junitxml & co. read their options
def pytest_configure(config: Any) -> None:
    """Register the full plugin when the run asked for it (see the module docstring)."""
    manager = config.pluginmanager
    if manager.has_plugin(FULL_PLUGIN) or manager.is_blocked(FULL_PLUGIN):
        return
    reason = why_active(config)
    if reason is not None:
        manager.register(importlib.import_module(FULL_PLUGIN), FULL_PLUGIN)

