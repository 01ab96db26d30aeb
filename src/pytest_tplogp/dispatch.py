"""Sending a TP test to its ranks and turning what comes back into the test's pytest outcome.

A TP test body is dispatched by node id: :func:`run_test_command` packs the module's name and file,
the qualified name, the pickled fixture values, ``sys.path``, a seed derived from the node id and
the parent's assertion-rewritten code object; the pool (or, under torchrun, this process) runs it on
every rank, and :func:`apply` merges every rank's outcome (``report.merge``) into a pass, skip,
xfail or :class:`RankFailure`. :class:`PoolHandle` is the ``tp_pool`` fixture: explicit dispatch of
a function from a body that stays in the parent.
"""

from __future__ import annotations

import functools
import inspect
import marshal
import pickle
import sys
import types
import zlib
from collections.abc import Callable
from typing import Any

import pytest

from .placement import Plan
from .protocol import CallFn, RunTest
from .session import RECYCLE_PROPERTY, SKIPPED_ON_RANKS, STATE, State
from .values import PerRankMonkeyPatch


def seed_for(nodeid: str) -> int:
    return zlib.crc32(nodeid.encode()) & 0x7FFFFFFF


#: Standard fixtures that act on the parent process and mean nothing on the ranks: a TP test body
#: that takes one is refused at setup with the reason and what to do instead.
PARENT_ONLY_FIXTURES: dict[str, str] = {
    **{name: "captures the output of the pytest process, but the body runs on the ranks. Each "
             "rank's stdout and stderr are captured per test and reported as 'Captured stdout rank "
             "N' sections (printed live with -s); to assert on printed text, capture it inside the "
             "body (contextlib.redirect_stdout)"
       for name in ("capsys", "capsysbinary", "capfd", "capfdbinary", "capteesys")},
    "caplog": "records the log of the pytest process, but the body logs on the ranks; use "
              "logging.Handler / assertLogs inside the body",
    "recwarn": "records the warnings of the pytest process, but the body warns on the ranks; use "
               "`with pytest.warns(...)` or warnings.catch_warnings inside the body",
    **{name: "lives in the pytest process and cannot reach the ranks; read what the body needs in "
             "a fixture of your own and return a picklable value"
       for name in ("request", "pytestconfig", "tmp_path_factory", "tmpdir_factory",
                    "record_property",
                    "record_xml_attribute", "record_testsuite_property", "doctest_namespace")},
}


def refuse_parent_only_fixtures(item: pytest.Item) -> None:
    """Fail the setup of a TP test whose body takes a fixture of :data:`PARENT_ONLY_FIXTURES` (one
    message)."""
    names = [n for n in body_argnames(item) if n in PARENT_ONLY_FIXTURES]  # type: ignore[arg-type]
    if names:
        name = names[0]
        pytest.fail(f"{item.nodeid}: a TP test body cannot take the {name!r} fixture: {name} "
                    f"{PARENT_ONLY_FIXTURES[name]}. (tp_pool tests, whose body stays in the pytest "
                    "process, can.)",
                    pytrace=False)


def _rank_side(value: Any) -> Any:
    """The value sent to the ranks for a fixture value: a ``monkeypatch`` becomes one per rank."""
    if isinstance(value, pytest.MonkeyPatch):
        return PerRankMonkeyPatch()
    return value


def _pickled_kwargs(item: pytest.Item, kwargs: dict[str, Any]) -> bytes:
    """The body's fixture values, pickled once; when that fails, the first value that does not
    pickle is named."""
    kwargs = {name: _rank_side(value) for name, value in kwargs.items()}
    try:
        return pickle.dumps(kwargs, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - find the fixture to name below
        pass
    for name, value in kwargs.items():
        try:
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - reported with the fixture's name
            pytest.fail(f"{item.nodeid}: fixture {name!r} (a {type(value).__name__}) cannot be "
                        f"sent to the ranks: {type(exc).__name__}: {exc}. A TP test body runs in "
                        "other processes: use picklable fixture values, or give the value a "
                        "__tp_bind__(tp) method / use pytest_tplogp.RankValue to build it on each "
                        "rank.", pytrace=False)
    return pickle.dumps(kwargs, protocol=pickle.HIGHEST_PROTOCOL)


def body_argnames(item: pytest.Function) -> list[str]:
    """The names a test body takes (its fixtures and parameters), in order."""
    return [n for n in inspect.signature(item.obj).parameters if n != "self"]


def run_test_command(item: pytest.Function) -> RunTest:
    obj = item.obj
    func = getattr(obj, "__func__", obj)
    module = item.module
    cls = item.cls
    qualname = f"{cls.__qualname__}.{item.originalname}" if cls is not None else item.originalname
    if "<locals>" in qualname:
        pytest.fail(f"{item.nodeid}: TP tests must be module-level functions or methods of "
                    f"module-level classes (the ranks look them up by name)", pytrace=False)
    kwargs = {n: item.funcargs[n] for n in body_argnames(item) if n in item.funcargs}
    code = extra = None
    if isinstance(func, types.FunctionType) and func.__closure__ is None:
        code = marshal.dumps(func.__code__)  # the parent's assertion-rewritten code object
        extra = {k: v.__name__ for k, v in func.__globals__.items()
                 if k.startswith("@") and isinstance(v, types.ModuleType)}
    return RunTest(nodeid=item.nodeid, module_name=module.__name__, module_file=module.__file__,
                   qualname=qualname,
                   kwargs=_pickled_kwargs(item, kwargs), sys_path=list(sys.path),
                   seed=seed_for(item.nodeid),
                   code=code, extra_globals=extra or {})


def _attach_outputs(item: pytest.Item, outputs: dict[int, tuple[str, str]],
                    label: str = "") -> None:
    from .report import rank_sections

    for key, text in rank_sections(outputs, label):
        item.add_report_section("call", key, text)


def _live_output(item: pytest.Item) -> Callable[[int, str, str], None] | None:
    """Under ``-s``, a sink that prints each rank's lines as they come, prefixed ``[rank N]``."""
    if item.config.getoption("capture", "fd") != "no":
        return None

    def sink(rank: int, stream: str, line: str) -> None:
        out = sys.stdout if stream == "stdout" else sys.stderr
        out.write(f"[rank {rank}] {line}\n")
        out.flush()

    return sink


def apply(item: pytest.Item, run: Any, plan: Plan, label: str = "") -> None:
    """Report a PoolRun as this test's outcome (attach outputs; skip, xfail or raise
    RankFailure)."""
    from .report import RankFailure, failure_class, merge

    # under -s every line was printed as it came: not a second time in the report
    if _live_output(item) is None:
        _attach_outputs(item, run.outputs, label)
    verdict = merge(run, plan.world_size, timeout_s=plan.timeout_s, test_file=str(item.path),
                    pool_desc=plan.describe())
    if run.killed:  # counted in the terminal summary (under xdist too: the report carries it)
        item.user_properties.append((RECYCLE_PROPERTY, run.killed))
    restored = sorted({what for o in run.outcomes.values() for what in o.state_restored})
    if restored:
        item.warn(pytest.PytestWarning("tplogp: the test changed process state on the ranks, "
                                       f"restored before the next test: {'; '.join(restored)} (use "
                                       "the monkeypatch fixture)"))
    if verdict.outcome == "passed":
        if run.killed:
            item.warn(pytest.PytestWarning(f"tplogp: pool recycled after this test: {run.killed}"))
        return
    if verdict.outcome == "skipped":
        item.stash[SKIPPED_ON_RANKS] = verdict.headline
        pytest.skip(verdict.headline)
    if verdict.outcome == "xfailed":
        pytest.xfail(verdict.headline)
    cls = failure_class(verdict.exc_type)
    try:
        failure = cls(verdict.headline, verdict.text, verdict.crash)
    except Exception:  # noqa: BLE001 - an exception type whose constructor rejects our arguments
        failure = RankFailure(verdict.headline, verdict.text, verdict.crash)
    raise failure


def pool_for(state: State, plan: Plan) -> Any:
    """The live pool of ``plan`` (started if needed); a start failure is this test's failure."""
    from .pool import PoolStartError
    from .report import RankFailure

    try:
        return state.manager.get(plan.key)
    except PoolStartError as exc:
        raise RankFailure(str(exc).splitlines()[0], "E   " + str(exc)) from None


def run_body(item: pytest.Function, state: State, plan: Plan) -> None:
    """Run a TP test body on every rank (pool or torchrun) and report the merged outcome."""
    cmd = run_test_command(item)
    if state.external is not None:
        run = state.external.run_test(item.obj, pickle.loads(cmd.kwargs), cmd.seed, plan.timeout_s,
                                      capture=item.config.getoption("capture", "fd") != "no",
                                      on_hang=functools.partial(end_session_after_hang, item, plan))
    else:
        run = pool_for(state, plan).run(cmd, plan.timeout_s, live=_live_output(item))
    apply(item, run, plan)


class PoolHandle:
    """The ``tp_pool`` fixture: explicit dispatch to the pool of this test's world size and
    backend."""

    def __init__(self, item: pytest.Item, state: State, plan: Plan) -> None:
        self._item = item
        self._state = state
        self._plan = plan
        self._calls = 0

    @property
    def world_size(self) -> int:
        return self._plan.world_size

    @property
    def backend(self) -> str:
        return self._plan.backend

    @property
    def devices(self) -> tuple[str, ...]:
        return self._plan.devices

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Call ``fn(tp, *args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` must be importable by the ranks (module-level, pickled by reference); arguments and
        results must pickle. A failure, skip or hang is reported like a TP test body's (grouped,
        with stacks) and raised here. ``timeout`` (seconds) defaults to the test's deadline.
        """
        self._calls += 1
        modules: list[tuple[str, str]] = []
        # type: ignore[attr-defined]
        for mod_name in {getattr(fn, "__module__", None), self._item.module.__name__}:
            mod = sys.modules.get(mod_name or "")
            file = getattr(mod, "__file__", None)
            if mod_name and file:
                modules.append((mod_name, file))
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"tp_pool.run: {getattr(fn, '__qualname__', fn)!r} or its arguments "
                            f"cannot be pickled ({type(exc).__name__}: {exc}); use a module-level "
                            "function and picklable arguments") from None
        cmd = CallFn(payload=payload, modules=modules, sys_path=list(sys.path),
                     seed=seed_for(f"{self._item.nodeid}#{self._calls}"))
        run = pool_for(self._state, self._plan).run(cmd, self._plan.timeout_s if timeout is None
                                                    else timeout,
                                                    live=_live_output(self._item))
        apply(self._item, run, self._plan, label=f" (tp_pool.run #{self._calls})")
        return [pickle.loads(run.outcomes[r].value) for r in range(self.world_size)]


def end_session_after_hang(item: pytest.Item, plan: Plan, run: Any) -> None:
    """Under torchrun, rank 0 when a test hung (its deadline passed, or ranks stayed in a collective
    after a peer failed): report the test as failed (which ranks hung and where), report every test
    that did not run as an error, and end the session's reporting (summary, JUnit file) before the
    job is torn down.

    Runs on the exchange's watcher thread while the test's body may be stuck in a collective on the
    main thread; the process exits right after, so no pytest state is left to repair.
    """
    from .protocol import STRAGGLER_GRACE_S
    from .report import TPLongRepr, label_rank_lines, longrepr_for, merge, rank_sections

    verdict = merge(run, plan.world_size, timeout_s=plan.timeout_s, test_file=str(item.path),
                    pool_desc="torchrun")
    # the titles pytest gives add_report_section's keys (this report is built by hand: the job ends
    # after it)
    sections = [(f"Captured {key} call", text) for key, text in rank_sections(run.outputs)]
    common = dict(nodeid=item.nodeid, location=item.location,
                  keywords={k: 1 for k in item.keywords})
    longrepr = longrepr_for(item, verdict.text, verdict.headline, verdict.crash)
    ihook = item.ihook
    ihook.pytest_runtest_logreport(report=pytest.TestReport(
        **common, outcome="failed", longrepr=longrepr, when="call", sections=sections,
        duration=run.elapsed_s))
    labelled = [(title, label_rank_lines(title, text)) for title, text in sections]
    ihook.pytest_runtest_logreport(report=pytest.TestReport(
        **common, outcome="passed", longrepr=None, when="teardown", sections=labelled))
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    session = item.session
    why = (f"passed its deadline of {plan.timeout_s:g} s" if run.timed_out else
           f"left ranks in a collective {STRAGGLER_GRACE_S:g} s after a peer failed")
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    mode = item.config.stash[STATE].external
    if mode is not None and mode.restarts_left and item in session.items:
        # torchrun restarts the job: the next attempt skips the tests done (this one too)
        mode.record_progress(mode.offset + session.items.index(item) + 1, session.testsfailed)
        if reporter is not None:
            reporter.write_line("")
            left = mode.restarts_left
            reporter.write_line(f"tplogp (torchrun): {item.nodeid} {why}; a process group cannot "
                                f"be respawned, so this attempt ends; torchrun restarts the job "
                                f"({left} restart(s) left) and it resumes at the next test.",
                                red=True)
        failed = pytest.ExitCode.TESTS_FAILED
        item.config.hook.pytest_sessionfinish(session=session, exitstatus=failed)
        return
    not_run = session.items[session.items.index(item) + 1:] if item in session.items else []
    reason = (f"not run: {item.nodeid} {why} and a process group cannot be respawned under "
              "torchrun, so the job ended")
    tbstyle = item.config.getoption("tbstyle", "auto")
    for later in not_run:
        path, line0, _ = later.reportinfo()
        later.ihook.pytest_runtest_logstart(nodeid=later.nodeid, location=later.location)
        common = dict(nodeid=later.nodeid, location=later.location,
                      keywords={k: 1 for k in later.keywords})
        error = TPLongRepr(f"E   {reason}", reason, str(path), (line0 or 0) + 1, style=tbstyle)
        later.ihook.pytest_runtest_logreport(report=pytest.TestReport(
            **common, outcome="failed", longrepr=error, when="setup", duration=0.0))
        later.ihook.pytest_runtest_logreport(report=pytest.TestReport(
            **common, outcome="passed", longrepr=None, when="teardown", duration=0.0))
        later.ihook.pytest_runtest_logfinish(nodeid=later.nodeid, location=later.location)
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(f"tplogp (torchrun): {item.nodeid} {why}; a process group cannot be "
                            f"respawned, so the job ends here ({len(not_run)} test(s) not run, "
                            "reported as errors).", red=True)
    item.config.hook.pytest_sessionfinish(session=session, exitstatus=pytest.ExitCode.TESTS_FAILED)
