"""The public operator ``linear_logp``, ``linear_logp_loss`` and ``get_op``, the per-source
callables.

One front serves both ops, then the call goes down once: :func:`tplogp.op.plan.prepare` (source,
every check, the layout's plan, the call's verdict) and :mod:`tplogp.op.tp` (the autograd Function,
the collectives, the source). Under ``torch.compile`` the same two steps run inside the
``torch.library`` ops of :mod:`tplogp.op.ops` (one opaque node each for forward and backward;
:mod:`tplogp.op.compiled_calls` says which calls cross their schemas and calls them); eager calls
skip the op's dispatch, whose host time matters at small shapes.

The front:

1. DTensor weights (vocab-sharded ``Shard(0)``) become their local shard plus the group, vocab start
   and global vocab of the mesh dimension they are sharded over (:mod:`tplogp.op.dtensor`).
2. Under ``torch.autocast(device_type, dtype=X)`` hidden, weight and bias are cast to X, as
   ``F.linear`` would use them, and the call runs with autocast off; the casts are differentiable,
   so gradients reach the original tensors in their own dtypes.
3. Under ``torch.compile`` the op returns one packed fp32 result; logp (and entropy, lse) are views
   of it with the targets' shape.

Arguments of the wrong Python type cannot cross the op's schema; such calls run the eager path,
whose checks raise the same clear error on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Callable, Optional, Sequence, Union

import torch

from .op import compiled_calls, plan, tp
from .op.dtensor import unwrap_dtensors
from .backends.kernel_registry import check_op, check_source, require_source
from .outputs import LinearLogpResult
from .op.options import DEFAULTS, LOSS_OP, LogpOptions, names_of
from .op.validation import EntryCheck, LinearLogpInputError

# (with_sum_z is the fused loss's: linear_logp returns no sum of the logits)
_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(LogpOptions)) - {"with_sum_z"}
AUTOMATIC = (None, "registry", "auto")  # the source names that leave the choice to the registry


def _options(kwargs: dict) -> LogpOptions:
    unknown = set(kwargs) - _OPTION_NAMES
    if unknown:
        raise TypeError(f"linear_logp got unexpected keyword argument(s) {sorted(unknown)}; options are "
                        f"tp_group, vocab_start_index, global_vocab_size, {', '.join(sorted(_OPTION_NAMES))}")
    return LogpOptions(**kwargs)


def autocast_inputs(device_type: str, hidden, weight, bias):
    """Under ``torch.autocast(device_type, dtype=X)``: hidden, weight and bias in X, as ``F.linear``
    would use them.

    The casts are ordinary differentiable ``.to`` calls, so gradients reach the original tensors in
    their own dtypes (fp32 parameters get fp32 gradients). Outside autocast the inputs come back as
    given.
    """
    if not torch.is_autocast_enabled(device_type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        return t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != dtype else t

    return cast(hidden), cast(weight), cast(bias)


def _front(body: Callable, hidden, weight, target_ids, bias, *rest):
    """``body(hidden, weight, target_ids, bias, *rest)`` after the autocast step of the module
    docstring (DTensors are unwrapped before): inputs cast like ``F.linear``, autocast off inside.
    Arguments of other types are not cast (the checks raise their error, on every rank)."""
    device = hidden.device if isinstance(hidden, torch.Tensor) else None
    if (device is None or not torch.is_autocast_enabled(device.type)
        or not isinstance(weight, torch.Tensor)
            or not (bias is None or isinstance(bias, torch.Tensor))):
        return body(hidden, weight, target_ids, bias, *rest)
    hidden, weight, bias = autocast_inputs(device.type, hidden, weight, bias)
    with torch.autocast(device.type, enabled=False):
        return body(hidden, weight, target_ids, bias, *rest)


def _eager(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index: int,
           global_vocab_size: Optional[int], options: LogpOptions,
           entry: Optional[EntryCheck] = None) -> LinearLogpResult:
    """The eager call: the plan, then the tensor-parallel layer. ``entry``: an integration's own
    check, raised with the op's (:func:`linear_logp_entry`)."""
    builds_graph = torch.is_grad_enabled() and isinstance(hidden, torch.Tensor) and hidden.requires_grad
    return tp.linear_logp(plan.prepare(source, hidden, weight, target_ids, bias, tp_group,
                                       vocab_start_index, global_vocab_size, options, builds_graph,
                                       entry))


def any_dtensor(*xs) -> bool:
    """Whether one of ``xs`` is a DTensor (without importing the DTensor package when nothing has
    made one): the front's question on every call, asked here (:mod:`tplogp.op.dtensor` unwraps
    the calls that hold one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and any(isinstance(x, module.DTensor) for x in xs)


def _run(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index: int,
         global_vocab_size: Optional[int], options: LogpOptions) -> LinearLogpResult:
    if any_dtensor(weight, hidden):
        return unwrap_dtensors(functools.partial(_run, source), hidden, weight, target_ids, bias,
                               tp_group, vocab_start_index, global_vocab_size, options)
    body = _eager
    if torch.compiler.is_compiling():
        if compiled_calls.fits_op_schema(hidden, weight, target_ids, bias, vocab_start_index,
                                         global_vocab_size, options):
            # (other calls run eagerly: their checks raise the error, on every rank)
            body = compiled_calls.linear_logp
        elif options.support is not None:  # (untraced: the sources' kernels launch as in eager)
            body = _eager_support
    return _front(functools.partial(body, source), hidden, weight, target_ids, bias, tp_group,
                  vocab_start_index, global_vocab_size, options)


def linear_logp_entry(entry: EntryCheck, hidden, weight, target_ids, bias=None, *, tp_group=None,
                      vocab_start_index: int = 0, global_vocab_size: Optional[int] = None,
                      **options) -> LinearLogpResult:
    """:func:`linear_logp` for an integration's entry point (:mod:`tplogp.integrations`): the
    entry's own problem and options (``entry``) are checked with the op's, so with a group every
    rank raises the same error and ranks whose options differ raise alike. Under ``torch.compile``
    (whose op carries no entry) the entry's problem raises at once."""
    opts = _options(options)
    layout = (tp_group, vocab_start_index, global_vocab_size, opts)
    if torch.compiler.is_compiling():
        if entry.problem is not None:
            raise LinearLogpInputError(entry.problem)
        return _run(None, hidden, weight, target_ids, bias, *layout)
    run = functools.partial(_eager_entry, entry)
    if any_dtensor(weight, hidden):
        return unwrap_dtensors(run, hidden, weight, target_ids, bias, *layout)
    return run(hidden, weight, target_ids, bias, *layout)


def _eager_entry(entry: EntryCheck, hidden, weight, target_ids, bias, *layout) -> LinearLogpResult:
    """:func:`_eager` with ``entry``, after the autocast front (``layout``: group, vocab start,
    global vocab, options)."""
    return _front(functools.partial(_eager, None, entry=entry), hidden, weight, target_ids, bias,
                  *layout)


def linear_logp_on(source, hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, *, tp_group=None,
                   vocab_start_index: int = 0, global_vocab_size: Optional[int] = None,
                   options: LogpOptions = LogpOptions()) -> LinearLogpResult:
    """:func:`linear_logp` on ``source``: a source name, None (the registry's choice), or a backend
    object (a source configured by hand, as tests and benchmarks use)."""
    return _run(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                global_vocab_size, options)


def linear_logp(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    tp_group=None,
    vocab_start_index: int = 0,
    global_vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    return_entropy: bool = False,
    return_lse: bool = False,
    return_argmax: bool = False,
    ignore_index: Optional[int] = None,
    deterministic: Union[bool, str] = False,
    workspace_bytes: Optional[int] = None,
    sequence_parallel: bool = False,
    hidden_grad: str = "reduced",
    support=None,
    top_k=None,
    top_p=None,
    min_p=None,
) -> LinearLogpResult:
    """Per-token log-probability of ``target_ids`` through a (vocab-sharded) LM head.

    ``logp[t] = log_softmax(z)[t, target_ids[t]]`` with ``z = cap(hidden @
    weight.T + bias) / temperature`` and ``cap(y) = softcap * tanh(y / softcap)`` (the identity when
    ``softcap`` is None), over the whole vocabulary of all ranks of ``tp_group``, without
    materializing the ``[tokens, vocab]`` logits. Differentiable in hidden, weight and bias for any
    upstream gradient. Traced by ``torch.compile`` as one op (no graph breaks); under
    ``torch.autocast`` hidden, weight and bias are used in the autocast dtype (outputs stay fp32).

    Args:
        hidden: ``[N, D]`` or ``[B, S, D]``, float32 / bfloat16 / float16 (plain, or a DTensor
            replicated over the weight's vocab mesh dimension).
        weight: ``[V_local, D]``, this rank's rows ``[vocab_start_index,
            vocab_start_index + V_local)``, hidden's dtype; or a DTensor ``[V, D]`` placed
            ``Shard(0)`` on one mesh dimension (then group, vocab start and global vocab come from
            it and must not be passed).
        target_ids: integer global token ids with hidden's leading shape, the same on every rank.
        bias: ``[V_local]`` or None (a DTensor when weight is one, with the same placements).
        tp_group: the process group the vocab is sharded over (None: the weight is the whole vocab).
        vocab_start_index: first global id of this rank's shard (shards may be uneven).
        global_vocab_size: total vocab; inferred from the shards when None.
        temperature: logits are divided by it before the softmax (after the softcap; gradients
            follow).
        softcap: None, or a positive finite float ``c``: final-logit softcapping ``c * tanh(y / c)``
            (Gemma 2 / 3), fused into the kernels' epilogue with its derivative in the backward (no
            logits in memory).
        return_entropy: also return the entropy of the full-vocab distribution per token
            (differentiable).
        return_lse: also return the merged log-sum-exp per token (differentiable, for z-loss / KL
            terms).
        return_argmax: also return the full-vocabulary argmax id of ``z`` per token (int64, the
            lowest id on ties, merged across the group's ranks; not differentiable), for
            token-accuracy metrics.
        ignore_index: positions with this target get logp 0 (entropy 0, lse 0, argmax 0) and no
            gradient.
        deterministic: bitwise reproducible outputs and gradients, and per-row results that do not
            depend on the other rows of the batch (costs some speed: fixed tiling, no cuBLAS
            ``d_hidden`` on triton / sm90). ``"tp_invariant"``: that, and logp, entropy, lse and
            argmax with the same bits at every TP degree and for any shard boundaries,
            ``weight.grad`` / ``bias.grad`` rows equal to the same rows at TP=1 (vocabularies below
            2^23; docs/operator.md, "Determinism"; under ``torch.compile`` the call runs eagerly).
        workspace_bytes: the most memory the op may hold beyond inputs, outputs and gradients: the
            source's transient tiles up to its default size, the rest softmax terms kept for the
            backward (docs/operator.md, "Memory budget"). None: ``TPLOGP_WORKSPACE_MB``, else the
            source's default, one row per source in that section's table (``triton`` / ``sm90`` then
            keep a small call's terms whole, 3 GEMMs, unless ``deterministic``).
        sequence_parallel: with ``tp_group``, hidden is this rank's contiguous slice of the tokens,
            rank-major: its rows (leading dimensions flattened) are tokens
            ``[r * N / world, (r + 1) * N / world)`` of target_ids' ``N`` (flattened; target_ids and
            the outputs are all ``N`` tokens, on every rank). The slices are gathered before the
            GEMMs and ``hidden.grad`` is this rank's slice of the full gradient (reduce-scattered).
            Megatron's sequence-parallel layout; docs/operator.md, "Sequence parallelism".
        hidden_grad: with ``tp_group``, ``"reduced"`` (default): ``hidden.grad`` is the full
            gradient (summed over the ranks; under ``sequence_parallel`` this rank's slice of it);
            ``"partial"``: each rank's ``hidden.grad`` is its vocab shard's share, not summed (no
            collective), for callers that sum it themselves (the backward of their own gather). Not
            with ``sequence_parallel``.
        support: the sampler's kept ids per token, as GLOBAL vocabulary ids: an integer tensor of
            shape ``target_ids.shape + (K,)`` (``-1`` for none, any order) or a CSR pair
            ``(offsets [N + 1], ids)`` over the flattened tokens. logp, entropy and lse are then
            those of the distribution renormalized over each token's ids, and the gradients reach
            their logits only; each token's support must hold its target once (a token whose target
            is ``ignore_index`` needs none). Runs on the native source (triton / sm90 refuse it),
            eagerly; not with ``deterministic="tp_invariant"`` (docs/operator.md, "Sampler's
            support").
        top_k, top_p, min_p: the sampler's parameters, instead of ``support``: each a number for
            every token or a tensor of target_ids' shape (one value per token); ``top_k`` -1 or 0,
            ``top_p`` 1, ``min_p`` 0 switch a filter off (vLLM's values). The support is computed
            from the logits as vLLM's v1 sampler keeps its ids (temperature, then min-p, then
            top-k with every id tied with the k-th, then top-p over the renormalized rest; ties at
            the top-p boundary keep the lower ids: :mod:`tplogp.op.sampler_support`), at the cost
            of one more forward pass over the vocabulary (and one collective with a group); then
            as with ``support``. A token whose target is outside its support gets logp ``-inf``.

    Returns:
        float32 logp with target_ids' shape; with ``return_entropy``, ``return_lse`` and/or
        ``return_argmax`` a named tuple of exactly the requested outputs in the order logp, entropy,
        lse, argmax, which unpacks: ``logp, entropy = ...`` (:class:`~tplogp.outputs.LogpEntropy`),
        ``logp, lse = ...`` (:class:`~tplogp.outputs.LogpLse`), ``logp, entropy, lse = ...``
        (:class:`~tplogp.outputs.LogpEntropyLse`), ``logp, argmax = ...``
        (:class:`~tplogp.outputs.LogpArgmax`), and so on (:mod:`tplogp.outputs`). With a DTensor
        hidden, each is a DTensor with hidden's placements (replicated over the vocab dimension).
    """
    return _run(None, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                global_vocab_size,
                LogpOptions(temperature=temperature, return_entropy=return_entropy,
                            return_lse=return_lse, ignore_index=ignore_index,
                            deterministic=deterministic, workspace_bytes=workspace_bytes,
                            sequence_parallel=sequence_parallel, hidden_grad=hidden_grad,
                            softcap=softcap, return_argmax=return_argmax, support=support,
                            top_k=top_k, top_p=top_p, min_p=min_p))


@functools.lru_cache(maxsize=None)
def make_linear_logp(source: Optional[str]) -> Callable[..., LinearLogpResult]:
    """``linear_logp`` bound to one source (None: automatic selection per call)."""
    if source is None:
        return linear_logp

    @functools.wraps(linear_logp)
    def op(hidden, weight, target_ids, bias=None, *, tp_group=None, vocab_start_index: int = 0,
           global_vocab_size: Optional[int] = None, **options):
        return _run(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                    global_vocab_size, _options(options))

    op.__name__ = f"linear_logp_{source}"
    op.source = source  # type: ignore[attr-defined]
    return op


def get_op(name: str = "linear_logp", source: Optional[str] = None) -> Callable[..., LinearLogpResult]:
    """The op callable. ``source=None`` or ``"registry"`` selects per call; otherwise that source or
    an error."""
    check_op(name)
    if source in AUTOMATIC:
        return make_linear_logp(None)
    check_source(source)
    require_source(source, None)
    return make_linear_logp(source)


EAGER_UNDER_COMPILE = (
    "tplogp.linear_logp_loss runs eagerly inside compiled code (a graph break, so not under "
    "fullgraph=True) when its loss is not a tplogp.losses TokenLoss (a losses.grpo(...) loss or "
    "another callable), with cu_seqlens or return_metrics, or with a DTensor: compile without "
    "fullgraph=True, or use a TokenLoss (losses.ppo_clip, losses.cross_entropy, ..., combined with "
    "+)")


SUPPORT_UNDER_COMPILE = (
    "tplogp.linear_logp with support= runs eagerly inside compiled code (a graph break, so not "
    "under fullgraph=True): the op's schema takes no support")


def _eager_under_compile(fn, message: str = EAGER_UNDER_COMPILE):
    """``fn`` behind ``torch.compiler.disable`` while Dynamo traces the caller (compiled code that
    calls it runs ``fn`` eagerly, untraced, after a graph break with ``message``); a plain call
    otherwise (the disabled wrapper's frame switch costs host time on every eager call). The
    wrapper is made at the first traced call: importing ``torch._dynamo`` with tplogp would cost
    about a second."""
    disabled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal disabled
        if not torch.compiler.is_compiling():  # (a constant True while Dynamo traces this frame)
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        # named: under fullgraph=True, the error's message
        torch._dynamo.graph_break(msg=message)
        return disabled(*args, **kwargs)

    return wrapper


# a call with a sampler's support inside compiled code: eagerly, untraced
_eager_support = _eager_under_compile(_eager, SUPPORT_UNDER_COMPILE)


def linear_logp_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    loss: Callable[..., torch.Tensor],
    per_token: Sequence[torch.Tensor] = (),
    reduction: str = "sum",
    tp_group=None,
    vocab_start_index: int = 0,
    global_vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    ignore_index: Optional[int] = None,
    deterministic: Union[bool, str] = False,
    workspace_bytes: Optional[int] = None,
    source: Optional[str] = None,
    with_entropy: bool = True,
    sequence_parallel: bool = False,
    hidden_grad: str = "reduced",
    cu_seqlens: Optional[torch.Tensor] = None,
    return_metrics: bool = False,
    support=None,
    top_k=None,
    top_p=None,
    min_p=None,
) -> Union[torch.Tensor, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """A per-token loss of the token log-probs (and entropies), reduced to a scalar, with the
    gradients computed in the forward chunk by chunk (see :mod:`tplogp.fused_loss.loop`).

    ``loss(logp, entropy, *per_token_chunk)`` returns the per-token loss of a chunk
    (``tplogp.losses`` has cross-entropy, PPO/GRPO clipping, policy gradient, KL to a reference and
    an entropy bonus: ``TokenLoss`` objects whose closed-form derivatives spare the loss an autograd
    graph, combined with ``+``; any callable works, differentiated by autograd); ``per_token``
    tensors have target_ids' shape and are constants. ``reduction``: ``"sum"`` or ``"mean"`` (over
    the tokens not ignored). Ignored positions add nothing. ``source``: None, ``"registry"`` or
    ``"auto"`` (the registry's choice for the device) or ``"native"`` / ``"triton"`` / ``"sm90"``.
    ``with_entropy``: whether the sources compute the entropy statistics (``True``); ``False`` suits
    a loss that never reads ``entropy`` (cross-entropy, ``policy_gradient``, ``ppo_clip``,
    ``kl_to_reference``; of ``tplogp.losses`` only ``entropy_bonus`` reads it): the forward's stats
    kernel then skips the entropy's running sum, and the callable gets ``entropy=None`` (one that
    uses it fails there with Python's error on None). A :class:`~tplogp.losses.TokenLoss` may also
    read each token's lse and the sum of its logits over the vocabulary (``losses.z_loss``,
    ``losses.cross_entropy(label_smoothing=...)``): the sources then compute that sum as one more
    statistic. The other arguments are those of :func:`linear_logp` (``softcap`` included), with the
    same handling of autocast (inputs cast like ``F.linear``, the loss in fp32, gradients to the
    leaves in their dtypes) and of a DTensor weight / bias sharded over the vocabulary (their
    gradients come back as DTensors); hidden is a plain tensor (the loss is a scalar of this rank's
    tokens: with ``sequence_parallel``, of all N tokens, the same on every rank, while ``hidden`` is
    this rank's slice, as in :func:`linear_logp`; ``hidden_grad`` as there). Returns a 0-d fp32
    tensor whose backward scales the gradients computed in the forward.

    ``tplogp.losses.grpo(...)`` builds the GRPO family (TRL's loss types, GSPO's sequence ratios,
    clip variants, rollout corrections, KL estimators): a loss that normalises itself (leave
    ``reduction="sum"``) over sequences, the rows of ``[B, L]`` targets or, for packed input, the
    spans of ``cu_seqlens`` (offsets ``[0, ..., N]`` of the flattened tokens).
    ``return_metrics=True`` (such losses only) returns ``(loss, metrics)``: a dict of 0-d fp32
    tensors (KL mean, clip fractions, ratio mean / min / max, entropy mean when computed) over the
    counted positions, the same on every rank (docs/operator.md, "GRPO-family losses").
    ``support``: the sampler's kept ids per token, as in :func:`linear_logp` (logp and entropy
    renormalized over them; not with label smoothing); ``top_k``, ``top_p``, ``min_p``: that
    support computed from the sampler's parameters, as in :func:`linear_logp`.
    """
    if isinstance(per_token, (tuple, list)):  # (else: the checks' error)
        per_token = tuple(per_token)
    options = dict(loss=loss, per_token=per_token, reduction=reduction, temperature=temperature,
                   softcap=softcap, ignore_index=ignore_index, deterministic=deterministic,
                   workspace_bytes=workspace_bytes, with_entropy=with_entropy,
                   sequence_parallel=sequence_parallel, hidden_grad=hidden_grad,
                   cu_seqlens=cu_seqlens, return_metrics=return_metrics, support=support,
                   top_k=top_k, top_p=top_p, min_p=min_p)
    source = None if source in AUTOMATIC else source
    return _loss_call(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                      global_vocab_size, options)


# linear_logp_loss's options and their defaults (linear_logp_loss_entry takes them by name)
_LOSS_OPTIONS = dict(per_token=(), reduction="sum", with_entropy=True, cu_seqlens=None,
                     return_metrics=False, support=None, top_k=None, top_p=None, min_p=None,
                     **{name: DEFAULTS[name] for name in names_of(LOSS_OP)})


def linear_logp_loss_entry(entry: EntryCheck, hidden, weight, target_ids, bias=None, *, loss,
                           tp_group=None, vocab_start_index: int = 0,
                           global_vocab_size: Optional[int] = None, source: Optional[str] = None,
                           **options):
    """:func:`linear_logp_loss` for an integration's entry point (:mod:`tplogp.integrations`): the
    entry's own problem (``entry``) is raised with the loss's checks, so with a group every rank
    raises the same error. Under ``torch.compile`` it raises at once."""
    unknown = set(options) - set(_LOSS_OPTIONS)
    if unknown:
        raise TypeError(f"linear_logp_loss got unexpected keyword argument(s) {sorted(unknown)}")
    options = dict(_LOSS_OPTIONS, loss=loss, **options)
    per_token = options["per_token"]
    options["per_token"] = tuple(per_token) if isinstance(per_token, (tuple, list)) else per_token
    if torch.compiler.is_compiling():
        if entry.problem is not None:
            raise LinearLogpInputError(entry.problem)
    else:
        options["entry"] = entry
    return _loss_call(None if source in AUTOMATIC else source, hidden, weight, target_ids, bias,
                      tp_group, vocab_start_index, global_vocab_size, options)


def _loss_call(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
               global_vocab_size, options: dict):
    """:func:`linear_logp_loss` after its options: the compiled op when they cross its schema, else
    eagerly."""
    if (torch.compiler.is_compiling() and not any_dtensor(weight, hidden)
            and compiled_calls.loss_fits_op_schema(hidden, weight, target_ids, bias,
                                                   vocab_start_index, global_vocab_size, source,
                                                   options)):
        return _front(functools.partial(compiled_calls.linear_logp_loss, source, **options),
                      hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                      global_vocab_size)
    return _eager_loss(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                       global_vocab_size, options)


@_eager_under_compile  # the chunk loop and its autograd.Function run eagerly inside compiled code
def _eager_loss(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                global_vocab_size, options: dict) -> torch.Tensor:
    """:func:`linear_logp_loss` eagerly: the fused loss (:mod:`tplogp.fused_loss.loop`) after the
    DTensor and autocast front."""
    from .fused_loss.loop import fused_loss

    body = functools.partial(fused_loss, source, **options)
    if any_dtensor(hidden, weight):  # (one question on the plain path; which one, only then)
        if any_dtensor(hidden):
            raise LinearLogpInputError("linear_logp_loss takes hidden as a plain tensor of this "
                                       "rank's tokens (the loss is their scalar): pass "
                                       "hidden.to_local()")

        def run(hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
                _options):
            return _front(body, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                          global_vocab_size)

        return unwrap_dtensors(run, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                               global_vocab_size, None)
    return _front(body, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                  global_vocab_size)
