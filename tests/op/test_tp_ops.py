"""The shared TP path on a pool of gloo ranks (pytest_tplogp): every source against float64 truth
with uneven and even shards, the RL options, and bad inputs that must raise the same clear error on
every rank (never a hang)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.support.problems import make_problem, run_op, run_reference
from tests.support.ranks import agreed_message, assert_no_worse_on_every_rank
from tplogp import LinearLogpInputError, ShardLayoutError, check_errors

# 38 tokens as [2, 19] (two interpreter row tiles, the second masked), odd D, prime V: no dimension
# is a multiple of a tile; V does not divide by the world size.
LEAD, D, V = (2, 19), 37, 401


@pytest.fixture
def vocab_shards_size() -> int:
    return V


def _shard(p, vocab_shards):
    full_w, full_b = p.weight, p.bias
    p.weight = vocab_shards.shard(full_w).clone()
    p.bias = None if full_b is None else vocab_shards.shard(full_b).clone()
    return full_w, full_b


def _three_way(tp, p, ours, full_w, full_b, vocab_shards, dtype, **ref_kw):
    p.weight, p.bias = full_w, full_b
    truth = run_reference(p, "float64", **ref_kw)
    ref = run_reference(p, "matching", **ref_kw)
    sl = slice(vocab_shards.start, vocab_shards.end)
    names = ["logp", "d_hidden"] + (["entropy"] if ref_kw.get("entropy") else []) + (
        ["lse"] if ref_kw.get("lse") else [])
    checks = [(name, getattr(ours, name), getattr(ref, name),
               getattr(truth, name)) for name in names]
    checks += [(name, getattr(ours, name), getattr(ref, name)[sl], getattr(truth, name)[sl])
               for name in ("d_weight", "d_bias") if getattr(truth, name) is not None]
    assert_no_worse_on_every_rank(tp, checks, dtype)


@pytest.mark.tp(world_size=4, timeout=300)
def test_tp_matches_float64_truth(tp, vocab_shards, op_source, dtype, bias):
    """logp, hidden.grad (all-reduced) and the local weight/bias grads vs the single-rank float64
    truth."""
    tp.skip_if(dtype == torch.float16,
               "fp16 is covered on GPUs (tests/gpu); CPU fp16 GEMMs are slow and add nothing")
    p = make_problem(LEAD, D, V, dtype, bias, seed=21, peaked=True)
    vs = vocab_shards
    full_w, full_b = _shard(p, vs)
    ours = run_op(op_source, p, tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=V)
    _three_way(tp, p, ours, full_w, full_b, vs, dtype)


@pytest.mark.tp(world_size=4, timeout=300)
def test_tp_rl_options(tp, op_source):
    """temperature, entropy, lse and ignore_index together, per-token gradients on logp, entropy and
    lse."""
    from pytest_tplogp import VocabShards

    vs = VocabShards("uneven", tp.world_size, vocab_size=V).__tp_bind__(tp)
    p = make_problem(LEAD, D, V, torch.float32, True, seed=5, ignore_index=-100,
                     ignore_fraction=0.3)
    full_w, full_b = _shard(p, vs)
    ours = run_op(op_source, p, entropy=True, lse=True, tp_group=tp.group,
                  vocab_start_index=vs.start, global_vocab_size=V, temperature=0.7,
                  ignore_index=-100)
    ignored = p.target == -100
    tp.assert_all(bool((ours.logp[ignored] == 0).all()), "ignored positions must have logp 0")
    tp.assert_all(bool((ours.d_hidden[ignored] == 0).all()),
                  "ignored positions must have no gradient")
    _three_way(tp, p, ours, full_w, full_b, vs, torch.float32, temperature=0.7, ignore_index=-100,
               entropy=True, lse=True)


# ---- bad inputs: the same error on every rank, in bounded time -----------------------------------

def _bad_call(tp, case):
    from tplogp import get_op
    from tplogp.support.shards import shard_boundaries, shard_range

    rank, world = tp.rank, tp.world_size
    start, end = shard_range(shard_boundaries(64, world), rank)
    n, d = 10, 8
    h, w, t, b = torch.randn(n, d), torch.randn(end - start, d), torch.arange(n) % 64, None
    kw = dict(tp_group=tp.group, vocab_start_index=start)
    if case == "overlap":
        kw["vocab_start_index"] = start - 1 if rank == 2 else start
    elif case == "gap":
        w = torch.randn(end - start - (1 if rank == 1 else 0), d)
    elif case == "target-out-of-range":
        t = t.clone()
        t[3] = 64
    elif case == "token-count-mismatch":
        if rank == 3:
            h, t = h[:-1], t[:-1]
    elif case == "shape-on-one-rank":
        if rank == 1:
            w = torch.randn(end - start, d + 1)
    elif case == "dtype-mismatch":
        if rank == 0:
            h = h.double()
    elif case == "bias-on-some-ranks":
        if rank % 2 == 0:
            b = torch.zeros(end - start)
    elif case == "targets-not-replicated":
        if rank == 2:
            t = (t + 1) % 64
    elif case == "global-vocab-disagrees":
        kw["global_vocab_size"] = 64 if rank else 65
    elif case == "device-mismatch":
        if rank == 1:
            t = t.to("meta")
    elif case == "grad-on-some-ranks":
        h.requires_grad_(rank != 3)
    try:
        get_op("linear_logp", source="native")(h, w, t, b, **kw)
        check_errors(tp.group)  # the targets' verdict of the default checks (deferred with a group)
    except (LinearLogpInputError, ShardLayoutError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


BAD_CASES = {
    "overlap": r"ShardLayoutError: vocab shards overlap: rank 1 owns \[16, 32\) and rank 2 owns \[31, 47\)",
    "gap": r"ShardLayoutError: vocab shards leave a gap: ids \[31, 32\) between rank 1",
    "target-out-of-range": r"target_ids must be covered by exactly one TP vocab shard: target id 64 is outside",
    "token-count-mismatch": r"the number of tokens must be the same on every TP rank, got rank 0: 10, .* rank 3: 9",
    "shape-on-one-rank": r"rank 1: hidden size mismatch",
    "dtype-mismatch": r"rank 0: (weight dtype \(torch.float32\) must match|hidden dtype must be one of)",
    "bias-on-some-ranks": r"bias presence .* must be the same on every TP rank",
    "targets-not-replicated": r"target_ids \(they must be replicated",
    "global-vocab-disagrees": r"global_vocab_size must be the same on every TP rank, got rank 0: 65",
    "device-mismatch": r"rank 1: all tensors must be on one device",
    "grad-on-some-ranks": r"whether the call is differentiable .* must be the same on every TP rank, .*rank 3: no",
}


@pytest.mark.tp(world_size=4, timeout=60)
@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_raises_same_error_on_every_rank(tp, case):
    message = agreed_message(tp, _bad_call(tp, case))
    assert re.search(BAD_CASES[case], message), message


@pytest.mark.tp(world_size=4, timeout=60)
def test_fast_checks_mark_uncovered_tokens_nan(tp, monkeypatch):
    """TPLOGP_CHECKS=fast skips the host-synchronizing target check: an unowned target gives NaN,
    not garbage."""
    from tplogp import get_op

    monkeypatch.setenv("TPLOGP_CHECKS", "fast")  # per rank, undone after the test
    v_local = 8
    t = torch.tensor([0, 9, 17, 31, 40])  # 40 is past the 32-id vocabulary: owned by no rank
    out = get_op("linear_logp", source="native")(torch.randn(5, 4), torch.randn(v_local, 4), t,
                                                  tp_group=tp.group,
                                                  vocab_start_index=tp.rank * v_local)
    assert torch.isnan(out).tolist() == [False, False, False, False, True]


@pytest.mark.tp(world_size=2, timeout=60)
@pytest.mark.parametrize("with_group", [True, False])
def test_single_shard_layout_error_names_the_group_it_was_given(tp, with_group):
    """A group of one rank, or none, holds the whole vocabulary in one shard; the message says which
    was passed."""
    from tplogp import get_op

    # every rank creates every group
    own = [tp.new_group([r]) for r in range(tp.world_size)][tp.rank]
    kw = {"tp_group": own} if with_group else {}
    calls = {"start": dict(vocab_start_index=4), "size": dict(global_vocab_size=12)}
    where = "with a tp_group of size 1" if with_group else "without a tp_group"
    expected = {
        "start": f"vocab shards leave a gap: {where} the single shard must start at 0, got vocab_start_index=4 "
                 f"(ids [0, 4) owned by no rank)",
        "size": f"{where} the weight must hold the whole vocabulary: weight has 8 rows but global_vocab_size is 12",
    }
    for name, layout in calls.items():
        with pytest.raises(ShardLayoutError) as info:
            get_op("linear_logp", source="native")(torch.randn(3, 4), torch.randn(8, 4),
                                                   torch.tensor([0, 1, 2]), **kw, **layout)
        assert str(info.value) == expected[name]
