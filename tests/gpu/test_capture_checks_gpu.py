"""On a CUDA GPU: a real CUDA-graph capture of forward and backward under the default checks (``TPLOGP_CHECKS``
unset), with ``ignore_index``. Replayed with good targets it gives an eager call's values and gradients and
``check_errors`` raises nothing; replayed after a target outside the vocabulary was written into the captured
targets buffer, the bad row's logp is NaN, every gradient of the call is zero, and ``check_errors`` raises after the
replay (once per replay). No CUDA error either way. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from tests.support.cuda import cuda_backend  # noqa: E402
from tplogp import LinearLogpInputError, check_errors, get_op  # noqa: E402


@pytest.mark.parametrize("source", ["native", "triton", "sm90"])
def test_default_checks_in_a_cuda_graph_with_ignore_index_and_a_bad_target(source, monkeypatch):
    monkeypatch.delenv("TPLOGP_CHECKS", raising=False)
    cuda_backend(source)
    op = get_op("linear_logp", source=source)
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 1024, 512, 8000
    h = (torch.randn(n, d, device="cuda", generator=gen) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=gen) / d ** 0.5).bfloat16().requires_grad_()
    b = (torch.randn(v, device="cuda", generator=gen) * 0.1).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    t[::5] = -100
    g = torch.randn(n, device="cuda", generator=gen)

    def step():
        logp = op(h, w, t, b, ignore_index=-100)
        (logp * g).sum().backward()
        return logp

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled, the layout planned and checked
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    check_errors()
    graph = torch.cuda.CUDAGraph()
    h.grad = w.grad = b.grad = None
    with torch.cuda.graph(graph):
        logp = step()
    for grad in (h.grad, w.grad, b.grad):
        grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    check_errors()  # good targets: nothing to raise
    got = [logp.clone(), h.grad.clone(), w.grad.clone(), b.grad.clone()]

    # an eager call that keeps the ignored rows in place, as the capture did (the same kernels on the same shapes)
    import tplogp.op.local_call

    with monkeypatch.context() as m:
        m.setattr(tplogp.op.local_call, "compacts_rows", lambda device: False)
        h2, w2, b2 = (x.detach().clone().requires_grad_() for x in (h, w, b))
        logp2 = op(h2, w2, t, b2, ignore_index=-100)
        (logp2 * g).sum().backward()
    for x, e in zip(got, [logp2, h2.grad, w2.grad, b2.grad]):
        torch.testing.assert_close(x, e.detach(), rtol=1e-4, atol=1e-4)
    check_errors()

    t[3] = v  # outside the vocabulary, written into the captured buffer
    for grad in (h.grad, w.grad, b.grad):
        grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(logp[3]) and torch.isfinite(logp[4:]).all() and logp[0].item() == 0.0
    for grad in (h.grad, w.grad, b.grad):
        assert torch.count_nonzero(grad) == 0  # the captured backward refused to write gradients
    with pytest.raises(LinearLogpInputError, match=rf"outside the vocabulary \[0, {v}\).*captured in a CUDA graph"):
        check_errors()
    check_errors()  # once per replay
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(LinearLogpInputError, match="captured in a CUDA graph"):  # the next replay's verdict
        check_errors()


def test_sync_checks_refuse_a_capture_before_capturing_anything(monkeypatch):
    monkeypatch.setenv("TPLOGP_CHECKS", "sync")
    op = get_op("linear_logp", source="native")
    h = torch.randn(64, 32, device="cuda")
    w = torch.randn(100, 32, device="cuda")
    t = torch.randint(0, 100, (64,), device="cuda")
    op(h, w, t)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(LinearLogpInputError, match="TPLOGP_CHECKS=sync"):
        with torch.cuda.graph(graph):
            op(h, w, t)
    torch.cuda.synchronize()  # no CUDA error left behind
    op(h, w, t)
