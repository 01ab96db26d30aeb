"""The ``triton`` and ``sm90`` sources' plan of a shard layout, made once per layout: the tile
config, the columns whose softmax terms the forward keeps for the backward and their buffer's words,
the d_logits workspace's part of the budget (:class:`ShardLayout`, :meth:`TritonLayouts._layout`),
and what the op asks of the kept terms ahead of a call (their bytes, shape and capacity) and at it
(the kept buffer and its views). A mixin of :class:`tplogp.backends.triton_backend.TritonBackend`:
it reads the source's ``name`` and tile config (``_cfg``). Nothing here imports Triton or touches
a device until a method is called.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import memory_budget
from ..support import settings
# (these three: torch only, no Triton import, no device work)
from ..kernels import kept as kept_layout
from ..kernels import tiles, workspace
from .base import KeptBuffers, ShardCall

MAX_LAYOUTS = 256  # shard layouts remembered per backend (the cache is emptied when full)


class ShardLayout(NamedTuple):
    """What the source's host code needs for one shard layout, computed once
    (:meth:`TritonLayouts._layout`)."""

    # the tile config of the dtype on the device (None: none could be had when
    cfg: Optional["tiles.TileConfig"]
    # planned, e.g. a device absent here; the launching methods then ask ``_cfg``, which raises the
    # reason)
    keep_block_v: int  # the forward's tile width that the kept scales are counted for
    # v_keep: the shard's first columns whose terms a forward for a backward keeps (0: none)
    keep_cols: int
    kept_values: int  # fp32 words of the kept terms (padded to 16 bytes); 0 when nothing is kept
    kept_scales: int  # fp32 words of the kept scales
    kept_dtype: torch.dtype  # the kept terms' dtype
    transient_bytes: int  # the d_logits workspace part of the budget (memory_budget.split)


class TritonLayouts:
    """The layout and kept-terms methods of the fused sources (module docstring)."""

    name: str

    def _layout(self, n: int, v: int, dtype: torch.dtype, device: torch.device,
                workspace_bytes: Optional[int], deterministic: bool = False) -> ShardLayout:
        """The :class:`ShardLayout` of an ``[n, d] x [v, d]`` call, cached per layout.

        Tile config, kept-terms plan and workspace split depend only on the shard's size, dtype and
        device, the call's budget, ``TPLOGP_WORKSPACE_MB`` and the kernels' dot precision (which
        follows ``torch.get_float32_matmul_precision()`` and ``TRITON_INTERPRET``): those form the
        key, read at each call (a change of any of them plans afresh). Planned per call, they cost
        several environment reads and table lookups per forward and backward (host time that matters
        at small shapes). Symbolic sizes (``kept_shape`` under ``torch.compile``'s dynamic shapes)
        are planned each time, uncached."""
        # symbolic sizes (a fake implementation's): never cached
        if type(n) is not int or type(v) is not int:
            return self._plan_layout(n, v, dtype, device, workspace_bytes, deterministic)
        cache = self.__dict__.setdefault("_layout_cache", {})
        key = (n, v, dtype, device, workspace_bytes, deterministic, settings.workspace_setting(),
               tiles.dot_precision(dtype))
        found = cache.get(key)
        if found is None:
            found = remember(cache, key,
                             self._plan_layout(n, v, dtype, device, workspace_bytes,
                                               deterministic), MAX_LAYOUTS)
        return found

    def _plan_layout(self, n: int, v: int, dtype: torch.dtype, device: torch.device,
                     workspace_bytes: Optional[int], deterministic: bool = False) -> ShardLayout:
        budget = memory_budget.split(self.name, workspace_bytes, device, deterministic)
        kept_dtype = kept_layout.kept_dtype(dtype)
        cfg = self._known_cfg(device, dtype)
        block_v = kept_layout.PLANNING_BLOCK_V if cfg is None else cfg.block_v
        # no budget: a call whose terms fit is kept whole (memory_budget's table)
        if budget.keep_whole:
            cols = workspace.keep_whole(n, v, budget.keep_whole, kept_dtype.itemsize, block_v)
        else:
            cols = workspace.plan_keep(n, v, budget.keep, kept_dtype.itemsize, block_v)
        values, scales = kept_layout.kept_words(n, cols, kept_dtype.itemsize,
                                                block_v) if cols else (0, 0)
        return ShardLayout(cfg, block_v, cols, values, scales, kept_dtype, budget.transient)

    def _launch_layout(self, hidden, weight, call: ShardCall) -> ShardLayout:
        """:meth:`_layout` of a call about to launch kernels: with its tile config (or ``_cfg``'s
        error)."""
        lay = self._layout(hidden.shape[0], weight.shape[0], hidden.dtype, hidden.device,
                           call.workspace_bytes, call.deterministic)
        if lay.cfg is None:
            lay = lay._replace(cfg=self._cfg(hidden.device, hidden.dtype))
        return lay

    def _known_cfg(self, device: torch.device, dtype: torch.dtype):
        """The tile config where it can be known here (the interpreter; a CUDA device that is
        present), else None (planned without the device, e.g. ``kept_shape`` ahead of a call, or
        nothing fits): no device probe then."""
        if torch.device(device).type != "cuda" or torch.cuda.is_available():
            try:
                return self._cfg(torch.device(device), dtype)
            except Exception:
                pass
        return None

    def _keep_block_v(self, device: torch.device, dtype: torch.dtype) -> int:
        """The forward's tile width (one kept scale per row and tile): the config's where it is
        known (:meth:`_known_cfg`), else the narrowest a fitted GPU config runs (planning ahead
        counts the most scales)."""
        cfg = self._known_cfg(device, dtype)
        return kept_layout.PLANNING_BLOCK_V if cfg is None else cfg.block_v

    def kept_bytes(self, n: int, v: int, dtype: torch.dtype, device: torch.device) -> int:
        """Bytes the forward keeps for the backward to skip the recompute of ``v`` columns of ``n``
        tokens: the softmax terms (2 bytes each for 16-bit inputs, 4 for fp32:
        :func:`tplogp.kernels.kept.kept_dtype`) and one fp32 scale per row and forward tile
        (:func:`tplogp.kernels.kept.kept_bytes`)."""
        return kept_layout.kept_bytes(n, v, kept_layout.kept_dtype(dtype).itemsize,
                                      self._keep_block_v(device, dtype))

    def _keep_columns(self, n: int, v: int, dtype: torch.dtype, device: torch.device,
                      call: ShardCall) -> int:
        """``v_keep``: the shard's first columns whose terms the forward keeps (0: none)."""
        if not call.for_backward:
            return 0
        return self._layout(n, v, dtype, device, call.workspace_bytes, call.deterministic).keep_cols

    def kept_shape(self, n: int, d: int, v: int, dtype: torch.dtype, device: torch.device,
                   call: ShardCall) -> tuple[int, ...]:
        """Shape of the flat fp32 buffer the forward keeps for the backward: the softmax terms of
        the first ``v_keep`` columns of the shard and their scales
        (:func:`tplogp.kernels.workspace.plan_keep`, :func:`tplogp.kernels.kept.kept_views`);
        ``(0,)``: nothing kept (no backward, or a budget or default that keeps nothing)."""
        if not call.for_backward:
            return (0,)
        lay = self._layout(n, v, dtype, device, call.workspace_bytes, call.deterministic)
        return (lay.kept_values + lay.kept_scales,) if lay.keep_cols else (0,)

    def kept_capacity(self, n: int, d: int, v: int, dtype: torch.dtype, device: torch.device,
                      call: ShardCall) -> tuple[int, ...]:
        """A flat fp32 buffer that holds what any call of at most ``n`` rows keeps
        (:func:`tplogp.kernels.workspace.keep_capacity`); ``(0,)``: none."""
        if not call.for_backward:
            return (0,)
        budget = memory_budget.split(self.name, call.workspace_bytes, device, call.deterministic)
        words = workspace.keep_capacity(n, v, max(budget.keep, budget.keep_whole),
                                        kept_layout.kept_dtype(dtype).itemsize,
                                        self._keep_block_v(device, dtype)) // 4
        return (words,) if words else (0,)

    @staticmethod
    def _kept_buffer(hidden, lay: ShardLayout, call: ShardCall, out: Optional[torch.Tensor] = None):
        """What the forward keeps, or None when nothing is kept: the flat fp32 buffer of
        :meth:`kept_shape`, or with ``call.scales_apart`` its two parts in their own allocations
        (:class:`~tplogp.backends.base.KeptBuffers`: the terms ``[N, keep_cols]`` in the kept dtype,
        the scales ``[N, tiles]`` fp32). The kernel writes every term and scale; the few padding
        bytes after the terms of the flat buffer are zeroed here, so its every byte is defined.
        ``out``: the flat buffer to keep into (the op's, ``ShardBackend``'s ``kept_out``), else
        allocated here."""
        if not (call.for_backward and lay.keep_cols):
            return None
        n = hidden.shape[0]
        device = hidden.device
        # each part in its final shape and dtype: no views to make per call (host time)
        if call.scales_apart:
            return KeptBuffers(torch.empty((n, lay.keep_cols), device=device, dtype=lay.kept_dtype),
                               torch.empty(kept_layout.kept_scales_shape(n, lay.kept_scales),
                                           device=device, dtype=torch.float32))
        words = lay.kept_values
        if out is None:
            kept = torch.empty(words + lay.kept_scales, device=device, dtype=torch.float32)
        else:
            assert out.shape == (words + lay.kept_scales,), (out.shape, words + lay.kept_scales)
            kept = out
        written = n * lay.keep_cols * lay.kept_dtype.itemsize // 4  # whole words of terms
        if written < words:
            kept[written:words].zero_()
        return kept

    @staticmethod
    def _kept_terms(kept, n: int, lay: ShardLayout, take_scales: bool = False):
        """The :class:`~tplogp.kernels.kept.KeptTerms` views of what the forward kept (None: nothing
        kept). ``take_scales`` (the backward): the scales leave the
        :class:`~tplogp.backends.base.KeptBuffers` holder for the KeptTerms, whose d_logits launcher
        drops them once read."""
        if kept is None:
            return None
        if isinstance(kept, KeptBuffers):
            return kept_layout.KeptTerms(kept.values,
                                         kept.take_scales() if take_scales else kept.scales)
        if kept.numel() == 0:
            return None
        # (made per call: views held on the buffer itself, an attribute, would keep it alive through
        # their base)
        return kept_layout.KeptTerms(*kept_layout.kept_views(kept, n, lay.keep_cols, lay.kept_dtype,
                                                             lay.keep_block_v))


def remember(cache: dict, key: tuple, value, limit: int):
    """``cache[key] = value``, the dict emptied first when it already holds ``limit`` other keys;
    returns ``value``. The layout cache (``MAX_LAYOUTS``) and the triton source's launch programs
    (``TritonBackend._programs``: a program, or ``False`` for a layout no program runs;
    ``triton_backend.MAX_PROGRAMS``)."""
    if key not in cache and len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value


__all__ = ["MAX_LAYOUTS", "ShardLayout", "TritonLayouts", "remember"]
