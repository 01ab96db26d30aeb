"""``linear_logp_loss``: a per-token loss of (logp, entropy) reduced to a scalar, its gradients computed in the
forward chunk by chunk and scaled in the backward (the scheme of fused linear cross-entropy).

Per chunk of tokens (the same chunks on every rank, :func:`tplogp.budgets.plan_chunk_tokens`):

1. :func:`tplogp.tp.shard_forward` gives fp32 logp and entropy (with a group: the stats' all_gather and merge);
2. the loss gives the per-token upstream gradients ``g_logp`` / ``g_entropy``: closed form for a
   :class:`~tplogp.losses.TokenLoss`, autograd on the chunk for any other callable;
3. the source's backward gives the chunk's fp32 ``d_hidden`` rows and adds its ``d_W`` / ``d_b`` to fp32
   accumulators (one chunk's are written directly in the weight / bias dtype).

A chunk is as many tokens as the kept part of ``workspace_bytes`` holds softmax terms of, so its backward reads
them instead of recomputing (3 GEMMs instead of 4). ONE all_reduce completes ``d_hidden``, issued as soon as the
last chunk's rows are done, under that chunk's ``d_W`` work. The autograd node's backward scales the gradients by
the upstream scalar, the fp32 product rounded once (:mod:`tplogp.grad_scaling`). Per-token tensors are constants.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import plan, tensors, tp
from .budgets import accumulator_tokens, plan_chunk_tokens
from .comm import OverlappedAllReduce
from .grad_scaling import scaled_all
from .losses import Derivative, TokenLoss
from .tensors import f32_contiguous, zero_rows

REDUCTIONS = ("sum", "mean")


class _PrecomputedGrads(torch.autograd.Function):
    """The loss as a function of (hidden, weight, bias) whose gradients were computed in the forward; the backward
    scales each by the upstream scalar. Without a retained graph the gradients leave with this backward (scaled in
    place where the dtype allows, adopted by autograd without a copy)."""

    @staticmethod
    def forward(ctx, loss, grads, verdict, hidden, weight, bias):
        ctx.grads, ctx.verdict = grads, verdict  # the call's verdict, settled before any gradient is handed over
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
            ctx.grads = None  # no reference left here: AccumulateGrad adopts the scaled tensors instead of copying
        scaled = scaled_all(grads, g, ctx.dtypes, in_place)
        del grads
        if ctx.verdict is not None:  # after the scaling's launches; raises, or zeroes a captured call's gradients
            scaled = ctx.verdict.settle(scaled)
        return (None, None, None) + tuple(scaled)


def fused_loss(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index: int,
               global_vocab_size: Optional[int], *, loss, per_token: Sequence[torch.Tensor], reduction: str,
               temperature: float, ignore_index: Optional[int], deterministic, workspace_bytes: Optional[int],
               with_entropy: bool = True) -> torch.Tensor:
    """See :func:`tplogp.linear_logp_loss` (``source``: a name, or None for the registry's choice). The chunk loop
    runs without autograd (only a callable loss runs under it); the result carries the gradients."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    _check_token_loss(loss, per_token, with_entropy)
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and isinstance(t, torch.Tensor) and t.requires_grad for t in (hidden, weight, bias))
    options = plan.LogpOptions(temperature=temperature, return_entropy=with_entropy, ignore_index=ignore_index,
                               deterministic=deterministic, workspace_bytes=workspace_bytes)
    # the d_hidden all-reduce runs iff needs[0]: the group's record makes every rank agree on it (no hang)
    call = plan.prepare(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
                        options, needs[0])
    with torch.no_grad():
        total, grads = _loss_and_grads(tp.localize(call), loss, per_token, reduction, needs, target_ids.numel(),
                                       hidden.shape)
    if not any(needs):
        return total
    return _PrecomputedGrads.apply(total, grads, call.verdict, hidden, weight, bias)


def _loss_and_grads(local: tp.LocalCall, loss, per_token, reduction: str, needs: tuple[bool, bool, bool],
                    n_all: int, hidden_shape):
    """``(loss, (d_hidden, d_W, d_b))`` of a local call, chunk by chunk (module docstring); ``needs``: the
    gradients to compute (none: the loss value alone)."""
    h2, w, b, local_target, tpc, ignored = local.hidden, local.weight, local.bias, local.local_target, local.tpc, \
        local.ignored  # (ignored rows kept in place, a CUDA-graph capture: masked out of the loss)
    extra = _per_token_rows(per_token, n_all, h2.device, local.keep_idx)
    n, d = h2.shape
    differentiate = any(needs)
    # from what requires a gradient, not from grad mode: a call without gradients sums the same chunks
    accumulators = accumulator_tokens(d, w.dtype if needs[1] else None, b.dtype if needs[2] else None)
    chunk = plan_chunk_tokens(tpc.backend, n, local.vocab_size, tpc.call.workspace_bytes, h2.device, accumulators,
                              h2.dtype)
    if differentiate:  # one backward per chunk's forward: it may write d_logits over the chunk's kept terms
        tpc.call = tpc.call.precomputing
    count = None if reduction != "mean" else (
        float(max(n, 1)) if ignored is None else (~ignored).sum().clamp_min(1).to(torch.float32))
    n_chunks = -(-n // chunk) if n else 0
    reduce = OverlappedAllReduce(tpc.group, tpc.comm_device) if tpc.world_size > 1 and needs[0] else None
    # one chunk without a group: its d_hidden is the source's (no [N, D] buffer to fill)
    d_hidden = (torch.zeros(n, d, device=h2.device, dtype=torch.float32)
                if needs[0] and (n_chunks > 1 or reduce is not None) else None)
    accumulate = None  # several chunks: d_W and d_b summed unrounded in fp32, rounded once at the end
    if n_chunks > 1 and (needs[1] or needs[2]):
        accumulate = (torch.zeros(w.shape, device=w.device, dtype=torch.float32) if needs[1] else None,
                      torch.zeros(b.shape, device=b.device, dtype=torch.float32) if needs[2] else None)
    total = torch.zeros((), device=h2.device, dtype=torch.float32) if n == 0 else None
    d_w = torch.zeros_like(w) if n == 0 and needs[1] else None
    d_b = torch.zeros_like(b) if n == 0 and needs[2] else None
    if n == 0 and needs[0]:
        d_hidden = h2.new_zeros(n, d, dtype=torch.float32)
    for t0 in range(0, n, chunk):
        t1 = min(t0 + chunk, n)
        whole = t1 - t0 == n  # one chunk: the call's tensors themselves (no slicing ops: host time)
        h_c, lt_c = (h2, local_target) if whole else (h2[t0:t1], local_target[t0:t1])
        pt = extra if whole else [t[t0:t1] for t in extra]
        skip = None if ignored is None else ignored if whole else ignored[t0:t1]
        (logp, entropy, _), (row_max, log_sum, mean_rel, kept) = tp.shard_forward(h_c, w, b, lt_c, tpc)
        if skip is not None:  # no NaN of a row nobody owns reaches the loss callable (nor its gradient)
            logp, entropy = zero_rows(skip, logp), None if entropy is None else zero_rows(skip, entropy)
        if not differentiate:
            part = _chunk_part(zero_rows(skip, loss(logp, entropy, *pt)), count)
            total = part if total is None else total + part
            continue
        part = None  # a linear loss's: from its upstream gradients, once the backward is launched
        if isinstance(loss, TokenLoss):  # closed-form derivatives: no autograd engine run per chunk
            if loss.linear:
                d_logp, d_ent = loss.coefficients(*pt)
            else:
                value, d_logp, d_ent = loss.value_and_derivatives(logp, entropy, *pt)
                part = _chunk_part(zero_rows(skip, value), count)
            g_logp = _token_grads(d_logp, t1 - t0, h2.device, skip, count=count)
            g_ent = None if entropy is None else _token_grads(d_ent, t1 - t0, h2.device, skip, count=count)
        else:
            logp = logp.detach().requires_grad_()
            entropy = None if entropy is None else entropy.detach().requires_grad_()
            with torch.enable_grad():
                part = _chunk_part(zero_rows(skip, loss(logp, entropy, *pt)), count)
                g_logp, *g_rest = torch.autograd.grad(part, [logp] if entropy is None else [logp, entropy],
                                                      allow_unused=True)
            g_ent, part = (g_rest[0] if g_rest else None), part.detach()
        linear = (g_logp, logp, g_ent, entropy) if part is None else None
        g_logp = torch.zeros_like(logp) if g_logp is None else g_logp
        ready = None
        if reduce is not None and t1 == n:  # the last chunk completes d_hidden: reduce it under that chunk's d_W

            def ready(rows, t0=t0, t1=t1):
                d_hidden[t0:t1] = rows
                reduce.start(d_hidden)

        grads = tpc.backend.backward(h_c, w, b, lt_c, row_max, log_sum, g_logp.contiguous(),
                                     None if g_ent is None else g_ent.contiguous(), None,
                                     mean_rel if g_ent is not None else None, tpc.call, needs, d_hidden_ready=ready,
                                     kept=kept, accumulate=accumulate)
        del kept  # one chunk's kept logits at a time
        part = _linear_total(*linear) if linear is not None else part  # (queued behind the backward's kernels)
        total = part if total is None else total + part
        if d_hidden is not None and not (ready is not None and reduce.started):
            d_hidden[t0:t1] = grads.d_hidden
        elif needs[0] and d_hidden is None:  # the one chunk
            d_hidden = grads.d_hidden
        d_w, d_b = grads.d_weight, grads.d_bias
    if d_hidden is not None:  # fp32: rounded once, after the upstream scale
        if reduce is not None:  # the one all_reduce of d_hidden (started by the last chunk's backward)
            d_hidden = reduce.finish(d_hidden)
        d_hidden = local.finish_rows(d_hidden, n_all)
        d_hidden = d_hidden if d_hidden.shape == hidden_shape else d_hidden.view(hidden_shape)
    if tpc.regrid is not None:  # the invariant level: d_W / d_b of the grid's rows back to the shard's rows
        d_w, d_b = tpc.regrid.grads_back(d_w, d_b)
    return total, (d_hidden, d_w, d_b)


def _chunk_part(per_token_loss: torch.Tensor, count) -> torch.Tensor:
    """One chunk's share of the call's loss: its per-token losses' sum, over the call's ``count`` for ``"mean"``."""
    return per_token_loss.sum() if count is None else per_token_loss.sum() / count


def _per_token_rows(per_token: Sequence[torch.Tensor], n_all: int, device: torch.device,
                    keep_idx: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """The per-token tensors as fp32 constants of the call's rows (those ``keep_idx`` kept, when compacted)."""
    extra = []
    for i, t in enumerate(per_token):
        if not isinstance(t, torch.Tensor) or t.numel() != n_all:
            raise ValueError(f"per_token[{i}] must be a tensor with target_ids' {n_all} elements, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        t = t.detach().reshape(-1).to(device=device, dtype=torch.float32)
        extra.append(t if keep_idx is None else t.index_select(0, keep_idx))
    return extra


def _check_token_loss(loss, per_token: Sequence, with_entropy: bool) -> None:
    """A :class:`~tplogp.losses.TokenLoss` gets the per-token tensors it names, and the entropy when it reads it:
    a clear error before any work otherwise (the same on every rank: the arguments are)."""
    if not isinstance(loss, TokenLoss):
        return
    loss.check_arity(len(per_token))
    if loss.reads_entropy and not with_entropy:
        raise ValueError(f"the loss {loss.name} reads the entropy: call with with_entropy=True")


def _token_grads(d: Derivative, n: int, device: torch.device, skip: Optional[torch.Tensor],
                 upstream: Optional[torch.Tensor] = None, count=None) -> Optional[torch.Tensor]:
    """The upstream gradient of one per-token input of a loss, ``d * upstream / count`` (``upstream``: the 0-d
    gradient of the reduced loss, None for 1; ``count``: the mean's divisor, a number or a 0-d tensor, None for a
    sum), as a contiguous fp32 ``[n]`` tensor, 0 at the ``skip`` rows; None when the loss does not depend on that
    input. ``d``: a :data:`~tplogp.losses.Derivative`. One op in the common cases (host time at small shapes)."""
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


# Read-only fp32 vectors of one value (a constant derivative over the mean's count), by (n, value, device): made once,
# then no op per call (host time at small shapes). Never written: every consumer reads them or makes a new tensor.
# At most _MAX_CONSTANTS (the oldest dropped first).
_CONSTANTS: dict[tuple, torch.Tensor] = {}
_MAX_CONSTANTS = 32


def _constant_vector(n: int, value: float, device: torch.device) -> torch.Tensor:
    """A read-only fp32 ``[n]`` tensor of ``value`` on ``device``, cached outside CUDA-graph captures. A capture gets
    a new one (in the graph's memory pool): a cached one could be dropped while a graph still reads it."""
    if tensors.is_capturing(device):
        return torch.full((n,), value, device=device, dtype=torch.float32)
    key = (n, value, device)
    vec = _CONSTANTS.get(key)
    if vec is None:
        if len(_CONSTANTS) >= _MAX_CONSTANTS:
            del _CONSTANTS[next(iter(_CONSTANTS))]
        vec = _CONSTANTS[key] = torch.full((n,), value, device=device, dtype=torch.float32)
    return vec


def _linear_total(g_logp: Optional[torch.Tensor], logp: torch.Tensor, g_entropy: Optional[torch.Tensor],
                  entropy: Optional[torch.Tensor]) -> torch.Tensor:
    """The reduced value of a :attr:`~tplogp.losses.TokenLoss.linear` loss from its upstream gradients (the
    coefficients over the mean's count, 0 at skipped rows): ``g_logp . logp + g_entropy . entropy``, one op per
    term (the rows' losses need not be formed)."""
    total = None if g_logp is None else torch.dot(g_logp, logp)
    if g_entropy is not None:
        part = torch.dot(g_entropy, entropy)
        total = part if total is None else total + part
    return total if total is not None else logp.new_zeros(())
