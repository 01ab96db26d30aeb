"""The controller: persistent rank pools, bounded waits, stack dumps, kill and respawn.

One :class:`RankPool` per (world size, backend, device set) lives in each pytest process (each xdist
worker has its own), created lazily on first use through ``multiprocessing`` (pytest's own process
never imports torch): by default every rank is a fork of one fork server per pytest process, which
imported torch once and never touches CUDA (``--tp-start-method=spawn``: a fresh interpreter per
rank). Rendezvous is a ``FileStore`` in a per-pool-generation directory under a per-session temp
directory (``tplogp-<worker>-<pid>-*``, removed at the end; a killed session's is removed by the
next one), so nothing can race for a port. Each command is sent to every rank over its own pipe and
awaited with ``multiprocessing.connection.wait`` on the pipes *and* the process sentinels, until a
deadline:

- all ranks answer: their :class:`RankOutcome` s come back (the fresh-state verdict included);
- a rank fails, skips alone or dies: the others get :data:`STRAGGLER_GRACE_S` to finish, else they
  are stuck (under ``--tp-pdb`` the grace is held while the debugged rank is in pdb: its
  ``rank<r>.pdb`` flag file);
- the deadline passes: stuck ranks are stuck.

Stuck ranks get SIGUSR1 (faulthandler dumps every thread's stack to the rank's stack file) and then
the pool is killed (SIGKILL to every rank's process group, bounded joins) and respawned on next use.
The same happens when a rank died or the fresh-state check failed. Nothing here waits without a
timeout.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Iterator, NamedTuple

from . import collectives, rank_coverage
from .rank_files import LIVE_POLL_S, LiveOutput, Tail, file_size, read_from
from .protocol import (
    COVERAGE_STOP_TIMEOUT_S,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    STRAGGLER_GRACE_S,
    RankConfig,
    RankCoverage,
    RankOutcome,
    Ready,
    StartFailed,
    rank_file,
)

#: Modules the fork server imports before forking ranks (start method "forkserver"); the guard
#: first, so that the fork server dies with pytest even while it still imports torch.
#: ``torch.distributed.tensor`` is what the first
#: ``torch.testing.assert_close`` (so the first ``tp.assert_close``) of a process imports: imported
#: here once, no pool pays it in its first test. It touches no device and starts no thread.
FORKSERVER_PRELOAD = ["pytest_tplogp.forkserver_guard", "torch", "torch.distributed",
                      "torch.distributed.tensor",
                      "pytest", "pytest_tplogp.rank", "pytest_tplogp.context"]


class PoolKey(NamedTuple):
    world_size: int
    backend: str
    devices: tuple[str, ...]  # physical GPU ids (CUDA_VISIBLE_DEVICES entries), or ("cpu",)

    @property
    def device_type(self) -> str:
        return "cpu" if self.devices == ("cpu",) else "cuda"

    @property
    def shared(self) -> bool:
        """Gloo ranks on GPUs: rank r uses ``devices[r % len(devices)]`` (several ranks per GPU when
        fewer GPUs)."""
        return self.device_type == "cuda" and self.backend == "gloo"

    def device_index(self, rank: int) -> int:
        """Rank ``rank``'s CUDA device index among the pool's GPUs (the pool's
        ``CUDA_VISIBLE_DEVICES``)."""
        return rank % len(self.devices)

    def describe(self) -> str:
        devs = "cpu" if self.device_type == "cpu" else "cuda:" + ",".join(self.devices)
        if self.shared:
            devs = f"{self.world_size} ranks sharing {devs}"
        return f"world size {self.world_size}, {self.backend}, {devs}"


class PoolStartError(RuntimeError):
    """The pool could not start (rendezvous, import or device error); the message carries every
    rank's stderr."""


@dataclass
class StuckRank:
    rank: int
    pid: int
    stack: str  # faulthandler dump (may be empty if the rank did not answer SIGUSR1)


@dataclass
class PoolRun:
    """Everything the controller learned from one command on every rank."""

    outcomes: dict[int, RankOutcome] = field(default_factory=dict)
    deaths: dict[int, str] = field(default_factory=dict)  # rank -> "was killed by SIGKILL ..."
    death_stacks: dict[int, str] = field(default_factory=dict)  # fatal-signal dumps of dead ranks
    stuck: dict[int, StuckRank] = field(default_factory=dict)
    timed_out: bool = False  # the deadline (not just the straggler grace) passed
    # rank -> (stdout, stderr) of this command
    outputs: dict[int, tuple[str, str]] = field(default_factory=dict)
    elapsed_s: float = 0.0
    killed: str | None = None  # why the pool was killed after this command (None: still alive)
    unmatched: str = ""  # collectives left unmatched (collectives.unmatched): fails the test


def describe_exit(exitcode: int | None) -> str:
    """How a rank ended, after ``rank N``: ``was killed by SIGKILL (signal 9)``, ``exited ...``."""
    if exitcode is None:
        return "exited (exit code unknown)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by {name} (signal {-exitcode})"
    return f"exited with code {exitcode} (os._exit/sys.exit inside the test?)"


#: Bounded wait for a dead rank's exit status (under forkserver it comes through the fork server,
#: after the rank's pipe already broke): long enough that a loaded machine still names the signal.
EXIT_STATUS_WAIT_S = 5.0


class RankPool:
    """A persistent pool of ``key.world_size`` rank processes (see the module docstring)."""

    def __init__(self, key: PoolKey, session_dir: str, num_threads: int | None = None,
                 start_method: str = "forkserver", pdb_rank: int | None = None) -> None:
        self.key = key
        self.pdb_rank = pdb_rank
        self.start_method = start_method
        self.session_dir = session_dir
        self.num_threads = num_threads
        self.generation = 0
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.pool_dir = ""
        self.start_s = 0.0
        self.starts = 0
        # starting, or a command in flight (e.g. interrupted by Ctrl-C): stop() kills at once
        self.busy = False
        # this generation's coverage settings (None: not measured)
        self.coverage: dict | None = None

    # ------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool:
        return bool(self.procs)

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def _cfg(self, rank: int) -> RankConfig:
        return RankConfig(rank=rank, world_size=self.key.world_size, backend=self.key.backend,
                          device_type=self.key.device_type, pool_dir=self.pool_dir,
                          store_path=os.path.join(self.pool_dir, "store"), parent_pid=os.getpid(),
                          num_threads=self.num_threads or self._default_threads(),
                          start_method=self.start_method, env=self._env(), pdb_rank=self.pdb_rank,
                          coverage=self.coverage,
                          device_index=self.key.device_index(rank) if self.key.device_type == "cuda"
                          else None)

    def _env(self) -> dict[str, str]:
        return ({"CUDA_VISIBLE_DEVICES": ",".join(self.key.devices)}
                if self.key.device_type == "cuda" else {})

    def _default_threads(self) -> int | None:
        """CPU ranks share the cores (cores // world size torch threads each); GPU ranks keep
        torch's default."""
        if self.key.device_type != "cpu":
            return None
        return max(1, (os.cpu_count() or 1) // self.key.world_size)

    def start(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Spawn the ranks and wait (bounded) until every one has joined the process group. Returns
        seconds."""
        # not torch's wrapper: nothing but plain values crosses the pipes, and pytest's
        import multiprocessing
        # own process then never imports torch (a second or more of CPU for every pytest run on a
        # small machine)

        from .forkserver_guard import PARENT_PID_ENV
        from .rank import rank_main

        t0 = time.perf_counter()
        # until every rank is ready: an interrupted start is killed, not asked to stop
        self.busy = True
        self.generation += 1
        self.coverage = rank_coverage.parent_settings()
        devices = "-".join(self.key.devices)
        tag = f"ws{self.key.world_size}-{self.key.backend}-{devices}-g{self.generation}"
        self.pool_dir = os.path.join(self.session_dir, tag)
        os.makedirs(self.pool_dir, exist_ok=True)
        ctx = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            # One fork server per pytest process imports torch once; every rank of every pool (and
            # every respawn) is then a fork of it. It never touches CUDA (importing torch does not),
            # so CUDA in the ranks is safe.
            ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        env = self._env()
        # for a fork server started now (a spawned rank must not see it)
        if self.start_method == "forkserver":
            env[PARENT_PID_ENV] = str(os.getpid())
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            for r in range(self.key.world_size):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=rank_main, args=(self._cfg(r), child),
                                   # type: ignore[attr-defined]
                                   name=f"tplogp-rank{r}", daemon=False)
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.starts += 1
        pending = set(range(self.key.world_size))
        deadline = time.monotonic() + timeout_s
        problem: str | None = None
        for r, msg in self._arrivals(pending, deadline):
            if isinstance(msg, Ready):
                pending.discard(r)
            elif isinstance(msg, StartFailed):
                problem = f"rank {r} failed to start:\n{msg.error}"
                break
            elif not self.procs[r].is_alive() or msg is None:
                self.procs[r].join(0.5)
                problem = f"rank {r} {describe_exit(self.procs[r].exitcode)} during start"
                break
        if problem is None and pending:
            problem = f"ranks did not join within {timeout_s:.0f} s"
        if problem is not None:
            errs = "\n".join(f"--- rank {r} stderr "
                             f"---\n{read_from(rank_file(self.pool_dir, r, 'err'), 0)}"
                             for r in range(self.key.world_size))
            self.kill()
            raise PoolStartError(f"tplogp pool ({self.key.describe()}) could not start: "
                                 f"{problem}\n{errs}")
        self.busy = False
        self.start_s = time.perf_counter() - t0
        return self.start_s

    def kill(self) -> None:
        """SIGKILL every rank's process group, reap with bounded joins, close the pipes."""
        for p in self.procs:
            if p.pid is None:
                continue
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, OSError):
                pass
            try:
                p.kill()
            except Exception:
                pass
        for p in self.procs:
            p.join(5.0)
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass
        self.procs, self.conns = [], []
        self.busy = False

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask the ranks to leave (bounded), then kill whatever is left. Ranks that measure coverage
        send their data as they leave: it is added to this process's coverage."""
        if not self.procs:
            return
        if self.busy:
            self.kill()
            return
        for c in self.conns:
            try:
                c.send_bytes(pickle.dumps("stop"))
            except (OSError, ValueError):
                pass
        if self.coverage is not None:
            timeout_s = max(timeout_s, COVERAGE_STOP_TIMEOUT_S)
        deadline = time.monotonic() + timeout_s
        if self.coverage is not None:
            self._merge_coverage(deadline)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def _merge_coverage(self, deadline: float) -> None:
        """Receive each leaving rank's coverage data (bounded) and add it to this process's
        coverage."""
        pending = set(range(len(self.procs)))
        for r, msg in self._arrivals(pending, deadline):
            # one message at most: the data, or nothing from a rank that left without it
            pending.discard(r)
            if isinstance(msg, RankCoverage):
                rank_coverage.merge(msg.data)

    def _arrivals(self, pending: set, deadline: float) -> Iterator[tuple[int, Any]]:
        """``(rank, message or None)`` each time a rank of ``pending`` sends a message or exits
        (None: it exited or its pipe broke), until ``pending`` is empty or ``deadline`` (monotonic)
        passes. The caller updates ``pending``; a rank it removed is not reported again."""
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            waitables = {self.conns[r]: r for r in pending}
            waitables.update({self.procs[r].sentinel: r for r in pending})
            for obj in wait(list(waitables), timeout=min(remaining, 1.0)):
                r = waitables[obj]
                if r not in pending:
                    continue
                try:
                    msg = (pickle.loads(self.conns[r].recv_bytes()) if self.conns[r].poll(0)
                           else None)
                except (EOFError, OSError):
                    msg = None
                yield r, msg

    # ------------------------------------------------------------ commands
    def _paths(self, r: int) -> tuple[str, str, str]:
        # type: ignore[return-value]
        return tuple(rank_file(self.pool_dir, r, s) for s in ("out", "err", "stack"))

    def dump_stacks(self, ranks: list[int], wait_s: float = 3.0) -> dict[int, str]:
        """SIGUSR1 to ``ranks`` (faulthandler) and collect the dumps, waiting (bounded) for them to
        settle."""
        offsets = {r: file_size(self._paths(r)[2]) for r in ranks}
        for r in ranks:
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except (ProcessLookupError, OSError):
                pass
        deadline = time.monotonic() + wait_s
        last: dict[int, int] = {}
        while time.monotonic() < deadline:
            sizes = {r: file_size(self._paths(r)[2]) for r in ranks}
            if all(sizes[r] > offsets[r] for r in ranks) and sizes == last:
                break
            last = sizes
            time.sleep(0.05)
        return {r: read_from(self._paths(r)[2], offsets[r]) for r in ranks}

    def run(self, command: Any, timeout_s: float, live: LiveOutput | None = None) -> PoolRun:
        """Send ``command`` to every rank and collect the outcomes within ``timeout_s`` (see the
        module docstring).

        With ``live`` (pytest ``-s``), every complete line a rank writes is passed on while the
        command runs.
        """
        # stays True if interrupted (Ctrl-C): the ranks are mid-command, stop() must kill
        self.busy = True
        res = self._run(command, timeout_s, live)
        self.busy = False
        return res

    def _run(self, command: Any, timeout_s: float, live: LiveOutput | None) -> PoolRun:
        t0 = time.perf_counter()
        n = self.key.world_size
        res = PoolRun()
        offsets = {r: tuple(file_size(p) for p in self._paths(r)) for r in range(n)}
        tail = Tail(live, {(r, s): (self._paths(r)[i], offsets[r][i]) for r in range(n)
                            for i, s in enumerate(
                                ("stdout", "stderr"))}) if live is not None else None
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        pending = set(range(n))

        def died(r: int) -> None:
            self.procs[r].join(EXIT_STATUS_WAIT_S)
            res.deaths[r] = describe_exit(self.procs[r].exitcode)
            pending.discard(r)

        for r in range(n):
            try:
                self.conns[r].send_bytes(data)
            except (OSError, ValueError):
                died(r)
        deadline = time.monotonic() + timeout_s
        peer_failed = bool(res.deaths)
        grace_end: float | None = None
        pdb_flag = None if self.pdb_rank is None else rank_file(self.pool_dir, self.pdb_rank, "pdb")
        while pending:
            if peer_failed:
                if pdb_flag is not None and self.pdb_rank in pending and os.path.exists(pdb_flag):
                    # the --tp-pdb rank is in pdb: held, and counted again once it leaves
                    grace_end = None
                elif grace_end is None:
                    grace_end = time.monotonic() + STRAGGLER_GRACE_S
            now = time.monotonic()
            limit = deadline if grace_end is None else min(deadline, grace_end)
            if now >= limit:
                res.timed_out = now >= deadline
                break
            waitables = {self.conns[r]: r for r in pending}
            waitables.update({self.procs[r].sentinel: r for r in pending})
            # live output to pass on, or the pdb flag to read
            polls = tail is not None or pdb_flag is not None
            ready = wait(list(waitables), timeout=min(limit - now, LIVE_POLL_S) if polls
                         else limit - now)
            if tail:
                tail.pump()
            for obj in ready:
                r = waitables[obj]
                if r not in pending:
                    continue
                out: RankOutcome | None = None
                if self.conns[r].poll(0):
                    try:
                        out = pickle.loads(self.conns[r].recv_bytes())
                    except (EOFError, OSError):
                        out = None
                if out is None:
                    died(r)
                else:
                    res.outcomes[r] = out
                    pending.discard(r)
                    if out.outcome == "passed":
                        continue
                peer_failed = True
        if tail:
            tail.pump(final=True)
        if pending:
            alive = [r for r in sorted(pending) if self.procs[r].is_alive()]
            stacks = self.dump_stacks(alive)
            for r in sorted(pending):
                res.stuck[r] = StuckRank(r, self.procs[r].pid, stacks.get(r, ""))
        for r in res.deaths:
            res.death_stacks[r] = read_from(self._paths(r)[2], offsets[r][2])
        for r in range(n):
            out_p, err_p, _ = self._paths(r)
            res.outputs[r] = (read_from(out_p, offsets[r][0]), read_from(err_p, offsets[r][1]))
        problems = sorted({p for o in res.outcomes.values() for p in o.state_problems})
        if not (res.stuck or res.deaths):
            counts = {r: o.collectives for r, o in res.outcomes.items() if o.collectives}
            res.unmatched = collectives.unmatched(counts, n)
            if res.unmatched:
                problems.insert(0, "collective(s) left unmatched")
        if res.stuck or res.deaths:
            what = "timed out" if res.timed_out else ("died" if res.deaths else "stuck")
            res.killed = f"ranks {what}"
        elif problems:
            res.killed = "fresh-state check failed: " + "; ".join(problems)
        if res.killed and problems and not (res.stuck or res.deaths) and self.coverage is not None:
            # every rank answered: ask them to leave, so that their coverage data comes back
            self.busy = False
            self.stop()
        elif res.killed:
            self.kill()
        res.elapsed_s = time.perf_counter() - t0
        return res
