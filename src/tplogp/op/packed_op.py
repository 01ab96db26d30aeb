"""The bodies that the ``torch.library`` ops (:mod:`tplogp.op.ops`) run: a checked call's forward
and backward with outputs of shapes a fake implementation can state.

The outputs and what the backward needs travel as one packed fp32 ``[K, N]`` tensor (rows
``PACKED_*``), the kept softmax terms as one flat buffer (with ``ignore_index``, whose compaction
leaves a data-dependent row count, a capacity of which the forward fills a prefix), and a
sequence-parallel call's gathered rows as a third output. Both run through the same
:func:`tplogp.op.tp.shard_forward` / :func:`tplogp.op.tp.shard_backward` as the eager path.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import local_call
from .local_call import LocalCall
from ..support.tensors import expand_kept_rows, finish_rows, zero_rows
from .tp import shard_backward, shard_forward


# Rows of the packed fp32 [K, N] result of ``forward_packed``: the outputs, then what the backward
# needs; the argmax ids (exact in fp32) come last, with return_argmax.
PACKED_LOGP, PACKED_LSE, PACKED_ROW_MAX, PACKED_LOG_SUM, PACKED_ENTROPY, PACKED_MEAN_REL = range(6)


def packed_rows(with_entropy: bool, with_argmax: bool = False) -> int:
    """K of the packed result: 4 rows, 6 with entropy, one more with the argmax."""
    return (6 if with_entropy else 4) + (1 if with_argmax else 0)


def op_kept_shape(backend, n: int, d: int, v: int, dtype: torch.dtype, device: torch.device, call,
                  ignore_index: Optional[int]) -> tuple[int, ...]:
    """Shape of the op's kept output for ``n`` tokens (what its fake implementation states): the
    flat buffer that the forward keeps (``ShardBackend.kept_shape``), or with ``ignore_index``,
    whose compaction leaves a row count that depends on the data, a capacity that holds what any
    count of at most ``n`` rows keeps (``ShardBackend.kept_capacity``: at most the kept part of the
    budget), of which the forward fills a prefix.

    Args:
        backend: the call's source.
        n, d, v, dtype, device: the call's tokens, hidden size, shard vocab, dtype and device.
        call: the op's :class:`~tplogp.backends.base.ShardCall` (:func:`tplogp.op.plan.op_call`).
        ignore_index: the call's.
    """
    if ignore_index is None:
        return backend.kept_shape(n, d, v, dtype, device, call)
    return backend.kept_capacity(n, d, v, dtype, device, call)


def _op_kept_buffer(local: LocalCall, n_all: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(the op's kept output, the prefix its forward keeps into or None)`` of a call with
    ``ignore_index``: the capacity of :func:`op_kept_shape` for the call's ``n_all`` tokens, of
    which the compacted rows' forward fills the prefix it would allocate in eager
    (``ShardBackend.kept_shape`` of its rows, in the same layout: the backward reads eager's terms);
    the rest is zeroed, so every byte of the output is defined."""
    h, w = local.hidden, local.weight
    call = local.tpc.call_for_backward.flat_kept
    capacity = local.tpc.backend.kept_capacity(n_all, h.shape[1], w.shape[0], h.dtype, h.device,
                                               call)
    words = local.tpc.backend.kept_shape(h.shape[0], h.shape[1], w.shape[0], h.dtype, h.device,
                                         call)[0]
    assert words <= capacity[0], (words, capacity)
    buffer = torch.empty(capacity, device=h.device, dtype=torch.float32)
    if words < buffer.numel():
        buffer[words:].zero_()
    return buffer, (buffer[:words] if words else None)


def _op_kept_prefix(local: LocalCall, kept: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """What the op's backward reads of its forward's kept output under ``ignore_index``: the prefix
    the compacted rows' forward filled (:func:`_op_kept_buffer`), or None when they kept nothing."""
    if kept is None or not kept.numel():
        return None
    h, w = local.hidden, local.weight
    words = local.tpc.backend.kept_shape(h.shape[0], h.shape[1], w.shape[0], h.dtype, h.device,
                                         local.tpc.call_for_backward.flat_kept)[0]
    return kept[:words] if words else None


def forward_packed(call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward of the ``torch.library`` op (:mod:`tplogp.op.ops`) for a checked call.

    An op returns tensors of shapes its fake implementation can state, so the outputs and what the
    backward needs travel as one packed tensor.

    Args:
        call: a :class:`tplogp.op.plan.Call` from :func:`tplogp.op.plan.prepare`.
    Returns:
        ``(packed, kept, gathered)``: one fp32 ``[K, target_ids.numel()]`` tensor (rows
        ``PACKED_*``; ignored rows 0), what the forward kept for the backward within the budget
        (shape :func:`op_kept_shape` of :func:`tplogp.op.plan.op_call`; ``(0,)`` when the budget
        keeps nothing, and the backward recomputes), and a sequence-parallel call's gathered rows
        ``[N, D]`` for its backward (``(0,)`` otherwise).
    """
    local = local_call.localize(call)
    options = call.args.options
    tpc = local.tpc
    n_all = call.args.target_ids.numel()
    capacity = kept_out = None
    shard_call = tpc.call
    # keep as eager does for a call that records a graph (the budget decides how much)
    if call.args.builds_graph:
        # (one buffer: the op's output)
        shard_call = tpc.call_for_backward.flat_kept
        # the rows' count depends on the data: a prefix of a capacity
        if options.ignore_index is not None:
            capacity, kept_out = _op_kept_buffer(local, n_all)
    (logp, entropy, lse, argmax, _), (row_max, log_sum, mean_rel, kept) = shard_forward(
        local.hidden, local.weight, local.bias, local.local_target, tpc, shard_call, kept_out)
    if capacity is not None:
        kept = capacity
    # the normalizer rows keep the real values of ignored rows kept in place; compacted-away rows
    # get log S = inf (p = 0), so that a backward that keeps the rows in place (a CUDA-graph
    # capture) gives them no gradient either
    rows = [finish_rows_of(local, logp, n_all), finish_rows_of(local, lse, n_all),
            expand_kept_rows(row_max, local.keep_idx, n_all),
            expand_kept_rows(log_sum, local.keep_idx, n_all,
                                                                               fill=float("inf"))]
    if options.return_entropy:
        rows += [finish_rows_of(local, entropy, n_all),
                 expand_kept_rows(mean_rel, local.keep_idx, n_all)]
    if options.return_argmax:
        rows.append(finish_rows_of(local, argmax, n_all))
    packed = torch.stack(rows)
    gathered = local.hidden if local.own_rows is not None else local.hidden.new_empty(0)
    return packed, (kept if kept is not None else packed.new_empty(0)), gathered


def backward_packed(call, packed: torch.Tensor, grad_packed: torch.Tensor,
                    needs: tuple[bool, bool, bool], kept: Optional[torch.Tensor] = None,
                    gathered: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], ...]:
    """The backward of :func:`forward_packed`, through :func:`shard_backward` like the eager path's.

    Args:
        call: :func:`tplogp.op.plan.prepare_backward`'s (its verdict, the latest call's, is settled
            before any gradient).
        packed: the forward's packed result.
        grad_packed: its gradient (rows ``PACKED_LOGP``, ``PACKED_LSE``, ``PACKED_ENTROPY`` are
            read; ignored rows get none).
        needs: whether ``(d_hidden, d_weight, d_bias)`` are wanted.
        kept: what the forward kept (read, never overwritten), or None / an empty tensor.
        gathered: a sequence-parallel forward's gathered rows (not gathered again), or None / an
            empty tensor.
    Returns:
        ``(d_hidden, d_weight, d_bias)``, None where not needed; d_hidden in hidden's shape.
    """
    local = local_call.localize(call, gathered if gathered is not None
                                and gathered.numel() else None)
    options = call.args.options
    if local.keep_idx is not None:
        packed, grad_packed = packed.index_select(1, local.keep_idx), grad_packed.index_select(1, local.keep_idx)
    else:  # rows in place (or none ignored): the ignored ones get no upstream gradient
        grad_packed = zero_rows(local.ignored, grad_packed, dim=1)
    if options.ignore_index is not None:  # (what the rows kept: a prefix of the forward's capacity)
        kept = _op_kept_prefix(local, kept)
    mean_rel = packed[PACKED_MEAN_REL] if options.return_entropy else None
    g_entropy = grad_packed[PACKED_ENTROPY] if options.return_entropy else None
    saved = (local.hidden, local.weight, local.bias, local.local_target, packed[PACKED_ROW_MAX],
             packed[PACKED_LOG_SUM], mean_rel, kept if kept is not None and kept.numel() else None)
    # the op's kept buffer is read, never overwritten: ``tplogp::linear_logp_bwd`` declares no
    # mutation (tplogp.op.ops)
    d_hidden, d_weight, d_bias = shard_backward(saved, local.tpc, local.tpc.call, needs, False,
                                                grad_packed[PACKED_LOGP], g_entropy,
                                                grad_packed[PACKED_LSE])
    if d_hidden is not None:
        hidden = call.args.hidden
        # (sequence-parallel ignored rows are in place: their upstream is zero above)
        if local.own_rows is None:
            d_hidden = finish_rows_of(local, d_hidden, call.args.target_ids.numel())
        d_hidden = d_hidden.view(hidden.shape)
    return d_hidden, d_weight, d_bias


def finish_rows_of(local: LocalCall, x: torch.Tensor, n_all: int) -> torch.Tensor:
    """:func:`tplogp.support.tensors.finish_rows` with the local call's compaction."""
    return finish_rows(x, n_all, local.keep_idx, local.ignored)
