"""Launcher of :func:`.scale_kernels.scale_round_kernel`: ``out = round(t * g)`` with ``g`` a 0-d fp32 tensor on
``t``'s device, ``out`` either ``t`` (in place) or a contiguous tensor of ``t``'s shape in the dtype to round to."""

from __future__ import annotations

import torch

from .direct_launch import launcher
from .generic_launch import KernelInputError
from .scale_kernels import scale_round_kernel
from .tiles import KERNEL_DTYPES, cdiv, dot_precision

# Elements per program: 32 per thread at 8 warps, read and written in 16-byte vectors (one H200 pass over a bf16
# [128256, 4096] gradient in place is bandwidth-bound at these sizes).
SCALE_BLOCK = 8192
SCALE_WARPS = 8


def scale_round(t: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = (t.float() * g).to(out.dtype)`` elementwise, one rounding; returns ``out``."""
    if t.dtype not in KERNEL_DTYPES or out.dtype not in KERNEL_DTYPES:
        raise KernelInputError(f"scale_round takes fp32, bf16 or fp16 tensors, got {t.dtype} -> {out.dtype}")
    if out.shape != t.shape or not t.is_contiguous() or not out.is_contiguous():
        raise KernelInputError(f"scale_round needs contiguous t and out of one shape, got {tuple(t.shape)} "
                               f"(contiguous: {t.is_contiguous()}) and {tuple(out.shape)} "
                               f"(contiguous: {out.is_contiguous()})")
    if g.dim() != 0 or g.dtype != torch.float32 or g.device != t.device or out.device != t.device:
        raise KernelInputError(f"scale_round needs a 0-d fp32 scalar on {t.device} and out there too, got "
                               f"{g.dtype} {tuple(g.shape)} on {g.device}, out on {out.device}")
    n = t.numel()
    if n == 0:
        return out
    launcher(scale_round_kernel)((cdiv(n, SCALE_BLOCK),), t, out, g, n, BLOCK=SCALE_BLOCK,
                                 DOT_PRECISION=dot_precision(out.dtype), num_warps=SCALE_WARPS)
    return out
