"""Kept-logits budgets and the fused loss on the triton / sm90 sources at real sizes (skipped without CUDA).

Every budget three-way against float64 truth and the same-dtype eager reference (tolerance table), the extra memory
within the budget, and the fused loss (``linear_logp_loss``) against float64 and eager with 16-bit inputs and peaked
rows over one and several token chunks. Run: ``python -m pytest tests/gpu/test_workspace_gpu.py -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

import tplogp  # noqa: E402
from tests.support.cuda import cuda_backend  # noqa: E402
from tplogp.tolerances import assert_no_worse  # noqa: E402

SOURCES = ["triton", "sm90"]


def _problem(n, d, v, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = (torch.randn(n, d, device="cuda", generator=g) * 0.5).to(dtype)
    w = (torch.randn(v, d, device="cuda", generator=g) / d**0.5).to(dtype)
    b = (torch.randn(v, device="cuda", generator=g) * 0.1).to(dtype)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    rows = torch.arange(0, n, 3, device="cuda")
    h[rows] = (w[y[rows]].float() * (40.0 / w[y[rows]].float().norm(dim=1, keepdim=True))).to(dtype)  # peaked
    return h, w, b, y, torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)


def _grads(fn, h, w, b, y, g, ge):
    h, w, b = (t.clone().requires_grad_() for t in (h, w, b))
    out = fn(h, w, y, b)
    torch.autograd.backward([out.logp, out.entropy], [g.to(out.logp.dtype), ge.to(out.logp.dtype)])
    return dict(logp=out.logp.detach(), entropy=out.entropy.detach(), d_hidden=h.grad, d_weight=w.grad,
                d_bias=b.grad)


N, D, V = 2048, 1024, 32000
BUDGETS = {"default": None, "half": 0.5, "all": 1.0}  # the share of the call's logits kept (keep_logits_budget)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kept_logits_budgets_three_way(source, dtype):
    from tplogp.reference import reference_outputs
    from tplogp.api import linear_logp_on
    from tplogp.op.plan import LogpOptions

    be = cuda_backend(source)
    h, w, b, y, g, ge = _problem(N, D, V, dtype)
    truth = _grads(lambda h, w, y, b: reference_outputs(h, w, y, b, mode="float64"),
                   h.double(), w.double(), b.double(), y, g, ge)  # float64 leaves: unrounded gradients
    ref_mode = "matching" if dtype != torch.float32 else "fp32"
    ref = _grads(lambda h, w, y, b: reference_outputs(h, w, y, b, mode=ref_mode), h, w, b, y, g, ge)
    results = {}
    for label, share in BUDGETS.items():
        budget = None if share is None else tplogp.keep_logits_budget(N, V, fraction=share, source=source,
                                                                      device="cuda", dtype=dtype)
        fn = lambda h, w, y, b: linear_logp_on(be, h, w, y, b, options=LogpOptions(  # noqa: E731
            return_entropy=True, workspace_bytes=budget))
        _grads(fn, h, w, b, y, g, ge)  # warm-up: compile the KEEP variants outside the memory window
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        results[label] = found = _grads(fn, h, w, b, y, g, ge)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        inputs = (N * D + V * D + V) * dtype.itemsize  # the clones that require grad
        grads = N * D * (4 + dtype.itemsize) + V * D * dtype.itemsize + V * 4  # d_hidden fp32 + its cast, d_W, d_b
        limit = (budget or be.transient_bytes(h.device)) + inputs + grads + (16 << 20)  # + outputs, stats: a few MiB
        assert extra <= limit, f"{label}: extra memory {extra / 2**20:.0f} MiB over {limit / 2**20:.0f} MiB"
        for name in found:
            assert_no_worse(f"{source} {label} {name}", found[name], ref[name], truth[name], dtype)
    for label in ("half", "all"):  # the forward is the same kernel work: logp and entropy are the default's bits
        for name in ("logp", "entropy"):
            assert torch.equal(results[label][name], results["default"][name]), (label, name)


@pytest.mark.parametrize("source", SOURCES)
def test_keep_all_backward_in_place_and_through_a_retained_graph(source):
    """Every logit's term kept, bf16, two 128 MiB chunks' worth of terms: a backward that frees the graph writes
    d_logits over the kept terms (one d_hidden and one d_W GEMM), its peak above what the forward left is the
    gradients alone (no d_logits workspace); through a retained graph the first backward reads the terms (the
    chunked schedule and its workspace) and a second one reads them again, with the same gradients. Both schedules
    within the tolerance table against float64 and the eager reference (their GEMM splits differ: not the same
    bits)."""
    from tplogp.reference import reference_outputs
    from tplogp.api import linear_logp_on
    from tplogp.op.plan import LogpOptions

    be = cuda_backend(source)
    n, d, v, dtype = 4096, 1024, 32000, torch.bfloat16
    h, w, b, y, g, ge = _problem(n, d, v, dtype, seed=3)
    truth = _grads(lambda h, w, y, b: reference_outputs(h, w, y, b, mode="float64"),
                   h.double(), w.double(), b.double(), y, g, ge)
    ref = _grads(lambda h, w, y, b: reference_outputs(h, w, y, b, mode="matching"), h, w, b, y, g, ge)
    opts = LogpOptions(return_entropy=True,
                       workspace_bytes=tplogp.keep_logits_budget(n, v, source=source, device="cuda", dtype=dtype))

    def backward_peak(retain: bool):
        leaves = [t.clone().requires_grad_() for t in (h, w, b)]
        out = linear_logp_on(be, *leaves[:2], y, leaves[2], options=opts)
        upstream = [out.logp, out.entropy], [g.to(out.logp.dtype), ge.to(out.logp.dtype)]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.autograd.backward(*upstream, retain_graph=retain)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        first = [x.grad.clone() for x in leaves]
        if retain:  # read-only again (a third backward could read the terms): the first one's bits
            torch.autograd.backward(*upstream, retain_graph=True)
            for x, f in zip(leaves, first):
                assert torch.equal(x.grad, 2 * f)
        return peak, dict(d_hidden=first[0], d_weight=first[1], d_bias=first[2])

    backward_peak(False)  # warm-up: compile the kernels outside the memory window
    consumed_peak, consumed = backward_peak(False)
    retained_peak, retained = backward_peak(True)
    grads = n * d * (4 + 2) + v * d * 2 + v * 2  # d_hidden fp32 + its cast, d_W, d_b
    workspace = be.transient_bytes(h.device)
    assert consumed_peak <= grads + (16 << 20), f"{consumed_peak / 2**20:.0f} MiB"  # + d_b partials, per-token
    assert retained_peak >= consumed_peak + workspace - (16 << 20), (retained_peak, consumed_peak)
    for name in consumed:
        for label, found in (("consumed", consumed), ("retained", retained)):
            assert_no_worse(f"{source} {label} {name}", found[name], ref[name], truth[name], dtype)


def _loss(logp, entropy, adv, old):
    ratio = torch.exp(logp - old)
    return -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv) - 0.01 * entropy


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("chunks", [1, 4])
def test_fused_loss_three_way(source, chunks):
    """``linear_logp_loss`` with bf16 inputs and peaked rows: loss and gradients three-way against float64 and the
    eager reference (``linear_logp`` semantics materialized in bf16, fp32 loss); ``chunks`` token chunks of kept
    logits (1: the whole batch's logits kept, 3 GEMMs)."""
    from tplogp.reference import reference_outputs

    cuda_backend(source)
    n, d, v = 4096, 1024, 32000
    h, w, b, y, adv, _ = _problem(n, d, v, torch.bfloat16, seed=1)
    old = -3 + 0.3 * torch.randn(n, device="cuda")

    def eager(mode):
        dt = torch.float64 if mode == "float64" else None
        hh, ww, bb = ((t.to(dt) if dt else t).clone().requires_grad_() for t in (h, w, b))
        out = reference_outputs(hh, ww, y, bb, mode=mode)
        value = _loss(out.logp, out.entropy, adv.to(out.logp.dtype), old.to(out.logp.dtype)).mean()
        value.backward()
        return value.detach(), hh.grad, ww.grad, bb.grad

    truth, ref = eager("float64"), eager("matching")
    hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
    budget = tplogp.loss_chunk_budget(n // chunks, d, v, dtype=w.dtype, bias_dtype=b.dtype, source=source,
                                      device="cuda")
    value = tplogp.linear_logp_loss(hh, ww, y, bb, loss=_loss, per_token=(adv, old), reduction="mean",
                                    workspace_bytes=budget, source=source)
    value.backward()
    for name, ours, r, t in zip(("loss", "d_hidden", "d_weight", "d_bias"), (value.detach(), hh.grad, ww.grad,
                                                                          bb.grad), ref, truth):
        assert_no_worse(f"{source} {chunks} chunks {name}", ours, r, t, torch.bfloat16)
