"""TRL's ``GRPOTrainer`` on a tiny model, for the TRL integration's tests (CPU and GPU): a
word-level tokenizer and tiny Qwen2 / Mixtral models built offline, a trainer of them, the option
groups its ``_compute_loss`` reads, one ``compute_loss`` step with TRL's head or tplogp's
log-probs (or a float64 head on the model's own backbone), and the three-way check of two steps
against a float64 one. Import after ``pytest.importorskip("trl")``."""

from __future__ import annotations

import types

import datasets
import tokenizers
import torch
import transformers
import trl

from tplogp.integrations import trl as tplogp_trl
from tplogp.tolerances import assert_no_worse, assert_no_worse_shared

V, B, P, K, T = 64, 4, 3, 6, 0.7
PROMPT_MASK = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1], [0, 0, 1]])  # left-padded prompts
COMPLETION_MASK = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 6, [1] * 2 + [0] * 4])


def tokenizer():
    vocab = {f"t{i}": i for i in range(V)}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t1",
                                                eos_token="t2", unk_token="t0")


def tiny_model(moe: bool = False, dtype=torch.float32):
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


def reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def grpo_trainer(model, tmp_path, cls=None, peft_config=None, fused_loss=None, **options):
    """A trainer of ``model`` on CPU in the model's dtype (with a PEFT adapter of ``peft_config``;
    ``fused_loss``: the subclass's argument); ``options``: more (or other) GRPOConfig arguments."""
    settings = dict(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=B,
                    num_generations=2, max_completion_length=K, temperature=T, report_to=[],
                    bf16=False, logging_steps=1)
    args = trl.GRPOConfig(**{**settings, **options})
    dataset = datasets.Dataset.from_dict({"prompt": ["t3 t4 t5", "t6 t7"] * 2})
    extra = {} if fused_loss is None else {"fused_loss": fused_loss}
    trainer = (cls or trl.GRPOTrainer)(model=model, reward_funcs=reward, args=args,
                                       train_dataset=dataset, processing_class=tokenizer(),
                                       peft_config=peft_config, **extra)
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def sequence_ids(batch: dict) -> tuple:
    return (torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1))


def bf16_trainers(out, device: str = "cpu"):
    """A bf16 model's trainer on ``device`` (TRL's autocast in bf16), the stock trainer of a float64
    copy of the same bf16 weights on the CPU, and a fixed batch (old and reference log-probs near
    the model's, ``-log V``)."""
    model = tiny_model(dtype=torch.bfloat16).to(device)
    stock = grpo_trainer(model, out, use_cpu=device == "cpu", bf16=True)
    truth = grpo_trainer(tiny_model(dtype=torch.bfloat16).double(), out)
    g = torch.Generator().manual_seed(3)
    old = torch.randn(B, K, generator=g) * 0.3 - 4.0
    batch = dict(prompt_ids=torch.randint(3, V, (B, P), generator=g), prompt_mask=PROMPT_MASK,
                 completion_ids=torch.randint(3, V, (B, K), generator=g),
                 completion_mask=COMPLETION_MASK, advantages=torch.randn(B, generator=g),
                 old_per_token_logps=old * COMPLETION_MASK,
                 ref_per_token_logps=(old + 0.2) * COMPLETION_MASK,
                 sampling_per_token_logps=(old - 0.1) * COMPLETION_MASK,
                 num_items_in_batch=COMPLETION_MASK.sum().float())
    return stock, truth, batch


def bf16_steps(monkeypatch, trainers, options: dict, fused: bool = False) -> list:
    """The four steps of the shared-error rule on :func:`bf16_trainers`: tplogp's (``fused``: the
    fused loss), TRL's head, the float64 model, and the bf16 model with a float64 head."""
    stock, truth, batch = trainers
    results = []
    for trainer, patched, exact in ((stock, True, False), (stock, False, False),
                                    (truth, False, False), (stock, False, True)):
        configure(monkeypatch, trainer, options)
        results.append(compute_loss_step(trainer, batch, patched, fused=fused and patched,
                                         exact_head=exact))
    return results


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


def configure(monkeypatch, trainer, options: dict) -> None:
    for name, value in options.items():
        target = trainer.args if name.startswith("args.") else trainer
        monkeypatch.setattr(target, name.removeprefix("args."), value)


def float64_head(trainer, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                 compute_entropy=False, compute_aux_loss=False, **inputs):
    """``_get_per_token_logps_and_entropies`` with the model's backbone as TRL runs it (its dtype,
    the trainer's autocast) and the LM head in float64: ``log_softmax((h W^T + b) / T)`` of the
    hidden states cast to float64, at the completion tokens, and its entropy (float64, 0 where the
    attention mask is 0). The error of a low-precision model that no head can remove."""
    assert not compute_aux_loss and all(v is None for v in inputs.values()), "a text model"
    with trainer.accelerator.autocast():
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    bias = None if head.bias is None else head.bias.double()
    hidden = hidden[:, -logits_to_keep - 1:-1].double()
    logp = torch.log_softmax(torch.nn.functional.linear(hidden, head.weight.double(), bias)
                             / trainer.temperature, -1)
    counted = attention_mask[:, -logits_to_keep:].bool()
    token = torch.where(counted, logp.gather(-1, input_ids[:, -logits_to_keep:, None])[..., 0], 0.0)
    entropy = torch.where(counted, -(logp.exp() * logp).sum(-1), 0.0) if compute_entropy else None
    return token, entropy, None


def compute_loss_step(trainer, batch, patched: bool, fused: bool = False,
                      exact_head: bool = False):
    """Loss, metrics and gradients of the trainer's own compute_loss on the batch (``fused``: the
    patched trainer's fused loss; ``exact_head``: TRL's loss code on :func:`float64_head`'s
    log-probs), and its log-probs and entropies."""
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    for name in ("_get_per_token_logps_and_entropies", "_compute_loss"):
        trainer.__dict__.pop(name, None)
    if patched:
        tplogp_trl.patch(trainer, fused_loss=fused)
    elif exact_head:
        trainer._get_per_token_logps_and_entropies = types.MethodType(float64_head, trainer)
    parameter = next(model.parameters())
    wide = parameter.dtype == torch.float64
    inputs = {k: (v.double() if wide and v.is_floating_point() else v).to(parameter.device)
              for k, v in batch.items()}
    try:
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        with torch.no_grad():
            logp, entropy, _ = trainer._get_per_token_logps_and_entropies(
                model, *sequence_ids(inputs), K, compute_entropy=True)
    finally:
        for name in ("_get_per_token_logps_and_entropies", "_compute_loss"):
            trainer.__dict__.pop(name, None)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return dict(loss=loss.detach().cpu(), logp=logp.cpu(), entropy=entropy.cpu(), metrics=metrics,
                grads=grads)


CONTINUOUS_METRICS = ("entropy", "kl", "policy_loss", "aux_loss")


def assert_three_way(ours, stock, truth, dtype=torch.float32, metrics=None, exact_head=None):
    """Ours no worse than the stock trainer against the float64 one (``dtype``: the model's);
    ``metrics``: the metrics compared (None: all). ``exact_head``: the same low-precision model's
    step with :func:`float64_head`, for the shared-error rule
    (:func:`tplogp.tolerances.assert_no_worse_shared`: the backbone's error in ``dtype``, which
    both heads carry, is the floor)."""
    def check(name, *values):
        if exact_head is None:
            assert_no_worse(name, *values, dtype)
        else:
            assert_no_worse_shared(name, values[0], values[1], values[3], values[2], dtype)

    results = (ours, stock, truth) + (() if exact_head is None else (exact_head,))
    for name in ("logp", "entropy", "loss"):
        assert ours[name].dtype == torch.float32
        check(name, *(r[name] for r in results))
    assert all(r["metrics"].keys() == ours["metrics"].keys() for r in results)
    assert "entropy" in ours["metrics"]
    names = [k for k in ours["metrics"] if metrics is None or k in metrics]
    vectors = [torch.tensor([r["metrics"][k] for k in names], dtype=torch.float64).nan_to_num(-1.0)
               for r in results]
    check("metrics " + ", ".join(names), *vectors)
    assert ours["grads"].keys() == truth["grads"].keys() and ours["grads"]
    for name in truth["grads"]:
        check(f"grad {name}", *(r["grads"][name] for r in results))
