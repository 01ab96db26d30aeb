"""The pytest hooks of the active plugin (parent side): configure, header, collection, setup, call
and reports.

Registered by the opt-in shim (``pytest_tplogp/__init__.py``, through ``optin.py``) when a run asks
for the plugin; it registers the fixture module (``fixtures.py``) at configure time. At collection a
TP test gets its world-size parametrization (``tp_world_size``, ids ``[tp2]``, ``[tp4]``, markers
``tp2``/``tp4``; with ``mesh=`` one parameter per mesh, ids ``[tp4-dp2xtp2]``); stress tests are
skipped unless selected; plain ``gpu`` tests are skipped without a GPU. At call time
``pytest_pyfunc_call`` hands a TP body to ``dispatch.run_body``. Public pytest API only.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import pytest

from . import devices, dispatch, fixtures, options, rank_coverage
from .mesh import MeshShapeError, parse_marker_meshes
from .placement import is_tp, marker_args, world_sizes
from .session import (ACTIVATED_BY, PLAN, RECYCLE_PROPERTY, SHARING_PROPERTY, SKIPPED_ON_RANKS,
                      STATE, State, register_marker)

# ------------------------------------------------------------------------------------------- config
def pytest_addoption(parser: pytest.Parser) -> None:
    # a no-op after the shim's: only for ``-p pytest_tplogp.hooks`` without the shim
    options.addoption(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # the fixture module is part of what a run opts into (registered, not imported by name: it is
    # imported already, so pytest's assertion rewriting must not be asked for it)
    if not config.pluginmanager.has_plugin(fixtures.__name__):
        config.pluginmanager.register(fixtures, fixtures.__name__)
    settings = options.resolve(config)
    if settings.pdb_rank is not None and config.getoption("capture", "fd") != "no":
        raise pytest.UsageError(f"pytest_tplogp: --tp-pdb={settings.pdb_rank} (or TPLOGP_TP_PDB, "
                                f"ini tp_pdb) needs -s: rank {settings.pdb_rank} prints the port "
                                "of its pdb as it stops, and that line must reach the terminal "
                                "while the test runs")
    register_marker(config, "tp", "tp(world_size=2|[2, 4], timeout=seconds, "
                    "backend='auto'|'gloo'|'nccl', mesh={'dp': 2, 'tp': 2}|[...]): run the test "
                    "body on every rank of a torch.distributed pool (pytest_tplogp)")
    register_marker(config, "stress", "large shapes; skipped unless selected with -m stress or "
                                      "--tp-run-stress")
    register_marker(config, "gpu", "needs a CUDA device (skipped before any spawn when there is "
                                   "none)")
    state = State(settings)
    config.stash[STATE] = state
    from . import external

    if external.detect():
        state.external = external.ExternalMode(settings)
        state.external.gather_coverage_on_rank0(config.pluginmanager)
        if state.external.ctx.rank != 0:
            # Report from rank 0 only: this runs before the terminal reporter is created with
            # sys.stdout, so the other ranks' reporters write to /dev/null (their verdicts reach
            # rank 0 through the outcome exchange).
            sys.stdout = open(os.devnull, "w")
            config.add_cleanup(sys.stdout.close)
            # rank 0 writes the one JUnit file, with every rank's verdict and output
            config.option.xmlpath = None
        elif state.external.restart and getattr(config.option, "xmlpath", None):
            # a restart of the job writes its tests beside the earlier attempts' file, not over it
            stem, ext = os.path.splitext(config.option.xmlpath)
            config.option.xmlpath = f"{stem}.restart{state.external.restart}{ext}"


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
    deadline = (f"timeout {s.timeout_s:g} s" if s.pdb_rank is None
                else f"no deadline (--tp-pdb={s.pdb_rank})")
    if state.external is not None:
        ctx = state.external.ctx
        return [f"tplogp: external mode (torchrun): world size {ctx.world_size}, backend "
                f"{ctx.backend}, device {ctx.device}; this report is rank {ctx.rank}'s; {deadline}"]
    worker = _header_worker(config)
    p = devices.place(s.world_size, s.backend, worker=worker)
    devs = "cpu" if p.device_type == "cpu" else "cuda:" + ",".join(p.devices)
    lines = [f"tplogp: world size {s.world_size}, backend {p.backend} ({s.backend}), devices "
             f"{devs}, {deadline}, rendezvous FileStore per session; {devices.block_note(worker)}; "
             f"on by {config.stash.get(ACTIVATED_BY, '-p pytest_tplogp.hooks')}"]
    if devices.visible_gpus():
        lines.append(f"tplogp: gpu tests at world size {s.world_size}: {_gpu_placement(s, worker)}")
    return lines


def _header_worker(config: pytest.Config) -> object:
    """Whose placement the header shows: this process's, or under an xdist controller worker
    gw0's."""
    if devices.xdist_worker() is not None:
        return devices.THIS_WORKER
    count = config.getoption("numprocesses", None)
    return (0, count) if isinstance(count, int) and count > 0 else None


def _gpu_placement(s: options.Settings, worker: object) -> str:
    g = devices.place(s.world_size, s.backend, needs_gpu=True, share=s.gpu_share, worker=worker)
    if g.skip_reason is not None:
        return f"skipped ({g.skip_reason})"
    if g.shared:
        return f"{devices.sharing_note(g, s.world_size, worker)}; --tp-gpu-share=off skips them"
    return f"{g.backend}, one GPU per rank (cuda:{','.join(g.devices)})"


# --------------------------------------------------------------------------------------- collection
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("tp")
    if not is_tp(marker, metafunc.fixturenames):
        return
    for m in metafunc.definition.iter_markers("parametrize"):
        names = m.args[0] if m.args else m.kwargs.get("argnames", "")
        if "tp_world_size" in (names.split(",") if isinstance(names, str) else names):
            return  # the author parametrized it directly
    config = metafunc.config
    state = config.stash[STATE]
    where = metafunc.definition.nodeid
    kwargs = marker_args(marker, where)
    sizes = world_sizes(kwargs, state.settings.world_size, where)
    values: list[Any] = list(sizes)
    if "mesh" in kwargs:  # one parameter per mesh, at the world size its sizes multiply to
        try:
            values = parse_marker_meshes(kwargs["mesh"], sizes if "world_size" in kwargs else None,
                                         where)
        # reported as this module's collection error: the message, no traceback
        except MeshShapeError as exc:
            raise pytest.Collector.CollectError(str(exc)) from None
    params = []
    for value in values:
        n = value if isinstance(value, int) else value.world_size
        if n not in state.registered_sizes:
            register_marker(config, f"tp{n}",
                            f"TP test at world size {n} (pytest_tplogp; select with -m tp{n})")
            state.registered_sizes.add(n)
        ident = f"tp{n}" if isinstance(value, int) else f"tp{n}-{value.id}"
        params.append(pytest.param(value, id=ident, marks=getattr(pytest.mark, f"tp{n}")))
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
        _resume_after_restart(session, state.external)


def _resume_after_restart(session: pytest.Session, mode: Any) -> None:
    """Under a torchrun restart: leave out the tests that an earlier attempt ran and reported."""
    done = min(mode.offset, len(session.items))
    if not done:
        return
    earlier = (f"tplogp (torchrun): restart {mode.restart} of {mode.max_restarts}: the first "
               f"{done} test(s) ran in earlier attempts ({mode.failed_earlier} failed, reported "
               f"above)")
    if done == len(session.items):  # an earlier attempt ran the rest and failed: a restart again
        pytest.exit(f"{earlier}; none left to run", returncode=pytest.ExitCode.TESTS_FAILED)
    skipped = session.items[:done]
    del session.items[:done]
    session.config.hook.pytest_deselected(items=skipped)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"{earlier}; resuming at {session.items[0].nodeid}", yellow=True)


# innermost: done before pytest-cov's wrapper saves and reports
@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtestloop(session: pytest.Session) -> Any:
    """After the last test, when this process measures coverage: stop the pools, whose ranks send
    their coverage data as they leave (``rank_coverage``), so that it is part of what pytest-cov (or
    ``coverage run``) reports. Under torchrun with pytest-cov, the other ranks send their data to
    rank 0, which adds it to its own."""
    result = yield
    state = session.config.stash[STATE]
    mode = state.external
    if mode is not None:
        exits_failed = session.testsfailed or mode.failed_earlier
        if mode.ctx.rank == 0 and mode.restarts_left and exits_failed:
            # this attempt exits non-zero, so torchrun starts another: it finds nothing left to run
            mode.record_progress(mode.offset + len(session.items), session.testsfailed)
        session.testsfailed += mode.failed_earlier  # the job fails when an earlier attempt's did
    if state._manager is not None and rank_coverage.measuring() is not None:
        state._manager.stop_pools()
    if state.external is not None and state.external.gathers_coverage:
        missing = state.external.send_or_merge_coverage()
        if missing:
            from .external import COVERAGE_WAIT_S
            from .protocol import format_ranks

            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line("tplogp (torchrun): the coverage data of "
                                    f"{format_ranks(missing)} did not come within "
                                    f"{COVERAGE_WAIT_S:g} s; their lines are reported as missed",
                                    yellow=True)
    return result


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    """Before the setup: a plain ``gpu`` test is skipped without a GPU, else its process's current
    CUDA device is the GPU that ``devices.one_gpu`` gives it (under xdist: its worker's). After the
    setup (every fixture set up, so no fixture of the test skips or fails it any more): the pool of
    a TP test starts, or respawns; its start-up is setup time, not the test's."""
    gpu = item.get_closest_marker("gpu")
    if (gpu is not None and not is_tp(item.get_closest_marker("tp"),
                                      getattr(item, "fixturenames", ()))):
        index = devices.one_gpu_index()
        if index is None:
            # a marker (not pytest.skip here) so the report points at the test, and the skipping
            # plugin applies it
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA device; this process has none "
                                                    f"({devices.block_note()})"))
        else:
            _use_cuda_device(index)
    result = yield
    plan = item.stash.get(PLAN, None)
    if plan is not None and not plan.external:
        dispatch.pool_for(item.config.stash[STATE], plan)
    return result


def _use_cuda_device(index: int) -> None:
    """Make ``cuda`` mean device ``index`` in this process (a plain ``gpu`` test's tensors, graphs
    and kernels).

    Device 0 is CUDA's current device until something selects another, and ``torch.cuda.set_device``
    initializes CUDA: so for device 0 in a process whose CUDA is not initialized yet there is
    nothing to do, and nothing is done (a test that a later setup hook skips does not initialize
    CUDA in this process). Once CUDA is initialized, the device is set every time (a previous test
    may have selected another one).
    """
    try:
        import torch
    except ImportError:
        return
    if index == 0 and not torch.cuda.is_initialized():
        return
    if torch.cuda.is_available() and index < torch.cuda.device_count():
        torch.cuda.set_device(index)


# --------------------------------------------------------------------------------------------- call
@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    plan = pyfuncitem.stash.get(PLAN, None)
    if plan is None or plan.in_parent:
        return None
    dispatch.run_body(pyfuncitem, pyfuncitem.config.stash[STATE], plan)
    return True


# ------------------------------------------------------------------------------------------ reports
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    from .report import RankFailure, label_rank_lines, longrepr_for

    exc = call.excinfo.value if call.excinfo is not None else None
    if isinstance(exc, RankFailure) and rep.failed:
        rep.longrepr = longrepr_for(item, exc.text, exc.headline, exc.crash)
    elif (rep.skipped and call.when == "call" and SKIPPED_ON_RANKS in item.stash
          and isinstance(rep.longrepr, tuple)):
        path, lineno, _ = item.reportinfo()  # report the test's location, not the plugin's
        rep.longrepr = (str(path), (lineno or 0) + 1, rep.longrepr[2])
    if call.when == "teardown" and PLAN in item.stash:
        rep.sections = [(title, label_rank_lines(title, text)) for title, text in rep.sections]
    return rep


@pytest.hookimpl(tryfirst=True)
def pytest_exception_interact(node: pytest.Item, call: pytest.CallInfo[None],
                              report: pytest.TestReport) -> None:
    """Before ``--pdb`` opens on a TP failure: say where the failure is, and that this debugger is
    not there."""
    from .report import RankFailure

    exc = call.excinfo.value if call.excinfo is not None else None
    if not isinstance(exc, RankFailure) or not node.config.getoption("usepdb", False):
        return
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    where = f" at {exc.crash[0]}:{exc.crash[1]}" if exc.crash else ""
    first = re.match(r"ranks? (\d+)", exc.headline)
    rank = first.group(1) if first else "R"
    reporter.write_line("")
    reporter.write_line(
        f"tplogp: {node.nodeid} failed on the ranks{where} ({exc.headline}). The body ran in the "
        "rank processes, so pytest's --pdb opens below in this process's dispatch code "
        "(pytest_tplogp.dispatch.apply: `p verdict.text` prints the report, `run.outcomes` holds "
        f"every rank's outcome). To debug the body on rank {rank}, rerun it with -s "
        f"--tp-pdb={rank}.", yellow=True)


def recycle_summary(reasons: list[str]) -> str:
    """``tplogp: 3 pool recycle(s): 2 x fresh-state check failed: CUDA memory N MiB above ...; 1 x
    ranks died``: the reasons grouped with their numbers taken out, most frequent first ("" when
    there was none)."""
    if not reasons:
        return ""
    groups: dict[str, int] = {}
    for reason in reasons:
        key = re.sub(r"\d+(?:\.\d+)?", "N", reason)
        groups[key] = groups.get(key, 0) + 1
    kinds = "; ".join(f"{n} x {key}" for key, n in sorted(groups.items(), key=lambda kv: -kv[1]))
    return f"tplogp: {len(reasons)} pool recycle(s): {kinds}"


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line counting the pool recycles and their reasons, one counting the GPU TP tests whose
    ranks shared GPUs over gloo, one counting the GPU tests skipped because their xdist worker owns
    too few GPUs (the controller sees every worker's reports)."""
    recycles = [str(value) for reports in terminalreporter.stats.values() for rep in reports
                if getattr(rep, "when", None) == "call"
                for name, value in getattr(rep, "user_properties", ()) if name == RECYCLE_PROPERTY]
    if recycles:
        terminalreporter.write_line(recycle_summary(recycles), yellow=True)
    shared = sum(1 for reports in terminalreporter.stats.values() for rep in reports
                 if getattr(rep, "when", None) == "call"
                 and any(name == SHARING_PROPERTY for name,
                         _ in getattr(rep, "user_properties", ())))
    if shared:
        terminalreporter.write_line(
            f"tplogp: {shared} gpu TP test(s) ran with ranks sharing GPUs over gloo: NCCL needs a "
            f"GPU per rank (-rA shows each one's placement; --tp-gpu-share=off skips them)")
    prefix = "Skipped: " + devices.PLACEMENT_SKIP_PREFIX
    count = sum(1 for rep in terminalreporter.stats.get("skipped", [])
                if isinstance(rep.longrepr, tuple) and str(rep.longrepr[2]).startswith(prefix))
    if count:
        terminalreporter.write_line(
            f"tplogp: {count} GPU test(s) skipped for placement: their xdist worker owns fewer "
            "GPUs than they need (run with -n <= GPUs // world size, or --tp-backend=gloo where a "
            f"test does not need a GPU; -rs lists them)", yellow=True)


_XDIST_KEY = "tplogp_longrepr"


@pytest.hookimpl(wrapper=True)
def pytest_report_to_serializable(config: pytest.Config, report: Any) -> Any:
    """Under pytest-xdist, send a TP failure's report as data, so the controller's summary line and
    JUnit get the same headline and grouped text as a run without xdist (not the text flattened into
    one string)."""
    from .report import TPLongRepr

    data = yield
    if isinstance(data, dict) and isinstance(getattr(report, "longrepr", None), TPLongRepr):
        data[_XDIST_KEY] = report.longrepr.to_dict()
    return data


@pytest.hookimpl(wrapper=True)
def pytest_report_from_serializable(config: pytest.Config, data: Any) -> Any:
    from .report import TPLongRepr

    report = yield
    if report is not None and isinstance(data, dict) and isinstance(data.get(_XDIST_KEY), dict):
        report.longrepr = TPLongRepr.from_dict(data[_XDIST_KEY])
    return report
