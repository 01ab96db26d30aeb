"""The RL steps of the op benchmark: a GSPO and a DAPO loss through ``tplogp.linear_logp_loss``,
with their inputs and the same losses written out in eager PyTorch (the float64 truth and the eager
baselines).

A problem of ``T`` tokens is ``SEQUENCES`` sequences of ``T / SEQUENCES`` tokens (one sequence when
``T`` does not divide), every token counted, so the fused rows do the work of the plain fused
cross-entropy at the same budget (the ``tplogp-loss-<source>`` rows) plus the loss's own: their
``vs_cross_entropy`` is the ratio of the two. Inputs (:func:`make_inputs`): one advantage per
sequence (standard normal) and old log-probs ``OLD_SPREAD`` away from the fp32 log-probs of the
problem (ratios on both sides of each loss's clip range).

The losses, TRL's recipes (``GRPOConfig``):

* ``gspo``: ``loss_type="grpo"``, ``importance_sampling_level="sequence"``, ``epsilon=3e-4``,
  ``epsilon_high=4e-4``: per sequence ``s = exp(mean_t(logp - old))``, per token ``-min(s A, clip(s,
  1 - 3e-4, 1 + 4e-4) A)``, each sequence's token mean, then the mean over sequences;
* ``dapo``: ``loss_type="dapo"``, ``epsilon=0.2``, ``epsilon_high=0.28``: per token ``r = exp(logp -
  old)``, ``-min(r A, clip(r, 0.8, 1.28) A)``, summed over the tokens over their count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

SEQUENCES = 8
OLD_SPREAD = 0.1
# name -> (tplogp.losses.grpo arguments, clip range, sequence-level ratio)
LOSSES = {
    "gspo": (dict(loss_type="grpo", importance_sampling_level="sequence", epsilon_low=3e-4,
                  epsilon_high=4e-4),
             (1 - 3e-4, 1 + 4e-4), True),
    "dapo": (dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28), (0.8, 1.28), False),
}


@dataclass(frozen=True)
class Inputs:
    """A problem's per-token inputs, ``[B, L]`` fp32 on the problem's device."""

    advantages: torch.Tensor
    old_logp: torch.Tensor

    @property
    def layout(self) -> tuple[int, int]:
        return tuple(self.advantages.shape)


def layout(T: int) -> tuple[int, int]:
    """``(sequences, tokens per sequence)`` of a problem of ``T`` tokens."""
    return (SEQUENCES, T // SEQUENCES) if T % SEQUENCES == 0 else (1, T)


def make_inputs(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, rows: int = 1024) -> Inputs:
    """Seeded inputs of the problem ``(h, w, y)``: the old log-probs from its fp32 log-probs
    (computed ``rows`` tokens at a time)."""
    B, L = layout(y.numel())
    with torch.no_grad():
        logp = torch.cat([(h[i:i + rows].float() @ w.float().T).log_softmax(-1)
                          .gather(1, y[i:i + rows, None])[:, 0] for i in range(0, y.numel(), rows)])
    g = torch.Generator(device=h.device).manual_seed(1)
    advantages = torch.randn(B, 1, device=h.device, generator=g).expand(B, L).contiguous()
    old = logp.view(B, L) + OLD_SPREAD * torch.randn(B, L, device=h.device, generator=g)
    return Inputs(advantages, old)


def eager_loss(name: str, logp: torch.Tensor, advantages: torch.Tensor, old_logp: torch.Tensor,
               mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The loss ``name`` of ``[B, L]`` log-probs in their dtype, differentiable, as TRL's
    ``_compute_loss`` writes it: ``mask`` 1 where a position counts (None: every position)."""
    _, (lo, hi), sequence = LOSSES[name]
    adv, old = advantages.to(logp.dtype), old_logp.to(logp.dtype)
    m = torch.ones_like(logp) if mask is None else mask.to(logp.dtype)
    length = m.sum(-1, keepdim=True).clamp(min=1.0)
    log_ratio = (logp - old) * m
    ratio = torch.exp(log_ratio.sum(-1, keepdim=True) / length if sequence else log_ratio)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv) * m
    if sequence:  # GRPO's normalisation: each sequence's token mean, then the batch mean
        return (per_token.sum(-1) / length[:, 0]).mean()
    return per_token.sum() / m.sum().clamp(min=1.0)


def tplogp_fn(name: str, source: str, options: dict) -> Callable:
    """``fn(h, w, y, inputs)``: the loss ``name`` through ``tplogp.linear_logp_loss`` on ``source``
    with the keywords ``options`` (``workspace_bytes``, a variant's ``softcap`` /
    ``deterministic``, a padded ``[T, K]`` ``support``, viewed as ``[B, L, K]``)."""
    from tplogp import linear_logp_loss, losses

    loss = losses.grpo(**LOSSES[name][0])
    support = options.get("support")

    def fn(h, w, y, inputs: Inputs):
        B, L = inputs.layout
        shaped = {} if support is None else {"support": support.view(B, L, -1)}
        return linear_logp_loss(h.view(B, L, -1), w, y.view(B, L), loss=loss,
                                per_token=(inputs.advantages, inputs.old_logp), source=source,
                                with_entropy=False,
                                **{**options, **shaped})

    return fn


def eager_fn(name: str) -> Callable:
    """``fn(h, w, y, inputs)``: logits in the input dtype, fp32 log-softmax and gather, the loss in
    eager fp32."""

    def fn(h, w, y, inputs: Inputs):
        logp = (h @ w.T).float().log_softmax(-1).gather(1, y[:, None])[:, 0]
        return eager_loss(name, logp.view(inputs.layout), inputs.advantages, inputs.old_logp)

    return fn
