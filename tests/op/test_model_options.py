"""Options for model families and training metrics: the final-logit ``softcap`` (Gemma 2 / 3) and
``return_argmax`` (token accuracy), on one process (native, and the triton kernels under the
interpreter at tiny sizes) and on a TP group of gloo ranks with uneven shards; their validation."""

from __future__ import annotations

import pytest
import torch

from tests.support.problems import make_problem, run_op, run_reference
from tests.support.ranks import assert_no_worse_on_every_rank
from tplogp import LinearLogpInputError, get_op, linear_logp
from tplogp.outputs import LogpArgmax, LogpEntropyLseArgmax
from tplogp.tolerances import assert_no_worse

# 26 tokens as [2, 13] (the second interpreter row tile masked), odd D, prime V: no dimension a tile
# multiple.
LEAD, D, V = (2, 13), 37, 401
# a cap near the logits' scale (the problems' logits reach ~8, peaked rows ~40): tanh bends every
# row
CAP = 5.0


def _three_way(ours, p, dtype, **ref_kw):
    truth = run_reference(p, "float64", **ref_kw)
    ref = run_reference(p, "matching", **ref_kw)
    names = ["logp", "d_hidden", "d_weight"] + (["d_bias"] if p.bias is not None else []) + (
        ["entropy"] if ref_kw.get("entropy") else []) + (["lse"] if ref_kw.get("lse") else [])
    for name in names:
        assert_no_worse(name, getattr(ours, name), getattr(ref, name), getattr(truth, name), dtype)


# native: fp32 and bf16 with a bias, kept terms (a budget above the default tiles) and recomputed
# tiles; triton (the interpreter) at fp32 with nothing kept, and with its default, which keeps the
# terms at this size: the small cap saturates the peaked rows, where the kept path's slope must come
# from the max's own tanh (its kept scale), and Gemma's cap of 30
SOFTCAP_CASES = [("native", torch.float32, True, None, CAP),
                 ("native", torch.bfloat16, True, None, CAP),
                 ("native", torch.float32, False, 1 << 30, CAP),
                 ("triton", torch.float32, True, 0, CAP),
                 ("triton", torch.float32, True, None, CAP),
                 ("triton", torch.float32, True, None, 30.0)]


@pytest.mark.parametrize("source,dtype,bias,workspace,cap", SOFTCAP_CASES,
                         ids=[f"src={s}-{str(d)[6:]}-{'bias' if b else 'nobias'}-ws={w}-cap={c}"
                              for s, d, b, w, c in SOFTCAP_CASES])
def test_softcap_matches_float64_truth(source, dtype, bias, workspace, cap):
    """z = cap * tanh(y / cap), then / T: logp, entropy, lse and every gradient, three ways."""
    p = make_problem(LEAD, D, V, dtype, bias, seed=3, peaked=True)
    ours = run_op(get_op(source=source), p, entropy=True, lse=True, softcap=cap, temperature=0.7,
                  workspace_bytes=workspace)
    _three_way(ours, p, dtype, entropy=True, lse=True, softcap=cap, temperature=0.7)


def test_softcap_changes_the_result():
    """The option is not ignored: a cap that bends the logits gives other log-probs than none."""
    p = make_problem(LEAD, D, V, torch.float32, False, seed=3, peaked=True)
    capped = linear_logp(p.hidden, p.weight, p.target, softcap=CAP)
    plain = linear_logp(p.hidden, p.weight, p.target)
    assert (capped - plain).abs().max() > 0.1


def _tied_problem(n: int, d: int, v: int, seed: int = 0):
    """Integer-valued hidden and weight (exact fp32 dot products in any order) with duplicated
    weight rows, so that some rows' max is reached at several ids, one of them late in the
    vocabulary."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-3, 4, (n, d), generator=g).float()
    weight = torch.randint(-3, 4, (v, d), generator=g).float()
    weight[v - 2] = weight[v // 3] = weight[5]  # ties across tiles and splits (and shards, in TP)
    hidden[0] = weight[5] * 2  # rows 0 and 1: the max is at 5, v // 3 and v - 2
    hidden[1] = weight[5]
    return hidden, weight, torch.randint(0, v, (n,), generator=g)


# a cap far above these logits (|y| <= 63): tanh keeps distinct integers distinct in fp32, so the
# only ties are the duplicated rows' (a saturating cap makes fp32 ties of ids whose float64 logits
# differ)
ARGMAX_CAP = 1000.0


@pytest.mark.parametrize("source,softcap",
                         [("native", None), ("native", ARGMAX_CAP), ("triton", ARGMAX_CAP)])
def test_argmax_is_the_lowest_full_vocab_max(source, softcap):
    hidden, weight, target = _tied_problem(20, 16, 300)
    logp, argmax = get_op(source=source)(hidden, weight, target, softcap=softcap,
                                         return_argmax=True)
    z = hidden.double() @ weight.double().T
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    assert argmax.dtype == torch.int64 and argmax.shape == target.shape
    assert torch.equal(argmax, z.argmax(-1))  # torch's argmax: the first max
    assert argmax[0] == 5 and argmax[1] == 5


def test_outputs_come_in_order_with_argmax_last():
    p = make_problem(LEAD, D, V, torch.float32, True, seed=1, ignore_index=-100,
                     ignore_fraction=0.3)
    out = linear_logp(p.hidden, p.weight, p.target, p.bias, return_entropy=True, return_lse=True,
                      return_argmax=True, ignore_index=-100)
    assert isinstance(out, LogpEntropyLseArgmax)
    logp, entropy, lse, argmax = out
    z = torch.nn.functional.linear(p.hidden, p.weight, p.bias)
    kept = p.target != -100
    assert torch.equal(argmax[kept], z.argmax(-1)[kept]) and bool((argmax[~kept] == 0).all())
    assert isinstance(linear_logp(p.hidden, p.weight, p.target.clamp_min(0), return_argmax=True),
                      LogpArgmax)


def test_argmax_is_not_differentiable_and_the_gradient_is_unchanged():
    p = make_problem(LEAD, D, V, torch.float32, False, seed=2)
    h1, h2 = p.hidden.clone().requires_grad_(), p.hidden.clone().requires_grad_()
    logp, argmax = linear_logp(h1, p.weight, p.target, return_argmax=True)
    assert not argmax.requires_grad
    logp.sum().backward()
    linear_logp(h2, p.weight, p.target).sum().backward()
    assert torch.equal(h1.grad, h2.grad)


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf"), float("nan"), True, "30"])
def test_softcap_must_be_a_positive_finite_float(softcap):
    p = make_problem((4,), 8, 11, torch.float32, False)
    with pytest.raises(LinearLogpInputError, match="softcap must be a positive finite float"):
        linear_logp(p.hidden, p.weight, p.target, softcap=softcap)


def test_argmax_of_a_shard_beyond_exact_fp32_ids_is_refused(monkeypatch):
    from tplogp.op import validation

    monkeypatch.setattr(validation, "MAX_ARGMAX_VOCAB", 8)
    p = make_problem((4,), 8, 11, torch.float32, False)
    with pytest.raises(LinearLogpInputError,
                       match="return_argmax supports vocab shards of at most 8 rows"):
        linear_logp(p.hidden, p.weight, p.target, return_argmax=True)
    linear_logp(p.hidden, p.weight, p.target)  # without argmax the shard is fine


def test_compiled_softcap_and_argmax_match_eager():
    p = make_problem(LEAD, D, V, torch.float32, True, seed=4)

    def f(h, w, t, b):
        return linear_logp(h, w, t, b, softcap=CAP, return_lse=True, return_argmax=True)

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    h1, h2 = p.hidden.clone().requires_grad_(), p.hidden.clone().requires_grad_()
    eager_out, compiled_out = f(h1, p.weight, p.target, p.bias), compiled(h2, p.weight, p.target,
                                                                          p.bias)
    assert torch.equal(eager_out.argmax, compiled_out.argmax) and compiled_out.argmax.dtype == torch.int64
    torch.testing.assert_close(compiled_out.logp, eager_out.logp, rtol=0, atol=0)
    (eager_out.logp.sum() + eager_out.lse.sum()).backward()
    (compiled_out.logp.sum() + compiled_out.lse.sum()).backward()
    assert torch.equal(h2.grad, h1.grad)


# ---- TP: 2 gloo ranks, uneven shards -------------------------------------------------------------

@pytest.mark.tp(world_size=2, timeout=300)
def test_tp_softcap_and_argmax(tp, op_source):
    """softcap with temperature, entropy, lse and ignore_index on uneven shards, three ways; the
    argmax merged across the ranks, ties between the ranks going to the lower id."""
    from pytest_tplogp import VocabShards

    vs = VocabShards("uneven", tp.world_size, vocab_size=V).__tp_bind__(tp)
    p = make_problem(LEAD, D, V, torch.float32, True, seed=5, ignore_index=-100,
                     ignore_fraction=0.3)
    full_w, full_b = p.weight, p.bias
    p.weight, p.bias = vs.shard(full_w).clone(), vs.shard(full_b).clone()
    ours = run_op(op_source, p, entropy=True, lse=True, tp_group=tp.group,
                  vocab_start_index=vs.start, global_vocab_size=V, temperature=0.7,
                  ignore_index=-100, softcap=CAP)
    p.weight, p.bias = full_w, full_b
    truth = run_reference(p, "float64", temperature=0.7, ignore_index=-100, entropy=True, lse=True,
                          softcap=CAP)
    ref = run_reference(p, "matching", temperature=0.7, ignore_index=-100, entropy=True, lse=True,
                        softcap=CAP)
    sl = slice(vs.start, vs.end)
    checks = [(name, getattr(ours, name), getattr(ref, name), getattr(truth, name))
              for name in ("logp", "entropy", "lse", "d_hidden")]
    checks += [(name, getattr(ours, name), getattr(ref, name)[sl], getattr(truth, name)[sl])
               for name in ("d_weight", "d_bias")]
    assert_no_worse_on_every_rank(tp, checks, torch.float32)

    # the max's ids 5, V // 3, V - 2 lie on both ranks
    hidden, weight, target = _tied_problem(20, 16, V)
    _, argmax = op_source(hidden, vs.shard(weight), target, softcap=ARGMAX_CAP, return_argmax=True,
                          tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=V)
    z = ARGMAX_CAP * torch.tanh(hidden.double() @ weight.double().T / ARGMAX_CAP)
    tp.assert_all(bool(torch.equal(argmax, z.argmax(-1))) and int(argmax[0]) == 5,
                  f"argmax {argmax.tolist()} vs {z.argmax(-1).tolist()}")
