"""On a CUDA GPU: with the default checks a call without a TP group (forward + backward) makes no synchronizing
CUDA call (``torch.cuda.set_sync_debug_mode("error")`` turns any into an error), and a bad target still raises: in
the same call's backward, at ``check_errors``, or at a later call once the device has delivered the verdict.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from tests.support.cuda import cuda_backend  # noqa: E402
from tests.support.problems import make_problem, problem_on  # noqa: E402
from tplogp import LinearLogpInputError, check_errors, get_op  # noqa: E402


def _op(source):
    cuda_backend(source)
    return get_op("linear_logp", source=source)


def _planned(source, seed, monkeypatch):
    """``(op, hidden, weight, targets, vocab)`` of a 300 x 64 x 1000 bf16 problem under the default checks, after one
    good forward+backward (kernels compiled, layout planned)."""
    monkeypatch.delenv("TPLOGP_CHECKS", raising=False)
    op = _op(source)
    v = 1000
    p = problem_on(make_problem((300,), 64, v, torch.bfloat16, False, seed=seed), "cuda")
    h, w, t = p.hidden.requires_grad_(), p.weight.requires_grad_(), p.target
    op(h, w, t).sum().backward()
    return op, h, w, t, v


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
    out = op(h, w, bad).detach()  # records a graph whose backward never runs: its verdict waits
    torch.cuda.synchronize()  # the verdict delivered: the next call's start judges it (it never waits for it)
    with pytest.raises(LinearLogpInputError, match=rf"target id {v} is outside the vocabulary"):
        op(h.detach(), w.detach(), t)
    assert torch.isnan(out[7]) and torch.isfinite(out[:7]).all()
    check_errors()


@pytest.mark.parametrize("source", ["native", "triton", "sm90"])
@pytest.mark.parametrize("bad_id", [-3, 1000, 1 << 40])
def test_bad_target_raises_in_the_same_calls_backward_and_leaves_the_model_unchanged(source, bad_id, monkeypatch):
    """The default checks (the triton / sm90 finishing kernel writes the verdict to pinned host memory; native's
    summary is copied behind an event): the backward of the call with the bad target raises before any gradient
    reaches the parameters, naming the id; a no-grad call raises at the call itself."""
    op, h, w, t, v = _planned(source, 1, monkeypatch)
    check_errors()
    h.grad = w.grad = None
    before = w.detach().clone()
    bad = t.clone()
    bad[-1] = bad_id
    opt = torch.optim.SGD([w], lr=1.0)
    loss = op(h, w, bad).sum()
    with pytest.raises(LinearLogpInputError, match=rf"target id {bad_id} is outside the vocabulary"):
        loss.backward()
    assert w.grad is None and h.grad is None
    opt.step()
    assert torch.equal(w.detach(), before)
    check_errors()  # judged once, by the backward
    at_call = rf"target id {bad_id} is outside the vocabulary .*\[checked at the call"
    with torch.no_grad(), pytest.raises(LinearLogpInputError, match=at_call):
        op(h, w, bad)  # no backward would carry the verdict: decided at the call
    check_errors()
    op(h, w, t).sum().backward()  # the next good call runs


@pytest.mark.parametrize("source", ["triton", "sm90"])
def test_verdict_on_a_side_stream(source, monkeypatch):
    """Calls on a stream other than the default one: the check's event is recorded on the stream the finishing
    kernel ran on (the cached current stream follows the switch), so a verdict is never read before that kernel
    wrote it; a bad target raises in its backward and the good calls around it on either stream run."""
    op, h, w, t, v = _planned(source, 2, monkeypatch)  # on the default stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    bad = t.clone()
    bad[5] = v + 7
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the side stream is busy: the finishing kernel writes the flag late
        loss = op(h, w, bad).sum()
        with pytest.raises(LinearLogpInputError, match=rf"target id {v + 7} is outside the vocabulary"):
            loss.backward()
        h.grad = w.grad = None
        op(h, w, t).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    h.grad = w.grad = None
    op(h, w, t).sum().backward()
    check_errors()


@pytest.mark.parametrize("source", ["native", "triton", "sm90"])
def test_no_grad_call_decides_its_verdict_at_the_call_with_one_host_read(source, monkeypatch):
    """A no-grad call (a GRPO step's old log-probs) reads its targets' range at the call: one host
    read, counted by the CUDA sync debug mode as the only synchronizing call; a bad id raises there
    and no NaN is handed out. A no-grad call captured in a CUDA graph reads nothing (its flag is
    read by ``check_errors`` after a replay)."""
    op, h, w, t, v = _planned(source, 3, monkeypatch)
    check_errors()
    with torch.no_grad():
        op(h, w, t)  # planned without a graph
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with pytest.warns(UserWarning, match="called a synchronizing CUDA operation") as caught:
                out = op(h, w, t)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert len(caught) == 1, [str(c.message) for c in caught]
        assert torch.isfinite(out).all()
        bad = t.clone()
        bad[3] = v
        at_call = rf"target id {v} is outside the vocabulary \[0, {v}\) \[checked at the call"
        with pytest.raises(LinearLogpInputError, match=at_call):
            op(h, w, bad)
        check_errors()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            op(h, w, t.clone())  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(side)
        captured_targets = t.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op(h, w, captured_targets)
        captured_targets.copy_(bad)
        graph.replay()
        torch.cuda.synchronize()
        captured = (rf"outside the vocabulary \[0, {v}\) \[found by the target check of a "
                    r"linear_logp call captured in a CUDA graph")
        with pytest.raises(LinearLogpInputError, match=captured):
            check_errors()
