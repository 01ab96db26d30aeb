"""The ``triton`` source: fused Triton kernels, portable across the CUDA GPUs Triton supports.

Forward: one fused kernel computes each shard's softmax statistics in the epilogue of the logits
GEMM (online softmax over vocab tiles, target logit read from the fp32 accumulator) and never writes
logits; a second tiny kernel merges the vocab splits in a fixed order. Backward: a fused kernel
recomputes logits tiles and writes ``d_logits`` for one vocab chunk into a bounded workspace, then
GEMMs with fp32 accumulation produce ``d_hidden`` (fp32, partial) and ``d_weight``. See
:mod:`tplogp.kernels` and docs/kernels.md. A call with a sampler's support (``ShardCall.support``):
:mod:`tplogp.backends.fused_support`. No collectives here.

Runs on CPU through Triton's interpreter when ``TRITON_INTERPRET=1`` is set before the kernels are
first imported. Nothing is imported from Triton and no device is probed until a method is called.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import fused_support, memory_budget, native_support
from ..support import settings
# (these three: torch only, no Triton import, no device work)
from ..kernels import kept as kept_layout
from ..kernels import tiles, workspace
from .base import BlockStats, BudgetParts, KeptBuffers, ShardCall, ShardGrads, ShardStats, SingleShardOutputs

# Oldest architecture the kernels are tested for (bf16 tensor cores need sm_80; Triton itself needs
# sm_75+).
MIN_CAPABILITY = (8, 0)
MAX_LAYOUTS = 256  # shard layouts remembered per backend (the cache is emptied when full)
# launch programs remembered per backend (emptied when full): room for a few per layout of every
# plan the call path holds (tplogp.op.plan.MAX_PLANS)
MAX_PROGRAMS = 1024


class ShardLayout(NamedTuple):
    """What the source's host code needs for one shard layout, computed once
    (:meth:`TritonBackend._layout`)."""

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


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def triton_unavailable_reason() -> Optional[str]:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising at import
        return f"triton is not importable ({type(exc).__name__}: {exc})"
    return None


class TritonBackend(BudgetParts):
    """Per-shard primitives backed by the fused Triton kernels (see module docstring)."""

    name = "triton"
    # the calls the fused kernels cannot run (kernel_registry: the native source runs them). A
    # sampler's support runs here (tplogp.backends.fused_support), but not on the
    # tensor-parallel-invariant level's grid kernels.
    missing_features: dict = {
        "support-tp-invariant": "its tensor-parallel-invariant grid kernels do not mask a "
                                "sampler's support (deterministic=\"tp_invariant\" with support=): "
                                "the native source runs that call"}

    def __init__(self, config=None):
        # config: an optional tplogp.kernels.tiles.TileConfig overriding the per-architecture
        # default.
        self._config = config
        # the layouts' launch programs, eager and compiled calls alike (:meth:`_program`)
        self._programs: dict = {}

    # -- availability ------------------------------------------------------------------------------
    def unavailable_reason(self, device: Optional[torch.device] = None) -> Optional[str]:
        reason = triton_unavailable_reason()
        if reason is not None:
            return reason
        device = torch.device(device) if device is not None else _default_device()
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return "no CUDA device is available (torch.cuda.is_available() is False)"
            cap = torch.cuda.get_device_capability(device)
            if cap < MIN_CAPABILITY:
                return (f"compute capability {cap[0]}.{cap[1]} of {torch.cuda.get_device_name(device)} is below "
                        f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, the oldest the Triton kernels support")
            return None
        if tiles.interpreting():
            return None
        return (f"the triton source runs on CUDA devices (got {device.type}); set TRITON_INTERPRET=1 before "
                f"importing the kernels to run them on the CPU through Triton's interpreter")

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype) -> Optional[str]:
        """None if operands of ``dtype`` can run on ``device`` (an available one), else why not: the
        tile configs need more shared memory than the device has (see
        :func:`tplogp.kernels.tiles.select`)."""
        from ..kernels.tiles import TilesDoNotFitError

        if dtype not in tiles.KERNEL_DTYPES:
            return None  # not a case of this source: the operator's input checks name the dtype
        try:
            self._cfg(torch.device(device), dtype)
        except TilesDoNotFitError as exc:
            return f"no tile configuration of the {self.name} source fits this device for {dtype}: {exc}"
        return None

    # -- helpers -----------------------------------------------------------------------------------
    def _cfg(self, device: torch.device, dtype: torch.dtype):
        """The tile config for ``dtype`` on ``device``, cached per (device, dtype, dot precision):
        the table lookup and the shared-memory fit cost host time on every call otherwise. Raises
        ``TilesDoNotFitError``."""
        cache = self.__dict__.setdefault("_cfg_cache", {})
        key = (device, dtype, tiles.dot_precision(dtype))
        cfg = cache.get(key)
        if cfg is None:
            cfg = cache[key] = self._select(device, dtype)
        return cfg

    def _select(self, device: torch.device, dtype: torch.dtype):
        return tiles.select(device, dtype, self._config)

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
            found = _remember(cache, key,
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

    def _uses_tma(self, hidden, weight, call: ShardCall) -> bool:
        """Whether a call launches the Hopper TMA kernels (the sm90 source's choice; here never)."""
        return False

    # -- primitives --------------------------------------------------------------------------------
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

    def layout_fingerprint(self, device: torch.device, dtype: torch.dtype) -> str:
        """The source's name and its tile config on ``device`` for ``dtype`` (the kept layout's
        tiles)."""
        return f"{self.name} {self._cfg(device, dtype)!r}"

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

    def forward_stats(self, hidden, weight, bias, local_target, call: ShardCall,
                      kept_out: Optional[torch.Tensor] = None) -> ShardStats:
        if call.support is not None:  # (a sampler's support: no launch program)
            return fused_support.forward_stats(self, hidden, weight, bias, local_target, call,
                                               kept_out)
        ran = self._run_program(hidden, weight, bias, local_target, call, "stats", False, None,
                                kept_out) if call.inputs_checked else None
        if ran is not None:
            out = ran[0]
            return ShardStats(*out[:4], kept=ran[1], sum_z=out[4], argmax=out[5])
        from ..kernels import forward_programs

        lay = self._launch_layout(hidden, weight, call)
        kept = self._kept_buffer(hidden, lay, call, kept_out)
        out = forward_programs.forward_stats(
            hidden, weight, bias, local_target, call.kernel_options, lay.cfg,
            tma=self._uses_tma(hidden, weight, call),
            kept=self._kept_terms(kept, hidden.shape[0], lay), checked=call.inputs_checked)
        return ShardStats(*out[:4], kept=kept, sum_z=out[4], argmax=out[5])

    def grid_columns(self, device: torch.device, dtype: torch.dtype) -> int:
        """The invariant level's grid block width (:mod:`tplogp.support.invariant`): the forward's
        split, ``split_v`` of the device's tile config, so each block is one program's split of
        whole tiles."""
        return self._cfg(torch.device(device), dtype).split_v

    def forward_blocks(self, hidden, weight, bias, local_target, call: ShardCall) -> BlockStats:
        """Per-block stats of a grid-aligned shard: the stats kernel's splits, unmerged
        (:func:`tplogp.kernels.grid_programs.forward_blocks`)."""
        from ..kernels import grid_programs

        lay = self._launch_layout(hidden, weight, call)
        if lay.cfg.split_v != call.grid_columns:
            raise AssertionError(f"grid of {call.grid_columns} columns, splits of {lay.cfg.split_v}")
        block_max, block_sum, target, sez, sum_z, argmax = grid_programs.forward_blocks(
            hidden, weight, bias, local_target, call.kernel_options, lay.cfg,
            tma=self._uses_tma(hidden, weight, call))
        # one split holds a row's target (the others add exact zeros)
        return BlockStats(block_max, block_sum, target.sum(0), sez, sum_z, argmax)

    # forward_single takes ``target_flag``: its finishing kernel checks the targets
    # (tplogp.op.verdicts.KernelTargetCheck)
    checks_targets_in_kernel = True

    def forward_single(self, hidden, weight, bias, target, call: ShardCall,
                       target_flag: Optional[torch.Tensor] = None,
                       kept_out: Optional[torch.Tensor] = None) -> SingleShardOutputs:
        if call.support is not None:  # (a sampler's support: no launch program)
            return fused_support.forward_single(self, hidden, weight, bias, target, call,
                                                target_flag, kept_out)
        ran = self._run_program(hidden, weight, bias, target, call, "single",
                                target_flag is not None, target_flag,
                                kept_out) if call.inputs_checked else None
        if ran is not None:
            out = ran[0]
            return SingleShardOutputs(*out[:6], kept=ran[1], sum_z=out[6], argmax=out[7])
        from ..kernels import forward_programs

        lay = self._launch_layout(hidden, weight, call)
        kept = self._kept_buffer(hidden, lay, call, kept_out)
        out = forward_programs.forward_single(
            hidden, weight, bias, target, call.kernel_options, lay.cfg,
            tma=self._uses_tma(hidden, weight, call),
            kept=self._kept_terms(kept, hidden.shape[0], lay), target_flag=target_flag,
            checked=call.inputs_checked)
        return SingleShardOutputs(*out[:6], kept=kept, sum_z=out[6], argmax=out[7])

    def _run_program(self, hidden, weight, bias, target, call: ShardCall, kind: str,
                     check_targets: bool, target_flag=None, kept_out=None):
        """``(the forward's outputs, what it kept)`` through the layout's program
        (:meth:`_program`), for the op's own calls (``call.inputs_checked``, tested by the caller),
        or None where none runs it. What the forward keeps: the two allocations of
        ``call.scales_apart``, else the flat buffer (``kept_out``, the op's, or allocated), whose
        views the program writes (:meth:`_kept_terms`)."""
        found = self._program(hidden, weight, bias, call, kind, check_targets)
        if not found:
            return None
        program, lay = found
        kept = self._kept_buffer(hidden, lay, call, kept_out)
        if kept is None:
            return program(hidden, weight, bias, target, target_flag), None
        terms = kept if call.scales_apart else self._kept_terms(kept, hidden.shape[0], lay)
        return program(hidden, weight, bias, target, target_flag, terms.values, terms.scales), kept

    def _program(self, hidden, weight, bias, call: ShardCall, kind: str, check_targets: bool):
        """``(the layout's ForwardProgram, its ShardLayout)``
        (:mod:`tplogp.kernels.forward_programs`) for a forward of ``kind`` (``"stats"``, or
        ``"single"`` with ``check_targets``: whether the targets are checked), held by this source
        for eager and compiled calls alike, keyed by the call's settings (``ShardCall.key``), the
        tensors' shapes, dtypes and device and the kernels' dot precision
        (``torch.get_float32_matmul_precision()`` for fp32 operands): a steady call finds it with
        one lookup (:func:`_remember` bounds the cache). ``False`` where the call's row count is not
        its layout's (``ShardCall.rows``; None: any) or its shard is empty: those take the per-call
        path (counts that vary from call to call, rows compacted away by ignore_index or a loss
        chunk, would make a program per count)."""
        n = hidden.shape[0]
        if call.rows is not None and n != call.rows:
            return False
        key = (call.key, kind, check_targets, hidden.shape, weight.shape, hidden.dtype,
               None if bias is None else bias.dtype, hidden.device,
               tiles.dot_precision(hidden.dtype))
        found = self._programs.get(key)
        if found is not None:
            return found
        found = False
        if n and weight.shape[0]:
            from ..kernels import forward_programs

            lay = self._launch_layout(hidden, weight, call)
            keep = None
            if call.for_backward and lay.keep_cols:
                # (the flat buffer's views and the two allocations have the same strides)
                keep = (lay.keep_cols, kept_layout.kept_scales_shape(n, lay.kept_scales)[1],
                        lay.keep_cols, lay.kept_dtype)
            single = kind == "single"
            found = (forward_programs.ForwardProgram(n, weight.shape[0], hidden.shape[1],
                                                     hidden.stride(0), weight.stride(0),
                                                     hidden.dtype,
                                                     None if bias is None else bias.dtype,
                                                     call.kernel_options, lay.cfg,
                                                     tiles.dot_precision(hidden.dtype), keep,
                                                     single, single and check_targets,
                                                     self._uses_tma(hidden, weight, call)), lay)
        return _remember(self._programs, key, found)

    def backward(self, hidden, weight, bias, local_target, row_max, log_sum, grad_logp,
                 grad_entropy, grad_lse, mean_rel, call: ShardCall, needs, d_hidden_ready=None,
                 kept=None, accumulate=None, grad_sum_z=None) -> ShardGrads:
        if call.support is not None:  # a small union of the supports' ids: its gathered rows
            local_target = fused_support.kept_targets(local_target, call.support)
            grads = native_support.gathered_backward(
                self, hidden, weight, bias, local_target, row_max, log_sum, grad_logp,
                grad_entropy, grad_lse, mean_rel, call, needs, d_hidden_ready, kept, accumulate,
                grad_sum_z)
            if grads is not None:
                return grads
        if call.inputs_checked and isinstance(kept, KeptBuffers):
            grads = self._kept_program_backward(hidden, weight, bias, local_target, row_max,
                                                log_sum, grad_logp, grad_entropy, grad_lse,
                                                mean_rel, call, needs, d_hidden_ready, kept,
                                                accumulate, grad_sum_z)
            if grads is not None:
                return grads
        from ..kernels import backward_programs

        lay = self._launch_layout(hidden, weight, call)
        if call.grid_columns:
            from ..kernels import grid_programs

            return ShardGrads(*grid_programs.backward_on_grid(
                hidden, weight, bias, local_target, row_max, log_sum, grad_logp, grad_entropy,
                grad_lse, mean_rel, transform=call.kernel_options.transform,
                columns=call.grid_columns,
                workspace_bytes=lay.transient_bytes, needs=tuple(needs), cfg=lay.cfg,
                tma=self._uses_tma(hidden, weight, call), d_hidden_ready=d_hidden_ready,
                accumulate=accumulate, grad_sum_z=grad_sum_z))
        d_hidden, d_weight, d_bias = backward_programs.backward(
            hidden, weight, bias, local_target, row_max, log_sum, grad_logp, grad_entropy, grad_lse,
            mean_rel, transform=call.kernel_options.transform, deterministic=call.deterministic,
            workspace_bytes=lay.transient_bytes, needs=tuple(needs),
            cfg=lay.cfg, tma=self._uses_tma(hidden, weight, call),
            kept=self._kept_terms(kept, hidden.shape[0], lay, take_scales=True),
            d_hidden_ready=d_hidden_ready, accumulate=accumulate,
            overwrite_kept=call.consume_kept, d_hidden_in_input_dtype=call.d_hidden_in_input_dtype,
            checked=call.inputs_checked, grad_sum_z=grad_sum_z, support=call.support)
        return ShardGrads(d_hidden, d_weight, d_bias)

    def _kept_program_backward(self, hidden, weight, bias, local_target, row_max, log_sum,
                               grad_logp, grad_entropy, grad_lse, mean_rel, call: ShardCall, needs,
                               d_hidden_ready, kept: KeptBuffers, accumulate,
                               grad_sum_z=None) -> Optional[ShardGrads]:
        """The backward through the layout's
        :class:`~tplogp.kernels.backward_programs.KeptBackward` (made at its first call, held by
        this source with the forwards' programs, :meth:`_program`), or None where one does not run
        it (its ``covers``)."""
        n = hidden.shape[0]
        if call.rows is not None and n != call.rows:  # (as :meth:`_program`)
            return None
        with_entropy = grad_entropy is not None
        with_sum_z = grad_sum_z is not None
        key = (call.key, "backward", tuple(needs), with_entropy, with_sum_z, hidden.shape,
               weight.shape, hidden.dtype, None if bias is None else bias.dtype, hidden.device,
               tiles.dot_precision(hidden.dtype))
        program = self._programs.get(key)
        if program is None:
            from ..kernels.backward_programs import KeptBackward
        else:
            KeptBackward = type(program)
        if not KeptBackward.covers(kept, weight, call.consume_kept):
            return None
        terms = kept_layout.KeptTerms(kept.values, kept.take_scales())
        if program is None or not program.matches(hidden, weight, bias, terms, needs, with_entropy,
                                                  with_sum_z):
            lay = self._launch_layout(hidden, weight, call)
            program = _remember(self._programs, key, KeptBackward(
                n, weight.shape[0], hidden.dtype, None if bias is None else bias.dtype,
                tuple(needs), with_entropy, call.kernel_options.transform, lay.cfg,
                tiles.dot_precision(hidden.dtype), terms.values.dtype, terms.scales.stride(0),
                call.deterministic, call.d_hidden_in_input_dtype, hidden.is_cuda, with_sum_z))
        return ShardGrads(*program(hidden, weight, bias, local_target, row_max, log_sum, grad_logp,
                                   grad_entropy, grad_lse, mean_rel, terms, d_hidden_ready,
                                   accumulate, grad_sum_z))


def _remember(cache: dict, key: tuple, value, limit: int = MAX_PROGRAMS):
    """``cache[key] = value``, the dict emptied first when it already holds ``limit`` other keys;
    returns ``value``. The layout cache (``MAX_LAYOUTS``) and the launch programs
    (``TritonBackend._programs``: a program, or ``False`` for a layout no program runs;
    ``MAX_PROGRAMS``)."""
    if key not in cache and len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value
