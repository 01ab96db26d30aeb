"""The fused loss's scaling launch (:func:`.scale_kernels.scale_round_kernel`):
``out = round(t * g)`` for up to three tensors in one launch, with ``g`` a 0-d fp32 tensor on their
device and each ``out`` either its ``t`` (in place) or a contiguous tensor of ``t``'s shape in the
dtype to round to. Its :class:`~.launch.Launch` is made once per sizes and dtypes
(:func:`~.launch.cached`)."""

from __future__ import annotations

from typing import Sequence

import torch

from .launch import Launch, cached
from .entry_checks import KernelInputError
from .scale_kernels import scale_round_kernel
from .tiles import KERNEL_DTYPES, cdiv, dot_precision

# Elements per program: 32 per thread at 8 warps, read and written in 16-byte vectors (one H200 pass
# over a bf16 [128256, 4096] gradient in place is bandwidth-bound at these sizes).
SCALE_BLOCK = 8192
SCALE_WARPS = 8
MAX_TENSORS = 3  # per launch: a loss's d_hidden, d_W and d_b


def _check(t: torch.Tensor, out: torch.Tensor, g: torch.Tensor) -> None:
    if t.dtype not in KERNEL_DTYPES or out.dtype not in KERNEL_DTYPES:
        raise KernelInputError(f"scale_round takes fp32, bf16 or fp16 tensors, got {t.dtype} -> {out.dtype}")
    if out.shape != t.shape or not t.is_contiguous() or not out.is_contiguous():
        raise KernelInputError(f"scale_round needs contiguous t and out of one shape, got {tuple(t.shape)} "
                               f"(contiguous: {t.is_contiguous()}) and {tuple(out.shape)} "
                               f"(contiguous: {out.is_contiguous()})")
    if g.dim() != 0 or g.dtype != torch.float32 or g.device != t.device or out.device != t.device:
        raise KernelInputError(f"scale_round needs a 0-d fp32 scalar on {t.device} and out there too, got "
                               f"{g.dtype} {tuple(g.shape)} on {g.device}, out on {out.device}")


def scale_launch(key: tuple) -> Launch:
    """The launch over ``key``'s ``(numel, dtype, out dtype, in place)`` tensors (at most
    :data:`MAX_TENSORS`; the missing ones have 0 elements): one program per ``SCALE_BLOCK`` elements
    of each, an in-place one skipped on the device when ``g == 1``. Tensors: ``g`` and each pair
    ``t, out``."""
    missing = MAX_TENSORS - len(key)
    numels = tuple(k[0] for k in key) + (0,) * missing
    precisions = [dot_precision(k[2]) for k in key] + [None] * missing
    in_place = [bool(k[3]) for k in key] + [False] * missing
    return Launch(scale_round_kernel, (sum(cdiv(n, SCALE_BLOCK) for n in numels),), numels,
                  SCALE_WARPS, None,
                  dict(BLOCK=SCALE_BLOCK, P0=precisions[0], P1=precisions[1], P2=precisions[2],
                       S0=in_place[0], S1=in_place[1], S2=in_place[2]))


def scale_round(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], g: torch.Tensor,
                checked: bool = False) -> None:
    """``out[:] = (t.float() * g).to(out.dtype)`` elementwise, one rounding, for every ``(t, out)``
    of ``pairs`` (at most :data:`MAX_TENSORS`), in one launch, made once per sizes and dtypes.
    ``checked``: the caller guarantees contiguous tensors of the kernel's dtypes, ``out`` of ``t``'s
    shape, and ``g`` a 0-d fp32 tensor on their device (the fused loss's backward); otherwise that
    is checked here."""
    if not 0 < len(pairs) <= MAX_TENSORS:
        raise KernelInputError(f"scale_round takes 1 to {MAX_TENSORS} tensors per launch, got {len(pairs)}")
    if not checked:
        for t, out in pairs:
            _check(t, out, g)
    pairs = [(t, out) for t, out in pairs if t.numel()]
    if not pairs:
        return
    launch = cached(scale_launch,
                    tuple((t.numel(), t.dtype, out.dtype, out is t) for t, out in pairs))
    tensors = [g]
    for t, out in pairs:
        tensors += (t, out)
    # unused segments: no elements, no programs
    tensors += tensors[1:3] * (MAX_TENSORS - len(pairs))
    launch(*tensors)
