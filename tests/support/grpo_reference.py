"""The GRPO family written out in eager float64 PyTorch, as TRL's ``GRPOTrainer._compute_loss`` states each loss
type on ``[B, L]`` tensors with a completion mask, differentiated by autograd: the definition the fused
``losses.grpo(...)`` is tested against. Packed sequences are padded to ``[B, L]`` first (:func:`padded`).

Where tplogp's definition is its own, so is this one: ``luspo``'s KL term is averaged like its policy term (a sum
over the counted tokens over ``B``); metrics are means over the counted tokens (a sequence-level clip counts once
per token of the sequence, as Liger's metric)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from tplogp.rl_losses import GRPOLossConfig


def logp_of(hidden, weight, bias, target, temperature: float, ignore_index: int, dtype=torch.float64):
    """logp and entropy of ``target [B, L]`` in ``dtype`` (0 at ignored positions), differentiable."""
    z = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
    z = z / temperature
    logq = torch.log_softmax(z, -1)
    safe = torch.where(target == ignore_index, 0, target)
    logp = logq.gather(-1, safe[..., None])[..., 0]
    entropy = -(logq.exp() * logq).sum(-1)
    keep = target != ignore_index
    return torch.where(keep, logp, 0.0), torch.where(keep, entropy, 0.0)


def padded(values: torch.Tensor, offsets: list[int], fill=0.0) -> torch.Tensor:
    """Packed ``[N]`` values as ``[B, Lmax]`` rows (``fill`` past each sequence's end), differentiably."""
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    longest = max(lengths)
    rows = [torch.cat([values[a:b], values.new_full((longest - (b - a),), fill)])
            for a, b in zip(offsets[:-1], offsets[1:])]
    return torch.stack(rows)


def grpo_reference(c: GRPOLossConfig, logp, entropy, mask, adv, old=None, ref=None, sampler=None,
                   rollout_weights=None) -> tuple[torch.Tensor, dict]:
    """``(loss, metrics)`` of config ``c`` on ``[B, L]`` tensors of one dtype; ``mask`` 1 where a position
    counts."""
    m = mask.to(logp.dtype)
    length = m.sum(-1, keepdim=True)
    batch = logp.shape[0]
    log_ratio = torch.zeros_like(logp) + (logp - logp.detach()) if old is None else logp - old
    log_ratio = torch.where(m > 0, log_ratio, 0.0)
    seq_log = (log_ratio * m).sum(-1, keepdim=True) / length.clamp(min=1.0)
    if c.importance_sampling_level == "token":
        log_w = log_ratio
    elif c.importance_sampling_level == "sequence":
        log_w = seq_log
    else:  # GSPO-token: sg[s_i] pi / sg[pi]
        log_w = logp - logp.detach() + seq_log.detach()
    coef_1 = torch.exp(log_w)

    is_ratio = None
    if c.rollout_correction == "weights":
        is_ratio = rollout_weights
    elif c.rollout_correction is not None:
        diff = (old - sampler) * m
        if c.rollout_correction.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True)
        ratio = torch.exp(diff)
        lo = -math.inf if c.rollout_clip_min is None else c.rollout_clip_min
        hi = math.inf if c.rollout_clip_max is None else c.rollout_clip_max
        if c.rollout_correction.endswith("truncate"):
            is_ratio = ratio.clamp(lo, hi)
        else:
            is_ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
        is_ratio = is_ratio.expand_as(logp)

    lt = c.loss_type
    low = high = torch.zeros_like(m, dtype=torch.bool)
    if lt == "cispo":
        per_token = -torch.clamp(coef_1, max=c.epsilon_high).detach() * adv * logp
        high = (coef_1 > c.epsilon_high) & (adv > 0)
    elif lt == "sapo":
        tau = torch.where(adv > 0, c.sapo_temperature_pos, c.sapo_temperature_neg)
        per_token = -(torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau) * adv
    elif lt == "vespo":
        with torch.no_grad():
            seq = (log_ratio.clamp(-20.0, 20.0) * m).sum(-1, keepdim=True)
            if is_ratio is not None:
                seq = seq + (torch.log(is_ratio).clamp(math.log(1e-8), 20.0) * m).sum(-1, keepdim=True)
            log_ws = seq.clamp(math.log(1e-8), 20.0)
            k = torch.where(adv >= 0, c.vespo_k_pos, c.vespo_k_neg)
            lam = torch.where(adv >= 0, c.vespo_lambda_pos, c.vespo_lambda_neg).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_ws - lam * torch.exp(log_ws)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token = -phi * adv * logp
    else:
        coef_2 = torch.clamp(coef_1, 1 - c.epsilon_low, 1 + c.epsilon_high)
        low = (coef_1 < 1 - c.epsilon_low) & (adv < 0)
        high = (coef_1 > 1 + c.epsilon_high) & (adv > 0)
        unclipped = coef_1 if c.delta is None else torch.clamp(coef_1, max=c.delta)
        per_token = -torch.min(unclipped * adv, coef_2 * adv)
        if c.clip_ratio_c is not None:
            per_token = torch.where(adv < 0, torch.min(per_token, -c.clip_ratio_c * adv), per_token)
    per_token = per_token.expand_as(logp)
    low, high = low.expand_as(logp), high.expand_as(logp)
    if is_ratio is not None and lt != "vespo":
        per_token = per_token * is_ratio

    kl = None
    if c.beta:
        d = ref - logp
        kl = {"k3": torch.exp(d) - d - 1, "k2": 0.5 * d * d, "k1": -d}[c.kl_estimator]
        if c.bias_corrected_kl:
            kl = kl * coef_1
        per_token = per_token + c.beta * kl

    norm = c.norm
    count = m.sum().clamp(min=1.0)
    normaliser = count if c.num_items_in_batch is None else torch.as_tensor(
        c.num_items_in_batch, dtype=logp.dtype).clamp(min=1.0)
    if norm == "seq-mean-token-mean":
        loss = ((per_token * m).sum(-1) / length[:, 0].clamp(min=1.0)).mean()
    elif norm == "token-mean":
        loss = (per_token * m).sum() / normaliser
    elif norm == "seq-mean-token-sum":
        loss = (per_token * m).sum() / batch
    else:
        loss = (per_token * m).sum() / (batch * c.max_completion_length)
    if c.entropy_coef:
        denom = normaliser if norm == "token-mean" else count
        loss = loss - c.entropy_coef * (entropy * m).sum() / denom

    on = m > 0
    ratio = coef_1.expand_as(logp).detach()

    def mean(x):
        return (torch.where(on, x.to(logp.dtype), 0.0)).sum() / count

    metrics = {"clip_low_fraction": mean(low), "clip_high_fraction": mean(high),
               "clip_region_fraction": mean(low | high), "ratio_mean": mean(ratio),
               "ratio_min": ratio[on].min(), "ratio_max": ratio[on].max(), "entropy_mean": mean(entropy.detach())}
    if kl is not None:
        metrics["kl_mean"] = mean(kl.detach())
    return loss, metrics


def per_token_inputs(target: torch.Tensor, logp_true: torch.Tensor, seed: int, spread: float = 0.3,
                     sampler: bool = False, weights: bool = False) -> dict[str, Optional[torch.Tensor]]:
    """Per-token fp32 inputs ``[B, L]`` near the true log-probs: one advantage per sequence (mixed signs, one 0),
    old and reference log-probs ``spread`` away (ratios on both sides of the clip range), the sampler's log-probs,
    rollout weights in (0, 1]."""
    g = torch.Generator().manual_seed(seed)
    shape = target.shape
    adv = torch.randn(shape[0], 1, generator=g).expand(shape).clone()
    adv[0] = -adv[0].abs() - 0.1
    if shape[0] > 1:
        adv[1] = adv[1].abs() + 0.1
    if shape[0] > 3:
        adv[3] = 0.0
    base = logp_true.float()
    out = {"advantages": adv, "old_logp": base + spread * torch.randn(shape, generator=g),
           "ref_logp": base + spread * torch.randn(shape, generator=g)}
    if sampler:
        out["sampler_logp"] = out["old_logp"] + 0.4 * torch.randn(shape, generator=g)
    if weights:
        out["rollout_weights"] = torch.rand(shape, generator=g) * 0.999 + 0.001
    return out


def definition(loss, hidden, weight, bias, target, per_token, *, temperature: float = 1.0, ignore_index: int,
               offsets: Optional[list[int]] = None, dtype=torch.float64):
    """``(loss, metrics, (d_hidden, d_weight, d_bias))`` of ``loss``'s definition in ``dtype`` (float64: the
    truth; float32: the same-dtype eager reference). ``offsets``: packed sequences of the flattened tokens, padded
    to rows for the definition. ``bias`` None: no bias (its gradient None)."""
    h, w = (t.to(dtype).clone().requires_grad_() for t in (hidden, weight))
    b = None if bias is None else bias.to(dtype).clone().requires_grad_()
    logp, entropy = logp_of(h, w, b, target, temperature, ignore_index, dtype)
    mask = (target != ignore_index).to(dtype)
    named = dict(zip(loss.per_token, (t.to(dtype) for t in per_token)))
    if offsets is not None:
        logp, entropy, mask = (padded(x.reshape(-1), offsets) for x in (logp, entropy, mask))
        named = {k: padded(t.reshape(-1), offsets) for k, t in named.items()}
    adv = named.pop("advantages")
    value, metrics = grpo_reference(loss.config, logp, entropy, mask, adv, old=named.get("old_logp"),
                                    ref=named.get("ref_logp"), sampler=named.get("sampler_logp"),
                                    rollout_weights=named.get("rollout_weights"))
    value.backward()
    return value.detach(), metrics, (h.grad, w.grad, None if b is None else b.grad)


def check_three_way(ours, reference, truth, what: str) -> None:
    """The fused loss's gradients no worse against the float64 ``truth`` than the fp32 eager ``reference`` (the
    table's fp32 slack); its value and metrics within the table's bounds of the truth's (a scalar sum of terms of
    both signs: the reference's error there is as much luck as precision)."""
    from tests.support import tolerances as tol
    from tplogp.tolerances import assert_no_worse

    value, t_value = ours[0].item(), truth[0].item()
    assert abs(value - t_value) <= tol.GRPO_LOSS.atol + tol.GRPO_LOSS.rtol * abs(t_value), \
        f"{what}: loss {value} vs {t_value}"
    for name, a, r, t in zip(("d_hidden", "d_weight", "d_bias"), ours[2], reference[2], truth[2]):
        if t is None:
            assert a is None, f"{what} {name}"
            continue
        assert_no_worse(f"{what} {name}", a, r, t, torch.float32)
    metrics, t_metrics = ours[1], truth[1]
    assert set(metrics) == set(t_metrics), what
    for key, t in t_metrics.items():
        assert metrics[key].dtype == torch.float32 and metrics[key].dim() == 0, key
        assert abs(metrics[key].item() - t.item()) <= tol.ABS_FP32_GRPO_METRIC * max(1.0, abs(t.item())), \
            f"{what} metric {key}: {metrics[key].item()} vs {t.item()}"
