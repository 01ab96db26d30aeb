"""``tplogp.integrations.trl`` inside TRL's own ``GRPOTrainer``: the trainer's ``compute_loss`` (its
``_compute_loss``, metrics included) on one fixed batch, with TRL's fused LM head and with tplogp's
log-probs, three-way against the same stock trainer on a float64 copy of the model (the rule of
``tplogp.tolerances``): log-probs, entropies, loss, every metric and every parameter's gradient,
for each group of TRL's options.

A tiny Qwen2 model (and a tiny Mixtral for the router loss) and a word-level tokenizer are built
here, no downloads; generation is bypassed except in one end-to-end training step. ``grpo_loss``
(the fused equivalent of a trainer's loss) is checked against the stock trainer's loss the same way.
"""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from tplogp.integrations import trl as tplogp_trl  # noqa: E402
from tplogp.integrations.hf import causal_lm_loss  # noqa: E402
from tplogp.tolerances import assert_no_worse  # noqa: E402

V, B, P, K, T = 64, 4, 3, 6, 0.7
PROMPT_MASK = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1], [0, 0, 1]])  # left-padded prompts
COMPLETION_MASK = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 6, [1] * 2 + [0] * 4])


def _tokenizer():
    vocab = {f"t{i}": i for i in range(V)}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t1",
                                                eos_token="t2", unk_token="t0")


def _model(moe: bool = False, dtype=torch.float32):
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if moe:  # a router loss (router_aux_loss_coef 0.001 by default); eager experts run float64
        config = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                            experts_implementation="eager")
    else:
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _trainer(model, tmp_path, cls=None, **options):
    """A trainer of ``model`` on CPU in the model's dtype; ``options``: more (or other) GRPOConfig
    arguments."""
    settings = dict(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=B,
                    num_generations=2, max_completion_length=K, temperature=T, report_to=[],
                    bf16=False, logging_steps=1)
    args = trl.GRPOConfig(**{**settings, **options})
    dataset = datasets.Dataset.from_dict({"prompt": ["t3 t4 t5", "t6 t7"] * 2})
    trainer = (cls or trl.GRPOTrainer)(model=model, reward_funcs=_reward, args=args,
                                       train_dataset=dataset, processing_class=_tokenizer())
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def _ids(batch: dict) -> tuple:
    return (torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1))


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """The stock trainer (fp32), its float64 twin (same weights) and the fixed batch."""
    out = tmp_path_factory.mktemp("grpo")
    stock, truth = _trainer(_model(), out), _trainer(_model(dtype=torch.float64), out)
    g = torch.Generator().manual_seed(1)
    batch = dict(prompt_ids=torch.randint(3, V, (B, P), generator=g), prompt_mask=PROMPT_MASK,
                 completion_ids=torch.randint(3, V, (B, K), generator=g),
                 completion_mask=COMPLETION_MASK)
    with torch.no_grad():
        logp, _, _ = stock._get_per_token_logps_and_entropies(stock.model, *_ids(batch), K)

    def noisy(base, scale):
        return (base + scale * torch.randn(base.shape, generator=g)) * COMPLETION_MASK

    old = noisy(logp, 0.3)
    sampler = noisy(old, 0.2)
    batch.update(advantages=torch.randn(B, generator=g), old_per_token_logps=old,
                 ref_per_token_logps=noisy(logp, 0.2), sampling_per_token_logps=sampler,
                 num_items_in_batch=COMPLETION_MASK.sum().float() * 2,
                 importance_sampling_ratio=torch.exp(old - sampler).clamp(max=2.0))  # 1 on pads
    return stock, truth, batch


# option groups: trainer attributes (and args.<name>) as TRL's _compute_loss reads them
CASES = {
    **{f"loss_type-{t}": dict(loss_type=t) for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo",
                                                      "sapo", "luspo", "vespo")},
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon_low=0.05,
                 epsilon_high=0.08),
    "beta-bias-corrected": dict(loss_type="bnpo", beta=0.04,
                                **{"args.use_bias_correction_kl": True}),
    "clip-delta": dict(loss_type="dapo", epsilon_high=0.28, **{"args.delta": 1.1}),
    "entropy-mask-and-bonus": dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.01,
                                   _entropy_bonus_enabled=True),
    "off-policy-mask": dict(loss_type="dapo", off_policy_mask_threshold=0.05),
    "rollout-is": dict(loss_type="grpo", use_vllm=True, vllm_importance_sampling_correction=True),
    "rollout-is-vespo": dict(loss_type="vespo", use_vllm=True,
                             vllm_importance_sampling_correction=True),
    "adaptive-entropy": dict(loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.01,
                             _entropy_bonus_enabled=True, _last_world_entropy=0.0),
}


def _configure(monkeypatch, trainer, options: dict) -> None:
    for name, value in options.items():
        target = trainer.args if name.startswith("args.") else trainer
        monkeypatch.setattr(target, name.removeprefix("args."), value)


def _step(trainer, batch, patched: bool):
    """Loss, metrics and gradients of the trainer's own compute_loss on the batch, and its
    log-probs and entropies."""
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    trainer.__dict__.pop("_get_per_token_logps_and_entropies", None)
    if patched:
        tplogp_trl.patch(trainer)
    parameter = next(model.parameters())
    wide = parameter.dtype == torch.float64
    inputs = {k: (v.double() if wide and v.is_floating_point() else v).to(parameter.device)
              for k, v in batch.items()}
    try:
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        with torch.no_grad():
            logp, entropy, _ = trainer._get_per_token_logps_and_entropies(
                model, *_ids(inputs), K, compute_entropy=True)
    finally:
        trainer.__dict__.pop("_get_per_token_logps_and_entropies", None)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return dict(loss=loss.detach().cpu(), logp=logp.cpu(), entropy=entropy.cpu(), metrics=metrics,
                grads=grads)


CONTINUOUS_METRICS = ("entropy", "kl", "policy_loss", "aux_loss")


def _assert_three_way(ours, stock, truth, dtype=torch.float32, metrics=None):
    """Ours no worse than the stock trainer against the float64 one (``dtype``: the model's);
    ``metrics``: the metrics compared (None: all)."""
    for name in ("logp", "entropy", "loss"):
        assert ours[name].dtype == torch.float32
        assert_no_worse(name, ours[name], stock[name], truth[name], dtype)
    assert ours["metrics"].keys() == stock["metrics"].keys() == truth["metrics"].keys()
    assert "entropy" in ours["metrics"]
    names = [k for k in ours["metrics"] if metrics is None or k in metrics]
    vectors = [torch.tensor([r["metrics"][k] for k in names], dtype=torch.float64).nan_to_num(-1.0)
               for r in (ours, stock, truth)]
    assert_no_worse("metrics " + ", ".join(names), *vectors, dtype)
    assert ours["grads"].keys() == truth["grads"].keys() and ours["grads"]
    for name in truth["grads"]:
        assert_no_worse(f"grad {name}", ours["grads"][name], stock["grads"][name],
                        truth["grads"][name], dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_compute_loss_matches_trls_fused_head(trainers, monkeypatch, case):
    stock, truth, batch = trainers
    results = []
    for trainer, patched in ((stock, True), (stock, False), (truth, False)):
        _configure(monkeypatch, trainer, CASES[case])
        results.append(_step(trainer, batch, patched))
    _assert_three_way(*results)
    if case == "adaptive-entropy":  # the controller moved the coefficient alike on both paths
        assert stock.entropy_coef == truth.entropy_coef != 0.01


def test_moe_router_loss_is_kept(tmp_path):
    stock = _trainer(_model(moe=True), tmp_path)
    truth = _trainer(_model(moe=True, dtype=torch.float64), tmp_path)
    assert stock.aux_loss_enabled
    g = torch.Generator().manual_seed(2)
    batch = dict(prompt_ids=torch.randint(3, V, (B, P), generator=g), prompt_mask=PROMPT_MASK,
                 completion_ids=torch.randint(3, V, (B, K), generator=g),
                 completion_mask=COMPLETION_MASK, advantages=torch.randn(B, generator=g),
                 num_items_in_batch=COMPLETION_MASK.sum().float())
    results = [_step(stock, batch, True), _step(stock, batch, False), _step(truth, batch, False)]
    assert "aux_loss" in results[0]["metrics"]
    _assert_three_way(*results)


def test_subclass_is_the_patched_trainer(trainers, tmp_path):
    stock, _, batch = trainers
    ours = _step(_trainer(_model(), tmp_path, cls=tplogp_trl.TplogpGRPOTrainer), batch, False)
    patched = _step(stock, batch, True)
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
    trainer = _trainer(_model(), tmp_path, cls=tplogp_trl.TplogpGRPOTrainer, max_steps=1,
                       num_iterations=2, save_strategy="no")
    trainer.train()
    assert True in calls and False in calls, calls  # the loss's call and the old log-probs'
    logged = trainer.state.log_history[0]
    assert all(torch.isfinite(torch.tensor(logged[k]))
               for k in ("loss", "entropy", "clip_ratio/region_mean"))


def test_unrouted_options_fall_back_visibly(trainers, monkeypatch, caplog):
    stock, _, batch = trainers
    monkeypatch.setattr(stock.args, "cast_lm_head_to_fp32", True)
    with caplog.at_level(logging.WARNING, logger="tplogp.integrations.trl"):
        ours = _step(stock, batch, True)
    assert "cast_lm_head_to_fp32" in caplog.text and "TRL's own fused LM head" in caplog.text
    monkeypatch.setattr(stock.args, "cast_lm_head_to_fp32", False)
    torch.testing.assert_close(ours["loss"], _step(stock, batch, False)["loss"], rtol=0, atol=0)


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
        _configure(monkeypatch, trainer, FUSED_CASES[case])
    fused = tplogp_trl.grpo_loss(stock, batch, training=True)
    model = stock.model
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model, *_ids(batch), loss=fused.loss, per_token=fused.per_token,
                          loss_mask=batch["completion_mask"], logits_to_keep=K,
                          temperature=T) / fused.divisor
    loss.backward()
    ours = dict(loss=loss.detach(), grads={n: p.grad.clone() for n, p in model.named_parameters()})
    stock_result, truth_result = _step(stock, batch, False), _step(truth, batch, False)
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
