"""The native source's per-token column mask of a sampler's support (``ShardCall.support``).

A tile ``[rows, v0:v1)`` of the logits keeps, in row ``t``, the columns of the shard-local ids of
row ``t`` of the support; every other column is set to ``-inf`` in the forward (the
masked-vocabulary rule of docs/operator.md then gives the renormalized statistics exactly: ``p = 0``
there) and its ``dz`` to 0 in the backward. The mask is made per tile by one scatter of the support
rows into a chunk-local ``[rows, cols + 1]`` boolean (ids outside the tile go to the extra column),
so nothing of size ``[N, V]`` is held.

When the union of the call's supports is small (:func:`gathered`), the call runs on the gathered
weight rows of that union alone (the ids become positions among them), and its argmax and its
``d_W`` / ``d_b`` rows are put back at the shard's ids (:func:`scattered_argmax`,
:func:`scattered_grads`). When the whole union is large but each token's support is narrow, the call
runs from its (token, id) pairs alone (:func:`by_pairs`, :mod:`tplogp.backends.support_pairs`:
supports of at most ``support_pairs.MAX_IDS`` ids, and wider ragged ones whose rows, grouped by
size, hold few pairs), or token chunk by token chunk, each chunk on
the gathered rows of its own small union (:func:`chunk_rows`, :func:`chunked_forward`,
:func:`chunked_backward`). These ways are source-agnostic: the triton and sm90 sources take them
too (:mod:`tplogp.backends.fused_support`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional

import torch

from ..op.support_ids import KEEP_ALL
from . import memory_budget, support_pairs
from .base import ShardCall, ShardGrads


def kept_columns(ids: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
    """``[rows, v1 - v0]`` bool: whether column ``v0 + j`` is one of row ``t``'s shard-local
    ``ids`` (int64 ``[rows, K]``, ``-1`` for none; a row that starts with ``KEEP_ALL`` keeps every
    column)."""
    cols = v1 - v0
    rel = ids - v0
    rel = torch.where((ids >= 0) & (rel >= 0) & (rel < cols), rel, cols)
    keep = torch.zeros(ids.shape[0], cols + 1, dtype=torch.bool, device=ids.device)
    keep.scatter_(1, rel, True)
    keep = keep[:, :cols]
    if ids.shape[1]:
        keep |= (ids[:, :1] == KEEP_ALL)
    return keep


def support_rows(support: torch.Tensor, t0: int, t1: int, rows: int) -> torch.Tensor:
    """Rows ``[t0, t1)`` of the support, padded with ``-1`` rows to ``rows`` (a deterministic token
    chunk's padding rows keep no column)."""
    part = support[t0:t1]
    if part.shape[0] == rows:
        return part
    pad = part.new_full((rows - part.shape[0], part.shape[1]), -1)
    return torch.cat([part, pad])




# ---- the union of the supports' ids: gathered rows --------------------------------------------
# A call whose supports keep at most this fraction of the shard's ids (all tokens together) runs on
# the gathered rows of those ids alone (the logits' GEMMs shrink with them); larger unions mask the
# whole shard's tiles. Not under ``deterministic``: the union depends on the other rows, and a row's
# results there must not.
GATHER_FRACTION = 0.5


class Gathered(NamedTuple):
    """A call narrowed to the union of its supports' ids (``rows``, sorted shard-local ids): the
    gathered weight rows and bias, the targets and the support as positions among ``rows``."""

    rows: torch.Tensor  # int64 [U]
    weight: torch.Tensor  # [U, D]
    bias: Optional[torch.Tensor]  # [U] or None
    local_target: torch.Tensor  # [N] int64, -1 where the shard does not own the target
    call: ShardCall  # the call with the support as positions among ``rows``


def gathered(weight: torch.Tensor, bias: Optional[torch.Tensor], local_target: torch.Tensor,
             call: ShardCall) -> Optional[Gathered]:
    """The call on the union of its supports' ids when that union is small (at most
    ``GATHER_FRACTION`` of the shard's ids, and not all of them), else None (one host read: the
    union's size; none where the caller gives the union, ``call.support_union``). Its call's
    support is ``support_narrowed``: asked again, none (chunks do not nest in it)."""
    support, v = call.support, weight.shape[0]
    if support is None or call.deterministic or v == 0 or call.support_narrowed:
        return None
    rows = call.support_union
    if rows is None:
        if keeps_all(call):
            return None
        rows = torch.unique(support[support >= 0])  # sorted
        if rows.numel() == v or rows.numel() > GATHER_FRACTION * v:  # (every id: no gather)
            return None
    position = torch.full((v + 1,), -1, dtype=torch.int64, device=weight.device)
    position[rows] = torch.arange(rows.numel(), device=weight.device)

    def positions(ids: torch.Tensor) -> torch.Tensor:  # (-1 stays -1: the extra last entry)
        return position[torch.where((ids >= 0) & (ids < v), ids, v)]

    return Gathered(rows, weight.index_select(0, rows),
                    None if bias is None else bias.index_select(0, rows),
                    positions(local_target),
                    replace(call, support=positions(support), support_union=None,
                            support_narrowed=True, support_logits=None))


def scattered_argmax(argmax: Optional[torch.Tensor], rows: torch.Tensor) -> Optional[torch.Tensor]:
    """A gathered call's argmax (fp32 positions among ``rows``) as shard-local ids (fp32); 0 where
    the shard keeps no id."""
    if argmax is None or rows.numel() == 0:
        return argmax
    return rows[argmax.long()].to(torch.float32)


def scattered_grads(grads: ShardGrads, rows: torch.Tensor, weight: torch.Tensor,
                    bias: Optional[torch.Tensor],
                    accumulate: Optional[tuple]) -> ShardGrads:
    """A gathered call's ``d_weight`` / ``d_bias`` rows put back at ``rows`` of the shard: added to
    the caller's fp32 accumulators (``accumulate``, returned), else in zeroed full-size gradients of
    the weight's / bias's dtype (0 on the rows no support keeps)."""
    acc_w, acc_b = accumulate if accumulate is not None else (None, None)
    d_w, d_b = grads.d_weight, grads.d_bias
    if d_w is not None:
        if acc_w is not None:
            d_w = acc_w.index_add_(0, rows, d_w)
        else:
            d_w = torch.zeros_like(weight).index_copy_(0, rows, d_w.to(weight.dtype))
    if d_b is not None:
        if acc_b is not None:
            d_b = acc_b.index_add_(0, rows, d_b)
        else:
            d_b = torch.zeros_like(bias).index_copy_(0, rows, d_b.to(bias.dtype))
    return ShardGrads(grads.d_hidden, d_w, d_b)


def gathered_accumulators(accumulate: Optional[tuple], rows: int) -> Optional[tuple]:
    """Zeroed fp32 accumulators of ``rows`` rows for a gathered backward whose caller accumulates
    (added to the caller's by :func:`scattered_grads`), or None."""
    if accumulate is None:
        return None
    acc_w, acc_b = accumulate
    return (None if acc_w is None else acc_w.new_zeros(rows, acc_w.shape[1]),
            None if acc_b is None else acc_b.new_zeros(rows))


# ---- token chunks with small unions: the gathered rows, chunk by chunk -------------------------
# A call whose union covers much of the shard (tokens with different supports) but whose supports
# are narrow runs token chunk by token chunk, each chunk on the gathered rows of its own union (at
# most ``CHUNK_IDS`` ids and ``CHUNK_FRACTION`` of the shard's: at most ``K`` ids per token): the
# logits' GEMMs shrink to the chunks' unions, and each chunk gathers its rows of W. Chunks of fewer
# than ``MIN_CHUNK_ROWS`` tokens are not worth their launches and host reads: wider supports mask
# the whole shard. Not under ``deterministic`` (as :func:`gathered`). The backward adds each
# chunk's ``d_W`` / ``d_b`` rows to fp32 accumulators: the fused loss's own, else ``4 V (D + 1)``
# bytes made for it where the call's memory budget holds them (:func:`accumulators_fit`; else the
# backward masks the whole shard). Supports that :func:`by_pairs` takes (at most
# ``support_pairs.MAX_IDS`` ids, or ragged with few pairs) do not take this way: they run from
# their (token, id) pairs (:mod:`tplogp.backends.support_pairs`).
CHUNK_IDS = 16384
CHUNK_FRACTION = 0.25  # a chunk's ids at most, over the shard's
MIN_CHUNK_ROWS = 128


def chunk_ids(v: int) -> int:
    """The most ids a token chunk's union may hold in a shard of ``v`` ids."""
    return int(min(CHUNK_IDS, CHUNK_FRACTION * v))


def chunk_rows(n: int, v: int, call: ShardCall) -> Optional[int]:
    """The token rows per chunk of a call that runs chunk by chunk on gathered rows (above), or
    None (one host read where it could: whether a row keeps every id). Never for a chunk
    (``support_union`` given) or a gathered call (``support_narrowed``): chunks do not nest."""
    support = call.support
    if (support is None or call.deterministic or n == 0 or v == 0 or support.shape[1] == 0
            or call.support_narrowed or call.support_union is not None):
        return None
    rows = chunk_ids(v) // support.shape[1]
    if rows < MIN_CHUNK_ROWS or rows >= n:
        return None
    if keeps_all(call):
        return None
    return rows


def keeps_all(call: ShardCall) -> bool:
    """Whether some row of the call's support keeps every id (``KEEP_ALL``): as the call says
    (``ShardCall.support_keeps_all``), else read from the support (one host read)."""
    if call.support_keeps_all is not None:
        return call.support_keeps_all
    support = call.support
    return bool(support.shape[1]) and bool((support[:, 0] == KEEP_ALL).any())


def by_pairs(call: ShardCall, weight: torch.Tensor) -> bool:
    """Whether the call runs from its (token, id) pairs (:mod:`tplogp.backends.support_pairs`),
    where no sum of the logits is asked for (it reaches every column): supports of at most
    ``support_pairs.MAX_IDS`` ids that the token-chunk way would take (:func:`chunk_rows`), and
    wider ragged ones whose rows, grouped by size, run at most ``MAX_IDS / 2`` pairs a token on
    average (:func:`tplogp.backends.support_pairs.pair_rows`: one host read, the call's sizes,
    kept for its backward) where the token-chunk way's conditions but the width hold. A function of
    the call alone: its forward and its backward decide alike."""
    support = call.support
    if support is None or support.shape[1] == 0 or call.with_sum_z:
        return False
    n = support.shape[0]
    if support.shape[1] <= support_pairs.MAX_IDS:
        return chunk_rows(n, weight.shape[0], call) is not None
    if (call.deterministic or n < MIN_CHUNK_ROWS or weight.shape[0] == 0 or call.support_narrowed
            or call.support_union is not None or keeps_all(call)):
        return False
    return support_pairs.pair_rows(support).pairs() <= n * support_pairs.MAX_IDS // 2


def chunk_unions(support: torch.Tensor, rows: int, v: int) -> list[torch.Tensor]:
    """The sorted union of the shard-local ids of each token chunk of ``rows`` rows of ``support``
    (int64 ``[n, K]``, ``-1`` for none, no ``KEEP_ALL`` row), every chunk at once: the ids of a
    chunk sorted (``-1`` as ``v``, last), the first of each run of equal ids kept, sorted again to
    put them first; one host read (the chunks' union sizes)."""
    n, k = support.shape
    chunks = -(-n // rows)
    ids = torch.where(support >= 0, support, v)
    if chunks * rows != n:
        ids = torch.cat([ids, ids.new_full((chunks * rows - n, k), v)])
    ids = ids.view(chunks, rows * k).sort(dim=1).values
    first = ids < v
    first[:, 1:] &= ids[:, 1:] != ids[:, :-1]
    sizes = first.sum(1).tolist()
    ids = ids.masked_fill(~first, v).sort(dim=1).values
    return [ids[c, :size] for c, size in enumerate(sizes)]


def accumulators_fit(source: str, weight: torch.Tensor, call: ShardCall) -> bool:
    """Whether a chunked backward's own fp32 ``d_W`` / ``d_b`` accumulators (``4 V (D + 1)``
    bytes: made where the caller passes none) fit the call's memory budget for ``source``
    (:func:`tplogp.backends.memory_budget.split`: what the call may hold beyond its inputs,
    outputs and gradients). Where they do not, the backward runs from the pairs or masks the
    whole shard instead."""
    split = memory_budget.split(source, call.workspace_bytes, weight.device, call.deterministic)
    return 4 * weight.shape[0] * (weight.shape[1] + 1) <= split.transient + split.keep


def chunked_forward(forward, rows: int, hidden: torch.Tensor, target: torch.Tensor, v: int,
                    call: ShardCall):
    """``forward(hidden rows, target rows, call)`` over token chunks of ``rows`` rows, each with its
    rows of the support and their union (:func:`chunk_unions`, of a shard of ``v`` ids) and keeping
    nothing (the backward recomputes), the outputs concatenated (a NamedTuple of ``[N]`` tensors
    or None)."""
    outs = []
    unions = chunk_unions(call.support, rows, v)
    for t0, union in zip(range(0, hidden.shape[0], rows), unions):
        t1 = t0 + rows
        outs.append(forward(hidden[t0:t1], target[t0:t1],
                            replace(call, support=call.support[t0:t1], support_union=union,
                                    for_backward=False, support_logits=None)))
    return type(outs[0])(*(None if parts[0] is None else torch.cat(parts) for parts in zip(*outs)))


def chunked_backward(backward, rows: int, hidden: torch.Tensor, weight: torch.Tensor,
                     bias: Optional[torch.Tensor], local_target: torch.Tensor, per_token: tuple,
                     call: ShardCall, needs: tuple[bool, bool, bool], d_hidden_ready,
                     accumulate: Optional[tuple], grad_sum_z) -> ShardGrads:
    """A backend's ``backward`` over token chunks of ``rows`` rows (``backward(hidden rows, target
    rows, per-token tensors' rows, call, accumulate, grad_sum_z rows)``; ``per_token``: ``(row_max,
    log_sum, grad_logp, grad_entropy, grad_lse, mean_rel)``, each ``[N]`` or None), each chunk's
    ``d_W`` / ``d_b`` rows added to fp32 accumulators (the caller's, else made here and returned in
    the weight's / bias's dtype), ``d_hidden`` concatenated and handed to ``d_hidden_ready`` once
    complete."""
    n = hidden.shape[0]
    _, need_w, need_b = needs
    own = accumulate is None
    if own:
        accumulate = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                      if need_w else None,
                      torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                      if need_b and bias is not None else None)

    def part(x, t0: int, t1: int):
        return x[t0:t1] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == n else x

    d_hidden = []
    unions = chunk_unions(call.support, rows, weight.shape[0])
    for t0, union in zip(range(0, n, rows), unions):
        t1 = t0 + rows
        grads = backward(hidden[t0:t1], local_target[t0:t1],
                         tuple(part(x, t0, t1) for x in per_token),
                         replace(call, support=call.support[t0:t1], support_union=union,
                                 support_logits=None),
                         accumulate, part(grad_sum_z, t0, t1))
        d_hidden.append(grads.d_hidden)
    dh = None if d_hidden[0] is None else torch.cat(d_hidden)
    if d_hidden_ready is not None and dh is not None:
        d_hidden_ready(dh)
    acc_w, acc_b = accumulate
    if own:
        acc_w = None if acc_w is None else acc_w.to(weight.dtype)
        acc_b = None if acc_b is None else acc_b.to(bias.dtype)
    return ShardGrads(dh, acc_w, acc_b)


def gathered_backward(backend, hidden, weight, bias, local_target, row_max, log_sum, grad_logp,
                      grad_entropy, grad_lse, mean_rel, call: ShardCall, needs,
                      d_hidden_ready=None, kept=None, accumulate=None,
                      grad_sum_z=None) -> Optional[ShardGrads]:
    """``backend.backward`` of a call with a support on gathered rows, where its forward ran there
    (the same decisions, made again from the call): on the union of the supports' ids
    (:func:`gathered`), its ``d_W`` / ``d_b`` rows put back at the shard's ids; else from the
    (token, id) pairs (:func:`by_pairs`); else token chunk by token chunk (:func:`chunk_rows`,
    where the fp32 accumulators are the caller's or fit the budget: :func:`accumulators_fit`);
    else None (the caller masks the whole shard). Every source's backward asks it first."""
    narrow = gathered(weight, bias, local_target, call)
    if narrow is not None:
        grads = backend.backward(hidden, narrow.weight, narrow.bias, narrow.local_target, row_max,
                                 log_sum, grad_logp, grad_entropy, grad_lse, mean_rel, narrow.call,
                                 needs, d_hidden_ready, kept,
                                 gathered_accumulators(accumulate, narrow.rows.numel()),
                                 grad_sum_z)
        return scattered_grads(grads, narrow.rows, weight, bias, accumulate)
    if kept is None and by_pairs(call, weight):
        return support_pairs.backward(backend.name, hidden, weight, bias, local_target, row_max,
                                      log_sum, grad_logp, grad_entropy, grad_lse, mean_rel, call,
                                      needs, d_hidden_ready, accumulate)
    rows = None if kept is not None else chunk_rows(hidden.shape[0], weight.shape[0], call)
    if rows is None or (accumulate is None and not accumulators_fit(backend.name, weight, call)):
        return None
    return chunked_backward(
        lambda h, t, per_token, c, acc, gz: backend.backward(h, weight, bias, t, *per_token, c,
                                                             needs, None, None, acc, gz),
        rows, hidden, weight, bias, local_target,
        (row_max, log_sum, grad_logp, grad_entropy, grad_lse, mean_rel), call, needs,
        d_hidden_ready, accumulate, grad_sum_z)


__all__ = ["kept_columns", "support_rows", "GATHER_FRACTION", "Gathered", "gathered",
           "scattered_argmax", "scattered_grads", "gathered_accumulators", "CHUNK_IDS",
           "CHUNK_FRACTION", "MIN_CHUNK_ROWS", "chunk_ids", "chunk_rows", "keeps_all", "by_pairs",
           "chunk_unions", "accumulators_fit", "chunked_forward", "chunked_backward",
           "gathered_backward"]
