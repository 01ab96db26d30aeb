"""Debugging a TP body on one rank (rank-side; imports nothing of the controller).

A rank has no terminal: its stdin is not the user's and its output goes to files. So, while a body
runs:

- ``breakpoint()`` on the rank chosen with ``--tp-pdb=RANK`` stops in pdb served on a local TCP
  port, and a failure of the body on that rank opens a post-mortem pdb there. The rank announces the
  port on its stderr (printed live under ``-s``, which ``--tp-pdb`` requires): ``nc 127.0.0.1 PORT``
  from another terminal is the debugger.
- ``breakpoint()`` on the other ranks does nothing under ``--tp-pdb`` (they wait for the debugged
  rank in their next collective). Without ``--tp-pdb`` it raises :class:`DebuggerUnavailable`, whose
  message says how to debug, instead of pdb reading an empty stdin and raising a bare
  ``bdb.BdbQuit``.

``PYTHONBREAKPOINT`` (e.g. ``remote_pdb.set_trace``, or ``0``) takes precedence over both. While
``--tp-pdb`` is set the parent gives every test :data:`DEBUG_WAIT_S` instead of its deadline: a rank
in pdb is not a hang. The rank says when it is in pdb (``in_pdb(True)`` from the moment it serves
the port until the debugger leaves, a flag the parent reads): while it is, the straggler grace after
a failed peer is held; otherwise ranks left waiting in a collective are stuck as without
``--tp-pdb``.
"""

from __future__ import annotations

import bdb
import contextlib
import os
import pdb
import socket
import sys
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import Any


#: Under ``--tp-pdb``: the deadline of every test (a week; Ctrl-C ends the run).
DEBUG_WAIT_S = 7 * 24 * 3600.0


class DebuggerUnavailable(RuntimeError):
    """``breakpoint()`` was called on a rank that has no debugger."""


class DebuggerQuit(RuntimeError):
    """pdb's ``q`` on the ``--tp-pdb`` rank ended the body (in place of bdb's ``BdbQuit`` and its
    frames)."""


class _SocketPdb(pdb.Pdb):
    """pdb whose prompt and commands travel over one accepted TCP connection."""

    def __init__(self, conn: socket.socket, rank: int, in_pdb: Callable[[bool], None]) -> None:
        self._conn = conn
        self._in_pdb = in_pdb
        self._file = conn.makefile("rw", buffering=1, encoding="utf-8", errors="replace")
        super().__init__(stdin=self._file, stdout=self._file)
        self.use_rawinput = False
        self.prompt = f"(Pdb rank {rank}) "

    def close(self) -> None:
        for thing in (self._file, self._conn):
            try:
                thing.close()
            except OSError:
                pass
        self._in_pdb(False)

    def do_continue(self, arg: str) -> Any:
        result = super().do_continue(arg)
        if not self.breaks:  # nothing can stop here again: the session is over
            self.close()
        return result

    do_c = do_cont = do_continue

    def do_quit(self, arg: str) -> Any:
        result = super().do_quit(arg)
        self.close()
        return result

    do_q = do_exit = do_quit


def _serve(rank: int, why: str, where: str, in_pdb: Callable[[bool], None]) -> _SocketPdb:
    """Wait on a local port until a debugger connects; the port is announced on this rank's
    stderr."""
    in_pdb(True)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    sys.stderr.write(f"tplogp: rank {rank} stopped in pdb ({why} at {where}); connect from another "
                     f"terminal: nc 127.0.0.1 {port}\n")
    sys.stderr.flush()
    with server:
        conn, _ = server.accept()
    return _SocketPdb(conn, rank, in_pdb)


def _where(frame: FrameType | None) -> str:
    return ("?" if frame is None
            else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}")


def _quit_where(tb: TracebackType | None) -> str:
    """Where pdb's ``q`` stopped the body: the innermost frame outside bdb and pdb."""
    frame = None
    while tb is not None:
        if os.path.basename(tb.tb_frame.f_code.co_filename) not in ("bdb.py", "pdb.py"):
            frame = tb.tb_frame
        tb = tb.tb_next
    return _where(frame)


def flag_file(path: str) -> Callable[[bool], None]:
    """An ``in_pdb`` flag kept as a file (present while up): how a pool's rank tells its parent
    (``pool.py``)."""

    def in_pdb(on: bool) -> None:
        if on:
            open(path, "w").close()
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    return in_pdb


@contextlib.contextmanager
def body(rank: int, pdb_rank: int | None, in_pdb: Callable[[bool], None]) -> Iterator[None]:
    """Around a test body on a rank: ``breakpoint()`` as the module docstring says, and the
    post-mortem of a failure on the ``--tp-pdb`` rank (the exception then propagates as before;
    ``q`` at a breakpoint becomes :class:`DebuggerQuit`). ``in_pdb(on)`` raises and lowers the flag
    that holds the straggler grace (lowered at the latest when the body ends)."""
    if os.environ.get("PYTHONBREAKPOINT"):
        yield
        return

    def hook(*args: Any, **kwargs: Any) -> None:
        frame = sys._getframe(1)
        if pdb_rank is None:
            raise DebuggerUnavailable(
                f"breakpoint() at {_where(frame)}: a TP body runs in rank processes, which have no "
                "terminal. To stop there in pdb on rank R, run with -s --tp-pdb=R: that rank "
                "serves pdb on a local port and prints it (PYTHONBREAKPOINT, e.g. "
                "remote_pdb.set_trace, is honoured too)")
        if rank == pdb_rank:
            _serve(rank, "breakpoint()", _where(frame), in_pdb).set_trace(frame)
        # the other ranks go on, and wait for the debugged one in their next collective

    saved = sys.breakpointhook
    sys.breakpointhook = hook
    try:
        yield
    except BaseException as exc:
        if rank == pdb_rank and isinstance(exc, bdb.BdbQuit):
            raise DebuggerQuit(f"quit the debugger at {_quit_where(exc.__traceback__)}") from None
        if (rank == pdb_rank and isinstance(exc, Exception)
            and not isinstance(exc, DebuggerUnavailable)):
            post_mortem(rank, exc, in_pdb)
        raise
    finally:
        sys.breakpointhook = saved
        if rank == pdb_rank:
            in_pdb(False)  # a session left open (`c` with breakpoints set) ends with the body


def post_mortem(rank: int, exc: BaseException, in_pdb: Callable[[bool], None]) -> None:
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = _where(tb.tb_frame) if tb is not None else "?"
    debugger = _serve(rank, f"post-mortem: {type(exc).__name__}: {exc}".splitlines()[0], where,
                      in_pdb)
    try:
        debugger.reset()
        debugger.interaction(None, exc.__traceback__)
    finally:
        debugger.close()
