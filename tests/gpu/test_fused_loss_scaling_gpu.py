"""The fused loss's backward scaling kernel and ``with_entropy=False`` on a GPU (skipped without CUDA).

The scaling kernel against the fp32 product rounded once (bitwise, in place and into a new tensor, several dtypes,
a 1 GiB bf16 ``d_W``-sized tensor among them); the loss without the entropy statistics bitwise equal to the default
for a loss that reads no entropy (triton and sm90, one chunk and four). Run:
``python -m pytest tests/gpu/test_fused_loss_scaling_gpu.py -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

import tplogp  # noqa: E402
from tests.support.cuda import cuda_backend  # noqa: E402
from tplogp.fused_loss import grad_scaling  # noqa: E402
from tplogp import losses  # noqa: E402

SOURCES = ["triton", "sm90"]


# [128256, 4096]: the d_W of a Llama-3 head (1 GiB in bf16, past 2**31 bytes: int64 offsets); [3, 1 << 20 + 5]: a
# ragged last block
@pytest.mark.parametrize("shape", [(3, (1 << 20) + 5), (128256, 4096)], ids=["ragged", "llama-head"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.float16), (torch.float32, torch.float32)],
                         ids=["fp32-bf16", "bf16-bf16", "fp32-fp16", "fp32-fp32"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "new"])
def test_scale_kernel_is_the_fp32_product_rounded_once(shape, dtypes, in_place):
    saved_dtype, dtype = dtypes
    if shape[0] > 3 and (saved_dtype, dtype) != (torch.bfloat16, torch.bfloat16):
        pytest.skip("the large shape runs the one-chunk bf16 d_W case only")
    g = torch.Generator(device="cuda").manual_seed(0)
    t = torch.randn(shape, device="cuda", generator=g).to(saved_dtype)
    kept = t.clone()
    for value in (1.0, 0.3):
        scalar = torch.tensor(value, device="cuda")
        want = (kept.float() * scalar).to(dtype)
        src = kept.clone() if in_place else t
        got, = grad_scaling.scaled_all([src], scalar, [dtype], in_place)
        assert grad_scaling.runs_kernel(src, dtype)
        assert (got is src) == (in_place and saved_dtype == dtype)
        assert torch.equal(got, want), f"g={value}: {(got != want).sum().item()} elements differ"
        del got, want, src
    assert torch.equal(t, kept)


def _ce(logp, entropy):
    return -logp


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("chunks", [1, 4])
def test_without_entropy_is_bitwise_the_default(source, chunks):
    """Cross-entropy with and without the entropy statistics: the same loss and gradients, bit for bit."""
    cuda_backend(source)
    n, d, v = 4096, 1024, 32000
    g = torch.Generator(device="cuda").manual_seed(2)
    h = (torch.randn(n, d, device="cuda", generator=g) * 0.5).bfloat16()
    w = (torch.randn(v, d, device="cuda", generator=g) / d**0.5).bfloat16()
    b = (torch.randn(v, device="cuda", generator=g) * 0.1).bfloat16()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    budget = tplogp.loss_chunk_budget(n // chunks, d, v, dtype=w.dtype, bias_dtype=b.dtype, source=source,
                                      device="cuda")
    found = []
    for with_entropy in (True, False):
        hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
        value = tplogp.linear_logp_loss(hh, ww, y, bb, loss=_ce, reduction="mean", workspace_bytes=budget,
                                        source=source, with_entropy=with_entropy, deterministic=True)
        (0.3 * value).backward()
        found.append((value.detach(), hh.grad, ww.grad, bb.grad))
    for name, a, e in zip(("loss", "d_hidden", "d_weight", "d_bias"), *found):
        assert torch.equal(a, e), f"{source} {chunks} chunks {name}: differs without entropy"
    ppo = losses.ppo_clip(0.2, 0.2)
    adv, old = torch.randn(n, device="cuda"), torch.full((n,), -10.0, device="cuda")
    found = []
    for with_entropy in (True, False):  # a built-in that reads no entropy runs without it, to the same bits
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        tplogp.linear_logp_loss(hh, ww, y, loss=ppo, per_token=(adv, old), source=source, with_entropy=with_entropy,
                                deterministic=True).backward()
        found.append((hh.grad, ww.grad))
    for name, a, e in zip(("d_hidden", "d_weight"), *found):
        assert torch.equal(a, e), f"{source} ppo_clip {name}: differs without entropy"


@pytest.mark.parametrize("source", SOURCES)
def test_a_built_in_loss_is_no_worse_than_a_callable(source):
    """A ``TokenLoss`` on one shard without a keep budget: its gradients are computed in the forward
    (``_PrecomputedGrads``), as a plain callable's are, and the loss and gradients are no worse against the float64
    truth than the callable's, within the tolerance table's bf16 slack."""
    from tplogp.reference import reference_outputs
    from tplogp.tolerances import assert_no_worse

    cuda_backend(source)
    n, d, v = 1024, 512, 4096
    g = torch.Generator(device="cuda").manual_seed(5)
    h = (torch.randn(n, d, device="cuda", generator=g) * 0.5).bfloat16()
    w = (torch.randn(v, d, device="cuda", generator=g) / d**0.5).bfloat16()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    adv, old = torch.randn(n, device="cuda", generator=g), -8 + torch.randn(n, device="cuda", generator=g)
    grpo = losses.ppo_clip(0.2, 0.28) + losses.kl_to_reference(0.05)
    found = {}
    for name, loss in (("built-in", grpo), ("callable", lambda *args: grpo(*args))):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        value = tplogp.linear_logp_loss(hh, ww, y, loss=loss, per_token=(adv, old, old), reduction="mean",
                                        source=source, with_entropy=False)
        node = type(value.grad_fn).__name__
        (0.7 * value).backward()
        found[name] = node, (value.detach(), hh.grad, ww.grad)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    logp = reference_outputs(h64, w64, y, None, mode="float64").logp
    truth = grpo(logp, None, adv.double(), old.double(), old.double()).mean()
    (0.7 * truth).backward()
    assert found["built-in"][0] == found["callable"][0] == "_PrecomputedGradsBackward", found
    for what, ours, ref, true in zip(("loss", "d_hidden", "d_weight"), found["built-in"][1], found["callable"][1],
                                     (truth.detach(), h64.grad, w64.grad)):
        assert_no_worse(f"{source} {what}", ours, ref, true, torch.bfloat16)
