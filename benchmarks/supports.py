"""The sampler's supports the op benchmark's ``support=`` variants pass (:mod:`benchmarks.variants`):
random padded supports of ``K`` ids per token, each holding the token's target.

Two kinds, the two ends of what a sampler keeps:

* ``shared``: the tokens of one sequence (:func:`benchmarks.policy.layout`) share a pool of
  :data:`POOL_FACTOR` ``K`` ids drawn at random from the vocabulary, as the top-p sets of nearby
  tokens overlap; each token keeps ``K`` ids of its sequence's pool (drawn without replacement), the
  last of them replaced by its target when the target is not among them. The union of the supports
  is about ``sequences * POOL_FACTOR * K`` ids plus the targets;
* ``disjoint``: the worst case, tokens share no ids as far as the vocabulary allows: token ``t``
  keeps the ``K`` ids at positions ``t K .. t K + K - 1`` (mod ``V``) of one random permutation of
  the vocabulary, the last replaced by its target when the target is not among them; the union is
  about ``min(T K, V)`` ids (the targets, drawn independently, may repeat).

Each row's ids are in random order. ``K`` above ``V`` keeps the whole vocabulary (``K = V``). Built
once per shape, seeded, before any timing.
"""

from __future__ import annotations

import torch

from .policy import layout

KINDS = ("shared", "disjoint")
POOL_FACTOR = 4  # a shared pool holds this many times K ids per sequence


def _with_targets(ids: torch.Tensor, targets: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``ids`` [T, K] (distinct per row) with each row's last id replaced by its target where the
    target is not in the row, then each row shuffled."""
    missing = ~(ids == targets[:, None]).any(1)
    ids[:, -1] = torch.where(missing, targets, ids[:, -1])
    order = torch.rand(ids.shape, device=ids.device, generator=g).argsort(1)
    return ids.gather(1, order)


def make_support(targets: torch.Tensor, vocab: int, k: int, kind: str,
                 seed: int = 2) -> torch.Tensor:
    """The padded support ``[T, min(k, vocab)]`` (int64, on the targets' device) of ``kind``
    (module docstring) for the targets ``[T]``."""
    if kind not in KINDS:
        raise ValueError(f"support kind must be one of {', '.join(KINDS)}, got {kind!r}")
    T, k = targets.numel(), min(k, vocab)
    device = targets.device
    g = torch.Generator(device=device).manual_seed(seed)
    targets = targets.reshape(-1).long()
    if kind == "disjoint":
        perm = torch.randperm(vocab, device=device, generator=g)
        positions = (torch.arange(T, device=device)[:, None] * k
                     + torch.arange(k, device=device)) % vocab
        return _with_targets(perm[positions], targets, g)
    sequences, per_sequence = layout(T)
    pool_size = min(POOL_FACTOR * k, vocab)
    pools = torch.rand(sequences, vocab, device=device, generator=g).argsort(1)[:, :pool_size]
    picks = torch.rand(T, pool_size, device=device, generator=g).argsort(1)[:, :k]
    rows = pools.repeat_interleave(per_sequence, 0)  # [T, pool_size]: each token's pool
    return _with_targets(rows.gather(1, picks), targets, g)


def union_size(support: torch.Tensor) -> int:
    """How many distinct ids the supports of all tokens hold together (``-1`` pads none)."""
    ids = support.reshape(-1)
    return int(ids[ids >= 0].unique().numel())
