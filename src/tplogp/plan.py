"""The per-layout call plan: what a call needs that depends only on its layout, computed once per layout.

A call's *layout* is everything its work depends on apart from tensor data: the shapes, dtypes and devices of
hidden, weight, target_ids and bias; ``vocab_start_index`` and ``global_vocab_size``; the options
(:class:`LogpOptions`); the TP group; the source; whether the call records an autograd graph; and the settings read
from the environment (``TPLOGP_CHECKS``, ``TPLOGP_WORKSPACE_MB``). :func:`plan_call` turns those into a tuple key and
looks the :class:`CallPlan` up in a small dict. At the first call of a layout it runs the layout checks
(:func:`tplogp.checks.local_problem`), resolves the group's world size and collective device and the
:class:`~tplogp.backends.base.ShardCall` the sources get; :func:`remember` keeps the plan once the call's checks
have passed (so a bad layout is re-checked, and raises, at every call). A later call of the same layout costs one
key and one lookup instead: the host time that matters at small shapes, where a call's latency is mostly host work.

What still runs per call is what depends on data: the target check (:func:`tplogp.checks.check_call`), the
``ignore_index`` compaction and the target localisation (:func:`tplogp.tp.localize_call`). Calls whose arguments are
not of the plain types the op takes (a bool for an int, a list for a tensor) are never planned: they are checked
afresh and get the checks' error. The cache holds at most ``MAX_PLANS`` layouts (it is emptied when full).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from . import settings
from .backends.base import ShardBackend, ShardCall
from .checks import checks_mode, local_problem
from .comm import collective_device

MAX_PLANS = 256


@dataclass(frozen=True)
class LogpOptions:
    """Keyword options of ``linear_logp`` beyond the bare contract (defaults keep the bare behaviour)."""

    temperature: float = 1.0
    return_entropy: bool = False
    return_lse: bool = False
    ignore_index: Optional[int] = None
    deterministic: bool = False
    workspace_bytes: Optional[int] = None


def shard_call(options: LogpOptions, for_backward: bool = False, one_shard: bool = False,
               scales_apart: bool = False, rows: Optional[int] = None) -> ShardCall:
    """What the sources get to know about a call's options. ``one_shard``: d_hidden is the call's whole gradient,
    which a source may round to the input dtype in its GEMM (``ShardCall.d_hidden_in_input_dtype``). Such calls run
    only after the op's checks (``ShardCall.inputs_checked``). ``scales_apart``: what the forward keeps comes in two
    allocations (``ShardCall.scales_apart``: the eager paths). ``rows``: the layout's token count
    (``ShardCall.rows``)."""
    return ShardCall(inv_temperature=1.0 / float(options.temperature), with_entropy=options.return_entropy,
                     deterministic=options.deterministic, workspace_bytes=options.workspace_bytes,
                     for_backward=for_backward, d_hidden_in_input_dtype=one_shard, inputs_checked=True,
                     scales_apart=scales_apart, rows=rows)


@dataclass
class CallPlan:
    """Everything about one layout that the call path needs (module docstring). One per layout, shared by its calls;
    the group itself is not held (a group is passed with each call)."""

    key: Optional[tuple]  # None: not cacheable (arguments of unusual types)
    backend: ShardBackend
    mode: str  # TPLOGP_CHECKS
    world_size: int
    comm_device: torch.device  # where the group's collectives take tensors (CPU without a group)
    call: ShardCall  # for a forward whose results are not differentiated
    call_for_backward: ShardCall  # for an eager forward that may keep logits for its backward (scales apart)
    single: bool  # one shard and a backend with forward_single: it finishes logp / lse / entropy itself
    # single, no ignore_index (the kernel cannot tell ignored rows apart), and the backend's finishing kernel checks
    # the targets (tplogp.checks.KernelTargetCheck)
    kernel_target_check: bool
    vocab_size: Optional[int] = None  # the global vocab, once a call of the layout has passed its checks


_plans: dict[tuple, CallPlan] = {}
_stats = {"built": 0}


def layout_key(backend: ShardBackend, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
               global_vocab_size, options: LogpOptions, builds_graph: bool) -> Optional[tuple]:
    """The call's layout as a hashable tuple, or None when an argument is of a type that is never planned."""
    if not (isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor)
            and isinstance(target_ids, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))
            and type(vocab_start_index) is int and (global_vocab_size is None or type(global_vocab_size) is int)
            and type(options.temperature) in (float, int) and type(options.return_entropy) is bool
            and type(options.return_lse) is bool and type(options.deterministic) is bool
            and (options.ignore_index is None or type(options.ignore_index) is int)
            and (options.workspace_bytes is None or type(options.workspace_bytes) is int)):
        return None
    group = None if tp_group is None else (id(tp_group), tp_group.group_name, tp_group.size())
    return (backend.name, hidden.shape, hidden.dtype, hidden.device, weight.shape, weight.dtype, weight.device,
            target_ids.shape, target_ids.dtype, target_ids.device,
            None if bias is None else (bias.shape, bias.dtype, bias.device), vocab_start_index, global_vocab_size,
            options, type(options.temperature), group, bool(builds_graph), settings.layout_settings())


def plan_call(backend: ShardBackend, hidden, weight, target_ids, bias, tp_group, vocab_start_index,
              global_vocab_size, options: LogpOptions, builds_graph: bool) -> tuple[CallPlan, Optional[str]]:
    """``(the layout's plan, its local problem)``: the cached plan and None when an earlier call of the layout passed
    its checks; else a new plan (cache it with :func:`remember` once the call's checks pass) and
    :func:`tplogp.checks.local_problem` (None when the arguments are fine)."""
    key = layout_key(backend, hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
                     options, builds_graph)
    if key is not None:
        plan = _plans.get(key)
        if plan is not None:
            return plan, None
    mode = checks_mode()  # a bad TPLOGP_CHECKS raises here, at every call (never cached)
    problem = local_problem(hidden, weight, target_ids, bias, vocab_start_index, global_vocab_size,
                            options.ignore_index, options.temperature, options.workspace_bytes)
    world = dist.get_world_size(tp_group) if tp_group is not None else 1
    device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
    comm_device = collective_device(tp_group, device) if world > 1 else torch.device("cpu")
    ok = problem is None
    single = world == 1 and hasattr(backend, "forward_single")
    _stats["built"] += 1
    rows = target_ids.numel() if ok else None
    plan = CallPlan(key if ok else None, backend, mode, world, comm_device,
                    shard_call(options, one_shard=world == 1, rows=rows) if ok else ShardCall(),
                    shard_call(options, for_backward=True, one_shard=world == 1, scales_apart=True, rows=rows) if ok
                    else ShardCall(),
                    single, single and options.ignore_index is None and getattr(backend, "checks_targets_in_kernel",
                                                                                 False))
    return plan, problem


def remember(plan: CallPlan, vocab_size: int) -> None:
    """Keep ``plan`` for the later calls of its layout, now that a call of it has passed its checks."""
    if plan.key is None or plan.key in _plans:
        return
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    plan.vocab_size = vocab_size
    _plans[plan.key] = plan


def planned_layouts() -> int:
    """How many layouts have been planned since the process started (a cache hit plans nothing)."""
    return _stats["built"]


def clear_plans() -> None:
    """Forget every plan (the next call of each layout is checked and planned afresh)."""
    _plans.clear()


__all__ = ["CallPlan", "LogpOptions", "plan_call", "remember", "shard_call", "planned_layouts", "clear_plans",
           "layout_key", "MAX_PLANS"]
