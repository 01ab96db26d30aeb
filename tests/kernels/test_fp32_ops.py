"""The kernels' fp32 tanh (:func:`tplogp.kernels.fp32_ops.tanh`, the softcap's) against float64: the
form this machine runs (Triton's interpreter on a CPU: the formula in plain fp32 operations; on a
GPU the PTX form with the approximate ``ex2`` / ``rcp``, held to the same bounds)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from tplogp.kernels.fp32_ops import PTX, tanh  # noqa: E402

ULP_OF_ONE = 2.0 ** -23


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PTX: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y_ptr + o, tanh(tl.load(x_ptr + o, mask=m), PTX), mask=m)


def _run(x: torch.Tensor) -> torch.Tensor:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = x.to(device)
    y = torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024, PTX=PTX)
    return y.cpu()


# the interpreter's exp2 of large |x| (inf: tanh = 1)
@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_tanh_error_saturation_and_symmetry():
    """Absolute error within two ulp of 1 everywhere (the rounding of ``1 - 2 / (1 + e)`` next to
    1), relative error within two ulp where ``|tanh| >= 0.5``; exactly +-1 once ``e^(2|x|)``
    overflows (and at +-inf); odd bit for bit."""
    half = torch.cat([torch.linspace(0, 12, 100001)[1:],
                      torch.tensor([1e-30, 1e-8, 1e-3, 44.0, 50.0, 1e4, 3e38])])
    x = torch.cat([half, -half]).float()
    y = _run(x)
    truth = torch.tanh(x.double())
    err = (y.double() - truth).abs()
    assert err.max().item() <= 2 * ULP_OF_ONE, (err.max().item(), x[err.argmax()].item())
    large = truth.abs() >= 0.5
    assert (err[large] / truth[large].abs()).max().item() <= 2 * ULP_OF_ONE
    assert torch.equal(y[x.abs() >= 44], torch.sign(x[x.abs() >= 44]))
    assert torch.equal(y[: half.numel()], -y[half.numel():])
    assert _run(torch.tensor([float("inf"), -float("inf")])).tolist() == [1.0, -1.0]
