"""Small tensor helpers shared by the tensor-parallel layer and the kernels' launchers (torch only)."""

from __future__ import annotations

import torch


def f32_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous fp32 tensor (itself when it already is one): the per-token inputs of the primitives."""
    if x.dtype != torch.float32:
        x = x.float()
    return x if x.is_contiguous() else x.contiguous()


def zero_rows(rows, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``x`` with 0 at the positions ``rows`` (a bool mask along ``dim``) marks; ``x`` itself when ``rows`` is None."""
    if rows is None:
        return x
    mask = rows.view(*([1] * dim), -1, *([1] * (x.dim() - dim - 1)))
    return torch.where(mask, torch.zeros((), dtype=x.dtype, device=x.device), x)
