"""``tplogp.integrations.trl`` inside TRL's own ``GRPOTrainer``: the trainer's ``compute_loss`` (its
``_compute_loss``, metrics included) on one fixed batch, with TRL's fused LM head and with tplogp's
log-probs, three-way against the same stock trainer on a float64 copy of the model (the rule of
``tplogp.tolerances``): log-probs, entropies, loss, every metric and every parameter's gradient,
for each group of TRL's options.

A tiny Qwen2 model (and a tiny Mixtral for the router loss) and a word-level tokenizer are built
offline (tests/support/grpo_trainer.py); generation is bypassed except in one end-to-end training
step. ``grpo_loss`` (the fused equivalent of a trainer's loss) is checked against the stock
trainer's loss the same way.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

from tests.support.grpo_trainer import (  # noqa: E402
    B, CASES, COMPLETION_MASK, CONTINUOUS_METRICS, K, P, PROMPT_MASK, T, V, assert_three_way,
    bf16_steps, bf16_trainers, compute_loss_step, configure, grpo_trainer, sequence_ids,
    tiny_model)
from tplogp.integrations import trl as tplogp_trl  # noqa: E402
from tplogp.integrations.hf import causal_lm_loss  # noqa: E402
from tests.support import tolerances as tol  # noqa: E402
from tplogp.tolerances import assert_no_worse  # noqa: E402


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """The stock trainer (fp32), its float64 twin (same weights) and the fixed batch."""
    out = tmp_path_factory.mktemp("grpo")
    stock = grpo_trainer(tiny_model(), out)
    truth = grpo_trainer(tiny_model(dtype=torch.float64), out)
    g = torch.Generator().manual_seed(1)
    batch = dict(prompt_ids=torch.randint(3, V, (B, P), generator=g), prompt_mask=PROMPT_MASK,
                 completion_ids=torch.randint(3, V, (B, K), generator=g),
                 completion_mask=COMPLETION_MASK)
    with torch.no_grad():
        logp, _, _ = stock._get_per_token_logps_and_entropies(stock.model, *sequence_ids(batch), K)

    def noisy(base, scale):
        return (base + scale * torch.randn(base.shape, generator=g)) * COMPLETION_MASK

    old = noisy(logp, 0.3)
    sampler = noisy(old, 0.2)
    batch.update(advantages=torch.randn(B, generator=g), old_per_token_logps=old,
                 ref_per_token_logps=noisy(logp, 0.2), sampling_per_token_logps=sampler,
                 num_items_in_batch=COMPLETION_MASK.sum().float() * 2,
                 importance_sampling_ratio=torch.exp(old - sampler).clamp(max=2.0))  # 1 on pads
    return stock, truth, batch


@pytest.mark.parametrize("case", list(CASES))
def test_compute_loss_matches_trls_fused_head(trainers, monkeypatch, case):
    stock, truth, batch = trainers
    results = []
    for trainer, patched in ((stock, True), (stock, False), (truth, False)):
        configure(monkeypatch, trainer, CASES[case])
        results.append(compute_loss_step(trainer, batch, patched))
    assert_three_way(*results)
    if case == "adaptive-entropy":  # the controller moved the coefficient alike on both paths
        assert stock.entropy_coef == truth.entropy_coef != 0.01


@pytest.fixture(scope="module")
def bf16_trainers_cpu(tmp_path_factory):
    """The bf16 model's trainer (TRL's bf16 autocast on the CPU, where TRL folds its head's bf16
    tiles in torch), its float64 twin and the batch of the GPU test."""
    return bf16_trainers(tmp_path_factory.mktemp("grpo_bf16"))


BF16_CASES = ["loss_type-dapo", "loss_type-grpo", "gspo", "beta-bias-corrected",
              "entropy-mask-and-bonus", "off-policy-mask"]
BF16_FUSED_CASES = ["loss_type-dapo", "loss_type-grpo", "loss_type-cispo", "loss_type-sapo",
                    "beta-bias-corrected"]


@pytest.mark.parametrize("case,fused", [(c, False) for c in BF16_CASES]
                         + [(c, True) for c in BF16_FUSED_CASES])
def test_bf16_compute_loss_by_the_shared_error_rule(bf16_trainers_cpu, monkeypatch, case, fused):
    """A bf16 model: the trainer's loss, continuous metrics and every gradient with tplogp's head
    (``fused``: the fused loss) no worse than the larger of TRL's head's error and a float64
    head's on the same bf16 model (tplogp.tolerances.assert_no_worse_shared)."""
    ours, stock, truth, exact = bf16_steps(monkeypatch, bf16_trainers_cpu, CASES[case], fused)
    assert_three_way(ours, stock, truth, dtype=torch.bfloat16, metrics=CONTINUOUS_METRICS,
                     exact_head=exact)


def test_bf16_log_probs_are_a_float64_heads(bf16_trainers_cpu, monkeypatch):
    """On the same bf16 backbone, tplogp's log-probs are a float64 head's to fp32 rounding, while
    TRL's head rounds each logit to bf16 (its tiles' dtype under autocast) before its fp32
    softmax: the head's own error, apart from the backbone's that both carry."""
    ours, stock, _, exact = bf16_steps(monkeypatch, bf16_trainers_cpu, CASES["loss_type-grpo"])
    counted = COMPLETION_MASK.bool()
    ours_head = (ours["logp"].double() - exact["logp"])[counted].abs().max().item()
    trl_head = (stock["logp"].double() - exact["logp"])[counted].abs().max().item()
    assert ours_head <= tol.ABS_FP32_HEAD_LOGP, ours_head
    assert trl_head > 100 * ours_head, (trl_head, ours_head)


def test_moe_router_loss_is_kept(tmp_path):
    stock = grpo_trainer(tiny_model(moe=True), tmp_path)
    truth = grpo_trainer(tiny_model(moe=True, dtype=torch.float64), tmp_path)
    assert stock.aux_loss_enabled
    g = torch.Generator().manual_seed(2)
    batch = dict(prompt_ids=torch.randint(3, V, (B, P), generator=g), prompt_mask=PROMPT_MASK,
                 completion_ids=torch.randint(3, V, (B, K), generator=g),
                 completion_mask=COMPLETION_MASK, advantages=torch.randn(B, generator=g),
                 num_items_in_batch=COMPLETION_MASK.sum().float())
    results = [compute_loss_step(stock, batch, True), compute_loss_step(stock, batch, False),
               compute_loss_step(truth, batch, False)]
    assert "aux_loss" in results[0]["metrics"]
    assert_three_way(*results)
    assert_three_way(compute_loss_step(stock, batch, True, fused=True), *results[1:])


def test_subclass_is_the_patched_trainer(trainers, tmp_path):
    stock, _, batch = trainers
    subclass = grpo_trainer(tiny_model(), tmp_path, cls=tplogp_trl.TplogpGRPOTrainer)
    ours = compute_loss_step(subclass, batch, False)
    patched = compute_loss_step(stock, batch, True)
    torch.testing.assert_close(ours["loss"], patched["loss"], rtol=0, atol=0)
    for name, grad in patched["grads"].items():
        torch.testing.assert_close(ours["grads"][name], grad, rtol=0, atol=0)


def test_a_training_step_goes_through_tplogp(tmp_path, monkeypatch):
    """trainer.train(): generation, the old log-probs (num_iterations=2) and the loss call the
    integration."""
    calls = []
    original = tplogp_trl.per_token_logps_and_entropies

    def spy(*args, **kwargs):
        calls.append(kwargs.get("compute_entropy", args[6] if len(args) > 6 else False))
        return original(*args, **kwargs)

    monkeypatch.setattr(tplogp_trl, "per_token_logps_and_entropies", spy)
    trainer = grpo_trainer(tiny_model(), tmp_path, cls=tplogp_trl.TplogpGRPOTrainer, max_steps=1,
                       num_iterations=2, save_strategy="no")
    trainer.train()
    assert True in calls and False in calls, calls  # the loss's call and the old log-probs'
    logged = trainer.state.log_history[0]
    assert all(torch.isfinite(torch.tensor(logged[k]))
               for k in ("loss", "entropy", "clip_ratio/region_mean"))


def test_a_fused_loss_training_step(tmp_path, monkeypatch, caplog):
    """trainer.train() with fused_loss=True: generation, then the fused loss with no fallback, and
    TRL's metrics logged."""
    calls = []
    original = tplogp_trl.causal_lm_loss

    def spy(*args, **kwargs):
        calls.append(kwargs["loss"])
        return original(*args, **kwargs)

    monkeypatch.setattr(tplogp_trl, "causal_lm_loss", spy)
    trainer = grpo_trainer(tiny_model(), tmp_path, cls=tplogp_trl.TplogpGRPOTrainer, max_steps=1,
                           save_strategy="no", fused_loss=True)
    with caplog.at_level(logging.WARNING, logger="tplogp.integrations.trl"):
        trainer.train()
    assert "fused_loss" not in caplog.text and len(calls) == 1, calls
    logged = trainer.state.log_history[0]
    assert all(torch.isfinite(torch.tensor(logged[k]))
               for k in ("loss", "entropy", "clip_ratio/region_mean", "clip_ratio/high_max"))


def test_a_lora_training_step_with_a_kl_term(tmp_path, monkeypatch):
    """A PEFT model's step with beta > 0: the reference log-probs (the adapter disabled) go through
    the integration as well."""
    peft = pytest.importorskip("peft")
    models = []
    original = tplogp_trl.per_token_logps_and_entropies

    def spy(trainer, model, *args, **kwargs):
        models.append(type(model).__name__)
        return original(trainer, model, *args, **kwargs)

    monkeypatch.setattr(tplogp_trl, "per_token_logps_and_entropies", spy)
    trainer = grpo_trainer(tiny_model(), tmp_path, cls=tplogp_trl.TplogpGRPOTrainer, max_steps=1,
                           beta=0.04, save_strategy="no",
                           peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    assert models == ["PeftModel", "PeftModel"], models  # the reference's and the loss's
    logged = trainer.state.log_history[0]
    assert torch.isfinite(torch.tensor([logged["loss"], logged["kl"]])).all()


def test_unrouted_options_fall_back_visibly(trainers, monkeypatch, caplog):
    stock, _, batch = trainers
    monkeypatch.setattr(stock.args, "cast_lm_head_to_fp32", True)
    with caplog.at_level(logging.WARNING, logger="tplogp.integrations.trl"):
        ours = compute_loss_step(stock, batch, True)
    assert "cast_lm_head_to_fp32" in caplog.text and "TRL's own fused LM head" in caplog.text
    monkeypatch.setattr(stock.args, "cast_lm_head_to_fp32", False)
    expected = compute_loss_step(stock, batch, False)
    torch.testing.assert_close(ours["loss"], expected["loss"], rtol=0, atol=0)


def test_tplogps_loss_config_is_not_trls():
    from tplogp.rl_losses import GRPOConfig, GRPOLossConfig

    assert GRPOConfig is GRPOLossConfig and GRPOLossConfig is not trl.GRPOConfig  # the former name


def test_version_and_trainer_are_checked():
    tplogp_trl.check_trl_version("1.16.4")
    for version in ("1.15.2", "1.17.0", "2.0.0"):
        with pytest.raises(tplogp_trl.UnsupportedTRLVersionError,
                           match=f"TRL {version} is installed"):
            tplogp_trl.check_trl_version(version)
    with pytest.raises(TypeError, match="expects a trl.GRPOTrainer"):
        tplogp_trl.patch(object())


FUSED_CASES = {
    "dapo-accumulated": dict(loss_type="dapo", **{"args.steps_per_generation": 4}),
    "grpo-accumulated": dict(loss_type="grpo"),
    "bias-correction-without-kl": dict(loss_type="bnpo", **{"args.use_bias_correction_kl": True}),
    "gspo-kl-bias-corrected": dict(loss_type="grpo", importance_sampling_level="sequence",
                                   beta=0.04, epsilon_low=0.05,
                                   **{"args.use_bias_correction_kl": True}),
    "dr_grpo-entropy": dict(loss_type="dr_grpo", entropy_coef=0.01, _entropy_bonus_enabled=True),
    "luspo-kl": dict(loss_type="luspo", beta=0.04, **{"args.use_bias_correction_kl": False}),
    "cispo-rollout-is": dict(loss_type="cispo", use_vllm=True,
                             vllm_importance_sampling_correction=True),
    "vespo-rollout-is": dict(loss_type="vespo", use_vllm=True,
                             vllm_importance_sampling_correction=True),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_grpo_loss_is_the_trainers_loss(trainers, monkeypatch, case):
    """causal_lm_loss with grpo_loss(trainer, inputs), / divisor: the stock trainer's loss and
    gradients."""
    stock, truth, batch = trainers
    for trainer in (stock, truth):
        configure(monkeypatch, trainer, FUSED_CASES[case])
    fused = tplogp_trl.grpo_loss(stock, batch, training=True)
    model = stock.model
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, *sequence_ids(batch), loss=fused.loss, per_token=fused.per_token,
                          loss_mask=batch["completion_mask"], logits_to_keep=K,
                          temperature=T) / fused.divisor
    loss.backward()
    ours = dict(loss=loss.detach(), grads={n: p.grad.clone() for n, p in model.named_parameters()})
    stock_result = compute_loss_step(stock, batch, False)
    truth_result = compute_loss_step(truth, batch, False)
    assert_no_worse("loss", ours["loss"], stock_result["loss"], truth_result["loss"],
                    torch.float32)
    for name, grad in truth_result["grads"].items():
        assert_no_worse(f"grad {name}", ours["grads"][name], stock_result["grads"][name], grad,
                        torch.float32)


@pytest.mark.parametrize("option", ["top_entropy_quantile", "off_policy_mask_threshold",
                                    "use_adaptive_entropy"])
def test_grpo_loss_names_what_it_cannot_fuse(trainers, monkeypatch, option):
    stock, _, batch = trainers
    value = {"top_entropy_quantile": 0.5, "off_policy_mask_threshold": 0.1,
             "use_adaptive_entropy": True}[option]
    monkeypatch.setattr(stock, option, value)
    with pytest.raises(ValueError, match=option):
        tplogp_trl.grpo_loss(stock, batch)


TRAINER_FUSED_CASES = {
    **{f"{t}-accumulated": dict(loss_type=t, **{"args.steps_per_generation": 4})
       for t in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")},
    "dapo-clip-delta-kl": dict(loss_type="dapo", epsilon_high=0.28, beta=0.04,
                               **{"args.delta": 1.1, "args.use_bias_correction_kl": True}),
    "bnpo-tight-clip-entropy": dict(loss_type="bnpo", epsilon_low=0.01, epsilon_high=0.01,
                                    entropy_coef=0.01, _entropy_bonus_enabled=True),
    "dr_grpo-entropy": dict(loss_type="dr_grpo", entropy_coef=0.01, _entropy_bonus_enabled=True),
    "grpo-rollout-is": dict(loss_type="grpo", use_vllm=True,
                            vllm_importance_sampling_correction=True),
    "sapo-entropy": dict(loss_type="sapo", entropy_coef=0.01, _entropy_bonus_enabled=True),
    "sapo-kl-bias-corrected-rollout-is": dict(
        loss_type="sapo", beta=0.04, use_vllm=True,
        vllm_importance_sampling_correction=True, **{"args.use_bias_correction_kl": True}),
    "cispo-kl-rollout-is": dict(loss_type="cispo", beta=0.04, use_vllm=True,
                                vllm_importance_sampling_correction=True,
                                **{"args.steps_per_generation": 4}),
}


@pytest.mark.parametrize("case", list(TRAINER_FUSED_CASES))
def test_fused_loss_in_the_trainer_matches_trls(trainers, monkeypatch, caplog, case):
    """patch(trainer, fused_loss=True): the loss, every gradient and every metric TRL logs,
    three-way against the stock trainer and its float64 twin, with no fallback."""
    stock, truth, batch = trainers
    results = []
    with caplog.at_level(logging.WARNING, logger="tplogp.integrations.trl"):
        for trainer, patched in ((stock, True), (stock, False), (truth, False)):
            configure(monkeypatch, trainer, TRAINER_FUSED_CASES[case])
            results.append(compute_loss_step(trainer, batch, patched, fused=patched))
    assert "fused_loss" not in caplog.text
    assert_three_way(*results)


def test_fused_loss_falls_back_visibly(trainers, monkeypatch, caplog, tmp_path):
    """vespo logs a per-sequence metric: TRL's loss code on tplogp's log-probs computes it, with
    one warning per trainer naming the metric."""
    stock, _, batch = trainers
    monkeypatch.setattr(stock, "loss_type", "vespo")
    expected = compute_loss_step(stock, batch, True)
    with caplog.at_level(logging.WARNING, logger="tplogp.integrations.trl"):
        ours = compute_loss_step(stock, batch, True, fused=True)
        compute_loss_step(stock, batch, True, fused=True)
    warned = [r for r in caplog.records if "fused_loss" in r.getMessage()]
    assert len(warned) == 1 and "vespo/phi_seq_mean" in warned[0].getMessage()
    torch.testing.assert_close(ours["loss"], expected["loss"], rtol=0, atol=0)
    assert ours["metrics"] == expected["metrics"]
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(ours["grads"][name], grad, rtol=0, atol=0)
    subclass = grpo_trainer(tiny_model(), tmp_path, cls=tplogp_trl.TplogpGRPOTrainer,
                            fused_loss=True)
    assert subclass._tplogp_fused_loss


RATIOS = (0.5, 0.7, 0.95, 1.0, 1.1, 1.5, 2.0)  # far from each bound below: 0.8, 1.28, 1.2, 1.25
CLIP_CASES = {
    "grpo-mixed-advantages": (dict(loss_type="grpo", epsilon_low=0.2, epsilon_high=0.28),
                              (1.0, -1.0, 0.5, -0.5)),
    "dapo-negative-advantages": (dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28),
                                 (-1.0, -0.3, -2.0, -0.7)),
    # delta under 1 + epsilon_high: no token is high-clipped (TRL flags the delta-clamped ratio)
    "bnpo-delta": (dict(loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.28,
                        **{"args.delta": 1.25}), (1.0, -1.0, 0.5, 2.0)),
    "cispo": (dict(loss_type="cispo", epsilon_high=1.2), (1.0, -1.0, 0.5, -0.5)),
}


def _clip_batch(stock, advantages):
    """A batch whose old log-probs set each counted token's ratio to one of RATIOS (from the
    model's own log-probs; every row's first two 0.5 and 2.0), and those ratios (float64)."""
    g = torch.Generator().manual_seed(5)
    batch = dict(prompt_ids=torch.randint(3, V, (B, P), generator=g), prompt_mask=PROMPT_MASK,
                 completion_ids=torch.randint(3, V, (B, K), generator=g),
                 completion_mask=COMPLETION_MASK, advantages=torch.tensor(advantages),
                 num_items_in_batch=COMPLETION_MASK.sum().float())
    with torch.no_grad():
        logp, _, _ = stock._get_per_token_logps_and_entropies(stock.model, *sequence_ids(batch), K)
    ratio = torch.tensor(RATIOS, dtype=torch.float64)[torch.randint(len(RATIOS), (B, K),
                                                                    generator=g)]
    ratio[:, :2] = torch.tensor([0.5, 2.0], dtype=torch.float64)  # each row: both signs' clip
    batch["old_per_token_logps"] = (logp - ratio.log().float()) * COMPLETION_MASK
    return batch, ratio


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", list(CLIP_CASES))
def test_clip_metrics_token_by_token(trainers, monkeypatch, case, fused):
    """Each clip metric TRL logs (clip_ratio/low_mean, high_mean, region_mean, low_min, high_max;
    cispo_clip_ratio) against its definition on per-token ratios set far from the bounds, for TRL's
    own trainer and for tplogp's (``fused``: the fused loss, whose per-token clip flags are
    compared token by token): low = ratio < 1 - epsilon_low with advantage < 0, high =
    min(ratio, delta) > 1 + epsilon_high with advantage > 0 (cispo: ratio > epsilon_high),
    token means over the counted tokens, low_min / high_max over the per-sequence means."""
    stock = trainers[0]
    options, advantages = CLIP_CASES[case]
    configure(monkeypatch, stock, options)
    batch, ratio = _clip_batch(stock, advantages)
    counted = COMPLETION_MASK.bool()
    adv = torch.tensor(advantages, dtype=torch.float64)[:, None]
    if stock.loss_type == "cispo":
        low, high = torch.zeros_like(counted), (ratio > stock.epsilon_high) & (adv > 0) & counted
    else:
        capped = ratio if stock.args.delta is None else ratio.clamp(max=stock.args.delta)
        low = (ratio < 1 - stock.epsilon_low) & (adv < 0) & counted
        high = (capped > 1 + stock.epsilon_high) & (adv > 0) & counted
    assert low.any() or high.any()
    count = counted.sum(-1).double()

    def mean(flags):
        return (flags.sum() / counted.sum()).item()

    if stock.loss_type == "cispo":
        expected = {"cispo_clip_ratio": mean(high)}
    else:
        expected = {"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
                    "clip_ratio/region_mean": mean(low | high),
                    "clip_ratio/low_min": (low.sum(-1) / count).min().item(),
                    "clip_ratio/high_max": (high.sum(-1) / count).max().item()}
    flags = []
    original = tplogp_trl._log_clip_metrics

    def spy(trainer, logged, clip_flags, mask):
        flags.append((clip_flags.low.clone(), clip_flags.high.clone()))
        return original(trainer, logged, clip_flags, mask)

    monkeypatch.setattr(tplogp_trl, "_log_clip_metrics", spy)
    for patched in (False, True):
        metrics = compute_loss_step(stock, batch, patched, fused=fused and patched)["metrics"]
        for name, value in expected.items():
            assert abs(metrics[name] - value) <= tol.ABS_FP32_GRPO_METRIC, \
                (name, patched, metrics[name], value)
    if fused and stock.loss_type != "cispo":
        assert len(flags) == 1
        assert torch.equal(flags[0][0].cpu(), low) and torch.equal(flags[0][1].cpu(), high)
    # the batch reaches each metric: every sequence low-clipped somewhere (low_min > 0) with
    # negative advantages only, high-clipped tokens with positive ones unless delta caps them
    if case == "dapo-negative-advantages":
        assert expected["clip_ratio/low_min"] > 0
    elif stock.loss_type != "cispo":
        assert expected["clip_ratio/high_max"] > 0 or stock.args.delta is not None
