"""docs/training.md on a CUDA GPU (skipped without CUDA): the CUDA-graph example, bf16 autocast with fp32
parameters, torch.compile with fullgraph, and CUDA-graph capture of the triton / sm90 sources.

Run on a GPU machine: ``python -m pytest tests/gpu/test_training_gpu.py -m gpu``.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from tests.support.doc_examples import run_example  # noqa: E402
from tests.support.cuda import cuda_backend  # noqa: E402
from tests.support.problems import make_problem, problem_on  # noqa: E402
from tplogp import get_op  # noqa: E402
from tplogp.reference import reference_outputs  # noqa: E402
from tplogp.tolerances import assert_no_worse  # noqa: E402

SOURCES = ["triton", "sm90"]


def _op(source):
    cuda_backend(source)
    return get_op("linear_logp", source=source)


def _cuda_problem(n, d, v, dtype, seed=0):
    return problem_on(make_problem((n,), d, v, dtype, True, seed=seed), "cuda")


def test_cuda_graph_example():
    run_example("cuda-graphs")


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("shape", [(1024, 1024, 32000), (2048, 1024, 32000), (777, 1000, 5003)],
                         ids=["1024x1024x32000", "2048x1024x32000", "odd-777x1000x5003"])
def test_bf16_autocast_with_fp32_params(source, shape):
    """The usual mixed-precision set-up: fp32 parameters under bf16 autocast, three-way against float64."""
    op = _op(source)
    n, d, v = shape
    p = _cuda_problem(n, d, v, torch.float32, seed=1)
    h, w, b = (x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logp, entropy, lse = op(h, w, p.target, b, return_entropy=True, return_lse=True)
    ((logp * p.g_logp).sum() + (entropy * p.g_entropy).sum() + (lse * p.g_lse).sum()).backward()
    assert logp.dtype == torch.float32 and (h.grad.dtype, w.grad.dtype, b.grad.dtype) == (torch.float32,) * 3

    def reference(mode, leaves):
        hr, wr, br = leaves
        out = reference_outputs(hr, wr, p.target, br, mode=mode)
        ((out.logp * p.g_logp).sum() + (out.entropy * p.g_entropy).sum() + (out.lse * p.g_lse).sum()).backward()
        return dict(logp=out.logp, entropy=out.entropy, lse=out.lse, d_hidden=hr.grad, d_weight=wr.grad,
                    d_bias=br.grad)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = reference("matching", [x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias)])
    truth = reference("float64", [x.to(torch.bfloat16).double().requires_grad_() for x in (p.hidden, p.weight,
                                                                                            p.bias)])
    ours = dict(logp=logp, entropy=entropy, lse=lse, d_hidden=h.grad, d_weight=w.grad, d_bias=b.grad)
    for name in ours:
        assert_no_worse(name, ours[name].detach(), ref[name].detach(), truth[name].detach(), torch.bfloat16)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("mode", ["full", "fast", "keep"])
def test_compile_fullgraph_on_gpu(source, mode, monkeypatch):
    """Inductor around the op, every option: one graph, eager's values and gradients; ``keep``: no ignore_index and
    a budget that keeps every logit (the compiled op keeps them for its backward)."""
    import tplogp

    monkeypatch.setenv("TPLOGP_CHECKS", "fast" if mode == "fast" else "full")
    torch._dynamo.reset()
    op = _op(source)
    p = _cuda_problem(512, 1024, 32000, torch.bfloat16, seed=2)
    opts = dict(temperature=0.8, return_entropy=True, return_lse=True, deterministic=True)
    if mode == "keep":
        opts["workspace_bytes"] = tplogp.keep_logits_budget(512, 32000, source=source, device="cuda")
    else:
        p.target[::7] = -100
        opts["ignore_index"] = -100

    def loss_fn(h, w, t, b):
        logp, entropy, lse = op(h, w, t, b, **opts)
        return (logp * p.g_logp).sum() + (entropy * p.g_entropy).sum() + (lse * p.g_lse).sum()

    def run(fn):
        h, w, b = (x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias))
        loss = fn(h, w, p.target, b)
        loss.backward()
        return [loss.detach(), h.grad, w.grad, b.grad]

    assert torch._dynamo.explain(loss_fn)(p.hidden, p.weight, p.target, p.bias).graph_break_count == 0
    eager = run(loss_fn)  # deterministic: the op runs the same kernels in both (inductor fuses the sums around it)
    compiled = run(torch.compile(loss_fn, fullgraph=True))
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("ignore", [False, True], ids=["all-rows", "ignore-index"])
def test_cuda_graph_capture_forward_and_backward(source, dtype, ignore, monkeypatch):
    """TPLOGP_CHECKS=fast: forward and backward captured in one CUDA graph, replayed on new inputs, equal to an
    eager call; with ignore_index the captured call keeps the ignored rows in place (no compaction)."""
    monkeypatch.setenv("TPLOGP_CHECKS", "fast")
    op = _op(source)
    p = _cuda_problem(1024, 1024, 32000, dtype, seed=3)
    h, w, b = (x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias))
    kw = {}
    if ignore:
        p.target[::5] = -100
        kw["ignore_index"] = -100

    def step():
        logp, entropy = op(h, w, p.target, b, return_entropy=True, **kw)
        ((logp * p.g_logp).sum() + (entropy * p.g_entropy).sum()).backward()
        return logp, entropy

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    h.grad = w.grad = b.grad = None
    with torch.cuda.graph(graph):
        logp, entropy = step()
    with torch.no_grad():
        h.copy_(torch.randn_like(h) * 0.5)
    for grad in (h.grad, w.grad, b.grad):
        grad.zero_()
    graph.replay()
    got = [logp.clone(), entropy.clone(), h.grad.clone(), w.grad.clone(), b.grad.clone()]

    # the eager call keeps the ignored rows in place too, as the capture did: the same kernels on the same shapes
    # (compaction's equality with this is tested on CPU, tests/op/test_ignored_rows_in_place.py)
    import tplogp.op.local_call

    monkeypatch.setattr(tplogp.op.local_call, "compacts_rows", lambda device: False)
    h2, w2, b2 = (x.detach().clone().requires_grad_() for x in (h, w, b))
    logp2, entropy2 = op(h2, w2, p.target, b2, return_entropy=True, **kw)
    ((logp2 * p.g_logp).sum() + (entropy2 * p.g_entropy).sum()).backward()
    for g, e in zip(got, [logp2, entropy2, h2.grad, w2.grad, b2.grad]):
        torch.testing.assert_close(g, e.detach(), rtol=1e-4, atol=1e-4)
