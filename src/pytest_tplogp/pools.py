"""The pools of one pytest process: at most :data:`MAX_LIVE_POOLS` live
:class:`~pytest_tplogp.pool.RankPool` s, started on first use and restarted after a kill, and the
per-session directory they share (a killed session's directory is removed by the next session on the
machine).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections import OrderedDict

from .pool import PoolKey, PoolStartError, RankPool

#: At most this many pools stay alive per pytest process (least recently used stopped first).
MAX_LIVE_POOLS = 3


def remove_stale_session_dirs(root: str | None = None) -> list[str]:
    """Remove the session directories (``tplogp-<worker>-<pid>-*``) of pytest processes that are
    gone.

    A session removes its own directory when it ends; one that was killed (SIGKILL, a crashed xdist
    worker) could not, so the next session on the machine does. Returns the removed paths.
    """
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) < 4 or parts[0] != "tplogp" or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
            continue  # its pytest process is still running
        except ProcessLookupError:
            pass
        except OSError:
            continue  # another user's process: not ours to judge
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class PoolManager:
    """The pools of one pytest process, keyed by :class:`PoolKey`; owns the per-session
    directory."""

    def __init__(self, num_threads: int | None = None, start_method: str = "forkserver",
                 pdb_rank: int | None = None) -> None:
        self.start_method = start_method
        self.pdb_rank = pdb_rank
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        remove_stale_session_dirs()
        self.session_dir = tempfile.mkdtemp(prefix=f"tplogp-{worker}-{os.getpid()}-")
        self.num_threads = num_threads
        self.pools: OrderedDict[PoolKey, RankPool] = OrderedDict()
        self.start_errors: dict[PoolKey, str] = {}
        self.respawns = 0
        atexit.register(self.shutdown)

    def get(self, key: PoolKey) -> RankPool:
        """The live pool for ``key``, (re)started if needed. Raises :class:`PoolStartError`."""
        if key in self.start_errors:
            raise PoolStartError(self.start_errors[key]
                                 + "\n(an earlier start of this pool failed; not retried)")
        pool = self.pools.get(key)
        if pool is None:
            pool = RankPool(key, self.session_dir, self.num_threads, self.start_method,
                            self.pdb_rank)
            self.pools[key] = pool
        self.pools.move_to_end(key)
        while len([p for p in self.pools.values() if p.started]) > MAX_LIVE_POOLS:
            oldest = next(p for p in self.pools.values() if p.started)
            oldest.stop()
        if not pool.alive():
            if pool.started:
                pool.kill()
            if pool.starts:
                self.respawns += 1
            try:
                pool.start()
            except PoolStartError as exc:
                self.start_errors[key] = str(exc)
                raise
        return pool

    def stop_pools(self) -> None:
        """Stop every pool (coverage data comes back as they stop); the next use starts them
        again."""
        for pool in self.pools.values():
            try:
                pool.stop()
            except Exception:
                pool.kill()

    def shutdown(self) -> None:
        """Stop every pool and remove the session directory (at the session's end, or at exit)."""
        self.stop_pools()
        self.pools.clear()
        shutil.rmtree(self.session_dir, ignore_errors=True)
