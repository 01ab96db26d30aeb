"""The native source's per-token column mask of a sampler's support (``ShardCall.support``).

A tile ``[rows, v0:v1)`` of the logits keeps, in row ``t``, the columns of the shard-local ids of
row ``t`` of the support; every other column is set to ``-inf`` in the forward (the
masked-vocabulary rule of docs/operator.md then gives the renormalized statistics exactly: ``p = 0``
there) and its ``dz`` to 0 in the backward. The mask is made per tile by one scatter of the support
rows into a chunk-local ``[rows, cols + 1]`` boolean (ids outside the tile go to the extra column),
so nothing of size ``[N, V]`` is held.
"""

from __future__ import annotations

import torch


def kept_columns(ids: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
    """``[rows, v1 - v0]`` bool: whether column ``v0 + j`` is one of row ``t``'s shard-local
    ``ids`` (int64 ``[rows, K]``, ``-1`` for none)."""
    cols = v1 - v0
    rel = ids - v0
    rel = torch.where((ids >= 0) & (rel >= 0) & (rel < cols), rel, cols)
    keep = torch.zeros(ids.shape[0], cols + 1, dtype=torch.bool, device=ids.device)
    keep.scatter_(1, rel, True)
    return keep[:, :cols]


def support_rows(support: torch.Tensor, t0: int, t1: int, rows: int) -> torch.Tensor:
    """Rows ``[t0, t1)`` of the support, padded with ``-1`` rows to ``rows`` (a deterministic token
    chunk's padding rows keep no column)."""
    part = support[t0:t1]
    if part.shape[0] == rows:
        return part
    pad = part.new_full((rows - part.shape[0], part.shape[1]), -1)
    return torch.cat([part, pad])


__all__ = ["kept_columns", "support_rows"]
