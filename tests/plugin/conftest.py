"""Shared setup for the pytester tests of pytest_tplogp (every run is a real subprocess)."""

from __future__ import annotations

import os
import pathlib
import uuid

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def tag(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> str:
    """Make pytest_tplogp and tplogp importable in the subprocess, and tag its processes (zombie/orphan checks)."""
    paths = [str(REPO / "src")]
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths + ([old] if old else [])))
    for var in ("TPLOGP_TP", "TPLOGP_TP_BACKEND", "TPLOGP_TP_TIMEOUT", "WORLD_SIZE", "RANK", "MASTER_ADDR",
                "TORCHELASTIC_RUN_ID", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(var, raising=False)
    value = uuid.uuid4().hex
    monkeypatch.setenv("TPLOGP_TEST_TAG", value)
    return value
