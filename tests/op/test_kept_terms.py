"""The 16-bit kept format: with a budget that keeps every logit, the forward keeps each logit's
softmax term ``exp(z - m)`` (bf16 for 16-bit inputs) with an fp32 running max ``m`` per (row, tile),
and the backward forms ``p = e exp(m - M - log S)`` from them. Values are the default's bits (the
statistics do not change); gradients carry e's rounding alone, so they stay at the same-dtype eager
reference's error against float64 (three-way, tolerance table) and within that error of the default
path, also for logits with a trained model's spread (std 5-10, rows whose target logit is ~30).
Rounding the logits themselves to bf16 does not (shown below: its error grows with the logits'
size). Native and triton (Triton's CPU interpreter) sources, and the fused loss.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tplogp
from tests.support.problems import Problem, cpu_sources, run_op, run_reference
from tplogp import get_op
from tplogp.tolerances import ERROR_SLACK, assert_no_worse, rel_error, slack_bound

N, D, V = 40, 32, 300


def trained_spread_problem(dtype: torch.dtype, seed: int = 0, std: float = 6.0,
                           peak: float = 30.0) -> Problem:
    """Logits with a trained LM head's spread: ``z ~ N(0, std^2)`` (std 6) and every third row's
    target logit set to ``peak`` (max about 30), bias 0.1 N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g)
    weight = torch.randn(V, D, generator=g) * (std / D ** 0.5)
    bias = torch.randn(V, generator=g) * 0.1
    target = torch.randint(0, V, (N,), generator=g)
    rows = torch.arange(0, N, 3)
    w_t = weight[target[rows]]
    z_t = (hidden[rows] * w_t).sum(1)
    hidden[rows] += ((peak - z_t) / (w_t * w_t).sum(1)).unsqueeze(1) * w_t
    gl, ge, gz = (torch.randn(N, generator=g) for _ in range(3))
    return Problem(hidden.to(dtype), weight.to(dtype), bias.to(dtype), target, gl, ge, gz)


def _keep_all(source: str, dtype: torch.dtype) -> int:
    return tplogp.keep_logits_budget(N, V, source=source, device="cpu", dtype=dtype)


def test_the_problem_has_a_trained_models_spread():
    p = trained_spread_problem(torch.float32)
    z = p.hidden @ p.weight.T + p.bias
    assert 5.0 <= float(z.std()) <= 10.0 and 25.0 <= float(z.max()) <= 40.0


@pytest.mark.parametrize("source", cpu_sources())
@pytest.mark.parametrize("dtype",
                         [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow),
                                   pytest.param(torch.float32, marks=pytest.mark.slow)],
                                   ids=["bf16", "fp16", "fp32"])
def test_keep_all_matches_the_default_and_float64(monkeypatch, source, dtype):
    """Every term kept (in the inputs' dtype: fp16 terms for fp16 inputs) against a call that keeps
    nothing (on triton, a call this small keeps by default: there a budget of the default workspace
    alone keeps nothing)."""
    from tplogp.backends import memory_budget

    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    p = trained_spread_problem(dtype, seed=1)
    op = get_op("linear_logp", source=source)
    kw = dict(entropy=True, lse=True, temperature=0.9)
    default = run_op(op, p,
                     workspace_bytes=None if source == "native" else memory_budget.DLOGITS_WORKSPACE_BYTES, **kw)
    kept = run_op(op, p, workspace_bytes=_keep_all(source, dtype), **kw)
    truth = run_reference(p, "float64", temperature=0.9, entropy=True, lse=True)
    ref = run_reference(p, "matching", temperature=0.9, entropy=True, lse=True)
    for name in ("logp", "entropy", "lse"):  # the statistics are the default's
        assert torch.equal(getattr(kept, name), getattr(default, name)), name
    for name in ("d_hidden", "d_weight", "d_bias"):
        ours, base = getattr(kept, name), getattr(default, name)
        assert ours.dtype == dtype
        assert_no_worse(f"{source} kept {name}", ours, getattr(ref, name), getattr(truth, name),
                        dtype)
        # within the table's allowance of the default path: the eager reference's error (16-bit),
        # fp32's eps
        allowed = (ERROR_SLACK[torch.float32].eps if dtype == torch.float32
                   else slack_bound(rel_error(getattr(ref, name), getattr(truth, name)), dtype))
        assert rel_error(ours, base) <= allowed, (name, rel_error(ours, base), allowed)


def test_kept_terms_are_16_bit_softmax_terms_with_fp32_scales(monkeypatch):
    """What the native forward keeps: ``exp(z - m)`` in bf16 (at most 1, exactly 1 at each row's
    max) and the running max ``m`` in fp32; half the bytes of fp32 logits, plus the scales."""
    from tplogp.backends.base import ShardCall
    from tplogp.backends.native import NativeBackend

    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    p = trained_spread_problem(torch.bfloat16, seed=2)
    be = NativeBackend()
    budget = _keep_all("native", torch.bfloat16)
    call = ShardCall(workspace_bytes=budget, for_backward=True)
    st = be.forward_stats(p.hidden, p.weight, p.bias, p.target, call)
    assert st.kept.numel() * 4 <= budget - NativeBackend.transient_bytes(torch.device("cpu"))
    assert st.kept.numel() * 4 < N * V * 4 * 0.6  # about half of fp32 logits
    tc, vc, (count, _) = be._plan(p.hidden, p.weight, call)
    views = be._kept_views(st.kept, N, V, tc, vc, count, False, torch.bfloat16)
    z = p.hidden.float() @ p.weight.float().T + p.bias.float()
    for (t0, v0), (terms, scales) in views.items():
        assert terms.dtype == torch.bfloat16 and scales.dtype == torch.float32
        rows = slice(t0, t0 + terms.shape[0])
        expect = torch.exp(z[rows, v0:v0 + terms.shape[1]] - scales.unsqueeze(1))
        assert float(terms.float().max()) <= 1.0
        # bf16 rounding (z's fp32 summation order aside)
        assert rel_error(terms.float(), expect) <= 2 ** -8
    assert torch.equal(torch.stack([s for _, s in views.values()]).amax(0) if len(views) > 1
                       else next(iter(views.values()))[1], st.row_max)


def test_rounded_logits_would_fail_the_table():
    """Why the terms and not the logits: with bf16-rounded logits and fp32 (M, log S) the peaked
    rows' ``1 - p`` takes the logits' rounding (up to 2^-9 |z| = 0.06 at z = 30) and d_hidden fails
    the three-way bound that the kept terms meet (the test above)."""
    p = trained_spread_problem(torch.bfloat16, seed=1)
    h, w, b = (x.double() for x in (p.hidden, p.weight, p.bias))
    z = h @ w.T + b
    lse = torch.logsumexp(z, 1, keepdim=True)
    onehot = torch.nn.functional.one_hot(p.target, V).double()
    g = p.g_logp.double().unsqueeze(1)
    # the logits rounded, the normalizer exact
    p_rounded = torch.exp(z.to(torch.bfloat16).double() - lse)
    d_hidden = ((onehot - p_rounded) * g) @ w
    truth = run_reference(p, "float64").d_hidden
    ref = run_reference(p, "matching").d_hidden
    assert rel_error(d_hidden, truth) > slack_bound(rel_error(ref, truth), torch.bfloat16)


@pytest.mark.parametrize("source", cpu_sources(slow_triton=True))
def test_fused_loss_keeping_terms_three_way(monkeypatch, source):
    """The fused loss with every chunk's terms kept (one chunk; chunks of 16 tokens) against float64
    and the eager reference, on the trained-spread logits."""
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    from tplogp import losses
    from tplogp.reference import reference_outputs

    dtype = torch.bfloat16
    p = trained_spread_problem(dtype, seed=3)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(4))
    loss_fn = losses.policy_gradient()

    def value_and_grads(fused, budget=None, mode=None):
        dt = torch.float64 if mode == "float64" else None
        h, w, b = ((x.to(dt) if dt else x).clone().requires_grad_() for x in (p.hidden, p.weight,
                                                                              p.bias))
        if fused:
            value = tplogp.linear_logp_loss(h, w, p.target, b, loss=loss_fn, per_token=(adv,),
                                            source=source, reduction="mean", workspace_bytes=budget)
        else:
            out = reference_outputs(h, w, p.target, b, mode=mode)
            value = loss_fn(out.logp, out.entropy, adv.to(out.logp.dtype)).mean()
        value.backward()
        return h.grad, w.grad, b.grad

    truth, ref = value_and_grads(False, mode="float64"), value_and_grads(False, mode="matching")
    default = value_and_grads(True)
    for budget in (tplogp.loss_chunk_budget(N, D, V, dtype=dtype, bias_dtype=dtype, source=source,
                                            device="cpu"),
                   tplogp.loss_chunk_budget(16, D, V, dtype=dtype, bias_dtype=dtype, source=source,
                                            device="cpu")):
        ours = value_and_grads(True, budget)
        for name, a, base, r, t in zip(("d_hidden", "d_weight", "d_bias"), ours, default, ref,
                                       truth):
            assert_no_worse(f"{source} {budget} {name}", a, r, t, dtype)
            assert rel_error(a, base) <= slack_bound(rel_error(r, t), dtype), (name,
                                                                               rel_error(a, base))


@pytest.mark.parametrize("source",
                         [s for s in cpu_sources() if getattr(s, "values", [s])[0] == "triton"])
@pytest.mark.parametrize("dtype",
                         [pytest.param(torch.bfloat16, marks=pytest.mark.slow), torch.float32],
                         ids=["bf16", "fp32"])
def test_consumed_kept_terms_become_d_logits_in_place(monkeypatch, source, dtype):
    """``ShardCall.consume_kept`` (the fused loss: one backward per forward) with every column kept:
    the d_logits kernel writes into the kept terms' memory (no workspace), then one d_hidden and one
    d_W GEMM over the whole shard; the gradients are those of the read-only schedule, bit for bit
    (one chunk either way here). Without it the kept buffer is left as the forward wrote it."""
    from tplogp.backends.base import ShardCall
    from tplogp.backends.triton_backend import TritonBackend
    from tplogp.kernels import backward_programs

    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    p = trained_spread_problem(dtype, seed=5)
    be = TritonBackend()
    budget = _keep_all("triton", dtype)
    stores = []
    real = backward_programs.launch_dlogits_kept

    def kept_launch(kept, *args, **options):
        stores.append(args[7].data_ptr() == kept.values.data_ptr())  # dz written over the terms
        return real(kept, *args, **options)

    monkeypatch.setattr(backward_programs, "launch_dlogits_kept", kept_launch)

    class Workspaces(TorchDispatchMode):
        """Tensors of the d_logits workspace's dtype and at least [N, 256] made during the
        backward."""

        def __init__(self):
            super().__init__()
            self.found = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == dtype and out.numel() >= N * 256 and (
                    func in (torch.ops.aten.empty.memory_format,
                             torch.ops.aten.empty_strided.default)):
                self.found.append(tuple(out.shape))
            return out

    results, workspaces = {}, {}
    for consume in (False, True):
        call = ShardCall(workspace_bytes=budget, for_backward=True, with_entropy=True,
                         consume_kept=consume)
        out = be.forward_single(p.hidden, p.weight, p.bias, p.target, call)
        before = out.kept.clone()
        with Workspaces() as seen:
            grads = be.backward(p.hidden, p.weight, p.bias, p.target, out.row_max, out.log_sum,
                                p.g_logp, p.g_entropy, None, out.mean_rel, call, (True, True, True),
                                kept=out.kept)
        results[consume], workspaces[consume] = grads, seen.found
        assert torch.equal(out.kept, before) != consume  # overwritten only when consumed
    assert stores == [False, True]
    # the read-only schedule allocates its d_logits workspace ([N, V] here: one chunk); the
    # consuming one none (d_W itself is [V, D] of the weight dtype: counted in neither, D < 256 rows
    # here would hide it anyway)
    assert (N, V) in workspaces[False] and not any(s == (N, V) for s in workspaces[True]), workspaces
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)
