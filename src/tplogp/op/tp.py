"""The shared tensor-parallel layer: one autograd path for every backend (the call arrives
localized, :mod:`tplogp.op.local_call`; the ``torch.library`` ops run the same functions,
:mod:`tplogp.op.packed_op`).

Each rank holds the vocab shard ``[vocab_start_index, vocab_start_index + V_local)`` of the LM head
and the same (replicated) global ``target_ids``. The backend computes per-shard, per-token
statistics (see :mod:`tplogp.backends.base`); this module merges them.

Forward, per call:
  1. ``local_target = target - start`` where this shard owns the target, else ``-1``.
  2. ``backend.forward_stats`` -> ``(m_r, s_r, y_r, q_r)`` per token: shard max, sum of
     ``exp(z - m_r)``, target logit (0 when not owned) and, for entropy,
     ``sum exp(z - m_r)(z - m_r)``.
  3. ONE ``all_gather`` of the packed ``[N, 4 or 5]`` fp32 stats (max, sumexp, target logit, owner
     flag, q). Then on every rank: ``M = max_r m_r``, ``S = sum_r s_r e^{m_r - M}``,
     ``lse = M + log S``, ``logp = (sum_r y_r [owned_r] - M) - log S`` (relative to M: no
     cancellation at peaked targets), ``E_p[z] - M = sum_r e^{m_r - M}(q_r + s_r (m_r - M)) / S``,
     ``entropy = log S - (E_p[z] - M)``; a shard or a row with no unmasked column (``S = 0``) as
     :mod:`tplogp.support.masked_rows` says; a token whose owner count is not 1 gets NaN (possible
     only when the target check is skipped, ``TPLOGP_CHECKS=fast``, or deferred, ``full``:
     :mod:`tplogp.op.verdicts`).
The call arrives checked (:func:`tplogp.op.plan.prepare`: the plan and the call's verdict; one shard
on the triton / sm90 sources the finishing kernel checks the targets, ``Call.target_check``); the
backward settles the call's target verdict (:meth:`tplogp.op.verdicts.BackwardVerdict.settle`)
before it hands any gradient to autograd: with a group first, before the ``d_hidden`` all-reduce;
with one shard after launching its kernels, so that a wait for the verdict leaves them queued.
Backward: ``backend.backward`` with the global ``(M, log S)`` (and ``E_p[z] - M``) gives local
``d_weight``/``d_bias`` and a partial fp32 ``d_hidden``; ONE ``all_reduce`` (fp32) of ``d_hidden``
completes it. The backend computes ``d_hidden`` before ``d_W`` and hands it over
(``d_hidden_ready``) as soon as it is complete: the all-reduce is issued async there and runs while
``d_W`` is computed. When no later backward can read what the forward kept (:func:`consumes_kept`:
the graph is not retained), the backend may overwrite it (``ShardCall.consume_kept``).

Sequence parallelism (``sequence_parallel=True``, a group of several ranks): hidden is this rank's
contiguous slice of the tokens, rank-major. :func:`tplogp.op.local_call.localize` gathers the slices
(ONE ``all_gather``, before the first GEMM: the sources run one kernel sequence over all rows, which
the gather must precede) and the rows run as above; the backward's ``d_hidden`` is reduce-scattered
instead of all-reduced (:class:`~tplogp.support.comm.OverlappedReduceScatter`, started at
``d_hidden_ready`` like the all-reduce, under the ``d_W`` work): each rank receives its slice, half
the bytes of an all-reduce. Ignored rows stay in place under sequence parallelism (no compaction:
the slices are fixed). ``hidden_grad="partial"`` skips the ``d_hidden`` collective: each rank's
gradient is its shard's share, which the caller sums
(:func:`tplogp.support.comm.overlapped_reduce`).

Without a group (or a group of one) the same code runs with no collectives; a backend with
``forward_single`` (native, triton, sm90) then gets the target ids as given and finishes
logp / lse / entropy in its own kernels, so steps 1 and 3 cost no host ops (what matters at small
shapes, where a call's host time is most of its latency). Rows whose target equals ``ignore_index``
are compacted away before any GEMM and get logp = entropy = lse = 0 and no gradient."""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

from ..support import invariant
from . import local_call
from ..backends import support_pairs
from ..backends.base import KeptBuffers, ShardCall
from ..support.comm import all_gather_flat, overlapped_reduce
from .local_call import LocalCall, TPContext
from ..support.masked_rows import settle_rows
from ..outputs import LinearLogpResult, pack_outputs
from ..support.tensors import current_stream, f32_contiguous, finish_rows


def merge_stats(stats_all: torch.Tensor, with_entropy: bool, with_sum_z: bool = False,
                with_argmax: bool = False) -> tuple[torch.Tensor, ...]:
    """Merge packed per-rank stats ``[W, N, K]`` -> (M, log S, lse, target logit - M, owner count,
    E_p[z] - M or None, sum_z or None, argmax or None); a row with no unmasked column anywhere is
    settled by :func:`tplogp.support.masked_rows.settle_rows`.

    Columns: max, sum of exp, target logit, owner flag, then q (entropy), sum_z and the global
    argmax id (each when asked). ``sum_z`` adds over the ranks; the argmax is the lowest global id
    among the ranks whose max is ``M``.

    Everything is kept relative to the global max ``M`` so that ``z - M`` is exact at the max: the
    logp of a peaked target is ``(y - M) - log S`` with no cancellation between two large numbers.
    """
    m = stats_all[..., 0]
    s = stats_all[..., 1]
    y = stats_all[..., 2]
    owned = stats_all[..., 3]
    big_m = m.amax(0)
    # m_r - M, 0 for a shard with no unmasked column (s_r = 0, m_r = -inf: it adds 0)
    rel = torch.where(s > 0, m - big_m.unsqueeze(0), torch.zeros_like(s))
    scale = torch.exp(rel)
    total = (s * scale).sum(0)
    count = owned.sum(0)
    sez = None
    if with_entropy:
        sez = (scale * (stats_all[..., 4] + s * rel)).sum(0)
    top = big_m  # (the argmax's: -inf on a row with every column masked, where the settled M is 0)
    big_m, log_sum, lse, mean_rel = settle_rows(big_m, total, sez)  # (empty rows: masked_rows)
    target_rel = (torch.where(owned > 0, y - big_m.unsqueeze(0), torch.zeros_like(y))).sum(0)
    col = 5 if with_entropy else 4
    sum_z = argmax = None
    if with_sum_z:
        sum_z = stats_all[..., col].sum(0)
        col += 1
    if with_argmax:
        ids = stats_all[..., col]
        argmax = torch.where(m == top.unsqueeze(0), ids, float("inf")).amin(0)
    return big_m, log_sum, lse, target_rel, count, mean_rel, sum_z, argmax


def shard_forward(hidden, weight, bias, local_target, tpc: TPContext, call: ShardCall,
                  kept_out: Optional[torch.Tensor] = None):
    """The forward of one call's rows (all of them, or a chunk of the fused loss).

    The one place where a forward's stats are gathered and merged, for every source and for both
    ops.

    Args:
        hidden, weight, bias, local_target: a :class:`LocalCall`'s tensors (rows of them).
        tpc: the call's context (``LocalCall.tpc``).
        call: the settings the source runs with: ``tpc.call``, ``tpc.call_for_backward`` (a
            forward that is differentiated) or a variant derived from one (``ShardCall.flat_kept``,
            ``precomputing``, ``for_rows``).
        kept_out: the flat buffer the source keeps into (the op's, :func:`forward_packed`), or None.
    Returns:
        ``((logp, entropy | None, lse, argmax | None, sum_z | None), (row_max, log_sum,
        mean_rel | None, kept))``: the outputs and what :func:`shard_backward` takes (``mean_rel``
        is ``E_p[z] - M``; ``argmax``: fp32 global ids, with ``ShardCall.with_argmax``; ``sum_z``:
        sum_v z over the whole vocabulary, with ``with_sum_z``).
    """
    be = tpc.backend
    # per-block stats, merged exactly (the same bits for every rank count)
    if tpc.regrid is not None:
        blocks = be.forward_blocks(hidden, weight, bias, local_target, call)
        row_max, log_sum, lse, target_rel, count, mean_rel, sum_z, argmax = invariant.merge_blocks(
            blocks, local_target >= 0, tpc.regrid, call.with_entropy, call.with_sum_z,
            call.with_argmax)
        logp = torch.where(count == 1, target_rel - log_sum, float("nan"))
        entropy = None if mean_rel is None else log_sum - mean_rel
        return (logp, entropy, lse, argmax, sum_z), (row_max, log_sum, mean_rel, None)
    # a support that came with its logits (the sampler's, in a 16-bit call): the statistics from
    # them, whatever the source, where the forward keeps nothing (no pass over the vocabulary)
    given = call.support_logits is not None and kept_out is None
    if tpc.single:  # no merge: the backend's kernels finish logp / lse / entropy (fewest host ops)
        check = tpc.target_check
        flag = None if check is None else check.flag
        if given:
            out = support_pairs.given_single(local_target, weight.shape[0], call, flag)
        elif check is None:
            out = be.forward_single(hidden, weight, bias, local_target, call, kept_out=kept_out)
        else:  # and check the targets: no launch or copy of the checks' own
            out = be.forward_single(hidden, weight, bias, local_target, call, target_flag=flag,
                                    kept_out=kept_out)
        # the point the host waits for before reading the flag's slot
        if check is not None and check.ready is not None:
            check.ready.record(current_stream(hidden.device))
        return (out.logp, out.entropy, out.lse, out.argmax, out.sum_z), (out.row_max, out.log_sum,
                                                                         out.mean_rel,
                                                                          out.kept)
    st = (support_pairs.given_stats(local_target, weight.shape[0], call) if given else
          be.forward_stats(hidden, weight, bias, local_target, call, kept_out=kept_out))
    owned = local_target >= 0
    if tpc.world_size > 1:
        cols = [st.row_max, st.sum_exp, st.target_logit, owned.to(torch.float32)]
        if call.with_entropy:
            cols.append(st.sum_exp_z)
        if call.with_sum_z:
            cols.append(st.sum_z)
        if call.with_argmax:  # global ids (exact in fp32: validation.MAX_ARGMAX_VOCAB)
            cols.append(st.argmax + tpc.vocab_start if tpc.vocab_start else st.argmax)
        packed = torch.stack(cols, dim=1)  # [N, K]
        recv = all_gather_flat(packed.to(tpc.comm_device), tpc.group)
        stats_all = recv.view(tpc.world_size, *packed.shape).to(hidden.device)
        row_max, log_sum, lse, target_rel, count, mean_rel, sum_z, argmax = merge_stats(
            stats_all, call.with_entropy, call.with_sum_z, call.with_argmax)
        # always true after full checks; fast mode turns uncovered tokens into NaN
        covered = count == 1
    else:  # one shard: the merge is the identity; few ops keep the host cost low
        row_max, log_sum, lse, mean_rel = settle_rows(st.row_max, st.sum_exp, st.sum_exp_z)
        target_rel = st.target_logit - row_max
        covered = owned
        sum_z = st.sum_z
        argmax = None if st.argmax is None else st.argmax + tpc.vocab_start if tpc.vocab_start else st.argmax
    logp = torch.where(covered, target_rel - log_sum, float("nan"))
    entropy = None if mean_rel is None else log_sum - mean_rel
    return (logp, entropy, lse, argmax, sum_z), (row_max, log_sum, mean_rel, st.kept)


def _without_autocast(backward):
    """Run ``backward`` with autocast off, so the sources see the dtypes of the forward also when
    the backward runs inside an autocast region (CPU autograd runs the backward on the caller's
    thread, with its autocast state)."""

    @functools.wraps(backward)
    def run(*args):
        on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        if not on:
            return backward(*args)
        with contextlib.ExitStack() as stack:
            for device_type in on:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            return backward(*args)

    return run


def saved_tensor_hooks_active() -> bool:
    """Whether ``torch.autograd.graph.saved_tensors_hooks`` are installed: a pack hook may hold the
    very tensors that are saved (True also when this torch cannot say)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    try:
        return top(True) is not None
    except TypeError:  # a torch whose query takes no argument
        try:
            return top() is not None
        except Exception:
            return True
    except Exception:
        return True


def graph_retained() -> bool:
    """Whether the running backward keeps the graph for another one
    (``retain_graph`` / ``create_graph``; True outside a backward, under a compiler's tracing and
    when this torch cannot say)."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if query is None or torch.compiler.is_compiling():
        return True
    try:
        return bool(query())
    except Exception:
        return True


def consumes_kept(kept: Optional[torch.Tensor], private: bool) -> bool:
    """Whether a backward may overwrite what its forward kept (``ShardCall.consume_kept``: the
    triton / sm90 sources then write d_logits in place of the kept terms and run full-size GEMMs):
    only when no later backward can read them (the graph is not retained) and nothing else holds
    them (``private``: saved with no saved-tensor hooks, so the autograd node holds the only
    reference, which it drops after this backward)."""
    return kept is not None and private and not graph_retained()


def park_kept_scales(kept, tpc: TPContext) -> Optional[torch.Tensor]:
    """What an autograd context saves of what the forward kept: the terms buffer. Scales kept apart
    (:class:`~tplogp.backends.base.KeptBuffers`) go to ``tpc.kept_scales`` instead, which the
    backward can empty (saved tensors live until the backward returns)."""
    if isinstance(kept, KeptBuffers):
        tpc.kept_scales = kept.scales
        return kept.values
    return kept


class _LinearLogpFunction(torch.autograd.Function):
    """``linear_logp``'s autograd node. ``forward`` takes what :func:`shard_forward` returned for
    these inputs, run just before ``apply`` (:func:`forward_for_backward`): the kernels are launched
    before autograd's machinery runs, which at small shapes is host time the GPU would wait for."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, local_target, tpc: TPContext, shard_outputs, rows):
        # rows: what the sources computed on, hidden itself or (sequence-parallel) every rank's
        # slices gathered
        ctx.tpc = tpc  # (the backward runs with tpc.call_for_backward, as the forward did)
        ctx.set_materialize_grads(False)
        outputs, (row_max, log_sum, mean_rel, kept) = shard_outputs
        kept = park_kept_scales(kept, tpc)
        ctx.save_for_backward(rows, weight, bias, local_target, row_max, log_sum, mean_rel, kept)
        ctx.kept_private = kept is not None and not saved_tensor_hooks_active()
        if outputs[3] is not None:
            ctx.mark_non_differentiable(outputs[3])
        return outputs[:4]

    @staticmethod
    def backward(ctx, g_logp, g_entropy, g_lse, _g_argmax):
        saved = ctx.saved_tensors  # (unpacked once: each access unpacks every saved tensor again)
        needs = ctx.needs_input_grad
        needs = (needs[0], needs[1], saved[2] is not None and needs[2])
        tpc = ctx.tpc
        return (*shard_backward(saved, tpc, tpc.call_for_backward, needs, ctx.kept_private, g_logp,
                                g_entropy, g_lse), None, None, None, None)


@_without_autocast
def shard_backward(saved: tuple, tpc: TPContext, call: ShardCall, needs: tuple[bool, bool, bool],
                   kept_private: bool, g_logp: Optional[torch.Tensor],
                   g_entropy: Optional[torch.Tensor],
                   g_lse: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
    """The backward of one call: the source's backward, the d_hidden collective with a group
    (all-reduce, or reduce-scatter of a sequence-parallel hidden; none for
    ``hidden_grad="partial"``), and the call's target verdict settled before any gradient is handed
    over.

    One function for the autograd Function and the op's backward, so the collective and the verdict
    have one place.

    Args:
        saved: what the forward saved, ``(rows, weight, bias, local_target, row_max, log_sum,
            mean_rel, kept)`` (``rows``: hidden, or every rank's slices gathered).
        tpc: the call's context (``LocalCall.tpc``).
        call: the settings of the call's backward (``tpc.call_for_backward`` after an eager
            forward that kept for it, ``tpc.call`` for the op's); its consuming variant
            (``ShardCall.consuming``) runs where the backward may overwrite what was kept.
        needs: whether ``(d_hidden, d_weight, d_bias)`` are wanted.
        kept_private: nothing but the caller's autograd node holds ``kept`` (:func:`consumes_kept`).
        g_logp, g_entropy, g_lse: the per-token upstream gradients (None: none flows there).
    Returns:
        ``(d_hidden, d_weight, d_bias)``, None where not needed; d_hidden in hidden's dtype (this
        rank's rows under sequence parallelism).
    Raises:
        LinearLogpInputError: the call's deferred target check found a bad target.
    """
    hidden, weight, bias, local_target, row_max, log_sum, mean_rel, kept = saved
    verdict = tpc.verdict
    # a group's pending check settles before the d_hidden all-reduce (every rank raises before
    # entering it)
    settle_first = verdict is not None and verdict.group is not None and verdict.pending is not None
    if settle_first:  # a bad target raises here, before the d_hidden all-reduce (every rank alike)
        verdict.settle()
    if g_logp is None:  # only entropy or lse feeds the loss
        g_logp = torch.zeros(hidden.shape[0], device=hidden.device, dtype=torch.float32)
    g_logp = f32_contiguous(g_logp)
    g_ent = None if (g_entropy is None or mean_rel is None) else f32_contiguous(g_entropy)
    g_lse_ = None if g_lse is None else f32_contiguous(g_lse)
    # the d_hidden collective starts as soon as the backend has finished d_hidden and runs under its
    # d_W work
    reduce = overlapped_reduce(tpc.hidden_reduce, tpc.group, tpc.comm_device)
    consuming = consumes_kept(kept, kept_private)
    call = call.consuming if consuming else call
    if tpc.kept_scales is not None:  # scales kept apart: handed over in a holder the source empties
        kept = KeptBuffers(kept, tpc.kept_scales)
        # no later backward reads them: the source's d_logits launcher frees them once read
        if consuming:
            tpc.kept_scales = None
    grads = tpc.backend.backward(hidden, weight, bias, local_target, row_max, log_sum, g_logp,
                                 g_ent, g_lse_, mean_rel if g_ent is not None else None, call,
                                 needs, d_hidden_ready=None if reduce is None else reduce.start,
                                 kept=kept)
    d_hidden = grads.d_hidden if reduce is None else reduce.finish(grads.d_hidden)
    if d_hidden is not None and d_hidden.dtype != hidden.dtype:
        d_hidden = d_hidden.to(hidden.dtype)
    if verdict is not None and not settle_first:
        # after the launches (a wait for the forward's verdict leaves the backward's kernels
        # queued), before any
        # gradient is handed to autograd: raises (the gradients computed are dropped), or zeroes a
        # captured call's
        return verdict.settle((d_hidden, grads.d_weight, grads.d_bias))
    return d_hidden, grads.d_weight, grads.d_bias


def local_outputs(local: LocalCall) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor,
                                             Optional[torch.Tensor]]:
    """``(logp, entropy | None, lse, argmax | None)`` of a local call's rows (compacted ones
    absent): through the autograd Function when something requires a gradient (the forward may then
    keep logits for the backward), else the bare forward (scoring, rollouts: no autograd.Function
    machinery, host time)."""
    h2, w, b, local_target, tpc = local.hidden, local.weight, local.bias, local.local_target, local.tpc
    h_in = h2 if local.own_rows is None else local.own_rows  # (what the gradient flows to)
    if torch.is_grad_enabled() and (h_in.requires_grad or w.requires_grad
                                    or (b is not None and b.requires_grad)):
        return _LinearLogpFunction.apply(h_in, w, b, local_target, tpc, forward_for_backward(local),
                                         h2)
    return shard_forward(h2, w, b, local_target, tpc, tpc.call)[0][:4]


def forward_for_backward(local: LocalCall) -> tuple:
    """:func:`shard_forward` of a local call whose results will be differentiated (its context's
    ``call_for_backward``: the source may keep terms for the backward), run before the call's
    autograd ``Function.apply``, which takes the results: the kernels are launched before autograd's
    machinery runs (host time at small shapes)."""
    tpc = local.tpc
    # (what a Function's forward runs under: the native source's torch ops record nothing)
    with torch.no_grad():
        return shard_forward(local.hidden, local.weight, local.bias, local.local_target, tpc,
                             tpc.call_for_backward)


def linear_logp(call) -> LinearLogpResult:
    """Run a checked call eagerly: localize, the shared forward (through the autograd Function when
    differentiated), and the outputs in the targets' shape.

    A forward that is not differentiated skips the autograd Function (scoring, rollouts: less host
    time).

    Args:
        call: a :class:`tplogp.op.plan.Call` from :func:`tplogp.op.plan.prepare`.
    Returns:
        The logp tensor, or the named tuple of :mod:`tplogp.outputs` that holds the requested
        outputs.
    """
    target_ids, options = call.args.target_ids, call.args.options
    out_shape = target_ids.shape
    local = local_call.localize(call)
    logp, entropy, lse, argmax = local_outputs(local)
    if local.keep_idx is not None or local.ignored is not None:
        n_all, keep_idx, ignored = target_ids.numel(), local.keep_idx, local.ignored
        logp, lse = finish_rows(logp, n_all, keep_idx, ignored), finish_rows(lse, n_all, keep_idx,
                                                                             ignored)
        entropy = None if entropy is None else finish_rows(entropy, n_all, keep_idx, ignored)
        argmax = None if argmax is None else finish_rows(argmax, n_all, keep_idx, ignored)
    if len(out_shape) != 1:
        logp = logp.view(out_shape)
        entropy = None if entropy is None else entropy.view(out_shape)
        lse = lse.view(out_shape)
        argmax = None if argmax is None else argmax.view(out_shape)
    return pack_outputs(logp, entropy, lse, options.return_entropy, options.return_lse,
                        None if argmax is None else argmax.to(torch.int64))
