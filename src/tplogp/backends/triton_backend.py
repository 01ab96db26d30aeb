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

from typing import Optional

import torch

from . import fused_support, native_support
# (these two: torch only, no Triton import, no device work)
from ..kernels import kept as kept_layout
from ..kernels import tiles
from .base import (BlockStats, BudgetParts, KeptBuffers, ShardCall, ShardGrads, ShardStats,
                   SingleShardOutputs)
from .triton_layouts import TritonLayouts, remember

# Oldest architecture the kernels are tested for (bf16 tensor cores need sm_80; Triton itself needs
# sm_75+).
MIN_CAPABILITY = (8, 0)
# launch programs remembered per backend (emptied when full): room for a few per layout of every
# plan the call path holds (tplogp.op.plan.MAX_PLANS)
MAX_PROGRAMS = 1024


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


class TritonBackend(TritonLayouts, BudgetParts):
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

    def _uses_tma(self, hidden, weight, call: ShardCall) -> bool:
        """Whether a call launches the Hopper TMA kernels (the sm90 source's choice; here never)."""
        return False

    # -- primitives --------------------------------------------------------------------------------
    def layout_fingerprint(self, device: torch.device, dtype: torch.dtype) -> str:
        """The source's name and its tile config on ``device`` for ``dtype`` (the kept layout's
        tiles)."""
        return f"{self.name} {self._cfg(device, dtype)!r}"

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
        return remember(self._programs, key, found, MAX_PROGRAMS)

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
            program = remember(self._programs, key, KeptBackward(
                n, weight.shape[0], hidden.dtype, None if bias is None else bias.dtype,
                tuple(needs), with_entropy, call.kernel_options.transform, lay.cfg,
                tiles.dot_precision(hidden.dtype), terms.values.dtype, terms.scales.stride(0),
                call.deterministic, call.d_hidden_in_input_dtype, hidden.is_cuda, with_sum_z),
                MAX_PROGRAMS)
        return ShardGrads(*program(hidden, weight, bias, local_target, row_max, log_sum, grad_logp,
                                   grad_entropy, grad_lse, mean_rel, terms, d_hidden_ready,
                                   accumulate, grad_sum_z))
