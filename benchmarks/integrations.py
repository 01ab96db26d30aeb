"""Hugging Face causal LM, RL steps: TRL 1.16's fused LM head vs ``tplogp.integrations.hf`` (time
and peak memory).

``python -m benchmarks integrations`` (one H100: a few minutes after the model is built). The model
is a Qwen2.5-1.5B-sized Qwen2 config with random weights (vocab 151936, hidden 1536, 28 layers, tied
head), bf16, on 8 x 2048 tokens (prompt 512 + completion 1536, ``logits_to_keep`` = the completion,
as TRL's GRPO trainer calls it). Steps, each implementation on the same model and batch:

* ``logprobs``: the old/reference log-probs of a GRPO batch, under ``torch.no_grad()``:
  ``trl_fused_head`` = TRL's own path since 1.15, ``model(ids, mask, labels=labels,
  fused_lm_head=True).log_probs[:, -k:]`` with the head ``trl.trainer.utils.add_fused_lm_head`` adds
  (its outputs ``log_probs`` and ``entropy``, as GRPOTrainer adds it to the policy; ``labels`` -100
  outside the completion and on padding); ``tplogp`` = ``causal_lm_logprobs`` (what
  ``tplogp.integrations.trl`` calls).
* ``grpo_loss``: forward + backward of TRL's default GRPO loss (``loss_type="dapo"``,
  ``epsilon=0.2``, ``epsilon_high=0.28``: the clipped token loss, a token mean over the completion
  mask; :mod:`benchmarks.policy`): ``trl_fused_head`` as above (with the entropy, which GRPOTrainer
  always asks for) then the loss written out in PyTorch (TRL's ``_compute_loss``);
  ``tplogp_logprobs`` = ``causal_lm_logprobs(..., return_entropy=True)`` then the same PyTorch loss
  (``TplogpGRPOTrainer``'s path); ``tplogp_fused`` = ``causal_lm_loss`` with the built-in
  ``losses.grpo("dapo", epsilon_high=0.28)`` and ``with_entropy=False`` (the loss and the head's
  gradients chunk by chunk in the forward).
* ``gspo_loss``: the same three for GSPO (``importance_sampling_level="sequence"``,
  ``loss_type="grpo"``, ``epsilon=3e-4``, ``epsilon_high=4e-4``: a ratio per sequence, each
  sequence's token mean, then the batch mean): the fused row takes every token's log-prob before any
  gradient (the two-phase schedule of :mod:`tplogp.fused_loss`).
* ``liger_fused`` (where ``liger-kernel`` is installed): the same loss through Liger's
  ``LigerFusedLinearGRPOLoss`` (``beta=0``, no reference model, its default ``compiled=True``, the
  loss's ``loss_type`` / ``importance_sampling_level`` / epsilons) on the decoder's final hidden
  states of the completion positions and the head.
* ``*_ckpt``: the same with gradient checkpointing on (``use_reentrant=False``), as RL trainers run
  models of this size: the decoder's activations no longer dominate the peak.

In bf16 and fp16 every call runs under ``torch.autocast`` in that dtype, as GRPOTrainer runs both
heads (``accelerator.autocast()`` with ``bf16=True``); fp32 runs without it. The model is built from
its config alone (no download: the machine needs no network).

Time: median of ``--reps`` calls (CUDA events, synced per call) after warm-up calls. Memory: peak
allocated GiB during one call above what was allocated before it (model and batch excluded;
gradients of the parameters and the activations included). A row whose call runs out of device
memory is kept, marked ``oom``, and a failing Liger row carries its ``error`` (the other rows still
run). ``loss``: the value of a loss step's call measured for memory. Agreement with an fp32 head on
the same final hidden states (the backbone's rounding is then no part of it): ``err_logp``,
``tplogp.tolerances.rel_error`` (``||logp - reference|| / ||reference||``) of the logprobs step,
the reference being ``tplogp.reference.reference_linear_logp(mode="fp32")`` (fp32 log-softmax of
fp32 logits); ``err_loss``, ``|loss - reference| / |reference|`` of a loss step, the reference
being the same loss in float64 of those fp32 log-probs. Prints a markdown table, then the same
table as a block to paste between the ``integrations-benchmark`` markers of docs/integrations.md,
and appends JSON rows (suite ``integrations``) to the results file.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Callable, Optional

import torch

from . import runner

FULL = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
            num_attention_heads=12, num_key_value_heads=2, batch=8, seq=2048, completion=1536)
SMOKE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4,
             num_key_value_heads=2, batch=2, seq=24, completion=16)
TEMPERATURE = 0.9
# the loss steps: (step, benchmarks.policy loss), each also with gradient checkpointing
# (step + "_ckpt")
STEPS = tuple((step + ckpt, name) for ckpt in ("", "_ckpt")
              for step, name in (("grpo_loss", "dapo"), ("gspo_loss", "gspo")))


def build_model(shape: dict, dtype: torch.dtype, device: torch.device):
    from tplogp.integrations import require

    transformers = require("transformers", "python -m benchmarks integrations", "hf")

    config = transformers.Qwen2Config(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        max_position_embeddings=max(shape["seq"], 64), tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device=device, dtype=dtype).train()


def set_checkpointing(model, on: bool) -> None:
    """Non-reentrant activation checkpointing on or off (transformers >= 5.2x names the methods
    ``activation_checkpointing_*``, earlier versions ``gradient_checkpointing_*``)."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def add_trl_fused_head(model, temperature: float) -> None:
    """TRL's fused LM head on ``model`` as GRPOTrainer adds it to the policy (log-probs and
    entropies)."""
    from tplogp.integrations import require

    require("trl", "python -m benchmarks integrations", "trl")
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))


def trl_logprobs(model, ids, mask, keep: int) -> torch.Tensor:
    """TRL 1.16's GRPOTrainer._get_per_token_logps_and_entropies: the fused head on the completion's
    labels."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    return model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[
        :, -keep:]


def reference_logprobs(model, ids, mask, keep: int, temperature: float) -> torch.Tensor:
    """``reference_linear_logp(mode="fp32")`` of the same final hidden states (the decoder run as
    the caller runs it, under its autocast) and head (outside autocast; one sequence at a time)."""
    from tplogp.reference import reference_linear_logp

    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask,
                                 use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    with torch.autocast(hidden.device.type, enabled=False):
        return torch.stack([reference_linear_logp(hidden[b, -keep - 1:-1], head.weight,
                                                  ids[b, -keep:], head.bias, mode="fp32",
                                                  temperature=temperature)
                            for b in range(ids.shape[0])])


def completion_hidden(model, ids, mask, keep: int) -> torch.Tensor:
    """The decoder's final hidden states at the ``keep`` positions that predict the completion,
    ``[B, keep, H]``."""
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask,
                                 use_cache=False).last_hidden_state
    return hidden[:, -keep - 1:-1]


def liger_grpo_loss(name: str, temperature: float):
    """Liger's fused GRPO loss configured as :data:`benchmarks.policy.LOSSES` ``[name]``, or None
    without ``liger-kernel``."""
    from . import policy

    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError:
        return None
    kw = policy.LOSSES[name][0]
    return LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type=kw["loss_type"],
                                    epsilon_low=kw["epsilon_low"], epsilon_high=kw["epsilon_high"],
                                    importance_sampling_level=kw.get(
                                        "importance_sampling_level", "token"),
                                    temperature=temperature)


def bench(smoke: bool, reps: int, dtype_name: str) -> list[dict]:
    from tplogp import losses

    from . import policy
    from tplogp.integrations.hf import causal_lm_logprobs, causal_lm_loss
    from tplogp.tolerances import rel_error

    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    shape = SMOKE if smoke else FULL
    dtype = runner.DTYPES[dtype_name]
    model = build_model(shape, dtype, device)
    add_trl_fused_head(model, TEMPERATURE)
    g = torch.Generator(device="cpu").manual_seed(1)
    b, s, keep = shape["batch"], shape["seq"], shape["completion"]
    ids = torch.randint(0, shape["vocab_size"], (b, s), generator=g).to(device)
    mask = torch.ones(b, s, dtype=torch.long)
    for row in range(0, b, 2):  # every other sequence left-padded by an eighth of the prompt
        mask[row, : (s - keep) // 8] = 0
    mask = mask.to(device)
    completion_mask = torch.ones(b, keep)
    for row in range(b):  # completions of different lengths
        completion_mask[row, keep - row * keep // (2 * b):] = 0
    completion_mask = completion_mask.to(device)
    advantages = torch.randn(b, 1, generator=g).expand(b, keep).contiguous().to(device)
    T = TEMPERATURE

    def autocast():
        """GRPOTrainer's ``accelerator.autocast()``: the model's dtype when low-precision."""
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    with torch.no_grad(), autocast():
        reference = reference_logprobs(model, ids, mask, keep, T)
        trl_values = trl_logprobs(model, ids, mask, keep)
        ours_values = causal_lm_logprobs(model, ids, mask, logits_to_keep=keep, temperature=T)
    old_logp = (reference + 0.05 * torch.randn(reference.shape, generator=g).to(device)).detach()
    errors = {"trl_fused_head": rel_error(trl_values, reference),
              "tplogp": rel_error(ours_values, reference)}
    reference_loss = {  # each loss in float64 of the fp32 head's log-probs
        name: policy.eager_loss(name, reference.double(), advantages, old_logp,
                                completion_mask).item() for _, name in STEPS}
    del reference, trl_values, ours_values

    def no_grad(fn: Callable[[], object]) -> Callable[[], object]:
        def run():
            with torch.no_grad(), autocast():
                fn()
        return run

    last = {}  # the latest loss step's value

    def with_backward(loss_fn: Callable[[], torch.Tensor]) -> Callable[[], object]:
        def run():
            model.zero_grad(set_to_none=True)
            with autocast():
                value = loss_fn()
            value.backward()
            last["loss"] = value.detach()
        return run

    def loss_cases(step: str, name: str) -> list:
        """TRL's fused head, tplogp's log-probs with the same eager loss, and the fused built-in
        loss."""
        grpo = losses.grpo(**policy.LOSSES[name][0])

        def eager(logp):
            return policy.eager_loss(name, logp, advantages, old_logp, completion_mask)

        liger = liger_grpo_loss(name, T)
        rows = [] if liger is None else [(step, "liger_fused", with_backward(lambda: liger(
            completion_hidden(model, ids, mask, keep), model.get_output_embeddings().weight,
            ids[:, -keep:],
            completion_mask, advantages[:, 0], old_per_token_logps=old_logp)[0]))]
        return [
            (step, "trl_fused_head",
             with_backward(lambda: eager(trl_logprobs(model, ids, mask, keep)))),
            (step, "tplogp_logprobs", with_backward(lambda: eager(causal_lm_logprobs(
                model, ids, mask, logits_to_keep=keep, temperature=T, return_entropy=True).logp))),
            (step, "tplogp_fused", with_backward(lambda: causal_lm_loss(
                model, ids, mask, loss=grpo, per_token=(advantages, old_logp),
                loss_mask=completion_mask,
                logits_to_keep=keep, temperature=T, with_entropy=False))),
            *rows,
        ]

    cases = [
        ("logprobs", "trl_fused_head", no_grad(lambda: trl_logprobs(model, ids, mask, keep))),
        ("logprobs", "tplogp", no_grad(lambda: causal_lm_logprobs(
            model, ids, mask, logits_to_keep=keep, temperature=T))),
        *(case for step, name in STEPS for case in loss_cases(step, name)),
    ]
    rows = []
    for step, impl, fn in cases:
        set_checkpointing(model, step.endswith("_ckpt"))
        model.zero_grad(set_to_none=True)
        last.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row = dict(suite="integrations", step=step, impl=impl, model="qwen2", dtype=dtype_name,
                   vocab=shape["vocab_size"], hidden=shape["hidden_size"],
                   layers=shape["num_hidden_layers"], batch=b, seq=s, logits_to_keep=keep,
                   temperature=T, median_ms=None, peak_gib=None,
                   err_logp=errors.get(impl) if step == "logprobs" else None, loss=None,
                   err_loss=None)
        try:
            peak = runner.extra_peak_gib(fn, device)
            value = last.pop("loss").item() if "loss" in last else None  # (that call's)
            ms = runner.median_ms(fn, device, reps=reps, warmup=0 if smoke else 2)
        except torch.OutOfMemoryError:
            row["oom"] = True
        except Exception as error:  # a peer's failure is its row's, not the run's
            if impl != "liger_fused":
                raise
            row["error"] = f"{type(error).__name__}: {error}"[:200]
        else:
            row.update(median_ms=round(ms, 3), peak_gib=None if peak is None else round(peak, 3),
                       loss=value, err_loss=loss_error(value, reference_loss.get(_loss_name(step))))
        rows.append(row)
    set_checkpointing(model, False)
    model.zero_grad(set_to_none=True)
    return rows


def _loss_name(step: str) -> Optional[str]:
    return next((name for s, name in STEPS if s == step), None)


def loss_error(value: Optional[float], reference: Optional[float]) -> Optional[float]:
    """``|value - reference| / |reference|`` (None without both)."""
    if value is None or reference is None:
        return None
    return abs(value - reference) / max(abs(reference), 1e-30)


def format_row(r: dict) -> str:
    if r.get("oom") or r.get("error"):
        what = "out of memory" if r.get("oom") else r["error"].replace("|", "/")
        return f"| {r['step']} | {r['impl']} | {what} | | | |"
    peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
    err = "" if r.get("err_logp") is None else f"{r['err_logp']:.2e}"
    err_loss = "" if r.get("err_loss") is None else f"{r['err_loss']:.2e}"
    return f"| {r['step']} | {r['impl']} | {r['median_ms']:.1f} | {peak} | {err} | {err_loss} |"


TABLE_HEADER = ("| step | implementation | median ms | extra peak GiB | logp rel error vs fp32 "
                "head | loss rel error vs fp32 head |\n|---|---|---:|---:|---:|---:|")


def caption(rows: list[dict], info: dict) -> str:
    """The table's one-line caption: the machine, the versions and the problem."""
    r = rows[0]
    return (f"{info.get('device', '?')}, torch {info.get('torch', '?')}, transformers "
            f"{info.get('transformers', '?')}, trl {info.get('trl', '?')}, tplogp "
            f"{info.get('commit', '?')}: Qwen2 config (vocab {r['vocab']}, hidden {r['hidden']}, "
            f"{r['layers']} layers, random weights), {r['dtype']}, {r['batch']} x {r['seq']} "
            f"tokens, the last {r['logits_to_keep']} scored, temperature {r['temperature']}"
            + (" (smoke shapes)" if r.get("smoke") else "") + ".")


def markdown(rows: list[dict], info: dict) -> str:
    """The block to paste between the ``integrations-benchmark`` markers of docs/integrations.md:
    the caption, a blank line, the table."""
    return "\n".join([caption(rows, info), "", TABLE_HEADER, *map(format_row, rows)]) + "\n"
