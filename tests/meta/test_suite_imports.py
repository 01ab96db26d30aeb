"""No test module imports another: what files of the suite share lives in ``tests/support``
(``tests.support.suite_imports`` states the rule and parses the imports)."""

from __future__ import annotations

from pathlib import Path

from tests.support.suite_imports import imported_names, violations

SUITE = Path(__file__).resolve().parents[1]


def test_no_test_module_imports_another():
    names = {name for path in SUITE.rglob("test_*.py") for _, name in imported_names(path, SUITE)}
    assert "tests.support.problems.make_problem" in names  # the walk reached the test modules' imports
    bad = violations(SUITE)
    assert not bad, "move what these share into tests/support:\n" + "\n".join(bad)


def test_the_checker_flags_every_kind_of_import_of_a_test_module(tmp_path):
    suite = tmp_path / "tests"
    for folder in ("", "support", "op"):
        (suite / folder).mkdir(exist_ok=True)
        (suite / folder / "__init__.py").write_text("")
    (suite / "support" / "helper.py").write_text("from . import shapes\nfrom tests.op import test_a\n")
    (suite / "op" / "test_a.py").write_text(
        "import os\nfrom tests.support.helper import x\nfrom tests import support\nfrom .. import support\n"
        "from ..support import helper\nX = 1\n")
    (suite / "op" / "test_b.py").write_text(
        "import importlib\nfrom tests.op.test_a import X\nfrom . import test_a\n\n"
        "def test_b():\n    import test_a\n    from tests import op\n"
        "    importlib.import_module('tests.op.test_a')\n    importlib.import_module('tests.support.helper')\n")
    (suite / "conftest.py").write_text("pytest_plugins = ['tests.op.test_a']\n")
    assert violations(suite) == [
        "tests/conftest.py:1 imports tests.op.test_a",
        "tests/op/test_b.py:2 imports tests.op.test_a.X",
        "tests/op/test_b.py:3 imports tests.op.test_a",
        "tests/op/test_b.py:6 imports test_a",
        "tests/op/test_b.py:7 imports tests.op",
        "tests/op/test_b.py:8 imports tests.op.test_a",
        "tests/support/helper.py:2 imports tests.op.test_a",
    ]
