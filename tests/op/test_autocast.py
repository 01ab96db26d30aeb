"""Autocast: ``linear_logp`` under ``torch.autocast(device_type, dtype=X)`` behaves like
``F.linear`` followed by an fp32 ``log_softmax``: hidden, weight and bias are used in X, the outputs
are fp32, and the gradients reach the original tensors in their own dtypes. Checked on CPU against
float64 truth of the X-rounded inputs and against the autocast PyTorch reference (the three-way rule
of ``tplogp.tolerances``)."""

from __future__ import annotations

import pytest
import torch

from tplogp import linear_logp
from tplogp.reference import reference_outputs
from tplogp.tolerances import assert_no_worse
from tests.support.problems import make_problem
from tests.support import tolerances as tol

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _leaves(p):
    h = p.hidden.clone().requires_grad_()
    w = p.weight.clone().requires_grad_()
    b = p.bias.clone().requires_grad_()
    return h, w, b


def _backward(outs, p, h, w, b):
    logp, entropy, lse = outs
    ((logp * p.g_logp).sum() + (entropy * p.g_entropy).sum() + (lse * p.g_lse).sum()).backward()
    return dict(logp=logp.detach(), entropy=entropy.detach(), lse=lse.detach(), d_hidden=h.grad,
                d_weight=w.grad, d_bias=b.grad)


@pytest.mark.parametrize("backward_inside", [False, True],
                         ids=["backward-after", "backward-inside"])
@pytest.mark.parametrize("dtype", list(AUTOCAST_DTYPES))
def test_autocast_matches_linear_then_fp32_log_softmax(dtype, backward_inside):
    """fp32 parameters and activations under CPU autocast: X-precision inputs, fp32 outputs, fp32
    gradients."""
    dt = AUTOCAST_DTYPES[dtype]
    p = make_problem((3, 17), 40, 263, torch.float32, True, seed=11, peaked=True)
    temperature = 0.8

    def run(inside):
        h, w, b = _leaves(p)
        with torch.autocast("cpu", dtype=dt):
            outs = linear_logp(h, w, p.target, b, temperature=temperature, return_entropy=True,
                               return_lse=True)
            if inside:
                return _backward(outs, p, h, w, b)
        return _backward(outs, p, h, w, b)

    ours = run(backward_inside)
    for name in ("logp", "entropy", "lse", "d_hidden", "d_weight", "d_bias"):
        assert ours[name].dtype == torch.float32, (name, ours[name].dtype)
    if backward_inside:  # the same gradients as a backward after the region (docs/training.md)
        after = run(False)
        for name in ours:
            assert torch.equal(ours[name], after[name]), name

    # the PyTorch way: F.linear under the same autocast, then an fp32 log_softmax
    hr, wr, br = _leaves(p)
    with torch.autocast("cpu", dtype=dt):
        ref_out = reference_outputs(hr, wr, p.target, br, mode="matching", temperature=temperature)
    ref = _backward(ref_out, p, hr, wr, br)
    # float64 truth of the inputs as autocast rounds them
    ht, wt, bt = (x.to(dt).double().requires_grad_() for x in (p.hidden, p.weight, p.bias))
    truth = _backward(reference_outputs(ht, wt, p.target, bt, mode="float64",
                                        temperature=temperature), p, ht, wt, bt)

    for name in ("logp", "entropy", "lse", "d_hidden", "d_weight", "d_bias"):
        assert_no_worse(name, ours[name], ref[name], truth[name], dt)


def test_autocast_low_precision_leaves_keep_their_dtype():
    """bf16 activations with fp32 parameters (the usual mixed set-up): every gradient in its leaf's
    dtype, and no worse than the autocast PyTorch reference's against float64."""
    p = make_problem((12,), 24, 131, torch.float32, True, seed=2)

    def run(fn, leaves):
        h, w, b = leaves
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp = fn(h, w, p.target, b)
        (logp * p.g_logp.to(logp.dtype)).sum().backward()
        return logp.detach(), h.grad, w.grad, b.grad

    def mixed():
        return (p.hidden.to(torch.bfloat16).requires_grad_(), p.weight.clone().requires_grad_(),
                p.bias.clone().requires_grad_())

    ours = run(linear_logp, mixed())
    ref = run(lambda h, w, t, b: reference_outputs(h, w, t, b, mode="matching").logp, mixed())
    truth = run(lambda h, w, t, b: reference_outputs(h, w, t, b, mode="float64").logp,
                [x.to(torch.bfloat16).double().requires_grad_() for x in (p.hidden, p.weight,
                                                                          p.bias)])
    assert ours[0].dtype == torch.float32
    assert tuple(g.dtype for g in ours[1:]) == (torch.bfloat16, torch.float32, torch.float32)
    torch.testing.assert_close(ours[0].double(), truth[0], **tol.AUTOCAST_LOGP._asdict())
    for name, a, r, t in zip(("d_hidden", "d_weight", "d_bias"), ours[1:], ref[1:], truth[1:]):
        assert_no_worse(name, a, r, t, torch.bfloat16)


def test_outside_autocast_nothing_changes():
    """fp32 inputs outside autocast (and with autocast disabled) compute in fp32: bitwise the same
    results."""
    p = make_problem((9,), 32, 101, torch.float32, True, seed=4)
    plain = linear_logp(p.hidden, p.weight, p.target, p.bias, return_lse=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        disabled = linear_logp(p.hidden, p.weight, p.target, p.bias, return_lse=True)
    assert torch.equal(plain.logp, disabled.logp) and torch.equal(plain.lse, disabled.lse)
    truth = reference_outputs(p.hidden, p.weight, p.target, p.bias, mode="float64")
    ref = reference_outputs(p.hidden, p.weight, p.target, p.bias, mode="fp32")
    for name in ("logp", "lse"):
        assert_no_worse(name, getattr(plain, name), getattr(ref, name), getattr(truth, name),
                        torch.float32)
