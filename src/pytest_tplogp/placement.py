"""Which tests are TP tests, what their ``@pytest.mark.tp(...)`` says, and where each one runs.

A *TP test* is a test marked ``@pytest.mark.tp(...)`` or requesting the ``tp`` / ``tp_pool``
fixture. Its marker gives world sizes (a parametrization), a deadline and a backend;
:func:`plan_for` turns that, the settings and this process's devices into a :class:`Plan` (backend,
devices, deadline, or the reason to skip before anything is spawned; for a ``gpu`` test that NCCL
cannot place, gloo ranks sharing the GPUs unless ``--tp-gpu-share=off``). A bad marker argument is a
``pytest.UsageError`` naming the test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from . import devices, options
from .options import Settings

MARKER_KWARGS = ("world_size", "timeout", "backend", "mesh")


@dataclass
class Plan:
    """Where and how one TP test runs (decided in the parent at setup)."""

    world_size: int
    backend: str
    devices: tuple[str, ...]  # GPU ids, ("cpu",), or ("external",) under torchrun
    timeout_s: float
    in_parent: bool  # tp_pool tests: body in the parent
    skip_reason: str | None = None
    # gloo ranks sharing GPUs: what and why (``devices.sharing_note``), for the report
    sharing: str | None = None

    @property
    def device_type(self) -> str:
        return "cpu" if self.devices == ("cpu",) else "cuda"

    @property
    def external(self) -> bool:
        return self.devices == ("external",)

    @property
    def key(self) -> Any:
        from .pool import PoolKey

        return PoolKey(self.world_size, self.backend, self.devices)

    def describe(self) -> str:
        return "torchrun" if self.external else self.key.describe()


def is_tp(marker: Any, fixturenames: Any) -> bool:
    return marker is not None or "tp" in fixturenames or "tp_pool" in fixturenames


def marker_args(marker: Any, where: str) -> dict[str, Any]:
    """The keyword arguments of a ``tp`` marker (a positional argument is the world size)."""
    if marker is None:
        return {}
    kwargs = dict(marker.kwargs)
    unknown = sorted(set(kwargs) - set(MARKER_KWARGS))
    if unknown:
        raise pytest.UsageError(f"{where}: unknown argument(s) {', '.join(unknown)} to "
                                f"@pytest.mark.tp; expected {', '.join(MARKER_KWARGS)}")
    if marker.args:
        if len(marker.args) > 1 or "world_size" in kwargs:
            raise pytest.UsageError(f"{where}: @pytest.mark.tp takes at most one positional "
                                    "argument (world_size)")
        kwargs["world_size"] = marker.args[0]
    return kwargs


def world_sizes(kwargs: dict[str, Any], default: int, where: str) -> list[int]:
    raw = kwargs.get("world_size", default)
    sizes = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    if (not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                             for n in sizes)):
        raise pytest.UsageError(f"{where}: @pytest.mark.tp(world_size=...) expects an int >= 1 or "
                                f"a list of them, got {raw!r}")
    return sizes


def plan_for(item: pytest.Item, world_size: int, settings: Settings,
             external_ctx: Any = None) -> Plan:
    """The :class:`Plan` of ``item`` at ``world_size`` (``external_ctx``: the torchrun rank context,
    if any)."""
    marker = item.get_closest_marker("tp")
    kwargs = marker_args(marker, item.nodeid)
    backend = kwargs.get("backend", settings.backend)
    if backend not in options.BACKENDS:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.tp(backend={backend!r}); expected "
                                f"one of {', '.join(options.BACKENDS)}")
    timeout = kwargs.get("timeout", settings.timeout_s)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.tp(timeout={timeout!r}) expects "
                                "seconds > 0")
    if settings.pdb_rank is not None:  # a rank in pdb is not a hang
        from .debug import DEBUG_WAIT_S

        timeout = DEBUG_WAIT_S
    fixturenames = getattr(item, "fixturenames", ())
    in_parent = "tp_pool" in fixturenames
    if in_parent and "tp" in fixturenames:
        raise pytest.UsageError(f"{item.nodeid}: a test requests either tp (body on the ranks) or "
                                f"tp_pool (body in the parent, explicit dispatch), not both")
    needs_gpu = item.get_closest_marker("gpu") is not None
    if external_ctx is not None:
        reason = None
        if world_size != external_ctx.world_size:
            reason = (f"needs world size {world_size}; torchrun started {external_ctx.world_size} "
                      "ranks")
        elif in_parent:
            reason = "tp_pool tests need the plugin's own pool; not available under torchrun"
        elif needs_gpu and external_ctx.device.type != "cuda":
            reason = "needs a GPU; the torchrun ranks run on CPU"
        return Plan(world_size, external_ctx.backend, ("external",), float(timeout), False, reason)
    p = devices.place(world_size, backend, needs_gpu=needs_gpu, share=settings.gpu_share)
    sharing = devices.sharing_note(p, world_size) if p.shared and p.skip_reason is None else None
    return Plan(world_size, p.backend, p.devices, float(timeout), in_parent, p.skip_reason, sharing)
