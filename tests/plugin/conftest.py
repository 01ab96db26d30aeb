"""Shared setup for the pytester tests of pytest_tplogp (every run is a real subprocess)."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
import uuid
from collections.abc import Iterator

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def tag(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Make pytest_tplogp and tplogp importable in the subprocess, tag its processes (zombie/orphan
    checks) and give it a temp dir of its own (a session these tests kill cannot leave anything in
    the system's)."""
    paths = [str(REPO / "src")]
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths + ([old] if old else [])))
    for var in ("TPLOGP_TP", "TPLOGP_TP_BACKEND", "TPLOGP_TP_TIMEOUT", "WORLD_SIZE", "RANK",
                "MASTER_ADDR",
                "TORCHELASTIC_RUN_ID", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(var, raising=False)
    own_tmp = tempfile.mkdtemp(prefix="tpt-")  # short: the fork server's AF_UNIX socket lives there
    monkeypatch.setenv("TMPDIR", own_tmp)
    # The session loads the plugins it names (-p pytest_tplogp, -p xdist, -p pytest_cov), not every
    # installed one: entry-point loading costs each session and each torchrun rank about half a
    # second (test_opt_in.py tests it).
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    value = uuid.uuid4().hex
    monkeypatch.setenv("TPLOGP_TEST_TAG", value)
    yield value
    shutil.rmtree(own_tmp, ignore_errors=True)


@pytest.fixture
def torchrun(pytester: pytest.Pytester, tag: str):
    """``torchrun(*args, nproc=2, launcher=())``: pytest with the plugin under ``torchrun
    --standalone --nproc_per_node=nproc *launcher`` in the pytester directory (the environment of
    ``tag``)."""
    import shutil
    import sys

    def run(*args: str, nproc: int = 2, launcher: tuple[str, ...] = ()) -> pytest.RunResult:
        exe = shutil.which("torchrun")
        cmd = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
        return pytester.run(*cmd, "--standalone", f"--nproc_per_node={nproc}", *launcher, "-m",
                            "pytest", "-p", "pytest_tplogp", "-p", "no:cacheprovider", *args,
                            timeout=180)

    return run
