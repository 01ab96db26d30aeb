"""The GRPO family's chunk schedule in the fused loss (:func:`policy_loss_and_grads`); the options
only its losses take are checked with the fused loss's others
(:func:`tplogp.op.validation.check_loss`)."""

from __future__ import annotations

from typing import Optional

import torch

from ..op import local_call, tp
from .chunk_gradients import ChunkGradients, per_token_rows, plan_chunks
from ..losses.grpo_family import GRPOLoss, combine_sums
from ..support.sequences import row_bounds, segments_for
from ..support.tensors import zero_rows


def policy_loss_and_grads(local: local_call.LocalCall, loss: GRPOLoss, per_token,
                          needs: tuple[bool, bool, bool],
                           n_all: int, hidden_shape, target_shape, offsets, metrics: bool):
    """``(loss, (d_hidden, d_W, d_b), metric sums | None)`` of a
    :class:`~tplogp.losses.grpo_family.GRPOLoss`.

    A loss without sequence sums runs the chunk loop of :mod:`tplogp.fused_loss.loop` (each chunk's
    coefficients from its own logp). One with them (GSPO's ratio, VESPO's weights) needs a
    sequence's sums before any of its tokens' gradients: its chunks hold whole sequences
    (:func:`_sequence_chunks`: consecutive sequences, at most the planned chunk's rows), so each
    chunk's forward, coefficients and backward follow one another as in that loop (every chunk's
    terms kept, no GEMM more; the coefficients' extra pass is over the chunk's per-token values).
    When a sequence has more rows than a chunk it runs in two phases: the forwards of every chunk
    (last chunk first), holding per token its logp, entropy and the three softmax statistics the
    backward takes (5 fp32, 20 bytes per token) and the kept terms of the first chunk only; then the
    coefficients of every token; then the backwards in order, the first chunk reading its kept
    terms, the others recomputing their logits (one GEMM more on those rows, as the backward of an
    unkept chunk).
    """
    h2, local_target, tpc, ignored = local.hidden, local.local_target, local.tpc, local.ignored
    extra = per_token_rows(per_token, n_all, h2.device, local.keep_idx)
    n = h2.shape[0]
    differentiate = any(needs)
    counted = None if ignored is None else ~ignored
    segments = (segments_for(target_shape, offsets, local.keep_idx,
                             h2.device) if loss.needs_sequences
                else None)
    bound = loss.bind(extra, counted, segments)
    chunk = plan_chunks(local, needs)
    lean = tpc.call  # a forward whose terms are not kept
    call = lean.precomputing if differentiate else lean
    # (t0, t1, whole sequences)
    chunks = [(t0, min(t0 + chunk, n), None) for t0 in range(0, n, chunk)]
    if loss.needs_sums and len(chunks) > 1:
        chunks = _sequence_chunks(row_bounds(target_shape, offsets, local.keep_idx),
                                  chunk) or chunks
    two_phase = loss.needs_sums and len(chunks) > 1 and chunks[0][2] is None
    grads = ChunkGradients(local, call, needs, n, len(chunks)) if differentiate else None
    w, b = local.weight, local.bias
    total, sums = torch.zeros((), device=h2.device, dtype=torch.float32), None

    def forward(t0, t1, keep):
        h_c, lt_c = (h2, local_target) if t1 - t0 == n else (h2[t0:t1], local_target[t0:t1])
        run = call if keep else lean
        (logp, entropy, *_), stats = tp.shard_forward(
            h_c, w, b, lt_c, tpc, run if run.support is None else run.for_rows(t0, t1))
        if ignored is not None:  # no NaN of a row nobody owns reaches the loss (nor its gradient)
            logp, entropy = zero_rows(ignored[t0:t1], logp), None if entropy is None else zero_rows(
                ignored[t0:t1], entropy)
        return h_c, lt_c, logp, entropy, stats

    if not two_phase:
        for t0, t1, sequences in chunks:
            h_c, lt_c, logp, entropy, (row_max, log_sum, mean_rel, kept) = forward(t0, t1,
                                                                                   differentiate)
            whole = t1 - t0 == n
            ev = bound.evaluate(logp, entropy, None if whole else slice(t0, t1), metrics,
                                None if whole else sequences)
            if differentiate:
                grads.backward(t0, t1, h_c, lt_c, row_max, log_sum, mean_rel, ev.g_logp,
                               ev.g_entropy, kept)
            del kept
            total = total + ev.total
            sums = combine_sums(sums, ev.sums) if metrics else None
    else:
        held = {}
        # phase 1: every chunk's forward, the first one's kept terms held
        for t0, t1, _ in reversed(chunks):
            _, _, logp, entropy, (row_max, log_sum, mean_rel, kept) = forward(t0, t1, differentiate
                                                                              and t0 == 0)
            held[t0] = (logp, entropy, row_max, log_sum, mean_rel, kept)
        parts = [held[t0] for t0, _, _ in chunks]
        logp = torch.cat([p[0] for p in parts])
        entropy = None if parts[0][1] is None else torch.cat([p[1] for p in parts])
        ev = bound.evaluate(logp, entropy, None, metrics)  # the coefficients of every token
        total, sums = total + ev.total, ev.sums
        for t0, t1, _ in chunks if differentiate else ():  # phase 2: the backwards in order
            _, entropy_c, row_max, log_sum, mean_rel, kept = held.pop(t0)
            g_ent = None if ev.g_entropy is None else ev.g_entropy[t0:t1]
            grads.backward(t0, t1, h2[t0:t1], local_target[t0:t1], row_max, log_sum, mean_rel,
                           ev.g_logp[t0:t1], g_ent, kept)
            del kept
    return total, (grads.finish(n_all, hidden_shape) if differentiate else (None, None, None)), sums


def _sequence_chunks(bounds: list[int], chunk: int) -> Optional[list[tuple[int, int, slice]]]:
    """Chunks ``(t0, t1, sequences)`` of at most ``chunk`` rows, each holding the whole
    ``sequences`` (consecutive, greedily as many as fit), from the sequences' row boundaries
    ``bounds`` (:func:`tplogp.support.sequences.row_bounds`); chunks of no row left out. None when a
    sequence has more rows than a chunk."""
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
