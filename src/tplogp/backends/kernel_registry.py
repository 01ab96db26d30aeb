"""Which source computes an op: a registry with a priority order and readable reasons.

``backend_for_call(source, device, dtype)`` resolves the backend of one call (``tplogp.get_op``
binds ``source``). With ``source=None`` (the runbook's "registry" path) the source is chosen per
device on each call: ``sm90`` on Hopper, then ``triton`` on CUDA, then ``native``; the choice is
logged once per device on the ``tplogp`` logger. An explicitly requested source that cannot run
raises :class:`SourceUnavailableError` with the backend's own reason. A source may also refuse one
case on a device where it otherwise runs (``unsupported_reason(device, dtype)``: for example no tile
configuration of the fused kernels fits the device's shared memory for that element size), or a
feature of the call (``missing_features``: ``{feature: reason}``, e.g. ``"support"`` for a call with
``support=``); automatic selection then takes the next source, an explicit request raises with that
reason. Backends are
imported lazily, so importing tplogp does no device work and does not need Triton.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Optional

import torch

from ..support import settings
from .base import ShardBackend

log = logging.getLogger("tplogp")

SOURCES: tuple[str, ...] = ("native", "triton", "sm90")
# Automatic selection tries these in order.
PRIORITY: tuple[str, ...] = ("sm90", "triton", "native")
OPS: tuple[str, ...] = ("linear_logp",)

_BACKEND_CLASSES: dict[str, tuple[str, str]] = {
    "native": ("tplogp.backends.native", "NativeBackend"),
    "triton": ("tplogp.backends.triton_backend", "TritonBackend"),
    "sm90": ("tplogp.backends.sm90_backend", "SM90Backend"),
}
_KERNEL_NAMES = {"native": "linear_logp_native", "triton": "fused_linear_logp_triton",
                 "sm90": "fused_linear_logp_sm90"}


class SourceUnavailableError(RuntimeError):
    """An explicitly requested source cannot run here."""


class _MissingBackend:
    """Stands in for a backend whose module is not part of this build."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self._reason = reason

    def unavailable_reason(self, device: Optional[torch.device] = None) -> Optional[str]:
        return self._reason


def check_op(name: str) -> None:
    if name not in OPS:
        raise KeyError(f"unknown op {name!r}; available ops: {', '.join(OPS)}")


def check_source(source: str) -> None:
    if source not in SOURCES:
        raise KeyError(f"unknown source {source!r} for linear_logp; available sources: {', '.join(SOURCES)} "
                       f"(or None for automatic selection)")


@functools.lru_cache(maxsize=None)
def get_backend(source: str) -> ShardBackend:
    """The backend object for ``source`` (imported on first use)."""
    check_source(source)
    module_name, cls_name = _BACKEND_CLASSES[source]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name in (module_name, "triton") or (exc.name or "").startswith("triton."):
            return _MissingBackend(source, f"{exc.name} is not installed")  # type: ignore[return-value]
        raise
    return getattr(module, cls_name)()


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def unavailable_reason(source: str, device: Optional[torch.device] = None,
                       dtype: Optional[torch.dtype] = None,
                       features: tuple[str, ...] = ()) -> Optional[str]:
    """None if ``source`` can run on ``device`` (default: current CUDA device, else CPU) and, when
    ``dtype`` is given, with inputs of that dtype, and a call with ``features`` (``"support"``);
    else why not."""
    backend = get_backend(source)
    device = device if device is not None else _default_device()
    why = backend.unavailable_reason(device)
    if why is None and dtype is not None:
        # optional: sources that refuse no case lack it
        refuse = getattr(backend, "unsupported_reason", None)
        why = refuse(device, dtype) if refuse is not None else None
    missing = getattr(backend, "missing_features", {})
    for feature in features if why is None else ():
        if feature in missing:
            return missing[feature]
    return why


_GPU_KERNELS: dict = {}


def gpu_kernels(device: torch.device, module: str):
    """``tplogp.kernels.<module>`` on a CUDA ``device`` where the ``triton`` source runs, else None:
    the Triton kernels that torch paths of the call (the sampler's passes, the support pairs'
    ``d_W``) take on a GPU. Decided once per device and module."""
    if device.type != "cuda":
        return None
    found = _GPU_KERNELS.get((device, module))
    if found is None:
        found = False
        if unavailable_reason("triton", device) is None:
            found = importlib.import_module(f"tplogp.kernels.{module}")
        _GPU_KERNELS[device, module] = found
    return found or None


def source_status(op: str = "linear_logp", device: Optional[torch.device] = None,
                  dtype: Optional[torch.dtype] = None) -> dict[str, Optional[str]]:
    """``{source: None or reason}`` for every source of ``op`` (on ``device``, for inputs of
    ``dtype`` if given)."""
    check_op(op)
    return {s: unavailable_reason(s, device, dtype) for s in SOURCES}


_logged_choice: set = set()


def select_source(device: torch.device, dtype: Optional[torch.dtype] = None,
                  features: tuple[str, ...] = ()) -> str:
    """Automatic choice for ``device`` (and inputs of ``dtype``, a call with ``features``): sm90 on
    Hopper, then triton on CUDA, then native."""
    reasons = {}
    for source in PRIORITY:
        if source != "native" and device.type != "cuda":
            reasons[source] = "automatic selection uses fused sources on CUDA devices only"
            continue
        why = unavailable_reason(source, device, dtype, features)
        if why is None:
            key = (str(device), source, dtype, features)
            if key not in _logged_choice:
                _logged_choice.add(key)
                skipped = "; ".join(f"{s}: {r}" for s, r in reasons.items())
                log.info("linear_logp on %s%s uses source %r%s", device,
                         "" if dtype is None else f" for {dtype}", source,
                         f" (skipped {skipped})" if skipped else "")
            return source
        reasons[source] = why
    # native always can
    raise SourceUnavailableError(f"no linear_logp source can run on {device}: {reasons}")


def require_source(source: str, device: Optional[torch.device],
                   dtype: Optional[torch.dtype] = None,
                   features: tuple[str, ...] = ()) -> ShardBackend:
    why = unavailable_reason(source, device, dtype, features)
    if why is not None:
        raise SourceUnavailableError(f"{_KERNEL_NAMES[source]} is unavailable: {why}")
    return get_backend(source)


_resolved_on_cuda: dict = {}
_resolved_elsewhere: dict = {}


def backend_for_call(source: Optional[str], device: torch.device,
                     dtype: Optional[torch.dtype] = None,
                     interpret: Optional[bool] = None,
                     features: tuple[str, ...] = ()) -> ShardBackend:
    """Resolve the backend that runs one call on ``device`` with inputs of ``dtype`` (and
    ``features``: ``("support",)`` for a call with ``support=``).

    The answer is remembered: on CUDA devices per (source, device index, dtype), since what decides
    it (installed modules, the device's compute capability and shared memory) does not change within
    a process; on other devices per (source, device type, dtype, ``TRITON_INTERPRET``), the one
    setting that decides there whether the Triton sources run (through the interpreter). The probes
    would cost host time on every call. Failures are not remembered (they raise each time)."""
    if device.type == "cuda":
        key = (source, device.index if device.index is not None else torch.cuda.current_device(),
               dtype, features)
        found = _resolved_on_cuda
    else:
        key = (source, device.type, dtype,
               settings.triton_interpret() if interpret is None else interpret, features)
        found = _resolved_elsewhere
    backend = found.get(key)
    if backend is None:
        backend = found[key] = _resolve(source, device, dtype, features)
    return backend


def _resolve(source: Optional[str], device: torch.device, dtype: Optional[torch.dtype],
             features: tuple[str, ...] = ()) -> ShardBackend:
    if source is None:
        return get_backend(select_source(device, dtype, features))
    return require_source(source, device, dtype, features)
