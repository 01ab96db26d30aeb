"""The ``triton`` and ``sm90`` sources' calls with a sampler's support (``ShardCall.support``).

Three ways, as on the native source (:mod:`tplogp.backends.native_support`):

* when the union of the call's supports is small (:func:`~.native_support.gathered`), the call runs
  on the gathered weight rows of that union alone, the ids becoming positions among them, and its
  argmax and ``d_W`` / ``d_b`` rows are put back at the shard's ids
  (:func:`~.native_support.scattered_argmax`, :func:`~.native_support.scattered_grads`); its kept
  terms are those of the gathered rows, which its backward (gathering the same union) reads;
* when that union is large but each token's support narrow: from the supports' (token, id) pairs
  alone, forward and backward (:func:`~.native_support.by_pairs`,
  :mod:`tplogp.backends.support_pairs`), or, for wider supports
  (:func:`~.native_support.chunk_rows`), token chunk by token chunk, each chunk the first way on
  its own small union, keeping nothing (the backward recomputes, chunk by chunk, its ``d_W`` /
  ``d_b`` rows added to fp32 accumulators: :func:`~.native_support.chunked_backward`);
* otherwise the fused kernels mask the logits outside each row's support to ``-inf`` in their logit
  transform (forward, and the backward's recompute), reading per row a bitmask of the shard's
  columns (:mod:`tplogp.kernels.support_bits`): the masked-vocabulary rule then gives the
  renormalized statistics and ``dz = 0`` there. The forward's kept terms are 0 on those columns,
  so a backward from them needs no mask. The forward's bitmask covers the whole shard for its token
  rows; where the rows' bitmask would exceed the budget's transient part, the forward runs in token
  chunks whose bitmask fits it (:func:`tplogp.kernels.support_bits.forward_rows`). The backward
  builds the bitmask of each d_logits chunk's columns
  (:func:`tplogp.kernels.backward_programs.backward`).

Support calls run no launch program (the per-layout ones of :mod:`tplogp.kernels.forward_programs`):
they go through the per-call entry points, planned afresh at every call as the call path plans them.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..op.support_ids import KEEP_ALL
from .base import ShardCall, ShardGrads, ShardStats, SingleShardOutputs
from . import support_pairs
from .native_support import by_pairs, chunk_rows, chunked_forward, gathered, scattered_argmax


def forward_stats(backend, hidden, weight, bias, local_target, call: ShardCall,
                  kept_out: Optional[torch.Tensor] = None) -> ShardStats:
    """``backend.forward_stats`` of a call with a support (module docstring)."""
    narrow = None if kept_out is not None else gathered(weight, bias, local_target, call)
    if narrow is not None:
        lost, targets = _lost_targets(narrow.local_target, local_target)
        st = backend.forward_stats(hidden, narrow.weight, narrow.bias, targets, narrow.call)
        return st._replace(argmax=scattered_argmax(st.argmax, narrow.rows),
                           target_logit=st.target_logit.masked_fill(lost, float("-inf")))
    if kept_out is None and by_pairs(call, weight):
        return support_pairs.forward_stats(backend.name, hidden, weight, bias, local_target, call)
    rows = None if kept_out is not None else chunk_rows(hidden.shape[0], weight.shape[0], call)
    if rows is not None:
        return chunked_forward(lambda h, t, c: backend.forward_stats(h, weight, bias, t, c), rows,
                               hidden, local_target, weight.shape[0], call)
    out, kept = _masked_forward(backend, hidden, weight, bias, local_target, call, kept_out, False)
    return ShardStats(*out[:4], kept=kept, sum_z=out[4], argmax=out[5])


def forward_single(backend, hidden, weight, bias, target, call: ShardCall,
                   target_flag: Optional[torch.Tensor] = None,
                   kept_out: Optional[torch.Tensor] = None) -> SingleShardOutputs:
    """``backend.forward_single`` of a call with a support (module docstring)."""
    narrow = None if kept_out is not None else gathered(weight, bias, target, call)
    if narrow is not None:
        lost, targets = _lost_targets(narrow.local_target, target)
        out = backend.forward_single(hidden, narrow.weight, narrow.bias, targets, narrow.call,
                                     target_flag)
        return out._replace(argmax=scattered_argmax(out.argmax, narrow.rows),
                            logp=out.logp.masked_fill(lost, float("-inf")))
    if kept_out is None and by_pairs(call, weight):
        return support_pairs.forward_single(backend.name, hidden, weight, bias, target, call,
                                            target_flag)
    rows = None if kept_out is not None else chunk_rows(hidden.shape[0], weight.shape[0], call)
    if rows is not None:
        return chunked_forward(
            lambda h, t, c: backend.forward_single(h, weight, bias, t, c, target_flag), rows,
            hidden, target, weight.shape[0], call)
    out, kept = _masked_forward(backend, hidden, weight, bias, target, call, kept_out, True,
                                target_flag)
    return SingleShardOutputs(*out[:6], kept=kept, sum_z=out[6], argmax=out[7])


def _lost_targets(positions: torch.Tensor,
                  targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lost, targets for the gathered forward)``: the rows whose target this shard owns but no
    support keeps (a computed support need not hold it: its logit is masked, ``-inf``, as on the
    masked tiles; set by the caller), and the gathered positions with those rows pointed at
    position 0 (any gathered row: their target logit is replaced)."""
    lost = (positions < 0) & (targets >= 0)
    return lost, torch.where(lost, 0, positions)


def _masked_forward(backend, hidden, weight, bias, target, call: ShardCall,
                    kept_out: Optional[torch.Tensor], single: bool,
                    target_flag: Optional[torch.Tensor] = None) -> tuple:
    """``(the per-call entry point's outputs, what the forward kept)``: the stats kernel with the
    support's bitmask, in token chunks whose bitmask fits the budget's transient part (the chunks'
    outputs concatenated)."""
    from ..kernels import forward_programs, support_bits
    from ..kernels.kept import KeptTerms

    n, v = hidden.shape[0], weight.shape[0]
    lay = backend._launch_layout(hidden, weight, call)
    kept = backend._kept_buffer(hidden, lay, call, kept_out)
    terms = backend._kept_terms(kept, n, lay)
    rows = support_bits.forward_rows(n, v, lay.transient_bytes, lay.cfg.block_n)
    tma = backend._uses_tma(hidden, weight, call)
    outs = []
    for t0 in range(0, max(n, 1), rows):
        t1 = min(t0 + rows, n)
        whole = t0 == 0 and t1 == n
        part = terms if terms is None or whole else KeptTerms(terms.values[t0:t1],
                                                              terms.scales[t0:t1])
        bits = support_bits.column_bits(call.support[t0:t1], 0, v)
        args = (hidden if whole else hidden[t0:t1], weight, bias,
                target if whole else target[t0:t1], call.kernel_options, lay.cfg)
        if single:
            outs.append(forward_programs.forward_single(*args, tma=tma, kept=part,
                                                        target_flag=target_flag,
                                                        checked=call.inputs_checked, support=bits))
        else:
            outs.append(forward_programs.forward_stats(*args, tma=tma, kept=part,
                                                       checked=call.inputs_checked, support=bits))
        del bits
    if len(outs) == 1:
        return outs[0], kept
    return tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*outs)), kept


def kept_targets(local_target: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """The backward's targets: a row's target where its support keeps it, else ``-1`` (nobody's).
    A support computed from the sampler's parameters need not hold the target (its logp is then
    ``-inf``, the forward's masked target logit): its gradient is that of ``-lse`` over the
    support, with no one-hot term, as on the native source. Given supports always hold their
    targets (the call's checks); ``KEEP_ALL`` rows keep every id. Device ops only."""
    inside = (support == local_target.unsqueeze(1)).any(1) | (support[:, 0] == KEEP_ALL)
    return torch.where(inside, local_target, -1)


__all__ = ["forward_stats", "forward_single", "kept_targets"]
