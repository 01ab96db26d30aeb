"""``tplogp.integrations.hf`` against the logits path (``model(...).logits[:, :-1] / T``, log_softmax, gather) on
tiny random models of several families, CPU: values and gradients into every parameter, three-way (no worse than
the fp32 logits path against the same model in float64, the rule of ``tplogp.tolerances``).

Grid, each axis covered on purpose rather than crossed: every family once (tied and untied heads, a head with a
bias, a model-side logit scale), each with one padding side; temperature on all; logits_to_keep, entropy,
checkpointing, LoRA and the fused loss on one or two families; what is refused, once each.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from tplogp import losses
from tplogp.integrations import MissingDependencyError, require
from tplogp.integrations.hf import UnsupportedModelError, causal_lm_logprobs, causal_lm_loss
from tplogp.tolerances import assert_no_worse
from tests.support import tolerances as tol

V, B, S, T = 211, 3, 9, 0.7
_DECODER = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)


def _config(family: str):
    c = transformers
    if family == "llama":
        return c.LlamaConfig(**_DECODER, tie_word_embeddings=False)
    if family == "qwen2":  # tied head, attention biases
        return c.Qwen2Config(**_DECODER, tie_word_embeddings=True)
    if family == "qwen3":
        return c.Qwen3Config(**_DECODER, head_dim=8, tie_word_embeddings=False)
    if family == "mistral":
        return c.MistralConfig(**_DECODER, tie_word_embeddings=False)
    if family == "gemma":  # tied head, scaled embeddings
        return c.GemmaConfig(**_DECODER, head_dim=8, tie_word_embeddings=True)
    if family == "gpt2":  # tied head, Conv1D layers
        return c.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
    if family == "phi":  # an LM head with a bias
        return c.PhiConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0)
    if family == "cohere":  # logits * logit_scale in the forward
        return c.CohereConfig(**_DECODER, logit_scale=0.5)
    if family == "granite":  # logits / logits_scaling in the forward
        return c.GraniteConfig(**_DECODER, logits_scaling=4.0, tie_word_embeddings=False)
    # final-logit softcapping: these random models' logits reach about 0.4, so a cap of 0.3 bends them hard
    if family == "gemma2":
        return c.Gemma2Config(**_DECODER, head_dim=8, final_logit_softcapping=0.3)
    if family == "gemma3":
        return c.Gemma3TextConfig(**_DECODER, head_dim=8, final_logit_softcapping=0.3)
    raise KeyError(family)


def _model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    cls = transformers.GPT2LMHeadModel if family == "gpt2" else transformers.AutoModelForCausalLM
    model = cls(_config(family)) if family == "gpt2" else cls.from_config(_config(family))
    return model.float().eval()


def _batch(padding: str, seed: int = 1):
    """Token ids and an attention mask with rows of 0, 2 and 4 padded positions on the given side."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    for row, pads in enumerate((0, 2, 4)):
        if pads:
            if padding == "left":
                mask[row, :pads] = 0
            else:
                mask[row, S - pads:] = 0
    return ids, mask


def logits_path(model, ids, mask, *, logits_to_keep=0, temperature=T, entropy=False):
    """TRL's computation: the model's logits at the positions that predict the kept tokens, / T, log_softmax."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    logits = logits[:, :-1] if logits_to_keep == 0 else logits[:, S - logits_to_keep - 1:S - 1]
    logsm = torch.log_softmax(logits / temperature, -1)
    targets = ids[:, 1:] if logits_to_keep == 0 else ids[:, S - logits_to_keep:]
    logp = logsm.gather(-1, targets[..., None])[..., 0]
    return (logp, -(logsm.exp() * logsm).sum(-1)) if entropy else logp


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _three_way(fn, model, *args, reference=logits_path, upstream_seed=5, **kwargs):
    """Run ``fn`` (ours) and ``reference`` (the logits path) on model (fp32) and the reference on a float64 copy;
    check the outputs and every parameter's gradient for the same random upstream gradients."""
    truth_model = copy.deepcopy(model).double()
    reference_model = copy.deepcopy(model)
    results = []
    for f, m in ((fn, model), (reference, reference_model), (reference, truth_model)):
        m.zero_grad(set_to_none=True)
        out = f(m, *args, **kwargs)
        outs = tuple(out) if isinstance(out, tuple) else (out,)
        g = torch.Generator().manual_seed(upstream_seed)
        total = sum((o * torch.randn(o.shape, generator=g).to(o.dtype)).sum() for o in outs)
        total.backward()
        results.append(([o.detach() for o in outs], _grads(m)))
    (ours, g_ours), (ref, g_ref), (truth, g_truth) = results
    for i, (o, r, t) in enumerate(zip(ours, ref, truth)):
        assert o.dtype == torch.float32 and o.shape == t.shape
        assert_no_worse(f"output {i}", o, r, t, torch.float32)
    assert set(g_ours) == set(g_truth) and g_ours, "every parameter that the logits path reaches gets a gradient"
    for name in g_truth:
        assert_no_worse(f"grad {name}", g_ours[name], g_ref[name], g_truth[name], torch.float32)


# Every family once, with one padding side each (the two sides alternate over the list).
FAMILIES = [("llama", "left"), ("qwen2", "right"), ("qwen3", "left"), ("mistral", "right"), ("gemma", "left"),
            ("gpt2", "right"), ("phi", "left"), ("cohere", "right"), ("granite", "left"), ("gemma2", "right"),
            ("gemma3", "left")]


@pytest.mark.parametrize("family,padding", FAMILIES, ids=[f"{f}-{p}" for f, p in FAMILIES])
def test_logprobs_match_the_logits_path(family, padding):
    model = _model(family)
    ids, mask = _batch(padding)
    _three_way(causal_lm_logprobs, model, ids, mask, temperature=T)


def test_tied_and_untied_heads_are_what_the_families_say():
    for family, tied in (("qwen2", True), ("gemma", True), ("gpt2", True), ("llama", False), ("phi", False)):
        model = _model(family)
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        assert (head.weight is embed.weight) == tied, family
    assert _model("phi").get_output_embeddings().bias is not None


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_logits_to_keep_and_entropy(family):
    model = _model(family)
    ids, mask = _batch("left")

    def ours(m, *args, **kwargs):
        return tuple(causal_lm_logprobs(m, *args, return_entropy=True, **kwargs))

    def reference(m, *args, **kwargs):
        return logits_path(m, *args, entropy=True, **kwargs)

    _three_way(ours, model, ids, mask, logits_to_keep=4, temperature=1.3, reference=reference)


def test_gradient_checkpointing():
    model = _model("llama").train()
    # transformers >= 5.2x names it activation_checkpointing_enable; earlier versions gradient_checkpointing_enable
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    ids, mask = _batch("right")
    _three_way(causal_lm_logprobs, model, ids, mask, temperature=T)


def _lora(model, **kwargs):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **kwargs)
    return peft.get_peft_model(model, config)


def test_lora_wrapped_model():
    """PEFT's wrapper runs as usual; the adapters' (and only the trainable) parameters get the right gradients."""
    model = _lora(_model("qwen2"), target_modules=["q_proj", "v_proj", "down_proj"])
    ids, mask = _batch("left")
    _three_way(causal_lm_logprobs, model, ids, mask, temperature=T)
    assert any("lora_A" in n for n, p in model.named_parameters() if p.grad is not None)


def test_lora_with_a_trainable_copy_of_the_head():
    """PEFT's modules_to_save=["lm_head"]: the wrapper calls the head's trainable copy, which gets the gradient."""
    model = _lora(_model("llama"), target_modules=["q_proj"], modules_to_save=["lm_head"])
    ids, mask = _batch("right")
    _three_way(causal_lm_logprobs, model, ids, mask, temperature=T)
    trained = [n for n, p in model.named_parameters() if p.grad is not None and "lm_head" in n]
    assert trained and all("modules_to_save" in n for n in trained)


def test_a_head_behind_accelerate_hooks():
    """device_map / offloading wrap the head's forward (accelerate hooks): the hook still runs around the head."""
    hooks = pytest.importorskip("accelerate.hooks")
    calls = []

    class Counting(hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(module)
            return args, kwargs

    model = _model("qwen2")
    hooks.add_hook_to_module(model.lm_head, Counting())
    ids, mask = _batch("left")
    _three_way(causal_lm_logprobs, model, ids, mask, temperature=T)
    assert any(m is model.lm_head for m in calls)  # ours ran through the hook (the copies have theirs)
    assert "_old_forward" in model.lm_head.__dict__ and callable(model.lm_head._old_forward)


def test_refusals_name_the_feature():
    ids, mask = _batch("left")
    with pytest.raises(UnsupportedModelError, match="LoRA"):
        causal_lm_logprobs(_lora(_model("llama"), target_modules=["q_proj", "lm_head"]), ids, mask)
    peft = pytest.importorskip("peft")
    prompt = peft.get_peft_model(_model("llama"), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(UnsupportedModelError, match="prompt-learning"):
        causal_lm_logprobs(prompt, ids, mask)
    with pytest.raises(TypeError, match="labels"):
        causal_lm_logprobs(_model("llama"), ids, mask, labels=ids)
    with pytest.raises(ValueError, match="logits_to_keep"):
        causal_lm_logprobs(_model("llama"), ids, mask, logits_to_keep=S)


class _ScaledLogits(transformers.LlamaForCausalLM):
    """A model whose forward transforms the head's output (out of place, or in place) after the head ran."""

    in_place = False

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self.in_place:
            out.logits.mul_(2.0)
        else:
            out.logits = out.logits * 2.0
        return out


@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_an_unknown_transform_of_the_logits_is_refused(in_place):
    torch.manual_seed(0)
    model = _ScaledLogits(_config("llama")).eval()
    model.in_place = in_place
    ids, mask = _batch("left")
    with pytest.raises(UnsupportedModelError, match="transforms the LM head's output"):
        causal_lm_logprobs(model, ids, mask)
    if not in_place:  # in place, autograd itself refuses to modify the loss's output
        with pytest.raises(UnsupportedModelError, match="transforms the LM head's output"):
            causal_lm_loss(model, ids, mask, loss=losses.entropy_bonus(1.0))
    assert "forward" not in model.lm_head.__dict__  # the head is restored after a refusal


def _grpo_inputs(ids, mask, prompt_len, logits_to_keep, seed=7):
    """Per-sequence advantages on every position, old log-probs near the current ones, the completion mask."""
    g = torch.Generator().manual_seed(seed)
    n = S - 1 if logits_to_keep == 0 else logits_to_keep
    advantages = torch.randn(B, 1, generator=g).expand(B, n).contiguous()
    completion = mask[:, S - n:].clone()
    completion[:, : max(0, prompt_len - (S - n))] = 0
    return advantages, completion


@pytest.mark.parametrize("family,logits_to_keep,with_entropy", [("llama", 0, True), ("phi", 5, False)])
def test_grpo_loss_matches_the_logits_path(family, logits_to_keep, with_entropy):
    """PPO clipping reads no entropy: with ``with_entropy=False`` the forward skips its statistics, same values."""
    model = _model(family)
    ids, mask = _batch("right")
    advantages, completion = _grpo_inputs(ids, mask, prompt_len=3, logits_to_keep=logits_to_keep)
    with torch.no_grad():
        old_logp = logits_path(model, ids, mask, logits_to_keep=logits_to_keep) + 0.1 * torch.randn(
            advantages.shape, generator=torch.Generator().manual_seed(3))
    clip = losses.ppo_clip(0.2, 0.28)

    def ours(m, *args, **kwargs):
        return causal_lm_loss(m, *args, loss=clip, per_token=(advantages, old_logp), loss_mask=completion,
                              reduction="mean", with_entropy=with_entropy, **kwargs)

    def reference(m, *args, **kwargs):
        logp = logits_path(m, *args, **kwargs)
        per_token = clip(logp, None, advantages.to(logp.dtype), old_logp.to(logp.dtype))
        weights = completion.to(logp.dtype)
        return (per_token * weights).sum() / weights.sum()

    _three_way(ours, model, ids, mask, logits_to_keep=logits_to_keep, temperature=T, reference=reference)


def test_per_sequence_tensors_model_output_and_1d_input_ids():
    """A [B] (or [B, 1]) per-token tensor is each sequence's value at all its positions; the model's output
    (an MoE model's router loss) comes back on request; 1-D input_ids get a ValueError naming the shape."""
    config = transformers.MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids, mask = _batch("left")
    advantages = torch.randn(B, generator=torch.Generator().manual_seed(4))
    loss = losses.grpo("grpo", with_old_logp=False)
    expected = causal_lm_loss(model, ids, mask, loss=loss, per_token=(advantages[:, None].expand(B, 4),),
                              logits_to_keep=4)
    for given in (advantages, advantages[:, None]):
        value, output = causal_lm_loss(model, ids, mask, loss=loss, per_token=(given,), logits_to_keep=4,
                                       return_model_output=True, output_router_logits=True)
        torch.testing.assert_close(value, expected, rtol=0, atol=0)
    own = model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False)
    assert isinstance(own.aux_loss, torch.Tensor) and own.aux_loss > 0
    torch.testing.assert_close(output.aux_loss, own.aux_loss, rtol=0, atol=0)
    logp, output = causal_lm_logprobs(model, ids, mask, return_model_output=True, output_router_logits=True)
    torch.testing.assert_close(output.aux_loss, own.aux_loss, rtol=0, atol=0)
    for call in (causal_lm_logprobs, causal_lm_loss):
        kwargs = {} if call is causal_lm_logprobs else dict(loss=loss, per_token=(advantages[:1],))
        with pytest.raises(ValueError, match=r"\[batch, sequence\] tensor, got \(9,\).*input_ids\[None\]"):
            call(model, ids[0], **kwargs)


def test_softcapped_model_loss_with_label_smoothing_and_z_loss():
    """Gemma 2's final-logit softcap in the fused loss, with label smoothing and a z-loss, against F.cross_entropy on
    the model's own (softcapped) logits."""
    model = _model("gemma2")
    ids, mask = _batch("right")  # (left padding gives NaN logits at the float64 copy's padded rows)
    eps, coef = 0.1, 1e-2
    loss = losses.cross_entropy(label_smoothing=eps) + losses.z_loss(coef)

    def ours(m, *args, **kwargs):
        return causal_lm_loss(m, *args, loss=loss, loss_mask=mask[:, 1:], reduction="mean", with_entropy=False,
                              **kwargs)

    def reference(m, ids, mask, *, temperature):
        z = m(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1] / temperature
        targets = torch.where(mask[:, 1:].bool(), ids[:, 1:], -100)
        per_token = F.cross_entropy(z.flatten(0, 1), targets.flatten(), label_smoothing=eps, reduction="none")
        per_token = per_token + coef * torch.logsumexp(z, -1).flatten() ** 2 * (targets.flatten() != -100)
        return per_token.sum() / (targets != -100).sum()

    _three_way(ours, model, ids, mask, temperature=T, reference=reference)


def test_missing_package_is_named(monkeypatch):
    with pytest.raises(MissingDependencyError, match=r"not_a_real_package_name.*\.\[hf\]"):
        require("not_a_real_package_name", "this integration", "hf")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if transformers were not installed
    monkeypatch.delitem(sys.modules, "tplogp.integrations.hf")
    import importlib

    with pytest.raises(MissingDependencyError, match="'transformers'"):
        importlib.import_module("tplogp.integrations.hf")


@pytest.mark.slow
@pytest.mark.tp(world_size=2, timeout=300)
def test_sharded_and_wrapped_models_on_gloo_ranks(tp):
    """The LM head sharded over the vocabulary on 2 ranks, two ways: its weight a DTensor placed Shard(0) (how
    FSDP2 + TP hold it), and a tensor-parallel plan ColwiseParallel(output_layouts=Replicate()) on the head (its
    hooks make the head's input a replicated DTensor); and the model under FSDP2 (per layer and root) and under
    DDP. Values and gradients against the logits path of the same model unsharded, fp32 and float64; the loss
    through the plan too."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import Replicate

    mesh = DeviceMesh.from_group(tp.group, "cpu")
    ids, mask = _batch("left")
    problems = []

    def check(name, fn, model):
        plain = _model("llama")
        reference, truth = copy.deepcopy(plain), copy.deepcopy(plain).double()
        outs = []
        for f, m in ((fn, model), (logits_path, reference), (logits_path, truth)):
            out = f(m, ids, mask, temperature=T)
            (out * torch.linspace(-1, 1, out.numel()).view(out.shape).to(out.dtype)).sum().backward()
            grads = {n.removeprefix("module."): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                     for n, p in m.named_parameters()}
            outs.append((out.detach(), grads))
        try:
            assert_no_worse(f"{name} logp", outs[0][0], outs[1][0], outs[2][0], torch.float32)
            for n in outs[2][1]:
                assert_no_worse(f"{name} grad {n}", outs[0][1][n], outs[1][1][n], outs[2][1][n], torch.float32)
        except AssertionError as exc:
            problems.append(str(exc))

    dtensor_head = _model("llama")
    dtensor_head.lm_head.weight = torch.nn.Parameter(distribute_tensor(dtensor_head.lm_head.weight.detach(), mesh,
                                                                       [Shard(0)]))
    check("DTensor head", causal_lm_logprobs, dtensor_head)

    planned = parallelize_module(_model("llama"), mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    assert isinstance(planned.lm_head.weight, DTensor)
    check("TP plan", causal_lm_logprobs, planned)

    # FSDP2 and DDP over the same 2 ranks, the same batch on both: their averaged gradients are the full ones
    from torch.distributed.fsdp import fully_shard

    fsdp = _model("llama")
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    check("FSDP2", causal_lm_logprobs, fsdp)

    ddp = torch.nn.parallel.DistributedDataParallel(_model("llama"), process_group=tp.group)
    check("DDP", lambda m, *a, **k: causal_lm_logprobs(m, *a, **k), ddp)

    weights = mask[:, 1:].float()

    def loss(m, *args, **kwargs):
        return causal_lm_loss(m, *args, loss=losses.policy_gradient(), per_token=(weights,), **kwargs)

    def loss_reference(m, *args, **kwargs):
        return -(logits_path(m, *args, **kwargs) * weights.to(torch.float64 if m.dtype == torch.float64
                                                                else torch.float32)).sum()

    planned = parallelize_module(_model("llama"), mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    plain = _model("llama")
    truth = copy.deepcopy(plain).double()
    values = [f(m, ids, mask, temperature=T) for f, m in ((loss, planned), (loss_reference, plain),
                                                           (loss_reference, truth))]
    for value in values:
        value.backward()
    grads = [{n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in m.named_parameters()}
             for m in (planned, plain, truth)]
    try:
        assert_no_worse("TP plan loss", *(v.detach() for v in values), torch.float32)
        for n in grads[2]:
            assert_no_worse(f"TP plan loss grad {n}", grads[0][n], grads[1][n], grads[2][n], torch.float32)
    except AssertionError as exc:
        problems.append(str(exc))
    tp.assert_all(not problems, "; ".join(problems))


HF_CASES = {
    "logits-to-keep": (dict(logits_to_keep=S), r"rank 1: logits_to_keep must be an int in \[0, "
                                               r"sequence length - 1 = 8\], got 9"),
    "loss-mask": (dict(loss_mask="short"), r"rank 1: loss_mask must be a tensor of shape \(3, 8\)"),
    "per-token": (dict(per_token="short"), r"rank 1: per_token\[0\] must be a floating-point "
                                           r"tensor of target_ids' shape \(3, 8\)"),
    "reduction": (dict(reduction="avg"), r"rank 1: reduction must be one of \('sum', 'mean'\), "
                                         r"got 'avg'"),
}


@pytest.mark.tp(world_size=2, timeout=300)
@pytest.mark.parametrize("entry", ["causal_lm_loss", "causal_lm_logprobs"])
def test_bad_argument_on_one_rank_raises_on_every_rank(tp, entry):
    """A model whose LM head is a DTensor sharded over the vocabulary on 2 ranks: an entry point's
    argument wrong on rank 1 alone travels with the head's op call, so every rank raises the same
    error after the model's forward (none left in a collective), and the next good call on the group
    runs (each case in turn, one model)."""
    import re

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.support.ranks import agreed_message
    from tplogp import LinearLogpInputError
    from tplogp.tolerances import RUNBOOK_TOLERANCES

    mesh = DeviceMesh.from_group(tp.group, "cpu")
    model = _model("llama")
    sharded = distribute_tensor(model.lm_head.weight.detach(), mesh, [Shard(0)])
    model.lm_head.weight = torch.nn.Parameter(sharded)
    ids, mask = _batch("left")
    weights = mask[:, 1:].float()
    good = dict(temperature=T, logits_to_keep=0)
    if entry == "causal_lm_loss":
        good.update(loss=losses.policy_gradient(), per_token=(weights,), loss_mask=mask[:, 1:],
                    reduction="sum")
    reference = logits_path(_model("llama"), ids, mask, temperature=T).detach()
    if entry == "causal_lm_loss":
        reference = -(reference * weights * mask[:, 1:]).sum()
    call = causal_lm_loss if entry == "causal_lm_loss" else causal_lm_logprobs
    tol = RUNBOOK_TOLERANCES[torch.float32]
    cases = dict(HF_CASES)
    if entry == "causal_lm_logprobs":
        cases = {"logits-to-keep": HF_CASES["logits-to-keep"]}
    for case, (change, expected) in cases.items():
        kw = dict(good)
        if tp.rank == 1:
            kw["logits_to_keep"] = change.get("logits_to_keep", 0)
            if "loss_mask" in change:
                kw["loss_mask"] = mask[:, 2:]
            if "per_token" in change:
                kw["per_token"] = (weights[:, 1:],)
            if "reduction" in change:
                kw["reduction"] = change["reduction"]
        try:
            call(model, ids, mask, **kw)
            outcome = "no error"
        except LinearLogpInputError as exc:
            outcome = str(exc)
        message = agreed_message(tp, outcome)
        assert re.search(rf"^{entry} inputs rejected \(" + expected, message), (case, message)
        value = call(model, ids, mask, **good).detach()
        tp.assert_close(value, reference, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.slow
def test_benchmark_smoke_rows():
    """``python -m benchmarks integrations --smoke``'s measuring function on tiny shapes: every step and
    implementation gives a row, the log-prob step's values agree with the fp32 reference, and within each loss step
    (GRPO, GSPO; with and without checkpointing) the fused loss and tplogp's log-probs with the eager loss give the
    loss of TRL's own fused LM head (fp32 model)."""
    pytest.importorskip("trl")
    from benchmarks import integrations

    rows = integrations.bench(smoke=True, reps=1, dtype_name="fp32")
    loss_steps = ("grpo_loss", "gspo_loss", "grpo_loss_ckpt", "gspo_loss_ckpt")
    assert [(r["step"], r["impl"]) for r in rows] == [("logprobs", "trl_fused_head"), ("logprobs", "tplogp")] + [
        (step, impl) for step in loss_steps for impl in ("trl_fused_head", "tplogp_logprobs", "tplogp_fused")]
    assert all(r["median_ms"] > 0 and r["suite"] == "integrations" for r in rows)
    errors = {r["impl"]: r["err_logp"] for r in rows if r["step"] == "logprobs"}
    assert errors["tplogp"] < tol.ABS_FP32_MODEL_LOGP and errors["trl_fused_head"] < tol.ABS_FP32_MODEL_LOGP
    values = {(r["step"], r["impl"]): r["loss"] for r in rows}
    for step in loss_steps:
        trl = values[step, "trl_fused_head"]
        for impl in ("tplogp_logprobs", "tplogp_fused"):
            assert abs(values[step, impl] - trl) <= tol.GRPO_LOSS.atol + tol.GRPO_LOSS.rtol * abs(trl), (
                step, impl, values[step, impl], trl)
    assert values["grpo_loss", "trl_fused_head"] != values["gspo_loss", "trl_fused_head"]  # two different losses
    assert all((r["err_loss"] is not None) == (r["step"] != "logprobs") for r in rows)
    assert integrations.format_row(rows[0]).count("|") == integrations.TABLE_HEADER.splitlines()[0].count("|")


@pytest.mark.slow
def test_benchmark_smoke_bf16_and_its_markdown():
    """The bf16 smoke run (both heads under bf16 autocast, as GRPOTrainer runs them): against the
    fp32 head on the same hidden states, tplogp's log-probs and losses are the closer (TRL's head
    rounds its logits to bf16), and the block to paste into docs/integrations.md is a caption and
    the table of every row."""
    pytest.importorskip("trl")
    from benchmarks import integrations

    rows = integrations.bench(smoke=True, reps=1, dtype_name="bf16")
    assert not any(r.get("oom") for r in rows)
    errors = {r["impl"]: r["err_logp"] for r in rows if r["step"] == "logprobs"}
    assert errors["tplogp"] <= tol.REL_FP32_SAME_MATH < errors["trl_fused_head"], errors
    loss_errors = {(r["step"], r["impl"]): r["err_loss"] for r in rows if r["step"] != "logprobs"}
    for (step, impl), value in loss_errors.items():
        assert impl == "trl_fused_head" or value < loss_errors[step, "trl_fused_head"], \
            (step, impl, value)
    block = integrations.markdown(rows, {"device": "cpu", "torch": torch.__version__})
    lines = block.splitlines()
    assert lines[0].startswith("cpu, torch") and lines[1] == ""
    assert "\n".join(lines[2:4]) == integrations.TABLE_HEADER
    assert lines[4:] == [integrations.format_row(r) for r in rows]


def _top_k_support(model, ids, mask, k: int, csr: bool):
    """A sampler's kept ids per position: the k largest logits plus the target (padded with -1 where
    the target was among them), or the same ids as a CSR pair over the flattened positions."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
    top = logits.topk(k, dim=-1).indices
    targets = ids[:, 1:, None]
    extra = torch.where((top == targets).any(-1, keepdim=True), -1, targets)
    padded = torch.cat([top, extra], dim=-1)
    if not csr:
        return padded
    flat = padded.reshape(-1, padded.shape[-1])
    counts = (flat >= 0).sum(-1)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return offsets, flat[flat >= 0]


@pytest.mark.parametrize("csr", [False, True], ids=["padded", "csr"])
def test_support_is_the_ops_support_on_the_models_hidden_states(csr):
    """causal_lm_logprobs / causal_lm_loss with support= give what linear_logp / linear_logp_loss
    give with it on the model's final hidden states and head (values and the hidden-state gradient
    path included), and differ from the full-vocabulary values."""
    import tplogp

    model = _model("llama")
    ids, mask = _batch("left")
    support = _top_k_support(model, ids, mask, 5, csr)
    hidden = model(input_ids=ids, attention_mask=mask, use_cache=False,
                   output_hidden_states=True).hidden_states[-1][:, :-1].detach()
    head = model.get_output_embeddings()
    direct = tplogp.linear_logp(hidden, head.weight, ids[:, 1:], temperature=T, return_entropy=True,
                                support=support)
    ours = causal_lm_logprobs(model, ids, mask, temperature=T, return_entropy=True, support=support)
    for o, d in zip(ours, direct):
        torch.testing.assert_close(o, d, rtol=1e-5, atol=1e-5)
    full = causal_lm_logprobs(model, ids, mask, temperature=T)
    assert (ours.logp >= full - 1e-6).all() and (ours.logp > full + 1e-3).any()

    loss_mask = mask[:, 1:]
    pg = lambda logp, entropy, adv: -adv * logp  # noqa: E731
    adv = torch.linspace(-1.0, 1.0, B)
    loss = causal_lm_loss(model, ids, mask, loss=pg, per_token=(adv,), loss_mask=loss_mask,
                          with_entropy=False, temperature=T, support=support)
    expected = (-adv[:, None] * direct.logp * loss_mask).sum()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_sampler_parameters_are_the_ops_on_the_models_hidden_states():
    """causal_lm_logprobs / causal_lm_loss with top_k / top_p give what linear_logp /
    linear_logp_loss give with them on the model's final hidden states and head (per-position
    tensors of the log-probs' shape too)."""
    import tplogp

    model = _model("llama")
    ids, mask = _batch("left")
    hidden = model(input_ids=ids, attention_mask=mask, use_cache=False,
                   output_hidden_states=True).hidden_states[-1][:, :-1].detach()
    head = model.get_output_embeddings()
    top_k = torch.full(ids[:, 1:].shape, 150, dtype=torch.int64)
    top_k[0] = -1  # (the first sequence's filter off)
    for params in (dict(top_k=150, top_p=0.98), dict(top_k=top_k, min_p=0.2)):
        direct = tplogp.linear_logp(hidden, head.weight, ids[:, 1:], temperature=T,
                                    return_entropy=True, **params)
        ours = causal_lm_logprobs(model, ids, mask, temperature=T, return_entropy=True, **params)
        for o, d in zip(ours, direct):
            torch.testing.assert_close(o, d, rtol=1e-5, atol=1e-5)
        loss_mask = mask[:, 1:] * torch.isfinite(direct.logp)  # (targets the filters keep)
        assert loss_mask.sum() >= 10 and torch.isinf(direct.logp).any()
        pg = lambda logp, entropy, adv: -adv * logp  # noqa: E731
        adv = torch.linspace(-1.0, 1.0, B)
        loss = causal_lm_loss(model, ids, mask, loss=pg, per_token=(adv,), loss_mask=loss_mask,
                              with_entropy=False, temperature=T, **params)
        kept = torch.where(loss_mask.bool(), direct.logp, 0.0)
        torch.testing.assert_close(loss, (-adv[:, None] * kept * loss_mask).sum(), rtol=1e-5,
                                   atol=1e-5)
