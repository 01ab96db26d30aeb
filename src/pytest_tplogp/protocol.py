"""Messages between the controller (``pool.py``) and the ranks (``rank.py``).

Every message is a small picklable dataclass sent as one ``send_bytes`` frame over a per-rank pipe;
payloads that carry user objects (fixture values, ``tp_pool.run`` arguments and results) are pickled
separately so a value that does not pickle is reported against the right fixture instead of breaking
the channel. This module imports neither torch nor pytest.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

#: How long (seconds) the controller waits for the other ranks once one rank failed, died or skipped
#: alone before it treats them as stuck in a collective (dump stacks, kill, respawn).
STRAGGLER_GRACE_S = 3.0
#: Bounded wait for a whole pool to start (spawn, import torch, rendezvous).
START_TIMEOUT_S = 180.0
#: Bounded wait for a graceful pool stop before SIGKILL.
STOP_TIMEOUT_S = 5.0
#: Bounded wait for a pool stop while coverage is measured: each rank serializes its coverage data
#: first.
COVERAGE_STOP_TIMEOUT_S = 30.0


def rank_file(pool_dir: str, rank: int, suffix: str) -> str:
    """A rank's file in its pool directory, ``rank<r>.<suffix>``: ``out``, ``err`` (its output),
    ``stack`` (its faulthandler dumps), ``pdb`` (present while it is in pdb under ``--tp-pdb``)."""
    return os.path.join(pool_dir, f"rank{rank}.{suffix}")


@dataclass(frozen=True)
class RankConfig:
    """Everything a rank needs to start; pickled into the spawned process."""

    rank: int
    world_size: int
    backend: str  # "gloo" or "nccl"
    device_type: str  # "cpu" or "cuda"
    pool_dir: str  # per-pool-generation directory inside the per-session directory
    store_path: str  # FileStore path: rendezvous without any port
    parent_pid: int  # the pytest process (with forkserver, the OS parent is the fork server)
    num_threads: int | None = None
    start_method: str = "forkserver"
    # applied before torch touches a device (CUDA_VISIBLE_DEVICES)
    env: dict[str, str] = field(default_factory=dict)
    # --tp-pdb: the rank whose breakpoint() and failures open pdb on a local port
    pdb_rank: int | None = None
    # the pytest process's coverage settings (rank_coverage); None: not measured
    coverage: dict | None = None
    # CUDA ranks: this rank's device among the pool's GPUs (shared under gloo)
    device_index: int | None = None


    def path(self, suffix: str) -> str:
        return rank_file(self.pool_dir, self.rank, suffix)


@dataclass
class RunTest:
    """Run one test body, dispatched by node id: the rank imports the module and looks the function
    up."""

    nodeid: str
    module_name: str
    module_file: str
    qualname: str  # "test_fn" or "TestClass.test_method"
    kwargs: bytes  # pickled {argname: value}; values with __tp_bind__ are bound on the rank
    sys_path: list[str]
    seed: int
    code: bytes | None = None  # marshal of the parent's (assertion-rewritten) code object, if any
    # global name -> module name the code needs
    extra_globals: dict[str, str] = field(default_factory=dict)


@dataclass
class CallFn:
    """``tp_pool.run(fn, *args)``: call ``fn(tp, *args, **kwargs)`` on every rank."""

    payload: bytes  # pickled (fn, args, kwargs)
    modules: list[tuple[str, str]]  # (module name, file) to import before unpickling
    sys_path: list[str]
    seed: int


@dataclass
class RankOutcome:
    """One rank's result for one command."""

    rank: int
    outcome: str  # "passed" | "failed" | "skipped" | "xfailed"
    summary: str = ""  # one line: "AssertionError: assert 1 == 2" or the skip reason
    longrepr: str = ""  # traceback text (test frames only)
    # "module:qualname" of the exception a failed body raised (for xfail(raises=...))
    exc_type: str = ""
    # (file, line) of the failure: the innermost frame in the test's file
    crash: tuple[str, int] | None = None
    duration_s: float = 0.0
    value: bytes | None = None  # pickled return value of a CallFn
    # fresh-state check: what makes the pool recycle
    state_problems: list[str] = field(default_factory=list)
    # fresh-state check: what the rank changed and put back
    state_restored: list[str] = field(default_factory=list)
    collectives: object = None  # collectives.CollectiveCounts after the command (None: not taken)


@dataclass
class Ready:
    rank: int
    pid: int
    device: str
    startup_s: float


@dataclass
class RankCoverage:
    """A rank's last message when it measures coverage: its data (``CoverageData.dumps``), sent as
    it stops."""

    rank: int
    data: bytes


@dataclass
class StartFailed:
    rank: int
    error: str


def format_ranks(ranks: Sequence[int]) -> str:
    """``[1] -> 'rank 1'``, ``[0, 1, 2, 3] -> 'ranks 0-3'``, ``[0, 2, 3] -> 'ranks 0, 2-3'``."""
    rs = sorted(set(ranks))
    if len(rs) == 1:
        return f"rank {rs[0]}"
    parts: list[str] = []
    start = prev = rs[0]
    for r in rs[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ", ".join(parts)
