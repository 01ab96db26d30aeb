"""Coverage of the ranks: a package whose functions run only inside TP bodies is reported 100% covered by pytest-cov
(pool mode, and under -n 2) and by ``coverage run -m pytest``, no ``.coverage.*`` file is left behind, and the ranks
do not import coverage when nothing measures."""

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
def test_pytest_cov_reports_rank_lines(pytester: pytest.Pytester, tag: str, extra: tuple[str, ...]) -> None:
    pytest.importorskip("pytest_cov")
    _write(pytester)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "--cov=tinypkg", "--cov-branch",
                                           "--cov-report=term-missing", *extra)
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["tinypkg/__init__.py * 9 * 0 * 4 * 0 * 100%", "TOTAL * 100%"])
    _no_leftover_data_files(pytester)


@pytest.mark.slow
def test_coverage_run_reports_rank_lines(pytester: pytest.Pytester, tag: str) -> None:
    pytest.importorskip("coverage")
    _write(pytester)
    result = pytester.run(sys.executable, "-m", "coverage", "run", "--branch", "--source=tinypkg", "-m", "pytest",
                          "-p", "pytest_tplogp", timeout=300)
    result.assert_outcomes(passed=3)
    report = pytester.run(sys.executable, "-m", "coverage", "report", "-m")
    report.stdout.fnmatch_lines(["tinypkg/__init__.py * 9 * 0 * 4 * 0 * 100%"])
    _no_leftover_data_files(pytester)


def test_ranks_do_not_import_coverage_when_nothing_measures(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_plain='''
        import sys
        import pytest

        @pytest.mark.tp(world_size=2)
        def test_no_coverage_on_ranks(tp):
            assert "coverage" not in sys.modules
    ''')
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp")
    result.assert_outcomes(passed=1)
