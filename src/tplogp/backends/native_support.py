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
:func:`scattered_grads`). That way is source-agnostic: the triton and sm90 sources take it too
(:mod:`tplogp.backends.fused_support`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional

import torch

from ..op.support_ids import KEEP_ALL
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
    union's size)."""
    support, v = call.support, weight.shape[0]
    if support is None or call.deterministic or v == 0:
        return None
    if support.shape[1] and bool((support[:, 0] == KEEP_ALL).any()):  # (a row keeps every id)
        return None
    rows = torch.unique(support[support >= 0])  # sorted
    if rows.numel() == v or rows.numel() > GATHER_FRACTION * v:  # (every id: nothing to gather)
        return None
    position = torch.full((v + 1,), -1, dtype=torch.int64, device=weight.device)
    position[rows] = torch.arange(rows.numel(), device=weight.device)

    def positions(ids: torch.Tensor) -> torch.Tensor:  # (-1 stays -1: the extra last entry)
        return position[torch.where((ids >= 0) & (ids < v), ids, v)]

    return Gathered(rows, weight.index_select(0, rows),
                    None if bias is None else bias.index_select(0, rows),
                    positions(local_target), replace(call, support=positions(support)))


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


__all__ = ["kept_columns", "support_rows", "GATHER_FRACTION", "Gathered", "gathered",
           "scattered_argmax", "scattered_grads", "gathered_accumulators"]
