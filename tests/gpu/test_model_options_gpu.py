"""softcap, argmax, label smoothing and z-loss on the triton and sm90 sources on a CUDA GPU (skipped without CUDA):
the pointer and the TMA kernels (a size above ``sm90_backend.TMA_MIN_MACS`` for the latter), kept and recomputed
d_logits, three ways against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from tests.support.cuda import cuda_backend  # noqa: E402
from tests.support.problems import make_problem, problem_on, run_op, run_reference  # noqa: E402
from tplogp import get_op, linear_logp_loss, losses  # noqa: E402
from tplogp.reference import reference_logits  # noqa: E402
from tplogp.tolerances import assert_no_worse  # noqa: E402

SOURCES = ["triton", "sm90"]
# (tokens, D, V): a small call (pointer kernels on sm90) and one above TMA_MIN_MACS (2^36: TMA kernels), V not a
# multiple of any tile
SIZES = [(1000, 256, 5003), (4096, 1024, 32771)]


def _problem(n, d, v, dtype, seed):
    return problem_on(make_problem((n,), d, v, dtype, True, seed=seed, peaked=True, ignore_index=-100,
                                   ignore_fraction=0.2), "cuda")


@pytest.mark.parametrize("size", SIZES, ids=[f"{n}x{d}x{v}" for n, d, v in SIZES])
@pytest.mark.parametrize("workspace", [None, 0], ids=["default", "recompute"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("source", SOURCES)
def test_softcap_three_way(source, dtype, workspace, size):
    cuda_backend(source)
    n, d, v = size
    p = _problem(n, d, v, dtype, seed=1)
    kw = dict(temperature=0.8, ignore_index=-100, entropy=True, lse=True, softcap=30.0)
    ours = run_op(get_op(source=source), p, workspace_bytes=workspace, **kw)
    truth, ref = run_reference(p, "float64", **kw), run_reference(p, "matching", **kw)
    for name in ("logp", "entropy", "lse", "d_hidden", "d_weight", "d_bias"):
        assert_no_worse(name, getattr(ours, name), getattr(ref, name), getattr(truth, name), dtype)


@pytest.mark.parametrize("size", SIZES, ids=[f"{n}x{d}x{v}" for n, d, v in SIZES])
@pytest.mark.parametrize("source", SOURCES)
def test_argmax_matches_torch(source, size):
    cuda_backend(source)
    n, d, v = size
    g = torch.Generator(device="cuda").manual_seed(2)
    hidden = torch.randint(-3, 4, (n, d), device="cuda", generator=g).float()  # exact dot products: exact ties
    weight = torch.randint(-3, 4, (v, d), device="cuda", generator=g).float()
    weight[v - 3] = weight[v // 2] = weight[7]
    hidden[0] = weight[7]
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    _, argmax = get_op(source=source)(hidden, weight, target, return_argmax=True)
    assert torch.equal(argmax, (hidden @ weight.T).argmax(-1)) and int(argmax[0]) == 7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("source", SOURCES)
def test_fused_loss_with_smoothing_zloss_and_softcap(source, dtype):
    cuda_backend(source)
    p = _problem(2048, 512, 8191, dtype, seed=3)
    loss = losses.cross_entropy(label_smoothing=0.1) + losses.z_loss(1e-4)

    def run(mode):
        cast = (lambda t: t.double()) if mode == "float64" else (lambda t: t)
        h, w, b = (cast(t).clone().requires_grad_() for t in (p.hidden, p.weight, p.bias))
        if mode == "ours":
            value = linear_logp_loss(h, w, p.target, b, loss=loss, reduction="mean", softcap=30.0,
                                     ignore_index=-100, source=source, with_entropy=False)
        else:
            z = reference_logits(h, w, b, mode=mode, softcap=30.0)
            per = F.cross_entropy(z, p.target, label_smoothing=0.1, ignore_index=-100, reduction="none")
            per = per + 1e-4 * torch.logsumexp(z, -1) ** 2 * (p.target != -100)
            value = per.sum() / (p.target != -100).sum()
        value.backward()
        return value.detach(), h.grad, w.grad, b.grad

    ours, ref, truth = run("ours"), run("matching"), run("float64")
    for name, o, r, t in zip(("loss", "d_hidden", "d_weight", "d_bias"), ours, ref, truth):
        assert_no_worse(name, o, r, t, dtype)
