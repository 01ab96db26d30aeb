"""External mode: pytest itself was launched by torchrun (``torchrun --nproc_per_node=2 -m pytest
...``).

Every pytest process is one rank of an existing world (``WORLD_SIZE``/``RANK``/``MASTER_ADDR`` from
torchrun, one node or several). Nothing is spawned: the process group is initialised from the
environment (or reused when the test session already has one), all ranks check that they collected
the same tests, TP test bodies run in-process, and each test's per-rank outcomes are exchanged
through the job's key-value store so that every rank reaches the same verdict (a failure on rank 3
fails the test on rank 0, which is the only rank that prints a report). When ranks are still running
at the deadline, or a straggler grace after a peer failed, every unfinished rank posts its stack to
the store and rank 0 reports the test as failed (which ranks hung and where), reports every test
that did not run as an error and writes the JUnit file before every rank exits: torchrun then ends
the job, since a process group cannot be respawned from inside. When torchrun restarts the job
(``--max-restarts``), rank 0 instead records in torchrun's agent store how many tests are done and
how many failed; the restarted workers (``TORCHELASTIC_RESTART_COUNT``) rendezvous under keys of
their own attempt, skip the tests done and run the rest, and the session fails when an earlier
attempt's tests did.

Coverage (pytest-cov's ``--cov``): every rank is a pytest process with its own pytest-cov, which
would save, combine and report its own part, all at once in one directory. So on the other ranks
pytest-cov is taken out at configure time (:meth:`ExternalMode.gather_coverage_on_rank0`; its
measurement keeps running), and at the end of the test loop each of them sends its data through the
store (:meth:`ExternalMode.send_or_merge_coverage`); rank 0 adds it to its own before its pytest-cov
saves, combines and reports: one data file, one report, every rank's lines.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from .options import Settings
from .protocol import STRAGGLER_GRACE_S, RankOutcome


#: How long rank 0 waits, at the end of its test loop, for the other ranks' coverage data.
COVERAGE_WAIT_S = 60.0


def detect(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return ("WORLD_SIZE" in env and "RANK" in env
            and ("TORCHELASTIC_RUN_ID" in env or "MASTER_ADDR" in env))


class ExternalMode:
    def __init__(self, settings: Settings) -> None:
        import torch
        import torch.distributed as dist

        from .context import RankContext, set_current

        self.dist = dist
        self.torch = torch
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        backend = settings.backend
        if backend == "auto":
            # The same answer on every rank of a node (never NCCL on some ranks and gloo on others):
            # NCCL only when this node has a GPU for each of its local ranks. Nodes of one job are
            # assumed alike.
            enough = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
            backend = "nccl" if enough else "gloo"
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
        # the real stdout/stderr (pytest's capture and our own redirect fds 1 and 2 during a test):
        # a deadline puts them back so that rank 0's report reaches the terminal
        self.real_fds = (os.dup(1), os.dup(2))
        self.test_index = 0
        self.pdb_rank = settings.pdb_rank
        self.gathers_coverage = False  # pytest-cov measures: rank 0 reports every rank's lines
        self.owns_group = not dist.is_initialized()
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
        self.job_store: Any = None  # torchrun's agent store, one for every restart (None: unused)
        self.offset = 0  # tests of the session done in earlier attempts (skipped here)
        self.failed_earlier = 0  # tests that failed in earlier attempts
        if self.owns_group:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            # bounded: a rendezvous or collective that never completes fails after the test deadline
            # + 60 s under --tp-pdb the peers of a rank in pdb wait in their collectives for as long
            # as it may sit there
            from .debug import DEBUG_WAIT_S

            waits_s = settings.timeout_s if settings.pdb_rank is None else DEBUG_WAIT_S
            timeout = timedelta(seconds=waits_s + 60)
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                # torchrun's agent keeps one store for the whole job: a restarted worker that
                # rendezvoused with env:// would read the addresses of the previous attempt's (dead)
                # workers under the same keys (gloo: "connectFullMesh failed ... timed out
                # connecting"). Each attempt gets keys of its own.
                self.job_store = dist.TCPStore(os.environ["MASTER_ADDR"],
                                               int(os.environ["MASTER_PORT"]), world_size,
                                               is_master=False, timeout=timeout)
                store = dist.PrefixStore(f"tplogp/attempt{self.restart}", self.job_store)
                dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                        timeout=timeout)
                self._read_progress()
            else:
                dist.init_process_group(backend, init_method="env://", rank=rank,
                                        world_size=world_size, timeout=timeout)
        else:
            backend = dist.get_backend()
        ctrl = dist.new_group(backend="gloo") if backend != "gloo" else None
        self.ctx = RankContext(rank, world_size, backend, device, local_rank=local_rank,
                               external=True,
                               ctrl_group=ctrl)
        set_current(self.ctx)

    # -------------------------------------------------------- restarts (torchrun --max-restarts)
    RESUME_KEY = "tplogp/resume"  # in the job store: how many of the session's tests are done
    FAILED_KEY = "tplogp/failed"  # in the job store: how many of them failed

    def _read_progress(self) -> None:
        if self.restart == 0 or self.job_store is None:
            return
        if self.job_store.check([self.RESUME_KEY]):
            self.offset = int(self.job_store.get(self.RESUME_KEY))
            self.failed_earlier = int(self.job_store.add(self.FAILED_KEY, 0))

    @property
    def restarts_left(self) -> int:
        """How many more times torchrun restarts the job after this attempt ends in failure (0:
        none, or its store is not the agent's, where no progress could be kept)."""
        return max(0, self.max_restarts - self.restart) if self.job_store is not None else 0

    def record_progress(self, done: int, failed: int) -> None:
        """Rank 0, before an attempt that torchrun restarts ends: the session's first ``done`` tests
        (counted from the session's start) are reported; ``failed`` of them failed in this one."""
        self.job_store.set(self.RESUME_KEY, str(done))
        self.job_store.add(self.FAILED_KEY, failed)

    #: pytest-cov's plugin object's name (``pluginmanager.register(plugin, "_cov")``).
    PYTEST_COV = "_cov"

    def gather_coverage_on_rank0(self, pluginmanager: Any) -> None:
        """When pytest-cov measures, let rank 0 alone report: on the other ranks, take pytest-cov's
        plugin out (it neither saves, combines nor reports there; its ``Coverage`` keeps measuring,
        and its data goes to rank 0)."""
        from . import rank_coverage

        self.gathers_coverage = (pluginmanager.has_plugin(self.PYTEST_COV)
                                 and rank_coverage.measuring() is not None)
        if self.gathers_coverage and self.ctx.rank != 0:
            pluginmanager.unregister(name=self.PYTEST_COV)

    def send_or_merge_coverage(self, wait_s: float = COVERAGE_WAIT_S) -> list[int]:
        """End of the test loop, while gathering coverage: the other ranks stop measuring and post
        their data; rank 0 adds every rank's data to its own (bounded wait). Returns the ranks whose
        data did not come (rank 0)."""
        import time

        from . import rank_coverage

        store = self.store()
        if self.ctx.rank != 0:
            cov = rank_coverage.measuring()
            store.set(f"tplogp/coverage{self.ctx.rank}", rank_coverage.collect(cov)
                      if cov is not None else b"")
            return []
        pending = {r: f"tplogp/coverage{r}" for r in range(1, self.ctx.world_size)}
        deadline = time.monotonic() + wait_s
        while pending:
            for r, key in list(pending.items()):
                if store.check([key]):
                    blob = store.get(key)
                    if blob:
                        rank_coverage.merge(blob)
                    del pending[r]
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return sorted(pending)

    def check_collection(self, nodeids: list[str]) -> str | None:
        """None if every rank collected the same tests in the same order, else a description of the
        difference."""
        everyone = self.ctx.all_gather_object(nodeids)
        ref = everyone[0]
        for r, ids in enumerate(everyone[1:], start=1):
            if ids != ref:
                extra = sorted(set(ids) - set(ref))[:5]
                missing = sorted(set(ref) - set(ids))[:5]
                return (f"tplogp (torchrun): rank {r} collected different tests than rank 0 "
                        f"({len(ids)} vs {len(ref)}; extra on rank {r}: {extra}; missing on rank "
                        f"{r}: {missing}; or a different order). Every rank must run the same "
                        "tests with the same options.")
        return None

    def run_test(self, func: Callable[..., Any], kwargs: dict[str, Any], seed: int,
                 timeout_s: float,
                 capture: bool = True, on_hang: Callable[[Any], None] | None = None) -> Any:
        """Run the body here, exchange outcomes (and captured output) with every rank; return a
        PoolRun for ``report.merge``, so rank 0's report shows every rank's verdict and output.

        The exchange goes through the job's store, never through a collective: a rank that failed
        cannot pair its exchange with a collective that its peers still wait in (which would let
        them pass). When the ranks are not all done by the deadline, or a rank failed and the others
        are not done :data:`STRAGGLER_GRACE_S` later, :class:`_Exchange` takes over: every
        unfinished rank posts its stack, rank 0 calls ``on_hang(run)`` with what it knows (the
        finished ranks' outcomes, the others' stacks) and every rank exits.
        """
        import time

        from . import debug
        from .pool import PoolRun
        from .outcomes import classify
        from .rank_state import seed_test
        from .values import bind, undo_per_rank

        seed_test(seed)
        t0 = time.perf_counter()
        self.test_index += 1
        exchange = _Exchange(self, self.test_index, timeout_s, on_hang)
        with _capture_output(capture) as output:
            bound = {k: bind(v, self.ctx) for k, v in kwargs.items()}
            try:
                with debug.body(self.ctx.rank, self.pdb_rank, exchange.in_pdb):
                    func(**bound)
                mine = RankOutcome(self.ctx.rank, "passed")
            except BaseException as exc:  # noqa: BLE001 - decided collectively below
                mine = classify(exc, self.ctx.rank, test_file=getattr(func, "__code__", None)
                                and func.__code__.co_filename)
            finally:
                undo_per_rank(bound)
        mine.duration_s = time.perf_counter() - t0
        exchange.post(mine, output.text())
        everyone = exchange.collect()
        return PoolRun(outcomes={o.rank: o for o, _ in everyone},
                       outputs={o.rank: out for o, out in everyone if out != ("", "")},
                       elapsed_s=time.perf_counter() - t0)

    def restore_real_output(self) -> None:
        """Point fds 1 and 2 back at the terminal (used by a deadline, while a body is stuck)."""
        os.dup2(self.real_fds[0], 1)
        os.dup2(self.real_fds[1], 2)

    def store(self) -> Any:
        """The job's key-value store: the default group's (torchrun's rendezvous store), else a
        client of the store at ``MASTER_ADDR:MASTER_PORT`` that torchrun runs for every job."""
        try:
            return self.dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - private torch API: connect to torchrun's store ourselves
            return self.dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                      is_master=False,
                                      timeout=timedelta(seconds=60))

    def close(self) -> None:
        """Leave together (bounded): torchrun kills every rank as soon as one exits non-zero, so no
        rank may exit before rank 0 has printed its report."""
        if self.dist.is_initialized():
            from datetime import timedelta

            try:
                self.dist.monitored_barrier(group=self.ctx._ctrl_group,
                                            timeout=timedelta(seconds=120),
                                            wait_all_ranks=True)
            except Exception as exc:  # noqa: BLE001 - reported, the session is over anyway
                sys.stderr.write("tplogp (torchrun): final barrier failed on rank "
                                 f"{self.ctx.rank}: {exc}\n")
        if self.owns_group and self.dist.is_initialized():
            try:
                self.dist.destroy_process_group()
            except Exception:
                pass


#: After a hang: how long rank 0 waits for the stacks of the ranks that did not finish, and how long
#: the other ranks wait for rank 0's report before they exit (torchrun kills the job when the first
#: rank exits).
STACK_WAIT_S = 5.0
REPORT_WAIT_S = 60.0
#: How often a rank's watcher thread looks at the store while a test runs.
WATCH_POLL_S = 0.05


class _Exchange:
    """One test's outcome exchange under torchrun, through the job's store (keys
    ``tplogp/test<i>/...``).

    Every rank posts ``done<r>`` (its outcome and output) when its body returns, marks ``failed``
    when that outcome is not a pass, and waits until every rank has posted. A watcher thread per
    rank bounds that wait: rank 0 declares the test hung (``expired``) at the deadline, or
    :data:`STRAGGLER_GRACE_S` after a peer marked ``failed`` while some rank is still running (stuck
    in a collective the failed rank never entered); under ``--tp-pdb`` the grace is held while the
    debugged rank's ``in-pdb`` flag is up. Then every unfinished rank posts its stack
    (``stack<r>``), rank 0 hands the finished ranks' outcomes and the others' stacks to ``on_hang``
    (which reports and writes the JUnit file) and sets ``reported``, and every rank exits with
    status 1: a process group cannot be respawned from inside.
    """

    def __init__(self, mode: ExternalMode, index: int, timeout_s: float,
                 on_hang: Callable[[Any], None] | None) -> None:
        import time

        self.mode = mode
        self.rank, self.world_size = mode.ctx.rank, mode.ctx.world_size
        self.prefix = f"tplogp/test{index}/"
        self.timeout_s = timeout_s
        self.on_hang = on_hang
        self.store = mode.store()
        self.started = time.monotonic()
        self.lock = threading.Lock()
        # the main thread has every rank's outcome: nothing can expire any more
        self.collected = False
        self.expiring = False  # the watcher declared a hang: the process exits after the report
        self.body_finished = False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="tplogp-hang-watch", daemon=True)
        self.thread.start()

    def _key(self, name: str) -> str:
        return self.prefix + name

    def post(self, outcome: RankOutcome, output: tuple[str, str]) -> None:
        self.body_finished = True
        self.store.set(self._key(f"done{self.rank}"), pickle.dumps((outcome, output)))
        if outcome.outcome != "passed":
            self.store.add(self._key("failed"), 1)

    def collect(self) -> list[tuple[RankOutcome, tuple[str, str]]]:
        """Every rank's (outcome, output) in rank order, once all have posted; never returns when a
        hang was declared (the watcher thread ends the process)."""
        import time

        keys = [self._key(f"done{r}") for r in range(self.world_size)]
        pause = 0.0005
        while not self.store.check(keys):
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        with self.lock:
            if not self.expiring:
                self.collected = True
        if not self.collected:
            self.thread.join()  # the watcher reports (rank 0) and exits the process
            os._exit(1)
        self.done.set()
        return [pickle.loads(v) for v in self.store.multi_get(keys)]

    def in_pdb(self, on: bool) -> None:
        """The ``--tp-pdb`` rank's flag (key ``in-pdb``): set while it is in pdb, when no grace runs
        out."""
        self.store.set(self._key("in-pdb"), b"1" if on else b"0")

    def debugging(self) -> bool:
        """Whether the ``--tp-pdb`` rank is in pdb now."""
        key = self._key("in-pdb")
        return self.store.check([key]) and self.store.get(key) == b"1"

    def _watch(self) -> None:
        import time

        deadline = self.started + self.timeout_s
        grace_end: float | None = None
        while not self.done.wait(WATCH_POLL_S):
            now = time.monotonic()
            if self.rank == 0:
                if self.store.check([self._key("failed")]):
                    if self.debugging():
                        # held while the --tp-pdb rank is in pdb, counted again once it leaves
                        grace_end = None
                    elif grace_end is None:
                        grace_end = now + STRAGGLER_GRACE_S
                timed_out = now >= deadline
                if not (timed_out or (grace_end is not None and now >= grace_end)):
                    continue
                with self.lock:
                    if self.collected:
                        return
                    self.expiring = True
                self.store.set(self._key("expired"), b"deadline" if timed_out else b"grace")
            elif not (self.store.check([self._key("expired")]) or now >= deadline + REPORT_WAIT_S):
                continue
            else:
                with self.lock:
                    if self.collected:
                        return
                    self.expiring = True
            try:
                self._expire(timed_out=self.rank != 0 or timed_out)
            finally:
                os._exit(1)

    def _expire(self, timed_out: bool) -> None:
        import time

        from .pool import PoolRun, StuckRank

        store = self.store
        stack = "" if self.body_finished else _own_stack()
        if not self.body_finished:
            store.set(self._key(f"stack{self.rank}"), pickle.dumps((os.getpid(), stack)))
        if self.rank != 0:
            end = time.monotonic() + REPORT_WAIT_S
            while time.monotonic() < end and not store.check([self._key("reported")]):
                time.sleep(0.2)
            return
        run = PoolRun(timed_out=timed_out)
        end = time.monotonic() + STACK_WAIT_S
        for r in range(self.world_size):
            done, posted = self._key(f"done{r}"), self._key(f"stack{r}")
            while time.monotonic() < end and not store.check([done]) and not store.check([posted]):
                time.sleep(0.05)
            if store.check([done]):
                outcome, output = pickle.loads(store.get(done))
                run.outcomes[r] = outcome
                if output != ("", ""):
                    run.outputs[r] = output
            elif store.check([posted]):
                pid, their_stack = pickle.loads(store.get(posted))
                run.stuck[r] = StuckRank(r, pid, their_stack)
            else:
                run.stuck[r] = StuckRank(r, 0, "")
        run.elapsed_s = time.monotonic() - self.started
        self.mode.restore_real_output()
        try:
            if self.on_hang is not None:
                self.on_hang(run)
        finally:
            for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001
                    pass
            store.set(self._key("reported"), b"1")


def _own_stack() -> str:
    """Every thread's stack of this process, in faulthandler's format (what ``report.where_waiting``
    reads)."""
    with tempfile.TemporaryFile() as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read().decode("utf-8", "replace")


class _Captured:
    def __init__(self) -> None:
        self.files: tuple[Any, Any] | None = None

    def text(self) -> tuple[str, str]:
        if self.files is None:
            return ("", "")
        out = []
        for f in self.files:
            f.seek(0)
            out.append(f.read().decode("utf-8", "replace"))
            f.close()
        return (out[0], out[1])


@contextlib.contextmanager
def _capture_output(enabled: bool) -> Iterator[_Captured]:
    """Capture this rank's stdout/stderr (Python and fd level) during a body, inside pytest's own
    capture, so the text can travel to rank 0's report under this rank's name. Disabled under
    ``-s``."""
    cap = _Captured()
    if not enabled:
        yield cap
        return
    files = (tempfile.TemporaryFile(), tempfile.TemporaryFile())
    saved_sys = (sys.stdout, sys.stderr)
    for stream in saved_sys:
        stream.flush()
    saved_fds = (os.dup(1), os.dup(2))
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    # noqa: SIM115
    sys.stdout = open(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
    # noqa: SIM115
    sys.stderr = open(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    try:
        yield cap
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            stream.close()
        sys.stdout, sys.stderr = saved_sys
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        cap.files = files
