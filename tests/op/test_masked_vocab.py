"""A vocabulary masked by a ``-inf`` bias, and other extreme logits, against eager PyTorch
(docs/operator.md, "Masked vocabulary and extreme values"): ``linear_logp`` and
``linear_logp_loss`` on the native and the interpreted triton source, in one process and over gloo
ranks with a shard wholly masked, with temperature, softcap and ``deterministic="tp_invariant"``."""

from __future__ import annotations

import pytest
import torch

import tplogp
from tests.support.masked import compare, make_masked, masked_outputs, masked_problems, run_masked
from tests.support.problems import cpu_sources
from tplogp.backends.memory_budget import DLOGITS_WORKSPACE_BYTES

N, D, V = 6, 16, 80
# a leading run of masked ids (whole tiles: a row's running max stays -inf over them), forbidden
# ids, padded rows
MASKED = [*range(0, 40), 47, 53, *range(72, 80)]
TARGETS = [5, 44, 53, 60, 75, 41]  # rows 0, 2, 4: a masked target (logp -inf)
OPTIONS = {
    "plain": dict(),
    "temperature-softcap": dict(temperature=0.7, softcap=5.0),
    "deterministic": dict(deterministic=True),
    "invariant": dict(temperature=1.3, deterministic="tp_invariant"),
}


def _references(p, **kw):
    """``(float64 truth, fp32 reference)`` of a call with options ``kw`` (those a reference
    takes)."""
    ref_kw = {k: v for k, v in kw.items() if k in ("temperature", "softcap", "loss")}
    return masked_outputs(p, torch.float64, **ref_kw), masked_outputs(p, torch.float32, **ref_kw)


def _check(op, p, **kw):
    ours = run_masked(op, p, **kw)
    truth, reference = _references(p, **kw)
    found = compare(ours, reference, truth)
    assert not found, "; ".join(found)
    return ours


def _budgets(source: str) -> dict:
    """native: tiles of 21 columns (the first wholly masked) and one whole tile; triton: its default
    (a call this small keeps its terms) and a budget that keeps nothing (the backward
    recomputes)."""
    if source == "native":
        return {"tiled": 2048, "whole": None}
    return {"kept": None, "recomputed": DLOGITS_WORKSPACE_BYTES}


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("source", cpu_sources())
def test_masked_columns_match_eager(source, options):
    """Masked columns give eager's finite logp, entropy, lse, argmax and gradients; a masked target
    gets logp -inf and still finite gradients (its one-hot), on every tiling and on kept and
    recomputed backwards."""
    p = make_masked(N, D, V, MASKED, TARGETS, seed=1)
    op = tplogp.get_op("linear_logp", source)
    for budget in _budgets(source).values():
        ours = _check(op, p, workspace_bytes=budget, **OPTIONS[options])
        if "softcap" not in OPTIONS[options]:  # (a softcap maps -inf to -softcap: none masked)
            assert ours.logp[[0, 2, 4]].isneginf().all() and ours.logp[[1, 3, 5]].isfinite().all()


@pytest.mark.parametrize("source", cpu_sources())
def test_every_column_masked_but_one(source):
    """Only column 9 unmasked: its rows get logp 0 and entropy 0 exactly, lse its logit; the other
    rows logp -inf; gradients finite and as eager's."""
    p = make_masked(N, D, V, [i for i in range(V) if i != 9], [9, 9, 3, 9, 70, 9], seed=2)
    ours = _check(tplogp.get_op("linear_logp", source), p, temperature=0.5)
    assert torch.equal(ours.logp[[0, 1, 3, 5]], torch.zeros(4))
    assert ours.logp[[2, 4]].isneginf().all()
    assert torch.equal(ours.entropy, torch.zeros(N))
    assert torch.equal(ours.argmax, torch.full((N,), 9))


@pytest.mark.parametrize("deterministic", [False, "tp_invariant"], ids=["default", "invariant"])
@pytest.mark.parametrize("source", cpu_sources())
def test_every_column_masked(source, deterministic):
    """No unmasked column: logp and lse -inf, entropy 0, argmax 0 (eager: NaN logp and entropy); the
    gradient is the target's one-hot alone (``d_bias`` its count times ``g_logp / T``), finite."""
    p = make_masked(N, D, V, range(V), TARGETS, seed=3)
    op = tplogp.get_op("linear_logp", source)
    ours = _check(op, p, temperature=2.0, deterministic=deterministic)
    assert ours.logp.isneginf().all() and ours.lse.isneginf().all()
    assert torch.equal(ours.entropy, torch.zeros(N))
    assert torch.equal(ours.argmax, torch.zeros(N, dtype=torch.long))
    want = torch.zeros(V).index_add_(0, p.target, p.g_logp / 2.0)
    torch.testing.assert_close(ours.d_bias, want, rtol=0, atol=0)


@pytest.mark.parametrize("source", cpu_sources())
def test_logits_of_1e4(source):
    """Logits of magnitude 1e4 (a bias of that size, some masked): the max subtraction keeps every
    output within the three-way rule against float64 (no overflow in fp32)."""
    p = make_masked(N, D, V, [3, 50], [0, 3, 17, 40, 79, 50], seed=4, scale=1e4)
    _check(tplogp.get_op("linear_logp", source), p, temperature=0.9)


@pytest.mark.parametrize("source", cpu_sources())
def test_plus_inf_and_nan(source):
    """A ``+inf`` logit makes every output and gradient of its row NaN (eager's log_softmax: NaN;
    its logsumexp gives +inf, ours NaN); under a softcap it is ``+softcap``, finite, as eager. NaN
    in hidden makes its row's outputs NaN and no other row's; NaN in weight or bias reaches every
    row."""
    op = tplogp.get_op("linear_logp", source)
    p = make_masked(N, D, V, [7], TARGETS, seed=5)
    p.bias[11] = float("inf")
    ours = run_masked(op, p)
    for name in ("logp", "entropy", "lse", "d_hidden", "d_weight", "d_bias"):
        assert getattr(ours, name).isnan().all(), name
    _check(op, p, softcap=4.0)
    p = make_masked(N, D, V, [7], TARGETS, seed=6)
    p.hidden[2, 5] = float("nan")
    ours = run_masked(op, p)
    rows = torch.arange(N) != 2
    for name in ("logp", "entropy", "lse"):
        out = getattr(ours, name)
        assert out[2].isnan() and not out[rows].isnan().any(), name
    p = make_masked(N, D, V, [7], TARGETS, seed=7)
    p.weight[30, 0] = float("nan")
    ours = run_masked(op, p)
    assert ours.logp.isnan().all() and ours.entropy.isnan().all() and ours.lse.isnan().all()


@pytest.mark.parametrize("source", cpu_sources())
def test_fused_loss_with_masked_columns(source):
    """``linear_logp_loss`` (policy gradient, entropy bonus, z-loss) over a masked vocabulary: the
    loss and its gradients against eager's, finite (the entropy bonus's terms with p = 0 add
    nothing)."""
    p = make_masked(N, D, V, MASKED, [44, 60, 41, 45, 70, 62], seed=8)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(9))
    loss = (tplogp.losses.policy_gradient() + tplogp.losses.entropy_bonus(0.1)
            + tplogp.losses.z_loss(1e-3))

    def eager(logp, entropy, lse):
        return (-adv.to(logp.dtype) * logp - 0.1 * entropy + 1e-3 * lse.square()).sum()

    h, w, b = (t.clone().requires_grad_() for t in (p.hidden, p.weight, p.bias))
    value = tplogp.linear_logp_loss(h, w, p.target, b, loss=loss, per_token=(adv,),
                                    temperature=0.8, source=source)
    value.backward()
    truth, reference = _references(p, temperature=0.8, loss=eager)
    found = []
    for name, ours in (("d_hidden", h.grad), ("d_weight", w.grad), ("d_bias", b.grad)):
        found += masked_problems(name, ours, getattr(reference, name), getattr(truth, name))
    assert not found, "; ".join(found)
    want = float(eager(truth.logp, truth.entropy, truth.lse))
    assert abs(float(value.detach()) - want) <= 1e-5 * abs(want), (float(value.detach()), want)


# ---- over gloo ranks --------------------------------------------------------------------------

TP_V = 97  # prime: every shard size odd


@pytest.fixture
def vocab_shards_size() -> int:
    return TP_V


def _tp_case(case: str, vocab_shards) -> tuple[torch.Tensor, list[int]]:
    """The masked ids and the targets of a case: ``shard`` masks rank 1's whole shard, the padded
    tail and two ids elsewhere (targets inside and outside the masks); ``one`` leaves column 3
    alone; ``empty`` masks everything."""
    bounds = vocab_shards.boundaries()
    masked = torch.zeros(TP_V, dtype=torch.bool)
    if case == "shard":
        masked[bounds[1]: bounds[2]] = True
        masked[90:] = True
        masked[[4, bounds[-2] + 1]] = True
        return masked, [bounds[1], 0, 4, 92, bounds[2] - 1 if bounds[2] - 1 < 90 else 5, 60]
    masked[:] = True
    if case == "one":
        masked[3] = False
    return masked, [3, 3, 50, 3, 96, 0]


@pytest.mark.tp(world_size=[2, 4], timeout=300)
@pytest.mark.parametrize("case", ["shard", "one", "empty"])
@pytest.mark.parametrize("options", ["plain", "invariant"])
def test_tp_masked_vocab(tp, vocab_shards, op_source, case, options):
    """Over the ranks (even and uneven shards): a shard with no unmasked column, a single unmasked
    column, and no unmasked column at all give the single-rank eager outputs and gradients (d_W /
    d_b: this rank's rows)."""
    masked, targets = _tp_case(case, vocab_shards)
    p = make_masked(N, D, TP_V, masked, targets, seed=10)
    vs = vocab_shards
    kw = OPTIONS[options]
    ours = run_masked(op_source, p, weight=vs.shard(p.weight), bias=vs.shard(p.bias),
                      tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=TP_V, **kw)
    truth, reference = _references(p, **kw)
    found = compare(ours, reference, truth, rows=slice(vs.start, vs.end))
    tp.assert_all(not found, "; ".join(found))


@pytest.mark.tp(world_size=[2, 4], timeout=300)
def test_tp_fused_loss_with_a_masked_shard(tp, vocab_shards, op_source):
    """``linear_logp_loss`` with an entropy bonus over the ranks, rank 1's shard wholly masked:
    gradients as eager's (this rank's rows of d_W and d_b)."""
    masked, _ = _tp_case("shard", vocab_shards)
    p = make_masked(N, D, TP_V, masked, [60, 0, 61, 62, 63, 64], seed=11)
    vs = vocab_shards
    loss = tplogp.losses.cross_entropy() + tplogp.losses.entropy_bonus(0.2)
    h = p.hidden.clone().requires_grad_()
    w, b = (vs.shard(t).clone().requires_grad_() for t in (p.weight, p.bias))
    tplogp.linear_logp_loss(h, w, p.target, b, loss=loss, tp_group=tp.group,
                            vocab_start_index=vs.start, global_vocab_size=TP_V,
                            source=op_source.source).backward()

    def eager(logp, entropy, lse):
        return (-logp - 0.2 * entropy).sum()

    truth, reference = _references(p, loss=eager)
    rows = slice(vs.start, vs.end)
    found = masked_problems("d_hidden", h.grad, reference.d_hidden, truth.d_hidden)
    found += masked_problems("d_weight", w.grad, reference.d_weight[rows], truth.d_weight[rows])
    found += masked_problems("d_bias", b.grad, reference.d_bias[rows], truth.d_bias[rows])
    tp.assert_all(not found, "; ".join(found))
