"""The public operator ``linear_logp`` and ``get_op``, the per-source callables.

A call resolves what the caller's training stack wraps around plain tensors, then runs the shared path of
:mod:`tplogp.tp`: eagerly through its autograd Function, and under ``torch.compile`` through the ``torch.library``
ops of :mod:`tplogp.ops` (one opaque node each for forward and backward; the same bodies run inside). Eager calls
skip the op's dispatch because it costs host time that matters at small shapes.

1. DTensor weights (vocab-sharded ``Shard(0)``) become their local shard plus the group, vocab start and global
   vocab of the mesh dimension they are sharded over (:mod:`tplogp.dtensor`).
2. Under ``torch.autocast(device_type, dtype=X)`` hidden, weight and bias are cast to X, as ``F.linear`` would
   use them; the casts are differentiable, so gradients reach the original tensors in their own dtypes.
3. Under ``torch.compile`` the op returns one packed fp32 result; logp (and entropy, lse) are views of it with the
   targets' shape.

Arguments of the wrong Python type cannot cross the op's schema; such calls run the same checks eagerly
(:func:`tplogp.tp.linear_logp_tp`), so the error is the same clear one, on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Optional, Sequence

import torch

from . import ops
from .comm import group_name
from .dtensor import is_dtensor, unwrap_dtensors
from .kernel_registry import backend_for_call, check_op, check_source, require_source
from .outputs import LinearLogpResult, pack_outputs
from .tp import PACKED_ENTROPY, PACKED_LOGP, PACKED_LSE, LogpOptions, linear_logp_tp
from .checks import LinearLogpInputError, is_int

_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(LogpOptions))
_NO_CONTEXT = contextlib.nullcontext()  # (reusable: one object, not one per call)


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


def _fits_op_schema(hidden, weight, target_ids, bias, vocab_start_index, global_vocab_size,
                    options: LogpOptions) -> bool:
    """Whether the arguments' Python types cross the op's schema; when not, :func:`tplogp.checks.local_problem`
    names the argument (checked in tests/test_linear_logp.py)."""
    return (all(isinstance(t, torch.Tensor) for t in (hidden, weight, target_ids))
            and (bias is None or isinstance(bias, torch.Tensor))
            and is_int(vocab_start_index)
            and (global_vocab_size is None or is_int(global_vocab_size))
            and isinstance(options.temperature, (int, float)) and not isinstance(options.temperature, bool)
            and (options.ignore_index is None or is_int(options.ignore_index))
            and (options.workspace_bytes is None or is_int(options.workspace_bytes)))


def _run(source: Optional[str], hidden, weight, target_ids, bias, tp_group, vocab_start_index: int,
         global_vocab_size: Optional[int], options: LogpOptions) -> LinearLogpResult:
    if is_dtensor(weight) or is_dtensor(hidden):
        return unwrap_dtensors(functools.partial(_run, source), hidden, weight, target_ids, bias, tp_group,
                               vocab_start_index, global_vocab_size, options)
    if not torch.compiler.is_compiling():  # eager: the same bodies without the op's dispatch (host time)
        device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
        backend = backend_for_call(source, device, getattr(hidden, "dtype", None))
        # under autocast: cast like F.linear, run with autocast off (arguments of other types are not cast: the
        # checks raise their error, on every rank)
        cast = torch.is_autocast_enabled(device.type) and _fits_op_schema(
            hidden, weight, target_ids, bias, vocab_start_index, global_vocab_size, options)
        if cast:
            hidden, weight, bias = autocast_inputs(device.type, hidden, weight, bias)
        with torch.autocast(device.type, enabled=False) if cast else _NO_CONTEXT:
            return linear_logp_tp(backend, hidden, weight, target_ids, bias, tp_group=tp_group,
                                  vocab_start_index=vocab_start_index, global_vocab_size=global_vocab_size,
                                  options=options)
    if not _fits_op_schema(hidden, weight, target_ids, bias, vocab_start_index, global_vocab_size, options):
        device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
        backend = backend_for_call(source, device, getattr(hidden, "dtype", None))
        return linear_logp_tp(backend, hidden, weight, target_ids, bias, tp_group=tp_group,
                              vocab_start_index=vocab_start_index, global_vocab_size=global_vocab_size,
                              options=options)  # raises the checks' error (on every rank)
    hidden, weight, bias = autocast_inputs(hidden.device.type, hidden, weight, bias)
    builds_graph = torch.is_grad_enabled() and hidden.requires_grad
    packed, _ = ops.linear_logp_fwd(
        hidden, weight, target_ids, bias, group_name(tp_group), vocab_start_index, global_vocab_size,
        float(options.temperature), bool(options.return_entropy), options.ignore_index, bool(options.deterministic),
        options.workspace_bytes, source or "", builds_graph)
    shape = target_ids.shape
    logp = packed[PACKED_LOGP].view(shape)
    lse = packed[PACKED_LSE].view(shape)
    entropy = packed[PACKED_ENTROPY].view(shape) if options.return_entropy else None
    return pack_outputs(logp, entropy, lse, options.return_entropy, options.return_lse)


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
    deterministic: bool = False,
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
    if source in (None, "registry", "auto"):
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
    deterministic: bool = False,
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
    precomputed gradients of hidden, weight and bias; on one shard with no keep bytes in the budget (the default),
    or with a budget that keeps every term of the call, the call runs as one autograd pass instead, whose backward
    (``linear_logp``'s) computes them (:func:`tplogp.fused_loss.one_pass`; a built-in loss at host-bound sizes on a
    GPU precomputes all the same, :func:`tplogp.fused_loss.precomputes`).
    """
    from .fused_loss import fused_loss

    def run(hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size, _options):
        device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
        if all(isinstance(t, torch.Tensor) for t in (hidden, weight)) and (bias is None or isinstance(bias,
                                                                                                   torch.Tensor)):
            hidden, weight, bias = autocast_inputs(device.type, hidden, weight, bias)
        automatic = source in (None, "registry", "auto")  # the names get_op accepts for the registry's choice
        backend = backend_for_call(None if automatic else source, device, getattr(hidden, "dtype", None))
        # the loss callable and the sources see fp32 / the inputs' dtypes
        with (torch.autocast(device.type, enabled=False) if torch.is_autocast_enabled(device.type)
              else contextlib.nullcontext()):
            return fused_loss(backend, hidden, weight, target_ids, bias, loss=loss,
                              per_token=tuple(per_token), reduction=reduction, tp_group=tp_group,
                              vocab_start_index=vocab_start_index, global_vocab_size=global_vocab_size,
                              temperature=temperature, ignore_index=ignore_index, deterministic=deterministic,
                              workspace_bytes=workspace_bytes, with_entropy=with_entropy)

    if is_dtensor(hidden):
        raise LinearLogpInputError("linear_logp_loss takes hidden as a plain tensor of this rank's tokens (the loss "
                                   "is their scalar): pass hidden.to_local()")
    if is_dtensor(weight):
        return unwrap_dtensors(run, hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
                               None)
    return run(hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size, None)
