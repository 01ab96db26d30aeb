"""The fused loss's own arguments are a collective verdict: a bad argument on one rank of a TP group
raises the same typed error, naming the rank and the argument, on every rank, before any collective
of the call; replicated arguments that differ between ranks (the loss's options, the per-token
tensors' layout, ``cu_seqlens``) are compared in the group record. The group stays usable: the next
good call on it gives the TP=1 value."""

from __future__ import annotations

import re

import pytest
import torch

from tests.support.ranks import agreed_message
from tplogp import LinearLogpInputError, ShardLayoutError, check_errors, linear_logp_loss, losses
from tplogp.tolerances import RUNBOOK_TOLERANCES

N, D, V = 16, 8, 64
OFFSETS = [0, 8, 16]


def _inputs(seed: int = 0):
    """Replicated inputs of a GRPO call: hidden [N, D], the full weight [V, D], targets [N],
    advantages, old log-probs (the same on every rank: one seed)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g)
    weight = torch.randn(V, D, generator=g)
    target = torch.randint(0, V, (N,), generator=g)
    adv = torch.randn(N, generator=g)
    old = -torch.rand(N, generator=g) * 4
    return hidden, weight, target, adv, old


def _shard(weight: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, int]:
    from tplogp.support.shards import shard_boundaries, shard_range

    start, end = shard_range(shard_boundaries(V, world), rank)
    return weight[start:end].clone(), start


def _call(hidden, weight, target, *, per_token, source="native", loss=None, **kw):
    hidden = hidden.clone().requires_grad_()
    value = linear_logp_loss(hidden, weight, target, loss=loss or losses.grpo("grpo"),
                             per_token=per_token, source=source, **kw)
    value.backward()
    return value.detach(), hidden.grad


def _bad_kwargs(case: str, rank: int, adv, old) -> dict:
    """The keyword arguments of the case's call on ``rank`` (wrong on rank 1 alone)."""
    kw = dict(per_token=[adv, old], cu_seqlens=torch.tensor(OFFSETS))
    if rank != 1:
        return kw
    if case == "per-token-short":
        kw["per_token"] = [adv[:-1], old]
    elif case == "per-token-2d":
        kw["per_token"] = [adv.reshape(2, N // 2), old]
    elif case == "per-token-integer":
        kw["per_token"] = [adv, old.long()]
    elif case == "per-token-one-too-many":
        kw["per_token"] = [adv, old, old]
    elif case == "reduction":
        kw["reduction"] = "avg"
    elif case == "with-entropy":
        kw["with_entropy"] = 1
    elif case == "metrics-of-a-token-loss":
        kw.update(loss=losses.ppo_clip(), return_metrics=True, cu_seqlens=None)
    elif case == "cu-seqlens-malformed":
        kw["cu_seqlens"] = torch.tensor([0, 8, 15])
    elif case == "cu-seqlens-float":
        kw["cu_seqlens"] = torch.tensor([0.0, 8.0, 16.0])
    elif case == "cu-seqlens-differ":
        kw["cu_seqlens"] = torch.tensor([0, 6, 16])
    elif case == "loss-options-differ":
        kw["loss"] = losses.grpo("grpo", epsilon_low=0.3)
    elif case == "loss-type-differs":
        kw["loss"] = losses.grpo("bnpo")
    elif case == "per-token-dtype-differs":
        kw["per_token"] = [adv.double(), old]
    elif case == "temperature":
        kw["temperature"] = 0.0
    return kw


REJECTED = r"linear_logp_loss inputs rejected \(rank 1: "
SHAPE = r"per_token\[0\] must be a floating-point tensor of target_ids' shape \(16,\), got "
LOSS_CASES = {
    "per-token-short": REJECTED + SHAPE + r"torch.float32 of shape \(15,\)\)$",
    "per-token-2d": REJECTED + SHAPE + r"torch.float32 of shape \(2, 8\)\)$",
    "per-token-integer": REJECTED + r"per_token\[1\] must be a floating-point tensor .* got "
                                    r"torch.int64",
    "per-token-one-too-many": REJECTED + r"the loss grpo\(loss_type='grpo', .*\) takes "
                                         r"per_token=\(advantages, old_logp\): 2 tensors, got 3\)$",
    "reduction": REJECTED + r"reduction must be one of \('sum', 'mean'\), got 'avg'\)$",
    "with-entropy": REJECTED + r"with_entropy must be a bool, got 1\)$",
    "metrics-of-a-token-loss": REJECTED + r"return_metrics is an option of the losses.grpo\(...\) "
                                          r"losses, not of TokenLoss\(ppo_clip",
    "cu-seqlens-malformed": REJECTED + r"cu_seqlens must be nondecreasing offsets from 0 to the 16 "
                                       r"tokens .*got \[0, 8, 15\]\)$",
    "cu-seqlens-float": REJECTED + r"cu_seqlens must be a 1-D integer tensor, got torch.float32",
    "cu-seqlens-differ": r"^linear_logp_loss: cu_seqlens must be the same on every TP rank, got "
                         r"rank 0: \(0, 8, 16\); rank 1: \(0, 6, 16\)",
    "loss-options-differ": r"^linear_logp_loss: the loss and its options .* must be the same on "
                           r"every TP rank, got rank 0: .*'epsilon_low', 0.2.*; rank 1: "
                           r".*'epsilon_low', 0.3",
    "loss-type-differs": r"^linear_logp_loss: the loss and its options .*rank 1: "
                         r".*'loss_type', 'bnpo'",
    "per-token-dtype-differs": r"^linear_logp_loss: the per_token tensors' shapes and dtypes must "
                               r"be the same on every TP rank, got rank 0: .*torch.float32.*; "
                               r"rank 1: \(\(\(16,\), 'torch.float64'\)",
    "temperature": REJECTED + r"temperature must be a positive finite number, got 0.0\)$",
}


def _bad_then_good(tp, case: str, source: str = "native") -> None:
    hidden, weight, target, adv, old = _inputs()
    w_local, start = _shard(weight, tp.rank, tp.world_size)
    group_kw = dict(tp_group=tp.group, vocab_start_index=start, global_vocab_size=V)
    try:
        bad = _bad_kwargs(case, tp.rank, adv, old)
        _call(hidden, w_local, target, source=source, **group_kw, **bad)
        check_errors(tp.group)
        outcome = "no error"
    except (LinearLogpInputError, ShardLayoutError) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    message = agreed_message(tp, outcome)
    assert message.startswith("LinearLogpInputError: "), message
    assert re.search(LOSS_CASES[case], message.removeprefix("LinearLogpInputError: ")), message
    # the group is usable: a good call on it gives the value and hidden gradient of the call without
    # a group
    good = dict(per_token=[adv, old], cu_seqlens=torch.tensor(OFFSETS))
    value, d_hidden = _call(hidden, w_local, target, source=source, **group_kw, **good)
    check_errors(tp.group)
    ref_value, ref_d_hidden = _call(hidden, weight, target, source=source, **good)
    tol = RUNBOOK_TOLERANCES[torch.float32]
    tp.assert_close(value, ref_value, atol=tol.atol, rtol=tol.rtol)
    tp.assert_close(d_hidden, ref_d_hidden, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.tp(world_size=[2, 4], timeout=120)
@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_bad_loss_argument_on_one_rank_raises_on_every_rank(tp, case):
    _bad_then_good(tp, case)


@pytest.mark.tp(world_size=2, timeout=300)
@pytest.mark.parametrize("case", ["per-token-short", "cu-seqlens-differ"])
def test_bad_loss_argument_interpreted_triton(tp, case):
    """The same verdict with the triton source (interpreted on the CPU): the checks sit above the
    sources."""
    _bad_then_good(tp, case, source="triton")


@pytest.mark.parametrize("case", [c for c in LOSS_CASES if "differ" not in c])
def test_bad_loss_argument_without_a_group(case):
    """One process: the same problem text, raised as the same type at the call (no rank named)."""
    hidden, weight, target, adv, old = _inputs()
    expected = LOSS_CASES[case].removeprefix(REJECTED).removesuffix(r"\)$")
    with pytest.raises(LinearLogpInputError) as info:
        _call(hidden, weight, target, **_bad_kwargs(case, 1, adv, old))
    assert re.search(expected, str(info.value)), str(info.value)
    value, _ = _call(hidden, weight, target, **_bad_kwargs(case, 0, adv, old))
    assert torch.isfinite(value)


# ---- calls that record no autograd graph: the target verdict at the call -------------------------

def _grpo_step_old_logp(hidden, weight, target, source: str, **group_kw):
    """A GRPO step's old log-probs: ``linear_logp`` under ``torch.no_grad()`` (no backward carries
    its verdict)."""
    from tplogp import get_op

    with torch.no_grad():
        return get_op("linear_logp", source=source)(hidden, weight, target, **group_kw)


@pytest.mark.parametrize("source", ["native", "triton"])
def test_no_grad_bad_target_raises_at_the_call(source):
    """One process: a no-grad call with a target outside the vocabulary raises at that call (no NaN
    enters the loss), and so does a fused loss computed without a graph; the next good calls run."""
    hidden, weight, target, adv, _ = _inputs()
    bad = target.clone()
    bad[5] = V
    message = rf"target id {V} is outside the vocabulary \[0, {V}\) \[checked at the call"
    with pytest.raises(LinearLogpInputError, match=message):
        _grpo_step_old_logp(hidden, weight, bad, source)
    with torch.no_grad(), pytest.raises(LinearLogpInputError, match=message):
        linear_logp_loss(hidden, weight, bad, loss=losses.policy_gradient(), per_token=[adv],
                         source=source)
    old = _grpo_step_old_logp(hidden, weight, target, source)
    assert torch.isfinite(old).all()
    value, _ = _call(hidden, weight, target, source=source, per_token=[adv, old],
                     cu_seqlens=OFFSETS)
    assert torch.isfinite(value)
    check_errors()


@pytest.mark.tp(world_size=[2, 4], timeout=120)
@pytest.mark.parametrize("source", ["native", "triton"])
def test_no_grad_bad_target_raises_at_the_call_on_every_rank(tp, source):
    """A GRPO step with a group: the old log-probs' no-grad call with a bad target raises the same
    error on every rank at that call; the group then runs the step."""
    tp.skip_if(source == "triton" and tp.world_size == 4,
               "the triton source's checks sit above it: TP=2 suffices")
    hidden, weight, target, adv, _ = _inputs()
    w_local, start = _shard(weight, tp.rank, tp.world_size)
    group_kw = dict(tp_group=tp.group, vocab_start_index=start, global_vocab_size=V)
    bad = target.clone()
    bad[5] = V
    outcomes = []
    for compute in (lambda: _grpo_step_old_logp(hidden, w_local, bad, source, **group_kw),
                    lambda: linear_logp_loss(hidden, w_local, bad, loss=losses.policy_gradient(),
                                             per_token=[adv], source=source, **group_kw)):
        try:
            with torch.no_grad():
                compute()
            outcomes.append("no error")
        except LinearLogpInputError as exc:
            outcomes.append(str(exc))
    for message in agreed_message(tp, tuple(outcomes)):
        expected = rf"target id {V} is outside the vocabulary \[0, {V}\) \[checked at the call"
        assert re.search(expected, message), message
    old = _grpo_step_old_logp(hidden, w_local, target, source, **group_kw)
    value, d_hidden = _call(hidden, w_local, target, source=source, per_token=[adv, old],
                            cu_seqlens=OFFSETS, **group_kw)
    check_errors(tp.group)
    ref_value, ref_d_hidden = _call(hidden, weight, target, source=source, per_token=[adv, old],
                                    cu_seqlens=OFFSETS)
    tol = RUNBOOK_TOLERANCES[torch.float32]
    tp.assert_close(value, ref_value, atol=tol.atol, rtol=tol.rtol)
    tp.assert_close(d_hidden, ref_d_hidden, atol=tol.atol, rtol=tol.rtol)
