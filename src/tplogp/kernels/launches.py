"""Each shard kernel's :class:`~.launch.Launch` for one layout, from sizes alone: grid, scalar
arguments, ``num_warps`` / ``num_stages`` and constexprs, for the pointer kernels
(:mod:`.forward_kernels`, :mod:`.backward_kernels`) and their Hopper TMA variants
(:mod:`.hopper_kernels`); and when the TMA variants may run (descriptor legality, the CUDA context
their descriptors need).

A builder's arguments are everything its launch depends on (hashable: :func:`~.launch.cached` keys
on them); the tensors a launch takes are listed in its docstring, in the kernel's order. A call's
options reach the builders as one bundle, :class:`KernelOptions` (its logit transform:
:class:`LogitTransform`), made once per ``ShardCall`` (``ShardCall.kernel_options``); this module
alone turns a bundle into the kernels' scalar arguments and constexprs.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Optional

import torch

from .backward_kernels import bwd_dlogits_kept_kernel, bwd_dlogits_kernel, dh_accum_kernel
from .forward_kernels import finalize_single_kernel, fwd_stats_kernel, merge_splits_kernel
from .hopper_kernels import bwd_dlogits_tma_kernel, fwd_stats_tma_kernel
from .launch import Launch
from .support_bits import bit_words
from .tiles import TileConfig, cdiv, interpreting

MERGE_BLOCK = 256  # tokens per program of the split merge and the one-shard finalize
_ACCURATE_LOG = not interpreting()  # libdevice's log on a GPU (fixed when the kernels are defined)


class LogitTransform(NamedTuple):
    """What the kernels apply to a raw logit ``y = hidden @ weight^T + bias``:
    ``z = cap(y) * inv_temperature`` with ``cap(y) = softcap * tanh(y / softcap)`` (the identity
    when ``softcap`` is None). Forward and backward alike; hashable (a cache key)."""

    inv_temperature: float = 1.0
    softcap: Optional[float] = None

    def scalars(self) -> tuple[float, float]:
        """The kernels' runtime arguments ``(inv_temp, softcap)`` (1.0 for no cap: not read)."""
        return self.inv_temperature, 1.0 if self.softcap is None else float(self.softcap)

    def constexprs(self) -> dict:
        """The kernels' constexpr of the transform."""
        return {"SOFTCAP": self.softcap is not None}


class KernelOptions(NamedTuple):
    """A call's options as the forward kernels take them: the logit transform and the optional
    stats (entropy, the logits' sum, the argmax). The backward builders take ``transform`` alone
    (their optional terms follow the gradients a call gets)."""

    transform: LogitTransform = LogitTransform()
    with_entropy: bool = False
    with_sum_z: bool = False
    with_argmax: bool = False


def stats_launch(n: int, v: int, d: int, stride_h: int, stride_w: int, has_bias: bool,
                 options: KernelOptions, cfg: TileConfig, precision: Optional[str],
                 kept_dims: Optional[tuple[int, int, int]], tma: bool = False,
                 keep_tma: bool = False, support: bool = False) -> Launch:
    """The forward statistics over S = cdiv(V, split_v) splits, one program per (token block,
    split). Tensors: ``hidden, weight, bias (or hidden), target, parts [3 or 4, S, N], kept values
    (or parts), kept scales (or parts), support bits (or parts)``. ``kept_dims``: the kept terms'
    and scales' row strides and the kept column count, or None (nothing kept: zeros, which the
    ``KEEP=False`` variant never reads). ``tma``: the Hopper kernel, ``hidden`` and ``weight`` as
    tensor descriptors (:func:`tma_ok`), and with ``keep_tma`` the kept terms too
    (:func:`kept_tma_ok`). ``options``: the logit transform and the optional stats (``parts`` then
    has up to 6 rows). ``support``: the columns outside a row's support are masked, read from the
    support's bitmask of the shard's columns, ``[N, cdiv(V, 32)]`` int32
    (:func:`.support_bits.column_bits`)."""
    num_splits = cdiv(v, cfg.split_v)
    stride_kept, stride_scale, v_keep = kept_dims if kept_dims is not None else (0, 0, 0)
    grid = (cdiv(n, cfg.block_n) * num_splits,)
    tail = ((stride_kept, stride_scale, v_keep) + options.transform.scalars()
            + (num_splits, num_splits * n, bit_words(v) if support else 0))
    common = dict(SPLIT_V=cfg.split_v, HAS_BIAS=has_bias, WITH_ENTROPY=options.with_entropy)
    flags = dict(options.transform.constexprs(), WITH_SUM_Z=options.with_sum_z,
                 WITH_ARGMAX=options.with_argmax, SUPPORT=support)
    blocks = dict(BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d,
                  GROUP_N=cfg.group_n, DOT_PRECISION=precision)
    if not tma:
        return Launch(fwd_stats_kernel, grid, (n, v, d, stride_h, stride_w) + tail, cfg.num_warps,
                      cfg.num_stages,
                      dict(common, EVEN_D=d % cfg.block_d == 0, KEEP=kept_dims is not None,
                           **blocks, **flags))
    descriptors = ((0, [cfg.block_n, cfg.block_d]), (1, [cfg.block_v, cfg.block_d]))
    if keep_tma:
        descriptors += ((5, [cfg.block_n, cfg.block_v]),)
    return Launch(fwd_stats_tma_kernel, grid, (n, v, d) + tail, cfg.num_warps, cfg.num_stages,
                  dict(common, KEEP=kept_dims is not None, **blocks,
                       WARP_SPECIALIZE=cfg.warp_specialize, NUM_STAGES=cfg.num_stages,
                       KEEP_TMA=keep_tma, **flags), descriptors)


def merge_launch(n: int, num_splits: int, with_entropy: bool, with_sum_z: bool = False,
                 with_argmax: bool = False) -> Launch:
    """The split merge, one program per ``MERGE_BLOCK`` tokens. Tensors:
    ``parts, out [3 to 6, N]``."""
    return Launch(merge_splits_kernel, (cdiv(n, MERGE_BLOCK),), (n, num_splits, num_splits * n), 4,
                  None,
                  dict(WITH_ENTROPY=with_entropy, BLOCK=MERGE_BLOCK, WITH_SUM_Z=with_sum_z,
                       WITH_ARGMAX=with_argmax))


def finalize_launch(n: int, v: int, num_splits: int, with_entropy: bool, check_targets: bool,
                    with_sum_z: bool = False, with_argmax: bool = False) -> Launch:
    """The one-shard finalize, one program per ``MERGE_BLOCK`` tokens. Tensors:
    ``parts, target, out [4 to 8, N], target flag (or out)``."""
    return Launch(finalize_single_kernel, (cdiv(n, MERGE_BLOCK),),
                  (n, v, num_splits, num_splits * n), 4, None,
                  dict(WITH_ENTROPY=with_entropy, ACCURATE_LOG=_ACCURATE_LOG, BLOCK=MERGE_BLOCK,
                       CHECK_TARGETS=check_targets, WITH_SUM_Z=with_sum_z, WITH_ARGMAX=with_argmax))


def dlogits_launch(n: int, v: int, d: int, v_lo: int, v_hi: int, stride_h: int, stride_w: int,
                   stride_dz: int, stride_dbp: int, has_bias: bool, need_db: bool,
                   with_entropy: bool, transform: LogitTransform, cfg: TileConfig,
                   precision: Optional[str], tma: bool = False, with_sum_z: bool = False,
                   support: bool = False) -> Launch:
    """The d_logits recompute over the columns ``[v_lo, v_hi)``. Tensors:
    ``hidden, weight, bias (or hidden), target, row_max, log_sum, g, g - g_lse, g_entropy, mean_rel,
    g_sum_z, dz, dbp, support bits (or dz)``. ``tma``: the Hopper kernel, ``hidden`` and ``weight``
    as tensor descriptors. ``with_sum_z``: the call has a gradient of the logits' sum
    (``g_sum_z``). ``support``: the columns outside a row's support get ``dz = 0``, read from the
    support's bitmask of the chunk's columns, ``[N, cdiv(v_hi - v_lo, 32)]`` int32
    (:func:`.support_bits.column_bits`)."""
    grid = (cdiv(n, cfg.bwd_block_n) * cdiv(v_hi - v_lo, cfg.bwd_block_v),)
    flags = dict(HAS_BIAS=has_bias, NEED_DB=need_db, WITH_ENTROPY=with_entropy)
    options = dict(transform.constexprs(), WITH_SUM_Z=with_sum_z)
    blocks = dict(BLOCK_N=cfg.bwd_block_n, BLOCK_V=cfg.bwd_block_v, BLOCK_D=cfg.bwd_block_d,
                  GROUP_N=cfg.group_n, DOT_PRECISION=precision)
    stride_sup = bit_words(v_hi - v_lo) if support else 0
    if not tma:
        return Launch(bwd_dlogits_kernel, grid,
                      (n, v, d, v_lo, v_hi, stride_h, stride_w, stride_dz, stride_dbp, stride_sup,
                       *transform.scalars()),
                      cfg.bwd_num_warps, cfg.bwd_num_stages,
                      dict(flags, EVEN_D=d % cfg.bwd_block_d == 0, **blocks, **options,
                           SUPPORT=support))
    return Launch(bwd_dlogits_tma_kernel, grid,
                  (n, v, d, v_lo, v_hi, stride_dz, stride_dbp, stride_sup, *transform.scalars()),
                  cfg.bwd_num_warps, cfg.bwd_num_stages,
                  dict(flags, **blocks, WARP_SPECIALIZE=cfg.warp_specialize,
                       NUM_STAGES=cfg.bwd_num_stages, **options, SUPPORT=support),
                  ((0, [cfg.bwd_block_n, cfg.bwd_block_d]),
                   (1, [cfg.bwd_block_v, cfg.bwd_block_d])))


def dlogits_kept_launch(n: int, v_lo: int, v_hi: int, stride_kept: int, stride_scale: int,
                        stride_dz: int, stride_dbp: int, transform: LogitTransform,
                        with_entropy: bool, need_db: bool, cfg: TileConfig,
                        precision: Optional[str], with_sum_z: bool = False) -> Launch:
    """d_logits from the kept terms over the columns ``[v_lo, v_hi)``: rows per program are the
    config's own for this pass, but the backward's when d_bias partial rows are written. Tensors:
    ``kept values, kept scales, target, row_max, log_sum, g, g - g_lse, g_entropy, mean_rel,
    g_sum_z, dz, dbp`` (``with_sum_z``: as in :func:`dlogits_launch`)."""
    block_n = cfg.bwd_block_n if need_db or cfg.kept_block_n is None else cfg.kept_block_n
    num_warps = cfg.bwd_num_warps if need_db or cfg.kept_num_warps is None else cfg.kept_num_warps
    return Launch(bwd_dlogits_kept_kernel, (cdiv(n, block_n) * cdiv(v_hi - v_lo, cfg.block_v),),
                  (n, v_lo, v_hi, stride_kept, stride_scale, stride_dz, stride_dbp,
                   *transform.scalars()),
                  num_warps, None, dict(NEED_DB=need_db, WITH_ENTROPY=with_entropy, BLOCK_N=block_n,
                                        BLOCK_V=cfg.block_v, DOT_PRECISION=precision,
                                        **transform.constexprs(), WITH_SUM_Z=with_sum_z))


def dh_launch(n: int, k: int, d: int, stride_dz: int, stride_w: int, stride_dh: int,
              accumulate: bool, cfg: TileConfig, precision: Optional[str]) -> Launch:
    """The deterministic ``d_hidden (+)= dz @ W[chunk]``. Tensors:
    ``dz [N, K], W rows [K, D], d_hidden fp32``."""
    return Launch(dh_accum_kernel, (cdiv(n, cfg.dh_block_n) * cdiv(d, cfg.dh_block_d),),
                  (n, k, d, stride_dz, stride_w, stride_dh), cfg.dh_num_warps, cfg.dh_num_stages,
                  dict(ACCUMULATE=accumulate, BLOCK_N=cfg.dh_block_n, BLOCK_D=cfg.dh_block_d,
                       BLOCK_K=cfg.dh_block_k, GROUP_N=cfg.group_n, DOT_PRECISION=precision))


# ----------------------------------------------------------------------------------------------- TMA legality


def _descriptor_legal(t: torch.Tensor) -> bool:
    """A tensor descriptor over the 2-D ``t`` needs a 16-byte aligned base and row stride, and unit
    column stride."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 and t.stride(1) == 1


def tma_ok(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """The TMA loads of hidden and weight are legal (:func:`_descriptor_legal`); else the pointer
    kernels run."""
    return _descriptor_legal(hidden) and _descriptor_legal(weight)


def kept_tma_ok(values: torch.Tensor) -> bool:
    """The kept terms ``[N, v_keep]`` can take the forward's TMA stores (:func:`_descriptor_legal`:
    ``v_keep`` a multiple of 8 for 16-bit terms, 4 for fp32 ones: every keep but a whole shard of
    another width)."""
    return _descriptor_legal(values)


_THREAD = threading.local()


def ensure_context(device: torch.device) -> None:
    """Make the device's primary CUDA context current on this thread (once per thread), before a TMA
    launch.

    Triton fills the TMA descriptors through the CUDA driver API, which, unlike the runtime API,
    does not bind the primary context to a thread that has none. Autograd runs the backward on its
    own device thread, and there the first TMA launch fails with "Failed to create tensor map
    descriptor: invalid device context" (in a fresh process whose first backward is an sm90 one).
    One runtime-API call binds it. Skipped while a CUDA graph is being captured (the capturing
    thread has a current context already)."""
    if getattr(_THREAD, "bound", False) or device.type != "cuda":
        return
    if not torch.cuda.is_current_stream_capturing():
        torch.cuda.current_stream(device).query()
        _THREAD.bound = True
