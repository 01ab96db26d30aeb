"""The one tolerance table used by the tests, the runbook script, the plugin fixtures and the benchmarks.

Two kinds of check:

* ``RUNBOOK_TOLERANCES`` -- ``allclose`` bounds (``|x - ref| <= atol + rtol * |ref|``) of the runbook script's
  correctness phase against the materialized reference, per dtype (the runbook's bf16 default is 0.08).
* ``ERROR_SLACK`` -- the three-way rule of the test suite: the op's error against float64 truth must be no worse
  than ``factor * (error of the same-dtype PyTorch reference) + eps``, measured as a relative norm
  ``||x - truth|| / ||truth||``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Tolerance(NamedTuple):
    atol: float
    rtol: float


class ErrorSlack(NamedTuple):
    factor: float
    eps: float


RUNBOOK_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-3, rtol=1e-3),
    torch.bfloat16: Tolerance(atol=0.08, rtol=0.08),
    torch.float16: Tolerance(atol=0.02, rtol=0.02),
}

# factor * reference error + eps, per dtype. fp32 eps covers reduction-order differences at the 1e-6 level.
ERROR_SLACK: dict[torch.dtype, ErrorSlack] = {
    torch.float32: ErrorSlack(factor=2.0, eps=2e-6),
    torch.bfloat16: ErrorSlack(factor=1.1, eps=2e-4),
    torch.float16: ErrorSlack(factor=1.1, eps=5e-5),
}


def rel_error(x: torch.Tensor, truth: torch.Tensor) -> float:
    """``||x - truth|| / max(||truth||, tiny)`` in float64."""
    x64, t64 = x.detach().double(), truth.detach().double()
    return float((x64 - t64).norm() / t64.norm().clamp_min(1e-30))


def assert_no_worse(name: str, ours: torch.Tensor, reference: torch.Tensor, truth: torch.Tensor,
                    dtype: torch.dtype) -> tuple[float, float]:
    """Three-way check: our error vs float64 truth is within the slack of the same-dtype reference's error."""
    slack = ERROR_SLACK[dtype]
    e_ours, e_ref = rel_error(ours, truth), rel_error(reference, truth)
    bound = slack.factor * e_ref + slack.eps
    if not (e_ours <= bound):
        raise AssertionError(
            f"{name}: error vs float64 {e_ours:.3e} exceeds {slack.factor} x reference error {e_ref:.3e} "
            f"+ {slack.eps:.0e} = {bound:.3e} ({dtype})")
    return e_ours, e_ref
