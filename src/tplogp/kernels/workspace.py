"""How a budget splits between the backward's d_logits workspace and the kept softmax terms, and how the backward
cuts the vocab into workspace chunks (torch only: no Triton import).

The transient d_logits workspace gets up to ``DEFAULT_WORKSPACE_BYTES``; the rest of a call's budget holds softmax
terms kept from forward to backward (:mod:`.kept`). Without a budget small calls keep every column
(:func:`default_keep`). Chunk widths are multiples of ``CHUNK_ALIGN``, so the deterministic d_hidden K order is the
same whatever the chunking.
"""

from __future__ import annotations

from typing import Optional

from .. import settings
from .kept import PLANNING_BLOCK_V, kept_bytes
from .tiles import cdiv

_MIB = 1 << 20
# Default d_logits workspace budget (bytes): large enough for full-efficiency GEMMs at N = 8192
# ([8192, 8192] bf16 chunks), small against the 256 MiB extra-memory allowance.
DEFAULT_WORKSPACE_BYTES = 128 * _MIB
# Chunk widths are multiples of this (covers every BLOCK_V and BLOCK_K in the config table), so that the
# deterministic d_hidden K order is the same whatever the chunking.
CHUNK_ALIGN = 256


def workspace_budget(workspace_bytes: Optional[int]) -> Optional[int]:
    """The call's budget in bytes, else ``TPLOGP_WORKSPACE_MB``, else None (the default, :func:`default_keep`)."""
    if workspace_bytes is not None:
        return workspace_bytes
    return settings.workspace_bytes()


def split_budget(workspace_bytes: Optional[int]) -> tuple[int, int]:
    """``(d_logits workspace bytes, kept-logits bytes)`` of a budget (the call's, else ``TPLOGP_WORKSPACE_MB``).

    The transient d_logits workspace gets up to ``DEFAULT_WORKSPACE_BYTES``; the rest holds fp32 logits kept from
    forward to backward. Unset: the default workspace and no keep bytes (a GPU source then keeps what
    :func:`default_keep` allows)."""
    budget = workspace_budget(workspace_bytes)
    if budget is None:
        return DEFAULT_WORKSPACE_BYTES, 0
    return min(budget, DEFAULT_WORKSPACE_BYTES), max(0, budget - DEFAULT_WORKSPACE_BYTES)



def default_keep(n: int, v: int, itemsize: int = 2, block_v: int = PLANNING_BLOCK_V) -> int:
    """Vocab columns kept under the default budget (no call budget, no ``TPLOGP_WORKSPACE_MB``): the whole shard when
    its kept terms and scales fit ``DEFAULT_WORKSPACE_BYTES``, else none.

    Such a call's backward runs one chunk either way: without keeping it allocates an ``[N, V]`` d_logits workspace
    of the weight's dtype, with keeping it writes d_logits in place of the kept terms (``ShardCall.consume_kept``).
    So the backward's peak grows at most by the scales (``4 / block_v`` bytes per logit; the eager paths free them
    before allocating the gradients, ``ShardCall.scales_apart``), and the call skips the
    recompute GEMM: at small shapes, where that GEMM is a quarter of the GPU time, the default runs 3 GEMMs. The
    terms are held from forward to backward (at most ``DEFAULT_WORKSPACE_BYTES`` per call); an explicit budget of
    ``DEFAULT_WORKSPACE_BYTES`` keeps nothing."""
    if n == 0 or v == 0 or kept_bytes(n, v, itemsize, block_v) > DEFAULT_WORKSPACE_BYTES:
        return 0
    return v


def plan_keep(n: int, v: int, keep_bytes: int, itemsize: int = 2, block_v: int = PLANNING_BLOCK_V) -> int:
    """Vocab columns ``[0, cols)`` of the shard whose kept terms and scales (all N tokens, :func:`kept_bytes`) fit
    ``keep_bytes``: V when the whole shard fits, else a multiple of CHUNK_ALIGN (possibly 0), so the backward's
    chunks stay aligned."""
    if n == 0 or v == 0 or keep_bytes <= 0:
        return 0
    if kept_bytes(n, v, itemsize, block_v) <= keep_bytes:
        return v
    cols = (keep_bytes * block_v // (n * (itemsize * block_v + 4)) // CHUNK_ALIGN) * CHUNK_ALIGN
    while cols > 0 and kept_bytes(n, cols, itemsize, block_v) > keep_bytes:
        cols -= CHUNK_ALIGN
    return min(max(cols, 0), v)



def keep_capacity(n: int, v: int, workspace_bytes: Optional[int], deterministic: bool, itemsize: int = 2,
                  block_v: int = PLANNING_BLOCK_V) -> int:
    """Bytes that hold what a call of any ``n' <= n`` tokens keeps (:func:`default_keep`, :func:`plan_keep`): fewer
    tokens may keep more columns, but never more bytes than the keep part of the budget (the default:
    ``DEFAULT_WORKSPACE_BYTES``, none when deterministic) nor than all ``n`` tokens' every column
    (:func:`kept_bytes` grows with the tokens and the columns)."""
    if workspace_budget(workspace_bytes) is None:
        keep = 0 if deterministic else DEFAULT_WORKSPACE_BYTES
    else:
        keep = split_budget(workspace_bytes)[1]
    return min(keep, kept_bytes(n, v, itemsize, block_v))


def plan_chunk(n: int, v: int, itemsize: int, workspace_bytes: int) -> int:
    """Vocab columns per backward chunk: the ``[N, chunk]`` workspace fits ``workspace_bytes`` (the d_logits part of
    the budget, :func:`split_budget`); a multiple of CHUNK_ALIGN."""
    cols = workspace_bytes // max(1, n * itemsize)
    cols = max(CHUNK_ALIGN, (cols // CHUNK_ALIGN) * CHUNK_ALIGN)
    return min(cols, cdiv(v, CHUNK_ALIGN) * CHUNK_ALIGN)
