"""Whether a pytest run asked for the plugin, and switching the full plugin on when it did.

The entry point loads only the package's shim (``pytest_tplogp/__init__.py``: the options and one
configure hook). A run asks for the plugin by naming it (``-p pytest_tplogp``, ``PYTEST_PLUGINS``,
``pytest_plugins`` in a conftest.py or plugin), by giving any ``--tp...`` option on the command
line, or with ini ``tplogp = true``. Environment variables (``TPLOGP_TP`` ...) only configure.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

#: The module that holds the full plugin (hooks, which bring the fixture modules along).
FULL_PLUGIN = "pytest_tplogp.hooks"
#: Names under which a run can ask for the plugin (``pytest_tplogp.lmhead`` asks for it with its own
#: fixtures).
NAMES = ("pytest_tplogp", FULL_PLUGIN, "pytest_tplogp.lmhead")


def _listed(specs: Any) -> str | None:
    """The first of :data:`NAMES` among plugin specs (a list, or a comma-separated string), or
    None."""
    if isinstance(specs, str):
        specs = specs.split(",")
    try:
        return next((str(s).strip() for s in specs if str(s).strip() in NAMES), None)
    except TypeError:
        return None


def why_active(config: Any) -> str | None:
    """How this run asked for the plugin (a short phrase for the header), or None when it did
    not."""
    from . import options

    name = _listed(config.getoption("plugins", None) or ())
    if name is not None:
        return f"-p {name}"
    if _listed(os.environ.get("PYTEST_PLUGINS", "")):
        return "PYTEST_PLUGINS"
    for plugin in config.pluginmanager.get_plugins():
        if (_listed(getattr(plugin, "pytest_plugins", ()))
            and getattr(plugin, "__name__", "") not in NAMES):
            name = str(config.pluginmanager.get_name(plugin) or "a plugin")
            return f"pytest_plugins in {os.path.basename(name)}"
    flag = options.given_on_command_line(config)
    if flag is not None:
        return flag
    if options.enabled_in_ini(config):
        return f"ini {options.ENABLE_INI} = true"
    return None


def activate_if_asked(config: Any) -> None:
    """Register the full plugin if the run asked for it; record how it asked (for the header)."""
    from .session import ACTIVATED_BY

    reason = why_active(config)
    if reason is None:
        return
    config.stash[ACTIVATED_BY] = reason
    manager = config.pluginmanager
    if not manager.has_plugin(FULL_PLUGIN) and not manager.is_blocked(FULL_PLUGIN):
        # register (not import_plugin): no assertion-rewrite marking of a module that may be
        # imported already
        manager.register(importlib.import_module(FULL_PLUGIN), FULL_PLUGIN)
