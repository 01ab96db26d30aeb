"""Argument and layout validation of ``linear_logp`` and ``linear_logp_loss``: what one rank can
check alone, with no tensor data read (but ``cu_seqlens``, read when a loss uses its sequences).

:func:`local_problem` returns a message instead of raising, so that with a TP group every rank first
finishes its own checks and the group then raises the same error everywhere
(:mod:`tplogp.op.group_record`); without a group the plan raises it. :func:`single_shard_vocab`
checks the shard layout of a call on one shard. The plan (:mod:`tplogp.op.plan`) runs these through
:func:`check_layout`, at the first call of a layout only.

The fused loss's own arguments (the loss, ``per_token``, ``reduction``, ``with_entropy``,
``cu_seqlens``, ``return_metrics``) are checked at every call by :func:`check_loss` (a few type and
shape tests): a :class:`LossCheck` holds the rank's problem and what its ranks must agree on (the
loss's options, the per-token tensors' shapes and dtypes, the sequences' offsets), which the group
record compares by digest (:meth:`LossCheck.digests`).
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional, Sequence

import torch

from ..support import invariant, settings
from ..support.shards import ShardLayoutError
from .options import LogpOptions, option_problems
from . import sampler_params
from .support_ids import form_problem as support_form_problem

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the dtype as it travels in a group record
DTYPE_CODE = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


class LinearLogpInputError(ValueError):
    """Bad arguments to ``linear_logp`` (raised identically on every rank of the group)."""


def checks_mode() -> str:
    """``TPLOGP_CHECKS`` (:func:`tplogp.support.settings.checks_mode`); a bad value is a
    :class:`LinearLogpInputError`."""
    try:
        return settings.checks_mode()
    except settings.SettingsError as exc:
        raise LinearLogpInputError(str(exc)) from exc


# return_argmax: the largest shard whose local ids fp32 holds exactly (the per-shard statistics are
# fp32)
MAX_ARGMAX_VOCAB = 1 << 24


def is_int(x) -> bool:
    """A Python int that is not a bool (what the op's ``int`` schema arguments accept)."""
    return isinstance(x, int) and not isinstance(x, bool)


def local_problem(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    bias: Optional[torch.Tensor],
    vocab_start_index: int,
    global_vocab_size: Optional[int],
    options: LogpOptions,
    world_size: int = 1,
) -> Optional[str]:
    """Everything one rank can check alone. Returns a message, or None when the inputs are fine.

    An argument of a type that the op's schema (:mod:`tplogp.op.ops`) does not take is always a
    problem here: such calls run these checks eagerly to raise their error (:mod:`tplogp.api`). The
    options' own checks are declared with them (:func:`tplogp.op.options.option_problems`)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("target_ids", target_ids)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if bias is not None and not isinstance(bias, torch.Tensor):
        return f"bias must be a torch.Tensor or None, got {type(bias).__name__}"
    if hidden.dim() not in (2, 3):
        return f"hidden must be [N, D] or [B, S, D], got shape {tuple(hidden.shape)}"
    if weight.dim() != 2:
        return f"weight must be [V_local, D], got shape {tuple(weight.shape)}"
    if hidden.shape[-1] != weight.shape[1]:
        return (f"hidden size mismatch: hidden is {tuple(hidden.shape)} (D={hidden.shape[-1]}) but weight is "
                f"{tuple(weight.shape)} (D={weight.shape[1]})")
    problem, late_problem = option_problems(options)
    if problem is not None:
        return problem
    if options.sequence_parallel:
        problem = sequence_parallel_problem(hidden, target_ids, options.hidden_grad, world_size)
        if problem is not None:
            return problem
    elif tuple(target_ids.shape) != tuple(hidden.shape[:-1]):
        return (f"target_ids must have shape {tuple(hidden.shape[:-1])} (hidden's shape without D), "
                f"got {tuple(target_ids.shape)}")
    if target_ids.dtype.is_floating_point or target_ids.dtype.is_complex or target_ids.dtype == torch.bool:
        return f"target_ids must be an integer tensor, got {target_ids.dtype}"
    if hidden.dtype not in SUPPORTED_DTYPES:
        return f"hidden dtype must be one of float32, bfloat16, float16, got {hidden.dtype}"
    if weight.dtype != hidden.dtype:
        return f"weight dtype ({weight.dtype}) must match hidden dtype ({hidden.dtype})"
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            return f"bias must be [V_local] = [{weight.shape[0]}], got shape {tuple(bias.shape)}"
        if bias.dtype not in (weight.dtype, torch.float32):
            return f"bias dtype ({bias.dtype}) must be the weight dtype ({weight.dtype}) or float32"
    devices = {hidden.device, weight.device, target_ids.device} | ({bias.device} if bias is not None else set())
    if len(devices) > 1:
        names = f"hidden={hidden.device}, weight={weight.device}, target_ids={target_ids.device}" + (
            f", bias={bias.device}" if bias is not None else "")
        return f"all tensors must be on one device, got {names}"
    if not is_int(vocab_start_index) or vocab_start_index < 0:
        return f"vocab_start_index must be a non-negative int, got {vocab_start_index!r}"
    if global_vocab_size is not None and (not is_int(global_vocab_size) or global_vocab_size <= 0):
        return f"global_vocab_size must be a positive int or None, got {global_vocab_size!r}"
    if late_problem is not None:
        return late_problem
    if (options.support is not None or options.top_k is not None or options.top_p is not None
            or options.min_p is not None):  # (sampler_params.given, inline: no room entered)
        problem = _support_problem(options, target_ids)
        if problem is not None:
            return problem
    if options.return_argmax and weight.shape[0] > MAX_ARGMAX_VOCAB:
        return (f"return_argmax supports vocab shards of at most {MAX_ARGMAX_VOCAB} rows (a shard's ids travel "
                f"exactly in its fp32 statistics), got a weight of {weight.shape[0]} rows")
    if options.deterministic == invariant.LEVEL and max(vocab_start_index + weight.shape[0],
                                                     global_vocab_size or 0) >= invariant.MAX_VOCAB:
        return (f"deterministic={invariant.LEVEL!r} sums in fixed point with {invariant.FIXED_POINT_BITS} fraction "
                f"bits, which holds vocabularies below {invariant.MAX_VOCAB}; this one reaches "
                f"{max(vocab_start_index + weight.shape[0], global_vocab_size or 0)}: use deterministic=True")
    return None


def _support_problem(options: LogpOptions, target_ids: torch.Tensor) -> Optional[str]:
    """What a call with ``support=`` or the sampler's parameters cannot be (their forms:
    :mod:`tplogp.op.support_ids`, :mod:`tplogp.op.sampler_params`), or None."""
    given = "support=" if options.support is not None else "top_k= / top_p= / min_p="
    if options.deterministic == invariant.LEVEL and options.support is None:
        return (f"deterministic={invariant.LEVEL!r} is not implemented with {given} (the kept ids "
                f"are chosen from logits computed on each rank's own shard): use "
                f"deterministic=True, which is bitwise reproducible for one TP degree, or pass "
                f"the sampler's kept ids as support=")
    if options.with_sum_z:
        return ("label smoothing reads the sum of the logits over the whole vocabulary, which a "
                f"call with {given} does not compute: drop label_smoothing or {given}")
    if sampler_params.given(options):
        return sampler_params.form_problem(options, target_ids)
    return support_form_problem(options.support, target_ids)


def sequence_parallel_problem(hidden: torch.Tensor, target_ids: torch.Tensor, hidden_grad: str,
                              world_size: int) -> Optional[str]:
    """The sequence-parallel layout: hidden's rows (its leading dimensions flattened) are this
    rank's contiguous, equal slice of target_ids' ``N`` tokens (flattened, rank-major). A message,
    or None when it is."""
    if hidden_grad == "partial":
        return ("hidden_grad='partial' leaves the gradient of a replicated hidden unsummed; with "
                "sequence_parallel=True hidden.grad is this rank's slice of the summed gradient (reduce-scattered): "
                "pass hidden_grad='reduced', or gather hidden yourself and pass it replicated with "
                "sequence_parallel=False")
    rows = math.prod(hidden.shape[:-1])
    n = target_ids.numel()
    if n % world_size or rows * world_size != n:
        expected = f"{n // world_size} rows" if n % world_size == 0 else (
            f"an equal share, but {n} tokens do not divide by the {world_size} ranks")
        return (f"with sequence_parallel=True hidden holds this rank's contiguous slice of the tokens, 1/{world_size} "
                f"of target_ids' {n} (one per rank, equal slices in rank order): expected {expected}, got hidden "
                f"{tuple(hidden.shape)} ({rows} rows)")
    return None


def single_shard_vocab(vocab_start_index: int, v_local: int, global_vocab_size: Optional[int],
                       group_given: bool = False) -> int:
    """Check that one shard is the whole vocabulary (without a TP group, or with a group of one
    rank).

    Args:
        vocab_start_index, global_vocab_size: the call's arguments.
        v_local: the weight's rows.
        group_given: whether a group (of one rank) was passed, for the message.
    Returns:
        The vocabulary size.
    Raises:
        ShardLayoutError: the shard does not start at 0 or is not the whole vocabulary.
    """
    where = "with a tp_group of size 1" if group_given else "without a tp_group"
    if vocab_start_index != 0:
        raise ShardLayoutError(
            f"vocab shards leave a gap: {where} the single shard must start at 0, "
            f"got vocab_start_index={vocab_start_index} (ids [0, {vocab_start_index}) owned by no rank)")
    if global_vocab_size is not None and global_vocab_size != v_local:
        raise ShardLayoutError(
            f"{where} the weight must hold the whole vocabulary: weight has {v_local} rows "
            f"but global_vocab_size is {global_vocab_size}")
    return v_local


def check_layout(hidden, weight, target_ids, bias, vocab_start_index, global_vocab_size, options,
                 world_size: int, group_given: bool) -> tuple[str, Optional[str], Optional[int]]:
    """The checks of a layout's first call, what one rank can check without reading tensor data.

    A local problem is returned, not raised, so that with a group every rank raises it together (no
    rank is left in a collective).

    Args:
        hidden, weight, target_ids, bias, vocab_start_index, global_vocab_size: the call's
            arguments.
        options: the call's :class:`tplogp.op.plan.LogpOptions`.
        world_size: the TP group's size (1 without a group).
        group_given: whether a group was passed (for the message of a one-rank group).
    Returns:
        ``(TPLOGP_CHECKS mode, local problem or None, the vocabulary of one shard or None)``.
    Raises:
        LinearLogpInputError: a bad ``TPLOGP_CHECKS``.
        ShardLayoutError: a one-shard layout whose weight is not the whole vocabulary.
    """
    mode = checks_mode()
    problem = local_problem(hidden, weight, target_ids, bias, vocab_start_index, global_vocab_size,
                            options, world_size)
    vocab_size = None
    if problem is None and world_size == 1:
        vocab_size = single_shard_vocab(vocab_start_index, weight.shape[0], global_vocab_size,
                                        group_given)
    return mode, problem, vocab_size


# ---- the fused loss's arguments ----------------------------------------------------------------

REDUCTIONS = ("sum", "mean")  # linear_logp_loss's reduction
# what a LossCheck's ranks must agree on, in the order of LossCheck.parts and of the group record's
# digests
AGREED = ("the loss and its options (loss, reduction, with_entropy, return_metrics)",
          "the per_token tensors' shapes and dtypes", "cu_seqlens")


class LossCheck:
    """The checks of one fused-loss call's own arguments (:func:`check_loss`).

    ``problem``: the rank's problem, or None. ``offsets``: ``cu_seqlens`` as host ints when the loss
    uses its sequences (else None). :meth:`parts`: plain-value tuples of what every rank of a group
    must pass alike, one per entry of :data:`AGREED` (built only with a group: host time);
    :meth:`digests` hashes them for the group record, :meth:`describe` shows them."""

    __slots__ = ("problem", "offsets", "_arguments", "caller")
    labels = AGREED  # what each part is, for the error of ranks that disagree

    def __init__(self, problem: Optional[str], offsets: Optional[list[int]], arguments: tuple,
                 caller: str = "linear_logp_loss") -> None:
        self.problem, self.offsets, self._arguments = problem, offsets, arguments
        self.caller = caller  # names the call in the group's errors

    def parts(self) -> tuple:
        loss, per_token, reduction, with_entropy, cu_seqlens, return_metrics = self._arguments
        if isinstance(per_token, tuple):
            layout = tuple(_layout(t) for t in per_token)
        else:
            layout = type(per_token).__name__
        if self.offsets is not None:
            sequences = tuple(self.offsets)
        else:
            sequences = None if cu_seqlens is None else _layout(cu_seqlens)
        options = (loss_identity(loss), reduction, with_entropy, return_metrics)
        return options, layout, sequences

    def digests(self) -> list[int]:
        """One non-negative 63-bit digest per part (the same on every rank for equal parts: a keyed
        hash, not Python's per-process ``hash``)."""
        return [_digest(repr(part)) for part in self.parts()]

    def describe(self, index: int) -> str:
        """Part ``index`` as text (for the error of ranks that disagree)."""
        return repr(self.parts()[index])


def _digest(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _layout(value):
    """A tensor as its shape and dtype (no data read); anything else as its type's name."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), str(value.dtype)
    return type(value).__name__


class EntryCheck(LossCheck):
    """The checks of an integration's entry point that calls the op (:mod:`tplogp.integrations`):
    its own problem, raised with the op's (on every rank of a group), and its options, which the
    ranks must pass alike (compared by digest in the group record like a fused loss's)."""

    __slots__ = ("labels",)

    def __init__(self, caller: str, problem: Optional[str], options: tuple) -> None:
        super().__init__(problem, None, options, caller)
        names = ", ".join(name for name, _ in options)
        self.labels = (f"{caller}'s options ({names})", "", "")

    def parts(self) -> tuple:
        return self._arguments, None, None


def loss_identity(loss) -> tuple:
    """What names a loss the same way on every rank: a :class:`~tplogp.losses.TokenLoss`'s name
    (its options included) and per-token names, a GRPO-family loss's options (a tensor option by
    its shape and dtype: no host read), else the callable's module and qualified name."""
    kind = type(loss).__name__
    config = getattr(loss, "config", None)
    if config is not None and hasattr(config, "__dataclass_fields__"):
        fields = tuple((name, _plain(getattr(config, name)))
                       for name in config.__dataclass_fields__)
        return kind, fields
    if hasattr(loss, "per_token") and hasattr(loss, "name"):
        return kind, loss.name, tuple(loss.per_token)
    return kind, getattr(loss, "__module__", None), getattr(loss, "__qualname__", None)


def _plain(value):
    return ("tensor", *_layout(value)) if isinstance(value, torch.Tensor) else value


def check_loss(loss, per_token: Sequence, reduction, with_entropy, cu_seqlens, return_metrics,
               target_ids, entry: Optional[EntryCheck] = None) -> LossCheck:
    """The fused loss's own arguments, checked (no tensor data read, but ``cu_seqlens`` when the
    loss uses its sequences: one small host read). The problem is returned, not raised (module
    docstring).

    Args:
        loss, per_token, reduction, with_entropy, cu_seqlens, return_metrics:
            :func:`tplogp.linear_logp_loss`'s.
        target_ids: the call's targets (their shape; a problem of their own is
            :func:`local_problem`'s).
        entry: the checks of the integration's entry point that made the call (its problem comes
            first, its name is the call's in the group's errors), or None.
    Returns:
        The :class:`LossCheck`.
    """
    if isinstance(per_token, (tuple, list)):
        per_token = tuple(per_token)
    offsets, problem = None, entry.problem if entry is not None else None
    problem = problem or _loss_problem(loss, per_token, reduction, with_entropy, cu_seqlens,
                                       return_metrics, target_ids)
    if problem is None and cu_seqlens is not None:
        offsets, problem = parse_offsets(cu_seqlens, target_ids.numel(),
                                         read=bool(getattr(loss, "needs_sequences", False)))
    arguments = (loss, per_token, reduction, with_entropy, cu_seqlens, return_metrics)
    return LossCheck(problem, offsets, arguments,
                     "linear_logp_loss" if entry is None else entry.caller)


def _loss_problem(loss, per_token, reduction, with_entropy, cu_seqlens, return_metrics,
                  target_ids) -> Optional[str]:
    """:func:`check_loss`'s problem of the arguments but ``cu_seqlens``' values, or None."""
    policy = hasattr(loss, "config") and hasattr(loss, "needs_sequences")  # a losses.grpo(...)
    if not (callable(loss) or policy):
        return (f"loss must be a callable (a tplogp.losses loss or (logp, entropy, *per_token) -> "
                f"[n]), got {loss!r}")
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        return f"reduction must be one of {REDUCTIONS}, got {reduction!r}"
    for name, value in (("with_entropy", with_entropy), ("return_metrics", return_metrics)):
        if not isinstance(value, bool):
            return f"{name} must be a bool, got {value!r}"
    if not isinstance(per_token, tuple):
        return f"per_token must be a tuple or list of tensors, got {type(per_token).__name__}"
    if not isinstance(target_ids, torch.Tensor):
        return None  # local_problem names it
    shape = tuple(target_ids.shape)
    for i, t in enumerate(per_token):
        tensor = isinstance(t, torch.Tensor)
        if not (tensor and tuple(t.shape) == shape and t.dtype.is_floating_point):
            got = f"{t.dtype} of shape {tuple(t.shape)}" if tensor else type(t).__name__
            return (f"per_token[{i}] must be a floating-point tensor of target_ids' shape {shape}, "
                    f"got {got}")
    if not policy:
        for name, value in (("return_metrics", return_metrics), ("cu_seqlens", cu_seqlens)):
            if value is not None and value is not False:
                return f"{name} is an option of the losses.grpo(...) losses, not of {loss!r}"
    if hasattr(loss, "check_arity"):  # a tplogp.losses loss names the per-token tensors it takes
        try:
            loss.check_arity(len(per_token))
        except ValueError as exc:
            return str(exc)
    if getattr(loss, "reads_entropy", False) and not with_entropy:
        return f"the loss {loss.name} reads the entropy: call with with_entropy=True"
    if policy:
        if reduction != "sum":
            return (f"the loss {loss.name} normalises itself (its normalization option): call with "
                    f"reduction='sum', got {reduction!r}")
        if loss.needs_sequences and cu_seqlens is None and target_ids.dim() < 2:
            return (f"the loss {loss.name} has per-sequence terms: pass [B, L] targets (a sequence "
                    f"per row) or cu_seqlens (packed sequences' offsets)")
    return None


def parse_offsets(cu_seqlens, n_all: int,
                  read: bool = True) -> tuple[Optional[list[int]], Optional[str]]:
    """``cu_seqlens`` (a 1-D integer tensor or a sequence ``[0, ..., N]``) as host offsets, checked:
    ``(offsets, None)``, or ``(None, problem)``. ``read=False`` (a loss without per-sequence terms,
    which never uses the offsets): a tensor's dtype and shape are checked without reading its values
    (no host copy, no sync with its device), and the offsets are None."""
    if isinstance(cu_seqlens, torch.Tensor):
        dtype = cu_seqlens.dtype
        if cu_seqlens.dim() != 1 or dtype.is_floating_point or dtype == torch.bool:
            return None, (f"cu_seqlens must be a 1-D integer tensor, got {dtype} of shape "
                          f"{tuple(cu_seqlens.shape)}")
        if not read:
            if cu_seqlens.numel() < 2:
                return None, (f"cu_seqlens must be offsets from 0 to the {n_all} tokens (one more "
                              f"than the sequences), got {cu_seqlens.numel()} value(s)")
            return None, None
        offsets = [int(x) for x in cu_seqlens.tolist()]
    else:
        try:
            offsets = [int(x) for x in cu_seqlens]
        except (TypeError, ValueError):
            return None, (f"cu_seqlens must be a 1-D integer tensor or a sequence of ints, got "
                          f"{cu_seqlens!r}")
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != n_all or any(
            b < a for a, b in zip(offsets[:-1], offsets[1:])):
        shown = f"{offsets[:8]}{'...' if len(offsets) > 8 else ''}"
        return None, (f"cu_seqlens must be nondecreasing offsets from 0 to the {n_all} tokens (one "
                      f"more than the sequences), got {shown}")
    return offsets, None
