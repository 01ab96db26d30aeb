"""The backward of ``linear_logp_loss`` scales the gradients computed in the forward by the upstream
scalar ``g``: the fp32 product rounded once to the input's dtype (bitwise the saved gradient rounded
once for ``g = 1``), through the Triton kernel (Triton's CPU interpreter here) and through the CPU's
torch ops; in place and adopted by autograd without a copy when the graph is not retained; unscaled
for a retained graph's second backward."""

from __future__ import annotations

import pytest
import torch

import tplogp
from tests.support.problems import make_problem
from tplogp.fused_loss import chunk_gradients, grad_scaling
from tplogp import losses
from tplogp.kernels.tiles import interpreting

CPU = torch.device("cpu")
KERNEL_HERE = interpreting() and grad_scaling.triton_usable()
# the two ways the CPU scales: Triton's interpreter (the GPU's kernel) and torch ops in flat blocks
PATHS = [pytest.param("kernel",
                      marks=pytest.mark.skipif(not KERNEL_HERE,
                                               reason="needs triton (interpreter)")),
         "torch"]


@pytest.fixture
def path(request, monkeypatch):
    """Force the scaling path; the torch one with blocks of 1000 elements, so that several blocks
    run."""
    if request.param == "torch":
        monkeypatch.setattr(grad_scaling, "runs_kernel", lambda t, dtype, on_device=None: False)
        monkeypatch.setattr(grad_scaling, "SCALE_BLOCK_ELEMENTS", 1000)
    return request.param


# 0.3 is not a bf16 value: a g rounded to 16 bits first (or a product rounded twice) differs in many
# elements
@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                    (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.float32)],
                         ids=["fp32-bf16", "fp32-fp16", "bf16-bf16", "fp32-fp32"])
@pytest.mark.parametrize("g", [1.0, 0.3])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "new"])
def test_scaled_is_the_fp32_product_rounded_once(path, dtypes, g, in_place):
    saved_dtype, dtype = dtypes
    gen = torch.Generator().manual_seed(3)
    # [3, 8195]: more than one kernel block (8192 elements), a ragged last one; magnitudes from fp16
    # subnormals up
    t = (torch.randn(3, 8195, generator=gen) * torch.logspace(-6, 4, 8195)).to(saved_dtype)
    kept = t.clone()
    scalar = torch.tensor(g)
    want = (t.to(torch.float32) * scalar).to(dtype)
    got, = grad_scaling.scaled_all([t], scalar, [dtype], in_place)
    assert got.dtype == dtype and got.shape == t.shape
    assert torch.equal(got, want), f"{path}: {(got != want).sum()} elements differ from the fp32 product rounded once"
    # in place exactly when the dtype allows it
    assert (got is t) == (in_place and saved_dtype == dtype)
    if got is not t:
        assert torch.equal(t, kept), "a scaling into a new tensor changed the saved gradient"
    if g == 1.0:  # loss.backward(): the saved gradient rounded once
        assert torch.equal(got, kept.to(dtype))
    assert grad_scaling.runs_kernel(t, dtype) == (path == "kernel")


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("g", [1.0, 0.3])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "new"])
def test_a_backward_scales_every_gradient_in_one_launch(path, g, in_place, monkeypatch):
    """d_hidden (fp32 to bf16), d_W (bf16, in place when allowed), no gradient (None) and d_b (fp32
    to fp16): each the fp32 product rounded once, the kernel path in ONE launch whatever the
    tensors' sizes and dtypes (with ``g == 1`` the in-place d_W is left as it is on the device, the
    new tensors beside it still written)."""
    from tplogp.kernels.launch import Launch

    launches = []
    real = Launch.__call__

    def counting(self, *tensors):  # (every kernel launch goes through a Launch)
        launches.append(self.kernel)
        return real(self, *tensors)

    monkeypatch.setattr(Launch, "__call__", counting)
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(5, 3001, generator=gen) * 3,
             (torch.randn(9000, generator=gen)).to(torch.bfloat16), None,
             torch.randn(8193, generator=gen) * 1e-3]
    dtypes = [torch.bfloat16, torch.bfloat16, None, torch.float16]
    kept = [None if t is None else t.clone() for t in grads]
    scalar = torch.tensor(g)
    got = grad_scaling.scaled_all(grads, scalar, dtypes, in_place)
    assert got[2] is None
    for i in (0, 1, 3):
        want = (kept[i].to(torch.float32) * scalar).to(dtypes[i])
        assert got[i].dtype == dtypes[i] and torch.equal(got[i], want), f"gradient {i} is not rounded once"
        assert (got[i] is grads[i]) == (in_place and i == 1)
    assert len(launches) == (1 if path == "kernel" else 0)


def _problem_and_saved(monkeypatch, chunks: int):
    """A bf16 problem with bias run as one chunk or as 6 chunks of 8 tokens (fp32 accumulators), and
    a list that receives each call's saved gradients: ``(clone, data_ptr)`` per gradient."""
    p = make_problem((45,), 8, 157, torch.bfloat16, True, seed=4)
    saved = []
    real = chunk_gradients.token_loss_and_grads

    def spying(*args, **kwargs):
        total, grads = real(*args, **kwargs)
        saved.append([(t.clone(), t.data_ptr()) for t in grads])
        return total, grads

    monkeypatch.setattr(chunk_gradients, "token_loss_and_grads", spying)
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    ws = None if chunks == 1 else tplogp.loss_chunk_budget(8, 8, 157, dtype=torch.bfloat16,
                                                           bias_dtype=torch.bfloat16, device=CPU,
                                                           source="native")
    return p, saved, ws


def _leaves(p):
    return [t.clone().requires_grad_() for t in (p.hidden, p.weight, p.bias)]


def _loss(p, leaves, ws):
    adv = torch.linspace(-1, 1, p.target.numel())
    return tplogp.linear_logp_loss(*leaves[:2], p.target, leaves[2], loss=losses.policy_gradient(),
                                   per_token=(adv,), reduction="mean", source="native",
                                   workspace_bytes=ws, with_entropy=False)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("chunks", [1, 6])
@pytest.mark.parametrize("g", [1.0, 0.3])
def test_backward_hands_over_the_saved_gradients_scaled(monkeypatch, path, chunks, g):
    """``(g * loss).backward()``: each gradient is the saved one times ``g`` in fp32, rounded once
    to bf16 (for ``g = 1`` bitwise the saved gradient rounded once). One chunk's bf16 ``d_W`` and
    ``d_b`` are scaled in place and become ``.grad`` without a copy; fp32 ones (``d_hidden``, the
    accumulators) are rounded into new tensors. A second backward without a retained graph
    raises."""
    p, saved, ws = _problem_and_saved(monkeypatch, chunks)
    leaves = _leaves(p)
    value = _loss(p, leaves, ws)
    (value * g if g != 1.0 else value).backward()
    (dh, dh_ptr), (dw, dw_ptr), (db, db_ptr) = saved[0]
    assert dh.dtype == torch.float32 and (dw.dtype, db.dtype) == ((torch.bfloat16,
                                                                   ) * 2 if chunks == 1
                                                                  else (torch.float32,) * 2)
    scalar = torch.tensor(g)
    for name, leaf, t, ptr in zip(("d_hidden", "d_weight", "d_bias"), leaves, (dh, dw, db),
                                  (dh_ptr, dw_ptr, db_ptr)):
        want = (t.to(torch.float32) * scalar).to(torch.bfloat16)
        assert torch.equal(leaf.grad, want), f"{name}: not the saved gradient times {g} rounded once"
        assert (leaf.grad.data_ptr() == ptr) == (t.dtype == torch.bfloat16), f"{name}: copied or not in place"
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        value.backward()


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_retained_graph_gives_the_same_gradients_twice(monkeypatch, path):
    """With ``retain_graph=True`` the saved gradients stay unscaled: a second backward (here with
    another upstream scalar) gives the same gradients as a fresh call's, and the saved ones are
    unchanged."""
    p, saved, ws = _problem_and_saved(monkeypatch, 1)
    leaves = _leaves(p)
    value = _loss(p, leaves, ws)
    grads = []
    for _ in range(2):
        (value * 0.3).backward(retain_graph=True)
        grads.append([t.grad for t in leaves])
        for t in leaves:
            t.grad = None
    (value * 0.3).backward()  # the last one may scale in place
    grads.append([t.grad for t in leaves])
    fresh = _leaves(p)
    (_loss(p, fresh, ws) * 0.3).backward()
    for name, *found in zip(("d_hidden", "d_weight", "d_bias"), *grads, [t.grad for t in fresh]):
        assert all(torch.equal(f, found[-1]) for f in found[:-1]), f"{name}: differs between backwards"
