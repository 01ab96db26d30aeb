"""Hangs, dead ranks and dirty state: reported with stacks, the pool respawned, the session goes on,
no orphans."""

from __future__ import annotations

import os

import pytest
from tests.support.plugin_helpers import leftover_processes, tagged_pids

pytest_plugins = ["pytester"]

BODY = '''
import os, signal
import pytest
import torch
import torch.distributed as dist

@pytest.mark.tp(timeout=2)
def test_hang(tp):
    if tp.rank == 0:
        dist.barrier()          # rank 1 never joins

@pytest.mark.tp
def test_after_hang(tp):
    dist.barrier()

@pytest.mark.tp
def test_fails_while_peer_waits(tp):
    if tp.rank == 1:
        raise RuntimeError("rank 1 gives up before the collective")
    dist.barrier()              # rank 0 would wait for the whole deadline (120 s)

@pytest.mark.tp
def test_exit(tp):
    if tp.rank == 1:
        os._exit(3)
    dist.barrier()

@pytest.mark.tp
def test_sigkill(tp):
    if tp.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()

@pytest.mark.tp
def test_leaves_group(tp):
    dist.new_group([0, 1])     # never destroyed: fresh-state check recycles the pool

@pytest.mark.tp
def test_cached_group_is_fine(tp):
    g = tp.new_group([0, 1])
    dist.barrier(group=g)

@pytest.mark.tp
def test_last(tp):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
'''


@pytest.mark.slow
def test_hang_death_and_recycle(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body=BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-vv", "-rA", "-W", "always")
    result.assert_outcomes(passed=4, failed=4)
    result.stdout.fnmatch_lines([
        "*test_hang*FAILED*",
        "*test_after_hang*PASSED*",
        "*test_fails_while_peer_waits*FAILED*",
        "*test_exit*FAILED*",
        "*test_sigkill*FAILED*",
        "*test_leaves_group*PASSED*",
        "*test_cached_group_is_fine*PASSED*",
        "*test_last*PASSED*",
    ])
    # hang: which rank waited where, every stuck rank's faulthandler stack, pool killed
    result.stdout.fnmatch_lines([
        "E   deadline of 2 s exceeded: rank 0 still running*",
        "*rank 0 (pid *) waiting in barrier (torch/distributed/*) called from test_hang "
        "(*test_body.py:9)*",
        "--- rank 0 stack (faulthandler, SIGUSR1) ---",
        "*File*test_body.py*line 9 in test_hang*",
        "  (* frame(s) of pytest_tplogp, pytest and pluggy below the test and 1 thread(s) of "
        "pytest_tplogp not shown)",
        "pool (world size 2, gloo, cpu) killed (ranks timed out)*",
    ])
    # a one-rank failure while the peer waits in a collective: the peer is declared stuck after the
    # grace period
    result.stdout.fnmatch_lines([
        "E   rank 1: RuntimeError: rank 1 gives up before the collective; rank 0 did not finish "
        "within 3 s after a peer failed or skipped (stuck in a collective?)",
        "*rank 0 (pid *) waiting in barrier*called from test_fails_while_peer_waits*",
    ])
    out = result.stdout.str()
    # hidden
    for harness in ("_watch_parent", "pytest_tplogp/rank.py", "/multiprocessing/", "Thread 0x"):
        assert harness not in out, harness
    result.stdout.fnmatch_lines(["*FAILED test_body.py::test_exit[[]tp2[]] - rank 1 exited with "
                                 "code 3*"])
    result.stdout.fnmatch_lines(["*FAILED test_body.py::test_sigkill[[]tp2[]] - rank 0 was killed "
                                 "by SIGKILL (signal 9)*"])
    result.stdout.fnmatch_lines(["*pool recycled after this test: fresh-state check failed: 1 "
                                 "process group(s) left*"])
    assert leftover_processes(tag) == []


SLEEPY = '''
import pathlib
import time
import pytest

@pytest.mark.tp
def test_sleeps(tp):
    pathlib.Path(__file__).with_name(f"in-body-rank{tp.rank}").touch()
    time.sleep(120)
'''

#: Ctrl-C or a crash of pytest ends the run, every rank and the fork server included, within this
#: many seconds, also on a loaded 2-core machine (measured there: docs/plugin.md, "Pool").
EXIT_WITHIN_S = 10.0


@pytest.mark.slow
@pytest.mark.parametrize("sig, phase", [("SIGINT", "body"), ("SIGINT", "start"),
                                        ("SIGKILL", "body")],
                         ids=["SIGINT-in-body", "SIGINT-while-starting", "SIGKILL-in-body"])
def test_no_orphans_after_ctrl_c_or_crash(pytester: pytest.Pytester, tag: str, sig: str,
                                          phase: str) -> None:
    """SIGINT (Ctrl-C) or SIGKILL to pytest ends it and leaves no process behind within
    EXIT_WITHIN_S.

    ``body``: the signal comes once both ranks are inside the test body (each touched its file).
    ``start``: the signal comes while the pool's fork server is still importing torch, frozen there
    (SIGSTOP) as a starved process on a loaded machine is; it must die with pytest instead of
    finishing its import first.
    """
    import signal
    import subprocess
    import sys
    import time

    from tests.support.plugin_helpers import forkserver_importing_torch, process_states, wait_for

    pytester.makepyfile(test_body=SLEEPY)
    # a file: nothing here waits on a pipe's last writer
    with open(pytester.path / "pytest.log", "wb") as log:
        # SIGINT at its default, as in a terminal's foreground job (a background job of a
        # non-interactive shell, or nohup, starts with SIGINT ignored, and a child keeps an ignored
        # signal ignored)
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "pytest_tplogp", "-q",
                                 "test_body.py"],
                                cwd=pytester.path, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        if phase == "body":
            wait_for(lambda: all((pytester.path / f"in-body-rank{r}").exists() for r in (0, 1)),
                     180,
                     "both ranks in the test body")
        else:
            server = wait_for(lambda: forkserver_importing_torch(proc.pid), 180,
                              "the fork server importing torch")
            os.kill(server, signal.SIGSTOP)
        sent = time.monotonic()
        proc.send_signal(getattr(signal, sig))
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            states = process_states([proc.pid, *tagged_pids(tag)])
            raise AssertionError(f"pytest still running 60 s after {sig}:\n{states}") from None
        exit_s = time.monotonic() - sent
        left = leftover_processes(tag, wait_s=max(0.0, EXIT_WITHIN_S - exit_s))
        all_gone_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        # clean up after a failure (a frozen fork server would stay forever)
        for pid in tagged_pids(tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    output = (pytester.path / "pytest.log").read_text(errors="replace")
    assert (
        exit_s
        < EXIT_WITHIN_S), f"pytest took {exit_s:.1f} s to exit after {sig}:\n{output[-3000:]}"
    assert left == [], f"still running {all_gone_s:.1f} s after {sig}: {left}\n{output[-3000:]}"
    if sig == "SIGINT":
        assert "KeyboardInterrupt" in output, output[-3000:]
