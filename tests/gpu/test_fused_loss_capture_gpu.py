"""``linear_logp_loss`` captured in a CUDA graph (skipped without CUDA): forward and backward of built-in losses
recorded once and replayed on new hidden states give the loss and gradients of an eager call on the same data, bit
for bit, through both paths a one-shard call takes (gradients precomputed in the forward at host-bound sizes, one
autograd pass above them), with the default checks and with ``TPLOGP_CHECKS=fast``. Linear losses (cross-entropy,
policy gradient plus an entropy bonus) reduce as a dot product with cached constant vectors outside a capture and
fresh ones inside it; PPO's clipped loss goes through its per-token values.
Run: ``python -m pytest tests/gpu/test_fused_loss_capture_gpu.py -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

import tplogp  # noqa: E402
from tests.support.cuda import cuda_backend  # noqa: E402
from tplogp.fused_loss import chunk_gradients  # noqa: E402
from tplogp import losses  # noqa: E402

N, D, V = 2048, 1024, 8192  # 2^34 multiply-accumulates: a host-bound size, precomputed unless forced to one pass

LOSSES = {
    "cross_entropy": (losses.cross_entropy(), 0, False),
    "pg+entropy": (losses.policy_gradient() + losses.entropy_bonus(0.01), 1, True),
    "ppo_clip": (losses.ppo_clip(0.2, 0.28), 2, False),
}


@pytest.mark.parametrize("source", ["triton", "sm90"])
@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("checks", ["full", "fast"])
def test_a_captured_fused_loss_replays_an_eager_calls_bits(source, name, checks, monkeypatch):
    cuda_backend(source)
    monkeypatch.setenv("TPLOGP_CHECKS", checks)
    loss_fn, n_extra, with_entropy = LOSSES[name]
    gen = torch.Generator(device="cuda").manual_seed(7)
    hidden = (torch.randn(N, D, device="cuda", generator=gen) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(V, D, device="cuda", generator=gen) / D ** 0.5).bfloat16().requires_grad_()
    target = torch.randint(0, V, (N,), device="cuda", generator=gen)
    adv = torch.randn(N, device="cuda", generator=gen)
    old = -torch.rand(N, device="cuda", generator=gen) * 12 - 3
    per_token = (adv, old)[:n_extra]

    def step(h, w):
        loss = tplogp.linear_logp_loss(h, w, target, loss=loss_fn, per_token=per_token, reduction="mean",
                                       source=source, with_entropy=with_entropy)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the capture (kernels compiled, constants cached)
            step(hidden, weight)
    torch.cuda.current_stream().wait_stream(side)
    cached = dict(chunk_gradients._CONSTANTS)
    hidden.grad = weight.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step(hidden, weight)
    assert chunk_gradients._CONSTANTS == cached  # nothing made inside the capture was cached
    with torch.no_grad():
        hidden.copy_(torch.randn(N, D, device="cuda", generator=gen) * 0.5)
    graph.replay()
    torch.cuda.synchronize()
    tplogp.check_errors()
    got = [loss.clone(), hidden.grad.clone(), weight.grad.clone()]

    h2, w2 = (x.detach().clone().requires_grad_() for x in (hidden, weight))
    want = [step(h2, w2).detach(), h2.grad, w2.grad]
    for label, g, e in zip(("loss", "d_hidden", "d_W"), got, want):
        assert torch.isfinite(g).all(), label
        assert torch.equal(g, e), f"{label}: the replay differs from the eager call ({(g != e).sum().item()} elements)"
