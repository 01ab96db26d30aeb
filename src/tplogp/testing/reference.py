"""Materialized full-vocab references (for tests, the runbook script and benchmarks; never for
production).

``mode="fp32"``      upcast hidden, weight and bias to fp32, then ``F.linear`` and an fp32
log_softmax. ``mode="matching"``  ``F.linear`` in the input dtype (what a plain PyTorch LM head
does), then fp32 log_softmax. ``mode="float64"``   everything in float64: the ground truth the tests
measure errors against.

All modes take the *full* (unsharded) weight ``[V, D]`` and are differentiable through autograd.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Optional

import torch
import torch.nn.functional as F

ReferenceMode = Literal["fp32", "matching", "float64"]
REFERENCE_MODES: tuple[str, ...] = ("fp32", "matching", "float64")


class ReferenceOutputs(NamedTuple):
    logp: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor


def reference_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    mode: ReferenceMode = "fp32",
    temperature: float = 1.0,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """``cap(hidden @ weight.T + bias) / temperature`` as a materialized ``[..., V]`` tensor in the
    mode's dtype (``cap(y) = softcap * tanh(y / softcap)``, the identity when ``softcap`` is
    None)."""
    if mode not in REFERENCE_MODES:
        raise ValueError(f"unknown reference mode {mode!r}; expected one of {REFERENCE_MODES}")
    if mode == "matching":
        logits = F.linear(hidden, weight, bias).float()
    else:
        dt = torch.float32 if mode == "fp32" else torch.float64
        logits = F.linear(hidden.to(dt), weight.to(dt), None if bias is None else bias.to(dt))
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def reference_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    mode: ReferenceMode = "fp32",
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    softcap: Optional[float] = None,
) -> ReferenceOutputs:
    """logp, entropy and lse per token (targets' shape); ignored positions give 0 logp and 0
    entropy."""
    logits = reference_logits(hidden, weight, bias, mode=mode, temperature=temperature,
                              softcap=softcap)
    logprobs = torch.log_softmax(logits, dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    return _per_token(logprobs, logprobs.exp(), lse, target_ids, _kept(target_ids, ignore_index))


def _kept(target_ids: torch.Tensor, ignore_index: Optional[int]) -> torch.Tensor:
    """Whether each token counts (its target is not ``ignore_index``)."""
    tgt = target_ids.long()
    return torch.ones_like(tgt, dtype=torch.bool) if ignore_index is None else tgt != ignore_index


def _per_token(logprobs: torch.Tensor, probs: torch.Tensor, lse: torch.Tensor,
               target_ids: torch.Tensor, keep: torch.Tensor) -> ReferenceOutputs:
    """The target's log-prob and the entropy ``-sum p log p`` per token, 0 where ``keep`` is
    False, beside ``lse``."""
    tgt = target_ids.long()
    safe = torch.where(keep, tgt, torch.zeros_like(tgt))
    logp = logprobs.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    entropy = -(probs * logprobs).sum(-1)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return ReferenceOutputs(torch.where(keep, logp, zero), torch.where(keep, entropy, zero), lse)


def reference_linear_logp(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    mode: ReferenceMode = "fp32",
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """``log_softmax(cap(hidden @ weight.T + bias) / temperature)[target]`` with the full vocab
    materialized.

    Output dtype: float32 for ``fp32``/``matching``, float64 for ``float64``.
    """
    return reference_outputs(
        hidden, weight, target_ids, bias, mode=mode, temperature=temperature,
        ignore_index=ignore_index, softcap=softcap).logp


def support_mask(support: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[..., V]`` bool of a padded support (``[..., K]`` global ids, ``-1`` for none): whether
    column ``v`` is one of the row's ids."""
    ids = support.long()
    ids = torch.where((ids >= 0) & (ids < vocab), ids, vocab)
    mask = torch.zeros(*ids.shape[:-1], vocab + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(-1, ids, True)[..., :vocab]


def _per_row(value, n: int, dtype: torch.dtype, off, device) -> torch.Tensor:
    """A sampler parameter (None, a number, or a tensor per token) as ``[n]`` of ``dtype``."""
    if value is None:
        return torch.full((n,), off, dtype=dtype, device=device)
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).to(device=device, dtype=dtype)
    return torch.full((n,), value, dtype=dtype, device=device)


def sampler_mask(logits: torch.Tensor, *, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """``[..., V]`` bool: the ids vLLM's v1 sampler keeps from ``logits`` (already softcapped and
    divided by the temperature), written out from its definition on the whole row in float64, in
    its order: min-p (``p >= min_p * max p``), top-k on what min-p left (every logit at least the
    k-th largest; ``top_k`` -1, 0 or at least V: off), top-p on the renormalized rest (sort
    ascending, drop where the cumulative mass is at most ``1 - top_p``, keep the largest; 1: off).
    Ties of the top-p sort are ordered with the higher id first in the ascending order (so a
    boundary inside a group of tied logits keeps its lower ids). Each parameter: None, a number, or
    a tensor per token. ``-inf`` logits are never kept."""
    shape, vocab = logits.shape, logits.shape[-1]
    z = logits.detach().double().reshape(-1, vocab)
    n, dev, neg = z.shape[0], z.device, float("-inf")
    k = _per_row(top_k, n, torch.int64, 0, dev)
    p = _per_row(top_p, n, torch.float64, 1.0, dev)
    mp = _per_row(min_p, n, torch.float64, 0.0, dev)
    probs = torch.softmax(z, -1)
    z = z.masked_fill(probs < mp[:, None] * probs.max(-1, keepdim=True).values, neg)
    on = (k > 0) & (k < vocab)
    kth = z.sort(-1, descending=True).values.gather(1, (k - 1).clamp(0, vocab - 1)[:, None])
    z = z.masked_fill(on[:, None] & (z < kth), neg)
    ids = torch.arange(vocab, device=dev).expand(n, vocab)
    by_id = ids.flip(-1)  # ids descending, then a stable ascending sort by value
    order = by_id.gather(1, z.gather(1, by_id).argsort(dim=-1, stable=True))
    ascending = z.gather(1, order)
    cumulative = torch.softmax(ascending, -1).cumsum(-1)
    drop = (cumulative <= 1 - p[:, None]) & (p[:, None] < 1)
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, neg)
    kept = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
    kept.scatter_(1, order, ascending > neg)
    return kept.reshape(shape)


def padded_support(mask: torch.Tensor) -> torch.Tensor:
    """A ``[..., V]`` bool mask as a padded support ``[..., K]`` (its ids ascending, ``-1``
    pads)."""
    vocab = mask.shape[-1]
    width = max(int(mask.sum(-1).max()) if mask.numel() else 0, 1)
    ids = torch.where(mask, torch.arange(vocab, device=mask.device), vocab)
    ids = ids.sort(-1).values[..., :width]
    return torch.where(ids < vocab, ids, -1)


def reference_support_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    support: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    mode: ReferenceMode = "fp32",
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    softcap: Optional[float] = None,
) -> ReferenceOutputs:
    """logp, entropy and lse per token of the distribution renormalized over the sampler's support
    ``S_t`` (padded ``[..., K]`` global ids, ``-1`` for none), from the definition: with ``z`` the
    logits (:func:`reference_logits`), ``lse = logsumexp_{v in S_t} z_v``, ``logp = z_y - lse``,
    entropy ``-sum_{v in S_t} p_v log p_v`` with ``p = exp(z - lse)`` on ``S_t``, 0 elsewhere.
    Differentiable: the gradients reach the support's logits only. Ignored positions give 0 logp
    and 0 entropy (their lse is that of the whole vocabulary: they need no support)."""
    logits = reference_logits(hidden, weight, bias, mode=mode, temperature=temperature,
                              softcap=softcap)
    keep = _kept(target_ids, ignore_index)
    mask = support_mask(support, logits.shape[-1]) | ~keep.unsqueeze(-1)
    masked = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(masked, dim=-1)
    logprobs = torch.where(mask, masked - lse.unsqueeze(-1), torch.zeros((), dtype=logits.dtype))
    p = torch.where(mask, logprobs.exp(), torch.zeros((), dtype=logits.dtype))
    return _per_token(logprobs, p, lse, target_ids, keep)
