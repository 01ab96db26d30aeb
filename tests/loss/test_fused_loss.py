"""``linear_logp_loss`` against ``linear_logp`` followed by the same loss in eager PyTorch: the same
value and gradients (equal within the fp32 tolerance: the loss path sums per chunk), one rank and 4
uneven gloo ranks, on the native and triton sources (the latter through Triton's CPU interpreter);
with 16-bit inputs and peaked rows over several chunks, three-way against float64 (no worse than the
same-dtype eager reference, tolerance table); without the entropy statistics
(``with_entropy=False``), bitwise the default's for a loss that reads no entropy."""

from __future__ import annotations

import pytest
import torch

import tplogp
from tests.support.problems import cpu_sources, make_problem
from tests.support.ranks import agreed_message
from tplogp import budgets, losses
from tplogp.fused_loss import chunk_gradients, loop as fused_loss
from tplogp.backends.kernel_registry import get_backend
from tplogp.reference import reference_outputs
from tplogp.tolerances import ERROR_SLACK, assert_no_worse, rel_error

IGNORE = -100
SOURCES = ["native", "triton"]
# the default transient memory of each source on CPU: a budget above it keeps logits
TILES = {s: get_backend(s).transient_bytes(torch.device("cpu")) for s in SOURCES}
CPU = torch.device("cpu")


def _per_token(p, seed):
    g = torch.Generator().manual_seed(seed)
    shape = p.target.shape
    return torch.randn(shape, generator=g), -3 + 0.3 * torch.randn(shape, generator=g), -3 + 0.3 * torch.randn(
        shape, generator=g)


def _loss_fn(logp, entropy, adv, old, ref):
    return (losses.ppo_clip(0.2, 0.28)(logp, entropy, adv, old) + losses.kl_to_reference(0.05)(logp, entropy, ref)
            + losses.entropy_bonus(0.01)(logp, entropy))


# the same loss as a built-in sum (a TokenLoss: closed-form derivatives)
GRPO = losses.ppo_clip(0.2, 0.28) + losses.kl_to_reference(0.05) + losses.entropy_bonus(0.01)
# a linear built-in sum (reduced as a dot product of its upstream gradients with logp and entropy);
# per_token (adv,)
LINEAR = losses.policy_gradient() + losses.entropy_bonus(0.01)


def _run(fused: bool, p, extra, reduction, source="native", scale=3.0, loss_fn=None, **kw):
    h = p.hidden.clone().requires_grad_()
    w = p.weight.clone().requires_grad_()
    b = None if p.bias is None else p.bias.clone().requires_grad_()
    if fused:
        value = tplogp.linear_logp_loss(h, w, p.target, b, loss=loss_fn or _loss_fn,
                                        per_token=extra, reduction=reduction, source=source, **kw)
    else:
        out = tplogp.get_op("linear_logp", source=source)(h, w, p.target, b, return_entropy=True,
                                                          **kw)
        per_tok = _loss_fn(out.logp, out.entropy, *extra)
        ignore = kw.get("ignore_index")
        keep = torch.ones_like(per_tok, dtype=torch.bool) if ignore is None else p.target != ignore
        per_tok = torch.where(keep, per_tok, torch.zeros_like(per_tok))
        value = per_tok.sum() if reduction == "sum" else per_tok.sum() / keep.sum().clamp_min(1)
    (scale * value).backward()
    return value.detach(), h.grad, w.grad, None if b is None else b.grad


def _compare(ours, eager, what=""):
    for name, a, e in zip(("loss", "d_hidden", "d_weight", "d_bias"), ours, eager):
        if e is None:
            assert a is None, name
            continue
        # fp32: per-chunk sums change the rounding, within the table's fp32 eps
        err = rel_error(a, e)
        assert err <= ERROR_SLACK[torch.float32].eps, f"{what} {name}: relative error {err:.2e} vs eager"


def _count_recompute(monkeypatch):
    """Count the triton backward's recompute launches (its kept-logits launches do no GEMM)."""
    from tplogp.kernels import backward_programs

    seen = {"recompute": 0, "kept": 0}
    real_recompute, real_kept = backward_programs.launch_dlogits, backward_programs.launch_dlogits_kept

    def recompute(*args, **options):
        seen["recompute"] += 1
        return real_recompute(*args, **options)

    def kept(*args, **options):
        seen["kept"] += 1
        return real_kept(*args, **options)

    monkeypatch.setattr(backward_programs, "launch_dlogits", recompute)
    monkeypatch.setattr(backward_programs, "launch_dlogits_kept", kept)
    return seen


@pytest.mark.parametrize("source", cpu_sources(slow_triton=True))
@pytest.mark.parametrize("reduction", ["sum", pytest.param("mean", marks=pytest.mark.slow)])
@pytest.mark.parametrize("budget", [None, "chunks", "all"])
def test_matches_eager_loss_one_rank(monkeypatch, source, reduction, budget):
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    p = make_problem((4, 13), 24, 211, torch.float32, True, seed=12, ignore_index=IGNORE,
                     ignore_fraction=0.2)
    extra = _per_token(p, 1)
    # chunks of 9 tokens (fp32 weights: their d_W accumulator is the gradient, no extra memory)
    ws = {None: None,
          "chunks": tplogp.loss_chunk_budget(9, 24, 211, dtype=torch.float32,
                                             bias_dtype=torch.float32,
                                                         source=source, device=CPU),
          "all": tplogp.keep_logits_budget(52, 211, source=source, device=CPU,
                                           dtype=torch.float32)}[budget]
    kw = dict(temperature=0.9, ignore_index=IGNORE, workspace_bytes=ws)
    eager = _run(False, p, extra, reduction, source, **kw)
    seen = _count_recompute(monkeypatch)
    ours = _run(True, p, extra, reduction, source, **kw)
    _compare(ours, eager, f"{source} {budget}")
    # every chunk's logits are kept, with a budget and (a call this small) without one: no
    if source == "triton":
        # recompute GEMM (3 GEMMs per chunk; tplogp.backends.memory_budget)
        assert seen["recompute"] == 0 and seen["kept"] > 0, seen


def _truth_and_reference(p, extra, reduction, temperature):
    """The loss and its gradients in float64 (truth) and with the same-dtype eager reference (logits
    in the input dtype, fp32 log_softmax and loss)."""
    found = {}
    for mode in ("float64", "matching"):
        dt = torch.float64 if mode == "float64" else None
        h = (p.hidden.to(dt) if dt else p.hidden).clone().requires_grad_()
        w = (p.weight.to(dt) if dt else p.weight).clone().requires_grad_()
        b = (p.bias.to(dt) if dt else p.bias).clone().requires_grad_()
        out = reference_outputs(h, w, p.target, b, mode=mode, temperature=temperature)
        per_tok = _loss_fn(out.logp, out.entropy, *(t.to(out.logp.dtype) for t in extra))
        value = per_tok.sum() if reduction == "sum" else per_tok.mean()
        value.backward()
        found[mode] = (value.detach(), h.grad, w.grad, b.grad)
    return found["float64"], found["matching"]


@pytest.mark.parametrize("source", cpu_sources(slow_triton=True))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_peaked_rows_over_several_chunks_three_way(monkeypatch, source, dtype):
    """d_W and d_b of several chunks are summed in fp32 and rounded once, d_hidden is rounded once
    after the upstream scale: no worse than the eager reference (``loss.backward()``; a one-chunk
    16-bit d_W is scaled in its dtype, exact for powers of two)."""
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)

    # D = 8: the accumulators (D + 1 units of 4 * 157 bytes) leave room for chunks of 8 of the 45
    # tokens
    p = make_problem((45,), 8, 157, dtype, True, seed=21, peaked=True)
    extra = _per_token(p, 5)
    truth, ref = _truth_and_reference(p, extra, "mean", 1.0)
    chunks_of_8 = tplogp.loss_chunk_budget(8, 8, 157, dtype=dtype, bias_dtype=dtype, source=source,
                                           device=CPU)
    accumulators = budgets.accumulator_tokens(8, dtype, dtype)
    # one chunk; 6 chunks of 8 tokens (+ accumulators)
    for ws, chunks in ((None, 1), (chunks_of_8, 6)):
        planned = budgets.plan_chunk_tokens(get_backend(source), 45, 157, ws, CPU, accumulators,
                                            dtype)
        assert -(-45 // planned) == chunks, planned
        ours = _run(True, p, extra, "mean", source, scale=1.0, workspace_bytes=ws)
        for name, a, r, t in zip(("loss", "d_hidden", "d_weight", "d_bias"), ours, ref, truth):
            assert a.dtype == (torch.float32 if name == "loss" else dtype), name
            assert_no_worse(f"{source} {ws} {name}", a, r, t, dtype)


def _ppo_and_kl(logp, entropy, adv, old, ref):
    """A loss that reads no entropy (asserts it got none: run with ``with_entropy=False``)."""
    assert entropy is None, "with_entropy=False must hand the loss callable entropy=None"
    return losses.ppo_clip(0.2, 0.28)(logp, entropy, adv, old) + losses.kl_to_reference(0.05)(logp, entropy, ref)


@pytest.mark.parametrize("source", cpu_sources())
@pytest.mark.parametrize("bias", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["bias", "nobias"])
def test_without_entropy_gives_the_same_loss_and_gradients(monkeypatch, source, bias):
    """``with_entropy=False`` with a loss that reads no entropy: no entropy statistics reach the
    loss path (the source's call and its outputs carry none) and the loss and gradients are bitwise
    those of the default, which computes and ignores them (the logp statistics do not depend on the
    entropy's running sum), over one chunk and six chunks of 8 tokens (bf16: fp32 accumulators
    rounded once)."""

    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    # D = 8: room for chunks
    p = make_problem((45,), 8, 157, torch.bfloat16, bias, seed=21, peaked=True)
    extra = _per_token(p, 5)
    seen = []
    real = fused_loss.tp.shard_forward

    def spying(h, w, b, lt, tpc, call):
        out = real(h, w, b, lt, tpc, call)
        seen.append((call.with_entropy, out[0][1] is not None, out[1][2] is not None))
        return out

    monkeypatch.setattr(fused_loss.tp, "shard_forward", spying)
    chunks_of_8 = tplogp.loss_chunk_budget(8, 8, 157, dtype=torch.bfloat16,
                                           bias_dtype=torch.bfloat16 if bias else None,
                                           source=source, device=CPU)
    for ws, chunks in ((None, 1), (chunks_of_8, 6)):
        found = {}
        for with_entropy in (True, False):
            seen.clear()
            loss_fn = _loss_fn_without_entropy if with_entropy else _ppo_and_kl
            found[with_entropy] = _run(True, p, extra, "mean", source, workspace_bytes=ws,
                                       loss_fn=loss_fn, with_entropy=with_entropy)
            # (the call asks for entropy, the source returns it, and its statistics) on each chunk,
            # or none of them
            assert seen == [(with_entropy,) * 3] * chunks, (ws, with_entropy, seen)
        for name, a, e in zip(("loss", "d_hidden", "d_weight", "d_bias"), found[False],
                              found[True]):
            assert (a is None) == (e is None) == (name == "d_bias" and not bias), name
            assert a is None or torch.equal(a, e), f"{source} {ws} {name}: differs without entropy"


def _loss_fn_without_entropy(logp, entropy, adv, old, ref):
    """``_ppo_and_kl`` for a call that computes the entropy (and ignores it)."""
    return _ppo_and_kl(logp, None, adv, old, ref)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_reaches_the_source(monkeypatch, deterministic):
    """``deterministic`` reaches the source's backward: the native source then pads every token
    chunk to its fixed height (rows' results independent of the batch), and a row's d_hidden is the
    same bits in a sub-batch."""
    from tplogp.backends import native_backward, native_tiles

    p = make_problem((33,), 16, 97, torch.bfloat16, False, seed=3)
    extra = _per_token(p, 2)
    pads = []
    real = native_backward._token_chunk

    def token_chunk(*args, **options):
        pads.append(args[-1])  # pad_to
        return real(*args, **options)

    monkeypatch.setattr(native_backward, "_token_chunk", token_chunk)
    full = _run(True, p, extra, "sum", deterministic=deterministic)
    # not deterministic: token chunks of the batch's own height, or none (one tile: the one-tile
    # backward)
    assert (pads and set(pads) == {native_tiles.DETERMINISTIC_TOKEN_CHUNK}) if deterministic else set(pads) <= {None}, pads
    rows = slice(5, 29)
    sub = make_problem((33,), 16, 97, torch.bfloat16, False, seed=3)
    sub.hidden, sub.target = sub.hidden[rows], sub.target[rows]
    part = _run(True, sub, tuple(t[rows] for t in extra), "sum", deterministic=deterministic)
    assert torch.equal(part[1], full[1][rows])


@pytest.mark.tp(world_size=4, timeout=300)
@pytest.mark.parametrize("source", cpu_sources())
@pytest.mark.parametrize("budget", [None, pytest.param("chunks", marks=pytest.mark.slow)])
def test_matches_eager_loss_on_uneven_ranks(tp, source, budget):
    from pytest_tplogp import VocabShards

    v = 301
    vs = VocabShards("uneven", tp.world_size, vocab_size=v).__tp_bind__(tp)
    p = make_problem((3, 11), 20, v, torch.float32, True, seed=9, ignore_index=IGNORE,
                     ignore_fraction=0.25)
    p.weight, p.bias = vs.shard(p.weight).clone(), vs.shard(p.bias).clone()
    extra = _per_token(p, 4)
    ws = None if budget is None else TILES[source] + 7 * v * 4  # chunks of 7 tokens
    kw = dict(tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=v, temperature=1.3,
              ignore_index=IGNORE, workspace_bytes=ws)
    ours, eager = _run(True, p, extra, "mean", source, **kw), _run(False, p, extra, "mean", source,
                                                                   **kw)
    # without the entropy statistics (4 floats per token gathered instead of 5): bitwise the
    # default's
    plain = _run(True, p, extra, "mean", source, loss_fn=_loss_fn_without_entropy, **kw)
    lean = _run(True, p, extra, "mean", source, loss_fn=_ppo_and_kl, with_entropy=False, **kw)
    with tp.agree():
        _compare(ours, eager, f"{source} rank {tp.rank}")
        assert all(torch.equal(a, e) for a, e in zip(lean, plain)), f"{source} rank {tp.rank}: without entropy"


def test_chunk_plan_counts_the_accumulators_in_the_budget():
    """Several chunks hold fp32 d_W / d_b accumulators (D + 1 units of ``4 * vocab`` bytes for
    16-bit weight and bias, nothing beyond the gradients for fp32 ones) beside the chunk's kept
    terms (2 bytes per logit plus scales for 16-bit inputs), both within the kept part of the
    budget, on every rank of any sharding; one chunk needs no accumulator."""
    from tplogp.backends.native import NativeBackend
    from tplogp.backends.memory_budget import transient_bytes
    from tplogp.budgets import GPU_MIN_CHUNK_TOKENS, accumulator_tokens, plan_chunk_tokens

    be, cpu, bf16 = NativeBackend(), torch.device("cpu"), torch.bfloat16
    n, d, vocab = 1000, 64, 5000
    acc = accumulator_tokens(d, bf16, bf16)
    assert acc == d + 1 and accumulator_tokens(d, bf16, None) == d
    assert accumulator_tokens(d, torch.float32, torch.float32) == 0 and accumulator_tokens(d, None, None) == 0
    acc_bytes = acc * vocab * 4

    def kept(tokens, v=vocab):
        return be.kept_bytes(tokens, v, bf16, cpu)

    assert kept(n) < n * vocab * 4 * 0.55  # about half of fp32 logits

    def plan(extra_bytes, device=cpu, accumulators=acc):
        budget = transient_bytes("native", device) + extra_bytes
        return plan_chunk_tokens(be, n, vocab, budget, device, accumulators, bf16)

    assert plan_chunk_tokens(be, n, vocab, None, cpu, acc, bf16) == n  # nothing kept: one chunk
    assert plan(kept(n)) == n  # every term fits: one chunk, no accumulator
    chunk = plan(kept(n - 1))
    # the most that fits beside them
    assert kept(chunk) + acc_bytes <= kept(n - 1) < kept(chunk + 1) + acc_bytes
    assert plan(kept(n - 1), accumulators=0) == n - 1
    assert plan(acc_bytes) == n  # room for the accumulators only: one chunk, partly kept
    assert plan(acc_bytes + kept(1)) == 1
    for extra in (kept(3) + 5, acc_bytes + kept(10) + 17, kept(700)):
        keep, chunk = extra, plan(extra)
        if chunk < n:
            # every rank's kept terms + accumulators fit its budget
            for v_local in (vocab, vocab // 3 + 1, 1):
                assert kept(chunk, v_local) + v_local * 4 * acc <= keep
    # a GPU runs no chunk thinner than its token tiles: one chunk instead
    cuda = torch.device("cuda")
    assert plan(acc_bytes + kept(GPU_MIN_CHUNK_TOKENS - 1), cuda) == n
    assert plan(acc_bytes + kept(GPU_MIN_CHUNK_TOKENS), cuda) == GPU_MIN_CHUNK_TOKENS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_chunks_run_as_planned(monkeypatch, dtype):
    """The loss runs one source backward per planned chunk, with an accumulator only over several
    chunks; a 16-bit weight and bias's accumulators (D + 1 = 17 units of ``4 * vocab`` bytes here)
    come out of the budget, fp32 ones do not."""
    from tplogp.backends.native import NativeBackend

    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    p = make_problem((80,), 16, 90, dtype, True, seed=8)
    extra = _per_token(p, 3)
    seen = []
    real = NativeBackend.backward

    def counting(self, *args, accumulate=None, **kwargs):
        seen.append(accumulate is not None)
        return real(self, *args, accumulate=accumulate, **kwargs)

    monkeypatch.setattr(NativeBackend, "backward", counting)
    # budgets: (tokens whose terms are kept, accumulator units) -> the backward calls (several
    # chunks: accumulated)
    cases = {torch.bfloat16: ((80, 0, [False]), (10, 17, [True] * 8), (0, 17, [False])),
             torch.float32: ((80, 0, [False]), (10, 0, [True] * 8))}[dtype]
    for tokens, units, calls in cases:
        seen.clear()
        budget = TILES["native"] + NativeBackend.kept_bytes(tokens, 90, dtype, CPU) + units * 90 * 4
        _run(True, p, extra, "sum", workspace_bytes=budget)
        assert seen == calls, (tokens, seen)


@pytest.mark.parametrize("source", [None, "registry", "auto"])
def test_automatic_source_names_pick_the_registry_choice(source):
    """The names ``get_op`` accepts for the registry's choice select it here too, with the same loss
    as native."""
    torch.manual_seed(0)
    h = torch.randn(6, 8, dtype=torch.float32)
    w = torch.randn(30, 8, dtype=torch.float32)
    t = torch.randint(0, 30, (6,))
    adv = torch.randn(6, dtype=torch.float32)
    got = tplogp.linear_logp_loss(h, w, t, loss=tplogp.losses.policy_gradient(), per_token=(adv,),
                                  source=source)
    want = tplogp.linear_logp_loss(h, w, t, loss=tplogp.losses.policy_gradient(), per_token=(adv,),
                                   source="native")
    torch.testing.assert_close(got, want)


def test_value_alone_runs_no_backward(monkeypatch):
    """Without gradients (no_grad, or no input that requires one) the loss is the same value and no
    source backward runs."""
    from tplogp.backends.native import NativeBackend

    p = make_problem((4, 9), 12, 70, torch.float32, True, seed=5, ignore_index=IGNORE,
                     ignore_fraction=0.2)
    extra = _per_token(p, 6)
    h, w, b = (x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias))
    kw = dict(loss=_loss_fn, per_token=extra, reduction="mean", ignore_index=IGNORE,
              source="native")
    want = tplogp.linear_logp_loss(h, w, p.target, b, **kw)

    def no_backward(*args, **kwargs):
        raise AssertionError("a source backward ran for a loss whose gradients nobody can use")

    monkeypatch.setattr(NativeBackend, "backward", no_backward)
    with torch.no_grad():
        got = tplogp.linear_logp_loss(h, w, p.target, b, **kw)
    assert got.grad_fn is None
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)
    got = tplogp.linear_logp_loss(p.hidden, p.weight, p.target, p.bias, **kw)
    assert got.grad_fn is None
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)


@pytest.mark.tp(world_size=2, timeout=60)
def test_grad_on_some_ranks_raises_on_every_rank(tp):
    """A rank whose hidden needs no gradient would skip the d_hidden all-reduce the others enter:
    every rank raises the group check's error instead of hanging."""
    from tplogp.support.shards import shard_boundaries, shard_range

    start, end = shard_range(shard_boundaries(40, tp.world_size), tp.rank)
    h = torch.randn(6, 8).requires_grad_(tp.rank == 0)
    w = torch.randn(end - start, 8, requires_grad=True)
    t = torch.arange(6) * 7 % 40
    try:
        tplogp.linear_logp_loss(h, w, t, loss=losses.policy_gradient(), per_token=(torch.ones(6),),
                                tp_group=tp.group, vocab_start_index=start, source="native")
        message = "no error"
    except tplogp.LinearLogpInputError as exc:
        message = str(exc)
    message = agreed_message(tp, message)
    assert "whether the call is differentiable" in message, message


@pytest.mark.tp(world_size=2, timeout=120)
def test_d_hidden_all_reduce_runs_under_the_last_chunks_d_w(tp):
    """With a group, the one d_hidden all-reduce is issued (async) by the last chunk's backward
    before that chunk's d_W work, and the loss and gradients equal linear_logp + the eager loss."""
    from pytest_tplogp import VocabShards
    from tests.support.backward_schedule import overlap_problem, record_schedule

    v = 97
    vs = VocabShards("uneven", tp.world_size, vocab_size=v).__tp_bind__(tp)
    p = make_problem((30,), 16, v, torch.float32, True, seed=3)
    p.weight, p.bias = vs.shard(p.weight).clone(), vs.shard(p.bias).clone()
    extra = _per_token(p, 2)
    kw = dict(tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=v,
              workspace_bytes=tplogp.loss_chunk_budget(8, 16, v, dtype=torch.float32,
                                                       source="native", device=CPU))
    with record_schedule() as events:
        ours = _run(True, p, extra, "mean", **kw)
    eager = _run(False, p, extra, "mean", **kw)
    with tp.agree():
        assert overlap_problem(events) is None, overlap_problem(events)
        _compare(ours, eager, f"rank {tp.rank}")


def test_autocast_casts_like_f_linear():
    """Under autocast the fused loss uses hidden, weight and bias in the autocast dtype (the loss in
    fp32) and the fp32 leaves get fp32 gradients: the same as casting by hand, then the casts'
    backward."""
    p = make_problem((20,), 16, 60, torch.float32, True, seed=6)
    extra = _per_token(p, 1)
    kw = dict(loss=_loss_fn, per_token=extra, reduction="mean", source="native")
    leaves = [x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = tplogp.linear_logp_loss(leaves[0], leaves[1], p.target, leaves[2], **kw)
    value.backward()
    by_hand = [x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias)]
    want = tplogp.linear_logp_loss(*(x.to(torch.bfloat16) for x in by_hand[:2]), p.target,
                                   by_hand[2].to(torch.bfloat16), **kw)
    want.backward()
    assert value.dtype == torch.float32 and torch.equal(value, want)
    for got, exp in zip(leaves, by_hand):
        assert got.grad.dtype == torch.float32 and torch.equal(got.grad, exp.grad)


@pytest.mark.tp(world_size=4, timeout=300)
def test_dtensor_weight(tp):
    """A DTensor weight and bias placed Shard(0) over an uneven vocabulary (101 ids: 26, 26, 26, 23
    rows): the loss and d_hidden equal those of the plain local shards, and weight.grad / bias.grad
    come back as DTensors with the weight's placement holding the plain call's local gradients; a
    DTensor hidden is refused on every rank."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from tplogp.support.shards import chunk_boundaries, shard_range

    v = 101
    mesh = DeviceMesh.from_group(tp.group, "cpu", mesh_dim_names=("tp",))
    p = make_problem((3, 7), 24, v, torch.float32, True, seed=8)
    extra = _per_token(p, 3)
    kw = dict(loss=_loss_fn, per_token=extra, reduction="mean", source="native")
    w = distribute_tensor(p.weight, mesh, [Shard(0)]).requires_grad_()
    b = distribute_tensor(p.bias, mesh, [Shard(0)]).requires_grad_()
    h = p.hidden.clone().requires_grad_()
    value = tplogp.linear_logp_loss(h, w, p.target, b, **kw)
    value.backward()

    start, end = shard_range(chunk_boundaries(v, tp.world_size), tp.rank)
    hp, wp, bp = (x.clone().requires_grad_() for x in (p.hidden, p.weight[start:end],
                                                       p.bias[start:end]))
    plain = tplogp.linear_logp_loss(hp, wp, p.target, bp, tp_group=tp.group,
                                    vocab_start_index=start, global_vocab_size=v, **kw)
    plain.backward()
    problems = [name for name, a,
                e in (("loss", value, plain), ("d_hidden", h.grad, hp.grad)) if not torch.equal(a,
                                                                                                e)]
    for name, param, local in (("d_weight", w, wp.grad), ("d_bias", b, bp.grad)):
        if not (isinstance(param.grad, DTensor) and tuple(param.grad.placements) == (Shard(0),)
                and torch.equal(param.grad.to_local(), local)):
            problems.append(name)
    try:
        tplogp.linear_logp_loss(DTensor.from_local(p.hidden, mesh, [Replicate()]), w, p.target, b,
                                **kw)
        problems.append("a DTensor hidden was accepted")
    except tplogp.LinearLogpInputError as exc:
        if "pass hidden.to_local()" not in str(exc):
            problems.append(str(exc))
    tp.assert_all(not problems, f"rank {tp.rank}: {problems}")



@pytest.mark.parametrize("source", cpu_sources(slow_triton=True))
@pytest.mark.parametrize("reduction", ["sum", pytest.param("mean", marks=pytest.mark.slow)])
@pytest.mark.parametrize("ignore",
                         [None, pytest.param("some", marks=pytest.mark.slow), "in place", "all"])
@pytest.mark.parametrize("path", ["one chunk", "chunks"])
@pytest.mark.parametrize("loss", ["grpo", "linear"])
def test_token_loss_closed_form_matches_autograd(monkeypatch, source, reduction, ignore, path,
                                                 loss):
    """A built-in loss (a ``TokenLoss``) runs on its closed-form derivatives, with no autograd
    engine run per chunk (one chunk, or chunks of 9 tokens); a linear one (policy gradient
    plus an entropy bonus) is reduced as a dot product. The loss and every gradient equal those of
    the same loss as a plain callable (differentiated by autograd) within the table's fp32 eps, with
    ignored rows compacted away, kept in place (a CUDA-graph capture's layout) or all ignored."""
    from tplogp.op import local_call

    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    p = make_problem((41,), 8, 53, torch.float32, True, seed=32)
    extra = _per_token(p, 4)
    built_in = GRPO if loss == "grpo" else LINEAR
    if loss == "linear":
        extra = extra[:1]
        assert built_in.linear
    targets = p.target.clone()
    if ignore in ("some", "in place"):
        targets[::4] = IGNORE
    elif ignore == "all":
        targets[:] = IGNORE
    if ignore == "in place":
        monkeypatch.setattr(local_call, "compacts_rows", lambda device: False)
    budget = None
    if path == "chunks":
        budget = tplogp.loss_chunk_budget(9, 8, 53, dtype=torch.float32, bias_dtype=torch.float32,
                                          source=source, device=CPU)
    engine_runs = {"n": 0}
    real_grad = torch.autograd.grad

    def counted_grad(*args, **kwargs):
        engine_runs["n"] += 1
        return real_grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counted_grad)
    dotted = []  # calls reduced as a dot product (_linear_total)
    real_total = chunk_gradients._linear_total
    monkeypatch.setattr(chunk_gradients, "_linear_total", lambda *args: dotted.append(1)
                        or real_total(*args))

    def run(loss):
        h, w, b = (x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias))
        engine_runs["n"] = 0
        value = tplogp.linear_logp_loss(h, w, targets, b, loss=loss, per_token=extra,
                                        reduction=reduction, ignore_index=IGNORE, temperature=0.9,
                                        source=source, workspace_bytes=budget)
        node, runs = type(value.grad_fn).__name__, engine_runs["n"]
        (3.0 * value).backward()
        return node, runs, (value.detach(), h.grad, w.grad, b.grad)

    node, runs, ours = run(built_in)
    # (no chunk runs when every row is compacted away)
    assert bool(dotted) == (loss == "linear" and ignore != "all"), dotted
    plain_node, plain_runs, plain = run(lambda *args: built_in(*args))
    assert node == plain_node == "_PrecomputedGradsBackward", (node, plain_node)
    assert runs == 0 and (plain_runs > (1 if path == "chunks" else 0)
                          or ignore == "all"), (runs, plain_runs)
    _compare(ours, plain, f"{source} {loss} {reduction} {ignore} {path}")
    if ignore == "all":
        assert all(torch.count_nonzero(t) == 0 for t in ours)


@pytest.mark.tp(4)
@pytest.mark.parametrize("source", cpu_sources(slow_triton=True))
def test_token_loss_on_uneven_ranks(tp, source):
    """With a group the loss runs the chunk loop; a built-in loss's closed-form derivatives give the
    loss and gradients of the same loss differentiated by autograd (as a plain callable), within the
    table's fp32 eps."""
    from pytest_tplogp import VocabShards

    v = 233
    vs = VocabShards("uneven", tp.world_size, vocab_size=v).__tp_bind__(tp)
    p = make_problem((6, 7), 16, v, torch.float32, True, seed=5, ignore_index=IGNORE,
                     ignore_fraction=0.25)
    p.weight, p.bias = vs.shard(p.weight).clone(), vs.shard(p.bias).clone()
    extra = _per_token(p, 2)
    kw = dict(tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=v, temperature=1.3,
              ignore_index=IGNORE)
    ours = _run(True, p, extra, "mean", source, loss_fn=GRPO, **kw)
    plain = _run(True, p, extra, "mean", source, loss_fn=lambda *args: GRPO(*args), **kw)
    with tp.agree():
        _compare(ours, plain, f"{source} rank {tp.rank}")


def test_constant_derivative_vectors_are_cached_outside_a_capture_only(monkeypatch):
    """A constant derivative over the count is one cached read-only vector per (n, value, device),
    the oldest dropped beyond the cap; inside a capture a fresh one, and the cache untouched."""
    monkeypatch.setattr(chunk_gradients, "_CONSTANTS", {})
    monkeypatch.setattr(chunk_gradients, "_MAX_CONSTANTS", 3)
    a = chunk_gradients._constant_vector(5, -0.25, torch.device("cpu"))
    assert torch.equal(a, torch.full((5,), -0.25)) and a.dtype == torch.float32
    assert chunk_gradients._constant_vector(5, -0.25, torch.device("cpu")) is a
    for n in (6, 7, 8):
        chunk_gradients._constant_vector(n, 1.0, torch.device("cpu"))
    assert list(chunk_gradients._CONSTANTS) == [(6, 1.0, torch.device("cpu")),
                                                (7, 1.0, torch.device("cpu")),
                                           (8, 1.0, torch.device("cpu"))]
    monkeypatch.setattr(chunk_gradients.tensors, "is_capturing", lambda device: True)
    inside = chunk_gradients._constant_vector(7, 1.0, torch.device("cpu"))
    assert torch.equal(inside, torch.ones(7)) and inside is not chunk_gradients._CONSTANTS[(7, 1.0, torch.device("cpu"))]
    chunk_gradients._constant_vector(9, 2.0, torch.device("cpu"))
    assert len(chunk_gradients._CONSTANTS) == 3 and (9, 2.0, torch.device("cpu")) not in chunk_gradients._CONSTANTS
