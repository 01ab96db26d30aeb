"""How the triton / sm90 backward cuts the vocab into d_logits workspace chunks, and which columns a
budget's kept part holds (torch only: no Triton import).

The budget's split into the d_logits workspace and the kept part is
:func:`tplogp.backends.memory_budget.split`'s. Kept columns are the shard's first ones
(:func:`plan_keep`; without a budget :func:`keep_whole`); chunk widths are multiples of
``CHUNK_ALIGN``, so the deterministic d_hidden K order is the same whatever the chunking.
"""

from __future__ import annotations

from .kept import PLANNING_BLOCK_V, kept_bytes
from .tiles import cdiv

# Chunk widths are multiples of this (covers every BLOCK_V and BLOCK_K in the config table), so that
# the deterministic d_hidden K order is the same whatever the chunking.
CHUNK_ALIGN = 256


def keep_whole(n: int, v: int, limit_bytes: int, itemsize: int = 2,
               block_v: int = PLANNING_BLOCK_V) -> int:
    """Vocab columns kept without a budget (``BudgetSplit.keep_whole``): the whole shard when its
    kept terms and scales fit ``limit_bytes``, else none."""
    if n == 0 or v == 0 or kept_bytes(n, v, itemsize, block_v) > limit_bytes:
        return 0
    return v


def plan_keep(n: int, v: int, keep_bytes: int, itemsize: int = 2,
              block_v: int = PLANNING_BLOCK_V) -> int:
    """Vocab columns ``[0, cols)`` of the shard whose kept terms and scales (all N tokens,
    :func:`kept_bytes`) fit ``keep_bytes``: V when the whole shard fits, else a multiple of
    CHUNK_ALIGN (possibly 0), so the backward's chunks stay aligned."""
    if n == 0 or v == 0 or keep_bytes <= 0:
        return 0
    if kept_bytes(n, v, itemsize, block_v) <= keep_bytes:
        return v
    cols = (keep_bytes * block_v // (n * (itemsize * block_v + 4)) // CHUNK_ALIGN) * CHUNK_ALIGN
    while cols > 0 and kept_bytes(n, cols, itemsize, block_v) > keep_bytes:
        cols -= CHUNK_ALIGN
    return min(max(cols, 0), v)



def keep_capacity(n: int, v: int, keep_limit_bytes: int, itemsize: int = 2,
                  block_v: int = PLANNING_BLOCK_V) -> int:
    """Bytes that hold what a call of any ``n' <= n`` tokens keeps (:func:`keep_whole`,
    :func:`plan_keep`): fewer tokens may keep more columns, but never more bytes than the budget's
    keep limit (``BudgetSplit.keep``, or without a budget ``BudgetSplit.keep_whole``) nor than all
    ``n`` tokens' every column (:func:`kept_bytes` grows with the tokens and the columns)."""
    return min(keep_limit_bytes, kept_bytes(n, v, itemsize, block_v))


def plan_chunk(n: int, v: int, itemsize: int, workspace_bytes: int) -> int:
    """Vocab columns per backward chunk: the ``[N, chunk]`` workspace fits ``workspace_bytes`` (the
    budget's transient part, :func:`tplogp.backends.memory_budget.split`); a multiple of
    CHUNK_ALIGN."""
    cols = workspace_bytes // max(1, n * itemsize)
    cols = max(CHUNK_ALIGN, (cols // CHUNK_ALIGN) * CHUNK_ALIGN)
    return min(cols, cdiv(v, CHUNK_ALIGN) * CHUNK_ALIGN)
