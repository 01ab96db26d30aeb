"""Per-token RL loss terms for :func:`tplogp.linear_logp_loss`: callables ``(logp, entropy, *per_token) -> [n]``.

Each sees one chunk of tokens (fp32 ``logp`` and ``entropy`` of the chunk, and the chunk's rows of the per-token
tensors, in the order given to ``per_token=``) and returns the per-token loss; ``linear_logp_loss`` reduces it.
Only :func:`entropy_bonus` reads ``entropy``: a loss built of the others runs with ``with_entropy=False`` (no entropy
statistics computed; ``entropy`` is then None).
"""

from __future__ import annotations

from typing import Callable

import torch

PerTokenLoss = Callable[..., torch.Tensor]


def policy_gradient() -> PerTokenLoss:
    """``-A * logp``; per_token = ``(advantages,)``. Reads no entropy."""
    return lambda logp, entropy, adv: -adv * logp


def ppo_clip(eps_low: float = 0.2, eps_high: float = 0.2) -> PerTokenLoss:
    """``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` with ``r = exp(logp - old_logp)`` (PPO / GRPO);
    per_token = ``(advantages, old_logp)``. Reads no entropy."""

    def term(logp, entropy, adv, old_logp):
        ratio = torch.exp(logp - old_logp)
        return -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)

    return term


def kl_to_reference(coef: float) -> PerTokenLoss:
    """``coef * (exp(ref - logp) - (ref - logp) - 1)`` (the k3 estimator); per_token = ``(ref_logp,)``. Reads no
    entropy."""

    def term(logp, entropy, ref_logp):
        d = ref_logp - logp
        return coef * (torch.exp(d) - d - 1)

    return term


def entropy_bonus(coef: float) -> PerTokenLoss:
    """``-coef * entropy``; no per-token tensors. Needs the entropy: ``with_entropy=True`` (the default)."""
    return lambda logp, entropy: -coef * entropy
