"""``linear_logp_loss``: a per-token loss of (logp, entropy) reduced to a scalar, with its gradients computed in the
forward, token chunk by token chunk.

Per chunk of tokens (the same number of chunks on every rank): the shard forward (``tp._shard_forward``: the stats,
one small all_gather with a group, the merge) gives fp32 logp and entropy; the loss callable runs on them under
autograd, which gives the per-token upstream gradients ``g_logp`` / ``g_entropy``; the source's backward then gives
the chunk's partial fp32 ``d_hidden`` rows, and adds its ``d_W`` and ``d_b`` to fp32 accumulators (several chunks;
one chunk's are written directly in the weight / bias dtype). The chunk is as many tokens as the kept part of the
memory budget (``workspace_bytes``) holds softmax terms of over the whole vocab (2 bytes per logit for 16-bit
inputs, plus scales), the accumulators counted in it (:func:`plan_chunk_tokens`): its forward keeps them and its
backward forms the probabilities from them instead of recomputing (3 GEMMs instead of 4), every source alike; only
one chunk's terms are alive at a time. ONE all_reduce completes
``d_hidden``: issued by the last chunk's backward as soon as its ``d_hidden`` rows are done (``d_hidden_ready``),
so that it runs under that chunk's ``d_W`` work. The gradients are handed to autograd: the backward only scales
them by the upstream scalar, the fp32 product rounded once (one Triton launch on a GPU, in place when the graph is not
retained and the dtype allows: :func:`_scaled_all`). The per-token tensors are constants (no gradient flows to them).
``with_entropy=False``: the sources compute no entropy statistics and the loss callable gets ``entropy=None``.

On one shard with a budget that keeps nothing beyond the default transient memory, the chunk loop buys nothing (one
chunk, whose logits ``linear_logp`` keeps or recomputes alike): such a call runs as one autograd pass instead,
``linear_logp``'s Function under the loss callable (:func:`one_pass`), or for a built-in loss
(:class:`~tplogp.losses.TokenLoss`, closed-form derivatives) one node, :class:`_OnePassTokenLoss`. Except where the
host is the critical path: a built-in loss on a GPU, in a call of at most :data:`PRECOMPUTE_MAX_MACS`, keeps the
chunk loop (:func:`precomputes`), whose forward queues the backward's kernels right behind its own.

A built-in loss's derivatives replace the autograd run of the callable in both paths; a linear one
(:attr:`~tplogp.losses.TokenLoss.linear`) is reduced as the dot product of its upstream gradients with ``logp`` and
``entropy`` (:func:`_linear_total`), with no per-token loss formed.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from . import checks
from .backends.triton_backend import triton_unavailable_reason
from .comm import OverlappedAllReduce
from .kernels.tiles import KERNEL_DTYPES, interpreting
from .losses import Derivative, PerTokenLoss, TokenLoss
from .tensors import f32_contiguous, zero_rows
from .tp import (LogpOptions, _graph_retained, _saved_tensor_hooks_active, _shard_forward, _TPContext,
                 forward_for_backward, park_kept_scales, prepare_call, prepared_outputs, shard_backward)

REDUCTIONS = ("sum", "mean")


class _PrecomputedGrads(torch.autograd.Function):
    """``loss`` as a function of (hidden, weight, bias) whose gradients were computed in the forward. The backward
    scales each by the upstream scalar ``g``: the fp32 product, rounded once to the input's dtype
    (:func:`_scaled_all`). When the graph is not retained the gradients leave with this backward: one already in the
    input's dtype (one chunk's d_W and d_b, any fp32 one) is scaled in place and handed to autograd without a copy;
    a retained graph's later backward finds them unscaled."""

    @staticmethod
    def forward(ctx, loss, grads, verdict, hidden, weight, bias):
        ctx.grads = grads
        ctx.verdict = verdict  # checks.BackwardVerdict of the call, settled before any gradient is handed over
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, g):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("linear_logp_loss: a second backward through a loss whose first backward did not "
                               "retain the graph (its gradients were handed over then); pass retain_graph=True to "
                               "the first backward to run another")
        verdict = ctx.verdict
        in_place = not _graph_retained()
        if in_place:
            ctx.grads = None  # no reference left here: AccumulateGrad adopts the scaled tensors instead of copying
        scaled = _scaled_all(grads, g, ctx.dtypes, in_place)
        del grads
        if verdict is not None:
            # a bad target raises here, before any gradient is handed over (every rank alike), after the scaling's
            # launches: a wait for the verdict leaves them queued; under a capture its flag zeroes the gradients
            verdict.settle()
            scaled = tuple(verdict.mask(t) for t in scaled)
        return (None, None, None) + scaled


# Elements per block when the CPU (or a dtype the kernel does not take) scales a gradient with torch ops: the fp32
# product is a transient of this size, not of the gradient's (an fp32 [V_local, D] d_W would double its memory).
_SCALE_BLOCK_ELEMENTS = 1 << 24


def _scaled_all(grads: Sequence[Optional[torch.Tensor]], g: torch.Tensor, dtypes: Sequence[Optional[torch.dtype]],
                in_place: bool) -> tuple[Optional[torch.Tensor], ...]:
    """``round(t * g)`` for every gradient ``t`` of ``grads`` (None stays None): the fp32 product of ``t`` and the
    upstream scalar ``g``, rounded once to its ``dtypes`` entry (with ``g == 1``: ``t`` rounded once; bitwise ``t``
    when it is in that dtype). ``in_place``: written over ``t`` when ``t`` is a contiguous tensor of that dtype,
    else into a new tensor of it.

    On a GPU (and on the CPU under Triton's interpreter) ONE launch of :mod:`tplogp.kernels.scale_kernels` scales
    them all, reading ``g`` from its device pointer; elsewhere torch ops in flat blocks of
    ``_SCALE_BLOCK_ELEMENTS``. A ``g`` that requires a gradient (``create_graph=True``) gets differentiable torch
    ops."""
    if g.requires_grad and torch.is_grad_enabled():
        return tuple(None if t is None else (t.to(torch.float32) * g.to(torch.float32)).to(dt)
                     for t, dt in zip(grads, dtypes))
    g32 = None
    outs, pairs = [], []
    for t, dtype in zip(grads, dtypes):
        if t is None:
            outs.append(None)
            continue
        if g32 is None:
            g32 = g.detach() if g.requires_grad else g
            if g32.dtype != torch.float32 or g32.device != t.device:  # (a no-op .to still parses its arguments)
                g32 = g32.to(device=t.device, dtype=torch.float32)
        out = (t if in_place and t.dtype == dtype and t.is_contiguous()
               else torch.empty(t.shape, device=t.device, dtype=dtype))
        outs.append(out)
        if t.numel() == 0:
            continue
        if _scale_kernel_runs(t, dtype):
            pairs.append((t.contiguous(), out))
        else:
            _scaled_by_torch(t, g32, out)
    if pairs:  # (contiguous, of the kernel's dtypes and one shape each; g32 0-d fp32 on their device)
        _scale_launch().scale_round(pairs, g32, checked=True)
    return tuple(outs)


@functools.lru_cache(maxsize=None)
def _scale_launch():
    """:mod:`tplogp.kernels.scale_launch`, imported at the first scaling (it imports Triton)."""
    from .kernels import scale_launch

    return scale_launch


def _scaled_by_torch(t: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> None:
    """``out = round(t * g)`` with torch ops (fp32 product in flat blocks: no gradient-sized fp32 transient)."""
    if t.dtype == torch.float32 and out.dtype == torch.float32:  # the product in fp32 is the result: one op
        if out is t:
            t.mul_(g)
        else:
            torch.mul(t, g, out=out)
        return
    src, dst = t.reshape(-1), out.view(-1)
    for i0 in range(0, src.numel(), _SCALE_BLOCK_ELEMENTS):
        dst[i0:i0 + _SCALE_BLOCK_ELEMENTS] = src[i0:i0 + _SCALE_BLOCK_ELEMENTS].to(torch.float32) * g


def _scale_kernel_runs(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`_scaled_all` runs the Triton kernel: a CUDA tensor, or a CPU one under Triton's interpreter, of
    the dtypes the kernel takes, with Triton installed."""
    on = t.device.type == "cuda" or (t.device.type == "cpu" and interpreting())
    return on and t.dtype in KERNEL_DTYPES and dtype in KERNEL_DTYPES and _triton_usable()


@functools.lru_cache(maxsize=None)
def _triton_usable() -> bool:
    """Triton imports (:func:`tplogp.backends.triton_backend.triton_unavailable_reason`; asked once)."""
    return triton_unavailable_reason() is None


# On a GPU, chunks under this many tokens under-fill the kernels' token tiles (128-256 rows): one chunk that keeps
# the budget's share of its logits and recomputes the rest is then the faster choice.
GPU_MIN_CHUNK_TOKENS = 256


def accumulator_tokens(dim: int, weight_dtype: Optional[torch.dtype], bias_dtype: Optional[torch.dtype]) -> int:
    """What the fp32 ``d_W`` / ``d_b`` accumulators of several chunks take beyond the gradients themselves, in units
    of ``4 * V_local`` bytes (one fp32 row of the shard's vocabulary): ``D`` for a low-precision weight, 1 for a
    low-precision bias; 0 for an fp32 one (its accumulator is its gradient) or one without a gradient (``None``)."""
    low = [t is not None and t != torch.float32 for t in (weight_dtype, bias_dtype)]
    return dim * low[0] + low[1]


def _kept_bytes(backend, n: int, vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes the source keeps for ``n`` tokens' terms of ``vocab`` columns (4 per logit for a source that does not
    say)."""
    kept_bytes = getattr(backend, "kept_bytes", None)
    return kept_bytes(n, vocab, dtype, device) if kept_bytes is not None else 4 * n * vocab


def plan_chunk_tokens(backend, n: int, vocab: int, workspace_bytes: Optional[int], device: torch.device,
                      accumulators: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Tokens per chunk, from sizes that every rank shares (``n``, the global ``vocab``, ``accumulators`` from
    :func:`accumulator_tokens`, the inputs' ``dtype``): the same chunks on every rank.

    The kept part of the budget holds the softmax terms of ``R`` tokens over the whole vocabulary (the source's
    ``kept_bytes``: 2 bytes per logit for 16-bit inputs plus the scales; a rank keeps a chunk's terms of its own
    shard: at most that). ``R >= n``: one chunk, every term kept, ``d_W`` written once. Otherwise several chunks
    sum ``d_W`` (and ``d_b``) in fp32 accumulators (``accumulators * 4 * vocab`` bytes), which count against the
    same kept part: a chunk is the most tokens whose terms fit beside them. Below the minimum chunk (one token;
    ``GPU_MIN_CHUNK_TOKENS`` on a GPU) or when nothing is kept: one chunk, of which the source keeps what the budget
    holds (its first vocab columns or tiles) and recomputes the rest."""
    keep_bytes = getattr(backend, "keep_bytes", None)
    keep = keep_bytes(workspace_bytes, device) if keep_bytes is not None else 0
    if keep <= 0 or _kept_bytes(backend, max(n, 1), vocab, dtype, device) <= keep:
        return max(n, 1)
    room = keep - accumulators * vocab * 4
    chunk, above = 0, n  # the most tokens whose terms fit ``room`` (kept bytes grow with the tokens): bisection
    while above - chunk > 1:
        mid = (chunk + above) // 2
        chunk, above = (mid, above) if _kept_bytes(backend, mid, vocab, dtype, device) <= room else (chunk, mid)
    if chunk < (GPU_MIN_CHUNK_TOKENS if device.type == "cuda" else 1):
        return max(n, 1)
    return chunk


def fused_loss(backend, hidden, weight, target_ids, bias, **kw) -> torch.Tensor:
    """See :func:`tplogp.linear_logp_loss`. The chunk loop runs without autograd (only the loss callable runs
    under it); the result carries the gradients through ``_PrecomputedGrads``. A call that keeps nothing on one
    shard runs as one autograd pass instead (:func:`one_pass`)."""
    _check_token_loss(kw["loss"], kw["per_token"], kw.get("with_entropy", True))
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and isinstance(t, torch.Tensor) and t.requires_grad for t in (hidden, weight, bias))
    if (any(needs) and not precomputes(kw["loss"], hidden, weight)
            and one_pass(backend, hidden, weight, kw["tp_group"], kw["workspace_bytes"])):
        return _one_pass_loss(backend, hidden, weight, target_ids, bias, **kw)
    with torch.no_grad():
        total, grads, verdict = _loss_and_grads(backend, hidden, weight, target_ids, bias, needs, **kw)
    if not any(needs):
        return total
    return _PrecomputedGrads.apply(total, grads, verdict, hidden, weight, bias)


# Calls of at most this many multiply-accumulates (N * D * V_local) are host-bound on a GPU: a TokenLoss then
# computes its gradients in the forward (:func:`precomputes`). Measured at 4096x2048x8192 (2^36) on an H200 only: a
# synced forward+backward of the mean cross-entropy was faster precomputed than in one pass in every process where
# both were timed (docs/operator.md, "Fused loss path").
PRECOMPUTE_MAX_MACS = 1 << 36


def precomputes(loss, hidden, weight) -> bool:
    """Whether a call that :func:`one_pass` would run as one autograd pass computes its gradients in the forward
    instead (the chunk loop, one chunk): a :class:`~tplogp.losses.TokenLoss`, whose derivatives need no autograd
    engine run, on a GPU, in a call of at most :data:`PRECOMPUTE_MAX_MACS`. At such sizes the host's time is the
    critical path: in one pass the GPU waits, between the forward's last kernel and the backward's first, for the
    rest of the forward's host work, autograd's engine and the backward's preparation; precomputing queues the
    backward's kernels right behind the forward's, and the backward only scales the gradients (one pass over
    each). Larger calls keep the one pass, which needs no scaling pass and no fp32 ``d_hidden``; so does the CPU,
    where the host is the device (nothing to overlap) and the scaling runs as torch ops."""
    if not (isinstance(loss, TokenLoss) and isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor)
            and hidden.device.type == "cuda" and weight.dim() >= 1):
        return False
    return hidden.numel() * weight.shape[0] <= PRECOMPUTE_MAX_MACS


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
    if checks.is_capturing(device):
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


class _OnePassTokenLoss(torch.autograd.Function):
    """The reduced loss of a :class:`~tplogp.losses.TokenLoss` as ONE autograd node (the loss callable's own ops
    and the reduction would add one node each, and host time per node in the backward). Forward: ``linear_logp``'s
    shard forward, then the loss's value and closed-form per-token derivatives, summed (over ``count`` for
    ``"mean"``). Backward: the derivatives times the upstream scalar (over ``count``) are the per-token upstream
    gradients of ``linear_logp``'s backward (:func:`tplogp.tp.shard_backward`), which it runs as is."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, local_target, tpc: _TPContext, loss: TokenLoss, extra, ignored,
                count, shard_outputs):
        ctx.set_materialize_grads(False)
        (logp, entropy, _), (row_max, log_sum, mean_rel, kept) = shard_outputs  # (run before apply: kernels first)
        if ignored is not None:  # no NaN of a row nobody owns reaches the loss (nor its derivatives)
            logp, entropy = zero_rows(ignored, logp), None if entropy is None else zero_rows(ignored, entropy)
        if loss.linear:  # the reduced value as a dot product of the coefficients over the count (one op each)
            d_logp, d_entropy = loss.coefficients(*extra)
            n = logp.shape[0]
            total = _linear_total(_token_grads(d_logp, n, logp.device, ignored, count=count), logp,
                                  _token_grads(d_entropy, n, logp.device, ignored, count=count), entropy)
        else:
            value, d_logp, d_entropy = loss.value_and_derivatives(logp, entropy, *extra)
            total = _reduced(zero_rows(ignored, value), count)
        tensors = [t if isinstance(t, torch.Tensor) else None for t in (d_logp, d_entropy)]
        kept = park_kept_scales(kept, tpc)
        ctx.save_for_backward(hidden, weight, bias, local_target, row_max, log_sum, mean_rel, kept, *tensors)
        ctx.constants = tuple(None if isinstance(t, torch.Tensor) else t for t in (d_logp, d_entropy))
        ctx.tpc, ctx.ignored, ctx.count = tpc, ignored, count
        ctx.kept_private = kept is not None and not _saved_tensor_hooks_active()
        return total

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors
        hidden, bias = saved[0], saved[2]
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        if g is None:
            return (None,) * 10
        n, g = hidden.shape[0], g.to(torch.float32)
        g_logp, g_entropy = (_token_grads(t if t is not None else c, n, hidden.device, ctx.ignored, g, ctx.count)
                             for t, c in zip(saved[8:], ctx.constants))
        grads = shard_backward(saved[:8], ctx.tpc, needs, ctx.kept_private, g_logp, g_entropy, None)
        return (*grads, None, None, None, None, None, None, None)


def one_pass(backend, hidden, weight, tp_group, workspace_bytes: Optional[int]) -> bool:
    """Whether a differentiated call runs as one autograd pass (:func:`_one_pass_loss`): one shard (no group, or a
    group of one) whose chunk loop would be one chunk that ``linear_logp`` runs alike. That is a budget that keeps
    nothing beyond the default transient memory (``linear_logp`` keeps a small call's terms under the default,
    :func:`tplogp.kernels.tiles.default_keep`, or recomputes, as the chunk loop would), or one whose kept part holds
    every term of the call (``linear_logp`` keeps them all too: 3 GEMMs either way).
    Computing the gradients in the forward buys no GEMM then, and costs the loss callable's autograd engine run, an
    fp32 ``d_hidden``, the gradients' scaling passes and the gradients held from forward to backward (on an H200 at
    4096x2048x8192 a synced call took 10.20 GEMM-times through the chunk loop, 5.44 in one pass: docs/operator.md);
    a built-in loss needs no engine run, and at host-bound sizes on a GPU precomputes all the same
    (:func:`precomputes`). The same inside and outside a CUDA-graph capture, so that a warm-up runs what the
    capture records."""
    if not (isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor) and hidden.dim() >= 1
            and weight.dim() >= 1):
        return False
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        return False
    keep_bytes = getattr(backend, "keep_bytes", None)
    if keep_bytes is None:
        return True
    keep = keep_bytes(workspace_bytes, hidden.device)
    if keep <= 0:
        return True
    tokens = hidden.numel() // max(hidden.shape[-1], 1)
    return _kept_bytes(backend, max(tokens, 1), weight.shape[0], hidden.dtype, hidden.device) <= keep


def _one_pass_loss(backend, hidden, weight, target_ids, bias, *, loss: PerTokenLoss,
                   per_token: Sequence[torch.Tensor], reduction: str, tp_group, vocab_start_index: int,
                   global_vocab_size: Optional[int], temperature: float, ignore_index: Optional[int],
                   deterministic: bool, workspace_bytes: Optional[int], with_entropy: bool = True) -> torch.Tensor:
    """The loss as ``linear_logp``'s autograd Function under the loss callable: the same checks, row compaction
    and per-token tensors as the chunked path, one chunk; the backward is ``linear_logp``'s (which settles the
    call's target verdict before handing over any gradient)."""
    options = _options(reduction, temperature, with_entropy, ignore_index, deterministic, workspace_bytes)
    prep = prepare_call(backend, hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
                        options, builds_graph=True)
    extra = _per_token_rows(per_token, target_ids.numel(), prep.hidden.device, prep.keep_idx)
    if isinstance(loss, TokenLoss):  # one autograd node for the whole loss
        n, ignored = prep.hidden.shape[0], prep.ignored
        count = _mean_count(reduction, n, ignored)
        return _OnePassTokenLoss.apply(prep.hidden, prep.weight, prep.bias, prep.local_target, prep.tpc, loss,
                                       extra, ignored, count, forward_for_backward(prep))
    logp, entropy, _ = prepared_outputs(prep)
    ignored = prep.ignored  # rows kept in place (the compaction off): out of the loss, as in the chunked path
    if ignored is not None:
        logp, entropy = zero_rows(ignored, logp), None if entropy is None else zero_rows(ignored, entropy)
    per_token_loss = zero_rows(ignored, loss(logp, entropy, *extra))
    return _reduced(per_token_loss, _mean_count(reduction, prep.hidden.shape[0], ignored))


def _options(reduction: str, temperature: float, with_entropy: bool, ignore_index: Optional[int],
             deterministic: bool, workspace_bytes: Optional[int]) -> LogpOptions:
    """The call's :class:`LogpOptions` (``return_entropy`` is ``with_entropy``), once ``reduction`` is checked."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return LogpOptions(temperature=temperature, return_entropy=with_entropy, ignore_index=ignore_index,
                       deterministic=deterministic, workspace_bytes=workspace_bytes)


def _mean_count(reduction: str, n: int, ignored: Optional[torch.Tensor]):
    """What ``"mean"`` divides the sum of the per-token losses by: the rows that count, at least 1 (a Python number
    when no ignored row is kept in place: no host-to-device copy); None for ``"sum"``."""
    if reduction != "mean":
        return None
    return float(max(n, 1)) if ignored is None else (~ignored).sum().clamp_min(1).to(torch.float32)


def _reduced(per_token_loss: torch.Tensor, count) -> torch.Tensor:
    """The call's loss from all its rows' per-token losses: their sum (``count`` None, or no row: 0), or the sum over
    :func:`_mean_count`'s ``count`` (the mean, one op and one autograd node, when every row counts)."""
    if count is None or per_token_loss.numel() == 0:
        return per_token_loss.sum()
    return per_token_loss.mean() if isinstance(count, float) else per_token_loss.sum() / count


def _chunk_part(per_token_loss: torch.Tensor, count) -> torch.Tensor:
    """One chunk's share of the call's loss: the sum of its per-token losses, over the call's ``count`` for
    ``"mean"``."""
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


def _loss_and_grads(backend, hidden, weight, target_ids, bias, needs: tuple[bool, bool, bool], *,
                    loss: PerTokenLoss, per_token: Sequence[torch.Tensor], reduction: str, tp_group,
                    vocab_start_index: int, global_vocab_size: Optional[int], temperature: float,
                    ignore_index: Optional[int], deterministic: bool, workspace_bytes: Optional[int],
                    with_entropy: bool = True):
    """``needs``: the gradients to compute (d_hidden, d_W, d_b); none of them: the loss value alone.
    ``with_entropy=False``: no source computes the entropy statistics; the loss callable gets ``entropy=None``."""
    options = _options(reduction, temperature, with_entropy, ignore_index, deterministic, workspace_bytes)
    # the d_hidden all-reduce runs iff needs[0]: the group check makes every rank agree on it (no hang)
    prep = prepare_call(backend, hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
                        options, builds_graph=needs[0])
    h2, w, b, local_target, keep_idx, tpc, vocab = prep[:7]
    ignored = prep.ignored  # ignored rows kept in place (CUDA-graph capture): masked out of the loss
    n_all = target_ids.numel()
    extra = _per_token_rows(per_token, n_all, h2.device, keep_idx)
    n, d = h2.shape
    differentiate = any(needs)
    # from what requires a gradient, not from grad mode: a call without gradients sums the same chunks
    accumulators = accumulator_tokens(d, weight.dtype if weight.requires_grad else None,
                                      bias.dtype if bias is not None and bias.requires_grad else None)
    chunk = plan_chunk_tokens(backend, n, vocab, workspace_bytes, h2.device, accumulators, h2.dtype)
    # one backward per chunk's forward: the source may write d_logits in place of the chunk's kept terms; d_hidden
    # stays fp32 (the chunks' rows are scaled by the upstream scalar later, rounded once then)
    if differentiate:  # (the call's own context: one per call)
        tpc.call = tpc.call.precomputing
    count = _mean_count(reduction, n, ignored)

    total = None
    n_chunks = -(-n // chunk) if n else 0
    reduce = OverlappedAllReduce(tpc.group, tpc.comm_device) if tpc.world_size > 1 and needs[0] else None
    # one chunk without a group: its d_hidden is the source's (no [N, D] buffer to fill)
    d_hidden = (torch.zeros(n, d, device=h2.device, dtype=torch.float32)
                if needs[0] and (n_chunks > 1 or reduce is not None) else None)
    accumulate = None  # several chunks: d_W and d_b summed unrounded in fp32, rounded once at the end
    if n_chunks > 1 and (needs[1] or needs[2]):
        accumulate = (torch.zeros(w.shape, device=w.device, dtype=torch.float32) if needs[1] else None,
                      torch.zeros(b.shape, device=b.device, dtype=torch.float32) if needs[2] else None)
    d_w = d_b = None
    for t0 in range(0, n, chunk):
        t1 = min(t0 + chunk, n)
        whole = t1 - t0 == n  # one chunk: the call's tensors themselves (no slicing ops: host time)
        h_c, lt_c = (h2, local_target) if whole else (h2[t0:t1], local_target[t0:t1])
        pt = extra if whole else [t[t0:t1] for t in extra]
        (logp, entropy, _), (row_max, log_sum, mean_rel, kept) = _shard_forward(h_c, w, b, lt_c, tpc)
        skip = None if ignored is None else ignored if whole else ignored[t0:t1]
        if skip is not None:  # no NaN of a row nobody owns reaches the loss callable (nor its gradient)
            logp = zero_rows(skip, logp)
            entropy = None if entropy is None else zero_rows(skip, entropy)
        if not differentiate:
            part = _chunk_part(zero_rows(skip, loss(logp, entropy, *pt)), count)
            total = part if total is None else total + part
            continue
        chunk_loss = None  # a linear loss's: from its upstream gradients, once the backward is launched
        if isinstance(loss, TokenLoss):  # closed-form derivatives: no autograd engine run per chunk
            if loss.linear:
                d_logp, d_ent = loss.coefficients(*pt)
            else:
                value, d_logp, d_ent = loss.value_and_derivatives(logp, entropy, *pt)
                chunk_loss = _chunk_part(zero_rows(skip, value), count)
            g_logp = _token_grads(d_logp, t1 - t0, h2.device, skip, count=count)
            g_ent = None if entropy is None else _token_grads(d_ent, t1 - t0, h2.device, skip, count=count)
        else:
            logp = logp.detach().requires_grad_()
            entropy = None if entropy is None else entropy.detach().requires_grad_()
            with torch.enable_grad():
                chunk_loss = _chunk_part(zero_rows(skip, loss(logp, entropy, *pt)), count)
                inputs = [logp] if entropy is None else [logp, entropy]
                g_logp, *g_rest = torch.autograd.grad(chunk_loss, inputs, allow_unused=True)
            g_ent = g_rest[0] if g_rest else None
            chunk_loss = chunk_loss.detach()
        linear_parts = (g_logp, logp, g_ent, entropy) if chunk_loss is None else None
        if g_logp is None:
            g_logp = torch.zeros_like(logp)
        ready = None
        if reduce is not None and t1 == n:  # the last chunk completes d_hidden: reduce it under that chunk's d_W

            def ready(rows, t0=t0, t1=t1):
                d_hidden[t0:t1] = rows
                reduce.start(d_hidden)

        grads = backend.backward(h_c, w, b, lt_c, row_max, log_sum, g_logp.contiguous(),
                                 None if g_ent is None else g_ent.contiguous(), None,
                                 mean_rel if g_ent is not None else None, tpc.call, needs, d_hidden_ready=ready,
                                 kept=kept, accumulate=accumulate)
        del kept  # one chunk's kept logits at a time
        if linear_parts is not None:  # queued behind the backward's kernels
            chunk_loss = _linear_total(*linear_parts)
        total = chunk_loss if total is None else total + chunk_loss
        if d_hidden is not None and not (ready is not None and reduce.started):
            d_hidden[t0:t1] = grads.d_hidden
        elif needs[0] and d_hidden is None:  # the one chunk
            d_hidden = grads.d_hidden
        d_w, d_b = grads.d_weight, grads.d_bias
    if total is None:
        total = torch.zeros((), device=h2.device, dtype=torch.float32)
    if n == 0:
        if needs[0]:
            d_hidden = torch.zeros(n, d, device=h2.device, dtype=torch.float32)
        d_w = torch.zeros_like(weight) if needs[1] else None
        d_b = torch.zeros_like(bias) if needs[2] else None
    if d_hidden is not None:
        if reduce is not None:  # the one all_reduce of d_hidden (started by the last chunk's backward)
            d_hidden = reduce.finish(d_hidden)
        # fp32: rounded once, after the upstream scale
        d_hidden = prep.finish_rows(d_hidden, n_all)
        if d_hidden.shape != hidden.shape:
            d_hidden = d_hidden.view(hidden.shape)
    return total, (d_hidden, d_w, d_b), prep.verdict
