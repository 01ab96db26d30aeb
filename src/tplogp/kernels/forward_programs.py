"""Per-layout forward programs: one shard's forward with every launch of a layout made once
(:class:`ForwardProgram`), and the entry points that run them (:func:`forward_stats`,
:func:`forward_single`): check shapes, allocate outputs and per-split stats, launch the stats kernel
and the one-shard finalize or the split merge. The backward's programs are
:mod:`.backward_programs`.

A program is made from sizes alone and holds its :class:`~.launch.Launch` objects; a call passes
its tensors. The op's forwards (``ShardCall.inputs_checked``; eager and compiled alike) run the
program that the source holds for the layout (``TritonBackend._program``: keyed by
``ShardCall.key`` and the tensors' layout); the per-call entry points (other row counts, a
sampler's support, direct calls of a source) take the same programs from :func:`~.launch.cached`,
keyed by everything they are made from. The ``sm90`` source runs the same programs with ``tma``:
the Hopper kernels where their tensor descriptors are legal (:func:`~.launches.tma_ok`), the
pointer kernels otherwise. The tensor-parallel-invariant level's entry points are in
:mod:`.grid_programs`.

No host syncs: every size used for planning is a Python int taken from tensor shapes; no
``.item()``, no ``nonzero()``. Each entry point checks its tensors
(:func:`.entry_checks.check_inputs`, :func:`.entry_checks.check_kept`) unless its caller passes
``checked=True``: the op's own call path, whose inputs passed the op's checks and were made 2-D,
contiguous and int64 there, skips these per-launch repeats.
"""

from __future__ import annotations

from typing import Optional

import torch

from .entry_checks import check_inputs, check_kept
from .kept import KeptTerms
from .launch import cached
from .launches import (KernelOptions, ensure_context, finalize_launch, kept_tma_ok, merge_launch,
                       stats_launch, tma_ok)
from .tiles import TileConfig, cdiv, dot_precision


def layout_of(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple:
    """What a program is made for: the shapes and dtype of a call's (checked: 2-D, contiguous, one
    device) tensors and its bias's dtype."""
    return hidden.shape, weight.shape, hidden.dtype, None if bias is None else bias.dtype


# The forwards' fp32 buffers: the per-split stats ``[rows, S, N]`` (row max, sum of exp, target
# logit and, with entropy, the sum of exp * z), the merged stats of a shard ``[rows, N]`` (the same
# rows), the one-shard outputs ``[6 or 4, N]`` (logp, lse, row max, log-sum and, with entropy,
# mean_rel and entropy).

def stats_rows(with_entropy: bool, with_sum_z: bool = False, with_argmax: bool = False) -> int:
    return (4 if with_entropy else 3) + with_sum_z + with_argmax


def _single_rows(with_entropy: bool, with_sum_z: bool = False, with_argmax: bool = False) -> int:
    return (6 if with_entropy else 4) + with_sum_z + with_argmax


def _extras(outs: tuple, first: int, with_sum_z: bool, with_argmax: bool) -> tuple:
    """``(sum_z | None, argmax | None)``: the optional rows from row ``first`` on."""
    sum_z = outs[first] if with_sum_z else None
    argmax = outs[first + with_sum_z] if with_argmax else None
    return sum_z, argmax


def stats_outputs(out: torch.Tensor, with_entropy: bool, with_sum_z: bool = False,
                  with_argmax: bool = False) -> tuple:
    """``(row_max, sum_exp, target_logit, sum_exp_z | None, sum_z | None, argmax | None)``: views of
    the merged stats ``out``."""
    outs = out.unbind(0)
    return (outs[0], outs[1], outs[2], outs[3] if with_entropy else None,
            *_extras(outs, 4 if with_entropy else 3, with_sum_z, with_argmax))


def _single_outputs(out: torch.Tensor, with_entropy: bool, with_sum_z: bool = False,
                    with_argmax: bool = False) -> tuple:
    """``(logp, lse, row_max, log_sum, mean_rel | None, entropy | None, sum_z | None,
    argmax | None)``: views of the one-shard outputs ``out``."""
    outs = out.unbind(0)
    return (outs[0], outs[1], outs[2], outs[3], outs[4] if with_entropy else None,
            outs[5] if with_entropy else None,
            *_extras(outs, 6 if with_entropy else 4, with_sum_z, with_argmax))


# ----------------------------------------------------------------------------------------------- forward


class ForwardProgram:
    """One shard's forward for one layout: :func:`forward_single` (``single``) or
    :func:`forward_stats`, with the split count, buffer shapes and every launch made once. A call
    allocates the per-split stats and the outputs and makes two launches (the stats kernel, then the
    one-shard finalize or the split merge).

    ``options``: the call's (:class:`~.launches.KernelOptions`). ``precision``: the dot precision
    (:func:`~.tiles.dot_precision`). ``keep``:
    ``(kept row stride, scales row stride, kept columns, kept dtype)`` of what the forward keeps for
    the backward (the calls pass the terms ``[N, columns]`` and their scales), or None.
    ``check_targets`` (``single`` only): the calls pass ``target_flag`` (the finishing kernel checks
    the targets). ``tma``: the Hopper stats kernel where a call's descriptors are legal (the pointer
    kernel otherwise). ``support``: the calls pass the bitmask of the columns each row's support
    keeps (:func:`.support_bits.column_bits`; the other logits are masked). The source's programs
    are checked with :meth:`matches` before a call."""

    def __init__(self, n: int, v: int, d: int, stride_h: int, stride_w: int, dtype: torch.dtype,
                 bias_dtype: Optional[torch.dtype], options: KernelOptions, cfg: TileConfig,
                 precision: Optional[str], keep: Optional[tuple], single: bool,
                 check_targets: bool = False, tma: bool = False, support: bool = False) -> None:
        self.layout = ((n, d), (v, d), dtype, bias_dtype)
        _, with_entropy, with_sum_z, with_argmax = options
        self.with_entropy = with_entropy
        self.extras = (with_sum_z, with_argmax)
        self.single = single
        num_splits = cdiv(v, cfg.split_v)
        kept_dims = None if keep is None else keep[:3]
        stats = (n, v, d, stride_h, stride_w, bias_dtype is not None, options, cfg, precision,
                 kept_dims)
        self.stats = stats_launch(*stats, support=support)
        # the Hopper kernel's launches (plain and, with kept terms, with their TMA stores), or None
        self.stats_tma = None if not tma else (stats_launch(*stats, tma=True, support=support),
                                               stats_launch(*stats, tma=True, keep_tma=True,
                                                            support=support)
                                               if keep else None)
        self.parts_shape = (stats_rows(with_entropy, with_sum_z, with_argmax), num_splits, n)
        if single:
            self.out_shape = (_single_rows(with_entropy, with_sum_z, with_argmax), n)
            self.finish = finalize_launch(n, v, num_splits, with_entropy, check_targets, with_sum_z,
                                          with_argmax)
        else:
            self.out_shape = (stats_rows(with_entropy, with_sum_z, with_argmax), n)
            self.finish = merge_launch(n, num_splits, with_entropy, with_sum_z, with_argmax)

    def matches(self, hidden: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor]) -> bool:
        """Whether a call's (checked: 2-D, contiguous, one device) tensors are of this layout."""
        return layout_of(hidden, weight, bias) == self.layout

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 target: torch.Tensor, target_flag: Optional[torch.Tensor] = None,
                 values: Optional[torch.Tensor] = None,
                 scales: Optional[torch.Tensor] = None,
                 support: Optional[torch.Tensor] = None) -> tuple:
        """``single``: ``(logp, lse, row_max, log_sum, mean_rel | None, entropy | None,
        sum_z | None, argmax | None)``; else ``(row_max, sum_exp, target_logit, sum_exp_z | None,
        sum_z | None, argmax | None)`` (``target``: shard-local, contiguous). The kept terms and
        scales are written into ``values`` and ``scales`` (the layout's ``keep``); ``support``: the
        rows' bitmask (a program made with ``support``)."""
        device = hidden.device
        stats = self.stats
        if self.stats_tma is not None and tma_ok(hidden, weight):
            ensure_context(device)
            stats = self.stats_tma[1] if values is not None and kept_tma_ok(values) else self.stats_tma[0]
        parts = torch.empty(self.parts_shape, device=device, dtype=torch.float32)
        stats(hidden, weight, hidden if bias is None else bias, target, parts,
              parts if values is None else values, parts if scales is None else scales,
              parts if support is None else support)
        # after the launch: the GPU starts sooner
        out = torch.empty(self.out_shape, device=device, dtype=torch.float32)
        if not self.single:
            self.finish(parts, out)
            return stats_outputs(out, self.with_entropy, *self.extras)
        self.finish(parts, target, out, out if target_flag is None else target_flag)
        return _single_outputs(out, self.with_entropy, *self.extras)


def _forward_program(hidden, weight, bias, options: KernelOptions, cfg,
                     kept: Optional[KeptTerms], single: bool, check_targets: bool,
                     tma: bool, support: bool = False) -> ForwardProgram:
    """The per-call paths' :class:`ForwardProgram` of these tensors' layout, from
    :func:`~.launch.cached`."""
    n, d = hidden.shape
    keep = None
    if kept is not None:
        keep = (kept.values.stride(0), kept.scales.stride(0), kept.values.shape[1],
                kept.values.dtype)
    return cached(ForwardProgram, n, weight.shape[0], d, hidden.stride(0), weight.stride(0),
                  hidden.dtype, None if bias is None else bias.dtype, options, cfg,
                  dot_precision(hidden.dtype), keep, single, check_targets, tma, support)


def forward_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  local_target: torch.Tensor, options: KernelOptions, cfg: TileConfig,
                  tma: bool = False, kept: Optional[KeptTerms] = None, checked: bool = False,
                  support: Optional[torch.Tensor] = None):
    """(row_max, sum_exp, target_logit, sum_exp_z | None, sum_z | None, argmax | None), fp32 [N],
    for one vocab shard (``options``: the call's, ``ShardCall.kernel_options``).

    ``kept`` (optional): the stats kernel also stores the softmax terms of the shard columns
    ``[0, v_keep)`` and their row scales there (:class:`~.kept.KeptTerms`), for :func:`backward`.
    ``tma``: the Hopper kernels where legal. ``support``: int32 ``[N, cdiv(V, 32)]``, the bitmask
    of the columns each row's support keeps (:func:`.support_bits.column_bits`): the other logits
    are masked (``-inf``). Two allocations (the merged stats are views of one ``[3 or 4, N]``
    buffer, the per-split stats of one ``[3 or 4, S, N]`` buffer), two launches, no other torch op.
    """
    n = hidden.shape[0]
    v = weight.shape[0]
    if not checked:
        check_inputs(hidden, weight, bias, local_target)
        check_kept(kept, n, v, cfg.block_v)
    if n == 0 or v == 0:
        _, with_entropy, *extras = options
        out = torch.empty((stats_rows(with_entropy, *extras), n), device=hidden.device,
                          dtype=torch.float32)
        out[0].fill_(float("-inf"))
        out[1:].zero_()
        return stats_outputs(out, with_entropy, *extras)
    local_target = local_target if local_target.is_contiguous() else local_target.contiguous()
    program = _forward_program(hidden, weight, bias, options, cfg, kept, False, False, tma,
                               support is not None)
    values, scales = (None, None) if kept is None else kept
    return program(hidden, weight, bias, local_target, None, values, scales, support)


def forward_single(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   target: torch.Tensor, options: KernelOptions, cfg: TileConfig,
                   tma: bool = False, kept: Optional[KeptTerms] = None,
                   target_flag: Optional[torch.Tensor] = None, checked: bool = False,
                   support: Optional[torch.Tensor] = None):
    """One shard holds the whole vocab: ``(logp, lse, row_max, log_sum, mean_rel | None,
    entropy | None, sum_z | None, argmax | None)``, fp32 [N].
    ``kept``, ``tma``, ``support``: as in :func:`forward_stats`. ``target_flag``: a zeroed int64
    ``[1]`` that the finishing kernel sets to an id outside ``[0, V)`` if some target is one (the
    call's default check; pinned host memory on a GPU, which the kernel writes directly).

    ``target`` holds vocab ids as given: an id outside ``[0, V)`` is nobody's and gets a NaN logp
    (the checks in ``full`` mode reject such ids before this runs). Two launches (the stats kernel,
    then one kernel that folds the splits and finishes the outputs) and two allocations: no other
    torch op.
    """
    n = hidden.shape[0]
    v = weight.shape[0]
    if not checked:
        check_inputs(hidden, weight, bias, target)
        check_kept(kept, n, v, cfg.block_v)
    if n == 0 or v == 0:
        _, with_entropy, *extras = options
        out = torch.empty((_single_rows(with_entropy, *extras), n), device=hidden.device,
                          dtype=torch.float32)
        if n:  # an empty vocab: no probability mass anywhere
            out.fill_(float("nan"))
            out[1:4].fill_(float("-inf"))
        return _single_outputs(out, with_entropy, *extras)
    target = target if target.is_contiguous() else target.contiguous()
    program = _forward_program(hidden, weight, bias, options, cfg, kept, True,
                               target_flag is not None, tma, support is not None)
    values, scales = (None, None) if kept is None else kept
    return program(hidden, weight, bias, target, target_flag, values, scales, support)
