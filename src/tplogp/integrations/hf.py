"""Hugging Face causal LMs: token log-probs and a fused RL loss without the
``[batch, sequence, vocab]`` logits.

The logits path, for ``input_ids [B, S]`` and ``k = logits_to_keep``::

    logits = model(input_ids, attention_mask, logits_to_keep=k + 1).logits[:, :-1] / T   # k = 0:
    every position logp = log_softmax(logits)[targets]                    # targets = input_ids[:,
    1:] (k = 0) or input_ids[:, -k:]

holds ``[B, S-1, V]`` logits (and copies of them). Here the model runs its own forward, so every
wrapper, hook, adapter, checkpointing and sharding of the model applies as usual (PEFT, DDP, FSDP2's
unsharding, a tensor-parallel plan's input and output hooks), except that its LM head -- the
``torch.nn.Linear`` that ``get_output_embeddings()`` returns -- computes, for the duration of the
call, tplogp's result from its input (the final hidden states, shifted as above) with its own weight
and bias: ``linear_logp`` (logp, and entropy) or ``linear_logp_loss`` (a scalar). The model returns
that result where it returns its logits.

What is checked, so that a number that differs from the logits path is never returned:

* before the forward: the head is a ``torch.nn.Linear`` that does not override ``forward`` (not a
  LoRA layer, not a quantized linear; PEFT's ``modules_to_save`` wrapper of plain ones is fine); no
  prompt-learning adapter changes the sequence;
* after it: the head ran exactly once, on hidden states of the input's length, and the model
  returned the head's output as its logits, unmodified (the same tensor, its version counter
  unchanged). A model whose forward scales the logits by a constant from its config
  (``logit_scale``: Cohere; ``logits_scaling``: Granite) gets that constant folded into the
  temperature, and its returned logits must equal exactly that scaling of the head's output. A model
  with final-logit softcapping (``config.final_logit_softcapping = c``: Gemma 2 and Gemma 3) returns
  ``c * tanh(head_output / c)``: the op computes it with ``softcap=c`` (then the temperature), and
  the returned logits must equal exactly that transform of the head's output. Any other transform of
  the logits in the model's forward raises :class:`UnsupportedModelError`.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..api import linear_logp_entry, linear_logp_loss_entry
from ..op.dtensor import is_dtensor
from ..outputs import LogpEntropy
from ..op.validation import EntryCheck
from . import require

require("transformers", "tplogp.integrations.hf", "hf")

from .hf_head import Softcap, UnsupportedModelError, run  # noqa: E402  (after require)

# Targets of masked positions (loss_mask == 0) in causal_lm_loss: token ids are never negative.
_MASKED = -100
_FORBIDDEN_MODEL_KWARGS = ("labels", "logits_to_keep", "num_logits_to_keep")


def _entry(input_ids, logits_to_keep, model_kwargs: dict) -> tuple[int, Optional[str]]:
    """The entry point's own checks: ``(logits_to_keep to run the model with, problem or None)``.
    What the model cannot run with raises here (input_ids not ``[B, S]``; model keyword arguments
    the integration sets itself, fixed in the caller's code); a bad ``logits_to_keep`` is a problem
    that travels with the head's op call (:class:`tplogp.op.validation.EntryCheck`), so with a
    tensor-parallel head every rank raises the same error after the model's forward (its
    collectives done on every rank) and none is left waiting."""
    bad = sorted(set(model_kwargs) & set(_FORBIDDEN_MODEL_KWARGS))
    if bad:
        raise TypeError(f"model keyword argument(s) {bad} are not accepted: the integration sets "
                        f"the positions (logits_to_keep) and computes no HF loss (labels)")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(f"input_ids must be a [batch, sequence] tensor, got {got} (a single "
                         f"sequence: input_ids[None])")
    last = input_ids.shape[1] - 1
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) \
            or not 0 <= logits_to_keep <= last:
        return 0, (f"logits_to_keep must be an int in [0, sequence length - 1 = {last}], got "
                   f"{logits_to_keep!r}")
    return logits_to_keep, None


def _softcap(transform) -> Optional[float]:
    """The op's ``softcap`` for the model's logit transform (None: none)."""
    return transform.softcap if isinstance(transform, Softcap) else None


def _targets(input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    return input_ids[:, 1:] if logits_to_keep == 0 else input_ids[:, input_ids.shape[1] - logits_to_keep:]


def _per_token(tensors: Sequence[torch.Tensor], shape: tuple) -> tuple:
    """The per-token tensors at the log-probs' ``shape`` ``[B, k]``: a per-sequence one (``[B]`` or
    ``[B, 1]``, such as GRPO's advantages) expanded along the positions; any other shape is passed
    on as given (and checked there)."""
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and tuple(t.shape) in ((shape[0],), (shape[0], 1)):
            t = t.reshape(shape[0], 1).expand(shape)
        out.append(t)
    return tuple(out)


def _sampler_on(device: torch.device, **params) -> dict:
    """The sampler's parameters given (``top_k``, ``top_p``, ``min_p``), tensors on the head's
    device."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in params.items()
            if v is not None}


def _support_on(support, device: torch.device):
    """The sampler's support (padded tensor or CSR pair) on the head's device; anything else as
    given (the op's checks name it)."""
    if isinstance(support, torch.Tensor):
        return support.to(device)
    if isinstance(support, tuple):
        return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in support)
    return support


def _positions(input_ids: torch.Tensor, logits_to_keep: int) -> int:
    return input_ids.shape[1] - 1 if logits_to_keep == 0 else logits_to_keep


def causal_lm_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    logits_to_keep: int = 0,
    temperature: float = 1.0,
    return_entropy: bool = False,
    workspace_bytes: Optional[int] = None,
    return_model_output: bool = False,
    support=None,
    top_k=None,
    top_p=None,
    min_p=None,
    **model_kwargs,
):
    """Per-token log-probs of ``input_ids[:, 1:]`` under a Hugging Face causal LM, without its
    logits.

    The values of the logits path: ``log_softmax(model(...).logits[:, :-1] / temperature)`` at the
    next tokens, computed by ``linear_logp`` from the final hidden states and the LM head's weight
    and bias (tied or not). Differentiable into every parameter of the model.

    Args:
        model: a ``*ForCausalLM`` model (plain, PEFT-wrapped, DDP/FSDP2-wrapped, tensor-parallel
            with a ``ColwiseParallel(output_layouts=Replicate())`` head or a DTensor head).
        input_ids: ``[B, S]`` token ids; the log-prob of token ``s`` is read at position ``s - 1``.
        attention_mask: ``[B, S]`` as the model takes it (left or right padding). Padded positions
            get the values the logits path gives them (mask them out downstream, as with the
            logits).
        logits_to_keep: 0: every next token, ``[B, S-1]``; ``k > 0``: the last ``k`` tokens,
            ``[B, k]``.
        temperature: the logits are divided by it (a model's own logit scale or final-logit softcap
            is applied first).
        return_entropy: also return the entropy of each position's distribution.
        workspace_bytes: :func:`tplogp.linear_logp`'s memory budget.
        return_model_output: also return the model's output object (its logits field holds the
            head's result; its other fields as the model returns them, e.g. an MoE model's
            ``aux_loss`` with ``output_router_logits=True``).
        support: the sampler's kept ids of each log-prob's position (top-k / top-p replay), as in
            :func:`tplogp.linear_logp`: padded ``[B, positions, K]`` (``-1`` for none) or a CSR
            pair ``(offsets, ids)`` over the flattened ``[B, positions]`` tokens; the log-probs
            (and entropy) are then those renormalized over each position's ids.
        top_k, top_p, min_p: the sampler's parameters, as in :func:`tplogp.linear_logp`: the
            support computed inside as vLLM's sampler keeps its ids (a number, or a tensor of the
            log-probs' shape ``[B, positions]``); not with ``support``.
        model_kwargs: passed to the model's forward (``position_ids``, ...); ``use_cache`` defaults
            to False.

    Returns:
        float32 ``logp``, or ``(logp, entropy)`` (:class:`~tplogp.outputs.LogpEntropy`) with
        ``return_entropy``; with ``return_model_output``, ``(that, model_output)``.

    Raises:
        UnsupportedModelError: the model's logits are not what the LM head computes (a
            LoRA or quantized head, a transform of the logits in the forward; see
            :mod:`tplogp.integrations.hf`).
    """
    keep, problem = _entry(input_ids, logits_to_keep, model_kwargs)
    entry = EntryCheck("causal_lm_logprobs", problem, (("logits_to_keep", logits_to_keep),))
    targets = _targets(input_ids, keep)

    def make(head, hidden, scale):
        t_eff = temperature if scale is None else scale.temperature(temperature)
        out = linear_logp_entry(entry, hidden, head.weight, targets.to(hidden.device), head.bias,
                                temperature=t_eff, softcap=_softcap(scale),
                                return_entropy=return_entropy, workspace_bytes=workspace_bytes,
                                support=_support_on(support, hidden.device),
                                **_sampler_on(hidden.device, top_k=top_k, top_p=top_p,
                                              min_p=min_p))
        # a new tensor, not a view of the op's packed output (FSDP2 warns about a module returning a
        # view)
        return torch.stack(tuple(out), dim=-1) if return_entropy else out.clone()

    shape = (input_ids.shape[0], _positions(input_ids, keep)) + ((2,) if return_entropy else ())
    result, output = run(model, input_ids, attention_mask, keep, make, model_kwargs, shape)
    if return_entropy:
        result = LogpEntropy(result[..., 0], result[..., 1])
    return (result, output) if return_model_output else result


def causal_lm_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    loss: Callable[..., torch.Tensor],
    per_token: Sequence[torch.Tensor] = (),
    loss_mask: Optional[torch.Tensor] = None,
    reduction: str = "sum",
    logits_to_keep: int = 0,
    temperature: float = 1.0,
    workspace_bytes: Optional[int] = None,
    with_entropy: bool = True,
    return_metrics: bool = False,
    return_model_output: bool = False,
    support=None,
    top_k=None,
    top_p=None,
    min_p=None,
    **model_kwargs,
):
    """A per-token RL loss of a Hugging Face causal LM's token log-probs, reduced to a scalar,
    without its logits.

    The positions and values of :func:`causal_lm_logprobs`, fed chunk by chunk to
    :func:`tplogp.linear_logp_loss`: ``loss(logp, entropy, *per_token_chunk)`` gives the per-token
    loss (``tplogp.losses`` has PPO/GRPO clipping, KL to a reference, an entropy bonus),
    ``reduction`` sums it or averages it over the positions that count. The gradients of the LM head
    and of the hidden states are computed in the forward, chunk by chunk (a keep budget sets the
    chunk size); ``loss.backward()`` carries them into every parameter.

    Args:
        loss, per_token: as in :func:`tplogp.linear_logp_loss`; each ``per_token`` tensor is
            ``[B, S-1]`` (or ``[B, logits_to_keep]``), aligned with the log-probs, or one value per
            sequence, ``[B]`` or ``[B, 1]`` (GRPO's advantages), taken for each of its positions.
        loss_mask: ``[B, S-1]`` (or ``[B, logits_to_keep]``), nonzero where a position counts (the
            completion tokens); the others add nothing, count nothing in ``"mean"`` and cost no GEMM
            work. None: all count.
        reduction: ``"sum"`` or ``"mean"`` (over the positions that count); ``"sum"`` for a
            ``losses.grpo(...)`` loss, which normalises itself over the sequences (the rows of
            ``input_ids``) and their counted positions.
        return_metrics: with a ``losses.grpo(...)`` loss, also return its metrics
            (:func:`tplogp.linear_logp_loss`).
        with_entropy: as in :func:`tplogp.linear_logp_loss`: False when ``loss`` does not read the
            entropy (policy gradient, PPO / GRPO clipping, KL): it then gets ``entropy=None`` and
            the forward skips the entropy statistics.
        model, input_ids, attention_mask, logits_to_keep, temperature, workspace_bytes,
        return_model_output, support, top_k, top_p, min_p,
            model_kwargs: as in :func:`causal_lm_logprobs` (positions left out by ``loss_mask``
            need no support).

    Returns:
        a 0-d float32 tensor; with ``return_metrics`` ``(loss, metrics)``; with
        ``return_model_output`` the model's output object after these.
    """
    keep, problem = _entry(input_ids, logits_to_keep, model_kwargs)
    targets = _targets(input_ids, keep)
    per_token = _per_token(per_token, tuple(targets.shape))
    if loss_mask is not None and (not isinstance(loss_mask, torch.Tensor)
                                  or tuple(loss_mask.shape) != tuple(targets.shape)):
        got = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else loss_mask
        problem = problem or (f"loss_mask must be a tensor of shape {tuple(targets.shape)} (the "
                              f"log-probs' shape), got {got}")
        loss_mask = None  # (the call is rejected: the problem travels with the loss's checks)
    if loss_mask is not None:
        targets = torch.where(loss_mask.to(targets.device).bool(), targets, _MASKED)
    entry = EntryCheck("causal_lm_loss", problem, (("logits_to_keep", logits_to_keep),))

    def make(head, hidden, scale):
        ignore = None if loss_mask is None else _MASKED
        t_eff = temperature if scale is None else scale.temperature(temperature)
        mesh, local = None, hidden
        if is_dtensor(hidden):
            # a tensor-parallel plan's input hook made hidden a DTensor replicated over the head's
            # mesh: the loss is computed from the local copy and handed back as a replicated DTensor
            # (what the output hook expects)
            if not all(p.is_replicate() for p in hidden.placements):
                raise UnsupportedModelError(f"the LM head's input is a DTensor placed {hidden.placements}; expected "
                                            f"Replicate() (ColwiseParallel's default input layout)")
            mesh, local = hidden.device_mesh, hidden.to_local()
        value = linear_logp_loss_entry(entry, local, head.weight, targets.to(local.device),
                                       head.bias, loss=loss, per_token=per_token,
                                       reduction=reduction, temperature=t_eff,
                                       softcap=_softcap(scale), ignore_index=ignore,
                                       workspace_bytes=workspace_bytes, with_entropy=with_entropy,
                                       return_metrics=return_metrics,
                                       support=_support_on(support, local.device),
                                       **_sampler_on(local.device, top_k=top_k, top_p=top_p,
                                                     min_p=min_p))
        # the model returns the loss where it returns its logits; the metrics come aside
        if return_metrics:
            value, found = value
            metrics.update(found)
        if mesh is None:
            return value
        from torch.distributed.tensor import DTensor, Replicate

        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)

    metrics: dict = {}
    value, output = run(model, input_ids, attention_mask, keep, make, model_kwargs, ())
    result = (value, metrics) if return_metrics else (value,)
    result = result + (output,) if return_model_output else result
    return result if len(result) > 1 else value


__all__ = ["causal_lm_logprobs", "causal_lm_loss", "UnsupportedModelError"]
