"""The fork server's first preload module: it dies with the pytest process that started it.

The rank pools' fork server (``pool.FORKSERVER_PRELOAD``) imports torch before it serves its first
fork, which takes seconds, and tens of seconds on a loaded machine. multiprocessing's fork server
notices that its parent is gone only in its serving loop, after that import, so a pytest process
that ends early (Ctrl-C while its first pool starts) would leave it running until the import is
done. Meanwhile it holds pytest's stdout and stderr (a CI step that pipes pytest's output waits for
it) and it still forks the rank that was asked for.

This module is imported first, before torch. When the controller starts ranks through the fork
server, it puts its own pid in ``TPLOGP_FORKSERVER_PARENT_PID`` (only while it starts them, and not
for spawned ranks); here that variable is taken out of the environment (the ranks, forks of this
process, do not see it) and the process asks the kernel for SIGKILL when its parent dies
(``PR_SET_PDEATHSIG``, Linux), then exits at once if the parent is already gone. The ranks use the
same mechanism with the fork server as their parent (:func:`set_pdeathsig`, which they import from
here), so pytest's death takes the whole tree down, whatever phase it is in. Anywhere else (the
variable unset, or this process is the controller itself) importing this module does nothing.
"""

from __future__ import annotations

import os
import signal
import sys

#: Environment variable carrying the controller's pid to the fork server it starts.
PARENT_PID_ENV = "TPLOGP_FORKSERVER_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def set_pdeathsig() -> None:
    """Ask the kernel to SIGKILL this process when its parent ends (``prctl(PR_SET_PDEATHSIG)``,
    Linux only).

    Best effort: elsewhere, or if the call fails, nothing happens (callers have a slower second line
    of defence). The request takes effect from now on: a parent that is already gone is not noticed,
    so callers then compare ``os.getppid()`` with the parent they expect.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except Exception:  # noqa: BLE001 - best effort, see above
            pass


def die_with_parent(expected_parent_pid: int) -> None:
    """Get SIGKILL when the parent process ends; exit now if the parent is not
    ``expected_parent_pid`` any more."""
    set_pdeathsig()  # if it fails, the fork server's own loop still ends it later
    if os.getppid() != expected_parent_pid:  # the parent died before the request took effect
        os._exit(0)


def _guard_this_process() -> None:
    value = os.environ.pop(PARENT_PID_ENV, None)
    if value is None or not value.isdigit() or int(value) == os.getpid():
        return
    die_with_parent(int(value))


_guard_this_process()
