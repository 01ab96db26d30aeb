"""Launchers of the Hopper (sm_90) kernels: tensor descriptors over ``hidden`` and ``weight``, then the TMA kernels
of :mod:`.hopper_kernels`; the generic launchers (:mod:`.generic_launch`) do everything else (checks, buffers, the
split merge, the cuBLAS steps) and call these through their ``stats_launch`` / ``dlogits_launch`` hooks. Where the
descriptors are illegal (base or row stride not 16-byte aligned) they launch the generic kernels instead.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Optional

import torch

from .direct_launch import launcher
from .generic_launch import launch_dlogits, launch_stats, stats_plan
from .hopper_kernels import bwd_dlogits_tma_kernel, fwd_stats_tma_kernel
from .tiles import cdiv, dot_precision

try:  # host-side tensor descriptors (Triton >= 3.3); the sm90 source reports itself unavailable without them
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - old Triton
    TensorDescriptor = None


def _descriptor_legal(t) -> bool:
    """A tensor descriptor over the 2-D ``t`` needs a 16-byte aligned base and row stride, and unit column stride."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 and t.stride(1) == 1


def tma_ok(hidden, weight) -> bool:
    """The TMA loads of hidden and weight are legal (:func:`_descriptor_legal`)."""
    return _descriptor_legal(hidden) and _descriptor_legal(weight)


def kept_tma_ok(values) -> bool:
    """The kept terms ``[N, v_keep]`` can take the forward's TMA stores (:func:`_descriptor_legal`: ``v_keep`` a
    multiple of 8 for 16-bit terms, 4 for fp32 ones: every keep but a whole shard of another width)."""
    return _descriptor_legal(values)


_THREAD = threading.local()


def _ensure_context(device) -> None:
    """Make the device's primary CUDA context current on this thread (once per thread).

    Triton fills the TMA descriptors through the CUDA driver API, which, unlike the runtime API, does not bind the
    primary context to a thread that has none. Autograd runs the backward on its own device thread, and there the
    first TMA launch fails with "Failed to create tensor map descriptor: invalid device context" (on the H200,
    in a fresh process whose first backward is an sm90 one). One runtime-API call binds it. Skipped while a
    CUDA graph is being captured (the capturing thread has a current context already)."""
    if getattr(_THREAD, "bound", False) or device.type != "cuda":
        return
    if not torch.cuda.is_current_stream_capturing():
        torch.cuda.current_stream(device).query()
        _THREAD.bound = True


def _descriptor_defaults() -> Optional[dict]:
    """Defaults of TensorDescriptor's optional fields, or None when it has required fields beyond the four that
    ``_descriptor`` sets (a Triton this code does not know: use ``from_tensor``)."""
    found = {}
    for f in dataclasses.fields(TensorDescriptor):
        if f.default is not dataclasses.MISSING:
            found[f.name] = f.default
        elif f.name not in ("base", "shape", "strides", "block_shape"):
            return None
    return found


_DESC_DEFAULTS = _descriptor_defaults() if TensorDescriptor is not None else None


def _descriptor(tensor, block_shape: list):
    """``TensorDescriptor.from_tensor(tensor, block_shape)`` without its per-call validation (microseconds of host
    time on a small-shape call): what it asserts holds (``tma_ok``: 16-byte aligned base and row stride;
    ``check_inputs``, or the op's own checks for its calls: unit stride along D; empty calls return before any
    launch) and the block shapes come from the config table."""
    if _DESC_DEFAULTS is None:
        return TensorDescriptor.from_tensor(tensor, block_shape)
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(_DESC_DEFAULTS)
    desc.base, desc.shape, desc.strides, desc.block_shape = tensor, tensor.shape, tensor.stride(), block_shape
    return desc


def _descriptors(hidden, weight, block_n: int, block_v: int, block_d: int):
    _ensure_context(hidden.device)
    return _descriptor(hidden, [block_n, block_d]), _descriptor(weight, [block_v, block_d])


def launch_stats_tma(hidden, weight, bias, local_target, inv_temperature: float, with_entropy: bool, cfg,
                     kept=None):
    """The forward statistics on sm_90: ``(parts, S)`` (the ``stats_launch`` hook of
    :func:`.generic_launch.forward_stats`): the TMA kernel, or the generic one where descriptors are illegal. With
    ``kept`` the kernel also stores the softmax terms of the kept columns and their row scales (plain stores)."""
    if not tma_ok(hidden, weight):
        return launch_stats(hidden, weight, bias, local_target, inv_temperature, with_entropy, cfg, kept)
    n, d = hidden.shape
    v = weight.shape[0]
    parts, num_splits, grid, (p_kept, p_scale, stride_kept, stride_scale, v_keep) = stats_plan(
        hidden, weight, with_entropy, cfg, kept)
    d_h, d_w = _descriptors(hidden, weight, cfg.block_n, cfg.block_v, cfg.block_d)
    keep_tma = kept is not None and kept_tma_ok(kept.values)
    if keep_tma:
        p_kept = _descriptor(kept.values, [cfg.block_n, cfg.block_v])
    launcher(fwd_stats_tma_kernel)(
        grid, d_h, d_w, bias if bias is not None else hidden, local_target,
        parts, p_kept, p_scale, n, v, d, stride_kept, stride_scale, v_keep, inv_temperature, num_splits,
        num_splits * n,
        SPLIT_V=cfg.split_v, HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy, KEEP=kept is not None,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, GROUP_N=cfg.group_n,
        DOT_PRECISION=dot_precision(hidden.dtype), WARP_SPECIALIZE=cfg.warp_specialize, NUM_STAGES=cfg.num_stages,
        KEEP_TMA=keep_tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return parts, num_splits


def launch_dlogits_tma(hidden, weight, bias, local_target, row_max, log_sum, g, gmg, ge, mz, dz, dbp, v_lo, v_hi,
                       inv_temperature, with_entropy, need_db, cfg, precision: str) -> None:
    """One chunk's d_logits tiles on sm_90 (the ``dlogits_launch`` hook of :func:`.generic_launch.backward`): the TMA
    kernel, or the generic one where descriptors are illegal."""
    if not tma_ok(hidden, weight):
        return launch_dlogits(hidden, weight, bias, local_target, row_max, log_sum, g, gmg, ge, mz, dz, dbp, v_lo, v_hi,
                              inv_temperature, with_entropy, need_db, cfg, precision)
    n, d = hidden.shape
    d_h, d_w = _descriptors(hidden, weight, cfg.bwd_block_n, cfg.bwd_block_v, cfg.bwd_block_d)
    grid = (cdiv(n, cfg.bwd_block_n) * cdiv(v_hi - v_lo, cfg.bwd_block_v),)
    launcher(bwd_dlogits_tma_kernel)(
        grid, d_h, d_w, bias if bias is not None else hidden, local_target, row_max, log_sum, g, gmg, ge, mz, dz, dbp,
        n, weight.shape[0], d, v_lo, v_hi, dz.stride(0), dbp.stride(0) if need_db else 0, inv_temperature,
        HAS_BIAS=bias is not None, NEED_DB=need_db, WITH_ENTROPY=with_entropy,
        BLOCK_N=cfg.bwd_block_n, BLOCK_V=cfg.bwd_block_v, BLOCK_D=cfg.bwd_block_d, GROUP_N=cfg.group_n,
        DOT_PRECISION=precision, WARP_SPECIALIZE=cfg.warp_specialize, NUM_STAGES=cfg.bwd_num_stages,
        num_warps=cfg.bwd_num_warps, num_stages=cfg.bwd_num_stages,
    )
