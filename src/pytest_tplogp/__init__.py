"""pytest_tplogp: run pytest test bodies on a persistent pool of torch.distributed ranks.

Opt-in. The ``pytest11`` entry point loads only this module, which adds the plugin's options (all
spelled ``--tp...``, ini keys ``tp_...``) and nothing else: no fixture, marker, skip or per-test
hook. The full plugin (``pytest_tplogp.hooks`` and the fixture modules) is registered at configure
time when the run asks for it:

- ``-p pytest_tplogp`` (command line, ``PYTEST_ADDOPTS`` or ini ``addopts``),
  ``PYTEST_PLUGINS=pytest_tplogp``, or ``pytest_plugins = ["pytest_tplogp"]`` in a conftest.py /
  plugin module;
- any ``--tp...`` option on the command line (``--tp=4``, ``--tp-timeout=60``, ...);
- ini ``tplogp = true``.

Layout (one role per module; each imports only the modules listed below it):

- ``hooks.py``           pytest hooks of the active plugin: configure, header, collection, setup,
                         call, reports.
- ``optin.py``           whether a run asked for the plugin; registers ``hooks`` (by name) when it
                         did.
- ``lmhead.py``          a plugin of its own (``-p pytest_tplogp.lmhead``): tplogp's LM-head
                         fixtures and options (vocab_shards, reference, op_source, dtype, bias;
                         --tp-op-source, --tp-dtype, ...).
- ``lmhead_values.py``   their picklable values (``VocabShards``, ``Reference``, ``OpSource``).
- ``fixtures.py``        the fixtures of every TP test: tp_world_size (placement at setup), tp,
                         tp_pool, mesh.
- ``dispatch.py``        sending a body to the ranks and merging what comes back into one pytest
                         outcome.
- ``placement.py``       the ``tp`` marker's arguments and where a test runs (backend, devices,
                         deadline).
- ``session.py``         per-session state in ``config.stash``.
- ``external.py``        pytest itself launched by torchrun: use the existing process group.
- ``report.py``          merging per-rank outcomes (grouped failures, agreed skips) into one report.
- ``pool.py``            the controller: persistent rank pools, bounded waits, stack dumps, kill +
                         respawn.
- ``rank_files.py``      the ranks' output and stack files as the controller reads them (a
                         command's slice, live lines).
- ``rank.py``            the rank-side worker loop (imports only ``collectives``, ``cuda_memory``,
                         ``debug``, ``outcomes``, ``rank_state``, ``forkserver_guard``,
                         ``protocol``, ``context``, ``values``, ``rank_coverage``).
- ``rank_state.py``      a rank process's state around a test: seeded before, put back and named
                         after, the process groups alive.
- ``outcomes.py``        a test body's exception as a rank's outcome (skip, xfail, failure).
- ``cuda_memory.py``     a CUDA rank's memory after each test: a leak (live tensors) or a cache.
- ``collectives.py``     collectives a body left unmatched: counted on the ranks, compared here.
- ``rank_coverage.py``   the ranks measure coverage when the pytest process does; their data joins
                         its data.
- ``debug.py``           ``breakpoint()`` and post-mortem pdb on one rank (``--tp-pdb``), served on
                         a local port.
- ``context.py``         the ``tp`` rank context and the collective assertion helpers (usable under
                         torchrun too).
- ``mesh.py``            mesh shapes (the marker's ``mesh=``), meshes built from cached groups,
                         DTensor helpers.
- ``devices.py``         backend and GPU-block choice.  ``options.py`` settings, CLI > env > ini >
                         default.
- ``values.py``          picklable fixture values shared by both sides, and the DTensor test
                         (``is_dtensor``, ``full``).
- ``protocol.py``        controller <-> rank messages.
- ``forkserver_guard.py`` the fork server's first preload module (it dies with pytest);
                          ``set_pdeathsig`` for the ranks.

Importing this package imports neither torch nor pytest (only pluggy): rank processes import
``pytest_tplogp.rank`` cheaply, and the public names below are loaded on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from pluggy import HookimplMarker  # what pytest.hookimpl is, without importing pytest

__version__ = "0.1.0"

_LAZY = {
    "RankContext": "pytest_tplogp.context",
    "CollectiveAssertionError": "pytest_tplogp.context",
    "current_context": "pytest_tplogp.context",
    "VocabShards": "pytest_tplogp.lmhead_values",
    "Reference": "pytest_tplogp.lmhead_values",
    "OpSource": "pytest_tplogp.lmhead_values",
    "RankValue": "pytest_tplogp.values",
    "RankFailure": "pytest_tplogp.report",
    "MeshShape": "pytest_tplogp.mesh",
}

__all__ = [
    "CollectiveAssertionError",
    "MeshShape",
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


# ------------------------------------------------------------------------------------------ the
# opt-in shim hooks
def pytest_addoption(parser: Any) -> None:
    from . import options

    options.addoption(parser)


@HookimplMarker("pytest")(tryfirst=True)  # before junitxml & co. read their options
def pytest_configure(config: Any) -> None:
    """Register the full plugin when the run asked for it (see the module docstring)."""
    from . import optin

    optin.activate_if_asked(config)
