"""tplogp.settings: every environment variable the package reads, read at call time, with clear errors."""

import ast
from pathlib import Path

import pytest

import tplogp
from tplogp import checks, settings


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
    with pytest.raises(settings.SettingsError, match="TPLOGP_CHECKS must be one of .*'full'.*got 'quick'"):
        settings.checks_mode()
    # the operator reports it as an input error
    with pytest.raises(checks.LinearLogpInputError, match="TPLOGP_CHECKS"):
        checks.checks_mode()


def test_direct_launch_flag(monkeypatch):
    monkeypatch.delenv("TPLOGP_DIRECT_LAUNCH", raising=False)
    assert settings.direct_launch() is True
    for value, expected in (("0", False), ("off", False), ("1", True), ("Yes", True)):
        monkeypatch.setenv("TPLOGP_DIRECT_LAUNCH", value)
        assert settings.direct_launch() is expected
    monkeypatch.setenv("TPLOGP_DIRECT_LAUNCH", "maybe")
    with pytest.raises(settings.SettingsError, match="TPLOGP_DIRECT_LAUNCH must be one of"):
        settings.direct_launch()


def test_triton_interpret(monkeypatch):
    for value, expected in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert settings.triton_interpret() is expected


def test_only_settings_reads_the_environment():
    """No other module of the package reads os.environ / os.getenv, and the docstring lists every variable."""
    root = Path(tplogp.__file__).parent
    readers = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
                readers.append(str(path.relative_to(root)))
    assert set(readers) == {"settings.py"}, readers
    for name in (settings.WORKSPACE_MB, settings.CHECKS, settings.DIRECT_LAUNCH, settings.TRITON_INTERPRET):
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


def test_environment_reads_see_what_os_environ_holds(monkeypatch):
    """The settings' environment read (``os.environ``'s own mapping, keys encoded once) returns what
    ``os.environ.get`` does after every kind of write, and the plain read where that mapping is absent."""
    import os

    name = "TPLOGP_TEST_SETTING"
    monkeypatch.delenv(name, raising=False)
    assert settings._environ_get(name) is None
    monkeypatch.setenv(name, "1.5")
    assert settings._environ_get(name) == "1.5"
    os.environ[name] = "ünïcode value"
    assert settings._environ_get(name) == os.environ.get(name) == "ünïcode value"
    del os.environ[name]
    assert settings._environ_get(name) is None
    monkeypatch.setattr(settings, "_ENV_DATA", None)  # a Python whose os.environ has no such mapping
    monkeypatch.setenv(name, "2")
    assert settings._environ_get(name) == "2"
