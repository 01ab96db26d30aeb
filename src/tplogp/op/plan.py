"""The plan of a call: every validation, the layout key and the per-layout state in one cache.

A call's *layout* is everything its work depends on apart from tensor data: the shapes, dtypes and
devices of hidden, weight, target_ids and bias; ``vocab_start_index`` and ``global_vocab_size``; the
options (:class:`LogpOptions`); the TP group; the source; whether the call records an autograd
graph; and the settings read from the environment (``TPLOGP_CHECKS``, ``TPLOGP_WORKSPACE_MB``).
:func:`plan_call` turns those into a tuple key and looks the :class:`CallPlan` up in a small dict,
so a later call of a layout costs one key and one lookup (the host time that matters at small
shapes). At the first call of a layout it validates the arguments and the shard layout
(:mod:`tplogp.op.validation`) and builds the :class:`~tplogp.backends.base.ShardCall` the sources
get; :func:`remember` keeps the plan once the call's checks have passed (so a bad layout raises at
every call).

:func:`prepare` is the one step of a call above the tensor-parallel layer: the plan (the source
named by the call is part of the key and resolved by :mod:`tplogp.backends.kernel_registry` at a
layout's first call), and the call's target verdict
(:func:`tplogp.op.verdicts.open_call`, with a group the record exchange that makes every rank raise
the same error). It returns a :class:`Call` that :mod:`tplogp.op.tp` runs. Calls whose arguments are
not of the plain types the op takes are never cached: they are checked afresh and get the
validation's error. The cache holds at most ``MAX_PLANS`` layouts (it is emptied when full).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from ..support import invariant, settings
from ..backends.base import ShardBackend, ShardCall
from ..support.comm import collective_device
from ..backends.kernel_registry import SourceUnavailableError, backend_for_call
from . import sampler_params, support_ids
from .options import SHARD_FIELDS, LogpOptions, keyable
from .validation import LinearLogpInputError, LossCheck, check_layout
from .verdicts import BackwardVerdict, KernelTargetCheck, latest_verdict, open_call

MAX_PLANS = 256


def shard_call(options: LogpOptions, for_backward: bool = False, one_shard: bool = False,
               scales_apart: bool = False, rows: Optional[int] = None,
               grid_columns: int = 0, env: Optional[tuple] = None) -> ShardCall:
    """What the sources get to know about a call's options. ``one_shard``: d_hidden is the call's
    whole gradient, which a source may round to the input dtype in its GEMM
    (``ShardCall.d_hidden_in_input_dtype``). Such calls run only after the op's checks
    (``ShardCall.inputs_checked``). ``scales_apart``: what the forward keeps comes in two
    allocations (``ShardCall.scales_apart``: the eager paths). ``rows``: the layout's token count
    (``ShardCall.rows``). ``grid_columns``: the source's invariant grid (``ShardCall.grid_columns``;
    0: off). ``env``: the call's :func:`tplogp.support.settings.layout_settings`
    (``ShardCall.env``)."""
    values = {field: None if value is None else plain(value) for name, (field, plain)
              in SHARD_FIELDS.items() for value in (getattr(options, name),)}
    return ShardCall(inv_temperature=1.0 / float(options.temperature), **values,
                     for_backward=for_backward and not grid_columns,
                     d_hidden_in_input_dtype=one_shard and not grid_columns,
                     inputs_checked=True, scales_apart=scales_apart, rows=rows,
                     grid_columns=grid_columns, env=env)


@dataclass
class CallPlan:
    """Everything about one layout that the call path needs (module docstring). One per layout,
    shared by its calls; the group itself is not held (a group is passed with each call)."""

    key: Optional[tuple]  # None: not cacheable (arguments of unusual types)
    backend: ShardBackend
    mode: str  # TPLOGP_CHECKS
    world_size: int
    comm_device: torch.device  # where the group's collectives take tensors (CPU without a group)
    call: ShardCall  # for a forward whose results are not differentiated
    # for an eager forward that may keep logits for its backward (scales apart)
    call_for_backward: ShardCall
    # one shard and a backend with forward_single: it finishes logp / lse / entropy itself
    single: bool
    # single, no ignore_index (the kernel cannot tell ignored rows apart), and the backend's
    # finishing kernel checks the targets (tplogp.op.verdicts.KernelTargetCheck)
    kernel_target_check: bool
    # the global vocab: of one shard from the start, of a group once a call of the layout has passed
    # its checks
    vocab_size: Optional[int] = None
    cached: bool = False  # kept for the later calls of its layout (:func:`remember`)


_plans: dict[tuple, CallPlan] = {}
_stats = {"built": 0}


def layout_key(source: "Source", hidden, weight, target_ids, bias, tp_group, vocab_start_index,
               global_vocab_size, options: LogpOptions, builds_graph: bool,
               env: Optional[tuple] = None) -> Optional[tuple]:
    """The call's layout as a hashable tuple, or None when an argument is of a type that is never
    planned. ``source``: as the call names it (a backend object by its name); what the registry
    resolves it to depends on nothing but the key's devices, dtypes, options and ``env``
    (:func:`tplogp.backends.kernel_registry.backend_for_call`). ``env``:
    :func:`tplogp.support.settings.layout_settings` (read here when None)."""
    if not (isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor)
            and isinstance(target_ids, torch.Tensor)
            and (bias is None or isinstance(bias, torch.Tensor))
            and type(vocab_start_index) is int
            and (global_vocab_size is None or type(global_vocab_size) is int)
            and keyable(options)):
        return None
    group = None if tp_group is None else (id(tp_group), tp_group.group_name, tp_group.size())
    named = source if source is None or isinstance(source, str) else source.name
    return (named, hidden.shape, hidden.dtype, hidden.device, weight.shape, weight.dtype,
            weight.device, target_ids.shape, target_ids.dtype, target_ids.device,
            None if bias is None else (bias.shape, bias.dtype, bias.device), vocab_start_index,
            global_vocab_size, options, type(options.temperature), group, bool(builds_graph),
            settings.layout_settings() if env is None else env)


def plan_call(source: "Source", hidden, weight, target_ids, bias, tp_group, vocab_start_index,
              global_vocab_size, options: LogpOptions, builds_graph: bool,
              env: Optional[tuple] = None) -> tuple[CallPlan, Optional[str]]:
    """The plan of a call's layout: looked up by its key, built and checked at the layout's first
    call.

    A later call of a checked layout costs one key and one lookup, the host time that matters at
    small shapes.

    Args:
        source: the call's source: a name, None (the registry's choice for the device) or a backend
            object, resolved at the layout's first call (the plan holds the backend).
        hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size: the call's
            arguments.
        options: the call's :class:`LogpOptions`.
        builds_graph: whether the call records an autograd graph.
    Returns:
        ``(plan, problem)``: the cached plan and None when an earlier call of the layout passed its
        checks; else a new plan (cache it with :func:`remember` once the call's checks pass) and
        :func:`tplogp.op.validation.local_problem` (None when the arguments are fine).
    Raises:
        ShardLayoutError: a one-shard layout whose weight is not the whole vocabulary.
    """
    env = settings.layout_settings() if env is None else env
    key = layout_key(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                     global_vocab_size, options, builds_graph, env)
    if key is not None:
        plan = _plans.get(key)
        if plan is not None:
            return plan, None
    backend = _backend(source, hidden, env, call_features(options))
    world = dist.get_world_size(tp_group) if tp_group is not None else 1
    # a bad TPLOGP_CHECKS raises here, at every call (never cached)
    mode, problem, vocab_size = check_layout(hidden, weight, target_ids, bias, vocab_start_index,
                                             global_vocab_size, options, world,
                                             tp_group is not None)
    device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
    comm_device = collective_device(tp_group, device) if world > 1 else torch.device("cpu")
    ok = problem is None
    grid = backend.grid_columns(device, weight.dtype) if ok and options.deterministic == invariant.LEVEL else 0
    single = world == 1 and hasattr(backend, "forward_single") and not grid
    _stats["built"] += 1
    rows = target_ids.numel() if ok else None
    plan = CallPlan(key if ok else None, backend, mode, world, comm_device,
                    shard_call(options, one_shard=world == 1, rows=rows,
                               grid_columns=grid, env=env) if ok else ShardCall(),
                    shard_call(options, for_backward=True, one_shard=world == 1, scales_apart=True,
                               rows=rows, grid_columns=grid, env=env) if ok
                    else ShardCall(),
                    single, single and options.ignore_index is None
                    and getattr(backend, "checks_targets_in_kernel",
                                                                                 False), vocab_size)
    return plan, problem


def remember(plan: CallPlan, vocab_size: int) -> None:
    """Keep ``plan`` for the later calls of its layout, now that a call of it has passed its checks
    (a layout that failed is never cached, so it raises at every call).

    Args:
        plan: the plan from :func:`plan_call`.
        vocab_size: the global vocabulary the call's checks found.
    """
    plan.vocab_size = vocab_size
    if plan.key is None or plan.key in _plans:
        return
    if len(_plans) >= MAX_PLANS:
        for dropped in _plans.values():
            dropped.cached = False
        _plans.clear()
    plan.cached = True
    _plans[plan.key] = plan


def planned_layouts() -> int:
    """How many layouts have been planned since the process started (a cache hit plans nothing)."""
    return _stats["built"]


def clear_plans() -> None:
    """Forget every plan (the next call of each layout is checked and planned afresh)."""
    for dropped in _plans.values():
        dropped.cached = False
    _plans.clear()


class CallArgs(NamedTuple):
    """The arguments of one call, as the checks take them (a plain tensor per tensor argument, after
    the DTensor and autocast front of :mod:`tplogp.api`)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    target_ids: torch.Tensor
    bias: Optional[torch.Tensor]
    group: object  # the TP process group, or None
    vocab_start_index: int
    global_vocab_size: Optional[int]
    options: LogpOptions
    # whether the call records an autograd graph (its ranks must agree: the backward reduces)
    builds_graph: bool


class Call(NamedTuple):
    """A call that passed its checks, what :mod:`tplogp.op.tp` runs."""

    plan: CallPlan
    args: CallArgs
    vocab_size: int  # of all shards together (the same on every rank)
    verdict: Optional[BackwardVerdict]  # what the backward settles before it writes a gradient
    target_check: Optional[KernelTargetCheck]  # the target check the source's finishing kernel runs
    # every rank's shard range (start, end), rank-major, from the group record (None: one shard, or
    # an op's backward, which exchanges no record)
    shard_ranges: Optional[list[tuple[int, int]]] = None


Source = Union[None, str, ShardBackend]


def call_features(options: LogpOptions) -> tuple[str, ...]:
    """What a call asks beyond the plain op, which a source may not run (its ``missing_features``):
    ``"support"`` for a call with ``support=`` (or the sampler's parameters that compute one), and
    ``"support-tp-invariant"`` for one under
    ``deterministic="tp_invariant"`` too."""
    # a support, given or from the sampler's parameters (sampler_params.given, inline)
    if (options.support is None and options.top_k is None and options.top_p is None
            and options.min_p is None):
        return ()
    if options.deterministic == invariant.LEVEL:
        return ("support", "support-tp-invariant")
    return ("support",)


def _backend(source: Source, hidden, env: tuple, features: tuple[str, ...] = ()) -> ShardBackend:
    """The backend of ``source``: a name, None (the registry's choice for the device), or a backend
    object. ``env``: the call's :func:`tplogp.support.settings.layout_settings`; ``features``: what
    the call asks beyond the plain op (``("support",)``), which a source may not run
    (:mod:`tplogp.backends.kernel_registry`)."""
    if source is not None and not isinstance(source, str):
        missing = getattr(source, "missing_features", {})
        for feature in features:
            if feature in missing:
                raise SourceUnavailableError(f"source {source.name!r}: {missing[feature]}")
        return source
    device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
    return backend_for_call(source, device, getattr(hidden, "dtype", None), env[2], features)


def _checked_support(options: LogpOptions, target_ids: torch.Tensor,
                     vocab: Optional[int]) -> tuple[LogpOptions, support_ids.SupportData]:
    """A call's support in the padded int64 ``[N, K]`` form, and its data checked
    (:mod:`tplogp.op.support_ids`): ``(options with that support, what the check read)``."""
    support = options.support
    ids, problem = support_ids.padded(support, target_ids.numel())
    if problem is not None:
        return options, support_ids.SupportData(problem, -1, 0)
    return (replace(options, support=ids),
            support_ids.data_problem(ids, target_ids, options.ignore_index, vocab))


def prepare(source: Source, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
            global_vocab_size, options: LogpOptions, builds_graph: bool,
            loss_check: Optional[LossCheck] = None) -> Call:
    """Resolve, validate and plan one call, and open its target verdict.

    Every check and decision of a call sits here, above the tensor-parallel layer, so that a call
    enters each module once and every rank raises the same error before any collective of the call's
    work.

    Args:
        source: a source name, None for the registry's choice, or a backend object.
        hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size: the call's
            arguments, plain tensors (after the DTensor and autocast front of :mod:`tplogp.api`).
        options: the call's :class:`LogpOptions`.
        builds_graph: whether the call records an autograd graph (its ranks must agree: the backward
            reduces).
        loss_check: a fused-loss call's checks of its own arguments
            (:func:`tplogp.op.validation.check_loss`, run at every call): raised like a layout's
            problem, and with a group compared across the ranks in the record.
    Returns:
        The :class:`Call` to run (:func:`tplogp.op.tp.linear_logp`,
        :func:`tplogp.op.packed_op.forward_packed`, the fused loss).
    Raises:
        LinearLogpInputError, ShardLayoutError: the arguments or the shard layout are wrong (with a
            group, on every rank).
    """
    env = settings.layout_settings()  # (read once: the plan's key, the registry's question)
    plan, problem = plan_call(source, hidden, weight, target_ids, bias, tp_group,
                              vocab_start_index, global_vocab_size, options, builds_graph, env)
    largest = support_digest = -1
    if options.support is not None and problem is None:  # (its data: one host read)
        options, (problem, largest, support_digest) = _checked_support(
            options, target_ids, global_vocab_size or plan.vocab_size)
    if problem is None and (options.top_k is not None or options.top_p is not None
                            or options.min_p is not None):  # (tensor parameters: one host read)
        problem = sampler_params.data_problem(options, target_ids, options.ignore_index)
    args = CallArgs(hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                    global_vocab_size, options, builds_graph)
    total, verdict, target_check, ranges = open_call(plan, args, problem, loss_check,
                                                     support_digest)
    # a group's vocabulary, known from its record: every rank reads the same (replicated) support
    problem = support_ids.past_vocab_problem(largest, total) if largest >= 0 else None
    if problem is not None:
        raise LinearLogpInputError(problem)
    if not plan.cached:
        remember(plan, total)
    return Call(plan, args, total, verdict, target_check, ranges)


def prepare_backward(source: Source, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
                     options: LogpOptions) -> Call:
    """The :class:`Call` of an op's backward (:mod:`tplogp.op.ops`), whose forward passed its
    checks.

    The op's backward gets tensors and plain values only, so it finds its layout's plan again and
    takes the latest call's verdict (:func:`tplogp.op.verdicts.latest_verdict`): the op cannot carry
    its own.

    Args:
        source, hidden, weight, target_ids, bias, tp_group, vocab_start_index, options: as the
            forward's (:func:`prepare`).
    Returns:
        The :class:`Call` for :func:`tplogp.op.packed_op.backward_packed` (``vocab_size`` 0: the
        backward does not read it).
    """
    env = settings.layout_settings()
    plan, _ = plan_call(source, hidden, weight, target_ids, bias, tp_group,
                        vocab_start_index, None, options, True, env)
    args = CallArgs(hidden, weight, target_ids, bias, tp_group, vocab_start_index, None, options,
                    True)
    group = tp_group if plan.world_size > 1 else None
    return Call(plan, args, 0, latest_verdict(plan.mode, group, hidden.device), None)


def op_call(options: LogpOptions, builds_graph: bool) -> ShardCall:
    """The :class:`ShardCall` of an op's forward: it keeps softmax terms for its backward when the
    call records a graph, as eager's does (the budget then decides how much:
    :func:`tplogp.op.packed_op.op_kept_shape`)."""
    return shard_call(options, for_backward=builds_graph)


__all__ = ["Call", "CallArgs", "CallPlan", "LogpOptions", "plan_call", "prepare",
           "prepare_backward", "remember", "shard_call", "planned_layouts", "clear_plans",
           "layout_key", "op_call", "MAX_PLANS"]
