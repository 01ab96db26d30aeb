"""What the kernels' entry points accept: the shapes, dtypes, devices and strides of a shard call's
tensors and of the kept softmax terms, checked before any launch (:mod:`.forward_programs` and
:mod:`.backward_programs` run these unless its caller passes ``checked=True``), with :class:`KernelInputError` naming what was expected."""

from __future__ import annotations

from typing import Optional

import torch

from .kept import KeptTerms
from .tiles import KERNEL_DTYPES, cdiv


class KernelInputError(ValueError):
    """A launcher got tensors of the wrong shape, dtype, device or layout."""


def check_inputs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 local_target: torch.Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise KernelInputError(
            f"expected hidden [N, D] and weight [V_local, D], got hidden {tuple(hidden.shape)} and weight "
            f"{tuple(weight.shape)}; flatten leading dims of hidden first")
    if hidden.shape[1] != weight.shape[1]:
        raise KernelInputError(
            f"hidden size mismatch: hidden has D={hidden.shape[1]} but weight has D={weight.shape[1]}")
    if hidden.dtype != weight.dtype:
        raise KernelInputError(f"hidden and weight dtypes differ ({hidden.dtype} vs {weight.dtype}); cast one")
    if hidden.dtype not in KERNEL_DTYPES:
        raise KernelInputError(f"unsupported dtype {hidden.dtype}; expected float32, bfloat16 or float16")
    dev = hidden.device
    if weight.device != dev or local_target.device != dev or (bias is not None
                                                              and bias.device != dev):
        devices = {hidden.device, weight.device, local_target.device} | ({bias.device} if bias is not None else set())
        raise KernelInputError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    if hidden.stride(1) != 1 or weight.stride(1) != 1:
        raise KernelInputError(
            "hidden and weight need unit stride along D (row-major); call .contiguous() on transposed inputs")
    if local_target.shape != (hidden.shape[0],) or local_target.dtype != torch.int64:
        raise KernelInputError(
            f"local_target must be int64 of shape [{hidden.shape[0]}], got {local_target.dtype} "
            f"{tuple(local_target.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise KernelInputError(f"bias must have shape [{weight.shape[0]}], got {tuple(bias.shape)}")


def check_kept(kept: Optional[KeptTerms], n: int, v: int, block_v: int) -> None:
    if kept is None:
        return
    values, scales = kept
    if (values.dtype not in KERNEL_DTYPES or values.dim() != 2
            or values.shape[0] != n or not 0 < values.shape[1] <= v or values.stride(1) != 1):
        raise KernelInputError(f"kept terms must be fp32, bf16 or fp16 [{n}, <= {v}] with unit column stride, got "
                               f"{values.dtype} {tuple(values.shape)}")
    tiles_kept = cdiv(values.shape[1], block_v)
    if (scales.dtype != torch.float32 or scales.dim() != 2 or scales.shape[0] != n
        or scales.shape[1] < tiles_kept
            or scales.stride(1) != 1):
        raise KernelInputError(f"kept scales must be fp32 [{n}, >= {tiles_kept}] with unit column stride, got "
                               f"{scales.dtype} {tuple(scales.shape)}")
