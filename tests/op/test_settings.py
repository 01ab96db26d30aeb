"""tplogp.support.settings: every environment variable the package reads, read at call time, with
clear errors."""

import ast
from pathlib import Path

import pytest

import tplogp
from tplogp.support import settings
from tplogp.op import validation


def test_workspace_mb(monkeypatch):
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    assert settings.workspace_bytes() is None
    monkeypatch.setenv("TPLOGP_WORKSPACE_MB", "1.5")
    assert settings.workspace_bytes() == 3 << 19
    monkeypatch.setenv("TPLOGP_WORKSPACE_MB", " ")
    assert settings.workspace_bytes() is None
    for bad in ("lots", "0", "-3", "nan", "inf"):
        monkeypatch.setenv("TPLOGP_WORKSPACE_MB", bad)
        with pytest.raises(settings.SettingsError, match=f"TPLOGP_WORKSPACE_MB .*got '{bad}'"):
            settings.workspace_bytes()


def test_checks_mode(monkeypatch):
    monkeypatch.delenv("TPLOGP_CHECKS", raising=False)
    assert settings.checks_mode() == "full"
    monkeypatch.setenv("TPLOGP_CHECKS", " FAST ")
    assert settings.checks_mode() == "fast"
    monkeypatch.setenv("TPLOGP_CHECKS", "quick")
    with pytest.raises(settings.SettingsError,
                       match="TPLOGP_CHECKS must be one of .*'full'.*got 'quick'"):
        settings.checks_mode()
    # the operator reports it as an input error
    with pytest.raises(validation.LinearLogpInputError, match="TPLOGP_CHECKS"):
        validation.checks_mode()


def test_triton_interpret(monkeypatch):
    for value, expected in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert settings.triton_interpret() is expected


def test_only_settings_reads_the_environment():
    """No other module of the package reads os.environ / os.getenv, and the docstring lists every
    variable."""
    root = Path(tplogp.__file__).parent
    readers = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
                readers.append(str(path.relative_to(root)))
    assert set(readers) == {"support/settings.py"}, readers
    for name in (settings.WORKSPACE_MB, settings.CHECKS, settings.TRITON_INTERPRET):
        assert f"``{name}``" in settings.__doc__


def test_launcher_env(monkeypatch):
    for name in settings.LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert settings.launcher_env() is None
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert settings.launcher_env() == settings.LauncherEnv(3, 4, 3, 4, False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert settings.launcher_env() == settings.LauncherEnv(3, 4, 1, 2, True)
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(settings.SettingsError, match="LOCAL_RANK must be an int, got 'one'"):
        settings.launcher_env()
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(settings.SettingsError, match=r"RANK must be in \[0, WORLD_SIZE\)"):
        settings.launcher_env()
