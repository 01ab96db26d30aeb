"""torch.compile(fullgraph=True) on a CUDA GPU, at the peers' compile case: 256 tokens x D 512 x V 2048 in bf16, every
7th target ``ignore_index = -100``, sum and mean (skipped without CUDA; CI has none).

The fused loss (``linear_logp_loss`` with ``losses.cross_entropy()``) compiles to one op whose loss and gradients
are eager's bits on every source; ``linear_logp`` with the loss written out gives eager's gradient bits on every
source too (its loss is inductor's sum: compared within the inductor tolerance). On triton / sm90 eager keeps the
compacted rows' softmax terms for the backward under the default budget, and so does the op (a prefix of its kept
capacity, ``tplogp.op.packed_op.op_kept_shape``), so both backwards read the same terms.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from tests.support import tolerances as tol  # noqa: E402
from tests.support.cuda import cuda_backend  # noqa: E402
from tplogp import get_op, linear_logp_loss, losses  # noqa: E402

N, D, V, IGNORE = 256, 512, 2048, -100


def _inputs():
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(N, D, device="cuda", generator=g).mul(0.1).bfloat16()
    w = (torch.randn(V, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    t[::7] = IGNORE
    return x, w, t


def _loss_and_grads(fn, x0, w0):
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    loss = fn(x, w)
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), x.grad, w.grad


def _eager_and_compiled(fn, x0, w0):
    """``(loss, d_hidden, d_weight)`` of ``fn`` run eagerly, then compiled with ``fullgraph=True``."""
    torch._dynamo.reset()
    return _loss_and_grads(fn, x0, w0), _loss_and_grads(torch.compile(fn, fullgraph=True), x0, w0)


def _assert_same_bits(label, names, compiled, eager):
    for name, c, e in zip(names, compiled, eager):
        assert torch.equal(c, e), f"{label} {name}: compiled differs by {float((c - e).abs().max()):.2e}"


SOURCES_X_REDUCTIONS = [(source, reduction) for source in ("native", "triton", "sm90") for reduction in ("sum", "mean")]


@pytest.mark.parametrize("source, reduction", SOURCES_X_REDUCTIONS)
def test_fused_loss_compiled_gradients_are_eager_bits(source, reduction):
    cuda_backend(source)
    x0, w0, t = _inputs()
    ce = losses.cross_entropy()

    def fused(x, w):
        return linear_logp_loss(x, w, t, loss=ce, reduction=reduction, ignore_index=IGNORE, source=source,
                                with_entropy=False)

    eager, compiled = _eager_and_compiled(fused, x0, w0)
    _assert_same_bits(f"{source} {reduction}", ("loss", "d_hidden", "d_weight"), compiled, eager)


@pytest.mark.parametrize("source, reduction", SOURCES_X_REDUCTIONS)
def test_linear_logp_compiled_gradients_are_eager_bits(source, reduction):
    cuda_backend(source)
    x0, w0, t = _inputs()
    op = get_op("linear_logp", source=source)
    # the token mean as RL losses write it, a known count's reciprocal (a division by a count tensor is
    # autograd's division in eager and a multiplication by its reciprocal in inductor: another upstream gradient)
    scale = 1.0 if reduction == "sum" else 1.0 / int((t != IGNORE).sum())

    def plain(x, w):
        return -op(x, w, t, ignore_index=IGNORE).sum() * scale

    eager, compiled = _eager_and_compiled(plain, x0, w0)
    torch.testing.assert_close(compiled[0], eager[0], **tol.INDUCTOR._asdict())
    _assert_same_bits(f"{source} {reduction}", ("d_hidden", "d_weight"), compiled[1:], eager[1:])
