"""The fused loss's chunks (:mod:`tplogp.fused_loss.loop`): tokens per chunk, the per-token tensors
as the chunk rows' fp32 constants, a chunk's share of the reduced loss, and the call's gradients
assembled from the chunks' backwards.

The gradients: ``d_hidden`` rows go into one fp32 buffer, ``d_W`` / ``d_b`` are summed unrounded in
fp32 over the chunks and rounded once, and the ONE collective of ``d_hidden`` is issued by the chunk
that completes it, under that chunk's ``d_W`` work.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..op import local_call, tp
from ..budgets import accumulator_tokens, plan_chunk_tokens
from ..support.tensors import finish_rows


class ChunkGradients:
    """The call's gradients as its chunks' backwards produce them: ``d_hidden`` rows into one fp32
    buffer (none for one chunk without a group: the source's), ``d_W`` / ``d_b`` summed in fp32
    accumulators over several chunks, and the ONE collective of ``d_hidden`` (all_reduce, or
    reduce_scatter for sequence-parallel input) issued by the chunk that completes it (the last
    rows), under its ``d_W`` work."""

    def __init__(self, local: local_call.LocalCall, needs: tuple[bool, bool, bool], n: int,
                 n_chunks: int) -> None:
        h2, w, b, tpc = local.hidden, local.weight, local.bias, local.tpc
        self.local, self.needs, self.n = local, needs, n
        self.reduce = tp.hidden_grad_reducer(tpc) if needs[0] else None
        d = h2.shape[1]
        # one chunk without a group: its d_hidden is the source's (no [N, D] buffer to fill)
        self.d_hidden = (torch.zeros(n, d, device=h2.device, dtype=torch.float32)
                         if needs[0] and (n_chunks > 1 or self.reduce is not None) else None)
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
        # the last chunk completes d_hidden: reduce it under its d_W
        if reduce is not None and t1 == self.n:

            def reduce_when_ready(rows, t0=t0, t1=t1):
                d_hidden[t0:t1] = rows
                reduce.start(d_hidden)

            ready = reduce_when_ready

        grads = local.tpc.backend.backward(h_c, local.weight, local.bias, lt_c, row_max, log_sum,
                                           g_logp.contiguous(),
                                           None if g_ent is None else g_ent.contiguous(), g_lse,
                                           mean_rel if g_ent is not None else None, local.tpc.call,
                                           self.needs, d_hidden_ready=ready, kept=kept,
                                           accumulate=self.accumulate, grad_sum_z=g_sum_z)
        if d_hidden is not None and not (ready is not None and reduce.started):
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
            if self.local.own_rows is None:
                d_hidden = finish_rows(d_hidden, n_all, self.local.keep_idx, self.local.ignored)
            d_hidden = d_hidden if d_hidden.shape == hidden_shape else d_hidden.view(hidden_shape)
        d_w, d_b = self.d_w, self.d_b
        # the invariant level: d_W / d_b of the grid's rows to the shard's
        if self.local.tpc.regrid is not None:
            d_w, d_b = self.local.tpc.regrid.grads_back(d_w, d_b)
        return d_hidden, d_w, d_b


def plan_chunks(local: local_call.LocalCall, needs: tuple[bool, bool, bool]) -> int:
    """Tokens per chunk (the same on every rank), from what requires a gradient, not from grad mode:
    a call without gradients sums the same chunks."""
    h2, w, b, tpc = local.hidden, local.weight, local.bias, local.tpc
    accumulators = accumulator_tokens(h2.shape[1], w.dtype if needs[1] else None,
                                      b.dtype if needs[2] else None)
    return plan_chunk_tokens(tpc.backend, h2.shape[0], local.vocab_size, tpc.call.workspace_bytes,
                             h2.device, accumulators, h2.dtype)


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
