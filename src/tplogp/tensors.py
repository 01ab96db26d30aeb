"""Small tensor helpers shared by the tensor-parallel layer and the kernels' launchers (torch only)."""

from __future__ import annotations

import torch


def f32_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous fp32 tensor (itself when it already is one): the per-token inputs of the primitives."""
    if x.dtype != torch.float32:
        x = x.float()
    return x if x.is_contiguous() else x.contiguous()
