"""Ignored rows kept in place instead of compacted away: what a CUDA-graph capture gets, where the
compaction's host read of the kept-row count cannot happen (``tplogp.op.local_call.compacts_rows``;
forced here). The outputs and gradients equal the compacted call's (fp32, within the tolerance
table's fp32 eps), ignored rows give 0 and no gradient, and the
call reads nothing on the host with ``TPLOGP_CHECKS=fast`` (one rank, 2 gloo ranks, the compiled op,
a forward compacted with its backward in place, the fused loss)."""

from __future__ import annotations

import pytest
import torch

import tplogp
from tests.support.host_reads import count_host_reads
from tests.support.problems import cpu_sources, make_problem
from tplogp import get_op, losses
from tplogp.op import local_call
from tplogp.tolerances import ERROR_SLACK, rel_error

IGNORE = -100
EPS = ERROR_SLACK[torch.float32].eps


SOURCES = cpu_sources()


def _problem(seed=5):
    return make_problem((4, 9), 16, 70, torch.float32, True, seed=seed, ignore_index=IGNORE,
                        ignore_fraction=0.3)


def _call(op, p, **kw):
    """Outputs (logp, entropy, lse) and gradients of one call with a per-token upstream gradient."""
    h, w, b = (x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias))
    logp, entropy, lse = op(h, w, p.target, b, return_entropy=True, return_lse=True,
                            ignore_index=IGNORE, **kw)
    ((logp * p.g_logp).sum() + (entropy * p.g_entropy).sum() + (lse * p.g_lse).sum()).backward()
    return [x.detach() for x in (logp, entropy, lse)] + [h.grad, w.grad, b.grad]


def _same(got, want, what=""):
    for name, a, e in zip(("logp", "entropy", "lse", "d_hidden", "d_weight", "d_bias"), got, want):
        assert torch.isfinite(a).all(), f"{what} {name} is not finite"
        assert rel_error(a, e) <= EPS, f"{what} {name}: {rel_error(a, e):.2e}"


@pytest.mark.parametrize("source", SOURCES)
def test_one_rank_matches_compaction_without_host_reads(source, monkeypatch):
    monkeypatch.setenv("TPLOGP_CHECKS", "fast")
    p = _problem()
    op = get_op("linear_logp", source=source)
    compacted = _call(op, p)
    monkeypatch.setattr(local_call, "compacts_rows", lambda device: False)
    with count_host_reads() as reads:
        ours = _call(op, p)
    assert reads == [], reads
    _same(ours, compacted, source)
    ignored = (p.target == IGNORE).reshape(-1)
    for x in ours[:3]:
        assert (x.reshape(-1)[ignored] == 0).all()
    assert (ours[3].reshape(-1, 16)[ignored] == 0).all()  # no gradient from ignored rows


@pytest.mark.slow
def test_compiled_op_in_place(monkeypatch):
    """The compiled op with the rows in place gives the compacted eager call's loss and
    gradients."""
    p = _problem(seed=6)
    op = get_op("linear_logp", source="native")

    def fn(h, w, t, b):
        logp, entropy, lse = op(h, w, t, b, return_entropy=True, return_lse=True,
                                ignore_index=IGNORE)
        return (logp * p.g_logp).sum() + (entropy * p.g_entropy).sum() + (lse * p.g_lse).sum()

    def loss_and_grads(f):
        h, w, b = (x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias))
        loss = f(h, w, p.target, b)
        loss.backward()
        return loss.detach(), h.grad, w.grad, b.grad

    compacted = loss_and_grads(fn)
    monkeypatch.setattr(local_call, "compacts_rows", lambda device: False)
    torch._dynamo.reset()
    try:
        ours = loss_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True))
    finally:
        torch._dynamo.reset()
    for name, a, e in zip(("loss", "d_hidden", "d_weight", "d_bias"), ours, compacted):
        assert torch.isfinite(a).all() and rel_error(a, e) <= EPS, (name, rel_error(a, e))


def test_forward_compacted_backward_in_place(monkeypatch):
    """The op's forward compacts (no capture), its backward runs in place (captured): the ignored
    rows' saved normalizer gives them p = 0, so the gradients are still those of the compacted
    call."""
    from tplogp.op import ops
    from tplogp.op.options import LOGP_OP, LogpOptions, op_values

    p = _problem(seed=7)
    h, w, b = (x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias))
    options = op_values(LogpOptions(return_entropy=True, ignore_index=IGNORE), LOGP_OP)
    layout = ops.layout_key("native", h.device, h.dtype)
    packed, kept, gathered = ops.linear_logp_fwd(h, w, p.target, b, "", 0, None, "native", True,
                                                 layout, *options)
    grad = torch.stack([p.g_logp.reshape(-1), p.g_lse.reshape(-1)] + [torch.zeros_like(p.g_logp.reshape(-1))] * 2
                       + [p.g_entropy.reshape(-1), torch.zeros_like(p.g_logp.reshape(-1))])
    bwd_args = ("", 0, "native", True, True, True, *options)
    want = ops.linear_logp_bwd(h, w, p.target, b, packed, kept, gathered, grad, *bwd_args)
    monkeypatch.setattr(local_call, "compacts_rows", lambda device: False)
    got = ops.linear_logp_bwd(h, w, p.target, b, packed, kept, gathered, grad, *bwd_args)
    for name, a, e in zip(("d_hidden", "d_weight", "d_bias"), got, want):
        assert torch.isfinite(a).all() and rel_error(a, e) <= EPS, name


def test_fused_loss_in_place(monkeypatch):
    p = _problem(seed=8)
    adv = torch.randn(p.target.shape, generator=torch.Generator().manual_seed(1))

    def run():
        h, w, b = (x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias))
        value = tplogp.linear_logp_loss(h, w, p.target, b, loss=losses.policy_gradient(),
                                        per_token=(adv,), reduction="mean", ignore_index=IGNORE,
                                        source="native")
        value.backward()
        return [value.detach(), h.grad, w.grad, b.grad]

    want = run()
    monkeypatch.setattr(local_call, "compacts_rows", lambda device: False)
    got = run()
    for name, a, e in zip(("loss", "d_hidden", "d_weight", "d_bias"), got, want):
        assert torch.isfinite(a).all() and rel_error(a, e) <= EPS, name


@pytest.mark.tp(world_size=2, timeout=120)
def test_two_ranks_in_place(tp):
    from pytest_tplogp import VocabShards

    vs = VocabShards("uneven", tp.world_size, vocab_size=70).__tp_bind__(tp)
    p = _problem(seed=9)
    p.weight, p.bias = vs.shard(p.weight).clone(), vs.shard(p.bias).clone()
    op = get_op("linear_logp", source="native")
    kw = dict(tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=70)
    compacted = _call(op, p, **kw)
    real = local_call.compacts_rows
    local_call.compacts_rows = lambda device: False
    try:
        ours = _call(op, p, **kw)
    finally:
        local_call.compacts_rows = real
    with tp.agree():
        _same(ours, compacted, f"rank {tp.rank}")
