"""Coverage of the ranks: a package whose functions run only inside TP bodies is reported 100%
covered by pytest-cov (pool mode, under -n 2, and under torchrun, where each rank runs its own
branch) and by ``coverage run -m pytest``, and no ``.coverage.*`` file is left behind (that the
ranks do not import coverage when nothing measures: test_plugin_only.py)."""

from __future__ import annotations

import sys

import pytest

pytest_plugins = ["pytester"]

PACKAGE = '''
def column(x, rank):
    if rank == 0:
        return x * 2
    return x * 3


def row(values):
    total = 0
    for v in values:
        total += v
    return total
'''

BODY = '''
import sys
import pytest
import tinypkg

@pytest.mark.tp(world_size=2)
def test_column(tp):
    assert tinypkg.column(1, tp.rank) == (2 if tp.rank == 0 else 3)

@pytest.mark.tp(world_size=2)
def test_row(tp):
    assert tinypkg.row([tp.rank, 1]) == tp.rank + 1

@pytest.mark.tp(world_size=2)
def test_ranks_measure(tp):
    assert "coverage" in sys.modules
'''


def _write(pytester: pytest.Pytester) -> None:
    pytester.mkpydir("tinypkg").joinpath("__init__.py").write_text(PACKAGE)
    pytester.makepyfile(test_tiny=BODY)


def _no_leftover_data_files(pytester: pytest.Pytester) -> None:
    leftovers = sorted(p.name for p in pytester.path.iterdir() if p.name.startswith(".coverage."))
    assert leftovers == []


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("-n", "2", "-p", "xdist")], ids=["pool", "xdist"])
def test_pytest_cov_reports_rank_lines(pytester: pytest.Pytester, tag: str,
                                       extra: tuple[str, ...]) -> None:
    pytest.importorskip("pytest_cov")
    _write(pytester)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-p", "pytest_cov",
                                           "--cov=tinypkg",
                                           "--cov-branch", "--cov-report=term-missing", *extra)
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["tinypkg/__init__.py * 9 * 0 * 4 * 0 * 100%", "TOTAL * 100%"])
    _no_leftover_data_files(pytester)


@pytest.mark.slow
def test_pytest_cov_under_torchrun_reports_every_rank(pytester: pytest.Pytester, tag: str,
                                                      torchrun) -> None:
    """Every torchrun rank is a pytest process with its own pytest-cov: rank 0's one report has
    every rank's lines (column()'s rank-0 branch runs only on rank 0, the other only on rank 1), and
    no rank leaves a data file of its own or writes a report of its part."""
    import xml.etree.ElementTree as ET

    pytest.importorskip("pytest_cov")
    _write(pytester)
    # each rank would write its XML report to a file of its own (coverage expands ${RANK} in its
    # configuration)
    (pytester.path / ".coveragerc").write_text("[xml]\noutput = cov-rank${RANK}.xml\n")
    result = torchrun("-p", "pytest_cov", "--cov=tinypkg", "--cov-branch",
                      "--cov-report=term-missing",
                      "--cov-report=xml", "--cov-config=.coveragerc")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["tinypkg/__init__.py * 9 * 0 * 4 * 0 * 100%", "TOTAL * 100%"])
    reports = sorted(p.name for p in pytester.path.glob("cov-rank*.xml"))
    assert reports == ["cov-rank0.xml"]  # rank 0 alone reports
    assert ET.parse(pytester.path / "cov-rank0.xml").getroot().get("branch-rate") == "1"
    _no_leftover_data_files(pytester)


@pytest.mark.slow
def test_coverage_run_reports_rank_lines(pytester: pytest.Pytester, tag: str) -> None:
    pytest.importorskip("coverage")
    _write(pytester)
    result = pytester.run(sys.executable, "-m", "coverage", "run", "--branch", "--source=tinypkg",
                          "-m", "pytest",
                          "-p", "pytest_tplogp", timeout=300)
    result.assert_outcomes(passed=3)
    report = pytester.run(sys.executable, "-m", "coverage", "report", "-m")
    report.stdout.fnmatch_lines(["tinypkg/__init__.py * 9 * 0 * 4 * 0 * 100%"])
    _no_leftover_data_files(pytester)
