"""verl's fused-kernel call, ``linear_cross_entropy(hidden, weight, labels, temperature, reduction,
dist_process_group) -> (logprobs, entropy)``, computed by :func:`tplogp.linear_logp`.

A verl user switches by changing one import (``verl.utils.kernel.linear_cross_entropy`` ->
``tplogp.integrations.verl``). The meaning is verl's (0.9.1):

* ``hidden`` ``[..., D]`` is flattened to ``[N, D]`` and ``labels`` to ``[N]`` (the same count);
  both outputs are flat ``[N]`` float32 tensors: ``logprobs[n] = log_softmax(hidden[n] @
  W.T / temperature)[labels[n]]`` over the whole vocabulary and ``entropy[n]`` of that distribution;
  there is no bias and no ignore label (every label is a token id of the vocabulary);
* with ``dist_process_group`` each rank holds the even vocab shard
  ``weight = W[rank * V_local:(rank + 1) * V_local]`` of the ``world * V_local`` vocabulary and the
  same hidden and labels (global ids);
* ``reduction``: ``"none"`` (per token), ``"sum"`` or ``"mean"`` (over the N tokens) of
  ``logprobs``; ``entropy`` stays per token under every reduction (case-insensitive, as verl);
* both outputs are differentiable; ``weight.grad`` is this rank's shard's gradient. With a group,
  verl's backward leaves ``hidden.grad`` partial on each rank and its callers sum it over the group
  (Megatron's sequence-parallel gather does, in its backward). This entry point calls the op with
  ``hidden_grad="partial"``: each rank's ``hidden.grad`` is its shard's share, with no collective,
  as verl's.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..api import linear_logp_entry
from ..op.validation import EntryCheck

REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group: Optional[dist.ProcessGroup] = None,
    *,
    support=None,
    top_k=None,
    top_p=None,
    min_p=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)`` of ``labels`` through ``weight`` with verl's meaning (see the module
    docstring).

    Args:
        hidden: ``[N, D]`` or ``[B, S, D]`` (any leading shape), the weight's dtype.
        weight: ``[V, D]``, or this rank's even shard ``[V / world, D]`` with a group.
        labels: integer global token ids, ``N`` of them (any shape).
        temperature: the logits are divided by it.
        reduction: ``"none"``, ``"sum"`` or ``"mean"`` (of logprobs; entropy is always per token).
        dist_process_group: the group the vocabulary is sharded over, or None.
        support: the sampler's kept GLOBAL ids per token (top-k / top-p replay), as in
            :func:`tplogp.linear_logp`: padded ``labels.shape + (K,)`` (``-1`` for none) or a CSR
            pair ``(offsets, ids)`` over the N tokens; the outputs are then renormalized over them.
        top_k, top_p, min_p: the sampler's parameters instead, as in :func:`tplogp.linear_logp`
            (the support computed inside as vLLM's sampler keeps its ids): a number, or a tensor
            with one value per label (any shape of ``labels``' size).

    Returns:
        float32 ``logprobs`` (``[N]``, or 0-d with ``"sum"`` / ``"mean"``) and ``entropy`` ``[N]``.
    """
    # verl's own checks travel with the op's: with a group every rank raises the same error (none is
    # left waiting)
    problem = None
    if not isinstance(reduction, str) or reduction.lower() not in REDUCTIONS:
        problem, reduction = f"reduction must be one of {REDUCTIONS}, got {reduction!r}", "none"
    reduction = reduction.lower()
    flat_hidden, flat_labels = hidden, labels
    tensors = all(isinstance(t, torch.Tensor) for t in (hidden, weight, labels))
    if tensors and (hidden.dim() < 2 or weight.dim() != 2):
        problem = problem or (f"expected hidden [..., D] and weight [V, D], got hidden "
                              f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}")
    elif tensors:
        flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        if flat_labels.numel() != flat_hidden.shape[0]:
            problem = problem or (f"labels must hold one id per token of hidden: "
                                  f"{flat_hidden.shape[0]} tokens (hidden {tuple(hidden.shape)}), "
                                  f"got labels {tuple(labels.shape)}")
            # (the call is rejected: the problem above)
            flat_labels = labels.new_zeros(flat_hidden.shape[0])
        if isinstance(support, torch.Tensor) and support.dim() == labels.dim() + 1:
            support = support.reshape(-1, support.shape[-1])  # (other shapes: the op names them)
    sampler = {name: value.reshape(-1) if isinstance(value, torch.Tensor) and tensors
               and value.shape == labels.shape else value
               for name, value in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p))
               if value is not None}  # (per-label tensors flattened with the labels)
    # (not a tensor: the op's checks name it; a temperature that is not a positive finite number:
    # the op's too)
    world = 1 if dist_process_group is None else dist.get_world_size(dist_process_group)
    group_kwargs: dict[str, Any] = {}
    if world > 1:
        local = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 0
        group_kwargs = dict(tp_group=dist_process_group,
                            vocab_start_index=dist.get_rank(dist_process_group) * local,
                            global_vocab_size=world * local if local else None,
                            hidden_grad="partial")
    entry = EntryCheck("linear_cross_entropy", problem, (("reduction", reduction),))
    logprobs, entropy = linear_logp_entry(entry, flat_hidden, weight, flat_labels,
                                          temperature=temperature, return_entropy=True,
                                          support=support, **sampler, **group_kwargs)
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.sum() / flat_labels.numel()
    return logprobs, entropy


__all__ = ["linear_cross_entropy", "REDUCTIONS"]
