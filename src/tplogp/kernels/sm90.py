"""Hopper (sm_90) variants of the fused kernels: tensor-memory-accelerator (TMA) tile loads.

Same algorithm as :mod:`.triton_forward` / :mod:`.triton_backward` (read those docstrings); the difference is how
operand tiles reach shared memory. ``hidden`` and ``weight`` are read through host-built tensor descriptors, so
each ``[BLOCK_N, BLOCK_D]`` / ``[BLOCK_V, BLOCK_D]`` tile is one bulk tensor copy (out-of-range rows and columns come
back as zeros, no mask arithmetic), feeding wgmma from shared memory. Optionally the K loop is warp-specialized
(producer warps issue the copies, consumer warpgroups run the MMAs and the softmax epilogue).

Usable only when the descriptors are legal: 16-byte aligned base pointers and row strides (``D * itemsize % 16``).
The launcher falls back to the generic kernels otherwise.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Optional

import torch
import triton
import triton.language as tl

from .configs import cdiv
from .direct_launch import launcher
from . import configs
from .launch import _launch_dlogits, _launch_stats, split_parts
from .triton_backward import _dlogits_epilogue
from .triton_forward import (FAST_EXP2, LOG2E, _grouped_ids, _mma, _natural_units, _online_softmax_update,
                             _split_bounds, _stats_program, _store_stats)

try:  # host-side tensor descriptors (Triton >= 3.3); the sm90 source reports itself unavailable without them
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - old Triton
    TensorDescriptor = None


@triton.jit
def _logits_tile_tma(
    d_h, d_w, off_n, off_v, D,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """fp32 ``[BLOCK_N, BLOCK_V]`` logits tile from two tensor descriptors."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for d0 in tl.range(0, D, BLOCK_D, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
        b_a = d_h.load([off_n, d0])  # [BLOCK_N, BLOCK_D]
        b_b = d_w.load([off_v, d0])  # [BLOCK_V, BLOCK_D]
        acc = _mma(b_a, b_b.T, acc, DOT_PRECISION)
    return acc


@triton.jit
def _fwd_stats_tma_kernel(
    d_h,  # descriptor over hidden [N, D], block [BLOCK_N, BLOCK_D]
    d_w,  # descriptor over weight [V, D], block [BLOCK_V, BLOCK_D]
    p_b,  # [V] bias (unused unless HAS_BIAS)
    p_tgt,  # [N] int64 local target (-1: not owned)
    p_parts,  # [3 or 4, S, N] fp32 split stats, out (see _fwd_stats_kernel)
    N, V, D,
    inv_temp,
    num_splits, plane,  # plane = S * N
    SPLIT_V: tl.constexpr,
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    i_n, i_s, o_n, m_n, b_max, b_sum, b_tl, b_sez = _stats_program(N, num_splits, BLOCK_N, GROUP_N)
    b_tgt = tl.load(p_tgt + o_n, mask=m_n, other=-1)
    c = inv_temp * LOG2E
    o_t = tl.arange(0, BLOCK_V)
    v_lo, v_full, v_hi = _split_bounds(i_s, V, SPLIT_V, BLOCK_V)
    for v0 in range(v_lo, v_full, BLOCK_V):  # full tiles
        acc = _logits_tile_tma(d_h, d_w, i_n * BLOCK_N, v0, D, BLOCK_N, BLOCK_V, BLOCK_D,
                               DOT_PRECISION, WARP_SPECIALIZE, NUM_STAGES)  # [BLOCK_N, BLOCK_V]
        b_max, b_sum, b_tl, b_sez = _online_softmax_update(acc, o_t, v0, V, p_b, b_tgt, b_max, b_sum, b_tl, b_sez, c,
                                                           False, HAS_BIAS, WITH_ENTROPY, FAST_EXP2, BLOCK_V)
    if v_full < v_hi:  # the shard's last tile, cut by V
        acc = _logits_tile_tma(d_h, d_w, i_n * BLOCK_N, v_full, D, BLOCK_N, BLOCK_V, BLOCK_D,
                               DOT_PRECISION, WARP_SPECIALIZE, NUM_STAGES)
        b_max, b_sum, b_tl, b_sez = _online_softmax_update(acc, o_t, v_full, V, p_b, b_tgt, b_max, b_sum, b_tl, b_sez, c,
                                                           True, HAS_BIAS, WITH_ENTROPY, FAST_EXP2, BLOCK_V)
    b_max, b_tl, b_sez = _natural_units(b_max, b_tl, b_sez, inv_temp)
    _store_stats(p_parts, plane, i_s.to(tl.int64) * N + o_n, m_n, b_max, b_sum, b_tl, b_sez, WITH_ENTROPY)


@triton.jit
def _bwd_dlogits_tma_kernel(
    d_h,  # descriptor over hidden [N, D], block [BLOCK_N, BLOCK_D]
    d_w,  # descriptor over weight [V, D], block [BLOCK_V, BLOCK_D]
    p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge, p_mz,  # see _bwd_dlogits_kernel
    p_dz,  # [N, v_hi - v_lo] d_logits workspace, out
    p_dbp,  # [cdiv(N, BLOCK_N), V] fp32 partial d_bias, out (only NEED_DB)
    N, V, D, v_lo, v_hi,
    stride_dz, stride_dbp,
    inv_temp,
    HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    i_n, i_v = _grouped_ids(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(v_hi - v_lo, BLOCK_V), GROUP_N)
    acc = _logits_tile_tma(d_h, d_w, i_n * BLOCK_N, v_lo + i_v * BLOCK_V, D, BLOCK_N, BLOCK_V, BLOCK_D,
                           DOT_PRECISION, WARP_SPECIALIZE, NUM_STAGES)  # [BLOCK_N, BLOCK_V]
    _dlogits_epilogue(acc, i_n, i_v, N, v_lo, v_hi, p_b, p_tgt, p_rmax, p_lsum, p_g, p_gmg, p_ge, p_mz, p_dz, p_dbp,
                      stride_dz, stride_dbp, inv_temp, HAS_BIAS, NEED_DB, WITH_ENTROPY, DOT_PRECISION, BLOCK_N, BLOCK_V)


def tma_ok(hidden, weight) -> bool:
    """Tensor descriptors need 16-byte aligned bases and row strides."""
    item = hidden.element_size()
    return (hidden.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and (hidden.stride(0) * item) % 16 == 0 and (weight.stride(0) * item) % 16 == 0)


_THREAD = threading.local()


def _ensure_context(device) -> None:
    """Make the device's primary CUDA context current on this thread (once per thread).

    Triton fills the TMA descriptors through the CUDA driver API, which, unlike the runtime API, does not bind the
    primary context to a thread that has none. Autograd runs the backward on its own device thread, and there the
    first TMA launch failed with "Failed to create tensor map descriptor: invalid device context" (seen on the
    H200, run 2, in a fresh process whose first backward was an sm90 one). One runtime-API call binds it. Skipped
    while a CUDA graph is being captured (the capturing thread has a current context already)."""
    if getattr(_THREAD, "bound", False) or device.type != "cuda":
        return
    import torch

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
    time on a small-shape call): the launchers have checked what it asserts (``tma_ok``: 16-byte aligned base and
    row stride; ``check_inputs``: unit stride along D, non-empty) and the block shapes come from the config table."""
    if _DESC_DEFAULTS is None:
        return TensorDescriptor.from_tensor(tensor, block_shape)
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(_DESC_DEFAULTS)
    desc.base, desc.shape, desc.strides, desc.block_shape = tensor, tensor.shape, tensor.stride(), block_shape
    return desc


def _descriptors(hidden, weight, block_n: int, block_v: int, block_d: int):
    _ensure_context(hidden.device)
    return _descriptor(hidden, [block_n, block_d]), _descriptor(weight, [block_v, block_d])


def launch_stats_sm90(hidden, weight, bias, local_target, inv_temperature: float, with_entropy: bool, cfg):
    """The forward statistics on sm_90: ``(parts, S)`` (see ``launch._split_stats``). The Gluon ping-pong kernel
    (``gluon_sm90``) when the config asks for it (``TileConfig.pingpong``, opt-in) and it can run here (Gluon in this
    Triton, 16-bit operands, legal descriptors); else the TMA kernel; else (descriptors illegal) the generic
    kernel."""
    if not tma_ok(hidden, weight):
        return _launch_stats(hidden, weight, bias, local_target, inv_temperature, with_entropy, cfg)
    if cfg.pingpong is not None and hidden.dtype in (torch.bfloat16, torch.float16):
        from . import gluon_sm90

        if gluon_sm90.available()[0]:
            _ensure_context(hidden.device)
            return gluon_sm90.launch_stats_pingpong(hidden, weight, bias, local_target, inv_temperature,
                                                    with_entropy, cfg.pingpong)
    n, d = hidden.shape
    v = weight.shape[0]
    num_splits = cdiv(v, cfg.split_v)
    parts = split_parts(hidden, num_splits, with_entropy)
    d_h, d_w = _descriptors(hidden, weight, cfg.block_n, cfg.block_v, cfg.block_d)
    grid = (cdiv(n, cfg.block_n) * num_splits,)
    launcher(_fwd_stats_tma_kernel)(
        grid, d_h, d_w, bias if bias is not None else hidden, local_target,
        parts, n, v, d, inv_temperature, num_splits, num_splits * n,
        SPLIT_V=cfg.split_v, HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, GROUP_N=cfg.group_n,
        DOT_PRECISION=configs.dot_precision(hidden.dtype), WARP_SPECIALIZE=cfg.warp_specialize, NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return parts, num_splits


def launch_dlogits_tma(hidden, weight, bias, local_target, row_max, log_sum, g, gmg, ge, mz, dz, dbp, v_lo, v_hi,
                       inv_temperature, with_entropy, need_db, cfg, precision: str) -> None:
    if not tma_ok(hidden, weight):
        return _launch_dlogits(hidden, weight, bias, local_target, row_max, log_sum, g, gmg, ge, mz, dz, dbp, v_lo, v_hi,
                               inv_temperature, with_entropy, need_db, cfg, precision)
    n, d = hidden.shape
    d_h, d_w = _descriptors(hidden, weight, cfg.bwd_block_n, cfg.bwd_block_v, cfg.bwd_block_d)
    grid = (cdiv(n, cfg.bwd_block_n) * cdiv(v_hi - v_lo, cfg.bwd_block_v),)
    launcher(_bwd_dlogits_tma_kernel)(
        grid, d_h, d_w, bias if bias is not None else hidden, local_target, row_max, log_sum, g, gmg, ge, mz, dz, dbp,
        n, weight.shape[0], d, v_lo, v_hi, dz.stride(0), dbp.stride(0) if need_db else 0, inv_temperature,
        HAS_BIAS=bias is not None, NEED_DB=need_db, WITH_ENTROPY=with_entropy,
        BLOCK_N=cfg.bwd_block_n, BLOCK_V=cfg.bwd_block_v, BLOCK_D=cfg.bwd_block_d, GROUP_N=cfg.group_n,
        DOT_PRECISION=precision, WARP_SPECIALIZE=cfg.warp_specialize, NUM_STAGES=cfg.bwd_num_stages,
        num_warps=cfg.bwd_num_warps, num_stages=cfg.bwd_num_stages,
    )
