"""pytest hooks and fixtures of pytest_tplogp (parent side).

A *TP test* is a test marked ``@pytest.mark.tp(...)`` or requesting the ``tp`` / ``tp_pool`` fixture. Its world size
is a parametrization (``tp_world_size``, ids ``[tp2]``, ``[tp4]``, markers ``tp2``/``tp4`` for ``-m tp4``). At setup
the autouse ``tp_world_size`` fixture decides the placement (backend, devices) and skips, before anything is
spawned, when this process cannot run it (e.g. not enough GPUs). At call time ``pytest_pyfunc_call`` sends the body
to the pool for that placement, dispatched by node id (module file + qualified name) with the picklable fixture
values; every rank's outcome is merged by ``report.merge``. Tests requesting ``tp_pool`` run in the parent and use
``tp_pool.run(fn, *args)`` instead. Under torchrun (external mode) the body runs in this process on the existing
process group (``external.py``).

State lives in ``config.stash``; the pool manager is created lazily on the first dispatch. Public pytest API only.
"""

from __future__ import annotations

import inspect
import marshal
import os
import pickle
import re
import sys
import types
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from . import devices, options
from .options import Settings
from .protocol import CallFn, RunTest
from .values import BIASES, DTYPES, OpSource, Reference, TPPlaceholder, VocabShards

MARKER_KWARGS = ("world_size", "timeout", "backend")


@dataclass
class Plan:
    """Where and how one TP test runs (decided in the parent at setup)."""

    world_size: int
    backend: str
    devices: tuple[str, ...]
    timeout_s: float
    in_parent: bool  # tp_pool tests: body in the parent
    skip_reason: str | None = None

    @property
    def device_type(self) -> str:
        return "cpu" if self.devices == ("cpu",) else "cuda"

    @property
    def key(self) -> Any:
        from .pool import PoolKey

        return PoolKey(self.world_size, self.backend, self.devices)


@dataclass
class State:
    settings: Settings
    external: Any = None  # external.ExternalMode under torchrun
    _manager: Any = None
    dispatched: int = 0
    registered_sizes: set = field(default_factory=set)

    @property
    def manager(self) -> Any:
        if self._manager is None:
            from .pool import PoolManager

            threads = self.settings.threads or None
            self._manager = PoolManager(num_threads=threads, start_method=self.settings.start_method)
        return self._manager


STATE = pytest.StashKey[State]()
PLAN = pytest.StashKey[Plan]()
SKIPPED_ON_RANKS = pytest.StashKey[str]()


# The options live in the package's opt-in shim (``pytest_tplogp/__init__.py``): registering this module directly
# (``-p pytest_tplogp.plugin``) brings the shim along.
pytest_plugins = ["pytest_tplogp"]


# ---------------------------------------------------------------------------------------------------- config
def _register_marker(config: pytest.Config, name: str, text: str) -> None:
    existing = {line.split(":", 1)[0].split("(", 1)[0].strip() for line in config.getini("markers")}
    if name not in existing:
        config.addinivalue_line("markers", f"{name}: {text}")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    settings = options.resolve(config)
    _register_marker(config, "tp", "tp(world_size=2|[2, 4], timeout=seconds, backend='auto'|'gloo'|'nccl'): run "
                     "the test body on every rank of a torch.distributed pool (pytest_tplogp)")
    _register_marker(config, "stress", "large shapes; skipped unless selected with -m stress or --tp-run-stress")
    _register_marker(config, "gpu", "needs a CUDA device (skipped before any spawn when there is none)")
    state = State(settings)
    config.stash[STATE] = state
    config.pluginmanager.register(_make_grid_fixtures(settings), "tplogp-grid-fixtures")
    from . import external

    if external.detect():
        state.external = external.ExternalMode(settings)
        if state.external.ctx.rank != 0:
            # Report from rank 0 only: this runs before the terminal reporter is created with sys.stdout, so the
            # other ranks' reporters write to /dev/null (their verdicts reach rank 0 through the outcome exchange).
            sys.stdout = open(os.devnull, "w")
            config.add_cleanup(sys.stdout.close)
            # rank 0 writes the one JUnit file, with every rank's verdict and output
            config.option.xmlpath = None


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    if state is None:
        return
    if state._manager is not None:
        state._manager.shutdown()
    if state.external is not None:
        state.external.close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    state = config.stash[STATE]
    s = state.settings
    if state.external is not None:
        ctx = state.external.ctx
        return [f"tplogp: external mode (torchrun): world size {ctx.world_size}, backend {ctx.backend}, "
                f"device {ctx.device}; this report is rank {ctx.rank}'s; timeout {s.timeout_s:g} s"]
    from . import why_active

    p = devices.place(s.world_size, s.backend)
    devs = "cpu" if p.device_type == "cpu" else "cuda:" + ",".join(p.devices)
    return [f"tplogp: world size {s.world_size}, backend {p.backend} ({s.backend}), devices {devs}, "
            f"timeout {s.timeout_s:g} s, rendezvous FileStore per session; {devices.block_note()}; "
            f"on by {why_active(config) or '-p pytest_tplogp.plugin'}"]


# ---------------------------------------------------------------------------------------------------- collection
def _is_tp(marker: Any, fixturenames: Any) -> bool:
    return marker is not None or "tp" in fixturenames or "tp_pool" in fixturenames


def _marker_args(marker: Any, where: str) -> dict[str, Any]:
    if marker is None:
        return {}
    kwargs = dict(marker.kwargs)
    unknown = sorted(set(kwargs) - set(MARKER_KWARGS))
    if unknown:
        raise pytest.UsageError(f"{where}: unknown argument(s) {', '.join(unknown)} to @pytest.mark.tp; "
                                f"expected {', '.join(MARKER_KWARGS)}")
    if marker.args:
        if len(marker.args) > 1 or "world_size" in kwargs:
            raise pytest.UsageError(f"{where}: @pytest.mark.tp takes at most one positional argument (world_size)")
        kwargs["world_size"] = marker.args[0]
    return kwargs


def _world_sizes(kwargs: dict[str, Any], default: int, where: str) -> list[int]:
    raw = kwargs.get("world_size", default)
    sizes = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    if not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes):
        raise pytest.UsageError(f"{where}: @pytest.mark.tp(world_size=...) expects an int >= 1 or a list of them, "
                                f"got {raw!r}")
    return sizes


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("tp")
    if not _is_tp(marker, metafunc.fixturenames):
        return
    for m in metafunc.definition.iter_markers("parametrize"):
        names = m.args[0] if m.args else m.kwargs.get("argnames", "")
        if "tp_world_size" in (names.split(",") if isinstance(names, str) else names):
            return  # the author parametrized it directly
    config = metafunc.config
    state = config.stash[STATE]
    where = metafunc.definition.nodeid
    sizes = _world_sizes(_marker_args(marker, where), state.settings.world_size, where)
    params = []
    for n in sizes:
        if n not in state.registered_sizes:
            _register_marker(config, f"tp{n}", f"TP test at world size {n} (pytest_tplogp; select with -m tp{n})")
            state.registered_sizes.add(n)
        params.append(pytest.param(n, id=f"tp{n}", marks=getattr(pytest.mark, f"tp{n}")))
    metafunc.parametrize("tp_world_size", params, indirect=True)


def _stress_selected(config: pytest.Config) -> bool:
    expr = config.getoption("markexpr", "") or ""
    return bool(re.search(r"(?<![\w-])stress(?![\w-])", expr))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash[STATE]
    if state.settings.run_stress or _stress_selected(config):
        return
    skip = pytest.mark.skip(reason="stress test: select with -m stress or --tp-run-stress")
    for item in items:
        if item.get_closest_marker("stress") is not None:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    state = session.config.stash[STATE]
    if state.external is not None:
        problem = state.external.check_collection([item.nodeid for item in session.items])
        if problem:
            pytest.exit(problem, returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None or item.get_closest_marker("tp") is not None:
        return
    if "tp" in getattr(item, "fixturenames", ()) or "tp_pool" in getattr(item, "fixturenames", ()):
        return
    if not devices.gpu_block():
        # a marker (not pytest.skip here) so the report points at the test, and the skipping plugin applies it
        item.add_marker(pytest.mark.skip(reason=f"needs a CUDA device; this process has none "
                                                f"({devices.block_note()})"))


# ---------------------------------------------------------------------------------------------------- fixtures
def _plan_for(item: pytest.Item, world_size: int, st: State) -> Plan:
    settings = st.settings
    marker = item.get_closest_marker("tp")
    kwargs = _marker_args(marker, item.nodeid)
    backend = kwargs.get("backend", settings.backend)
    if backend not in options.BACKENDS:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.tp(backend={backend!r}); expected one of "
                                f"{', '.join(options.BACKENDS)}")
    timeout = kwargs.get("timeout", settings.timeout_s)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.tp(timeout={timeout!r}) expects seconds > 0")
    fixturenames = getattr(item, "fixturenames", ())
    in_parent = "tp_pool" in fixturenames
    if in_parent and "tp" in fixturenames:
        raise pytest.UsageError(f"{item.nodeid}: a test requests either tp (body on the ranks) or tp_pool (body in "
                                f"the parent, explicit dispatch), not both")
    needs_gpu = item.get_closest_marker("gpu") is not None
    if st.external is not None:
        ctx = st.external.ctx
        reason = None
        if world_size != ctx.world_size:
            reason = f"needs world size {world_size}; torchrun started {ctx.world_size} ranks"
        elif in_parent:
            reason = "tp_pool tests need the plugin's own pool; not available under torchrun"
        elif needs_gpu and ctx.device.type != "cuda":
            reason = "needs a GPU; the torchrun ranks run on CPU"
        return Plan(world_size, ctx.backend, ("external",), float(timeout), False, reason)
    p = devices.place(world_size, backend, needs_gpu=needs_gpu)
    return Plan(world_size, p.backend, p.devices, float(timeout), in_parent, p.skip_reason)


@pytest.fixture(autouse=True)
def tp_world_size(request: pytest.FixtureRequest) -> int | None:
    """World size of a TP test (its ``[tpN]`` parametrization); None for other tests.

    For TP tests this also fixes the placement (backend, devices, deadline) and skips, before any rank is
    spawned, when this process cannot run it.
    """
    ws = getattr(request, "param", None)
    if ws is None:
        return None
    state = request.config.stash[STATE]
    plan = _plan_for(request.node, int(ws), state)
    request.node.stash[PLAN] = plan
    if plan.skip_reason:
        pytest.skip(plan.skip_reason)
    return int(ws)


def _plan(request: pytest.FixtureRequest) -> Plan | None:
    return request.node.stash.get(PLAN, None)


@pytest.fixture
def tp(request: pytest.FixtureRequest) -> Any:
    """This rank's context in a TP test body: ``rank``, ``world_size``, ``backend``, ``device``, ``group`` and the
    collective helpers ``assert_all``, ``assert_close``, ``agree()``, ``skip_if``, ``new_group``, ``barrier``."""
    plan = _plan(request)
    if plan is None:
        raise pytest.UsageError(f"{request.node.nodeid}: the tp fixture only works in TP tests")
    return TPPlaceholder(plan.world_size)


@pytest.fixture
def tp_pool(request: pytest.FixtureRequest) -> PoolHandle:
    """Explicit dispatch from a test body that stays in the parent: ``tp_pool.run(fn, *args)`` calls
    ``fn(tp, *args)`` on every rank and returns the list of results (index = rank)."""
    plan = _plan(request)
    assert plan is not None, "tp_world_size sets the plan of every tp_pool test"
    return PoolHandle(request.node, request.config.stash[STATE], plan)


@pytest.fixture
def reference() -> Reference:
    """Full-vocab references from ``tplogp.reference``: ``reference(h, w, t, b, mode="fp32"|"matching"|"float64")``,
    or ``reference.fp32(...)`` / ``.matching(...)`` / ``.float64(...)`` / ``.outputs(...)``."""
    return Reference()


@pytest.fixture
def vocab_shards_size() -> int | None:
    """Override to change the default vocabulary of ``vocab_shards`` (None: :data:`values.DEFAULT_VOCAB_SIZE`)."""
    return None


_SOURCE_CACHE: dict[tuple[str, str], str | None] = {}


def source_unavailable(name: str, device_type: str) -> str | None:
    """The kernel registry's reason why op source ``name`` cannot run on ``device_type`` (None: it can)."""
    if name == "registry":
        return None
    key = (name, device_type)
    if key not in _SOURCE_CACHE:
        try:
            from tplogp import kernel_registry
        except ImportError as exc:
            return f"tplogp.kernel_registry is not importable: {exc}"
        import torch

        if device_type == "cuda":
            block = devices.gpu_block()
            index = devices.visible_gpus().index(block[0]) if block else 0
            dev = torch.device("cuda", index)
        else:
            dev = torch.device("cpu")
        _SOURCE_CACHE[key] = kernel_registry.source_status("linear_logp", device=dev).get(name, "unknown source")
    return _SOURCE_CACHE[key]


def _make_grid_fixtures(settings: Settings) -> Any:
    """The parametrizing fixtures, with grids restricted by the settings (--tp-op-source, --tp-dtype, ...)."""

    class GridFixtures:
        @pytest.fixture(params=list(settings.op_sources), ids=list(settings.op_sources))
        def op_source(self, request: pytest.FixtureRequest) -> OpSource:
            """Op source (registry, native, triton, sm90); unavailable ones skip with the registry's reason."""
            plan = _plan(request)
            device_type = plan.device_type if plan is not None and plan.devices != ("external",) else "cpu"
            if plan is not None and plan.devices == ("external",):
                state = request.config.stash[STATE]
                device_type = state.external.ctx.device.type
            why = source_unavailable(request.param, device_type)
            if why is not None:
                pytest.skip(f"op source {request.param} unavailable on {device_type}: {why}")
            return OpSource(request.param)

        @pytest.fixture(params=list(settings.dtypes), ids=list(settings.dtypes))
        def dtype(self, request: pytest.FixtureRequest) -> Any:
            """torch dtype: fp32, bf16, fp16."""
            import torch

            return getattr(torch, DTYPES[request.param])

        @pytest.fixture(params=list(settings.biases), ids=list(settings.biases))
        def bias(self, request: pytest.FixtureRequest) -> bool:
            """Whether the LM head has a bias (ids nobias / bias)."""
            return BIASES[request.param]

        @pytest.fixture(params=list(settings.shards), ids=list(settings.shards))
        def vocab_shards(self, request: pytest.FixtureRequest, vocab_shards_size: int | None) -> VocabShards:
            """Even and uneven vocab layouts (ids even / uneven); on a rank, bound to that rank's range."""
            plan = _plan(request)
            ws = plan.world_size if plan is not None else request.config.stash[STATE].settings.world_size
            if vocab_shards_size is None:
                return VocabShards(request.param, ws)
            return VocabShards(request.param, ws, vocab_size=int(vocab_shards_size))

    return GridFixtures()


# ---------------------------------------------------------------------------------------------------- dispatch
def _seed(nodeid: str) -> int:
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


def _run_test_command(item: pytest.Function) -> RunTest:
    obj = item.obj
    func = getattr(obj, "__func__", obj)
    module = item.module
    cls = item.cls
    qualname = f"{cls.__qualname__}.{item.originalname}" if cls is not None else item.originalname
    if "<locals>" in qualname:
        pytest.fail(f"{item.nodeid}: TP tests must be module-level functions or methods of module-level classes "
                    f"(the ranks look them up by name)", pytrace=False)
    names = [p for p in inspect.signature(obj).parameters]
    kwargs = {n: item.funcargs[n] for n in names if n in item.funcargs}
    code = extra = None
    if isinstance(func, types.FunctionType) and func.__closure__ is None:
        code = marshal.dumps(func.__code__)  # the parent's assertion-rewritten code object
        extra = {k: v.__name__ for k, v in func.__globals__.items()
                 if k.startswith("@") and isinstance(v, types.ModuleType)}
    return RunTest(nodeid=item.nodeid, module_name=module.__name__, module_file=module.__file__, qualname=qualname,
                   kwargs=_pickled_kwargs(item, kwargs), sys_path=list(sys.path), seed=_seed(item.nodeid),
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


def _apply(item: pytest.Item, run: Any, plan: Plan, label: str = "") -> None:
    """Report a PoolRun as this test's outcome (attach outputs; skip, xfail or raise RankFailure)."""
    from .report import failure_class, merge

    _attach_outputs(item, run.outputs, label)
    pool_desc = plan.key.describe() if plan.devices != ("external",) else "torchrun"
    verdict = merge(run, plan.world_size, timeout_s=plan.timeout_s, test_file=str(item.path),
                    pool_desc=pool_desc)
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
        from .report import RankFailure

        failure = RankFailure(verdict.headline, verdict.text)
    raise failure


def _pool_for(state: State, plan: Plan) -> Any:
    from .pool import PoolStartError
    from .report import RankFailure

    try:
        return state.manager.get(plan.key)
    except PoolStartError as exc:
        raise RankFailure(str(exc).splitlines()[0], "E   " + str(exc)) from None


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    plan = pyfuncitem.stash.get(PLAN, None)
    if plan is None or plan.in_parent:
        return None
    state = pyfuncitem.config.stash[STATE]
    cmd = _run_test_command(pyfuncitem)
    if state.external is not None:
        run = state.external.run_test(pyfuncitem.obj, pickle.loads(cmd.kwargs), cmd.seed, plan.timeout_s,
                                      capture=pyfuncitem.config.getoption("capture", "fd") != "no")
    else:
        run = _pool_for(state, plan).run(cmd, plan.timeout_s)
    state.dispatched += 1
    _apply(pyfuncitem, run, plan)
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    from .report import RankFailure, TPLongRepr

    exc = call.excinfo.value if call.excinfo is not None else None
    if isinstance(exc, RankFailure) and rep.failed:
        loc_path, lineno, _ = item.location
        rep.longrepr = TPLongRepr(exc.text, exc.headline, loc_path, (lineno or 0) + 1)
    elif rep.skipped and call.when == "call" and SKIPPED_ON_RANKS in item.stash and isinstance(rep.longrepr, tuple):
        path, lineno, _ = item.reportinfo()  # report the test's location, not the plugin's
        rep.longrepr = (str(path), (lineno or 0) + 1, rep.longrepr[2])
    if call.when == "teardown" and PLAN in item.stash:
        rep.sections = [(title, _label_lines(title, text)) for title, text in rep.sections]
    return rep


_RANK_SECTION = re.compile(r"^Captured (?:stdout|stderr) rank (\d+)")


def _label_lines(title: str, text: str) -> str:
    """Prefix every line of a rank's captured output with ``[rank N]``, in the teardown report only.

    JUnit XML (``-o junit_logging=...``) writes the teardown report's captured output as one ``system-out`` /
    ``system-err`` text, joining the sections without their titles; the prefix keeps each line's rank. The
    terminal shows the call report's sections, whose titles already name the rank.
    """
    m = _RANK_SECTION.match(title)
    if m is None:
        return text
    return "".join(f"[rank {m.group(1)}] {line}" for line in text.splitlines(keepends=True))


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
                     seed=_seed(f"{self._item.nodeid}#{self._calls}"))
        run = _pool_for(self._state, self._plan).run(cmd, self._plan.timeout_s if timeout is None else timeout)
        self._state.dispatched += 1
        _apply(self._item, run, self._plan, label=f" (tp_pool.run #{self._calls})")
        return [pickle.loads(run.outcomes[r].value) for r in range(self.world_size)]
