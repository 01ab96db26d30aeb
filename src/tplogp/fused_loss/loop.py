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
(:mod:`tplogp.fused_loss.chunk_gradients` holds the chunk plan and the gradients' assembly). A
``losses.grpo(...)`` loss runs the same loop, on chunks of whole sequences when it has sequence sums
(:mod:`tplogp.fused_loss.policy_loss`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..op import local_call, plan, tp, validation
from ..support import tensors
from .chunk_gradients import ChunkGradients, chunk_part, per_token_rows, plan_chunks
from .grad_scaling import scaled_all
from ..losses.terms import Derivative, TokenLoss, TokenStats
from .policy_loss import policy_loss_and_grads
from ..losses.grpo_family import GRPOLoss, finish_metrics
from ..support.tensors import f32_contiguous, zero_rows


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
            total, grads = _loss_and_grads(local, loss, per_token, reduction, needs,
                                           target_ids.numel(), hidden.shape)
    return total, grads, call.verdict, sums

def _loss_and_grads(local: local_call.LocalCall, loss, per_token, reduction: str,
                    needs: tuple[bool, bool, bool], n_all: int, hidden_shape):
    """``(loss, (d_hidden, d_W, d_b))`` of a local call, chunk by chunk (module docstring);
    ``needs``: the gradients to compute (none: the loss value alone)."""
    h2, local_target, tpc, ignored = local.hidden, local.local_target, local.tpc, \
        local.ignored  # (ignored rows kept in place, a CUDA-graph capture: masked out of the loss)
    extra = per_token_rows(per_token, n_all, h2.device, local.keep_idx)
    n = h2.shape[0]
    differentiate = any(needs)
    chunk = plan_chunks(local, needs)
    # one backward per chunk's forward: it may write d_logits over the chunk's kept terms
    if differentiate:
        tpc.call = tpc.call.precomputing
    count = None if reduction != "mean" else (
        float(max(n, 1)) if ignored is None else (~ignored).sum().clamp_min(1).to(torch.float32))
    n_chunks = -(-n // chunk) if n else 0
    grads = ChunkGradients(local, needs, n, n_chunks) if differentiate else None
    total = torch.zeros((), device=h2.device, dtype=torch.float32) if n == 0 else None
    w, b = local.weight, local.bias
    for t0 in range(0, n, chunk):
        t1 = min(t0 + chunk, n)
        whole = t1 - t0 == n  # one chunk: the call's tensors themselves (no slicing ops: host time)
        h_c, lt_c = (h2, local_target) if whole else (h2[t0:t1], local_target[t0:t1])
        pt = extra if whole else [t[t0:t1] for t in extra]
        skip = None if ignored is None else ignored if whole else ignored[t0:t1]
        (logp, entropy, lse, _, sum_z), (row_max, log_sum, mean_rel, kept) = tp.shard_forward(h_c, w, b, lt_c, tpc)
        # no NaN of a row nobody owns reaches the loss callable (nor its gradient)
        if skip is not None:
            logp, entropy = zero_rows(skip, logp), None if entropy is None else zero_rows(skip,
                                                                                          entropy)
        reads_stats = isinstance(loss, TokenLoss) and bool(loss.reads)
        stats = TokenStats(lse, sum_z, local.vocab_size) if reads_stats else None
        if not differentiate:
            value = loss(logp, entropy, *pt, stats=stats) if reads_stats else loss(logp, entropy,
                                                                                   *pt)
            part = chunk_part(zero_rows(skip, value), count)
            total = part if total is None else total + part
            continue
        part = None  # a linear loss's: from its upstream gradients, once the backward is launched
        g_lse = g_sum_z = None
        if isinstance(loss, TokenLoss):  # closed-form derivatives: no autograd engine run per chunk
            if loss.linear:
                d_logp, d_ent = loss.coefficients(*pt)
            else:
                value, d_logp, d_ent = loss.value_and_derivatives(logp, entropy, *pt, stats=stats)
                part = chunk_part(zero_rows(skip, value), count)
            g_logp = _token_grads(d_logp, t1 - t0, h2.device, skip, count=count)
            g_ent = None if entropy is None else _token_grads(d_ent, t1 - t0, h2.device, skip,
                                                              count=count)
            # d loss / d lse and d loss / d sum_z: the sources' grad_lse and grad_sum_z
            if reads_stats:
                d_lse, d_sum_z = loss.stat_derivatives(stats, *pt)
                g_lse = _token_grads(d_lse, t1 - t0, h2.device, skip, count=count)
                g_sum_z = _token_grads(d_sum_z, t1 - t0, h2.device, skip, count=count)
        else:
            logp = logp.detach().requires_grad_()
            entropy = None if entropy is None else entropy.detach().requires_grad_()
            with torch.enable_grad():
                part = chunk_part(zero_rows(skip, loss(logp, entropy, *pt)), count)
                g_logp, *g_rest = torch.autograd.grad(part,
                                                      [logp] if entropy is None else [logp, entropy], allow_unused=True)
            g_ent, part = (g_rest[0] if g_rest else None), part.detach()
        linear = (g_logp, logp, g_ent, entropy) if part is None else None
        g_logp = torch.zeros_like(logp) if g_logp is None else g_logp
        grads.backward(t0, t1, h_c, lt_c, row_max, log_sum, mean_rel, g_logp, g_ent, kept, g_lse,
                       g_sum_z)
        del kept  # one chunk's kept logits at a time
        # (queued behind the backward's kernels)
        part = _linear_total(*linear) if linear is not None else part
        total = part if total is None else total + part
    return total, (grads.finish(n_all, hidden_shape) if differentiate else (None, None, None))


def _token_grads(d: Derivative, n: int, device: torch.device, skip: Optional[torch.Tensor],
                 upstream: Optional[torch.Tensor] = None, count=None) -> Optional[torch.Tensor]:
    """The upstream gradient of one per-token input of a loss, ``d * upstream / count``
    (``upstream``: the 0-d gradient of the reduced loss, None for 1; ``count``: the mean's divisor,
    a number or a 0-d tensor, None for a sum), as a contiguous fp32 ``[n]`` tensor, 0 at the
    ``skip`` rows; None when the loss does not depend on that input. ``d``: a
    :data:`~tplogp.losses.Derivative`. One op in the common cases (host time at small shapes)."""
    if d is None:
        return None
    if isinstance(count, torch.Tensor):  # ignored rows kept in place: the count is on the device
        upstream, count = (1.0 if upstream is None else upstream) / count, None
    factor = 1.0 if count is None else 1.0 / count
    if upstream is None:
        g = d * factor if isinstance(d, torch.Tensor) else _constant_vector(n, d * factor, device)
    elif isinstance(d, torch.Tensor):
        g = d * upstream if factor == 1.0 else torch.mul(d, upstream).mul_(factor)
    else:  # a constant derivative: the upstream scalar broadcast, one op
        g = torch.mul(upstream.expand(n), d * factor)
    return f32_contiguous(zero_rows(skip, g))


# Read-only fp32 vectors of one value (a constant derivative over the mean's count), by (n, value,
# device): made once, then no op per call (host time at small shapes). Never written: every consumer
# reads them or makes a new tensor. At most _MAX_CONSTANTS (the oldest dropped first).
_CONSTANTS: dict[tuple, torch.Tensor] = {}
_MAX_CONSTANTS = 32


def _constant_vector(n: int, value: float, device: torch.device) -> torch.Tensor:
    """A read-only fp32 ``[n]`` tensor of ``value`` on ``device``, cached outside CUDA-graph
    captures. A capture gets a new one (in the graph's memory pool): a cached one could be dropped
    while a graph still reads it."""
    if tensors.is_capturing(device):
        return torch.full((n,), value, device=device, dtype=torch.float32)
    key = (n, value, device)
    vec = _CONSTANTS.get(key)
    if vec is None:
        if len(_CONSTANTS) >= _MAX_CONSTANTS:
            del _CONSTANTS[next(iter(_CONSTANTS))]
        vec = _CONSTANTS[key] = torch.full((n,), value, device=device, dtype=torch.float32)
    return vec


def _linear_total(g_logp: Optional[torch.Tensor], logp: torch.Tensor,
                  g_entropy: Optional[torch.Tensor],
                  entropy: Optional[torch.Tensor]) -> torch.Tensor:
    """The reduced value of a :attr:`~tplogp.losses.TokenLoss.linear` loss from its upstream
    gradients (the coefficients over the mean's count, 0 at skipped rows):
    ``g_logp . logp + g_entropy . entropy``, one op per term (the rows' losses need not be
    formed)."""
    total = None if g_logp is None else torch.dot(g_logp, logp)
    if g_entropy is not None:
        part = torch.dot(g_entropy, entropy)
        total = part if total is None else total + part
    return total if total is not None else logp.new_zeros(())
