"""The per-layout call plan (tplogp.op.plan): a later call of a layout plans nothing; a change of
any layout input (shapes, dtypes, bias, options, group, checks mode, workspace setting, grad mode)
plans afresh; a bad layout is never remembered (it raises at every call)."""

from __future__ import annotations

import pytest
import torch

from tplogp import LinearLogpInputError, ShardLayoutError, check_errors, get_op
from tplogp.op import plan


@pytest.fixture(autouse=True)
def _no_remembered_plans():
    """Each test starts from an empty plan cache: another test in the same process may have planned
    its layouts."""
    plan.clear_plans()
    yield


def _inputs(n=6, d=8, v=20, dtype=torch.float32, bias=False, grad=False):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g).to(dtype).requires_grad_(grad)
    w = torch.randn(v, d, generator=g).to(dtype)
    b = torch.randn(v, generator=g) if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    return h, w, y, b


def _planned(call) -> int:
    """How many layouts ``call`` planned."""
    before = plan.planned_layouts()
    call()
    return plan.planned_layouts() - before


# one change per layout input, each from the same base call (its name says which input changes)
CHANGES = {
    "tokens": lambda op, h, w, y, b: op(h[:4], w, y[:4]),
    "3-d hidden": lambda op, h, w, y, b: op(h.view(2, 3, 8), w, y.view(2, 3)),
    "vocab": lambda op, h, w, y, b: op(h, w[:19], y.clamp(max=18)),
    "dtype": lambda op, h, w, y, b: op(h.double().float().bfloat16(), w.bfloat16(), y),
    "target dtype": lambda op, h, w, y, b: op(h, w, y.int()),
    "bias": lambda op, h, w, y, b: op(h, w, y, torch.zeros(20)),
    "temperature": lambda op, h, w, y, b: op(h, w, y, temperature=0.5),
    "entropy": lambda op, h, w, y, b: op(h, w, y, return_entropy=True),
    "ignore_index": lambda op, h, w, y, b: op(h, w, y, ignore_index=-100),
    "deterministic": lambda op, h, w, y, b: op(h, w, y, deterministic=True),
    "workspace_bytes": lambda op, h, w, y, b: op(h, w, y, workspace_bytes=1 << 20),
    "global_vocab_size": lambda op, h, w, y, b: op(h, w, y, global_vocab_size=20),
    "grad mode": lambda op, h, w, y, b: op(h.detach().requires_grad_(), w, y),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_layout_input_replans_and_the_same_layout_does_not(change):
    op = get_op("linear_logp", source="native")
    h, w, y, b = _inputs()
    op(h, w, y)
    assert _planned(lambda: op(h, w, y)) == 0  # the same layout: the remembered plan
    # other tensors of the same layout
    assert _planned(lambda: op(h.clone(), w.clone(), y.clone())) == 0
    assert _planned(lambda: CHANGES[change](op, h, w, y, b)) == 1
    # and that one is remembered in turn
    assert _planned(lambda: CHANGES[change](op, h, w, y, b)) == 0
    check_errors()


@pytest.mark.parametrize("variable,value",
                         [("TPLOGP_CHECKS", "sync"), ("TPLOGP_WORKSPACE_MB", "3")])
def test_a_changed_setting_replans(variable, value, monkeypatch):
    op = get_op("linear_logp", source="native")
    h, w, y, _ = _inputs(n=5)
    op(h, w, y)
    monkeypatch.setenv(variable, value)
    assert _planned(lambda: op(h, w, y)) == 1
    assert _planned(lambda: op(h, w, y)) == 0
    check_errors()


def test_a_bad_layout_is_never_remembered():
    """Every call of a bad layout runs the checks again and raises (the plan is kept only after they
    pass)."""
    op = get_op("linear_logp", source="native")
    h, w, y, _ = _inputs(n=7)
    for _ in range(2):
        with pytest.raises(LinearLogpInputError,
                           match=r"temperature must be a positive finite number"):
            op(h, w, y, temperature=-1.0)
        with pytest.raises(ShardLayoutError, match="the single shard must start at 0"):
            op(h, w, y, vocab_start_index=3)
    # arguments of unusual types are never planned: True is no int, and is refused every time
    for _ in range(2):
        with pytest.raises(LinearLogpInputError, match="ignore_index must be an int"):
            op(h, w, y, ignore_index=True)


def test_a_bad_setting_raises_at_every_call(monkeypatch):
    op = get_op("linear_logp", source="native")
    h, w, y, _ = _inputs(n=3)
    op(h, w, y)
    monkeypatch.setenv("TPLOGP_CHECKS", "sometimes")
    for _ in range(2):
        with pytest.raises(LinearLogpInputError, match="TPLOGP_CHECKS"):
            op(h, w, y)


def test_planned_calls_match_the_reference():
    """The remembered plan gives the same outputs and gradients as the first (planning) call, bit
    for bit."""
    op = get_op("linear_logp", source="native")
    h, w, y, b = _inputs(n=9, bias=True)
    results = []
    for _ in range(3):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = op(hh, ww, y, b, return_entropy=True, temperature=0.7)
        (out.logp * 2 + out.entropy).sum().backward()
        results.append((out.logp.detach(), out.entropy.detach(), hh.grad, ww.grad))
    for later in results[1:]:
        for a, c in zip(results[0], later):
            assert torch.equal(a, c)
