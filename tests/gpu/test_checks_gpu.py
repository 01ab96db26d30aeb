"""On a CUDA GPU: with the default checks a call without a TP group (forward + backward) makes no synchronizing
CUDA call (``torch.cuda.set_sync_debug_mode("error")`` turns any into an error), and a bad target still raises at
the next call. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from tests.gpu import cuda_backend  # noqa: E402
from tplogp import LinearLogpInputError, check_errors, get_op  # noqa: E402


def _op(source):
    cuda_backend(source)
    return get_op("linear_logp", source=source)


def _step(op, h, w, t, g):
    out = op(h, w, t, return_entropy=True)
    ((out.logp * g).sum() + out.entropy.sum()).backward()


@pytest.mark.parametrize("source", ["native", "triton", "sm90"])
def test_default_checks_make_no_synchronizing_call(source, monkeypatch):
    monkeypatch.delenv("TPLOGP_CHECKS", raising=False)
    op = _op(source)
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 512, 256, 1000
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (torch.randn(v, d, device="cuda", dtype=torch.bfloat16, generator=gen) / 16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    g = torch.randn(n, device="cuda", generator=gen)
    for _ in range(2):  # compile, probe, allocate
        _step(op, h, w, t, g)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _step(op, h, w, t, g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    bad = t.clone()
    bad[7] = v
    out = op(h.detach(), w.detach(), bad)
    with pytest.raises(LinearLogpInputError, match=rf"target id {v} is outside the vocabulary"):
        op(h.detach(), w.detach(), t)
    assert torch.isnan(out[7]) and torch.isfinite(out[:7]).all()
    check_errors()
