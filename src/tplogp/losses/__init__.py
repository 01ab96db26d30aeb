"""The fused loss's terms: the public per-token loss terms and the GRPO family built of them.

:mod:`.terms` holds the callables ``linear_logp_loss`` sums per token (:class:`TokenLoss`, the
built-ins :func:`cross_entropy`, :func:`z_loss`, :func:`policy_gradient`, :func:`ppo_clip`,
:func:`kl_to_reference`, :func:`entropy_bonus`, :func:`grpo`) and the logits statistics they may
read (:class:`TokenStats`); :mod:`.grpo_family` holds the GRPO family's configuration, normalisation
and metrics (:class:`GRPOLoss`), which :func:`grpo` builds. Both are plain torch (no collectives, no
sources); the chunk loop that evaluates them lives in :mod:`tplogp.fused_loss`. This package
re-exports the terms: ``tplogp.losses.cross_entropy`` and the like.
"""

from .grpo_family import (
    GRPOLoss, GRPOLossConfig, check_number, k3_kl, refuse_under_compile,
)
from .terms import (
    PerTokenLoss, Derivative, loss_by_key, TokenStats, STATS, TokenLoss, cross_entropy, z_loss,
    policy_gradient, ppo_clip, kl_to_reference, entropy_bonus, grpo,
)

__all__ = [
    "PerTokenLoss",
    "Derivative",
    "loss_by_key",
    "TokenStats",
    "STATS",
    "TokenLoss",
    "cross_entropy",
    "z_loss",
    "policy_gradient",
    "ppo_clip",
    "kl_to_reference",
    "entropy_bonus",
    "grpo",
    "GRPOLoss",
    "GRPOLossConfig",
    "check_number",
    "k3_kl",
    "refuse_under_compile",
]
