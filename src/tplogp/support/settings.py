"""Every environment variable that the ``tplogp`` package reads, in one place.

Each accessor reads the environment when it is called (never at import), so a test or a launcher
that changes a variable is honoured by the next call that consults it. A malformed value raises
:class:`SettingsError` naming the variable, what was expected and what was found.

==========================  =========================  =================================================================
variable                    values (default)           effect
==========================  =========================  =================================================================
``TPLOGP_WORKSPACE_MB``     positive number of MiB     the call's ``workspace_bytes`` when it gives
none: the most memory
                            (unset: per source)        the op may hold beyond inputs, outputs and
                            gradients (transient
                                                       tiles plus terms kept for the backward).
                                                       Unset: each source's default
                                                       (``tplogp.backends.memory_budget.SOURCE_BUDGETS``; its table: docs/operator.md, "Memory budget")
``TPLOGP_CHECKS``           ``full`` | ``sync`` |      input checks of ``linear_logp``
(:mod:`tplogp.op.verdicts`):
                            ``fast`` (``full``)        ``sync`` reads the target check at the call
                            without a group;
                                                       ``fast`` checks each layout once, then skips
                                                       the checks (docs/operator.md, "Checks")
``TRITON_INTERPRET``        ``0`` | ``1`` (``0``)      Triton's own switch for its CPU interpreter;
tplogp reads it to
                                                       choose interpreter tile configs and code
                                                       paths
``RANK``, ``WORLD_SIZE``,   set by torchrun            this process's place in the job, read by the
runbook program ``LOCAL_RANK``,             (unset: not launched by    (:mod:`tplogp.runbook`) only,
never by the operator ``LOCAL_WORLD_SIZE``,       torchrun)
``TORCHELASTIC_RUN_ID``
==========================  =========================  =================================================================

An empty value means the default.
The pytest plugin's ``TPLOGP_TP*`` options belong to :mod:`pytest_tplogp` and are read there.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

WORKSPACE_MB = "TPLOGP_WORKSPACE_MB"
CHECKS = "TPLOGP_CHECKS"
TRITON_INTERPRET = "TRITON_INTERPRET"
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")

CHECK_MODES = ("full", "sync", "fast")
_MIB = 1 << 20


class SettingsError(ValueError):
    """An environment variable read by tplogp holds a value it cannot use."""


def _raw(name: str) -> Optional[str]:
    """The variable's value stripped of surrounding blanks, or None when unset or empty."""
    value = os.environ.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def workspace_bytes() -> Optional[int]:
    """``TPLOGP_WORKSPACE_MB`` in bytes, or None when unset (each source's default then applies:
    :func:`tplogp.backends.memory_budget.split`)."""
    value = _raw(WORKSPACE_MB)
    if value is None:
        return None
    try:
        mb = float(value)
    except ValueError as exc:
        raise SettingsError(f"{WORKSPACE_MB} must be a number of MiB, got {value!r}") from exc
    if not mb > 0 or mb == float("inf"):
        raise SettingsError(f"{WORKSPACE_MB} must be a positive finite number of MiB, got {value!r}")
    return max(int(mb * _MIB), 1)


def checks_mode() -> str:
    """``TPLOGP_CHECKS``: ``"full"`` (default), ``"sync"`` or ``"fast"``."""
    value = _raw(CHECKS)
    if value is None:
        return "full"
    mode = value.lower()
    if mode not in CHECK_MODES:
        raise SettingsError(f"{CHECKS} must be one of {CHECK_MODES}, got {value!r}")
    return mode


def layout_settings() -> tuple[Optional[str], Optional[str], bool]:
    """The variables that shape a call's plan: ``TPLOGP_CHECKS`` and ``TPLOGP_WORKSPACE_MB`` raw,
    unparsed and cheap (parsed when a layout is planned), and whether Triton's interpreter is on
    (:func:`triton_interpret`, which decides off CUDA whether the Triton sources run). Read once per
    call by :mod:`tplogp.op.plan`: part of the key under which it remembers a layout, and what the
    registry resolves the call's source with."""
    value = os.environ.get(TRITON_INTERPRET)
    return (os.environ.get(CHECKS), os.environ.get(WORKSPACE_MB),
            value is not None and value.strip() not in ("", "0"))


def workspace_setting() -> Optional[str]:
    """The raw value of ``TPLOGP_WORKSPACE_MB`` (unparsed, cheap: part of a source's layout key)."""
    return os.environ.get(WORKSPACE_MB)


def kernel_settings() -> tuple[Optional[str], Optional[str]]:
    """The raw values of ``TPLOGP_WORKSPACE_MB`` and ``TRITON_INTERPRET`` (unparsed, cheap: part of
    the key of a plan that depends on a source's budget and tiles)."""
    return os.environ.get(WORKSPACE_MB), os.environ.get(TRITON_INTERPRET)


def triton_interpret() -> bool:
    """Whether Triton's CPU interpreter is on (``TRITON_INTERPRET`` set to anything but empty or
    ``0``, as Triton reads it). Read by several launches of every call: one lookup, no helper
    calls."""
    value = os.environ.get(TRITON_INTERPRET)
    return value is not None and value.strip() not in ("", "0")


class LauncherEnv(NamedTuple):
    """This process's place in a job started by torchrun."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    under_torchrun: bool  # TORCHELASTIC_RUN_ID is set: torchrun's agent is this process's parent


def launcher_env() -> Optional[LauncherEnv]:
    """torchrun's variables, or None when ``RANK`` or ``WORLD_SIZE`` is unset (not a launched rank).

    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` default to the global values (one node).
    """
    rank, world = _raw("RANK"), _raw("WORLD_SIZE")
    if rank is None or world is None:
        return None
    values = {}
    for name, value, default in (("RANK", rank, None), ("WORLD_SIZE", world, None),
                                 ("LOCAL_RANK", _raw("LOCAL_RANK"), rank),
                                 ("LOCAL_WORLD_SIZE", _raw("LOCAL_WORLD_SIZE"), world)):
        text = default if value is None else value
        try:
            values[name] = int(text)
        except ValueError as exc:
            raise SettingsError(f"{name} must be an int, got {text!r}") from exc
    if values["WORLD_SIZE"] < 1 or not 0 <= values["RANK"] < values["WORLD_SIZE"]:
        raise SettingsError(f"RANK must be in [0, WORLD_SIZE), got RANK={rank!r}, WORLD_SIZE={world!r}")
    return LauncherEnv(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"],
                       values["LOCAL_WORLD_SIZE"], _raw("TORCHELASTIC_RUN_ID") is not None)
