"""Small tensor and device helpers shared by the call path and the kernels' launchers (torch only):
fp32 views, row masks, the support rows' keep-all marker, and the CUDA stream state (capture,
current stream)."""

from __future__ import annotations

from typing import Optional

import torch


# a row of a computed support (tplogp.op.sampler_support) whose first entry is KEEP_ALL keeps every
# id: a token whose sampler filters are all off (a given support never holds it: ids are >= -1);
# the call path, the native source and the kernels' support bitmask read it
KEEP_ALL = -2


def f32_contiguous(x: torch.Tensor, zero_at: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` as a contiguous fp32 tensor (itself when it already is one and ``zero_at`` is None):
    the per-token inputs of the primitives; 0 at the rows ``zero_at`` (a bool mask) marks."""
    if zero_at is not None:
        x = zero_rows(zero_at, x)
    if x.dtype != torch.float32:
        x = x.float()
    return x if x.is_contiguous() else x.contiguous()


def zero_rows(rows, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``x`` with 0 at the positions ``rows`` (a bool mask along ``dim``) marks; ``x`` itself when
    ``rows`` is None."""
    if rows is None:
        return x
    mask = rows.view(*([1] * dim), -1, *([1] * (x.dim() - dim - 1)))
    return torch.where(mask, torch.zeros((), dtype=x.dtype, device=x.device), x)


def expand_kept_rows(x: torch.Tensor, keep_idx: Optional[torch.Tensor], n_all: int, dim: int = 0,
                     fill: float = 0.0) -> torch.Tensor:
    """Undo the ignore_index compaction along ``dim``: ``n_all`` rows, ``fill`` at the ignored ones
    (``x`` itself when nothing was compacted)."""
    if keep_idx is None:
        return x
    shape = list(x.shape)
    shape[dim] = n_all
    return x.new_full(shape, fill).index_copy(dim, keep_idx, x)


def finish_rows(x: torch.Tensor, n_all: int, keep_idx: Optional[torch.Tensor],
                ignored: Optional[torch.Tensor], dim: int = 0, fill: float = 0.0) -> torch.Tensor:
    """An output of a call's rows as ``n_all`` rows along ``dim``, 0 at the ignored ones: zeroed in
    place where the ignored rows were kept in place (``ignored``, a bool mask), else expanded from
    the compacted rows ``keep_idx`` (``fill`` at the ignored ones; ``x`` itself when nothing was
    compacted)."""
    if ignored is not None:
        return zero_rows(ignored, x, dim)
    return expand_kept_rows(x, keep_idx, n_all, dim, fill)


def is_capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being captured into a CUDA graph now (host reads are then
    impossible)."""
    return device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing()


_current_streams: dict = {}


def current_stream(device: torch.device) -> "torch.cuda.Stream":
    """``torch.cuda.current_stream(device)`` without its Python wrapper's device-index resolution
    and ``Stream`` construction (host time on every call): the ``Stream`` object of a device is
    reused while the device's current stream is the same one."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream_id, device_index, device_type = torch._C._cuda_getCurrentStream(index)
    found = _current_streams.get(index)
    if found is None or found.stream_id != stream_id:
        found = _current_streams[index] = torch.cuda.Stream(stream_id=stream_id,
                                                            device_index=device_index,
                                                            device_type=device_type)
    return found
