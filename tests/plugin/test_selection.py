"""Collection-side behaviour: world-size ids and markers, stress selection, grids, header, settings,
GPU skips.

Most runs here use --collect-only or spawn nothing, so they are cheap.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

BODY = '''
import pytest

@pytest.mark.tp(world_size=[2, 4], timeout=60)
def test_sizes(tp):
    pass

@pytest.mark.tp
def test_default(tp):
    pass

def test_plain():
    pass

@pytest.mark.stress
def test_stress_plain():
    pass

@pytest.mark.stress
@pytest.mark.tp
def test_stress_tp(tp):
    pass

@pytest.mark.tp
def test_grid(tp, dtype, bias, vocab_shards):
    pass
'''


def test_world_size_ids_and_tp_markers(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body=BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp.lmhead", "--co", "-q")
    result.stdout.fnmatch_lines([
        "test_body.py::test_sizes[[]tp2[]]",
        "test_body.py::test_sizes[[]tp4[]]",
        "test_body.py::test_default[[]tp2[]]",
        "test_body.py::test_plain",
    ])
    result.stdout.fnmatch_lines(["test_body.py::test_grid[[]fp32-nobias-even-tp2[]]"])
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "--co", "-q", "-m", "tp4")
    result.stdout.fnmatch_lines(["test_body.py::test_sizes[[]tp4[]]",
                                 "1/* tests collected (* deselected)*"])
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "--co", "-q", "--tp=3", "-m",
                                           "tp3")
    result.stdout.fnmatch_lines(["test_body.py::test_default[[]tp3[]]"])


def test_grid_restriction(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body=BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp.lmhead", "--co", "-q", "-k",
                                           "test_grid",
                                           "--tp-dtype=bf16", "--tp-bias=bias",
                                           "--tp-shards=uneven")
    result.stdout.fnmatch_lines(["test_body.py::test_grid[[]bf16-bias-uneven-tp2[]]",
                                 "1/* tests collected*"])
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp.lmhead", "--co", "-q", "-k",
                                           "test_grid")
    result.stdout.fnmatch_lines(["12/* tests collected*"])


@pytest.mark.slow
def test_stress_selection(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body=BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-k", "stress_plain or plain",
                                           "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*stress test: select with -m stress or --tp-run-stress*"])
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-m", "stress", "-k", "plain")
    result.assert_outcomes(passed=1)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "--tp-run-stress", "-k",
                                           "stress_plain")
    result.assert_outcomes(passed=1)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "--co", "-q", "-m", "stress")
    result.stdout.fnmatch_lines(["test_body.py::test_stress_plain",
                                 "test_body.py::test_stress_tp[[]tp2[]]"])


def test_header_and_single_registration(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-p", "pytest_tplogp.hooks",
                                           "--tp=4")
    result.assert_outcomes(passed=1)
    header = [line for line in result.outlines if line.startswith("tplogp:")]
    assert len(header) == 1, result.outlines  # -p next to the entry point does not register twice
    assert header[0].startswith("tplogp: world size 4, backend gloo (auto), devices cpu, timeout "
                                "120 s")


def test_settings_precedence_and_errors(pytester: pytest.Pytester, tag: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\ntp_world_size = 3\ntp_timeout = 7\n")
    pytester.makepyfile(test_body="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp")
    result.stdout.fnmatch_lines(["tplogp: world size 3, *timeout 7 s*"])  # ini
    monkeypatch.setenv("TPLOGP_TP", "5")
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp")
    result.stdout.fnmatch_lines(["tplogp: world size 5, *timeout 7 s*"])  # env beats ini
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "--tp=6")
    result.stdout.fnmatch_lines(["tplogp: world size 6, *"])  # CLI beats env
    monkeypatch.setenv("TPLOGP_TP_TIMEOUT", "soon")
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp")
    result.stderr.fnmatch_lines(["*invalid value 'soon' for env TPLOGP_TP_TIMEOUT: could not "
                                 "convert*"])
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    monkeypatch.delenv("TPLOGP_TP_TIMEOUT")
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "--tp-backend=mpi")
    result.stderr.fnmatch_lines(["*invalid value 'mpi' for --tp-backend: expected one of auto, "
                                 "gloo, nccl*"])


GPU_BODY = '''
import pytest

@pytest.mark.gpu
@pytest.mark.tp
def test_needs_gpus(tp):
    raise AssertionError("never runs here")

@pytest.mark.tp(backend="nccl", world_size=4)
def test_nccl(tp):
    raise AssertionError("never runs here")

@pytest.mark.gpu
def test_plain_gpu():
    raise AssertionError("never runs here")

@pytest.mark.tp
def test_source(tp, op_source):
    pass
'''


POOL_REPORTER = '''
def pytest_sessionfinish(session):
    from pytest_tplogp.session import STATE

    state = session.config.stash.get(STATE, None)
    print("\\npool manager made:", state is not None and state._manager is not None)
'''


@pytest.mark.slow
def test_parent_side_skips_spawn_nothing(pytester: pytest.Pytester, tag: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU (CUDA_VISIBLE_DEVICES=-1), gpu and nccl TP tests and a plain gpu test are
    skipped in the parent at setup, each for far less than a pool start, and a fixture's skip
    (op_source) comes before the pool start too: no pool manager is ever made. None of the skips is
    a placement skip (no summary line)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    pytester.makepyfile(test_body=GPU_BODY)
    pytester.makeconftest(POOL_REPORTER)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp.lmhead", "-rs", "-s",
                                           "-k", "gpu or nccl or test_source",
                                           "--tp-op-source=sm90", "--durations=0",
                                           "--durations-min=0")
    result.assert_outcomes(skipped=4)
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] test_body.py:3: needs 2 distinct GPU(s) for NCCL "
                                 "(one per rank); this process has none*"])
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] test_body.py:8: needs 4 distinct GPU(s) for "
                                 "NCCL*"])
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] test_body.py:12: needs a CUDA device; this "
                                 "process has none*"])
    result.stdout.fnmatch_lines(["*op source sm90 unavailable on cpu: *"])
    result.stdout.no_fnmatch_line("*skipped for placement*")
    # decided in the parent at setup: nothing spawned, each skip costs (far) less than a pool start
    # (the op_source fixture's own setup imports the op's sources: not timed here)
    times = [float(line.split("s ", 1)[0]) for line in result.outlines
             if line.endswith(("]", "gpu")) and "test_source" not in line
             and line[:1].isdigit()]
    assert times and max(times) < 0.5, result.outlines
    # a fixture's skip (op_source) comes before the pool start too: no pool manager was ever made
    result.stdout.fnmatch_lines(["pool manager made: False"])


SPAWN_BODY = '''
import pytest
import torch
import torch.distributed as dist

@pytest.mark.tp
def test_collective(tp):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
'''


@pytest.mark.slow
def test_spawn_start_method(pytester: pytest.Pytester, tag: str) -> None:
    """The spawn start method (a fresh interpreter per rank) works as well as the default
    forkserver."""
    from tests.support.plugin_helpers import leftover_processes

    pytester.makepyfile(test_body=SPAWN_BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "--tp-start-method=spawn")
    result.assert_outcomes(passed=1)
    assert leftover_processes(tag) == []
