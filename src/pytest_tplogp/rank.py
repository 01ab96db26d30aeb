"""Rank-side worker: one process of a pool. Imports nothing of the controller.

Life of a rank (started by ``pool.py`` through ``multiprocessing``, forkserver by default, or
spawn):

1. Own process group (``setpgid``) so the controller can kill the rank's whole tree and a terminal
   Ctrl-C reaches only pytest; ``PR_SET_PDEATHSIG`` = SIGKILL so the rank dies with pytest even if
   pytest is SIGKILLed.
2. fd 1/2 go to per-rank files (the controller slices them per test: per-rank captured output, also
   after a hang); ``faulthandler`` dumps every thread's stack to a per-rank file on SIGUSR1 (works
   while a collective holds the GIL) and on fatal signals. When the pytest process measures
   coverage, the rank starts measuring with its settings (``rank_coverage``).
3. Rendezvous through a ``FileStore`` in the per-session directory (no port at all),
   ``init_process_group``; under NCCL a gloo control group for object exchange. Then ``Ready`` is
   sent.
4. Serve commands until ``stop`` or EOF: ``RunTest`` (import the module by file, look the function
   up by its qualified name, rebuild it from the parent's assertion-rewritten code object, bind
   fixture values, seed, call) and ``CallFn`` (``tp_pool.run``). Every command answers one
   :class:`RankOutcome`, which carries the result of a cheap fresh-state check: what the test
   changed in the process (environment, working directory, default dtype, grad mode, torch threads,
   deterministic algorithms) is restored and named; process groups left behind, a dead default group
   or CUDA memory held by live tensors (``cuda_memory``) recycle the pool. It also carries the
   rank's collective counts (``collectives``), from which the controller finds a collective left
   unmatched.
5. Leave: send the coverage data (when measured) as the last message, destroy the process group, run
   multiprocessing's exit finalizers (named semaphores made on the rank are released, not reported
   leaked by the resource tracker at the end of the session), then ``os._exit`` (no interpreter
   teardown).
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import marshal
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import types
from typing import Any

from . import collectives, cuda_memory, debug
from .outcomes import classify
from .rank_state import ProcessState, groups_kept_for_the_process, live_groups, seed_test
from .forkserver_guard import set_pdeathsig
from .protocol import CallFn, RankConfig, RankCoverage, RankOutcome, Ready, RunTest, StartFailed

_KEEP: list[Any] = []  # files that must stay open for faulthandler


def _isolate(cfg: RankConfig) -> None:
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    set_pdeathsig()
    # pytest died before prctl took effect
    if cfg.start_method == "spawn" and os.getppid() != cfg.parent_pid:
        os._exit(1)
    if cfg.start_method == "forkserver":
        # Our OS parent is the fork server, which exits when pytest does, unless its children keep
        # the "alive" pipe open: multiprocessing hands every child that pipe's write end. Close our
        # copy so that the chain pytest dies -> fork server exits -> PDEATHSIG kills us works
        # (kernel-level, GIL-independent).
        server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
        fd = getattr(server, "_forkserver_alive_fd", None)
        if isinstance(fd, int):
            try:
                os.close(fd)
            except OSError:
                pass
            server._forkserver_alive_fd = None  # type: ignore[union-attr]
    # Belt and braces: a watchdog thread that takes the rank's process group down when pytest is
    # gone.
    threading.Thread(target=_watch_parent, args=(cfg.parent_pid,), name="tplogp-parent-watchdog",
                     daemon=True).start()


def _watch_parent(pid: int) -> None:
    while True:
        time.sleep(0.5)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.killpg(0, signal.SIGKILL)
            finally:
                os._exit(1)
        except OSError:
            pass


def _redirect_output(cfg: RankConfig) -> None:
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(cfg.path(suffix), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        except Exception:
            pass
    stack = open(cfg.path("stack"), "a", buffering=1)
    _KEEP.append(stack)
    faulthandler.enable(file=stack, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True, chain=False)


class _Rank:
    def __init__(self, cfg: RankConfig) -> None:
        import torch
        import torch.distributed as dist

        from .context import RankContext, set_current

        self.cfg = cfg
        # read by the parent: the straggler grace waits meanwhile
        self.in_pdb = debug.flag_file(cfg.path("pdb"))
        self.torch = torch
        self.dist = dist
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        kwargs: dict[str, Any] = {}
        if cfg.device_type == "cuda":  # NCCL: a GPU per rank; gloo: ranks sharing the pool's GPUs
            index = cfg.rank if cfg.device_index is None else cfg.device_index
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
            if cfg.backend == "nccl":
                kwargs["device_id"] = device
        else:
            device = torch.device("cpu")
        # peers wait in collectives for as long as a rank may sit in pdb
        if cfg.pdb_rank is not None:
            from datetime import timedelta

            kwargs["timeout"] = timedelta(seconds=debug.DEBUG_WAIT_S)
        store = dist.FileStore(cfg.store_path, cfg.world_size)
        dist.init_process_group(cfg.backend, store=store, rank=cfg.rank, world_size=cfg.world_size,
                                **kwargs)
        ctrl = dist.new_group(backend="gloo") if cfg.backend != "gloo" else None
        self.ctx = RankContext(cfg.rank, cfg.world_size, cfg.backend, device, ctrl_group=ctrl)
        set_current(self.ctx)
        self.base_groups = live_groups()
        self.memory = cuda_memory.for_device(torch) if cfg.device_type == "cuda" else None
        self.baseline = ProcessState(torch)
        self.functions: dict[tuple[str, str, bytes], Any] = {}

    # ------------------------------------------------------------ state
    def _restore_and_check(self) -> tuple[list[str], list[str]]:
        """Restore what a test may change in the process and name it; report what cannot be
        restored.

        Returns ``(restored, problems)``: ``restored`` names the changes undone here (environment
        variables, working directory, default dtype, grad mode, torch threads, deterministic
        algorithms; the parent warns), ``problems`` what makes the controller recycle the pool
        (process groups, CUDA memory). RNGs need no check: every test starts by seeding ``random``,
        torch and numpy from its node id.
        """
        restored = self.baseline.restore() + self.ctx.reset_after_test()
        problems: list[str] = []
        if not self.dist.is_initialized():
            problems.append("the default process group was destroyed")
            return restored, problems
        live = live_groups()
        if live is not None and self.base_groups is not None:
            extra = (live - self.base_groups - self.ctx.owned_group_ids()
                     - groups_kept_for_the_process())
            if extra:
                problems.append(f"{len(extra)} process group(s) left behind (use tp.new_group or "
                                f"the mesh fixture, which the pool caches)")
        if self.memory is not None:
            leak = self.memory.after_test()
            if leak:
                problems.append(leak)
        return restored, problems

    # ------------------------------------------------------------ imports
    @staticmethod
    def _sync_path(sys_path: list[str]) -> None:
        if sys.path != sys_path:
            sys.path[:] = sys_path
            importlib.invalidate_caches()

    @staticmethod
    def _load_module(name: str, file: str) -> types.ModuleType:
        def same(mod: types.ModuleType | None) -> bool:
            f = getattr(mod, "__file__", None)
            return f is not None and os.path.realpath(f) == os.path.realpath(file)

        mod = sys.modules.get(name)
        if same(mod):
            return mod  # type: ignore[return-value]
        if mod is None:
            try:
                mod = importlib.import_module(name)
                if same(mod):
                    return mod
            except ImportError:
                pass
        spec = importlib.util.spec_from_file_location(name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import test module {name!r} from {file}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return mod

    def _resolve(self, cmd: RunTest) -> Any:
        mod = self._load_module(cmd.module_name, cmd.module_file)
        for name, modname in cmd.extra_globals.items():
            if name not in mod.__dict__:
                mod.__dict__[name] = importlib.import_module(modname)
        parts = cmd.qualname.split(".")
        owner: Any = mod
        for part in parts[:-1]:
            owner = getattr(owner, part)
        raw = getattr(owner, parts[-1])
        key = (cmd.module_file, cmd.qualname, cmd.code or b"")
        func = self.functions.get(key)
        if func is None:
            func = raw
            plain = getattr(raw, "__func__", raw)
            if (cmd.code is not None and isinstance(plain, types.FunctionType)
                and plain.__closure__ is None):
                func = types.FunctionType(marshal.loads(cmd.code), plain.__globals__,
                                          plain.__name__, plain.__defaults__)
                func.__kwdefaults__ = plain.__kwdefaults__
                func.__qualname__ = plain.__qualname__
            self.functions[key] = func
        # test class: fresh instance per test, like pytest
        if owner is not mod and isinstance(owner, type):
            return types.MethodType(func, owner())
        return func

    # ------------------------------------------------------------ commands
    def _outcome(self, exc: BaseException, tb_skip: int = 1,
                 test_file: str | None = None) -> RankOutcome:
        return classify(exc, self.cfg.rank, tb_skip, test_file)

    def run_test(self, cmd: RunTest) -> RankOutcome:
        from .values import bind, undo_per_rank

        t0 = time.perf_counter()
        try:
            self._sync_path(cmd.sys_path)
            func = self._resolve(cmd)
            kwargs = {k: bind(v, self.ctx) for k, v in pickle.loads(cmd.kwargs).items()}
            seed_test(cmd.seed)
        except BaseException as exc:  # noqa: BLE001 - reported as this rank's failure
            out = self._outcome(exc, tb_skip=0)
            out.summary = f"could not set up the test on the rank: {out.summary}"
        else:
            try:
                with debug.body(self.cfg.rank, self.cfg.pdb_rank, self.in_pdb):
                    func(**kwargs)
                out = RankOutcome(self.cfg.rank, "passed")
            except BaseException as exc:  # noqa: BLE001
                out = self._outcome(exc, test_file=cmd.module_file)
            finally:
                undo_per_rank(kwargs)
        out.duration_s = time.perf_counter() - t0
        return out

    def call(self, cmd: CallFn) -> RankOutcome:
        from .values import bind

        t0 = time.perf_counter()
        try:
            self._sync_path(cmd.sys_path)
            for name, file in cmd.modules:
                if file:
                    self._load_module(name, file)
            fn, args, kwargs = pickle.loads(cmd.payload)
            args = tuple(bind(a, self.ctx) for a in args)
            kwargs = {k: bind(v, self.ctx) for k, v in kwargs.items()}
            seed_test(cmd.seed)
        except BaseException as exc:  # noqa: BLE001
            out = self._outcome(exc, tb_skip=0)
            out.summary = f"could not unpickle the call on the rank: {out.summary}"
            out.duration_s = time.perf_counter() - t0
            return out
        try:
            with debug.body(self.cfg.rank, self.cfg.pdb_rank, self.in_pdb):
                value = fn(self.ctx, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001
            out = self._outcome(exc)
        else:
            try:
                out = RankOutcome(self.cfg.rank, "passed",
                                  value=pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception as exc:  # noqa: BLE001
                out = RankOutcome(self.cfg.rank, "failed",
                                  summary=f"return value of {getattr(fn, '__name__', fn)!r} "
                                  f"is not picklable: {type(exc).__name__}: {exc}")
        out.duration_s = time.perf_counter() - t0
        return out

    def serve(self, conn: Any) -> None:
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                return
            cmd = pickle.loads(data)
            if cmd == "stop":
                return
            with collectives.count_unwaited() as unwaited:
                if isinstance(cmd, RunTest):
                    out = self.run_test(cmd)
                elif isinstance(cmd, CallFn):
                    out = self.call(cmd)
                else:
                    what = f"unknown command {type(cmd).__name__}"
                    out = RankOutcome(self.cfg.rank, "failed", summary=what)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            out.state_restored, out.state_problems = self._restore_and_check()
            out.collectives = collectives.snapshot(unwaited[0])
            try:
                payload = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001
                payload = pickle.dumps(RankOutcome(self.cfg.rank, "failed",
                                                   summary=f"unpicklable outcome: {exc!r}"))
            conn.send_bytes(payload)


def _release_multiprocessing_resources() -> None:
    """Run multiprocessing's exit finalizers of priority >= 0, as a multiprocessing process that
    returns does.

    ``os._exit`` skips them, yet they release what outlives the process otherwise: each named
    semaphore made on the rank (a multiprocessing lock of a non-fork context, e.g. tqdm's class
    lock, which torch.fx makes when torch.compile runs) is unlinked and unregistered from the pytest
    process's resource tracker, which would otherwise report it leaked when the session ends. Queues
    are closed and pools or managers a test left are shut down too. Not run: the joins of child
    processes and queue feeder threads that multiprocessing does after them (they can wait without
    bound). ``_run_finalizers`` is multiprocessing's own (private) entry point for this; where it is
    missing, nothing is run. The controller's bounded stop still kills a rank stuck here.
    """
    from multiprocessing import util

    run_finalizers = getattr(util, "_run_finalizers", None)
    if run_finalizers is None:
        return
    try:
        run_finalizers(0)
    except Exception:  # noqa: BLE001 - best effort; the resource tracker still cleans up at the end
        pass


def rank_main(cfg: RankConfig, conn: Any) -> None:
    """Entry point of a spawned rank process (see the module docstring)."""
    t0 = time.perf_counter()
    os.environ.update(cfg.env)
    _isolate(cfg)
    _redirect_output(cfg)
    cov = None
    if cfg.coverage is not None:  # started before the rank imports anything of the tests
        from . import rank_coverage

        cov = rank_coverage.start(cfg.coverage)
    try:
        rank = _Rank(cfg)
    except BaseException:  # noqa: BLE001 - reported to the controller
        err = traceback.format_exc()
        sys.stderr.write(err)
        try:
            conn.send_bytes(pickle.dumps(StartFailed(cfg.rank, err)))
        finally:
            os._exit(1)
    conn.send_bytes(pickle.dumps(Ready(cfg.rank, os.getpid(), str(rank.ctx.device),
                                       time.perf_counter() - t0)))
    try:
        rank.serve(conn)
    finally:
        if cov is not None:
            try:
                conn.send_bytes(pickle.dumps(RankCoverage(cfg.rank, rank_coverage.collect(cov))))
            # noqa: BLE001 - the controller is gone, or the data could not be read: none sent
            except Exception:
                pass
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        try:
            rank.dist.destroy_process_group()
        except Exception:
            pass
        _release_multiprocessing_resources()
        os._exit(0)  # skip interpreter teardown: fast, and no atexit surprises from test code
