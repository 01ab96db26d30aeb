"""``linear_logp_loss``: a per-token loss of (logp, entropy) reduced to a scalar, its gradients computed in the
forward chunk by chunk and scaled in the backward (the scheme of fused linear cross-entropy).

Per chunk of tokens (the same chunks on every rank, :func:`tplogp.budgets.plan_chunk_tokens`):

1. :func:`tplogp.tp.shard_forward` gives fp32 logp and entropy (with a group: the stats' all_gather and merge), and
   the lse and ``sum_v z`` that a :class:`~tplogp.losses.TokenLoss` may read (:class:`~tplogp.losses.TokenStats`);
2. the loss gives the per-token upstream gradients ``g_logp`` / ``g_entropy`` (and ``g_lse`` / ``g_sum_z``):
   closed form for a :class:`~tplogp.losses.TokenLoss`, autograd on the chunk for any other callable;
3. the source's backward gives the chunk's fp32 ``d_hidden`` rows and adds its ``d_W`` / ``d_b`` to fp32
   accumulators (one chunk's are written directly in the weight / bias dtype).

A chunk is as many tokens as the kept part of ``workspace_bytes`` holds softmax terms of, so its backward reads
them instead of recomputing (3 GEMMs instead of 4). ONE all_reduce completes ``d_hidden``, issued as soon as the
last chunk's rows are done, under that chunk's ``d_W`` work (a reduce-scatter of a sequence-parallel hidden, which the
chunks see gathered: :func:`tplogp.local_call.localize`; none with ``hidden_grad="partial"``). The autograd node's
backward scales the gradients by the upstream scalar, the fp32 product rounded once (:mod:`tplogp.grad_scaling`).
Per-token tensors are constants. A ``losses.grpo(...)`` loss with sequence sums runs the same loop on chunks of whole
sequences (:func:`_policy_loss_and_grads`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from . import local_call, plan, tensors, tp
from .budgets import accumulator_tokens, plan_chunk_tokens
from .grad_scaling import scaled_all
from .losses import Derivative, TokenLoss, TokenStats
from .rl_losses import GRPOLoss, combine_sums, finish_metrics
from .sequences import check_offsets, row_bounds, segments_for
from .tensors import f32_contiguous, finish_rows, zero_rows

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
               global_vocab_size: Optional[int], *, return_metrics: bool = False, **kwargs):
    """See :func:`tplogp.linear_logp_loss` (``source``: a name, or None for the registry's choice; ``kwargs``: the
    keyword arguments of :func:`loss_and_grads` but ``needs``). The chunk loop runs without autograd (only a
    callable loss runs under it); the result carries the gradients, and with ``return_metrics`` comes with the
    metrics of a :class:`~tplogp.rl_losses.GRPOLoss`."""
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and isinstance(t, torch.Tensor) and t.requires_grad for t in (hidden, weight, bias))
    total, grads, verdict, sums = loss_and_grads(source, hidden, weight, target_ids, bias, tp_group,
                                                 vocab_start_index, global_vocab_size, needs=needs,
                                                 return_metrics=return_metrics, **kwargs)
    if any(needs):
        total = _PrecomputedGrads.apply(total, grads, verdict, hidden, weight, bias)
    if not return_metrics:
        return total
    loss = kwargs["loss"]
    return total, finish_metrics(sums, total.device, bool(loss.config.beta), kwargs.get("with_entropy", True))


def loss_and_grads(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index: int,
                   global_vocab_size: Optional[int], *, loss, per_token: Sequence[torch.Tensor], reduction: str,
                   temperature: float, ignore_index: Optional[int], deterministic: bool,
                   workspace_bytes: Optional[int], needs: tuple[bool, bool, bool], with_entropy: bool = True,
                   sequence_parallel: bool = False, hidden_grad: str = "reduced", softcap: Optional[float] = None,
                   cu_seqlens=None, return_metrics: bool = False):
    """The fused loss's value and the unscaled gradients ``needs`` asks for, computed chunk by chunk (module
    docstring): ``(loss, (d_hidden, d_weight, d_bias), the call's verdict, metric sums | None)``, what
    :func:`fused_loss` and the compiled op (:mod:`tplogp.ops`) hand to autograd."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    policy = isinstance(loss, GRPOLoss)
    _check_policy_options(loss, policy, per_token, reduction, return_metrics, cu_seqlens, target_ids, with_entropy)
    offsets = None if cu_seqlens is None else check_offsets(cu_seqlens, target_ids.numel(),
                                                            read=policy and loss.needs_sequences)
    _check_token_loss(loss, per_token, with_entropy)
    options = plan.LogpOptions(temperature=temperature, return_entropy=with_entropy, ignore_index=ignore_index,
                               deterministic=deterministic, workspace_bytes=workspace_bytes,
                               sequence_parallel=sequence_parallel, hidden_grad=hidden_grad, softcap=softcap,
                               with_sum_z=isinstance(loss, TokenLoss) and "sum_z" in loss.reads)
    # the d_hidden collective runs iff needs[0]: the group's record makes every rank agree on it (no hang)
    call = plan.prepare(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
                        options, needs[0])
    sums = None
    with torch.no_grad():
        local = local_call.localize(call)
        if policy:
            total, grads, sums = _policy_loss_and_grads(local, loss, per_token, needs, target_ids.numel(),
                                                        hidden.shape, target_ids.shape, offsets, return_metrics)
        else:
            total, grads = _loss_and_grads(local, loss, per_token, reduction, needs, target_ids.numel(), hidden.shape)
    return total, grads, call.verdict, sums

def _check_policy_options(loss, policy: bool, per_token: Sequence, reduction: str, return_metrics: bool,
                          cu_seqlens, target_ids, with_entropy: bool) -> None:
    """The options that only a :class:`~tplogp.rl_losses.GRPOLoss` takes, and what it needs (the same error on
    every rank: the arguments are)."""
    if not policy:
        for name, value in (("return_metrics", return_metrics), ("cu_seqlens", cu_seqlens)):
            if value is not None and value is not False:
                raise ValueError(f"{name} is an option of the losses.grpo(...) losses, not of {loss!r}")
        return
    loss.check_arity(len(per_token))
    if reduction != "sum":
        raise ValueError(f"the loss {loss.name} normalises itself (its normalization option): call with "
                         f"reduction='sum', got {reduction!r}")
    if loss.needs_sequences and cu_seqlens is None and target_ids.dim() < 2:
        raise ValueError(f"the loss {loss.name} has per-sequence terms: pass [B, L] targets (a sequence per row) "
                         f"or cu_seqlens (packed sequences' offsets)")
    if loss.reads_entropy and not with_entropy:
        raise ValueError(f"the loss {loss.name} reads the entropy (entropy_coef): call with with_entropy=True")


class _Gradients:
    """The call's gradients as its chunks' backwards produce them: ``d_hidden`` rows into one fp32 buffer (none for
    one chunk without a group: the source's), ``d_W`` / ``d_b`` summed in fp32 accumulators over several chunks, and
    the ONE collective of ``d_hidden`` (all_reduce, or reduce_scatter for sequence-parallel input) issued by the
    chunk that completes it (the last rows), under its ``d_W`` work."""

    def __init__(self, local: local_call.LocalCall, needs: tuple[bool, bool, bool], n: int, n_chunks: int) -> None:
        h2, w, b, tpc = local.hidden, local.weight, local.bias, local.tpc
        self.local, self.needs, self.n = local, needs, n
        self.reduce = tp.hidden_grad_reducer(tpc) if needs[0] else None
        d = h2.shape[1]
        # one chunk without a group: its d_hidden is the source's (no [N, D] buffer to fill)
        self.d_hidden = (torch.zeros(n, d, device=h2.device, dtype=torch.float32)
                         if needs[0] and (n_chunks > 1 or self.reduce is not None) else None)
        self.accumulate = None  # several chunks: d_W and d_b summed unrounded in fp32, rounded once at the end
        if n_chunks > 1 and (needs[1] or needs[2]):
            self.accumulate = (torch.zeros(w.shape, device=w.device, dtype=torch.float32) if needs[1] else None,
                               torch.zeros(b.shape, device=b.device, dtype=torch.float32) if needs[2] else None)
        self.d_w = torch.zeros_like(w) if n == 0 and needs[1] else None
        self.d_b = torch.zeros_like(b) if n == 0 and needs[2] else None
        if n == 0 and needs[0]:
            self.d_hidden = h2.new_zeros(n, d, dtype=torch.float32)

    def backward(self, t0: int, t1: int, h_c, lt_c, row_max, log_sum, mean_rel, g_logp: torch.Tensor,
                 g_ent: Optional[torch.Tensor], kept, g_lse: Optional[torch.Tensor] = None,
                 g_sum_z: Optional[torch.Tensor] = None) -> None:
        """One chunk's backward, rows ``[t0, t1)``, given its upstream gradients (``g_lse`` / ``g_sum_z``: of a
        loss that reads the lse / the sum of the logits)."""
        local, reduce, d_hidden = self.local, self.reduce, self.d_hidden
        ready = None
        if reduce is not None and t1 == self.n:  # the last chunk completes d_hidden: reduce it under its d_W

            def ready(rows, t0=t0, t1=t1):
                d_hidden[t0:t1] = rows
                reduce.start(d_hidden)

        grads = local.tpc.backend.backward(h_c, local.weight, local.bias, lt_c, row_max, log_sum,
                                           g_logp.contiguous(), None if g_ent is None else g_ent.contiguous(), g_lse,
                                           mean_rel if g_ent is not None else None, local.tpc.call, self.needs,
                                           d_hidden_ready=ready, kept=kept, accumulate=self.accumulate,
                                           grad_sum_z=g_sum_z)
        if d_hidden is not None and not (ready is not None and reduce.started):
            d_hidden[t0:t1] = grads.d_hidden
        elif self.needs[0] and d_hidden is None:  # the one chunk
            self.d_hidden = grads.d_hidden
        self.d_w, self.d_b = grads.d_weight, grads.d_bias

    def finish(self, n_all: int, hidden_shape) -> tuple:
        """``(d_hidden, d_W, d_b)`` of the call; d_hidden fp32 (rounded once, after the upstream scale)."""
        d_hidden = self.d_hidden
        if d_hidden is not None:
            if self.reduce is not None:  # the one collective of d_hidden (started by the last chunk's backward)
                d_hidden = self.reduce.finish(d_hidden)
            if self.local.own_rows is None:  # (sequence-parallel ignored rows are in place, no upstream gradient)
                d_hidden = finish_rows(d_hidden, n_all, self.local.keep_idx, self.local.ignored)
            d_hidden = d_hidden if d_hidden.shape == hidden_shape else d_hidden.view(hidden_shape)
        d_w, d_b = self.d_w, self.d_b
        if self.local.tpc.regrid is not None:  # the invariant level: d_W / d_b of the grid's rows to the shard's
            d_w, d_b = self.local.tpc.regrid.grads_back(d_w, d_b)
        return d_hidden, d_w, d_b


def _plan_chunks(local: local_call.LocalCall, needs: tuple[bool, bool, bool]) -> int:
    """Tokens per chunk (the same on every rank), from what requires a gradient, not from grad mode: a call without
    gradients sums the same chunks."""
    h2, w, b, tpc = local.hidden, local.weight, local.bias, local.tpc
    accumulators = accumulator_tokens(h2.shape[1], w.dtype if needs[1] else None, b.dtype if needs[2] else None)
    return plan_chunk_tokens(tpc.backend, h2.shape[0], local.vocab_size, tpc.call.workspace_bytes, h2.device,
                             accumulators, h2.dtype)


def _loss_and_grads(local: local_call.LocalCall, loss, per_token, reduction: str, needs: tuple[bool, bool, bool],
                    n_all: int, hidden_shape):
    """``(loss, (d_hidden, d_W, d_b))`` of a local call, chunk by chunk (module docstring); ``needs``: the
    gradients to compute (none: the loss value alone)."""
    h2, local_target, tpc, ignored = local.hidden, local.local_target, local.tpc, \
        local.ignored  # (ignored rows kept in place, a CUDA-graph capture: masked out of the loss)
    extra = _per_token_rows(per_token, n_all, h2.device, local.keep_idx)
    n = h2.shape[0]
    differentiate = any(needs)
    chunk = _plan_chunks(local, needs)
    if differentiate:  # one backward per chunk's forward: it may write d_logits over the chunk's kept terms
        tpc.call = tpc.call.precomputing
    count = None if reduction != "mean" else (
        float(max(n, 1)) if ignored is None else (~ignored).sum().clamp_min(1).to(torch.float32))
    n_chunks = -(-n // chunk) if n else 0
    grads = _Gradients(local, needs, n, n_chunks) if differentiate else None
    total = torch.zeros((), device=h2.device, dtype=torch.float32) if n == 0 else None
    w, b = local.weight, local.bias
    for t0 in range(0, n, chunk):
        t1 = min(t0 + chunk, n)
        whole = t1 - t0 == n  # one chunk: the call's tensors themselves (no slicing ops: host time)
        h_c, lt_c = (h2, local_target) if whole else (h2[t0:t1], local_target[t0:t1])
        pt = extra if whole else [t[t0:t1] for t in extra]
        skip = None if ignored is None else ignored if whole else ignored[t0:t1]
        (logp, entropy, lse, _, sum_z), (row_max, log_sum, mean_rel, kept) = tp.shard_forward(h_c, w, b, lt_c, tpc)
        if skip is not None:  # no NaN of a row nobody owns reaches the loss callable (nor its gradient)
            logp, entropy = zero_rows(skip, logp), None if entropy is None else zero_rows(skip, entropy)
        reads_stats = isinstance(loss, TokenLoss) and bool(loss.reads)
        stats = TokenStats(lse, sum_z, local.vocab_size) if reads_stats else None
        if not differentiate:
            value = loss(logp, entropy, *pt, stats=stats) if reads_stats else loss(logp, entropy, *pt)
            part = _chunk_part(zero_rows(skip, value), count)
            total = part if total is None else total + part
            continue
        part = None  # a linear loss's: from its upstream gradients, once the backward is launched
        g_lse = g_sum_z = None
        if isinstance(loss, TokenLoss):  # closed-form derivatives: no autograd engine run per chunk
            if loss.linear:
                d_logp, d_ent = loss.coefficients(*pt)
            else:
                value, d_logp, d_ent = loss.value_and_derivatives(logp, entropy, *pt, stats=stats)
                part = _chunk_part(zero_rows(skip, value), count)
            g_logp = _token_grads(d_logp, t1 - t0, h2.device, skip, count=count)
            g_ent = None if entropy is None else _token_grads(d_ent, t1 - t0, h2.device, skip, count=count)
            if reads_stats:  # d loss / d lse and d loss / d sum_z: the sources' grad_lse and grad_sum_z
                d_lse, d_sum_z = loss.stat_derivatives(stats, *pt)
                g_lse = _token_grads(d_lse, t1 - t0, h2.device, skip, count=count)
                g_sum_z = _token_grads(d_sum_z, t1 - t0, h2.device, skip, count=count)
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
        grads.backward(t0, t1, h_c, lt_c, row_max, log_sum, mean_rel, g_logp, g_ent, kept, g_lse, g_sum_z)
        del kept  # one chunk's kept logits at a time
        part = _linear_total(*linear) if linear is not None else part  # (queued behind the backward's kernels)
        total = part if total is None else total + part
    return total, (grads.finish(n_all, hidden_shape) if differentiate else (None, None, None))


def _policy_loss_and_grads(local: local_call.LocalCall, loss: GRPOLoss, per_token, needs: tuple[bool, bool, bool],
                           n_all: int, hidden_shape, target_shape, offsets, metrics: bool):
    """``(loss, (d_hidden, d_W, d_b), metric sums | None)`` of a :class:`~tplogp.rl_losses.GRPOLoss`.

    A loss without sequence sums runs the chunk loop of :func:`_loss_and_grads` (each chunk's coefficients from
    its own logp). One with them (GSPO's ratio, VESPO's weights) needs a sequence's sums before any of its tokens'
    gradients: its chunks hold whole sequences (:func:`_sequence_chunks`: consecutive sequences, at most the
    planned chunk's rows), so each chunk's forward, coefficients and backward follow one another as in that loop
    (every chunk's terms kept, no GEMM more; the coefficients' extra pass is over the chunk's per-token values).
    When a sequence has more rows than a chunk it runs in two phases: the forwards of every chunk (last chunk
    first), holding per token its logp, entropy and the three softmax statistics the backward takes (5 fp32, 20
    bytes per token) and the kept terms of the first chunk only; then the coefficients of every token; then the
    backwards in order, the first chunk reading its kept terms, the others recomputing their logits (one GEMM more
    on those rows, as the backward of an unkept chunk).
    """
    h2, local_target, tpc, ignored = local.hidden, local.local_target, local.tpc, local.ignored
    extra = _per_token_rows(per_token, n_all, h2.device, local.keep_idx)
    n = h2.shape[0]
    differentiate = any(needs)
    counted = None if ignored is None else ~ignored
    segments = (segments_for(target_shape, offsets, local.keep_idx, h2.device) if loss.needs_sequences
                else None)
    bound = loss.bind(extra, counted, segments)
    chunk = _plan_chunks(local, needs)
    lean = tpc.call  # a forward whose terms are not kept
    if differentiate:
        tpc.call = tpc.call.precomputing
    chunks = [(t0, min(t0 + chunk, n), None) for t0 in range(0, n, chunk)]  # (t0, t1, whole sequences)
    if loss.needs_sums and len(chunks) > 1:
        chunks = _sequence_chunks(row_bounds(target_shape, offsets, local.keep_idx), chunk) or chunks
    two_phase = loss.needs_sums and len(chunks) > 1 and chunks[0][2] is None
    grads = _Gradients(local, needs, n, len(chunks)) if differentiate else None
    w, b = local.weight, local.bias
    total, sums = torch.zeros((), device=h2.device, dtype=torch.float32), None

    def forward(t0, t1, keep):
        h_c, lt_c = (h2, local_target) if t1 - t0 == n else (h2[t0:t1], local_target[t0:t1])
        context = tpc if keep or tpc.call is lean else dataclasses.replace(tpc, call=lean)
        (logp, entropy, *_), stats = tp.shard_forward(h_c, w, b, lt_c, context)
        if ignored is not None:  # no NaN of a row nobody owns reaches the loss (nor its gradient)
            logp, entropy = zero_rows(ignored[t0:t1], logp), None if entropy is None else zero_rows(
                ignored[t0:t1], entropy)
        return h_c, lt_c, logp, entropy, stats

    if not two_phase:
        for t0, t1, sequences in chunks:
            h_c, lt_c, logp, entropy, (row_max, log_sum, mean_rel, kept) = forward(t0, t1, differentiate)
            whole = t1 - t0 == n
            ev = bound.evaluate(logp, entropy, None if whole else slice(t0, t1), metrics, None if whole else sequences)
            if differentiate:
                grads.backward(t0, t1, h_c, lt_c, row_max, log_sum, mean_rel, ev.g_logp, ev.g_entropy, kept)
            del kept
            total = total + ev.total
            sums = combine_sums(sums, ev.sums) if metrics else None
    else:
        held = {}
        for t0, t1, _ in reversed(chunks):  # phase 1: every chunk's forward, the first one's kept terms held
            _, _, logp, entropy, (row_max, log_sum, mean_rel, kept) = forward(t0, t1, differentiate and t0 == 0)
            held[t0] = (logp, entropy, row_max, log_sum, mean_rel, kept)
        parts = [held[t0] for t0, _, _ in chunks]
        logp = torch.cat([p[0] for p in parts])
        entropy = None if parts[0][1] is None else torch.cat([p[1] for p in parts])
        ev = bound.evaluate(logp, entropy, None, metrics)  # the coefficients of every token
        total, sums = total + ev.total, ev.sums
        for t0, t1, _ in chunks if differentiate else ():  # phase 2: the backwards in order
            _, entropy_c, row_max, log_sum, mean_rel, kept = held.pop(t0)
            g_ent = None if ev.g_entropy is None else ev.g_entropy[t0:t1]
            grads.backward(t0, t1, h2[t0:t1], local_target[t0:t1], row_max, log_sum, mean_rel, ev.g_logp[t0:t1],
                           g_ent, kept)
            del kept
    return total, (grads.finish(n_all, hidden_shape) if differentiate else (None, None, None)), sums


def _sequence_chunks(bounds: list[int], chunk: int) -> Optional[list[tuple[int, int, slice]]]:
    """Chunks ``(t0, t1, sequences)`` of at most ``chunk`` rows, each holding the whole ``sequences`` (consecutive,
    greedily as many as fit), from the sequences' row boundaries ``bounds`` (:func:`tplogp.sequences.row_bounds`);
    chunks of no row left out. None when a sequence has more rows than a chunk."""
    out, s0, count = [], 0, len(bounds) - 1
    while s0 < count:
        if bounds[s0 + 1] - bounds[s0] > chunk:
            return None
        s1 = s0 + 1
        while s1 < count and bounds[s1 + 1] - bounds[s0] <= chunk:
            s1 += 1
        if bounds[s1] > bounds[s0]:
            out.append((bounds[s0], bounds[s1], slice(s0, s1)))
        s0 = s1
    return out


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
