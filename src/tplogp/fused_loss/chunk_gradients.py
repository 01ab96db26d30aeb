"""The fused loss's chunks (:mod:`tplogp.fused_loss.loop`): tokens per chunk, the per-token tensors
as the chunk rows' fp32 constants, a chunk's share of the reduced loss, the call's gradients
assembled from the chunks' backwards, and the chunk loop of a token loss
(:func:`token_loss_and_grads`: forward, the loss's closed-form derivatives, the source's backward,
per chunk).

The gradients: ``d_hidden`` rows go into one fp32 buffer, ``d_W`` / ``d_b`` are summed unrounded in
fp32 over the chunks and rounded once, and the ONE collective of ``d_hidden`` is issued by the chunk
that completes it, under that chunk's ``d_W`` work.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..op import local_call, tp
from ..budgets import accumulator_tokens, plan_chunk_tokens
from ..backends.base import ShardCall
from ..losses.terms import Derivative, TokenLoss, TokenStats
from ..support import comm, settings, tensors
from ..support.tensors import f32_contiguous, finish_rows, zero_rows


class ChunkGradients:
    """The call's gradients as its chunks' backwards produce them: ``d_hidden`` rows into one fp32
    buffer (none for one chunk: the source's own, which the collective is started on), ``d_W`` /
    ``d_b`` summed in fp32 accumulators over several chunks, and the ONE collective of ``d_hidden``
    (all_reduce, or reduce_scatter for sequence-parallel input) issued by the chunk that completes
    it (the last rows), under its ``d_W`` work. ``call``: the settings of the chunks' backwards
    (``ShardCall.precomputing`` of the call's; a chunk's rows of its support taken per chunk)."""

    def __init__(self, local: local_call.LocalCall, call: ShardCall,
                 needs: tuple[bool, bool, bool], n: int, n_chunks: int) -> None:
        h2, w, b, tpc = local.hidden, local.weight, local.bias, local.tpc
        self.local, self.call, self.needs, self.n = local, call, needs, n
        self.reduce = (comm.overlapped_reduce(tpc.hidden_reduce, tpc.group, tpc.comm_device)
                       if needs[0] else None)
        d = h2.shape[1]
        # one chunk: its d_hidden is the source's (no [N, D] buffer to fill), reduced as the op's
        self.d_hidden = (torch.zeros(n, d, device=h2.device, dtype=torch.float32)
                         if needs[0] and n_chunks > 1 else None)
        # several chunks: d_W and d_b summed unrounded in fp32, rounded once at the end
        self.accumulate = None
        if n_chunks > 1 and (needs[1] or needs[2]):
            self.accumulate = (torch.zeros(w.shape, device=w.device,
                                           dtype=torch.float32) if needs[1] else None,
                               torch.zeros(b.shape, device=b.device,
                                           dtype=torch.float32) if needs[2] else None)
        self.d_w = torch.zeros_like(w) if n == 0 and needs[1] else None
        self.d_b = torch.zeros_like(b) if n == 0 and needs[2] else None
        if n == 0 and needs[0]:
            self.d_hidden = h2.new_zeros(n, d, dtype=torch.float32)

    def backward(self, t0: int, t1: int, h_c, lt_c, row_max, log_sum, mean_rel,
                 g_logp: torch.Tensor, g_ent: Optional[torch.Tensor], kept,
                 g_lse: Optional[torch.Tensor] = None,
                 g_sum_z: Optional[torch.Tensor] = None) -> None:
        """One chunk's backward, rows ``[t0, t1)``, given its upstream gradients
        (``g_lse`` / ``g_sum_z``: of a loss that reads the lse / the sum of the logits)."""
        local, reduce, d_hidden = self.local, self.reduce, self.d_hidden
        ready = None
        started = []  # the source handed d_hidden over (its rows written, the reduce started)
        # the last chunk completes d_hidden: reduce it under its d_W (the one chunk: the source's
        # d_hidden itself, as the op's backward does)
        if reduce is not None and d_hidden is None:
            ready = reduce.start
        elif reduce is not None and t1 == self.n:

            def reduce_when_ready(rows, t0=t0, t1=t1):
                d_hidden[t0:t1] = rows
                reduce.start(d_hidden)
                started.append(True)

            ready = reduce_when_ready

        call = self.call
        grads = local.tpc.backend.backward(h_c, local.weight, local.bias, lt_c, row_max, log_sum,
                                           g_logp.contiguous(),
                                           None if g_ent is None else g_ent.contiguous(), g_lse,
                                           mean_rel if g_ent is not None else None,
                                           call if call.support is None else call.for_rows(t0, t1),
                                           self.needs, d_hidden_ready=ready, kept=kept,
                                           accumulate=self.accumulate, grad_sum_z=g_sum_z)
        if d_hidden is not None and not started:
            d_hidden[t0:t1] = grads.d_hidden
        elif self.needs[0] and d_hidden is None:  # the one chunk
            self.d_hidden = grads.d_hidden
        self.d_w, self.d_b = grads.d_weight, grads.d_bias

    def finish(self, n_all: int, hidden_shape) -> tuple:
        """``(d_hidden, d_W, d_b)`` of the call; d_hidden fp32 (rounded once, after the upstream
        scale)."""
        d_hidden = self.d_hidden
        if d_hidden is not None:
            # the one collective of d_hidden (started by the last chunk's backward)
            if self.reduce is not None:
                d_hidden = self.reduce.finish(d_hidden)
            # (sequence-parallel ignored rows are in place, no upstream gradient)
            local = self.local
            if local.own_rows is None and (local.keep_idx is not None or local.ignored is not None):
                d_hidden = finish_rows(d_hidden, n_all, local.keep_idx, local.ignored)
            d_hidden = d_hidden if d_hidden.shape == hidden_shape else d_hidden.view(hidden_shape)
        d_w, d_b = self.d_w, self.d_b
        # the invariant level: d_W / d_b of the grid's rows to the shard's
        if self.local.tpc.regrid is not None:
            d_w, d_b = self.local.tpc.regrid.grads_back(d_w, d_b)
        return d_hidden, d_w, d_b


# tokens per chunk, by everything plan_chunk_tokens reads (the source's budget and tiles:
# TPLOGP_WORKSPACE_MB, TRITON_INTERPRET as the plan read them, ShardCall.env, and the fp32 matmul
# precision): planned once per layout (host time at small shapes); emptied beyond 1024 entries
_chunk_tokens: dict = {}


def plan_chunks(local: local_call.LocalCall, needs: tuple[bool, bool, bool]) -> int:
    """Tokens per chunk (the same on every rank), from what requires a gradient, not from grad mode:
    a call without gradients sums the same chunks. Remembered per layout."""
    h2, w, b, tpc = local.hidden, local.weight, local.bias, local.tpc
    key = (tpc.backend, h2.shape[0], h2.shape[1], local.vocab_size, tpc.call.workspace_bytes,
           h2.device, h2.dtype, w.dtype if needs[1] else None, b.dtype if needs[2] else None,
           tpc.call.env or settings.kernel_settings(), torch.get_float32_matmul_precision())
    chunk = _chunk_tokens.get(key)
    if chunk is None:
        accumulators = accumulator_tokens(h2.shape[1], w.dtype if needs[1] else None,
                                          b.dtype if needs[2] else None)
        if len(_chunk_tokens) > 1024:
            _chunk_tokens.clear()
        chunk = _chunk_tokens[key] = plan_chunk_tokens(tpc.backend, h2.shape[0], local.vocab_size,
                                                       tpc.call.workspace_bytes, h2.device,
                                                       accumulators, h2.dtype)
    return chunk


def chunk_part(per_token_loss: torch.Tensor, count) -> torch.Tensor:
    """One chunk's share of the call's loss: its per-token losses' sum, over the call's ``count``
    for ``"mean"``."""
    return per_token_loss.sum() if count is None else per_token_loss.sum() / count


def per_token_rows(per_token: Sequence[torch.Tensor], n_all: int, device: torch.device,
                    keep_idx: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """The per-token tensors as fp32 constants of the call's rows (those ``keep_idx`` kept, when
    compacted)."""
    extra = []
    for i, t in enumerate(per_token):
        if not isinstance(t, torch.Tensor) or t.numel() != n_all:
            raise ValueError(f"per_token[{i}] must be a tensor with target_ids' {n_all} elements, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        t = t.detach().reshape(-1).to(device=device, dtype=torch.float32)
        extra.append(t if keep_idx is None else t.index_select(0, keep_idx))
    return extra


# ---- the chunk loop of a token loss ---------------------------------------------------------------

def token_loss_and_grads(local: local_call.LocalCall, loss, per_token, reduction: str,
                    needs: tuple[bool, bool, bool], n_all: int, hidden_shape):
    """``(loss, (d_hidden, d_W, d_b))`` of a local call with a token loss, chunk by chunk (the loop
    of :mod:`tplogp.fused_loss.loop`'s docstring); ``needs``: the gradients to compute (none: the
    loss value alone)."""
    h2, local_target, tpc, ignored = local.hidden, local.local_target, local.tpc, \
        local.ignored  # (ignored rows kept in place, a CUDA-graph capture: masked out of the loss)
    extra = per_token_rows(per_token, n_all, h2.device, local.keep_idx)
    n = h2.shape[0]
    differentiate = any(needs)
    chunk = plan_chunks(local, needs)
    # one backward per chunk's forward: it may write d_logits over the chunk's kept terms
    call = tpc.call.precomputing if differentiate else tpc.call
    count = None if reduction != "mean" else (
        float(max(n, 1)) if ignored is None else (~ignored).sum().clamp_min(1).to(torch.float32))
    n_chunks = -(-n // chunk) if n else 0
    grads = ChunkGradients(local, call, needs, n, n_chunks) if differentiate else None
    total = torch.zeros((), device=h2.device, dtype=torch.float32) if n == 0 else None
    w, b = local.weight, local.bias
    for t0 in range(0, n, chunk):
        t1 = min(t0 + chunk, n)
        whole = t1 - t0 == n  # one chunk: the call's tensors themselves (no slicing ops: host time)
        h_c, lt_c = (h2, local_target) if whole else (h2[t0:t1], local_target[t0:t1])
        pt = extra if whole else [t[t0:t1] for t in extra]
        skip = None if ignored is None else ignored if whole else ignored[t0:t1]
        (logp, entropy, lse, _, sum_z), (row_max, log_sum, mean_rel, kept) = tp.shard_forward(
            h_c, w, b, lt_c, tpc, call if call.support is None else call.for_rows(t0, t1))
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
    return f32_contiguous(g, zero_at=skip)


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
