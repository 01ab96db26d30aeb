"""Sequence parallelism and the partial hidden gradient on pools of gloo ranks with uneven vocab
shards.

``sequence_parallel=True``: hidden is this rank's contiguous slice of the tokens; logp and the other
outputs are all N tokens on every rank; ``hidden.grad`` is this rank's slice of the full gradient
(reduce-scattered, under the d_W work); weight and bias gradients stay local.
``hidden_grad="partial"``: each rank's ``hidden.grad`` is its shard's share, whose sum over the
ranks is the reduced gradient. Bad layouts raise the same error on every rank.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import tplogp
from tests.support import tolerances as tol
from tests.support.backward_schedule import overlap_problem, record_schedule
from tests.support.problems import cpu_sources, make_problem, run_reference
from tests.support.ranks import agreed_message, assert_no_worse_on_every_rank
from tplogp import LinearLogpInputError, losses
from tplogp.reference import reference_outputs
from tplogp.tolerances import rel_error

# 24 tokens as [2, 12]: divisible by 2 and 4 ranks, and more than one interpreter row tile per rank
# at 2; odd D; a prime V that no world size divides (uneven shards).
LEAD, D, V = (2, 12), 37, 401
IGNORE = -100


def _shards(tp, v=V):
    from pytest_tplogp import VocabShards

    return VocabShards("uneven", tp.world_size, vocab_size=v).__tp_bind__(tp)


def _own_rows(tp, x: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    """This rank's contiguous slice of the tokens of ``x``: rows ``[*, D]`` (leading dimensions
    flattened), or the elements of a ``per_token`` tensor (flattened)."""
    flat = x.reshape(-1) if per_token else x.reshape(-1, x.shape[-1])
    n = flat.shape[0] // tp.world_size
    return flat[tp.rank * n:(tp.rank + 1) * n]


# the bf16 case on the native source only: the triton interpreter adds time, not coverage of the SP
# layout
CASES = [pytest.param("native", torch.float32, id="native-fp32"),
         pytest.param("native", torch.bfloat16, id="native-bf16"),
         pytest.param(*cpu_sources()[1].values, torch.float32, marks=cpu_sources()[1].marks,
                      id="triton-fp32")]


@pytest.mark.tp(world_size=[2, 4], timeout=300)
@pytest.mark.parametrize("source, dtype", CASES)
def test_sequence_parallel_matches_float64_truth(tp, source, dtype):
    """logp, entropy, lse of all N tokens, hidden.grad (this rank's slice) and the local
    weight / bias grads vs the single-rank float64 truth, with temperature and ignored tokens (kept
    in place under sequence parallelism)."""
    vs = _shards(tp)
    p = make_problem(LEAD, D, V, dtype, True, seed=31, peaked=True, ignore_index=IGNORE,
                     ignore_fraction=0.2)
    kw = dict(temperature=0.8, ignore_index=IGNORE, entropy=True, lse=True)
    truth, ref = run_reference(p, "float64", **kw), run_reference(p, "matching", **kw)
    h = _own_rows(tp, p.hidden).clone().requires_grad_()  # [N / world, D]
    w, b = vs.shard(p.weight).clone().requires_grad_(), vs.shard(p.bias).clone().requires_grad_()
    logp, entropy, lse = tplogp.get_op("linear_logp", source=source)(
        h, w, p.target, b, tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=V,
        temperature=0.8, ignore_index=IGNORE, return_entropy=True, return_lse=True,
        sequence_parallel=True)
    tp.assert_all(logp.shape == p.target.shape,
                  f"logp {tuple(logp.shape)}: all N tokens in target_ids' shape")
    ((logp * p.g_logp).sum() + (entropy * p.g_entropy).sum() + (lse * p.g_lse).sum()).backward()
    ignored = _own_rows(tp, p.target, per_token=True) == IGNORE
    tp.assert_all(bool((h.grad[ignored] == 0).all()), "ignored tokens must get no gradient")
    sl = slice(vs.start, vs.end)
    assert_no_worse_on_every_rank(tp, [
        ("logp", logp, ref.logp, truth.logp), ("entropy", entropy, ref.entropy, truth.entropy),
        ("lse", lse, ref.lse, truth.lse),
        ("d_hidden", h.grad, _own_rows(tp, ref.d_hidden), _own_rows(tp, truth.d_hidden)),
        ("d_weight", w.grad, ref.d_weight[sl], truth.d_weight[sl]),
        ("d_bias", b.grad, ref.d_bias[sl], truth.d_bias[sl]),
    ], dtype)


@pytest.mark.tp(world_size=2, timeout=120)
def test_sequence_parallel_reduce_scatter_runs_under_the_d_w_work(tp):
    """hidden.grad is reduce-scattered (one async collective, no all-reduce) issued before the last
    d_W update, and equals the replicated call's all-reduced gradient's slice; outputs equal the
    replicated call's."""
    vs = _shards(tp, 97)
    p = make_problem((32,), 16, 97, torch.float32, True, seed=3)
    w, b = vs.shard(p.weight), vs.shard(p.bias)
    kw = dict(tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=97,
              # 16-token chunks: several d_W updates
              workspace_bytes=16 * 4 * 4 * (vs.end - vs.start))

    def run(hidden, **extra):
        h, wg, bg = (x.clone().requires_grad_() for x in (hidden, w, b))
        out = tplogp.get_op("linear_logp", source="native")(h, wg, p.target, bg, **kw, **extra)
        (out * p.g_logp).sum().backward()
        return out.detach(), h.grad

    with record_schedule() as events:
        logp, d_hidden = run(_own_rows(tp, p.hidden), sequence_parallel=True)
    full_logp, full_d_hidden = run(p.hidden)
    problem = overlap_problem(events, "reduce_scatter")
    tp.assert_all(problem is None, problem)
    tp.assert_all(torch.equal(logp, full_logp), "logp differs from the replicated call's")
    tp.assert_all(rel_error(d_hidden, _own_rows(tp, full_d_hidden)) <= tol.REL_FP32_SAME_MATH,
                  "hidden.grad is not the slice of the replicated call's")


@pytest.mark.tp(world_size=[2, 4], timeout=300)
@pytest.mark.parametrize("source", cpu_sources(slow_triton=True))
def test_fused_loss_with_sequence_parallel_matches_float64_truth(tp, source):
    """linear_logp_loss with sequence_parallel: the loss of all N tokens (mean over the tokens not
    ignored), this rank's slice of hidden.grad and the local weight / bias grads, against float64
    truth, over several chunks."""
    vs = _shards(tp)
    p = make_problem(LEAD, D, V, torch.float32, True, seed=8, ignore_index=IGNORE,
                     ignore_fraction=0.25)
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(p.target.shape, generator=g)
    loss = losses.policy_gradient() + losses.entropy_bonus(0.01)
    keep = p.target != IGNORE
    found = {}
    for mode in ("float64", "matching"):
        dt = torch.float64 if mode == "float64" else torch.float32
        h, w, b = (x.to(dt).clone().requires_grad_() for x in (p.hidden, p.weight, p.bias))
        out = reference_outputs(h, w, p.target, b, mode=mode, temperature=1.1, ignore_index=IGNORE)
        per_tok = torch.where(keep, loss(out.logp, out.entropy, adv.to(out.logp.dtype)), 0.0)
        value = per_tok.sum() / keep.sum()
        value.backward()
        found[mode] = (value.detach(), h.grad, w.grad, b.grad)
    h = _own_rows(tp, p.hidden).clone().requires_grad_()
    w, b = vs.shard(p.weight).clone().requires_grad_(), vs.shard(p.bias).clone().requires_grad_()
    ws = tplogp.loss_chunk_budget(5, D, V, dtype=torch.float32, bias_dtype=torch.float32,
                                  source=source,
                                  # chunks of 5 tokens: several chunks, one partial
                                  device=torch.device("cpu"))
    value = tplogp.linear_logp_loss(h, w, p.target, b, loss=loss, per_token=(adv,),
                                    reduction="mean", source=source, tp_group=tp.group,
                                    vocab_start_index=vs.start, global_vocab_size=V,
                                    temperature=1.1, ignore_index=IGNORE, workspace_bytes=ws,
                                    sequence_parallel=True)
    (2.0 * value).backward()
    sl = slice(vs.start, vs.end)
    (t_val, t_h, t_w, t_b), (r_val, r_h, r_w, r_b) = found["float64"], found["matching"]
    assert_no_worse_on_every_rank(tp, [
        ("loss", value.detach(), r_val, t_val),
        ("d_hidden", h.grad / 2, _own_rows(tp, r_h), _own_rows(tp, t_h)),
        ("d_weight", w.grad / 2, r_w[sl], t_w[sl]), ("d_bias", b.grad / 2, r_b[sl], t_b[sl]),
    ], torch.float32)
    tp.assert_all(len(set(tp.all_gather_object(float(value)))) == 1,
                  "the loss must be the same on every rank")


@pytest.mark.tp(world_size=4, timeout=300)
def test_partial_hidden_grad_sums_to_the_reduced_one(tp):
    """hidden_grad="partial" leaves each rank its shard's share (no collective): their sum over the
    ranks is the reduced gradient, for linear_logp and for linear_logp_loss; the other outputs and
    gradients are unchanged."""
    vs = _shards(tp)
    p = make_problem(LEAD, D, V, torch.float32, True, seed=13)
    w, b = vs.shard(p.weight), vs.shard(p.bias)
    kw = dict(tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=V)
    results = {}
    for mode in ("reduced", "partial"):
        h, wg, bg = p.hidden.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        logp = tplogp.get_op("linear_logp", source="native")(h, wg, p.target, bg, hidden_grad=mode,
                                                             **kw)
        (logp * p.g_logp).sum().backward()
        hl = p.hidden.clone().requires_grad_()
        value = tplogp.linear_logp_loss(hl, w, p.target, b, loss=losses.cross_entropy(),
                                        source="native", with_entropy=False, hidden_grad=mode, **kw)
        value.backward()
        results[mode] = (logp.detach(), h.grad, wg.grad, bg.grad, value.detach(), hl.grad)
    reduced, partial = results["reduced"], results["partial"]
    for name, i in (("logp", 0), ("d_weight", 2), ("d_bias", 3), ("loss", 4)):
        tp.assert_all(torch.equal(partial[i], reduced[i]),
                      f"{name} changed with hidden_grad='partial'")
    for name, i in (("linear_logp d_hidden", 1), ("linear_logp_loss d_hidden", 5)):
        summed = partial[i].clone()
        dist.all_reduce(summed, group=tp.group)
        tp.assert_all(not torch.equal(partial[i], reduced[i]),
                      f"{name}: 'partial' gave the reduced gradient")
        tp.assert_all(rel_error(summed, reduced[i]) <= tol.REL_FP32_SAME_MATH,
                      f"{name}: shares do not sum up")


def _bad_call(tp, case):
    h, w, t = torch.randn(3, 8), torch.randn(16, 8), torch.arange(12) % 64
    kw = dict(tp_group=tp.group, vocab_start_index=16 * tp.rank, sequence_parallel=True)
    if case == "unequal-slices":
        h = torch.randn(4 if tp.rank == 1 else 3, 8)
    elif case == "tokens-do-not-divide":
        t = torch.arange(13) % 64
    elif case == "replicated-hidden":
        h = torch.randn(12, 8)
    elif case == "sequence-parallel-on-some-ranks":
        kw["sequence_parallel"] = tp.rank != 2
        h = torch.randn(3 if tp.rank != 2 else 12, 8)
    elif case == "partial":
        kw["hidden_grad"] = "partial"
    elif case == "bad-hidden-grad":
        kw.update(sequence_parallel=False, hidden_grad="summed")
        h = torch.randn(12, 8)
    try:
        if case == "loss":
            tplogp.linear_logp_loss(torch.randn(4 if tp.rank == 0 else 3, 8), w, t,
                                    loss=losses.cross_entropy(), **kw)
        else:
            tplogp.linear_logp(h, w, t, **kw)
        tplogp.check_errors(tp.group)
    except LinearLogpInputError as exc:
        return str(exc)
    return "no error"


BAD_CASES = {
    "unequal-slices": r"rank 1: with sequence_parallel=True hidden holds this rank's contiguous slice of the tokens, "
                      r"1/4 of target_ids' 12 .*: expected 3 rows, got hidden \(4, 8\)",
    "tokens-do-not-divide": r"rank 0: .*13 tokens do not divide by the 4 ranks",
    "replicated-hidden": r"rank 0: .*expected 3 rows, got hidden \(12, 8\) \(12 rows\)",
    "sequence-parallel-on-some-ranks": r"the hidden layout \(sequence_parallel, hidden_grad\) must be the same on every "
                                       r"TP rank, got rank 0: sequence_parallel=True, .*rank 2: replicated",
    "partial": r"rank 0: hidden_grad='partial' leaves the gradient of a replicated hidden unsummed",
    "bad-hidden-grad": r"rank 0: hidden_grad must be one of \('reduced', 'partial'\), got 'summed'",
    "loss": r"rank 0: with sequence_parallel=True .*expected 3 rows, got hidden \(4, 8\)",
}


@pytest.mark.tp(world_size=4, timeout=60)
@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_sequence_parallel_input_raises_on_every_rank(tp, case):
    message = agreed_message(tp, _bad_call(tp, case))
    assert re.search(BAD_CASES[case], message), message


@pytest.mark.slow
@pytest.mark.tp(world_size=2, timeout=300)
def test_sequence_parallel_compiles_fullgraph(tp):
    """linear_logp and linear_logp_loss with sequence_parallel under torch.compile(fullgraph=True):
    the gathered rows travel from the op's forward to its backward; loss and gradients are eager's
    bits."""
    import torch._dynamo

    vs = _shards(tp, 97)
    p = make_problem((16,), 16, 97, torch.float32, True, seed=6)
    w, b = vs.shard(p.weight), vs.shard(p.bias)
    kw = dict(tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=97,
              sequence_parallel=True)
    pg = losses.policy_gradient()

    def op_loss(h, w, b):
        return (tplogp.linear_logp(h, w, p.target, b, **kw) * p.g_logp).sum()

    def fused_loss(h, w, b):
        return tplogp.linear_logp_loss(h, w, p.target, b, loss=pg, per_token=(p.g_logp,),
                                       with_entropy=False, **kw)

    def run(fn):
        h, wg, bg = (x.clone().requires_grad_() for x in (_own_rows(tp, p.hidden), w, b))
        value = fn(h, wg, bg)
        value.backward()
        return [value.detach(), h.grad, wg.grad, bg.grad]

    torch._dynamo.reset()
    try:
        for fn in (op_loss, fused_loss):
            eager, compiled = run(fn), run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
            same = all(torch.equal(c, e) for c, e in zip(compiled, eager))
            tp.assert_all(same, f"{fn.__name__}: compiled differs from eager")
    finally:
        torch._dynamo.reset()


@pytest.mark.tp(world_size=[2, 4], timeout=120)
def test_operator_doc_example(tp):
    """docs/operator.md's sequence-parallel example runs as written on every rank."""
    from tests.support.doc_examples import OPERATOR_DOC, run_example

    run_example("sequence-parallel", OPERATOR_DOC, tp_group=tp.group)
