"""One call, one path: a ``linear_logp`` forward, and its backward, enter each module of the package
once.

A profiler hook (``sys.setprofile``) follows every Python call of one forward (and of its backward)
and maps the called function's file to a *room*: a module of ``src/tplogp``, named by its path under
the package (``op.plan``), except that the sources and their kernels (``backends.*`` but the
registry, ``kernels.*``) are one room ``backend`` (they call each other freely), and the helpers
that every layer uses (the ``support`` package, ``outputs``, the budget table
``backends.memory_budget`` and the loss terms ``losses.terms``) are not rooms. Code that dataclasses
and named tuples generate (file ``<string>``) is not followed. A room is *re-entered* when a call
enters it while none of its frames is on the stack, after an earlier call had entered it: that is
what the test forbids. The rooms in the order first entered are asserted too (one shard, a plan miss
and a plan hit; two gloo ranks). :mod:`tests.support.route` counts every module, helpers included,
for docs/operator.md's route.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import tplogp
from tests.support.problems import make_problem

PACKAGE = Path(tplogp.__file__).resolve().parent
HELPERS = {"outputs", "backends.memory_budget", "losses.terms"}


def _room(filename: str):
    path = Path(filename)
    if not path.is_absolute():
        return None
    try:
        parts = path.resolve().relative_to(PACKAGE).with_suffix("").parts
    except ValueError:
        return None
    name = ".".join(p for p in parts if p != "__init__") or "tplogp"
    if parts[0] == "support" or name in HELPERS:
        return None
    if parts[0] in ("backends", "kernels") and name != "backends.kernel_registry":
        return "backend"
    return name


def trace_rooms(fn) -> tuple[list[str], list[str]]:
    """Run ``fn`` under the hook: ``(rooms in the order first entered, rooms re-entered)``."""
    entered: list[str] = []
    reentered: list[str] = []
    depth: dict[str, int] = {}
    stack: list = []

    def hook(frame, event, arg):
        if event == "call":
            room = _room(frame.f_code.co_filename)
            stack.append(room)
            if room is None:
                return
            if depth.get(room, 0) == 0:
                if room in entered:
                    reentered.append(f"{room} (from {frame.f_back.f_code.co_name}: {frame.f_code.co_name})")
                else:
                    entered.append(room)
            depth[room] = depth.get(room, 0) + 1
        elif event == "return" and stack:
            room = stack.pop()
            if room is not None:
                depth[room] -= 1

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return entered, reentered


def _inputs(n: int, seed: int):
    p = make_problem((n,), 16, 70, torch.float32, True, seed=seed)
    return p.hidden.clone().requires_grad_(), p.weight.clone().requires_grad_(), p.target, p.bias.clone()


def _forward_and_backward(op, hidden, weight, target, bias, **kw):
    out = {}
    forward = trace_rooms(lambda: out.setdefault("logp", op(hidden, weight, target, bias, **kw)))
    backward = trace_rooms(lambda: out["logp"].sum().backward())
    return forward, backward


@pytest.mark.parametrize("layout", ["plan miss", "plan hit"])
def test_one_shard_call_goes_down_once(layout):
    """Without a group: the forward enters api (with the front's DTensor question), plan (on a plan
    miss the source registry and validation), the verdict and tp, which localizes the call
    (local_call) and runs the source, each once; the backward enters tp, the source and the verdict
    once."""
    op = tplogp.get_op("linear_logp", source="native")
    _forward_and_backward(op, *_inputs(5, seed=1))  # imports and probes done
    tplogp.check_errors()
    inputs = _inputs(7, seed=2)
    if layout == "plan hit":
        _forward_and_backward(op, *inputs)
    (forward, again), (backward, back_again) = _forward_and_backward(op, *inputs)
    assert not again and not back_again, (again, back_again)
    middle = (["backends.kernel_registry", "op.validation", "op.options"] if layout == "plan miss"
              else [])
    assert forward == ["api", "op.plan", *middle, "op.verdicts", "op.tp", "op.local_call",
                       "backend"], forward
    assert backward == ["op.tp", "backend", "op.verdicts"], backward


@pytest.mark.tp(2)
@pytest.mark.parametrize("deterministic", [False, "tp_invariant"])
def test_group_call_goes_down_once(tp, deterministic):
    """With 2 gloo ranks: the forward's checks run the group record under the verdict (one
    exchange), tp merges the stats; the backward settles the verdict before the source's backward
    and its ``d_hidden`` all-reduce."""
    op = tplogp.get_op("linear_logp", source="native")
    hidden, weight, target, bias = _inputs(6, seed=3)
    v_local = 35
    start = tp.rank * v_local
    shard = weight.detach()[start:start + v_local].clone().requires_grad_()
    kw = dict(tp_group=tp.group, vocab_start_index=start, global_vocab_size=70,
              deterministic=deterministic)
    _forward_and_backward(op, hidden, shard, target, bias[start:start + v_local], **kw)
    (forward, again), (backward, back_again) = _forward_and_backward(op, hidden, shard, target,
                                                                      bias[start:start + v_local],
                                                                      **kw)
    tp.assert_all(not again and not back_again, f"rank {tp.rank}: re-entered {again} {back_again}")
    tp.assert_all(forward == ["api", "op.plan", "op.verdicts", "op.group_record", "op.tp",
                              "op.local_call", "backend"],
                  f"rank {tp.rank}: {forward}")
    tp.assert_all(backward == ["op.tp", "op.verdicts", "backend"], f"rank {tp.rank}: {backward}")
