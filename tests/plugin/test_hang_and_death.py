"""Hangs, dead ranks and dirty state: reported with stacks, the pool respawned, the session goes on,
no orphans; with -s the ranks' output is live, also while a peer hangs."""

from __future__ import annotations

import os

import pytest
from tests.support.plugin_helpers import leftover_processes, tagged_pids

pytest_plugins = ["pytester"]

BODY = '''
import os, signal, time
import pytest
import torch
import torch.distributed as dist

@pytest.mark.tp
def test_prints_waits_prints(tp):
    print(f"first line of rank {tp.rank}")
    for _ in range(600):  # the pytest process creates the file once it has seen the first line
        if os.path.exists("go"):
            break
        time.sleep(0.1)
    print(f"rank {tp.rank} saw the file: {os.path.exists('go')}")

@pytest.mark.tp(timeout=2)
def test_hang(tp):
    print(f"rank {tp.rank} before the barrier")
    if tp.rank == 0:
        dist.barrier()          # rank 1 never joins: the deadline passes

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
def test_hang_death_recycle_and_live_output(pytester: pytest.Pytester, tag: str) -> None:
    """A hang (which rank waited where, its stack, the pool killed), a one-rank failure while the
    peer waits in a collective (stuck after the grace), ranks that exit or are killed, and a
    leftover process group (the pool recycled): each reported, the session goes on, no orphans.
    With -s every rank's output is printed as it comes (``[rank N] ...``), once, also while a peer
    hangs: before the report, which does not repeat it."""
    import subprocess
    import sys

    pytester.makepyfile(test_body=BODY)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "pytest_tplogp", "-p",
                             "no:cacheprovider", "-s", "-vv", "-rA", "-W", "always",
                             "test_body.py"], cwd=pytester.path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "[rank 1] first line of rank 1" in line:
                # the body is still running: its first line came live
                (pytester.path / "go").touch()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    result = pytest.RunResult(proc.returncode, lines, [], 0.0)
    out = "\n".join(lines)
    result.assert_outcomes(passed=5, failed=4)
    # (-s -vv: the verdict of a test that printed follows the ranks' lines)
    result.stdout.fnmatch_lines([
        "test_body.py::test_prints_waits_prints[[]tp2[]] *",
        "PASSED",
        "test_body.py::test_hang[[]tp2[]] *",
        "FAILED",
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
        "(*test_body.py:19)*",
        "--- rank 0 stack (faulthandler, SIGUSR1) ---",
        "*File*test_body.py*line 19 in test_hang*",
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
    # -s: live output
    assert ("[rank 0] rank 0 saw the file: True" in out
            and "[rank 1] rank 1 saw the file: True" in out), out
    # the hang's output shows as it comes, before the failure report
    before = next(i for i, line in enumerate(lines) if "[rank 0] rank 0 before the barrier" in line)
    assert before < next(i for i, line in enumerate(lines) if "FAILURES" in line), out
    # printed once, as it came: the report does not repeat the ranks' output
    assert (out.count("rank 0 before the barrier") == 1
            and out.count("rank 1 saw the file") == 1), out
    assert "Captured stdout rank" not in out, out


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
