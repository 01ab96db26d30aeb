"""A checked call brought to this shard: the rows and targets the sources take, and the state its
backward carries.

:func:`localize` flattens the inputs to 2-D contiguous tensors, gathers a sequence-parallel call's
slices (ONE ``all_gather``, before any GEMM), compacts away rows whose target is ``ignore_index``
(or, while a CUDA graph is captured, keeps them in place as rows that no shard owns:
:func:`compacts_rows`), re-shards onto the tensor-parallel-invariant grid where that level is asked
(:mod:`tplogp.support.invariant`), and makes the targets shard-local (``-1`` where another shard
owns the id). The result, a :class:`LocalCall`, is what :func:`tplogp.op.tp.shard_forward` and
:func:`tplogp.op.tp.shard_backward` run; :class:`TPContext` is the call's non-tensor state from
forward to backward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from ..support import invariant, tensors
from ..backends.base import ShardBackend, ShardCall
from ..support.comm import all_gather_flat
from . import sampler_params
from .sampler_support import sampler_support, sampler_support_with_logits
from .support_ids import KEEP_ALL, local_ids
from .verdicts import BackwardVerdict, KernelTargetCheck


@dataclass
class TPContext:
    """Non-tensor state of one call, carried from forward to backward: built once by
    :func:`localize`, its fields fixed from then on but ``kept_scales``, the one hand-off that a
    forward writes and its backward takes (:func:`tplogp.op.tp.park_kept_scales`).

    The call's two :class:`~tplogp.backends.base.ShardCall` objects are fixed here, the sampler's
    support (this shard's ids) already in both: ``call`` and ``call_for_backward``. A phase that
    runs a variant of one (the op's flat kept buffer, ``ShardCall.flat_kept``; the fused loss's
    ``ShardCall.precomputing``; a chunk's rows, ``ShardCall.for_rows``) derives it, an immutable
    value, and passes it to :func:`tplogp.op.tp.shard_forward` /
    :func:`~tplogp.op.tp.shard_backward` or the source: the context is never changed for it."""

    backend: ShardBackend
    # a forward whose results are not differentiated, and the op's backward (tplogp.op.packed_op)
    call: ShardCall
    # an eager forward whose results are differentiated (the source may keep terms for the
    # backward), and its backward
    call_for_backward: ShardCall
    group: Any
    world_size: int
    comm_device: torch.device
    # one shard and a backend with ``forward_single``: it finishes the outputs; targets are passed
    # as given
    single: bool = False
    # what the backward settles before it writes a gradient, or None
    verdict: Optional[BackwardVerdict] = None
    # the call's target check, run by the source's finishing kernel (single only), or None
    target_check: Optional[KernelTargetCheck] = None
    # the d_hidden collective: "all_reduce" (replicated hidden), "reduce_scatter" (sequence-parallel
    # hidden), or None (one shard, or hidden_grad="partial": each rank keeps its share)
    hidden_reduce: Optional[str] = None
    vocab_start: int = 0  # this shard's first global id (argmax ids are made global with it)
    # the tensor-parallel-invariant level (tplogp.support.invariant): this rank's re-shard onto the
    # grid, or None
    regrid: Optional[invariant.Regrid] = None
    # the one field written after construction: the kept scales of a forward that keeps them apart
    # (KeptBuffers), held here from forward to backward and dropped by a consuming backward
    # (:func:`park_kept_scales`, :func:`shard_backward`)
    kept_scales: Optional[torch.Tensor] = None


def gather_rows(h: torch.Tensor, group: Any, comm_device: torch.device) -> torch.Tensor:
    """The sequence-parallel slices of every rank, rank-major: ``[world * n, D]`` on ``h``'s device
    (one ``all_gather``, through the group's collective device)."""
    return all_gather_flat(h.detach().to(comm_device), group).to(h.device)


class LocalCall(NamedTuple):
    """A checked call on this shard: 2-D contiguous inputs (ignored rows compacted away),
    shard-local targets and the context carried from forward to backward."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    local_target: torch.Tensor
    keep_idx: Optional[torch.Tensor]  # rows kept by ignore_index compaction, or None
    tpc: TPContext
    vocab_size: int  # of all shards together (the same on every rank)
    # [N] bool: ignored rows kept in place (no compaction), or None
    ignored: Optional[torch.Tensor] = None
    # sequence parallelism: this rank's rows, the tensor the gradient flows to (``hidden`` is every
    # rank's, gathered)
    own_rows: Optional[torch.Tensor] = None


def compacts_rows(device: torch.device) -> bool:
    """Whether ignored rows are compacted away (their GEMM work saved, at the price of a host read
    of the kept-row count), or kept in place as rows that no shard owns, whose outputs are zeroed
    and whose upstream gradients are dropped (no host read): the latter while a CUDA graph is being
    captured, where a host read cannot happen."""
    # (looked up at the call: a test may simulate a capture)
    return not tensors.is_capturing(device)


def localize(call, gathered: Optional[torch.Tensor] = None) -> LocalCall:
    """Flattening, the sequence-parallel gather, ignore_index compaction and target localisation of
    a checked call.

    The sources take 2-D contiguous inputs and shard-local targets only, so their kernels need no
    per-launch checks.

    Args:
        call: a :class:`tplogp.op.plan.Call`.
        gathered: a sequence-parallel call's rows gathered by its forward (the op's backward), or
            None.
    Returns:
        The :class:`LocalCall` that :func:`shard_forward` and :func:`shard_backward` run.
    """
    plan, args = call.plan, call.args
    hidden, target_ids, weight, bias = args.hidden, args.target_ids, args.weight, args.bias
    d = hidden.shape[-1]
    # (no view op, and no view node, when 2-D)
    h2 = hidden if hidden.dim() == 2 else hidden.reshape(-1, d)
    tgt = target_ids if target_ids.dim() == 1 else target_ids.reshape(-1)
    tgt = tgt if tgt.dtype == torch.int64 else tgt.long()
    h2 = h2 if h2.is_contiguous() else h2.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    b = bias if (bias is None or bias.is_contiguous()) else bias.contiguous()

    options = args.options
    sequence_parallel = options.sequence_parallel and plan.world_size > 1
    if plan.world_size == 1 or options.hidden_grad == "partial":
        hidden_reduce = None
    else:
        hidden_reduce = "reduce_scatter" if sequence_parallel else "all_reduce"
    own_rows = None
    if sequence_parallel:
        own_rows, h2 = h2, (gathered if gathered is not None
                            else gather_rows(h2, args.group, plan.comm_device))

    keep_idx = ignored = None
    support = options.support  # (padded [N, K] int64: tplogp.op.plan)
    ignore_index = options.ignore_index
    if ignore_index is not None:
        keep = tgt != ignore_index
        if compacts_rows(h2.device) and not sequence_parallel:
            keep_idx = keep.nonzero().squeeze(1)  # identical on every rank (targets are replicated)
            h2 = h2.index_select(0, keep_idx)
            tgt = tgt.index_select(0, keep_idx)
            support = None if support is None else support.index_select(0, keep_idx)
        else:  # in place: the rows' target becomes nobody's (-1 is outside every shard)
            ignored = ~keep
            tgt = torch.where(keep, tgt, -1)

    # (a given support's ids are checked ids or -1: no row keeps every id; a computed one's may)
    keeps_all: Optional[bool] = False
    # the support from the sampler's parameters (sampler_params.given, inline: the plain path
    # enters no room for it): GLOBAL ids
    support_logits = None  # (a computed support's logits, where the forward takes them)
    if options.top_k is not None or options.top_p is not None or options.min_p is not None:
        support, support_logits = _sampler_support(plan, args, options, h2, w, b, keep_idx,
                                                   call.vocab_size)
        keeps_all = None

    # the invariant level: the rows of the grid blocks this rank computes
    regrid = None
    if plan.call.grid_columns:
        regrid = _regrid(plan, args, w.shape[0], call.vocab_size, call.shard_ranges)
        w, b = invariant.regrid_rows(regrid, w, b)
        local_target = regrid.local_targets(tgt)
    # the backend treats ids outside [0, V) as nobody's (vocab_start_index is 0 without a group)
    elif plan.single:
        local_target = tgt
    else:
        start = args.vocab_start_index
        rel = tgt - start if start else tgt
        local_target = torch.where((rel >= 0) & (rel < w.shape[0]), rel, -1)
    shard_call, call_for_backward = plan.call, plan.call_for_backward
    if support is not None:  # this shard's ids of the support, shard-local, on the call's settings
        if regrid is not None:  # the rows of the grid blocks this rank computes
            support = local_ids(support, regrid.lo, regrid.hi - regrid.lo)
        else:
            support = local_ids(support, 0 if plan.single else args.vocab_start_index, w.shape[0])
        if keeps_all is None:  # a computed support's: read once here (one host read)
            keeps_all = bool(support.shape[1]) and bool((support[:, 0] == KEEP_ALL).any())
        if support_logits is not None:  # (this shard's ids' logits)
            support_logits = torch.where(support >= 0, support_logits, float("-inf"))
        shard_call = replace(shard_call, support=support, support_keeps_all=keeps_all,
                             support_logits=support_logits)
        # (a call that records a graph runs its forward on this one: the logits too)
        call_for_backward = replace(call_for_backward, support=support,
                                    support_keeps_all=keeps_all, support_logits=support_logits)
    tpc = TPContext(plan.backend, shard_call, call_for_backward, args.group, plan.world_size,
                    plan.comm_device, plan.single, call.verdict, call.target_check, hidden_reduce,
                    0 if plan.single else args.vocab_start_index, regrid)
    return LocalCall(h2, w, b, local_target, keep_idx, tpc, call.vocab_size, ignored, own_rows)


def _sampler_support(plan, args, options, h2, w, b, keep_idx, vocab: int
                     ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The padded GLOBAL support of the rows ``h2`` computed from the sampler's parameters
    (:mod:`tplogp.op.sampler_support`; ``keep_idx``: the rows ignore_index compaction kept), or
    None when every filter is off; and, in a 16-bit call that neither runs on the invariant
    level's grid nor sums the logits, its ids' logits as the passes computed them (the forward's
    statistics then need no pass of their own), else None. The passes' fp32 logits and the
    backward's recomputed ones may differ by the GEMMs' rounding: far below a 16-bit call's
    error, not an fp32 call's at a peaked token's ``1 - p``."""
    params = sampler_params.per_token(options, args.target_ids.numel(), h2.device, vocab)
    if params is None:
        return None, None
    if keep_idx is not None:
        params = params.rows(keep_idx)
    group = args.group if plan.world_size > 1 else None
    layout = dict(call=plan.call, vocab_start=0 if plan.single else args.vocab_start_index,
                  vocab=vocab, group=group, comm_device=plan.comm_device)
    if (h2.dtype in (torch.bfloat16, torch.float16) and not plan.call.grid_columns
            and not plan.call.with_sum_z):
        return sampler_support_with_logits(h2, w, b, params, **layout)
    return sampler_support(h2, w, b, params, **layout), None


def _regrid(plan, args, v_local: int, vocab: int, ranges) -> invariant.Regrid:
    """This rank's :class:`~tplogp.support.invariant.Regrid`; with a group, from every rank's shard
    range: ``ranges``, what the call's group record gathered, else (an op's backward) one small
    exchange of the boundaries."""
    if plan.world_size > 1:
        bounds = (list(ranges) if ranges is not None else
                  invariant.shard_bounds(args.group, plan.comm_device, args.vocab_start_index,
                                         v_local))
        return invariant.Regrid(args.group, plan.comm_device, dist.get_rank(args.group), bounds,
                                plan.call.grid_columns, vocab)
    return invariant.Regrid(None, None, 0, [(0, v_local)], plan.call.grid_columns, vocab)
