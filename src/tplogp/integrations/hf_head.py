"""How :mod:`tplogp.integrations.hf` runs a Hugging Face causal LM with tplogp in place of its
logits: the LM head found (``get_output_embeddings()``, a plain ``torch.nn.Linear``, PEFT's
``modules_to_save`` copies included), the model's config read for a constant logit scale or a
final-logit softcap, the head made to compute tplogp's result for the duration of one forward
(:func:`run`), and every check of :mod:`tplogp.integrations.hf`'s docstring that the returned value
is what the logits path would give."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional

import torch

from ..op.dtensor import is_dtensor


class UnsupportedModelError(ValueError):
    """The model computes its logits in a way this integration does not reproduce exactly; the
    message names the feature."""


@dataclasses.dataclass(frozen=True)
class _LogitScale:
    """The model's forward returns ``head_output * value`` (``multiply``) or
    ``head_output / value``."""

    name: str
    value: float
    multiply: bool

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return t * self.value if self.multiply else t / self.value

    def temperature(self, temperature: float) -> float:
        """The temperature that gives ``log_softmax(scaled logits / temperature)`` from the unscaled
        ones."""
        return temperature / self.value if self.multiply else temperature * self.value


@dataclasses.dataclass(frozen=True)
class Softcap:
    """The model's forward returns ``tanh(head_output / value) * value`` (Gemma 2 / 3's final-logit
    softcapping, in the order of their forward), which the op computes with ``softcap=value``."""

    value: float

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t / self.value) * self.value

    def temperature(self, temperature: float) -> float:
        return temperature

    @property
    def softcap(self) -> float:
        return self.value


def _configs(model) -> list:
    config = getattr(model, "config", None)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config] if text is config else [config, text]


def _check_config(model) -> Optional[_LogitScale]:
    """Refuse what the op cannot compute; the transform the model's forward applies to its logits,
    if any (a :class:`_LogitScale` or a :class:`Softcap`)."""
    scale = None
    for config in _configs(model):
        cap = getattr(config, "final_logit_softcapping", None)
        if cap is not None and scale is None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < float("inf"):
                raise UnsupportedModelError(f"config.final_logit_softcapping={cap!r}: expected a positive number")
            scale = Softcap(float(cap))
        for name, multiply in (("logit_scale", True), ("logits_scaling", False)):
            value = getattr(config, name, None)
            if value is not None and isinstance(scale, Softcap):
                raise UnsupportedModelError(f"config.{name}={value!r} together with final_logit_softcapping: the "
                                            f"order of the two transforms is not known here")
            if value is not None and scale is None:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                    raise UnsupportedModelError(f"config.{name}={value!r}: expected a positive number")
                scale = _LogitScale(name, float(value), multiply)
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        raise UnsupportedModelError(
            f"a prompt-learning adapter ({type(peft_config).__name__}) changes the sequence the model sees; "
            f"only adapters of the layers' weights (LoRA and the like) are supported")
    return scale


def _plain_linear(module) -> bool:
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def _output_heads(model) -> list[torch.nn.Linear]:
    """The linear layers that may compute the model's logits: the LM head
    (``get_output_embeddings()``, through wrappers that hold the model as ``.module``), or, for
    PEFT's ``modules_to_save`` wrapper of the head, its original layer and its trainable copies (the
    wrapper calls one of them and returns its output as is)."""
    target = model
    head = None
    for _ in range(4):
        get = getattr(target, "get_output_embeddings", None)
        head = get() if callable(get) else None
        target = getattr(target, "module", None)
        if head is not None or target is None:
            break
    if head is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no output embeddings (get_output_embeddings() gave None): expected a "
            f"Hugging Face causal LM (a *ForCausalLM model, possibly wrapped by PEFT, DDP or FSDP)")
    copies = getattr(head, "modules_to_save", None)
    original = getattr(head, "original_module", None)
    if isinstance(copies, torch.nn.ModuleDict) and original is not None:
        heads = [original, *copies.values()]
    else:
        heads = [head]
    if not all(_plain_linear(h) for h in heads):
        odd = next(h for h in heads if not _plain_linear(h))
        raise UnsupportedModelError(
            f"the LM head is a {type(odd).__module__}.{type(odd).__qualname__}, expected a plain torch.nn.Linear: "
            f"tplogp reads its weight and bias. An adapter on the LM head (LoRA: W x + B A x) or a quantized or "
            f"custom head is not supported; leave lm_head out of the adapter's target_modules (PEFT's "
            f"modules_to_save=[\"lm_head\"], a trainable copy of the head, is supported)")
    return heads


@contextlib.contextmanager
def _heads_compute(heads: list, compute: Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]):
    """While active, calling any of ``heads`` returns ``compute(that_head, hidden)`` instead of its
    logits (its hooks still run); yields the list of the heads' outputs, after their hooks, with
    their version counters."""
    outputs: list = []

    def record(module, args, output):
        outputs.append((output, output._version if isinstance(output, torch.Tensor) else None))

    def patched(head):
        def forward(hidden, *args, **kwargs):
            if args or kwargs:
                raise UnsupportedModelError(f"the LM head was called with extra arguments {len(args)} / "
                                            f"{sorted(kwargs)}; expected head(hidden_states)")
            return compute(head, hidden)
        return forward

    restore = []
    try:
        for head in heads:
            # accelerate's hooks (device_map) wrap forward and call _old_forward after moving
            # tensors: replace that
            name = "_old_forward" if "_old_forward" in head.__dict__ else "forward"
            restore.append((head, name, head.__dict__.get(name),
                            head.register_forward_hook(record)))
            setattr(head, name, patched(head))
        yield outputs
    finally:
        for head, name, previous, handle in reversed(restore):
            handle.remove()
            if previous is None:
                delattr(head, name)
            else:
                setattr(head, name, previous)


def _model_logits(out):
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)) and out:
        logits = out[0]
    return logits


def run(model, input_ids: torch.Tensor, attention_mask, logits_to_keep: int, make: Callable,
         model_kwargs: dict, expected_shape: tuple):
    """Run ``model``'s forward with its head computing ``make(head, shifted_hidden,
    temperature_scale)``; the result as the model returned it, after the exactness checks, and the
    model's output (its other fields: an MoE model's ``aux_loss``, ...). ``logits_to_keep``: checked
    (:func:`_entry`)."""
    scale = _check_config(model)
    heads = _output_heads(model)
    seq = input_ids.shape[1]

    def compute(head, hidden):
        if hidden.dim() != 3 or hidden.shape[1] != seq:
            raise UnsupportedModelError(
                f"the LM head got hidden states of shape {tuple(hidden.shape)} for input_ids of shape "
                f"{tuple(input_ids.shape)}: expected [batch, {seq}, hidden] (the model changes the sequence "
                f"before its head)")
        shifted = hidden[:, :-1] if logits_to_keep == 0 else hidden[:, seq - logits_to_keep - 1:seq - 1]
        return make(head, shifted, scale)

    model_kwargs.setdefault("use_cache", False)
    with _heads_compute(heads, compute) as outputs:
        out = model(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)
    if len(outputs) != 1:
        raise UnsupportedModelError(f"the LM head ran {len(outputs)} times in the model's forward, expected once "
                                    f"(a model that computes its logits without calling get_output_embeddings(), "
                                    f"or more than once, is not supported)")
    result, version = outputs[0]
    logits = _model_logits(out)
    if scale is None:
        same = logits is result and result._version == version
    else:
        with torch.no_grad():
            same = (isinstance(logits, torch.Tensor) and logits is not result
                    and result._version == version
                    and torch.equal(logits, scale.apply(result)))
    if not same:
        what = ("the head's output, unmodified" if scale is None else
                f"exactly the head's output softcapped by config.final_logit_softcapping={scale.value}"
                if isinstance(scale, Softcap) else f"exactly the head's output scaled by config.{scale.name}")
        raise UnsupportedModelError(
            f"{type(model).__name__}'s forward transforms the LM head's output before returning it as logits "
            f"(expected {what}): tplogp cannot reproduce that transform")
    if is_dtensor(result):
        if not all(p.is_replicate() for p in result.placements):
            raise UnsupportedModelError(f"the LM head's output came back as a DTensor placed {result.placements}; "
                                        f"expected Replicate() (a tensor-parallel plan with output_layouts="
                                        f"Replicate())")
        result = result.to_local()
    if tuple(result.shape) != expected_shape:
        raise UnsupportedModelError(
            f"the LM head's output came back with shape {tuple(result.shape)}, expected {expected_shape}: the "
            f"head's output hooks redistribute it (for a tensor-parallel plan, use "
            f"ColwiseParallel(output_layouts=Replicate()) on the head)")
    return result, out

