"""Settings of the plugin, resolved once per session with precedence CLI > environment > ini >
default.

Every setting has one row in :data:`SPECS`: its CLI flag, environment variable, ini key, default and
parser. A value that does not parse raises ``pytest.UsageError`` naming where it came from
(``--tp-timeout``, ``env TPLOGP_TP_TIMEOUT`` or ``ini tp_timeout``), what was expected and what
came.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

BACKENDS = ("auto", "gloo", "nccl")
START_METHODS = ("forkserver", "spawn")


@dataclass(frozen=True)
class Settings:
    world_size: int = 2
    backend: str = "auto"
    timeout_s: float = 120.0
    run_stress: bool = False
    threads: int = 0  # torch intra-op threads per CPU rank; 0 = cores // world size
    start_method: str = "forkserver"
    # --tp-pdb: this rank's breakpoint() and failures open pdb on a local port
    pdb_rank: int | None = None
    # a gpu test that NCCL cannot place: gloo ranks sharing the GPUs (off: skipped)
    gpu_share: bool = True


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def _non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


def _bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true/false")


def _on_off(raw: str) -> bool:
    low = raw.strip().lower()
    if low not in ("on", "off"):
        raise ValueError("expected on or off")
    return low == "on"


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return raw

    return parse


def subset(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(raw: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in raw.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise ValueError(f"expected a comma-separated subset of {', '.join(choices)}"
                             + (f"; unknown: {', '.join(bad)}" if bad else ""))
        return items

    return parse


@dataclass(frozen=True)
class Spec:
    field: str
    flag: str
    env: str
    ini: str
    parse: Callable[[str], Any]
    help: str
    metavar: str = ""
    is_flag: bool = False


SPECS: tuple[Spec, ...] = (
    Spec("world_size", "--tp", "TPLOGP_TP", "tp_world_size", _positive_int,
         "default world size of @pytest.mark.tp tests without world_size= (default 2)", "N"),
    Spec("backend", "--tp-backend", "TPLOGP_TP_BACKEND", "tp_backend", _choice(BACKENDS),
         "auto (NCCL with one GPU per rank when this process has enough GPUs, else gloo on CPU; "
         "gpu tests: gloo ranks sharing the GPUs, see --tp-gpu-share), gloo or nccl",
         "NAME"),
    Spec("timeout_s", "--tp-timeout", "TPLOGP_TP_TIMEOUT", "tp_timeout", _positive_float,
         "per-test deadline in seconds on the ranks (marker timeout= overrides; default 120)",
         "SECONDS"),
    Spec("run_stress", "--tp-run-stress", "TPLOGP_RUN_STRESS", "tp_run_stress", _bool,
         "run @pytest.mark.stress tests (also selected by -m stress)", is_flag=True),
    Spec("start_method", "--tp-start-method", "TPLOGP_TP_START_METHOD", "tp_start_method",
         _choice(START_METHODS), "how ranks start: forkserver (one process imports torch once, "
         "ranks are forks of it: fast starts and respawns) or spawn (a fresh interpreter per rank)",
         "NAME"),
    Spec("pdb_rank", "--tp-pdb", "TPLOGP_TP_PDB", "tp_pdb", _non_negative_int,
         "debug rank RANK: its breakpoint() and a failure of its body stop in pdb, served on a "
         "local port that the rank prints (needs -s; no deadline while it is set)", "RANK"),
    Spec("gpu_share", "--tp-gpu-share", "TPLOGP_TP_GPU_SHARE", "tp_gpu_share", _on_off,
         "on (default): a gpu test whose ranks outnumber this process's GPUs runs on gloo, its "
         "ranks sharing the GPUs (CUDA tensors); off: such a test is skipped", "on|off"),
    Spec("threads", "--tp-threads", "TPLOGP_TP_THREADS", "tp_threads", _non_negative_int,
         "torch intra-op threads per CPU rank (0 = cores // world size)", "N"),
)


#: The ini switch that turns the plugin on for a project (besides -p, pytest_plugins and any --tp...
#: option).
ENABLE_INI = "tplogp"


def addoption(parser: pytest.Parser, specs: tuple[Spec, ...] = SPECS) -> None:
    """Add the options of ``specs`` (CLI flag and ini key) once. Adding them changes nothing until
    the plugin is active. The generic plugin's (:data:`SPECS`) come with the ini switch;
    ``pytest_tplogp.lmhead`` adds its own."""
    group = parser.getgroup("tplogp", "tensor-parallel rank pool (pytest_tplogp; any --tp... "
                                      "option turns it on)")
    if any(option.names() == [specs[0].flag] for option in group.options):
        return
    if specs is SPECS:
        parser.addini(ENABLE_INI, help="turn pytest_tplogp on for this project (like -p "
                                       "pytest_tplogp)", type="bool",
                      default=False)
    for spec in specs:
        dest = f"tplogp_{spec.field}"
        help_text = f"{spec.help} [env {spec.env}, ini {spec.ini}]"
        if spec.is_flag:
            group.addoption(spec.flag, action="store_true", default=None, dest=dest, help=help_text)
        else:
            group.addoption(spec.flag, action="store", default=None, dest=dest,
                            metavar=spec.metavar, help=help_text)
        parser.addini(spec.ini, help=spec.help, type="string", default="")


def given_on_command_line(config: pytest.Config) -> str | None:
    """The first plugin flag given on the command line (e.g. ``--tp``), or None."""
    for spec in SPECS:
        value = config.getoption(f"tplogp_{spec.field}", None)
        if value is not None and value is not False:
            return spec.flag
    return None


def enabled_in_ini(config: pytest.Config) -> bool:
    return bool(config.getini(ENABLE_INI))


def resolve(config: pytest.Config, environ: dict[str, str] | None = None) -> Settings:
    """Resolve every setting (CLI > env > ini > default); raise ``pytest.UsageError`` naming the
    source."""
    return Settings(**resolve_values(config, SPECS, environ))


def resolve_values(config: pytest.Config, specs: tuple[Spec, ...],
                   environ: dict[str, str] | None = None
                   ) -> dict[str, Any]:
    """``{field: value}`` of the settings of ``specs`` that are given (CLI > env > ini);
    ``pytest.UsageError`` naming the source of a value that does not parse."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for spec in specs:
        cli = config.getoption(f"tplogp_{spec.field}")
        if cli is not None and cli is not False:
            raw, source = ("true" if cli is True else str(cli)), spec.flag
        elif env.get(spec.env, "") != "":
            raw, source = env[spec.env], f"env {spec.env}"
        else:
            ini = config.getini(spec.ini)
            if ini in ("", None):
                continue
            raw, source = str(ini), f"ini {spec.ini}"
        try:
            values[spec.field] = spec.parse(raw)
        except ValueError as exc:
            raise pytest.UsageError(
                f"pytest_tplogp: invalid value {raw!r} for {source}: {exc}") from None
    return values
