"""A rank that leaves its pool cleanly releases what multiprocessing registered for it (named
semaphores)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tests.support.plugin_helpers import leftover_processes

pytest_plugins = ["pytester"]

# A process-wide multiprocessing lock that lives until the process ends, as tqdm's class lock does
# (torch.fx makes one on a rank when torch.compile runs there); a non-fork context gives it a named
# POSIX semaphore that the pytest process's resource tracker watches.
HOLDS_A_LOCK = '''
import multiprocessing
import pytest

LOCKS = []

@pytest.mark.tp
def test_holds_a_lock(tp):
    LOCKS.append(multiprocessing.get_context("spawn").Lock())
'''


@pytest.mark.slow
def test_stopped_ranks_release_their_semaphores(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body=HOLDS_A_LOCK)
    # a file: the resource tracker writes after pytest exits
    with open(pytester.path / "pytest.log", "wb") as log:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "pytest_tplogp", "-q",
                               "test_body.py"],
                              cwd=pytester.path, stdout=log, stderr=subprocess.STDOUT, timeout=300)
    assert leftover_processes(tag) == []  # the resource tracker too: it has written its last word
    output = (pytester.path / "pytest.log").read_text(errors="replace")
    assert proc.returncode == 0, output[-3000:]
    assert "1 passed" in output, output[-3000:]
    assert "leaked semaphore" not in output, output[-3000:]
