"""A value computed once per test session, shared by pytest-xdist's workers.

A module- or session-scoped fixture runs once per xdist worker: a costly one (compiling kernels in a subprocess)
would run on every worker that draws one of its tests. :func:`once_per_session` computes the value in the first
worker that asks, under an exclusive ``flock`` on a file in the directory every worker of the session shares, and
the others read it. Without xdist it simply computes it.
"""

from __future__ import annotations

import fcntl
import json
from typing import Any, Callable

import pytest


def once_per_session(request: pytest.FixtureRequest, name: str, compute: Callable[[], Any]) -> Any:
    """``compute()`` (a JSON value), once per session across xdist workers (module docstring); ``name`` names it."""
    if getattr(request.config, "workerinput", None) is None:  # not an xdist worker: nothing to share
        return compute()
    shared = request.getfixturevalue("tmp_path_factory").getbasetemp().parent  # this session's, every worker's
    path = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        if path.is_file():
            return json.loads(path.read_text())
        value = compute()
        path.write_text(json.dumps(value))
        return value
