"""``linear_logp_loss``: a per-token loss of (logp, entropy) reduced to a scalar, its gradients
computed in the forward chunk by chunk and scaled in the backward (the scheme of fused linear
cross-entropy).

Per chunk of tokens (the same chunks on every rank, :func:`tplogp.budgets.plan_chunk_tokens`):

1. :func:`tplogp.op.tp.shard_forward` gives fp32 logp and entropy (with a group: the stats'
   all_gather and merge), and the lse and ``sum_v z`` that a :class:`~tplogp.losses.TokenLoss` may
   read (:class:`~tplogp.losses.TokenStats`);
2. the loss gives the per-token upstream gradients ``g_logp`` / ``g_entropy`` (and
   ``g_lse`` / ``g_sum_z``): closed form for a :class:`~tplogp.losses.TokenLoss`, autograd on the
   chunk for any other callable;
3. the source's backward gives the chunk's fp32 ``d_hidden`` rows and adds its ``d_W`` / ``d_b`` to
   fp32 accumulators (one chunk's are written directly in the weight / bias dtype).

A chunk is as many tokens as the kept part of ``workspace_bytes`` holds softmax terms of, so its
backward reads them instead of recomputing (3 GEMMs instead of 4). ONE all_reduce completes
``d_hidden``, issued as soon as the last chunk's rows are done, under that chunk's ``d_W`` work (a
reduce-scatter of a sequence-parallel hidden, which the chunks see gathered:
:func:`tplogp.op.local_call.localize`; none with ``hidden_grad="partial"``). The autograd node's
backward scales the gradients by the upstream scalar, the fp32 product rounded once
(:mod:`tplogp.fused_loss.grad_scaling`). Per-token tensors are constants
(:mod:`tplogp.fused_loss.chunk_gradients` holds this loop, the chunk plan and the gradients'
assembly; this module the entry, the checks and plan, and the autograd node). A
``losses.grpo(...)`` loss runs the same loop, on chunks of whole sequences when it has sequence sums
(:mod:`tplogp.fused_loss.policy_loss`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..losses.grpo_family import GRPOLoss, finish_metrics
from ..losses.terms import TokenLoss
from ..op import local_call, plan, tp, validation
from . import chunk_gradients
from .grad_scaling import scaled_all
from .policy_loss import policy_loss_and_grads


class _PrecomputedGrads(torch.autograd.Function):
    """The loss as a function of (hidden, weight, bias) whose gradients were computed in the
    forward; the backward scales each by the upstream scalar. Without a retained graph the gradients
    leave with this backward (scaled in place where the dtype allows, adopted by autograd without a
    copy)."""

    @staticmethod
    def forward(ctx, loss, grads, verdict, hidden, weight, bias):
        # the call's verdict, settled before any gradient is handed over
        ctx.grads, ctx.verdict = grads, verdict
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, g):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("linear_logp_loss: a second backward through a loss whose first backward did not "
                               "retain the graph (its gradients were handed over then); pass retain_graph=True to "
                               "the first backward to run another")
        in_place = not tp.graph_retained()
        if in_place:
            # no reference left here: AccumulateGrad adopts the scaled tensors instead of copying
            ctx.grads = None
        scaled = scaled_all(grads, g, ctx.dtypes, in_place)
        del grads
        # after the scaling's launches; raises, or zeroes a captured call's gradients
        if ctx.verdict is not None:
            scaled = ctx.verdict.settle(scaled)
        return (None, None, None) + tuple(scaled)


def fused_loss(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index: int,
               global_vocab_size: Optional[int], *, return_metrics: bool = False, **kwargs):
    """See :func:`tplogp.linear_logp_loss` (``source``: a name, or None for the registry's choice;
    ``kwargs``: the keyword arguments of :func:`loss_and_grads` but ``needs``). The chunk loop runs
    without autograd (only a callable loss runs under it); the result carries the gradients, and
    with ``return_metrics`` comes with the metrics of a
    :class:`~tplogp.losses.grpo_family.GRPOLoss`."""
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and isinstance(t, torch.Tensor)
                  and t.requires_grad for t in (hidden, weight, bias))
    total, grads, verdict, sums = loss_and_grads(source, hidden, weight, target_ids, bias, tp_group,
                                                 vocab_start_index, global_vocab_size, needs=needs,
                                                 return_metrics=return_metrics, **kwargs)
    if any(needs):
        total = _PrecomputedGrads.apply(total, grads, verdict, hidden, weight, bias)
    if not return_metrics:
        return total
    loss = kwargs["loss"]
    return total, finish_metrics(sums, total.device, bool(loss.config.beta),
                                 kwargs.get("with_entropy", True))


def loss_and_grads(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index: int,
                   global_vocab_size: Optional[int], *, loss, per_token: Sequence[torch.Tensor],
                   reduction: str, needs: tuple[bool, bool, bool], with_entropy: bool = True,
                   cu_seqlens=None, return_metrics: bool = False, entry=None, **options):
    """The fused loss's value and the unscaled gradients ``needs`` asks for, computed chunk by chunk
    (module docstring): ``(loss, (d_hidden, d_weight, d_bias), the call's verdict, metric
    sums | None)``, what :func:`fused_loss` and the compiled op (:mod:`tplogp.op.ops`) hand to
    autograd. ``entry``: the checks of an integration's entry point
    (:class:`tplogp.op.validation.EntryCheck`), raised with the loss's. ``options``: the fused
    loss's :class:`~tplogp.op.options.LogpOptions` (those of ``linear_logp_loss``'s schema,
    :func:`tplogp.op.options.names_of`)."""
    # the loss's own arguments, checked with the op's (the same error on every rank of a group,
    # before any collective)
    check = validation.check_loss(loss, per_token, reduction, with_entropy, cu_seqlens,
                                  return_metrics, target_ids, entry)
    policy = isinstance(loss, GRPOLoss)
    options = plan.LogpOptions(return_entropy=with_entropy,
                               with_sum_z=isinstance(loss, TokenLoss) and check.problem is None
                               and "sum_z" in loss.reads, **options)
    # the d_hidden collective runs iff needs[0]: the group's record makes every rank agree on it (no
    # hang)
    call = plan.prepare(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                        global_vocab_size, options, needs[0], check)
    offsets = check.offsets
    sums = None
    with torch.no_grad():
        local = local_call.localize(call)
        if policy:
            total, grads, sums = policy_loss_and_grads(local, loss, per_token, needs,
                                                       target_ids.numel(),
                                                        hidden.shape, target_ids.shape, offsets,
                                                        return_metrics)
        else:
            total, grads = chunk_gradients.token_loss_and_grads(local, loss, per_token, reduction,
                                                                needs, target_ids.numel(),
                                                                hidden.shape)
    return total, grads, call.verdict, sums

