"""``linear_logp_loss`` against ``linear_logp`` followed by the same loss in eager PyTorch: the same value and
gradients (equal within the fp32 tolerance: the loss path sums per chunk), one rank and 4 uneven gloo ranks."""

from __future__ import annotations

import pytest
import torch

import tplogp
from tests.problems import make_problem
from tplogp import losses
from tplogp.tolerances import ERROR_SLACK, rel_error

IGNORE = -100


def _per_token(p, seed):
    g = torch.Generator().manual_seed(seed)
    shape = p.target.shape
    return torch.randn(shape, generator=g), -3 + 0.3 * torch.randn(shape, generator=g), -3 + 0.3 * torch.randn(
        shape, generator=g)


def _loss_fn(logp, entropy, adv, old, ref):
    return (losses.ppo_clip(0.2, 0.28)(logp, entropy, adv, old) + losses.kl_to_reference(0.05)(logp, entropy, ref)
            + losses.entropy_bonus(0.01)(logp, entropy))


def _run(fused: bool, p, extra, reduction, **kw):
    h = p.hidden.clone().requires_grad_()
    w = p.weight.clone().requires_grad_()
    b = None if p.bias is None else p.bias.clone().requires_grad_()
    if fused:
        value = tplogp.linear_logp_loss(h, w, p.target, b, loss=_loss_fn, per_token=extra, reduction=reduction,
                                        source="native", **kw)
    else:
        out = tplogp.get_op("linear_logp", source="native")(h, w, p.target, b, return_entropy=True, **kw)
        per_tok = _loss_fn(out.logp, out.entropy, *extra)
        ignore = kw.get("ignore_index")
        keep = torch.ones_like(per_tok, dtype=torch.bool) if ignore is None else p.target != ignore
        per_tok = torch.where(keep, per_tok, torch.zeros_like(per_tok))
        value = per_tok.sum() if reduction == "sum" else per_tok.sum() / keep.sum().clamp_min(1)
    (3.0 * value).backward()
    return value.detach(), h.grad, w.grad, None if b is None else b.grad


def _compare(ours, eager, what=""):
    for name, a, e in zip(("loss", "d_hidden", "d_weight", "d_bias"), ours, eager):
        if e is None:
            assert a is None, name
            continue
        err = rel_error(a, e)  # fp32: per-chunk sums change the rounding, within the table's fp32 eps
        assert err <= ERROR_SLACK[torch.float32].eps, f"{what} {name}: relative error {err:.2e} vs eager"


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("budget", [None, "chunks", "all"])
def test_matches_eager_loss_one_rank(reduction, budget):
    p = make_problem((4, 13), 24, 211, torch.float32, True, seed=12, ignore_index=IGNORE,
                     ignore_fraction=0.2)
    extra = _per_token(p, 1)
    ws = {None: None, "chunks": (64 << 20) + 9 * 211 * 4, "all": (64 << 20) + 52 * 211 * 4}[budget]
    kw = dict(temperature=0.9, ignore_index=IGNORE, workspace_bytes=ws)
    _compare(_run(True, p, extra, reduction, **kw), _run(False, p, extra, reduction, **kw), f"{budget}")


def test_deterministic_and_bf16_single_chunk():
    p = make_problem((33,), 16, 97, torch.bfloat16, False, seed=3)
    extra = _per_token(p, 2)
    a = _run(True, p, extra, "mean", deterministic=True)
    b = _run(True, p, extra, "mean", deterministic=True)
    for x, y in zip(a, b):
        assert (x is None and y is None) or torch.equal(x, y)
    eager = _run(False, p, extra, "mean", deterministic=True)
    torch.testing.assert_close(a[0], eager[0], rtol=1e-5, atol=1e-6)
    for x, y in zip(a[1:3], eager[1:3]):  # bf16 gradients: one rounding apart at most
        torch.testing.assert_close(x.float(), y.float(), rtol=1e-2, atol=1e-4)


@pytest.mark.tp(world_size=4, timeout=300)
@pytest.mark.parametrize("budget", [None, "chunks"])
def test_matches_eager_loss_on_uneven_ranks(tp, budget):
    from pytest_tplogp import VocabShards

    v = 301
    vs = VocabShards("uneven", tp.world_size, vocab_size=v).__tp_bind__(tp)
    p = make_problem((3, 11), 20, v, torch.float32, True, seed=9, ignore_index=IGNORE, ignore_fraction=0.25)
    p.weight, p.bias = vs.shard(p.weight).clone(), vs.shard(p.bias).clone()
    extra = _per_token(p, 4)
    ws = None if budget is None else (64 << 20) + 7 * v * 4
    kw = dict(tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=v, temperature=1.3,
              ignore_index=IGNORE, workspace_bytes=ws)
    ours, eager = _run(True, p, extra, "mean", **kw), _run(False, p, extra, "mean", **kw)
    problems = []
    try:
        _compare(ours, eager, f"rank {tp.rank}")
    except AssertionError as exc:
        problems.append(str(exc))
    tp.assert_all(not problems, "; ".join(problems))
