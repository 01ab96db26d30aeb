"""The generic plugin's footprint. Without the op's dependencies (``triton`` and ``tplogp``
unimportable in the fork server and the ranks, and ``triton`` in pytest, which never imports
``tplogp``) a TP test runs and passes; pytest's own process never imports torch; the ranks do not
import coverage when nothing measures; and a rank that leaves its pool cleanly releases what
multiprocessing registered for it (named semaphores). One pytest session checks all four."""

from __future__ import annotations

import pytest
from tests.support.plugin_helpers import leftover_processes

pytest_plugins = ["pytester"]

# Imported at start-up by every Python process whose sys.path has this directory (PYTHONPATH).
BLOCKER = '''
import sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("triton", "tplogp"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Blocker())
'''

BODY = '''
import multiprocessing
import sys

import pytest

def _importable(name):
    try:
        __import__(name)
    except ImportError:
        return False
    return True

@pytest.mark.tp(world_size=2)
def test_on_ranks(tp):
    import torch
    import torch.distributed as dist

    assert not _importable("triton") and not _importable("tplogp")
    t = torch.ones(1) * (tp.rank + 1)
    dist.all_reduce(t)
    tp.assert_close(t, torch.tensor([3.0]))

@pytest.mark.tp(world_size=2)
def test_ranks_do_not_import_coverage(tp):
    assert "coverage" not in sys.modules

# A process-wide multiprocessing lock that lives until the process ends, as tqdm's class lock does
# (torch.fx makes one on a rank when torch.compile runs there); a non-fork context gives it a named
# POSIX semaphore that the pytest process's resource tracker watches.
LOCKS = []

@pytest.mark.tp(world_size=2)
def test_holds_a_lock(tp):
    LOCKS.append(multiprocessing.get_context("spawn").Lock())

def test_in_pytest_after_tp_tests():
    # pytest's assertion rewriting imports the modules of an installed plugin's distribution
    # itself, past the blocker: here what counts is that nothing imported them
    assert "torch" not in sys.modules
    assert "triton" not in sys.modules and "tplogp" not in sys.modules
    assert not _importable("triton")
'''


@pytest.mark.slow
def test_footprint(pytester: pytest.Pytester, tag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``triton`` and ``tplogp`` blocked in every process, TP tests run and pass, and nothing
    imported them in pytest's own process. Only the fork server and the ranks import torch: TP tests
    run through a pool, from a test module that does not import torch, leave pytest's own process
    without it (--tp-backend=gloo: so also on a machine with GPUs, where backend auto asks torch
    about NCCL). Nothing measures coverage here, so the ranks do not import coverage. A rank that
    holds a multiprocessing lock till its end leaves its pool cleanly, releasing the lock's named
    semaphore: no leak reported, no process left."""
    import subprocess
    import sys

    blocker = pytester.mkdir("blocker")
    blocker.joinpath("sitecustomize.py").write_text(BLOCKER)
    monkeypatch.setenv("PYTHONPATH", f"{blocker}:{__import__('os').environ['PYTHONPATH']}")
    pytester.makepyfile(test_body=BODY)
    # a file: the resource tracker writes after pytest exits
    with open(pytester.path / "pytest.log", "wb") as log:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "pytest_tplogp", "-p",
                               "no:cacheprovider", "-rA", "--tp-backend=gloo", "test_body.py"],
                              cwd=pytester.path, stdout=log, stderr=subprocess.STDOUT, timeout=300)
    assert leftover_processes(tag) == []  # the resource tracker too: it has written its last word
    output = (pytester.path / "pytest.log").read_text(errors="replace")
    assert proc.returncode == 0, output[-3000:]
    result = pytest.RunResult(proc.returncode, output.splitlines(), [], 0.0)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["tplogp: world size 2, backend gloo*"])
    assert "leaked semaphore" not in output, output[-3000:]
