"""``workspace_bytes`` values from what they should keep, for a source on a device.

A budget is the source's transient part (``native`` tiles, the ``triton`` / ``sm90`` d_logits
workspace: the source's ``transient_bytes``) plus its kept part, what the forward keeps for the
backward: per kept logit its softmax term ``exp(z - m)`` in 2 bytes for 16-bit inputs (4 for fp32),
plus one fp32 scale per row and tile (the source's ``kept_bytes``). How a budget splits is
:func:`tplogp.backends.memory_budget.split`'s (docs/operator.md, "Memory budget"). These helpers add
the second part to the first, so a caller states tokens and vocab rather than each source's default:

* :func:`keep_logits_budget`: ``linear_logp`` keeps ``fraction`` of a call's ``[N, V_local]``
  logits' terms (the backward skips the recompute GEMM for that share; 1.0: 3 GEMMs instead of 4).
* :func:`loss_chunk_budget`: ``linear_logp_loss`` runs token chunks of ``chunk_tokens`` with every
  chunk's logits kept, its fp32 ``d_W`` / ``d_b`` accumulators (``D`` units of ``4 * V`` bytes for a
  16-bit weight, :func:`accumulator_tokens`) counted in.

:func:`plan_chunk_tokens` is the other direction, the fused loss's chunk from a budget.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .backends.base import ShardBackend
from .backends.kernel_registry import SourceUnavailableError, backend_for_call, get_backend

#: What names a source here, as in the op: a registry name, None (the registry's choice), or a
#backend object.
Source = Union[None, str, ShardBackend]


# On a GPU, chunks under this many tokens under-fill the kernels' token tiles (128-256 rows): one
# chunk that keeps the budget's share of its logits and recomputes the rest is then the faster
# choice.
GPU_MIN_CHUNK_TOKENS = 256


def accumulator_tokens(dim: int, weight_dtype: Optional[torch.dtype],
                       bias_dtype: Optional[torch.dtype]) -> int:
    """What the fp32 ``d_W`` / ``d_b`` accumulators of several chunks take beyond the gradients
    themselves, in units of ``4 * V_local`` bytes (one fp32 row of the shard's vocabulary): ``D``
    for a low-precision weight, 1 for a low-precision bias; 0 for an fp32 one (its accumulator is
    its gradient) or one without a gradient (``None``)."""
    low = [t is not None and t != torch.float32 for t in (weight_dtype, bias_dtype)]
    return dim * low[0] + low[1]


def _kept_bytes(backend, n: int, vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes the source keeps for ``n`` tokens' terms of ``vocab`` columns (4 per logit for a source
    that does not say)."""
    kept_bytes = getattr(backend, "kept_bytes", None)
    return kept_bytes(n, vocab, dtype, device) if kept_bytes is not None else 4 * n * vocab


def plan_chunk_tokens(backend, n: int, vocab: int, workspace_bytes: Optional[int],
                      device: torch.device, accumulators: int,
                      dtype: torch.dtype = torch.bfloat16) -> int:
    """Tokens per chunk, from sizes that every rank shares (``n``, the global ``vocab``,
    ``accumulators`` from :func:`accumulator_tokens`, the inputs' ``dtype``): the same chunks on
    every rank.

    The kept part of the budget holds the softmax terms of ``R`` tokens over the whole vocabulary
    (the source's ``kept_bytes``: 2 bytes per logit for 16-bit inputs plus the scales; a rank keeps
    a chunk's terms of its own shard: at most that). ``R >= n``: one chunk, every term kept, ``d_W``
    written once. Otherwise several chunks sum ``d_W`` (and ``d_b``) in fp32 accumulators
    (``accumulators * 4 * vocab`` bytes), which count against the same kept part: a chunk is the
    most tokens whose terms fit beside them. Below the minimum chunk (one token;
    ``GPU_MIN_CHUNK_TOKENS`` on a GPU) or when nothing is kept: one chunk, of which the source keeps
    what the budget holds (its first vocab columns or tiles) and recomputes the rest."""
    keep_bytes = getattr(backend, "keep_bytes", None)
    keep = keep_bytes(workspace_bytes, device) if keep_bytes is not None else 0
    if keep <= 0 or _kept_bytes(backend, max(n, 1), vocab, dtype, device) <= keep:
        return max(n, 1)
    room = keep - accumulators * vocab * 4
    # the most tokens whose terms fit ``room`` (kept bytes grow with the tokens): bisection
    chunk, above = 0, n
    while above - chunk > 1:
        mid = (chunk + above) // 2
        chunk, above = (mid, above) if _kept_bytes(backend, mid, vocab, dtype, device) <= room else (chunk, mid)
    if chunk < (GPU_MIN_CHUNK_TOKENS if device.type == "cuda" else 1):
        return max(n, 1)
    return chunk


def _backend(source: Source, device: Optional[torch.device | str]):
    """``(backend, device)``. An explicit source need not run here: sizes are planned ahead (for the
    GPU of a later job, say); only an uninstalled one raises. None: the registry's choice on
    ``device``; a backend object: itself."""
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if source is not None and not isinstance(source, str):
        backend = source
    elif source in (None, "registry", "auto"):
        backend = backend_for_call(None, dev, torch.bfloat16)
    else:
        backend = get_backend(source)
    if getattr(backend, "transient_bytes", None) is None or getattr(backend, "kept_bytes",
                                                                    None) is None:
        raise SourceUnavailableError(f"source {source!r} is not available: {backend.unavailable_reason(dev)}")
    return backend, dev


def keep_logits_budget(n_tokens: int, v_local: int, *, fraction: float = 1.0, source: Source = None,
                       device: Optional[torch.device | str] = None,
                       dtype: Optional[torch.dtype] = None) -> int:
    """The ``workspace_bytes`` with which ``linear_logp`` keeps ``fraction`` of a call's logits
    (their softmax terms) from forward to backward: ``n_tokens`` after ``ignore_index`` compaction,
    ``v_local`` the shard's vocab (each rank computes its own), ``dtype`` the inputs' (16-bit: 2
    bytes per kept logit; fp32: 4), plus the scales; None: fp32's size, enough for any inputs (the
    sources allocate what they keep, not the budget; pass the inputs' dtype for the exact size, and
    for a fraction below 1 of 16-bit inputs). ``source`` / ``device``: those of the call (default:
    the registry's choice on the current device). The sources keep whole units of their own
    (``triton`` / ``sm90``: 256 vocab columns unless the whole shard fits; ``native``: tiles), so a
    fraction below 1 keeps at most that share."""
    if n_tokens < 0 or v_local < 0:
        raise ValueError(f"n_tokens and v_local must be >= 0, got {n_tokens} and {v_local}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    backend, dev = _backend(source, device)
    kept = backend.kept_bytes(n_tokens, int(fraction * v_local), dtype or torch.float32, dev)
    return int(backend.transient_bytes(dev)) + int(kept)


def loss_chunk_budget(chunk_tokens: int, hidden_size: int, vocab_size: int, *,
                      dtype: torch.dtype = torch.bfloat16, bias_dtype: Optional[torch.dtype] = None,
                      source: Source = None, device: Optional[torch.device | str] = None) -> int:
    """The ``workspace_bytes`` with which ``linear_logp_loss`` runs chunks of ``chunk_tokens``
    tokens, each chunk's logits kept (their softmax terms: 3 GEMMs), the fp32 ``d_W`` / ``d_b``
    accumulators of several chunks counted in (:func:`accumulator_tokens`: ``4 * vocab_size`` bytes
    per unit, ``hidden_size`` units for a weight of ``dtype`` below fp32, one more for such a bias,
    ``bias_dtype``; None: no bias). ``vocab_size``: the global vocabulary (the same
    budget on every rank). A batch of at most ``chunk_tokens`` tokens runs as one chunk within it.
    On a GPU chunks under :data:`GPU_MIN_CHUNK_TOKENS` tokens are not run (one partly kept chunk
    instead)."""
    if chunk_tokens < 1 or hidden_size < 1 or vocab_size < 1:
        raise ValueError(f"chunk_tokens, hidden_size and vocab_size must be >= 1, got {chunk_tokens}, "
                         f"{hidden_size} and {vocab_size}")
    backend, dev = _backend(source, device)
    accumulators = accumulator_tokens(hidden_size, dtype, bias_dtype) * vocab_size * 4
    return (int(backend.transient_bytes(dev)) + int(backend.kept_bytes(chunk_tokens, vocab_size,
                                                                       dtype, dev))
            + accumulators)
