"""Debugging a TP body: breakpoint() says how without --tp-pdb, --tp-pdb=RANK serves pdb on a local
port (a breakpoint and a post-mortem), --pdb says where the ranks' failure is."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest

from pytest_tplogp.protocol import STRAGGLER_GRACE_S

pytest_plugins = ["pytester"]

PROMPT = "(Pdb rank 1) "

BODY = '''
import pytest
import torch.distributed as dist

@pytest.mark.tp
def test_stops(tp):
    value = 40 + tp.rank
    breakpoint()
    dist.barrier()
    assert value in (40, 41)

@pytest.mark.tp
def test_fails_on_rank_1(tp):
    local = f"rank-{tp.rank}-local"
    assert tp.rank == 0

@pytest.mark.tp
def test_peer_fails_first(tp):
    if tp.rank == 0:
        raise RuntimeError("rank 0 fails first")
    breakpoint()
    dist.barrier()

@pytest.mark.tp
def test_debugged_rank_waits(tp):
    if tp.rank == 0:
        raise RuntimeError("rank 0 fails before the collective")
    dist.barrier()

@pytest.mark.tp
def test_collectives_wait_as_long_as_pdb(tp):
    import torch
    group = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert group.options._timeout.days >= 7, group.options._timeout
'''


def test_tp_pdb_needs_s(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body=BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "--tp-pdb=1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*pytest_tplogp: --tp-pdb=1 (or TPLOGP_TP_PDB, ini tp_pdb) needs "
                                 "-s*"])


class _Lines:
    """The lines of a running pytest's stdout, read by a thread as they come (a wait for a line is
    bounded)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        import queue
        import threading

        self.seen: list[str] = []
        self.queue: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.queue.put(line.rstrip("\n"))
            self.queue.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def until(self, pattern: str, timeout_s: float = 180) -> re.Match:
        import queue

        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            try:
                line = self.queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(self.seen))


def _debug(port: int, commands: list[tuple[str | None, str]]) -> str:
    """Connect to a rank's pdb, send each command and read until its expected text (in what came
    after the command) and the next prompt; after the last command (``c`` or ``q``) read until the
    rank closes the connection, so nothing is left unread (a close with unread data resets the
    connection, and the rank could lose the command). A command ``None`` holds the session open,
    idle, for longer than the straggler grace. Returns the conversation."""
    text = ""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        for i, (command, expect) in enumerate(commands):
            if command is None:  # hold the session open for longer than the straggler grace
                time.sleep(STRAGGLER_GRACE_S + 0.5)
                continue
            last = i == len(commands) - 1
            start = len(text)
            if command:
                conn.sendall(command.encode() + b"\n")
            if last and command:
                conn.shutdown(socket.SHUT_WR)
            while True:
                answer = text[start:]
                if not last and expect in answer and answer.endswith(PROMPT):
                    break
                data = conn.recv(4096)
                if not data:
                    break
                text += data.decode()
            assert expect in text[start:], f"{command!r}: no {expect!r} in {text[start:]!r}"
    return text


@pytest.mark.slow
def test_tp_pdb_breakpoint_and_post_mortem(pytester: pytest.Pytester, tag: str) -> None:
    """Rank 1 stops at breakpoint() (rank 0 waits for it in the barrier), answers `p value`,
    continues, and the test passes; then rank 1's failure opens a post-mortem that sees the body's
    locals, and the test fails. The straggler grace after a failed peer is held while rank 1 is in
    pdb (it still answers after longer than the grace, and `q` fails it), and runs as usual while
    rank 1 waits in a collective outside pdb."""
    pytester.makepyfile(test_body=BODY)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "pytest_tplogp", "-p",
                             "no:cacheprovider", "-s",
                             "-v", "--tp-pdb=1", "test_body.py"], cwd=pytester.path,
                             stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = _Lines(proc)
    try:
        m = lines.until(r"\[rank 1\] tplogp: rank 1 stopped in pdb \(breakpoint\(\) at "
                        r"test_body\.py:7\); connect from another terminal: nc 127\.0\.0\.1 (\d+)")
        talk = _debug(int(m.group(1)), [("", PROMPT), ("p f'value={value}'", "'value=41'"),
                                        ("c", "")])
        # stopped in the body, on the line after
        assert "test_body.py(8)test_stops()" in talk, talk
        # (-s -v: the verdict follows the ranks' lines)
        lines.until(r"^PASSED$")
        m = lines.until(r"\[rank 1\] tplogp: rank 1 stopped in pdb \(post-mortem: AssertionError: "
                        r"assert 1 == 0.* at test_body\.py:14\); connect from another terminal: nc "
                        r"127\.0\.0\.1 (\d+)")
        _debug(int(m.group(1)), [("", PROMPT), ("p local", "'rank-1-local'"), ("q", "")])
        m = lines.until(r"\[rank 1\] tplogp: rank 1 stopped in pdb \(breakpoint\(\) at "
                        r"test_body\.py:20\); connect from another terminal: nc 127\.0\.0\.1 (\d+)")
        before_quit = "\n".join(lines.seen)
        # None: past the grace
        _debug(int(m.group(1)), [("", PROMPT), (None, ""), ("p 6 * 7", "42"), ("q", "")])
        lines.until(r"rank 0: RuntimeError: rank 0 fails first")
        # test_debugged_rank_waits
        lines.until(r"rank 1 did not finish within 3 s after a peer failed")
        lines.until(r"3 failed, 2 passed", timeout_s=60)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out = "\n".join(lines.seen)
    assert "BdbQuit" not in before_quit and "rank 1: AssertionError: assert 1 == 0" in out, out
    held = out[out.index("test_peer_fails_first[tp2] _"):out.index(
        "test_debugged_rank_waits[tp2] _")]
    assert "did not finish within" not in held, held  # in pdb past the grace: not stuck
    assert ("rank 1: pytest_tplogp.debug.DebuggerQuit: quit the debugger at test_body.py:21"
            in held), held
    assert "bdb.py" not in held, held
    assert "no deadline (--tp-pdb=1)" in out, out


@pytest.mark.slow
def test_breakpoint_says_how_and_pytest_pdb_names_the_ranks_failure(pytester: pytest.Pytester,
                                                                   tag: str) -> None:
    """breakpoint() in a body without --tp-pdb fails the test on every rank, saying how to stop
    there (no BdbQuit). pytest's --pdb opens in this process: it first says where the ranks' failure
    is and how to debug it there; the pdb session has the merged verdict at hand."""
    pytester.makepyfile(test_body=BODY)
    result = pytester.run(sys.executable, "-m", "pytest", "-p", "pytest_tplogp", "-p",
                          "no:cacheprovider", "--pdb", "-rf", "-vv", "test_body.py::test_stops",
                          "test_body.py::test_fails_on_rank_1",
                          stdin=b"p verdict.headline\nc\np verdict.headline\nc\n", timeout=180)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "FAILED test_body.py::test_stops[[]tp2[]] - ranks 0-1: "
        "pytest_tplogp.debug.DebuggerUnavailable: breakpoint() at test_body.py:7: a TP body runs "
        "in rank processes, which have no terminal. To stop there in pdb on rank R, run with -s "
        "--tp-pdb=R*",
    ])
    assert "BdbQuit" not in result.stdout.str()
    result.stdout.fnmatch_lines([
        "tplogp: test_body.py::test_fails_on_rank_1[[]tp2[]] failed on the ranks at "
        "*test_body.py:14 (rank 1: AssertionError: assert 1 == 0). The body ran in the rank "
        "processes, so pytest's --pdb opens below in this process's dispatch code*To debug the "
        "body on rank 1, rerun it with -s --tp-pdb=1.",
    ])
    result.stdout.fnmatch_lines(["*'rank 1: AssertionError: assert 1 == 0'*"])
