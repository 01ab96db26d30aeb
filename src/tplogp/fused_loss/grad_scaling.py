"""Gradients scaled by an upstream scalar, the fp32 product rounded once: the backward of the fused
loss.

:func:`tplogp.linear_logp_loss` computes its gradients in the forward; its backward multiplies each
by the 0-d upstream gradient ``g``. Each result is ``round(t * g)``: the fp32 product rounded once
to the leaf's dtype, so that ``loss.backward()`` (``g == 1``) hands over the saved gradient rounded
once, bitwise.

On a GPU (and on the CPU under Triton's interpreter) ONE launch of
:mod:`tplogp.kernels.scale_kernels` scales every gradient of a call, reading ``g`` from its device
pointer (no host read); elsewhere torch ops scale them in flat blocks of
:data:`SCALE_BLOCK_ELEMENTS`, so that no gradient-sized fp32 transient is made.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from ..backends.triton_backend import triton_unavailable_reason
from ..kernels.tiles import KERNEL_DTYPES, interpreting

# Elements per block when torch ops scale a gradient: the fp32 product is a transient of this size,
# not of the gradient's (an fp32 [V_local, D] d_W would double its memory).
SCALE_BLOCK_ELEMENTS = 1 << 24


def scaled_all(grads: Sequence[Optional[torch.Tensor]], g: torch.Tensor,
               dtypes: Sequence[Optional[torch.dtype]],
               in_place: bool) -> tuple[Optional[torch.Tensor], ...]:
    """Scale every gradient of one call by the upstream scalar, each rounded once.

    Args:
        grads: the gradients computed in the forward (None stays None).
        g: the 0-d upstream gradient. One that requires a gradient (``create_graph=True``) gets
            differentiable torch ops.
        dtypes: per gradient, the dtype of the result (its leaf's).
        in_place: write over ``t`` when ``t`` is a contiguous tensor of its result dtype (no later
            backward reads it), else into a new tensor.
    Returns:
        ``round(t * g)`` per gradient, in ``grads``' order: with ``g == 1``, ``t`` rounded once
        (bitwise ``t`` when it is in that dtype).
    """
    if g.requires_grad and torch.is_grad_enabled():
        return tuple(None if t is None else (t.to(torch.float32) * g.to(torch.float32)).to(dt)
                     for t, dt in zip(grads, dtypes))
    g32 = kernel_device = None
    outs, pairs = [], []
    for t, dtype in zip(grads, dtypes):
        if t is None:
            outs.append(None)
            continue
        if g32 is None:
            g32 = g.detach() if g.requires_grad else g
            # (a no-op .to still parses its arguments)
            if g32.dtype != torch.float32 or g32.device != t.device:
                g32 = g32.to(device=t.device, dtype=torch.float32)
            kernel_device = runs_on(t.device)  # (asked once: the call's gradients share it)
        out = (t if in_place and t.dtype == dtype and t.is_contiguous()
               else torch.empty(t.shape, device=t.device, dtype=dtype))
        outs.append(out)
        if t.numel() == 0:
            continue
        if runs_kernel(t, dtype, kernel_device):
            pairs.append((t.contiguous(), out))
        else:
            _scaled_by_torch(t, g32, out)
    # (contiguous, of the kernel's dtypes and one shape each; g32 0-d fp32 on their device)
    if pairs:
        _scale_launch().scale_round(pairs, g32, checked=True)
    return tuple(outs)


def runs_on(device: torch.device) -> bool:
    """Whether the scaling kernel runs on ``device``: CUDA, or the CPU under Triton's
    interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def runs_kernel(t: torch.Tensor, dtype: torch.dtype, on_device: Optional[bool] = None) -> bool:
    """Whether :func:`scaled_all` scales ``t`` into ``dtype`` with the Triton kernel: a tensor on a
    device the kernel runs on (:func:`runs_on`; ``on_device``: that answer for ``t``'s device, asked
    here when None), of the dtypes the kernel takes, with Triton installed."""
    on = runs_on(t.device) if on_device is None else on_device
    return on and t.dtype in KERNEL_DTYPES and dtype in KERNEL_DTYPES and triton_usable()


@functools.lru_cache(maxsize=None)
def triton_usable() -> bool:
    """Whether Triton imports (:func:`tplogp.backends.triton_backend.triton_unavailable_reason`;
    asked once)."""
    return triton_unavailable_reason() is None


@functools.lru_cache(maxsize=None)
def _scale_launch():
    """:mod:`tplogp.kernels.scale_launch`, imported at the first scaling (it imports Triton)."""
    from ..kernels import scale_launch

    return scale_launch


def _scaled_by_torch(t: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> None:
    """``out = round(t * g)`` with torch ops (fp32 product in flat blocks: no gradient-sized fp32
    transient)."""
    # the product in fp32 is the result: one op
    if t.dtype == torch.float32 and out.dtype == torch.float32:
        if out is t:
            t.mul_(g)
        else:
            torch.mul(t, g, out=out)
        return
    src, dst = t.reshape(-1), out.view(-1)
    for i0 in range(0, src.numel(), SCALE_BLOCK_ELEMENTS):
        dst[i0:i0 + SCALE_BLOCK_ELEMENTS] = src[i0:i0 + SCALE_BLOCK_ELEMENTS].to(torch.float32) * g
