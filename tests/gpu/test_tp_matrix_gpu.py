"""The TP matrix on GPUs, through the plugin: every source x dtype x bias x even/uneven vocab shards at world sizes 2
and 4, the RL options and the fused loss under TP, a DTensor head on a 2-D mesh, a compiled call, and a bad target
on one rank raising on every rank, and the tensor-parallel-invariant level bit for bit against one rank. Each other
result is checked against float64 truth and the same-dtype PyTorch reference with the tolerance table
(``tplogp.tolerances``).

``python -m pytest tests/gpu -m gpu -n 4`` on one GPU runs them all: each xdist worker's ranks share the GPU over
gloo with CUDA tensors (the plugin's sharing placement); with a GPU per rank (4 GPUs, ``-n 1``) they run on NCCL.
Every body uses ``tp.device`` only, so the same bodies run on CPU gloo ranks where the ``gpu`` marker is left out.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.problems import make_problem, problem_on, run_op, run_reference
from tests.support.ranks import agreed_message, assert_no_worse_on_every_rank
from tplogp import LinearLogpInputError, ShardLayoutError, check_errors, linear_logp, linear_logp_loss, losses
from tplogp.reference import reference_outputs

pytestmark = pytest.mark.gpu

SOURCES = ["native", "triton", "sm90"]
# One shape for every test, so that each rank process compiles (or loads) every kernel variant once: 26 tokens as
# [2, 13] (the second row tile masked), D = 64 (16-byte rows for sm90's TMA descriptors), and the LM-head fixtures'
# 1031-token vocabulary (prime: uneven shards at world size 2 and 4, and no shard a multiple of a tile).
LEAD, D = (2, 13), 64
V = 1031
IGNORE = -100
#: The GRPO-style loss of the RL tests: clipped policy ratio, KL to a reference policy, entropy bonus.
GRPO = losses.ppo_clip(0.2, 0.28) + losses.kl_to_reference(0.05) + losses.entropy_bonus(0.01)


def _call_options(op_source) -> dict:
    """sm90 launches its TMA kernels above a size these shapes are far below, and for every deterministic call: sm90
    is asked for deterministic calls, so that its TMA kernels (not only the pointer kernels it shares with triton)
    run under TP."""
    return {"deterministic": True} if str(op_source) == "sm90" else {}


def _shard_problem(p, vocab_shards):
    """Keep this rank's rows of the LM head in ``p``; return the full weight and bias."""
    full_w, full_b = p.weight, p.bias
    p.weight = vocab_shards.shard(full_w).clone()
    p.bias = None if full_b is None else vocab_shards.shard(full_b).clone()
    return full_w, full_b


def _three_way(tp, p, ours, full_w, full_b, vocab_shards, dtype, **ref_kw) -> None:
    """Ours vs float64 truth, no worse than the same-dtype reference (the table's slack): logp, hidden.grad (the
    whole, all-reduced), this rank's rows of weight.grad and bias.grad, and entropy / lse when asked for. One
    verdict for every rank."""
    p.weight, p.bias = full_w, full_b
    truth, ref = run_reference(p, "float64", **ref_kw), run_reference(p, "matching", **ref_kw)
    rows = slice(vocab_shards.start, vocab_shards.end)
    names = ["logp", "d_hidden"] + [n for n in ("entropy", "lse") if ref_kw.get(n)]
    checks = [(n, getattr(ours, n), getattr(ref, n), getattr(truth, n)) for n in names]
    checks += [(n, getattr(ours, n), getattr(ref, n)[rows], getattr(truth, n)[rows])
               for n in ("d_weight", "d_bias") if getattr(truth, n) is not None]
    assert_no_worse_on_every_rank(tp, checks, dtype)


# ---- the matrix: source x dtype x bias x shards x world size (72 tests) --------------------------------------------

@pytest.mark.tp(world_size=[2, 4], timeout=300)
@pytest.mark.parametrize("op_source", SOURCES, indirect=True)
def test_tp_matrix(tp, op_source, dtype, bias, vocab_shards):
    """``src-dtype-bias-shards`` at world size 2 and 4: logp and every gradient against float64 truth."""
    p = problem_on(make_problem(LEAD, D, V, dtype, bias, seed=21, peaked=True), tp.device)
    full_w, full_b = _shard_problem(p, vocab_shards)
    ours = run_op(op_source, p, tp_group=tp.group, vocab_start_index=vocab_shards.start, global_vocab_size=V,
                  **_call_options(op_source))
    _three_way(tp, p, ours, full_w, full_b, vocab_shards, dtype)


# ---- the RL options and the fused loss under TP ---------------------------------------------------------------------

@pytest.mark.tp(world_size=[2, 4], timeout=300)
@pytest.mark.parametrize("op_source", SOURCES, indirect=True)
def test_tp_rl_options(tp, op_source):
    """temperature, entropy, lse and ignore_index together on uneven shards, bf16 (the RL dtype): per-token
    gradients on logp, entropy and lse; ignored positions give 0 and no gradient."""
    from pytest_tplogp import VocabShards

    vs = VocabShards("uneven", tp.world_size, vocab_size=V).__tp_bind__(tp)
    p = problem_on(make_problem(LEAD, D, V, torch.bfloat16, True, seed=5, ignore_index=IGNORE, ignore_fraction=0.3),
                   tp.device)
    full_w, full_b = _shard_problem(p, vs)
    ours = run_op(op_source, p, entropy=True, lse=True, tp_group=tp.group, vocab_start_index=vs.start,
                  global_vocab_size=V, temperature=0.7, ignore_index=IGNORE, **_call_options(op_source))
    ignored = p.target == IGNORE
    tp.assert_all(bool((ours.logp[ignored] == 0).all()), "ignored positions must have logp 0")
    tp.assert_all(bool((ours.d_hidden[ignored] == 0).all()), "ignored positions must have no gradient")
    _three_way(tp, p, ours, full_w, full_b, vs, torch.bfloat16, temperature=0.7, ignore_index=IGNORE,
               entropy=True, lse=True)


def _eager_grpo(p, per_token, mode: str):
    """The GRPO loss (mean over the tokens not ignored) through the materialized reference in ``mode`` (float64 or
    matching), with its gradients in hidden, weight, bias."""
    cast = (lambda x: x.double()) if mode == "float64" else (lambda x: x)
    h, w = cast(p.hidden).clone().requires_grad_(), cast(p.weight).clone().requires_grad_()
    b = None if p.bias is None else cast(p.bias).clone().requires_grad_()
    out = reference_outputs(h, w, p.target, b, mode=mode, temperature=0.7, ignore_index=IGNORE)
    keep = p.target != IGNORE
    per_tok = GRPO(out.logp, out.entropy, *(x.to(out.logp.dtype) for x in per_token))
    loss = torch.where(keep, per_tok, torch.zeros_like(per_tok)).sum() / keep.sum()
    loss.backward()
    return loss.detach(), h.grad, w.grad, None if b is None else b.grad


@pytest.mark.tp(world_size=[2, 4], timeout=300)
@pytest.mark.parametrize("op_source", SOURCES, indirect=True)
def test_tp_fused_loss(tp, op_source):
    """linear_logp_loss (GRPO: ppo_clip + kl_to_reference + entropy_bonus, mean, temperature, ignore_index) on
    uneven bf16 shards: the loss, hidden.grad and this rank's weight and bias gradients against float64 truth."""
    from pytest_tplogp import VocabShards

    vs = VocabShards("uneven", tp.world_size, vocab_size=V).__tp_bind__(tp)
    dtype = torch.bfloat16
    p = problem_on(make_problem(LEAD, D, V, dtype, True, seed=9, ignore_index=IGNORE, ignore_fraction=0.25),
                   tp.device)
    g = torch.Generator().manual_seed(4)
    per_token = tuple(t.to(tp.device) for t in (torch.randn(LEAD, generator=g),
                                                 -3 + 0.3 * torch.randn(LEAD, generator=g),
                                                 -3 + 0.3 * torch.randn(LEAD, generator=g)))
    truth, ref = _eager_grpo(p, per_token, "float64"), _eager_grpo(p, per_token, "matching")
    h = p.hidden.clone().requires_grad_()
    w, b = vs.shard(p.weight).clone().requires_grad_(), vs.shard(p.bias).clone().requires_grad_()
    loss = linear_logp_loss(h, w, p.target, b, loss=GRPO, per_token=per_token, reduction="mean", tp_group=tp.group,
                            vocab_start_index=vs.start, global_vocab_size=V, temperature=0.7, ignore_index=IGNORE,
                            source=op_source.source, **_call_options(op_source))
    loss.backward()
    rows = slice(vs.start, vs.end)
    assert_no_worse_on_every_rank(tp, (("loss", loss.detach(), ref[0], truth[0]),
                                       ("d_hidden", h.grad, ref[1], truth[1]),
                                       ("d_weight", w.grad, ref[2][rows], truth[2][rows]),
                                       ("d_bias", b.grad, ref[3][rows], truth[3][rows])), dtype)


# ---- the tensor-parallel-invariant level ----------------------------------------------------------------------------

@pytest.mark.tp(world_size=[2, 4], timeout=300)
@pytest.mark.parametrize("op_source", SOURCES, indirect=True)
def test_tp_invariant_equals_one_rank_bitwise(tp, op_source):
    """``deterministic="tp_invariant"`` on uneven shards of the prime vocabulary (shards that cut the grid's
    blocks), temperature and ignore_index: logp, entropy, lse and this rank's weight / bias gradient rows equal an
    in-process TP=1 call's on the same device bit for bit, and so do the fused loss's value and gradient rows;
    hidden.grad is equal from run to run."""
    from pytest_tplogp import VocabShards

    vs = VocabShards("uneven", tp.world_size, vocab_size=V).__tp_bind__(tp)
    dtype = torch.float32 if str(op_source) == "native" else torch.bfloat16
    p = problem_on(make_problem(LEAD, D, V, dtype, True, seed=13, ignore_index=IGNORE, ignore_fraction=0.2),
                   tp.device)
    kw = dict(temperature=0.7, ignore_index=IGNORE, deterministic="tp_invariant")
    one = run_op(op_source, p, entropy=True, lse=True, **kw)
    full_w, full_b = _shard_problem(p, vs)
    group = dict(tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=V)
    ours = run_op(op_source, p, entropy=True, lse=True, **group, **kw)
    rows = slice(vs.start, vs.end)
    bad = [n for n in ("logp", "entropy", "lse") if not torch.equal(getattr(ours, n), getattr(one, n))]
    bad += [n for n in ("d_weight", "d_bias") if not torch.equal(getattr(ours, n), getattr(one, n)[rows])]
    tp.assert_all(not bad, f"rank {tp.rank} [{vs.start}, {vs.end}): not bitwise equal to TP=1: {bad}")
    again = run_op(op_source, p, entropy=True, lse=True, **group, **kw)
    tp.assert_all(torch.equal(again.d_hidden, ours.d_hidden), "hidden.grad differs from run to run")

    def fused(weight, bias, **extra):
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        value = linear_logp_loss(p.hidden, w, p.target, b, loss=losses.cross_entropy() + losses.entropy_bonus(0.01),
                                 source=op_source.source, **kw, **extra)
        value.backward()
        return value.detach(), w.grad, b.grad

    loss, lw, lb = fused(p.weight, p.bias, **group)
    ref_loss, ref_w, ref_b = fused(full_w, full_b)
    tp.assert_all(torch.equal(loss, ref_loss) and torch.equal(lw, ref_w[rows]) and torch.equal(lb, ref_b[rows]),
                  f"rank {tp.rank}: the fused loss or its gradient rows differ from TP=1 ({loss.item()!r} vs "
                  f"{ref_loss.item()!r})")


# ---- DTensor, compile, errors -----------------------------------------------------------------------------------------

@pytest.mark.tp(mesh={"dp": 2, "tp": 2}, timeout=300)
def test_tp_dtensor_head_on_2d_mesh(tp, mesh):
    """A DTensor LM head (Replicate over dp, uneven Shard(0) over tp) read out by linear_logp with the registry's
    source: logp, entropy, hidden.grad and this rank's shard of weight.grad and bias.grad (DTensors placed like the
    weight) against float64 truth. Local shards are compared, so nothing but the op's own collectives runs."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    placements = [Replicate(), Shard(0)]
    p = problem_on(make_problem(LEAD, D, V, torch.float32, True, seed=8, peaked=True), tp.device)
    w = distribute_tensor(p.weight, mesh, placements, src_data_rank=None).requires_grad_()  # local chunks, no copy
    b = distribute_tensor(p.bias, mesh, placements, src_data_rank=None).requires_grad_()
    h = p.hidden.clone().requires_grad_()
    logp, entropy = linear_logp(h, w, p.target, b, return_entropy=True)
    ((logp * p.g_logp).sum() + (entropy * p.g_entropy).sum()).backward()
    truth, ref = run_reference(p, "float64", entropy=True), run_reference(p, "matching", entropy=True)
    chunk = -(-V // mesh.size(1))  # torch.chunk's rows per tp rank (DTensor's uneven Shard(0))
    rows = slice(mesh.get_local_rank("tp") * chunk, min(V, (mesh.get_local_rank("tp") + 1) * chunk))
    misplaced = [f"{name} must be a DTensor placed {placements}, got {type(param.grad).__name__}"
                 for name, param in (("d_weight", w), ("d_bias", b))
                 if not (isinstance(param.grad, DTensor) and tuple(param.grad.placements) == tuple(placements))]
    tp.assert_all(not misplaced, "; ".join(misplaced))
    assert_no_worse_on_every_rank(tp, [("logp", logp, ref.logp, truth.logp),
                                       ("entropy", entropy, ref.entropy, truth.entropy),
                                       ("d_hidden", h.grad, ref.d_hidden, truth.d_hidden),
                                       ("d_weight", w.grad.to_local(), ref.d_weight[rows], truth.d_weight[rows]),
                                       ("d_bias", b.grad.to_local(), ref.d_bias[rows], truth.d_bias[rows])],
                                  torch.float32)


@pytest.mark.tp(world_size=2, timeout=300)
def test_tp_compiled_call(tp):
    """torch.compile(fullgraph=True) of a step around linear_logp with a TP group (uneven shards, the registry's
    source, entropy, temperature): no graph break, and the compiled step's logp and gradients equal eager's within
    the table's fp32 bound."""
    from pytest_tplogp import VocabShards

    vs = VocabShards("uneven", tp.world_size, vocab_size=V).__tp_bind__(tp)
    p = problem_on(make_problem(LEAD, D, V, torch.float32, True, seed=4), tp.device)
    _shard_problem(p, vs)

    def step(h, w, b):  # the forward and the loss; the backward runs the compiled graph's backward
        logp, entropy = linear_logp(h, w, p.target, b, tp_group=tp.group, vocab_start_index=vs.start,
                                    global_vocab_size=V, temperature=0.9, return_entropy=True)
        return logp, (logp * p.g_logp).sum() + (entropy * p.g_entropy).sum()

    def run(fn):
        h, w, b = (x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias))
        logp, loss = fn(h, w, b)
        loss.backward()
        return logp.detach(), h.grad, w.grad, b.grad

    torch._dynamo.reset()
    eager = run(step)
    compiled = run(torch.compile(step, fullgraph=True))
    # the op's outputs and gradients are eager's bits, as on one rank (tests/gpu/test_compile_gpu.py); the upstream
    # gradients of the compiled loss are p.g_logp and p.g_entropy exactly
    differ = [name for name, c, e in zip(("logp", "d_hidden", "d_weight", "d_bias"), compiled, eager)
              if not torch.equal(c, e)]
    tp.assert_all(not differ, f"compiled differs from eager's bits: {differ}")


@pytest.mark.tp(world_size=[2, 4], timeout=120)
@pytest.mark.parametrize("op_source", SOURCES, indirect=True)
def test_tp_bad_target_on_one_rank_raises_on_all(tp, op_source):
    """The last rank's targets hold an id past the vocabulary (its targets are not the others' any more): every rank
    raises the same LinearLogpInputError, in bounded time, before any gradient is returned."""
    from pytest_tplogp import VocabShards

    vs = VocabShards("uneven", tp.world_size, vocab_size=V).__tp_bind__(tp)
    p = problem_on(make_problem(LEAD, D, V, torch.float32, False, seed=2), tp.device)
    _shard_problem(p, vs)
    if tp.rank == tp.world_size - 1:
        p.target = p.target.clone()
        p.target[1, 3] = V
    h = p.hidden.clone().requires_grad_()
    try:
        logp = op_source(h, p.weight.clone().requires_grad_(), p.target, tp_group=tp.group,
                         vocab_start_index=vs.start, global_vocab_size=V, **_call_options(op_source))
        logp.sum().backward()
        check_errors(tp.group)  # the deferred target verdict of the default checks, on every rank
        message = f"no error (hidden.grad set: {h.grad is not None})"
    except (LinearLogpInputError, ShardLayoutError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    message = agreed_message(tp, message)
    assert message.startswith("LinearLogpInputError: ") and "target" in message, message
    tp.assert_all(h.grad is None, "a gradient reached hidden before the error")
