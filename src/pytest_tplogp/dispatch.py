"""Sending a TP test to its ranks and turning what comes back into the test's pytest outcome.

A TP test body is dispatched by node id: :func:`run_test_command` packs the module's name and file, the qualified
name, the pickled fixture values, ``sys.path``, a seed derived from the node id and the parent's
assertion-rewritten code object; the pool (or, under torchrun, this process) runs it on every rank, and
:func:`apply` merges every rank's outcome (``report.merge``) into a pass, skip, xfail or :class:`RankFailure`.
:class:`PoolHandle` is the ``tp_pool`` fixture: explicit dispatch of a function from a body that stays in the parent.
"""

from __future__ import annotations

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
from .session import SKIPPED_ON_RANKS, State


def seed_for(nodeid: str) -> int:
    return zlib.crc32(nodeid.encode()) & 0x7FFFFFFF


def _pickled_kwargs(item: pytest.Item, kwargs: dict[str, Any]) -> bytes:
    for name, value in kwargs.items():
        try:
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - reported with the fixture's name
            pytest.fail(f"{item.nodeid}: fixture {name!r} (a {type(value).__name__}) cannot be sent to the ranks: "
                        f"{type(exc).__name__}: {exc}. A TP test body runs in other processes: use picklable fixture "
                        f"values, or give the value a __tp_bind__(tp) method / use pytest_tplogp.RankValue to build it "
                        f"on each rank.", pytrace=False)
    return pickle.dumps(kwargs, protocol=pickle.HIGHEST_PROTOCOL)


def body_argnames(item: pytest.Function) -> list[str]:
    """The names a test body takes (its fixtures and parameters), in order."""
    return list(inspect.signature(item.obj).parameters)


def run_test_command(item: pytest.Function) -> RunTest:
    obj = item.obj
    func = getattr(obj, "__func__", obj)
    module = item.module
    cls = item.cls
    qualname = f"{cls.__qualname__}.{item.originalname}" if cls is not None else item.originalname
    if "<locals>" in qualname:
        pytest.fail(f"{item.nodeid}: TP tests must be module-level functions or methods of module-level classes "
                    f"(the ranks look them up by name)", pytrace=False)
    kwargs = {n: item.funcargs[n] for n in body_argnames(item) if n in item.funcargs}
    code = extra = None
    if isinstance(func, types.FunctionType) and func.__closure__ is None:
        code = marshal.dumps(func.__code__)  # the parent's assertion-rewritten code object
        extra = {k: v.__name__ for k, v in func.__globals__.items()
                 if k.startswith("@") and isinstance(v, types.ModuleType)}
    return RunTest(nodeid=item.nodeid, module_name=module.__name__, module_file=module.__file__, qualname=qualname,
                   kwargs=_pickled_kwargs(item, kwargs), sys_path=list(sys.path), seed=seed_for(item.nodeid),
                   code=code, extra_globals=extra or {})


def _attach_outputs(item: pytest.Item, outputs: dict[int, tuple[str, str]], label: str = "") -> None:
    live = item.config.getoption("capture", "fd") == "no"
    for r, (out, err) in sorted(outputs.items()):
        for stream, text in (("stdout", out), ("stderr", err)):
            if not text:
                continue
            item.add_report_section("call", f"{stream} rank {r}{label}", text)
            if live:
                sys.stdout.write("".join(f"[rank {r}] {line}\n" for line in text.splitlines()))


def apply(item: pytest.Item, run: Any, plan: Plan, label: str = "") -> None:
    """Report a PoolRun as this test's outcome (attach outputs; skip, xfail or raise RankFailure)."""
    from .report import RankFailure, failure_class, merge

    _attach_outputs(item, run.outputs, label)
    verdict = merge(run, plan.world_size, timeout_s=plan.timeout_s, test_file=str(item.path),
                    pool_desc=plan.describe())
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
        failure = cls(verdict.headline, verdict.text)
    except Exception:  # noqa: BLE001 - an exception type whose constructor rejects our arguments
        failure = RankFailure(verdict.headline, verdict.text)
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
                                      capture=item.config.getoption("capture", "fd") != "no")
    else:
        run = pool_for(state, plan).run(cmd, plan.timeout_s)
    state.dispatched += 1
    apply(item, run, plan)


class PoolHandle:
    """The ``tp_pool`` fixture: explicit dispatch to the pool of this test's world size and backend."""

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

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(tp, *args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` must be importable by the ranks (module-level, pickled by reference); arguments and results must
        pickle. A failure, skip or hang is reported like a TP test body's (grouped, with stacks) and raised here.
        ``timeout`` (seconds) defaults to the test's deadline.
        """
        self._calls += 1
        modules: list[tuple[str, str]] = []
        for mod_name in {getattr(fn, "__module__", None), self._item.module.__name__}:  # type: ignore[attr-defined]
            mod = sys.modules.get(mod_name or "")
            file = getattr(mod, "__file__", None)
            if mod_name and file:
                modules.append((mod_name, file))
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"tp_pool.run: {getattr(fn, '__qualname__', fn)!r} or its arguments cannot be pickled "
                            f"({type(exc).__name__}: {exc}); use a module-level function and picklable arguments") from None
        cmd = CallFn(payload=payload, modules=modules, sys_path=list(sys.path),
                     seed=seed_for(f"{self._item.nodeid}#{self._calls}"))
        run = pool_for(self._state, self._plan).run(cmd, self._plan.timeout_s if timeout is None else timeout)
        self._state.dispatched += 1
        apply(self._item, run, self._plan, label=f" (tp_pool.run #{self._calls})")
        return [pickle.loads(run.outcomes[r].value) for r in range(self.world_size)]
