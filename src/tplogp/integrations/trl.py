"""TRL's ``GRPOTrainer`` with its per-token log-probs and entropies computed by tplogp.

Enabled by the trainer subclass or by patching a built trainer::

    from tplogp.integrations.trl import TplogpGRPOTrainer
    trainer = TplogpGRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data)
    trainer.train()              # or: trainer = tplogp.integrations.trl.patch(GRPOTrainer(...))

What changes: every call of the trainer's ``_get_per_token_logps_and_entropies`` -- the policy's
log-probs and entropies in the loss, the old and reference log-probs after generation -- runs the
model's own forward with its LM head computing :func:`tplogp.linear_logp`
(:func:`tplogp.integrations.hf.causal_lm_logprobs`), in place of TRL's fused head
(``model(..., labels=labels, fused_lm_head=True)``). The values are TRL's: the completion tokens'
log-probs at ``temperature``, 0 (entropy 0) where the attention mask is 0, the model's MoE router
loss (``aux_loss``) alongside when TRL asks for it. TRL's own ``_compute_loss`` then computes the
loss, its normalisation and its metrics from these ``[B, completion]`` tensors, so every option of
the loss (:data:`OPTIONS`) keeps TRL's meaning, metric names and values.

Not routed (TRL's own head runs, and a logging line names the option once per trainer): multimodal
inputs (``pixel_values`` and the other image fields, which TRL slices per chunk of rows in its own
ways) and ``cast_lm_head_to_fp32`` (an fp32 head on low-precision hidden states). The TRL version is
checked: only 1.16.x, the series this module is tested with, is accepted
(:class:`UnsupportedTRLVersionError` otherwise).

With ``fused_loss=True`` (``TplogpGRPOTrainer(..., fused_loss=True)``, ``patch(trainer,
fused_loss=True)``) the trainer's ``_compute_loss`` is one :func:`causal_lm_loss` call of
:func:`grpo_loss` (:func:`fused_compute_loss`), logging TRL's metrics with TRL's values; an option
or a logged metric without an exact fused equivalent falls back to the path above, with a logging
line naming it once per trainer.

For a loop of one's own around :func:`tplogp.integrations.hf.causal_lm_loss`, :func:`grpo_loss`
gives the fused ``losses.grpo`` equivalent of a trainer's loss (docs/integrations.md holds the table
:func:`option_table` renders from :data:`OPTIONS`).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import types
from typing import Optional

import torch

from .. import losses
from ..losses.grpo_family import CLIPPED, BoundGRPO, GRPOLoss
from . import require
from .hf import causal_lm_logprobs, causal_lm_loss

trl = require("trl", "tplogp.integrations.trl", "trl")
_trl_utils = importlib.import_module("trl.trainer.utils")  # (trl is there: require said so)
nanmax, nanmin = _trl_utils.nanmax, _trl_utils.nanmin

TESTED_TRL = "1.16"  # the release series tests/integrations/test_trl.py runs
_LOG = logging.getLogger(__name__)
# inputs of _get_per_token_logps_and_entropies that TRL slices per chunk of rows in its own ways
_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
               "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids",
               "image_position_ids")
_TOKEN_SUM_LOSSES = ("dapo", "cispo", "vespo")  # normalised by TRL's num_items_in_batch


class UnsupportedTRLVersionError(RuntimeError):
    """The installed TRL is not the release series this integration is tested with."""


def check_trl_version(version: Optional[str] = None) -> None:
    """Raise :class:`UnsupportedTRLVersionError` unless ``version`` (default: the installed TRL's)
    is of the 1.16 series."""
    version = trl.__version__ if version is None else version
    if version.split("+")[0].split(".")[:2] != TESTED_TRL.split("."):
        raise UnsupportedTRLVersionError(
            f"tplogp.integrations.trl is tested with TRL {TESTED_TRL}.x, and TRL {version} is "
            f"installed: its GRPOTrainer's private methods may differ. Install "
            f"trl=={TESTED_TRL}.* (the 'trl' extra)")


def _fallback(trainer, option: str, why: str) -> None:
    """Log, once per trainer and option, that TRL's own head computes the log-probs."""
    seen = trainer.__dict__.setdefault("_tplogp_fallbacks", set())
    if option not in seen:
        seen.add(option)
        _LOG.warning("tplogp.integrations.trl: %s: TRL's own fused LM head computes these "
                     "log-probs (%s)", option, why)


def per_token_logps_and_entropies(trainer, model, input_ids, attention_mask, logits_to_keep,
                                  batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                  **inputs):
    """``GRPOTrainer._get_per_token_logps_and_entropies`` through tplogp: ``(logps, entropies or
    None, aux_loss or None)``, ``[B, logits_to_keep]`` float32 each (0 where ``attention_mask`` is
    0), the rows in chunks of ``batch_size`` as TRL takes them, the router loss their mean."""
    multimodal = next((name for name in _MULTIMODAL if inputs.get(name) is not None), None)
    if multimodal is not None or trainer.args.cast_lm_head_to_fp32:
        if multimodal is not None:
            _fallback(trainer, multimodal, "multimodal inputs")
        else:
            _fallback(trainer, "cast_lm_head_to_fp32",
                      "an fp32 head on low-precision hidden states")
        return trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
            compute_aux_loss, **inputs)
    batch_size = batch_size or input_ids.size(0)
    extra = {"output_router_logits": True} if compute_aux_loss else {}
    logps, entropies, aux_losses = [], [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids = input_ids[start:start + batch_size]
        mask = attention_mask[start:start + batch_size]
        with trainer.accelerator.autocast():
            result, output = causal_lm_logprobs(
                model, ids, mask, logits_to_keep=logits_to_keep, temperature=trainer.temperature,
                return_entropy=compute_entropy, return_model_output=True, **extra)
        counted = mask[:, -logits_to_keep:].bool()  # TRL's labels are -100 where the mask is 0
        logp = result.logp if compute_entropy else result
        logps.append(torch.where(counted, logp, 0.0))
        if compute_entropy:
            entropies.append(torch.where(counted, result.entropy, 0.0))
        if compute_aux_loss:
            aux_losses.append(output.aux_loss)
    return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None,
            torch.stack(aux_losses).mean() if compute_aux_loss else None)


def _unfused(trainer, inputs: dict) -> Optional[str]:
    """The first option or metric of this loss call that the fused loss cannot match exactly
    (None: none)."""
    multimodal = next((name for name in _MULTIMODAL if inputs.get(name) is not None), None)
    rollout = "importance_sampling_ratio" in inputs and (trainer.loss_type == "vespo" or (
        trainer.use_vllm and trainer.vllm_importance_sampling_correction))
    refused = _unfusable(trainer, inputs, rollout)
    sequence = trainer.importance_sampling_level == "sequence"
    checks = (
        (multimodal, multimodal is not None),
        ("cast_lm_head_to_fp32", trainer.args.cast_lm_head_to_fp32),
        ("tool_mask", "tool_mask" in inputs),
        (refused[0] if refused else "", bool(refused)),
        (f"importance_sampling_level sequence with loss_type {trainer.loss_type}: the clip_ratio "
         f"metrics (per-sequence values)", sequence and trainer.loss_type in CLIPPED),
        ("loss_type vespo: the metric vespo/phi_seq_mean (per-sequence values)",
         trainer.loss_type == "vespo"),
        (f"importance_sampling_level sequence with loss_type {trainer.loss_type} (losses.grpo "
         f"takes it at the token level)", sequence and trainer.loss_type in ("cispo", "sapo")))
    return next((name for name, on in checks if on), None)


class _ClipFlags(GRPOLoss):
    """A clipped ``losses.grpo`` loss that also records, for each counted token, TRL's clip flags:
    ``low`` (``min(ratio, delta) < 1 - epsilon_low`` and advantage < 0) and ``high``
    (``min(ratio, delta) > 1 + epsilon_high`` and advantage > 0), ``[B, K]`` bool, from the token's
    own ratio as each chunk evaluates it; a ``position`` per-token tensor (the flat index
    ``b K + t``) carries each row back to its token through the op's row compaction."""

    def __init__(self, base: GRPOLoss, shape: torch.Size, delta: Optional[float],
                 device: torch.device) -> None:
        super().__init__(base.config)
        self.per_token = base.per_token + ("position",)
        self.delta = delta
        self.low = torch.zeros(shape, dtype=torch.bool, device=device)
        self.high = torch.zeros(shape, dtype=torch.bool, device=device)

    def bind(self, per_token, counted, segments) -> BoundGRPO:
        self.check_arity(len(per_token))
        return _FlaggingBound(self, dict(zip(self.per_token, per_token)), counted, segments)


class _FlaggingBound(BoundGRPO):
    """:class:`BoundGRPO` writing :class:`_ClipFlags`' flags of the rows it evaluates."""

    def __init__(self, flags: _ClipFlags, tensors: dict, counted, segments) -> None:
        super().__init__(flags.config, tensors, counted, segments)
        self.flags, self.position = flags, tensors["position"]

    def evaluate(self, logp, entropy, rows=None, metrics=False, sequences=None):
        result = super().evaluate(logp, entropy, rows, metrics, sequences)
        if self.old is not None:
            def part(t):
                return t if rows is None else t[rows]

            with torch.no_grad():
                on = part(self.m) > 0
                ratio = torch.exp(torch.where(on, logp.detach() - part(self.old), 0.0))
                if self.flags.delta is not None:
                    ratio = ratio.clamp(max=self.flags.delta)
                adv, c = part(self.adv), self.c
                index = part(self.position).long().to(self.flags.low.device)
                low = on & (ratio < 1 - c.epsilon_low) & (adv < 0)
                high = on & (ratio > 1 + c.epsilon_high) & (adv > 0)
                self.flags.low.view(-1)[index] = low.to(self.flags.low.device)
                self.flags.high.view(-1)[index] = high.to(self.flags.low.device)
        return result


def _log_clip_metrics(trainer, logged: dict, flags: _ClipFlags, mask: torch.Tensor) -> None:
    """TRL's ``clip_ratio/*`` metrics from the clip flags, as TRL's ``_compute_loss`` logs them."""
    mask = mask.float()
    count = mask.sum()

    def token_mean(flag):
        local = torch.stack([(flag.to(mask) * mask).sum(), count])
        totals = trainer.accelerator.reduce(local, reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def sequence_means(flag):
        return trainer.accelerator.gather((flag.to(mask) * mask).sum(-1) / mask.sum(-1))

    low, high = flags.low, flags.high
    logged["clip_ratio/low_mean"].append(token_mean(low))
    logged["clip_ratio/high_mean"].append(token_mean(high))
    logged["clip_ratio/region_mean"].append(token_mean(low | high))
    logged["clip_ratio/low_min"].append(nanmin(sequence_means(low)).item())
    logged["clip_ratio/high_max"].append(nanmax(sequence_means(high)).item())


def _global_token_mean(trainer, mean: torch.Tensor, count: torch.Tensor) -> float:
    """TRL's ``global_masked_mean`` from a process's token mean over ``count`` tokens."""
    local = torch.stack([mean.detach().float() * count, count]).to(count.device)
    totals = trainer.accelerator.reduce(local, reduction="sum")
    return (totals[0] / totals[1].clamp(min=1.0)).item()


def fused_compute_loss(trainer, model, inputs: dict, unfused):
    """``GRPOTrainer._compute_loss`` as one :func:`causal_lm_loss` call of :func:`grpo_loss` (the
    model's forward, the head's loss and its gradients chunk by chunk), logging TRL's metrics
    (names and values: token means summed and counted across processes). Where an option or a
    logged metric has no exact fused equivalent (:func:`_unfused`), ``unfused(model, inputs)``
    (tplogp's log-probs under TRL's loss code) computes it, and a ``WARNING`` names the option
    once per trainer."""
    reason = _unfused(trainer, inputs)
    if reason is not None:
        seen = trainer.__dict__.setdefault("_tplogp_unfused", set())
        if reason not in seen:
            seen.add(reason)
            _LOG.warning("tplogp.integrations.trl: fused_loss: %s has no exact fused "
                         "equivalent: TRL's loss code on tplogp's log-probs computes this loss",
                         reason)
        return unfused(model, inputs)
    fused = grpo_loss(trainer, inputs)
    mask = inputs["completion_mask"]
    keep = inputs["completion_ids"].size(1)
    loss_fn, per_token, flags = fused.loss, fused.per_token, None
    if trainer.loss_type in CLIPPED:
        shape = inputs["completion_ids"].shape
        flags = loss_fn = _ClipFlags(fused.loss, shape, trainer.args.delta, mask.device)
        position = torch.arange(shape.numel(), dtype=torch.float32, device=mask.device)
        per_token = per_token + (position.view(shape),)
    extra = ({"output_router_logits": True, "return_model_output": True}
             if trainer.aux_loss_enabled else {})
    with trainer.accelerator.autocast():
        result = causal_lm_loss(
            model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], mask], 1), loss=loss_fn, per_token=per_token,
            loss_mask=mask, logits_to_keep=keep,
            temperature=trainer.temperature, return_metrics=True, **extra)
    value, metrics = result[0], result[1]
    mode = "train" if trainer.model.training else "eval"
    logged = trainer._metrics[mode]
    loss = value / fused.divisor
    if trainer._entropy_bonus_enabled:  # the policy loss: the entropy bonus taken back out
        policy_loss = (value + trainer.entropy_coef * metrics["entropy_mean"]).detach()
        logged["policy_loss"].append(trainer.accelerator.gather(policy_loss).nanmean().item())
        if mode == "train" and trainer.accelerator.sync_gradients:
            logged["entropy_coef"].append(trainer.entropy_coef)
    if trainer.aux_loss_enabled:
        aux_loss = result[2].aux_loss
        normalizer = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
        loss = loss + trainer.router_aux_loss_coef * aux_loss / normalizer
        logged["aux_loss"].append(trainer.accelerator.gather_for_metrics(aux_loss).mean().item())
    count = mask.sum().float()
    if trainer.beta != 0.0:
        logged["kl"].append(_global_token_mean(trainer, metrics["kl_mean"], count))
    logged["entropy"].append(_global_token_mean(trainer, metrics["entropy_mean"], count))
    if flags is not None:
        _log_clip_metrics(trainer, logged, flags, mask)
    if trainer.loss_type == "cispo":
        logged["cispo_clip_ratio"].append(
            _global_token_mean(trainer, metrics["clip_high_fraction"], count))
    return loss


class TplogpGRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose log-probs and entropies come from tplogp
    (:mod:`tplogp.integrations.trl`); the same arguments, and ``fused_loss=True`` for the loss as
    one fused call (:func:`fused_compute_loss`)."""

    def __init__(self, *args, fused_loss: bool = False, **kwargs):
        check_trl_version()
        self._tplogp_fused_loss = fused_loss
        super().__init__(*args, **kwargs)

    def _compute_loss(self, model, inputs):
        if not self._tplogp_fused_loss:
            return super()._compute_loss(model, inputs)
        return fused_compute_loss(self, model, inputs, super()._compute_loss)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False,
                                           compute_aux_loss=False, **inputs):
        return per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                             logits_to_keep, batch_size, compute_entropy,
                                             compute_aux_loss, **inputs)


def patch(trainer, fused_loss: bool = False):
    """Make a built ``trl.GRPOTrainer`` (or a subclass of it) compute its log-probs and entropies
    through tplogp, as :class:`TplogpGRPOTrainer` does, and with ``fused_loss`` its loss as one
    fused call (:func:`fused_compute_loss`); returns the trainer."""
    check_trl_version()
    if not isinstance(trainer, trl.GRPOTrainer):
        raise TypeError(f"patch expects a trl.GRPOTrainer, got {type(trainer).__name__}")
    if isinstance(trainer, TplogpGRPOTrainer):
        trainer._tplogp_fused_loss = fused_loss
        return trainer

    def method(self, *args, **kwargs):
        return per_token_logps_and_entropies(self, *args, **kwargs)

    trainer._get_per_token_logps_and_entropies = types.MethodType(method, trainer)
    if fused_loss:
        unfused = types.MethodType(type(trainer)._compute_loss, trainer)

        def compute(self, model, inputs):
            return fused_compute_loss(self, model, inputs, unfused)

        trainer._compute_loss = types.MethodType(compute, trainer)
    else:
        trainer.__dict__.pop("_compute_loss", None)
    return trainer


@dataclasses.dataclass(frozen=True)
class Option:
    """One ``trl.GRPOConfig`` option of the loss: how :class:`TplogpGRPOTrainer` computes it
    (``trainer``), its ``losses.grpo(...)`` equivalent in :func:`grpo_loss` (``fused``; empty:
    none) and what the trainer's ``fused_loss=True`` does with it (``fused_trainer``)."""

    trl: str
    fused: str
    trainer: str = "TRL's loss code on tplogp's log-probs"
    fused_trainer: str = "fused"


_ACCUMULATION = ("`num_items_in_batch.clamp(min=1) / num_processes * "
                 "current_gradient_accumulation_steps / steps_per_generation` (training; in "
                 "evaluation without the last two factors)")
OPTIONS = (
    Option("`loss_type` (`grpo`, `bnpo`, `dr_grpo`, `dapo`, `cispo`, `sapo`, `luspo`, `vespo`)",
           "`losses.grpo(loss_type)`; the returned loss divided by "
           "`current_gradient_accumulation_steps` (training) for all but `dapo`, `cispo`, `vespo`",
           fused_trainer="fused; `vespo` falls back (`vespo/phi_seq_mean` is per sequence)"),
    Option("`num_items_in_batch` (`dapo`, `cispo`, `vespo`)",
           f"`num_items_in_batch=` {_ACCUMULATION}"),
    Option("`max_completion_length` (`dr_grpo`)", "`max_completion_length=`"),
    Option("`importance_sampling_level` (`token`, `sequence`)", "`importance_sampling_level=`",
           fused_trainer="`token` fused; `sequence` falls back (the clip metrics are per "
           "sequence; `cispo`, `sapo`: token level only)"),
    Option("`epsilon`, `epsilon_high`", "`epsilon_low=`, `epsilon_high=` (cispo: the ratio's cap)"),
    Option("`delta`", "`delta=`"),
    Option("`beta` (k3 KL)",
           "`beta=`, `kl_estimator=\"k3\"`; `per_token` gets `ref_per_token_logps`"),
    Option("`use_bias_correction_kl`",
           "`bias_corrected_kl=use_bias_correction_kl and beta != 0` (no KL term with `beta=0`: "
           "nothing to correct)"),
    Option("`vllm_importance_sampling_correction` (the ratio TRL computes from the sampler's "
           "log-probs)",
           "`rollout_correction=\"weights\"`; `per_token` gets `importance_sampling_ratio` (vespo: "
           "token modes only)"),
    Option("`sapo_temperature_pos` / `_neg`, `vespo_k_pos` / `_lambda_pos` / `_k_neg` / "
           "`_lambda_neg`", "the same names"),
    Option("`entropy_coef`",
           "`entropy_coef=` for all but `dapo`, `cispo`, `vespo` (there TRL averages the entropy "
           "over the counted tokens, not over `num_items_in_batch`)",
           fused_trainer="fused for all but `dapo`, `cispo`, `vespo` (those fall back)"),
    Option("`temperature`", "`temperature=` of the call", "`temperature=` of `linear_logp`"),
    Option("old log-probs absent (`num_iterations=1`)", "`with_old_logp=False`"),
    Option("`top_entropy_quantile < 1` (high-entropy token mask)", "", fused_trainer="falls back"),
    Option("`off_policy_mask_threshold` (off-policy sequence mask)", "",
           fused_trainer="falls back"),
    Option("`use_adaptive_entropy`", "", fused_trainer="falls back"),
    Option("`router_aux_loss_coef` (an MoE model's router loss)",
           "`causal_lm_loss(..., output_router_logits=True, return_model_output=True)`: the "
           "output's `aux_loss`", "TRL's code on the model output's `aux_loss`",
           "fused; TRL's code on the output's `aux_loss`"),
    Option("metrics `kl`, `entropy`, `clip_ratio/*`, `cispo_clip_ratio`, `vespo/phi_seq_mean`, "
           "`policy_loss`, `entropy_coef`, `aux_loss`",
           "`return_metrics=True`: `kl_mean`, `entropy_mean`, `clip_*_fraction` per counted token "
           "(not per sequence under `importance_sampling_level=\"sequence\"`; no `low_min` / "
           "`high_max`)", "TRL's metrics, names and values",
           "TRL's names and values: the fused loss's token means, the clip fractions per sequence "
           "from each token's clip flags"),
)


def option_table() -> str:
    """The markdown table of :data:`OPTIONS` (docs/integrations.md holds it; the tests compare)."""
    rows = ["| TRL `GRPOConfig` | `TplogpGRPOTrainer` / `patch` | with `fused_loss=True` | "
            "`losses.grpo(...)` for `causal_lm_loss` |", "|---|---|---|---|"]
    rows += [f"| {o.trl} | {o.trainer} | {o.fused_trainer} | "
             f"{o.fused or 'none: the trainer only'} |" for o in OPTIONS]
    return "\n".join(rows) + "\n"


@dataclasses.dataclass(frozen=True)
class FusedGRPO:
    """A trainer's loss as :func:`tplogp.integrations.hf.causal_lm_loss` computes it: ``loss`` (a
    ``losses.grpo``) fed ``per_token``, the result divided by ``divisor``."""

    loss: GRPOLoss
    per_token: tuple
    divisor: float


def _unfusable(trainer, inputs: dict, rollout: bool) -> list[str]:
    ratio = inputs.get("importance_sampling_ratio")
    checks = (
        ("top_entropy_quantile", trainer.top_entropy_quantile < 1.0),
        ("off_policy_mask_threshold", trainer.off_policy_mask_threshold is not None),
        ("use_adaptive_entropy", trainer.use_adaptive_entropy),
        ("entropy_coef with loss_type dapo, cispo or vespo",
         trainer.entropy_coef != 0 and trainer.loss_type in _TOKEN_SUM_LOSSES),
        ("a sequence-level importance_sampling_ratio with loss_type vespo",
         rollout and trainer.loss_type == "vespo" and ratio.shape[-1] == 1))
    return [name for name, on in checks if on]


def grpo_loss(trainer, inputs: dict, training: Optional[bool] = None) -> FusedGRPO:
    """The ``losses.grpo`` equivalent of a ``trl.GRPOTrainer``'s loss on ``inputs`` (the batch its
    ``compute_loss`` gets), by :data:`OPTIONS`; ``training`` defaults to ``trainer.model.training``.
    Raises ``ValueError`` naming the options that have no fused equivalent."""
    args, loss_type = trainer.args, trainer.loss_type
    rollout = "importance_sampling_ratio" in inputs and (loss_type == "vespo" or (
        trainer.use_vllm and trainer.vllm_importance_sampling_correction))
    unfusable = _unfusable(trainer, inputs, rollout)
    if unfusable:
        raise ValueError(f"no fused losses.grpo equivalent of {', '.join(unfusable)}: "
                         f"TplogpGRPOTrainer runs TRL's loss code on tplogp's log-probs instead")
    training = trainer.model.training if training is None else training
    steps = trainer.current_gradient_accumulation_steps if training else 1
    num_items, divisor = None, float(steps)
    if loss_type in _TOKEN_SUM_LOSSES:  # TRL's normaliser spans the generation batch: rescaled
        num_items = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if training:
            num_items = num_items * steps / args.steps_per_generation
        divisor = 1.0
    old = inputs.get("old_per_token_logps")
    loss = losses.grpo(
        loss_type, importance_sampling_level=trainer.importance_sampling_level,
        epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high, delta=args.delta,
        beta=trainer.beta, bias_corrected_kl=bool(args.use_bias_correction_kl and trainer.beta),
        max_completion_length=trainer.max_completion_length if loss_type == "dr_grpo" else None,
        num_items_in_batch=num_items, with_old_logp=old is not None,
        sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg, vespo_k_pos=args.vespo_k_pos,
        vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
        vespo_lambda_neg=args.vespo_lambda_neg,
        rollout_correction="weights" if rollout else None, entropy_coef=trainer.entropy_coef)
    per_token = [inputs["advantages"]] + ([old] if old is not None else [])
    if trainer.beta != 0:
        per_token.append(inputs["ref_per_token_logps"])
    if rollout:
        per_token.append(inputs["importance_sampling_ratio"].expand(inputs["completion_ids"].shape))
    return FusedGRPO(loss, tuple(per_token), divisor)


__all__ = ["TplogpGRPOTrainer", "patch", "check_trl_version", "UnsupportedTRLVersionError",
           "grpo_loss", "FusedGRPO", "Option", "OPTIONS", "option_table",
           "per_token_logps_and_entropies", "fused_compute_loss"]
