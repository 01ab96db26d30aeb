"""A minimal spawn-per-call gloo harness for the operator's multi-rank tests (bounded waits, every rank checked).

``run_ranks(fn, world_size, *args, timeout_s=...)`` runs ``fn(rank, world_size, group, *args)`` on ``world_size``
spawned CPU processes joined through a FileStore in a fresh temp directory (no ports), and returns every rank's
return value or raises with every rank's exception. A rank still running at the deadline is a hang: the harness
kills all ranks and fails with that message.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def _entry(rank: int, world: int, store_path: str, fn: Callable, args: tuple, queue) -> None:
    import torch.distributed as dist

    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world, dist.group.WORLD, *args)
        queue.put((rank, "ok", result))
    except BaseException as exc:  # report every rank's failure to the parent
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


class RankFailures(AssertionError):
    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        body = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed:\n{body}")


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(r, world_size, store_path, fn, args, queue), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        import queue as _q
        import time

        deadline = time.monotonic() + timeout_s
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for p in procs:
                    p.kill()
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s}s (hang); "
                                   f"finished: {sorted(results)}, failed: {errors}")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except _q.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in results and r not in errors]
                for r in dead:
                    errors[r] = f"process died with exit code {procs[r].exitcode}"
                continue
            (results if status == "ok" else errors)[rank] = payload
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RankFailures(errors)
    return [results[r] for r in range(world_size)]
