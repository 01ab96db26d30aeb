"""The public operator ``linear_logp``, ``linear_logp_loss`` and ``get_op``, the per-source callables.

One front serves both ops, then the call goes down once: :func:`tplogp.plan.prepare` (source, every check, the
layout's plan, the call's verdict) and :mod:`tplogp.tp` (the autograd Function, the collectives, the source). Under
``torch.compile`` the same two steps run inside the ``torch.library`` ops of :mod:`tplogp.ops` (one opaque node each
for forward and backward); eager calls skip the op's dispatch, whose host time matters at small shapes.

The front:

1. DTensor weights (vocab-sharded ``Shard(0)``) become their local shard plus the group, vocab start and global
   vocab of the mesh dimension they are sharded over (:mod:`tplogp.dtensor`).
2. Under ``torch.autocast(device_type, dtype=X)`` hidden, weight and bias are cast to X, as ``F.linear`` would
   use them, and the call runs with autocast off; the casts are differentiable, so gradients reach the original
   tensors in their own dtypes.
3. Under ``torch.compile`` the op returns one packed fp32 result; logp (and entropy, lse) are views of it with the
   targets' shape.

Arguments of the wrong Python type cannot cross the op's schema; such calls run the eager path, whose checks raise
the same clear error on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence, Union

import torch

from . import ops, plan, tp
from .comm import group_name
from .dtensor import any_dtensor, unwrap_dtensors
from .kernel_registry import check_op, check_source, require_source
from .outputs import LinearLogpResult, pack_outputs
from .plan import LogpOptions
from .tp import PACKED_ENTROPY, PACKED_LOGP, PACKED_LSE
from .validation import LinearLogpInputError, is_int

_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(LogpOptions))
AUTOMATIC = (None, "registry", "auto")  # the source names that leave the choice to the registry


def _options(kwargs: dict) -> LogpOptions:
    unknown = set(kwargs) - _OPTION_NAMES
    if unknown:
        raise TypeError(f"linear_logp got unexpected keyword argument(s) {sorted(unknown)}; options are "
                        f"tp_group, vocab_start_index, global_vocab_size, {', '.join(sorted(_OPTION_NAMES))}")
    return LogpOptions(**kwargs)


def autocast_inputs(device_type: str, hidden, weight, bias):
    """Under ``torch.autocast(device_type, dtype=X)``: hidden, weight and bias in X, as ``F.linear`` would use them.

    The casts are ordinary differentiable ``.to`` calls, so gradients reach the original tensors in their own
    dtypes (fp32 parameters get fp32 gradients). Outside autocast the inputs come back as given.
    """
    if not torch.is_autocast_enabled(device_type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        return t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != dtype else t

    return cast(hidden), cast(weight), cast(bias)


def _front(body: Callable, hidden, weight, target_ids, bias, *rest):
    """``body(hidden, weight, target_ids, bias, *rest)`` after the autocast step of the module docstring (DTensors
    are unwrapped before): inputs cast like ``F.linear``, autocast off inside. Arguments of other types are not cast
    (the checks raise their error, on every rank)."""
    device = hidden.device if isinstance(hidden, torch.Tensor) else None
    if (device is None or not torch.is_autocast_enabled(device.type) or not isinstance(weight, torch.Tensor)
            or not (bias is None or isinstance(bias, torch.Tensor))):
        return body(hidden, weight, target_ids, bias, *rest)
    hidden, weight, bias = autocast_inputs(device.type, hidden, weight, bias)
    with torch.autocast(device.type, enabled=False):
        return body(hidden, weight, target_ids, bias, *rest)


def _fits_op_schema(hidden, weight, target_ids, bias, vocab_start_index, global_vocab_size,
                    options: LogpOptions) -> bool:
    """Whether the arguments' Python types cross the op's schema; when not, :func:`tplogp.validation.local_problem`
    names the argument (checked in tests/op/test_linear_logp.py)."""
    return (all(isinstance(t, torch.Tensor) for t in (hidden, weight, target_ids))
            and (bias is None or isinstance(bias, torch.Tensor))
            and is_int(vocab_start_index)
            and (global_vocab_size is None or is_int(global_vocab_size))
            and isinstance(options.temperature, (int, float)) and not isinstance(options.temperature, bool)
            and (options.ignore_index is None or is_int(options.ignore_index))
            and (options.workspace_bytes is None or is_int(options.workspace_bytes))
            and isinstance(options.deterministic, bool))  # ("tp_invariant" runs eagerly: tplogp.invariant)


def _eager(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index: int,
           global_vocab_size: Optional[int], options: LogpOptions) -> LinearLogpResult:
    """The eager call: the plan, then the tensor-parallel layer."""
    builds_graph = torch.is_grad_enabled() and isinstance(hidden, torch.Tensor) and hidden.requires_grad
    return tp.linear_logp(plan.prepare(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                                       global_vocab_size, options, builds_graph))


def _compiled(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index: int,
              global_vocab_size: Optional[int], options: LogpOptions) -> LinearLogpResult:
    """The call as the op pair of :mod:`tplogp.ops` (traced by ``torch.compile``)."""
    builds_graph = torch.is_grad_enabled() and hidden.requires_grad
    name = source if source is None or isinstance(source, str) else source.name
    packed, _ = ops.linear_logp_fwd(
        hidden, weight, target_ids, bias, group_name(tp_group), vocab_start_index, global_vocab_size,
        float(options.temperature), bool(options.return_entropy), options.ignore_index, bool(options.deterministic),
        options.workspace_bytes, name or "", builds_graph)
    shape = target_ids.shape
    logp = packed[PACKED_LOGP].view(shape)
    lse = packed[PACKED_LSE].view(shape)
    entropy = packed[PACKED_ENTROPY].view(shape) if options.return_entropy else None
    return pack_outputs(logp, entropy, lse, options.return_entropy, options.return_lse)


def _run(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index: int,
         global_vocab_size: Optional[int], options: LogpOptions) -> LinearLogpResult:
    if any_dtensor(weight, hidden):
        return unwrap_dtensors(functools.partial(_run, source), hidden, weight, target_ids, bias, tp_group,
                               vocab_start_index, global_vocab_size, options)
    body = _eager
    if torch.compiler.is_compiling() and _fits_op_schema(hidden, weight, target_ids, bias, vocab_start_index,
                                                         global_vocab_size, options):
        body = _compiled  # (other calls run eagerly: their checks raise the error, on every rank)
    return _front(functools.partial(body, source), hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                  global_vocab_size, options)


def linear_logp_on(source, hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, *, tp_group=None, vocab_start_index: int = 0,
                   global_vocab_size: Optional[int] = None, options: LogpOptions = LogpOptions()) -> LinearLogpResult:
    """:func:`linear_logp` on ``source``: a source name, None (the registry's choice), or a backend object (a source
    configured by hand, as tests and benchmarks use)."""
    return _run(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size, options)


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
    return_entropy: bool = False,
    return_lse: bool = False,
    ignore_index: Optional[int] = None,
    deterministic: Union[bool, str] = False,
    workspace_bytes: Optional[int] = None,
) -> LinearLogpResult:
    """Per-token log-probability of ``target_ids`` through a (vocab-sharded) LM head.

    ``logp[t] = log_softmax((hidden @ weight.T + bias) / temperature)[t, target_ids[t]]`` over the whole vocabulary
    of all ranks of ``tp_group``, without materializing the ``[tokens, vocab]`` logits. Differentiable in hidden,
    weight and bias for any upstream gradient. Traced by ``torch.compile`` as one op (no graph breaks); under
    ``torch.autocast`` hidden, weight and bias are used in the autocast dtype (outputs stay fp32).

    Args:
        hidden: ``[N, D]`` or ``[B, S, D]``, float32 / bfloat16 / float16 (plain, or a DTensor replicated over the
            weight's vocab mesh dimension).
        weight: ``[V_local, D]``, this rank's rows ``[vocab_start_index, vocab_start_index + V_local)``, hidden's dtype;
            or a DTensor ``[V, D]`` placed ``Shard(0)`` on one mesh dimension (then group, vocab start and global
            vocab come from it and must not be passed).
        target_ids: integer global token ids with hidden's leading shape, the same on every rank.
        bias: ``[V_local]`` or None (a DTensor when weight is one, with the same placements).
        tp_group: the process group the vocab is sharded over (None: the weight is the whole vocab).
        vocab_start_index: first global id of this rank's shard (shards may be uneven).
        global_vocab_size: total vocab; inferred from the shards when None.
        temperature: logits are divided by it before the softmax (gradients follow).
        return_entropy: also return the entropy of the full-vocab distribution per token (differentiable).
        return_lse: also return the merged log-sum-exp per token (differentiable, for z-loss / KL terms).
        ignore_index: positions with this target get logp 0 (entropy 0, lse 0) and no gradient.
        deterministic: bitwise reproducible outputs and gradients, and per-row results that do not depend on the
            other rows of the batch (costs some speed: fixed tiling, no cuBLAS ``d_hidden`` on triton / sm90).
            ``"tp_invariant"``: that, and logp, entropy and lse with the same bits at every TP degree and for any
            shard boundaries, ``weight.grad`` / ``bias.grad`` rows equal to the same rows at TP=1 (vocabularies
            below 2^23; docs/operator.md, "Determinism"; under ``torch.compile`` the call runs eagerly).
        workspace_bytes: the most memory the op may hold beyond inputs, outputs and gradients (tiles, plus fp32
            logits kept for the backward when above the source's default tiles; docs/operator.md, "Memory
            budget"). None: ``TPLOGP_WORKSPACE_MB``, else the source's default tiles; on triton / sm90 a call
            whose kept terms fit those (128 MiB) keeps them (3 GEMMs), unless ``deterministic``.

    Returns:
        float32 logp with target_ids' shape; with ``return_entropy`` and/or ``return_lse`` a named tuple of exactly
        the requested outputs, which unpacks: ``logp, entropy = ...`` (:class:`~tplogp.outputs.LogpEntropy`),
        ``logp, lse = ...`` (:class:`~tplogp.outputs.LogpLse`), ``logp, entropy, lse = ...``
        (:class:`~tplogp.outputs.LogpEntropyLse`). With a DTensor hidden, each is a DTensor with hidden's
        placements (replicated over the vocab dimension).
    """
    return _run(None, hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
                LogpOptions(temperature=temperature, return_entropy=return_entropy, return_lse=return_lse,
                            ignore_index=ignore_index, deterministic=deterministic, workspace_bytes=workspace_bytes))


@functools.lru_cache(maxsize=None)
def make_linear_logp(source: Optional[str]) -> Callable[..., LinearLogpResult]:
    """``linear_logp`` bound to one source (None: automatic selection per call)."""
    if source is None:
        return linear_logp

    @functools.wraps(linear_logp)
    def op(hidden, weight, target_ids, bias=None, *, tp_group=None, vocab_start_index: int = 0,
           global_vocab_size: Optional[int] = None, **options):
        return _run(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
                    _options(options))

    op.__name__ = f"linear_logp_{source}"
    op.source = source  # type: ignore[attr-defined]
    return op


def get_op(name: str = "linear_logp", source: Optional[str] = None) -> Callable[..., LinearLogpResult]:
    """The op callable. ``source=None`` or ``"registry"`` selects per call; otherwise that source or an error."""
    check_op(name)
    if source in AUTOMATIC:
        return make_linear_logp(None)
    check_source(source)
    require_source(source, None)
    return make_linear_logp(source)


def _eager_under_compile(fn):
    """``fn`` behind ``torch.compiler.disable`` while Dynamo traces the caller (compiled code that calls it runs
    ``fn`` eagerly, untraced); a plain call otherwise (the disabled wrapper's frame switch costs host time on every
    eager call). The wrapper is made at the first traced call: importing ``torch._dynamo`` with tplogp would cost
    about a second."""
    disabled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal disabled
        if not torch.compiler.is_compiling():  # (a constant True while Dynamo traces this frame)
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return wrapper


@_eager_under_compile  # the chunk loop and its autograd.Function run eagerly inside compiled code
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
    ignore_index: Optional[int] = None,
    deterministic: Union[bool, str] = False,
    workspace_bytes: Optional[int] = None,
    source: Optional[str] = None,
    with_entropy: bool = True,
) -> torch.Tensor:
    """A per-token loss of the token log-probs (and entropies), reduced to a scalar, with the gradients computed in
    the forward chunk by chunk (see :mod:`tplogp.fused_loss`).

    ``loss(logp, entropy, *per_token_chunk)`` returns the per-token loss of a chunk (``tplogp.losses`` has
    cross-entropy, PPO/GRPO clipping, policy gradient, KL to a reference and an entropy bonus: ``TokenLoss``
    objects whose closed-form derivatives spare the loss an autograd graph, combined with ``+``; any callable works,
    differentiated by autograd); ``per_token`` tensors have target_ids' shape and are constants.
    ``reduction``: ``"sum"`` or ``"mean"`` (over the tokens not ignored). Ignored
    positions add nothing. ``source``: None, ``"registry"`` or ``"auto"`` (the registry's choice for the device) or
    ``"native"`` / ``"triton"`` / ``"sm90"``. ``with_entropy``: whether the sources compute the entropy
    statistics (``True``); ``False`` suits a loss that never reads ``entropy`` (cross-entropy, ``policy_gradient``,
    ``ppo_clip``, ``kl_to_reference``; of ``tplogp.losses`` only ``entropy_bonus`` reads it): the forward's stats
    kernel then skips the entropy's running sum, and the callable gets ``entropy=None`` (one that uses it fails
    there with Python's error on None). The other arguments are those of :func:`linear_logp`, with the same
    handling of autocast (inputs cast like ``F.linear``, the loss in fp32, gradients to the leaves in their dtypes)
    and of a DTensor weight / bias sharded over the vocabulary (their gradients come back as DTensors); hidden is a
    plain tensor (the loss is a scalar of this rank's tokens). Returns a 0-d fp32 tensor whose backward scales the
    gradients computed in the forward.
    """
    from .fused_loss import fused_loss

    if any_dtensor(hidden):
        raise LinearLogpInputError("linear_logp_loss takes hidden as a plain tensor of this rank's tokens (the loss "
                                   "is their scalar): pass hidden.to_local()")
    body = functools.partial(fused_loss, None if source in AUTOMATIC else source, loss=loss,
                             per_token=tuple(per_token), reduction=reduction, temperature=temperature,
                             ignore_index=ignore_index, deterministic=deterministic, workspace_bytes=workspace_bytes,
                             with_entropy=with_entropy)

    def run(hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size, _options):
        return _front(body, hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size)

    if any_dtensor(weight):
        return unwrap_dtensors(run, hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
                               None)
    return _front(body, hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size)
