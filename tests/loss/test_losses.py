"""The built-in per-token losses (``tplogp.losses``): their closed-form derivatives equal autograd's
derivatives of their own values within fp32 rounding (float64 inputs give the exact comparison), at
the points where the formulas switch branches (PPO's clip boundaries, ties, a zero advantage) as
well as at random ones; sums of terms; and the clear errors for a wrong number of per-token tensors
or a missing entropy."""

from __future__ import annotations

import pytest
import torch

import tplogp
from tplogp import losses
from tplogp.tolerances import ERROR_SLACK, rel_error
from tests.support import tolerances as tol


def _points(n: int = 257, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """logp, entropy, advantages, old_logp, ref_logp in float64, with ratios exactly at PPO's clip
    edges (0.8, 1.28, 1), zero advantages, and logits of a trained model's spread (logp down to
    about -30)."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, generator=g, dtype=torch.float64) * 30
    entropy = torch.rand(n, generator=g, dtype=torch.float64) * 5
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[::7] = 0.0
    old = logp + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    edge = torch.tensor([0.8, 1.28, 1.0], dtype=torch.float64)
    # ratio = exp(logp - old) on the edges (up to rounding)
    old[:30] = logp[:30] - torch.log(edge.repeat(10))
    ref = logp + torch.randn(n, generator=g, dtype=torch.float64)
    return logp, entropy, adv, old, ref


def _autograd_derivatives(loss, logp, entropy, *extra):
    lp, ent = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    value = loss(lp, ent, *extra)
    d_logp, d_ent = torch.autograd.grad(value.sum(), (lp, ent), allow_unused=True)
    return value.detach(), d_logp, d_ent


def _as_tensor(d, like):
    if d is None:
        return torch.zeros_like(like)
    return d if isinstance(d, torch.Tensor) else torch.full_like(like, d)


CASES = {
    "cross_entropy": (losses.cross_entropy(), ()),
    "policy_gradient": (losses.policy_gradient(), ("adv",)),
    "ppo_clip": (losses.ppo_clip(0.2, 0.28), ("adv", "old")),
    "kl_to_reference": (losses.kl_to_reference(0.04), ("ref",)),
    "entropy_bonus": (losses.entropy_bonus(0.01), ()),
    "grpo sum": (losses.ppo_clip(0.2, 0.28) + losses.kl_to_reference(0.04) + losses.entropy_bonus(0.01),
                 ("adv", "old", "ref")),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_closed_form_derivatives_equal_autograds(name, dtype):
    loss, names = CASES[name]
    logp, entropy, adv, old, ref = (t.to(dtype) for t in _points())
    extra = [{"adv": adv, "old": old, "ref": ref}[k] for k in names]
    value, d_logp, d_ent = loss.value_and_derivatives(logp, entropy, *extra)
    want_value, want_logp, want_ent = _autograd_derivatives(loss, logp, entropy, *extra)
    eps = ERROR_SLACK[torch.float32].eps if dtype == torch.float32 else 1e-14
    assert torch.equal(value, want_value), name  # the same ops: the same value
    kink = torch.zeros_like(logp, dtype=torch.bool)
    if "adv" in names and "old" in names:
        # PPO's kink: a ratio just outside the range whose two terms round to the same value. Both
        # one-sided derivatives (0 and -A r) are subgradients there; autograd's tie rule gives their
        # mean, the closed form the unclipped one
        ratio = torch.exp(logp - old)
        kink = (ratio * adv == ratio.clamp(0.8, 1.28) * adv) & ((ratio < 0.8) | (ratio > 1.28))
        if name == "ppo_clip":  # (a sum's other terms are compared off the kinks)
            on_kink = _as_tensor(d_logp, logp)[kink] - _ppo_part(d_logp, want_logp, kink)
            assert torch.all(on_kink.abs() <= 1e-6 * (ratio * adv)[kink].abs()), name
    for what, got, want in (("d_logp", d_logp, want_logp), ("d_entropy", d_ent, want_ent)):
        got_t, want_t = _as_tensor(got, logp)[~kink], _as_tensor(want, logp)[~kink]
        assert rel_error(got_t, want_t) <= eps, f"{name} {what}: {rel_error(got_t, want_t):.2e}"
        assert (got is None) == (want is None or not torch.count_nonzero(want)), f"{name} {what} dependence"


def _ppo_part(d_logp, want_logp, kink):
    """At PPO's kinks: the closed form's value should be one of the one-sided derivatives, 0 or
    twice autograd's mean of the two (-A r); returns that one-sided value for each kink."""
    got, mean = _as_tensor(d_logp, want_logp)[kink], want_logp[kink]
    return torch.where(got == 0, 0.0, 2 * mean)


def test_ppo_clip_derivative_branches():
    """Inside the clip range the unclipped term's slope; outside it, on the clipped side, none; a
    zero advantage, none."""
    loss = losses.ppo_clip(0.2, 0.2)
    logp = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.5, 0.5, 1.1], dtype=torch.float64))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, 0.0], dtype=torch.float64)
    _, d_logp, _ = loss.value_and_derivatives(logp, None, adv, torch.zeros_like(logp))
    # r=1, A>0: -1; r=1.5 clipped at 1.2 (A>0: min is the clip): 0; r=0.5, A<0: min is the clip: 0;
    # r=1.5, A<0: min is r*A: -A r = 1.5; r=0.5, A>0: min is r*A: -0.5; A=0: 0
    assert torch.allclose(d_logp,
                          torch.tensor([-1.0, 0.0, 0.0, 1.5, -0.5, 0.0], dtype=torch.float64))


def test_sums_take_the_terms_per_token_tensors_in_order():
    clip, kl = losses.ppo_clip(0.2, 0.28), losses.kl_to_reference(0.04)
    both = clip + kl
    assert both.per_token == ("advantages", "old_logp", "ref_logp") and not both.reads_entropy
    assert (both + losses.entropy_bonus(0.1)).reads_entropy
    logp, entropy, adv, old, ref = _points()
    assert torch.equal(both(logp, entropy, adv, old, ref),
                       clip(logp, entropy, adv, old) + kl(logp, entropy, ref))


def test_a_wrong_number_of_per_token_tensors_names_what_the_loss_takes():
    logp = torch.zeros(3)
    with pytest.raises(ValueError,
                       match=r"ppo_clip\(0.2, 0.2\) takes per_token=\(advantages, old_logp\): 2"):
        losses.ppo_clip()(logp, None, logp)
    h, w, t = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"takes per_token=\(advantages,\): 1 tensor\(s\), got 0"):
        tplogp.linear_logp_loss(h, w, t, loss=losses.policy_gradient(), source="native")
    with pytest.raises(ValueError, match="reads the entropy: call with with_entropy=True"):
        tplogp.linear_logp_loss(h, w, t, loss=losses.entropy_bonus(0.1), with_entropy=False,
                                source="native")


def test_a_plain_call_runs_none_of_the_derivatives_ops():
    """Called as a plain per-token loss (the autograd path, the value-only chunks), a built-in
    computes its value alone: fewer ops than with its derivatives, and the same value."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    loss, names = CASES["grpo sum"]
    logp, entropy, adv, old, ref = _points()
    extra = [{"adv": adv, "old": old, "ref": ref}[k] for k in names]
    with Ops() as plain:
        value = loss(logp, entropy, *extra)
    with Ops() as full:
        parts = loss.value_and_derivatives(logp, entropy, *extra)
    assert plain.count < full.count, (plain.count, full.count)
    assert torch.equal(value, parts[0])


LINEAR = {"cross_entropy": True, "policy_gradient": True, "ppo_clip": False,
          "kl_to_reference": False, "entropy_bonus": True, "grpo sum": False}
# the documented per-token values of the linear losses, written out here (not through the loss
# objects)
FORMULAS = {"cross_entropy": lambda logp, entropy, adv: -logp,
            "policy_gradient": lambda logp, entropy, adv: -adv * logp,
            "entropy_bonus": lambda logp, entropy, adv: -0.01 * entropy,
            "pg + entropy": lambda logp, entropy, adv: -adv * logp - 0.01 * entropy}


@pytest.mark.parametrize("name", list(CASES) + ["pg + entropy"])
def test_linear_losses_are_their_coefficients_dot_logp_and_entropy(name):
    """A loss marked linear is ``c_logp * logp + c_entropy * entropy`` with its closed-form
    derivatives as the coefficients, and these do not depend on logp or entropy (the fused loss
    reduces it as a dot product): its value is the documented formula at two sets of points, from
    the coefficients alone; a sum is linear only when both terms are; the others refuse
    ``coefficients`` with an error naming the loss."""
    if name == "pg + entropy":
        loss, names, linear = losses.policy_gradient() + losses.entropy_bonus(0.01), ("adv",), True
    else:
        (loss, names), linear = CASES[name], LINEAR[name]
    logp, entropy, adv, old, ref = _points()
    extra = [{"adv": adv, "old": old, "ref": ref}[k] for k in names]
    assert loss.linear == linear
    if not linear:
        with pytest.raises(TypeError, match="not linear"):
            loss.coefficients(*extra)
        return
    c_logp, c_ent = loss.coefficients(*extra)
    value, d_logp, d_ent = loss.value_and_derivatives(logp, entropy, *extra)
    for c, d, x in ((c_logp, d_logp, logp), (c_ent, d_ent, entropy)):
        assert (c is None) == (d is None)
        assert torch.equal(_as_tensor(c, x), _as_tensor(d, x))
    for lp, ent in ((logp, entropy), (logp * 0.5 - 1, entropy + 2)):
        want = FORMULAS[name](lp, ent, adv)
        assert torch.allclose(loss(lp, ent, *extra), want, **tol.FLOAT64_FORMULA._asdict())
        # the coefficients found at the first
        dotted = _as_tensor(c_logp, lp) * lp + _as_tensor(c_ent, ent) * ent
        assert torch.allclose(dotted, want, **tol.FLOAT64_FORMULA._asdict())
