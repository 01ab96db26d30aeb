"""The plugin is opt-in: installed, it changes nothing in a project that did not ask; asked, it does
everything.

Every run here collects or runs plain tests only (no rank pool is started), so the file is cheap.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

pytest_plugins = ["pytester"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


@pytest.fixture(autouse=True)
def entry_points_load(tag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """These sessions load installed plugins as pytest does by default (the ``tag`` fixture turns
    that off)."""
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)

# An unrelated project with its own stress/gpu markers, its own --run-stress option and its own
# fixtures named like the plugin's (dtype, bias, reference, op_source).
PROJECT_CONFTEST = '''
import pytest

def pytest_addoption(parser):
    parser.addoption("--run-stress", action="store_true", help="the project's own flag")

@pytest.fixture(params=["half", "single"])
def dtype(request):
    return request.param

@pytest.fixture
def bias():
    return "project-bias"

@pytest.fixture
def reference():
    return "project-reference"
'''

PROJECT_TESTS = '''
import pytest

@pytest.mark.stress
def test_project_stress():
    pass

@pytest.mark.gpu
def test_project_gpu():
    pass

def test_project_fixtures(dtype, bias, reference):
    assert dtype in ("half", "single") and bias == "project-bias"
    assert reference == "project-reference"

def test_no_foreign_fixtures(request):
    print("FIXTURES", sorted(request.fixturenames))

def test_unknown_op_source(op_source):
    pass
'''

PROJECT_INI = ("[pytest]\nmarkers =\n    stress: the project's slow tests\n    gpu: the project's "
               "GPU tests\n")


def _outcome_lines(result: pytest.RunResult) -> list[str]:
    """Per-test verdict lines and printed fixture lists, without timings."""
    keep = []
    for line in result.outlines:
        line = re.sub(r"\s+\[\s*\d+%\]$", "", line)
        if re.match(r"^(test_\S+::\S+ (PASSED|FAILED|SKIPPED|ERROR)|FIXTURES "
                    r"|(PASSED|FAILED|SKIPPED|ERROR) )", line):
            keep.append(line)
    return keep


def _without_install_paths(line: str) -> str:
    """``line`` less the paths of this checkout and of the running environment."""
    for path in (ROOT, sys.prefix, os.path.realpath(sys.prefix)):
        line = line.replace(path, "<path>")
    return line


@pytest.mark.slow
def test_unrelated_project_is_unchanged(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makeconftest(PROJECT_CONFTEST)
    pytester.makepyfile(test_project=PROJECT_TESTS)
    pytester.makeini(PROJECT_INI)
    args = ("-v", "-rA", "-s", "-p", "no:cacheprovider", "--strict-markers")
    installed = pytester.runpytest_subprocess(*args)
    not_installed = pytester.runpytest_subprocess(*args, "-p", "no:pytest_tplogp")
    # the project's stress and gpu tests run, its fixtures win, op_source does not exist
    installed.assert_outcomes(passed=5, errors=1)
    assert _outcome_lines(installed) == _outcome_lines(not_installed), installed.stdout.str()
    # loaded (pytest lists the distribution), yet silent: no header line, no skip reason
    plugins = [line for line in installed.outlines if line.startswith("plugins:")]
    assert plugins and "tplogp" in plugins[0], installed.stdout.str()
    assert (not any("tplogp" in line for line in not_installed.outlines
                    if line.startswith("plugins:")))
    # (paths aside: a checkout named tplogp holds the virtual environment whose files tracebacks name)
    assert (not any("tplogp" in _without_install_paths(line) for line in installed.outlines
                    if not line.startswith("plugins:")))
    # the same fixtures exist either way
    fixtures = [[line for line in pytester.runpytest_subprocess("--fixtures", "-p",
                                                                "no:cacheprovider", *extra).outlines
                 if not line.startswith("plugins:") and " in " not in line]
                for extra in ((), ("-p", "no:pytest_tplogp"))]
    assert fixtures[0] == fixtures[1]
    # the project's --run-stress option does not clash with the plugin's options, which exist all
    # the same
    helps = pytester.runpytest_subprocess("--help").stdout.str()
    assert "--run-stress" in helps and "--tp-run-stress" in helps and "--tp=N" in helps


def test_the_shim_has_no_per_test_hooks() -> None:
    """What the entry point loads: an option adder and a configure-time switch, nothing per test."""
    import pytest_tplogp

    hooks = sorted(n for n in vars(pytest_tplogp) if n.startswith("pytest_"))
    assert hooks == ["pytest_addoption", "pytest_configure"]


TP_TESTS = '''
import pytest

@pytest.mark.tp(backend="nccl")  # skipped in the parent without GPUs: nothing is spawned
def test_tp(tp):
    pass

@pytest.mark.stress
def test_stress():
    pass

# a downstream project's own dtype and bias: the generic plugin has no fixture of these names,
# so nothing parametrizes the test
@pytest.fixture
def dtype():
    return "project-dtype"

@pytest.fixture
def bias():
    return "project-bias"

def test_project_dtype_bias(dtype, bias):
    assert (dtype, bias) == ("project-dtype", "project-bias")
'''


# every way of asking, each a pytester subprocess: the inner loop keeps -p
@pytest.mark.parametrize("how", ["-p", *(pytest.param(how, marks=pytest.mark.slow)
                                        for how
                                        in ("conftest", "--tp", "ini",
                                            "PYTEST_PLUGINS without autoload"))])
def test_asking_turns_everything_on(pytester: pytest.Pytester, tag: str,
                                    monkeypatch: pytest.MonkeyPatch,
                                    how: str) -> None:
    pytester.makepyfile(test_body=TP_TESTS)
    args = ["-v", "-rs", "-p", "no:cacheprovider"]
    if how == "-p":
        args += ["-p", "pytest_tplogp"]
    elif how == "conftest":
        pytester.makeconftest('pytest_plugins = ["pytest_tplogp"]\n')
    elif how == "--tp":
        args += ["--tp=2"]
    elif how == "ini":
        pytester.makeini("[pytest]\ntplogp = true\n")
    else:
        monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        monkeypatch.setenv("PYTEST_PLUGINS", "pytest_tplogp")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = pytester.runpytest_subprocess(*args)
    # the tp parametrization, stress tests skipped unless selected, the project's dtype/bias test
    # run once, as it is
    result.assert_outcomes(passed=1, skipped=2)
    # the header says how the run asked for the plugin
    reason = {"-p": "-p pytest_tplogp", "conftest": "pytest_plugins in conftest.py",
              "--tp": "--tp*",
              "ini": "ini tplogp = true", "PYTEST_PLUGINS without autoload": "PYTEST_PLUGINS"}[how]
    result.stdout.fnmatch_lines([f"tplogp: world size 2, *; on by {reason}"])
    result.stdout.fnmatch_lines(["*test_body.py::test_tp[[]tp2[]] SKIPPED*",
                                 "*test_body.py::test_stress SKIPPED*",
                                 "*test_body.py::test_project_dtype_bias PASSED*"])
    result.stdout.fnmatch_lines(["*stress test: select with -m stress*"])
    assert "--tp-dtype" not in pytester.runpytest_subprocess(*args, "--help").stdout.str()


LMHEAD_TESTS = '''
import pytest

def test_grid(dtype, bias):
    pass

@pytest.mark.tp(backend="nccl")  # skipped in the parent without GPUs: nothing is spawned
def test_tp(tp):
    pass
'''


@pytest.mark.slow
@pytest.mark.parametrize("how", ["-p", "conftest"])
def test_lmhead_fixtures_are_a_plugin_of_their_own(pytester: pytest.Pytester, tag: str,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   how: str) -> None:
    """``pytest_tplogp.lmhead`` brings tplogp's LM-head fixtures and options, and the generic plugin
    with them."""
    pytester.makepyfile(test_body=LMHEAD_TESTS)
    args = ["-v", "-rs", "-p", "no:cacheprovider", "--tp-dtype=fp32,bf16"]
    if how == "-p":
        args = ["-p", "pytest_tplogp.lmhead", *args]
    else:
        pytester.makeconftest('pytest_plugins = ["pytest_tplogp.lmhead"]\n')
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=4, skipped=1)  # 2 dtypes x 2 biases; the tp marker works
    reason = {"-p": "-p pytest_tplogp.lmhead", "conftest": "pytest_plugins in conftest.py"}[how]
    result.stdout.fnmatch_lines([f"tplogp: world size 2, *; on by {reason}",
                                 "*test_body.py::test_grid[[]bf16-bias[]] PASSED*"])
    assert "--tp-dtype" in pytester.runpytest_subprocess(*args, "--help").stdout.str()


def test_environment_variables_only_configure(pytester: pytest.Pytester, tag: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``TPLOGP_*`` variables set the plugin's options; they do not turn it on."""
    pytester.makepyfile(test_body=TP_TESTS)
    monkeypatch.setenv("TPLOGP_TP", "4")
    result = pytester.runpytest_subprocess("-k", "stress", "-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
