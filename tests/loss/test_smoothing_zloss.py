"""Label smoothing and z-loss in the fused loss: ``losses.cross_entropy(label_smoothing=eps)`` per
token is ``F.cross_entropy(z, y, label_smoothing=eps, reduction="none")`` and
``losses.z_loss(coef)`` is ``coef * lse^2``; they combine with ``+``, honour ``ignore_index`` and
the final-logit softcap. Three ways against float64 on one process (native; triton through the
interpreter), on 2 uneven gloo ranks, and a small grid re-creating the peers' cases (Liger's fused
linear cross-entropy: label_smoothing x lse_square_scale x softcap x reduction, and its token
accuracy; TransformerEngine's parallel cross-entropy: label smoothing with ignored tokens, mean and
per token)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tplogp
from tests.support.problems import make_problem
from tests.support.ranks import assert_no_worse_on_every_rank
from tplogp import losses
from tplogp.losses import TokenStats
from tplogp.reference import reference_logits
from tplogp.tolerances import assert_no_worse

IGNORE = -100
LEAD, D, V = (3, 7), 24, 211  # 21 tokens, prime V: no tile multiple


def _reference(h, w, b, target, *, eps, coef, softcap, temperature, reduction):
    """The materialized loss: F.cross_entropy with label smoothing on the (softcapped, tempered)
    logits, plus coef * lse^2 on the tokens that count, summed or averaged over them."""
    z = reference_logits(h, w, b, mode="float64" if h.dtype == torch.float64 else "matching",
                         temperature=temperature, softcap=softcap)
    flat_t = target.reshape(-1)
    per_token = F.cross_entropy(z.reshape(-1, z.shape[-1]), flat_t, label_smoothing=eps,
                                reduction="none", ignore_index=IGNORE)
    kept = flat_t != IGNORE
    per_token = per_token + coef * torch.logsumexp(z.reshape(-1, z.shape[-1]), -1) ** 2 * kept
    return per_token.sum() / kept.sum() if reduction == "mean" else per_token.sum()


def _run(fn, p, dtype_mode, **kw):
    """(loss, d_hidden, d_weight, d_bias): ``fn`` on the problem's tensors (float64 for the
    truth)."""
    cast = (lambda t: t.double()) if dtype_mode == "float64" else (lambda t: t)
    h = cast(p.hidden).clone().requires_grad_()
    w = cast(p.weight).clone().requires_grad_()
    b = None if p.bias is None else cast(p.bias).clone().requires_grad_()
    value = fn(h, w, b, p.target, **kw)
    value.backward()
    return value.detach(), h.grad, w.grad, None if b is None else b.grad


def _ours(source):
    def run(h, w, b, target, *, eps, coef, softcap, temperature, reduction):
        loss = losses.cross_entropy(label_smoothing=eps)
        if coef:
            loss = loss + losses.z_loss(coef)
        return tplogp.linear_logp_loss(h, w, target, b, loss=loss, reduction=reduction,
                                       temperature=temperature, softcap=softcap,
                                       ignore_index=IGNORE, source=source, with_entropy=False)
    return run


def _three_way(source, p, dtype, **kw):
    ours = _run(_ours(source), p, "ours", **kw)
    ref = _run(_reference, p, "matching", **kw)
    truth = _run(_reference, p, "float64", **kw)
    for name, o, r, t in zip(("loss", "d_hidden", "d_weight", "d_bias"), ours, ref, truth):
        if t is not None:
            assert_no_worse(name, o, r, t, dtype)


# native at fp32 and bf16 (with a bias, softcap and temperature), triton once at fp32 under the
# interpreter
CASES = [("native", torch.float32, 0.1, 1e-3, None, "mean"),
         ("native", torch.bfloat16, 0.2, 1e-2, 5.0, "sum"),
         ("triton", torch.float32, 0.1, 1e-2, 5.0, "mean")]


@pytest.mark.parametrize("source,dtype,eps,coef,softcap,reduction", CASES,
                         ids=[f"src={s}-{str(d)[6:]}-eps={e}-z={c}-cap={cap}-{r}" for s, d, e, c,
                              cap, r in CASES])
def test_smoothing_and_zloss_match_float64_truth(source, dtype, eps, coef, softcap, reduction):
    p = make_problem(LEAD, D, V, dtype, True, seed=7, peaked=True, ignore_index=IGNORE,
                     ignore_fraction=0.25)
    _three_way(source, p, dtype, eps=eps, coef=coef, softcap=softcap, temperature=0.8,
               reduction=reduction)


def test_per_token_values_are_f_cross_entropy_with_label_smoothing():
    """The TokenLoss itself, per token, given the statistics of the logits."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(9, 17, generator=g, dtype=torch.float64)
    y = torch.randint(0, 17, (9,), generator=g)
    logp = torch.log_softmax(z, -1).gather(1, y[:, None])[:, 0]
    stats = TokenStats(torch.logsumexp(z, -1), z.sum(-1), 17)
    loss = losses.cross_entropy(label_smoothing=0.3) + losses.z_loss(0.5)
    expected = F.cross_entropy(z, y, label_smoothing=0.3, reduction="none") + 0.5 * torch.logsumexp(z, -1) ** 2
    torch.testing.assert_close(loss(logp, None, stats=stats), expected)
    value, d_logp, _ = loss.value_and_derivatives(logp, None, stats=stats)
    torch.testing.assert_close(value, expected)
    d_lse, d_sum_z = loss.stat_derivatives(stats)
    assert d_logp == -0.7 and d_sum_z == pytest.approx(-0.3 / 17)
    torch.testing.assert_close(d_lse, 0.3 + 2 * 0.5 * stats.lse)


def test_stat_losses_name_what_they_need():
    with pytest.raises(ValueError, match="label_smoothing must be a float in \\[0, 1\\]"):
        losses.cross_entropy(label_smoothing=1.5)
    with pytest.raises(ValueError, match="coef must be a finite number"):
        losses.z_loss(float("nan"))
    with pytest.raises(ValueError, match="reads the statistics"):
        losses.z_loss(1.0)(torch.zeros(3), None)
    # no smoothing: the plain linear cross-entropy
    assert losses.cross_entropy(label_smoothing=0.0).linear


@pytest.mark.tp(world_size=2, timeout=300)
def test_tp_smoothing_and_zloss(tp):
    """On 2 uneven shards: the sum of the logits and the lse merged across the ranks, d_hidden
    all-reduced, the local weight and bias gradients, against the single-process float64 truth."""
    from pytest_tplogp import VocabShards

    vs = VocabShards("uneven", tp.world_size, vocab_size=V).__tp_bind__(tp)
    p = make_problem(LEAD, D, V, torch.float32, True, seed=9, ignore_index=IGNORE,
                     ignore_fraction=0.25)
    kw = dict(eps=0.1, coef=1e-2, softcap=5.0, temperature=0.8, reduction="mean")
    full_w, full_b = p.weight, p.bias
    p.weight, p.bias = vs.shard(full_w).clone(), vs.shard(full_b).clone()

    def ours(h, w, b, target, *, eps, coef, softcap, temperature, reduction):
        loss = losses.cross_entropy(label_smoothing=eps) + losses.z_loss(coef)
        return tplogp.linear_logp_loss(h, w, target, b, loss=loss, reduction=reduction,
                                       temperature=temperature, softcap=softcap,
                                       ignore_index=IGNORE, source="native", with_entropy=False,
                                       tp_group=tp.group, vocab_start_index=vs.start,
                                       global_vocab_size=V)

    mine = _run(ours, p, "ours", **kw)
    p.weight, p.bias = full_w, full_b
    ref, truth = _run(_reference, p, "matching", **kw), _run(_reference, p, "float64", **kw)
    sl = slice(vs.start, vs.end)
    assert_no_worse_on_every_rank(tp,
                                  (("loss", mine[0], ref[0], truth[0]),
                                   ("d_hidden", mine[1], ref[1], truth[1]),
                                       ("d_weight", mine[2], ref[2][sl], truth[2][sl]),
                                       ("d_bias", mine[3], ref[3][sl], truth[3][sl])),
                                       torch.float32)


# ---- the peers' cases, re-created at small sizes -------------------------------------------------

# Liger's fused linear cross-entropy grid: label_smoothing {0, 0.1} x lse_square_scale {0, 1e-4} x
# softcap {None, 30} x reduction {mean, sum}, ignore_index -100, fp32 (native: the whole grid is
# cheap there)
LIGER = [(eps, z, cap, red) for eps in (0.0, 0.1) for z in (0.0, 1e-4) for cap in (None, 30.0)
         for red in ("mean", "sum")]


@pytest.mark.parametrize("eps,coef,softcap,reduction", LIGER,
                         ids=[f"eps={e}-lse2={z}-cap={c}-{r}" for e, z, c, r in LIGER])
def test_liger_flce_grid(eps, coef, softcap, reduction):
    p = make_problem((2, 16), 32, 97, torch.float32, False, seed=11, ignore_index=IGNORE,
                     ignore_fraction=0.2)
    _three_way("native", p, torch.float32, eps=eps, coef=coef, softcap=softcap, temperature=1.0,
               reduction=reduction)


def test_liger_token_accuracy_from_argmax():
    """Liger's ``return_token_accuracy``: the share of counted tokens whose argmax is the target."""
    p = make_problem((4, 8), 16, 53, torch.float32, False, seed=12, ignore_index=IGNORE,
                     ignore_fraction=0.2)
    _, argmax = tplogp.linear_logp(p.hidden, p.weight, p.target, softcap=30.0, return_argmax=True,
                                   ignore_index=IGNORE)
    kept = p.target != IGNORE
    z = reference_logits(p.hidden, p.weight, mode="matching", softcap=30.0)
    expected = (z.argmax(-1) == p.target)[kept].float().mean()
    assert (argmax == p.target)[kept].float().mean() == expected


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_transformer_engine_label_smoothing_with_ignored_tokens(reduction):
    """TransformerEngine's parallel cross-entropy case: label smoothing 0.1, some tokens ignored,
    the mean or the per-token losses (per token: the fused loss's gradient for one-hot upstream
    weights is that token's)."""
    p = make_problem((2, 12), 16, 64, torch.float32, False, seed=13, ignore_index=IGNORE,
                     ignore_fraction=0.3)
    loss = losses.cross_entropy(label_smoothing=0.1)
    # TE's formula on float64 logits (truth) and on fp32 ones (the same-dtype reference)
    truth, ref = (F.cross_entropy(reference_logits(p.hidden, p.weight, mode=mode).reshape(-1, 64),
                                  p.target.reshape(-1), label_smoothing=0.1, ignore_index=IGNORE,
                                  reduction="mean" if reduction == "mean" else "none")
                  for mode in ("float64", "fp32"))
    if reduction == "mean":
        ours = tplogp.linear_logp_loss(p.hidden, p.weight, p.target, loss=loss, reduction="mean",
                                       ignore_index=IGNORE, with_entropy=False)
        assert_no_worse("loss", ours, ref, truth, torch.float32)
        return
    per_token = []
    flat = p.target.reshape(-1)
    # one token at a time: its loss is the sum over a one-token target
    for i in range(flat.numel()):
        only = torch.full_like(flat, IGNORE)
        only[i] = flat[i]
        per_token.append(tplogp.linear_logp_loss(p.hidden.reshape(-1, 16), p.weight, only,
                                                 loss=loss, ignore_index=IGNORE,
                                                 with_entropy=False))
    assert_no_worse("per-token loss", torch.stack(per_token), ref, truth, torch.float32)


def test_operator_doc_example_runs_as_written():
    """docs/operator.md's example of label smoothing, z-loss, softcap and argmax."""
    from tests.support.doc_examples import OPERATOR_DOC, run_example

    run_example("operator-smoothing", OPERATOR_DOC)
