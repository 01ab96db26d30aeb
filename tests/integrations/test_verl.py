"""``tplogp.integrations.verl.linear_cross_entropy`` with verl's meaning, against float64: flat outputs, the
reductions, temperature, gradients of both outputs; on one process and on 2 and 4 gloo ranks with even vocab
shards (each rank's ``hidden.grad`` summed over the group, as verl's callers do). Each result is checked with the
three-way rule of ``tplogp.tolerances`` (no worse than the same-dtype PyTorch reference)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from tplogp import LinearLogpInputError
from tplogp.integrations.verl import linear_cross_entropy
from tplogp.reference import reference_outputs
from tplogp.tolerances import assert_no_worse
from tests.support.ranks import assert_no_worse_on_every_rank

# 1032 ids: even shards at world 2 and 4 (516, 258 rows); D = 48 is not a multiple of verl's 128 (not required here)
V, D, T = 1032, 48, 0.8


def _reference(mode):
    """verl's meaning from ``tplogp.reference`` in ``mode``: flat [N] logprobs (or their sum / mean) and entropy."""
    def call(hidden, weight, labels, temperature, reduction):
        out = reference_outputs(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                mode=mode, temperature=temperature)
        logp = out.logp
        if reduction == "sum":
            logp = logp.sum()
        elif reduction == "mean":
            logp = logp.mean()
        return logp, out.entropy
    return call


# The same-dtype PyTorch reference (matmul in the input dtype, fp32 log-softmax) and the float64 truth.
_matching, _float64 = _reference("matching"), _reference("float64")


def _inputs(seed, lead=(3, 5), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) / D**0.5).to(dtype)
    labels = torch.randint(0, V, lead, generator=g)
    n = labels.numel()
    return hidden, weight, labels, torch.randn(n, generator=g), torch.randn(n, generator=g)


def _run(fn, hidden, weight, labels, g_logp, g_ent, reduction, dtype=None):
    """Outputs and (d_hidden, d_weight) for the upstream gradients g_logp (scalar-summed when reduced), g_ent."""
    h = hidden.detach().to(dtype or hidden.dtype).requires_grad_()
    w = weight.detach().to(dtype or weight.dtype).requires_grad_()
    logp, entropy = fn(h, w, labels, T, reduction)
    upstream = g_logp if reduction == "none" else g_logp[0]
    ((logp * upstream).sum() + (entropy * g_ent).sum()).backward()
    return logp.detach(), entropy.detach(), h.grad, w.grad


# Each reduction once in fp32, "none" in bf16 (the dtype verl runs in); [B, S, D] hidden except one [N, D] case.
@pytest.mark.parametrize("reduction,dtype,lead", [
    ("none", torch.float32, (3, 5)), ("sum", torch.float32, (15,)), ("mean", torch.float32, (3, 5)),
    ("none", torch.bfloat16, (3, 5))], ids=["none-fp32-BSD", "sum-fp32-ND", "mean-fp32-BSD", "none-bf16-BSD"])
def test_one_process_against_float64(reduction, dtype, lead):
    hidden, weight, labels, g_logp, g_ent = _inputs(0, lead, dtype)
    ours = _run(linear_cross_entropy, hidden, weight, labels, g_logp, g_ent, reduction)
    ref = _run(_matching, hidden, weight, labels, g_logp, g_ent, reduction)
    truth = _run(_float64, hidden, weight, labels, g_logp.double(), g_ent.double(), reduction, torch.float64)
    assert ours[0].dtype == ours[1].dtype == torch.float32
    assert ours[0].shape == (() if reduction != "none" else (labels.numel(),)) and ours[1].shape == (labels.numel(),)
    assert ours[2].shape == hidden.shape and ours[2].dtype == dtype and ours[3].dtype == dtype
    for name, o, r, t in zip(("logprobs", "entropy", "d_hidden", "d_weight"), ours, ref, truth):
        assert_no_worse(name, o, r, t, dtype)


def test_reduction_names_and_errors():
    hidden, weight, labels, _, _ = _inputs(1)
    a, _ = linear_cross_entropy(hidden, weight, labels, T, "MEAN")  # verl lower-cases the name
    b, _ = linear_cross_entropy(hidden, weight, labels, T, "none")
    torch.testing.assert_close(a, b.mean())
    with pytest.raises(ValueError, match="reduction must be one of"):
        linear_cross_entropy(hidden, weight, labels, T, "batchmean")
    with pytest.raises(LinearLogpInputError, match="one id per token"):
        linear_cross_entropy(hidden, weight, labels[:, :-1], T)
    with pytest.raises(LinearLogpInputError, match="temperature must be a positive finite number"):
        linear_cross_entropy(hidden, weight, labels, "1.0")


@pytest.mark.tp(world_size=[2, 4], timeout=120)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_even_shards_against_float64(tp, reduction):
    """Each rank passes its even shard and the group; the caller sums hidden.grad over the group (as with verl)."""
    hidden, weight, labels, g_logp, g_ent = _inputs(2)  # the same full tensors on every rank
    rows = V // tp.world_size
    shard = slice(tp.rank * rows, (tp.rank + 1) * rows)

    def tplogp_call(h, w, lab, t, red):
        return linear_cross_entropy(h, w[shard], lab, t, red, tp.group)

    logp, entropy, d_hidden, d_weight = _run(tplogp_call, hidden, weight, labels, g_logp, g_ent, reduction)
    tp.assert_all(d_weight[:shard.start].abs().sum() == 0 and d_weight[shard.stop:].abs().sum() == 0,
                  "only this rank's shard gets a weight gradient")
    dist.all_reduce(d_hidden, group=tp.group)
    ref = _run(_matching, hidden, weight, labels, g_logp, g_ent, reduction)
    truth = _run(_float64, hidden, weight, labels, g_logp.double(), g_ent.double(), reduction, torch.float64)
    assert_no_worse_on_every_rank(tp, (("logprobs", logp, ref[0], truth[0]), ("entropy", entropy, ref[1], truth[1]),
                                       ("d_hidden", d_hidden, ref[2], truth[2]),
                                       ("d_weight", d_weight[shard], ref[3][shard], truth[3][shard])), torch.float32)


@pytest.mark.tp(world_size=2, timeout=120)
def test_uneven_shards_are_refused_on_every_rank(tp):
    """verl's layout is even shards: a rank with a different shard size is a layout error, raised on every rank."""
    hidden, weight, labels, _, _ = _inputs(3)
    local = weight[:500] if tp.rank == 0 else weight[500:]  # 500 and 532 rows
    with pytest.raises(Exception) as info:
        linear_cross_entropy(hidden, local, labels, T, "none", tp.group)
    tp.assert_all(isinstance(info.value, (LinearLogpInputError, ValueError)), repr(info.value))


REJECTED_ON_1 = r"^linear_cross_entropy inputs rejected \(rank 1: "
VERL_CASES = {
    "reduction": (dict(reduction="avg"), REJECTED_ON_1 + r"reduction must be one of \('none', "
                                                         r"'sum', 'mean'\), got 'avg'\)$"),
    "reduction-differs": (dict(reduction="sum"),
                          r"^linear_cross_entropy: linear_cross_entropy's options \(reduction\) "
                          r"must be the same on every TP rank, got rank 0: "
                          r"\(\('reduction', 'none'\),\); rank 1: \(\('reduction', 'sum'\),\)"),
    "labels-short": (dict(labels="short"), REJECTED_ON_1 + r"labels must hold one id per token of "
                                                           r"hidden: 15 tokens"),
    "temperature": (dict(temperature=0.0), REJECTED_ON_1 + r"temperature must be a positive finite "
                                                           r"number, got 0.0\)$"),
}


@pytest.mark.tp(world_size=[2, 4], timeout=120)
@pytest.mark.parametrize("case", list(VERL_CASES))
def test_bad_argument_on_one_rank_raises_on_every_rank(tp, case):
    """verl's entry point: its own arguments travel with the op's checks, so an argument wrong on
    rank 1 alone raises the same error on every rank (none left in a collective), and the next good
    call on the group runs."""
    from tests.support.ranks import agreed_message

    hidden, weight, labels, _, _ = _inputs(4)
    rows = V // tp.world_size
    local = weight[tp.rank * rows:(tp.rank + 1) * rows]
    change, expected = VERL_CASES[case]
    kw = dict(reduction="none", temperature=T)
    if tp.rank == 1:
        kw.update({k: v for k, v in change.items() if k != "labels"})
        labels = labels.reshape(-1)[:-1] if change.get("labels") else labels
    try:
        linear_cross_entropy(hidden, local, labels, kw["temperature"], kw["reduction"], tp.group)
        outcome = "no error"
    except LinearLogpInputError as exc:
        outcome = str(exc)
    message = agreed_message(tp, outcome)
    assert re.search(expected, message), message
    hidden, weight, labels, _, _ = _inputs(4)
    logp, entropy = linear_cross_entropy(hidden, local, labels, T, "none", tp.group)
    ref_logp, ref_entropy = _matching(hidden, weight, labels, T, "none")
    truth_logp, truth_entropy = _float64(hidden.double(), weight.double(), labels, T, "none")
    checks = (("logprobs", logp, ref_logp, truth_logp),
              ("entropy", entropy, ref_entropy, truth_entropy))
    assert_no_worse_on_every_rank(tp, checks, torch.float32)


def test_support_is_passed_to_the_op():
    """support= (padded labels.shape + (K,), or CSR over the N tokens) gives the op's renormalized
    values on the flattened tokens."""
    import tplogp

    hidden, weight, labels, _, _ = _inputs(3)
    others = (labels[..., None] + torch.tensor([1, 3, 7])) % weight.shape[0]
    others[0, 0, 1:] = -1  # a token with fewer kept ids
    padded = torch.cat([others[..., :1], labels[..., None], others[..., 1:]], dim=-1)
    flat = padded.reshape(-1, 4)
    direct = tplogp.linear_logp(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                return_entropy=True, support=flat)
    counts = (flat >= 0).sum(-1)
    csr = (torch.cat([counts.new_zeros(1), counts.cumsum(0)]), flat[flat >= 0])
    for support in (padded, csr):
        logp, entropy = linear_cross_entropy(hidden, weight, labels, support=support)
        torch.testing.assert_close(logp, direct.logp, rtol=0, atol=0)
        torch.testing.assert_close(entropy, direct.entropy, rtol=0, atol=0)


def test_sampler_parameters_are_passed_to_the_op():
    """top_k / top_p / min_p (numbers, or one value per label in labels' shape) give the op's
    values on the flattened tokens."""
    import tplogp

    hidden, weight, labels, _, _ = _inputs(5)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    per_label = torch.full(labels.shape, 9, dtype=torch.int64)
    per_label[0] = -1
    for params, flat in ((dict(top_k=12, top_p=0.95), dict(top_k=12, top_p=0.95)),
                         (dict(top_k=per_label, min_p=0.01),
                          dict(top_k=per_label.reshape(-1), min_p=0.01))):
        direct = tplogp.linear_logp(flat_hidden, weight, labels.reshape(-1), return_entropy=True,
                                    temperature=T, **flat)
        logp, entropy = linear_cross_entropy(hidden, weight, labels, T, **params)
        torch.testing.assert_close(logp, direct.logp, rtol=0, atol=0)
        torch.testing.assert_close(entropy, direct.entropy, rtol=0, atol=0)
        assert torch.isfinite(entropy).all()
