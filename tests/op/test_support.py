"""Log-probs renormalized over the sampler's support (``support=``, docs/operator.md, "Sampler's
support") against the float64 definition (``tplogp.testing.reference.reference_support_outputs``):
values and every gradient, padded and CSR supports of different sizes per token, temperature,
softcap, ignore_index and a tiled budget, on one process and on 2 and 4 uneven gloo ranks, on the
native source and the interpreted triton source (``TRITON_INTERPRET=1``), each on both ways (every
tile masked; the gathered rows of the supports' union); every bad support raising the same error on
every rank with the group usable after; the fused loss and ``losses.grpo(...)`` with a support; the
registry's answer for the fused sources (they run a support)."""

from __future__ import annotations

import re

import pytest
import torch

import tplogp
from tests.support import grpo_reference
from tests.support import support_checks
from tests.support.interpreter import INTERPRETING
from tests.support.host_reads import count_host_reads
from tests.support.problems import cpu_sources
from tplogp import losses
from tplogp.backends import fused_support, native, native_support, support_pairs
from tplogp.backends.kernel_registry import SourceUnavailableError, unavailable_reason
from tplogp.op.validation import LinearLogpInputError
from tplogp.testing.reference import reference_logits, reference_support_outputs, support_mask
from tplogp.tolerances import assert_no_worse

IGNORE = -100
B, L, D, V, K = 2, 5, 16, 61, 6  # V prime: uneven shards
OPTIONS = {
    "plain": dict(),
    "temperature-softcap": dict(temperature=0.7, softcap=4.0),
    "ignore-tiled": dict(ignore_index=IGNORE, workspace_bytes=4096),  # tiles of a few columns
    "deterministic": dict(deterministic=True, temperature=1.3),
    "tp-invariant": dict(deterministic="tp_invariant", temperature=0.9, softcap=5.0),
}


# every source's four ways: every tile masked, the gathered rows of the supports' union, token
# chunks each on the gathered rows of its own union (GATHER_FRACTION; the chunks' settings), and
# those chunks with a backward from the (token, id) pairs (no d_W accumulators within the budget)
PATHS = {"mask": -1.0, "gather": 1.0, "chunks": 0.1, "pairs": 0.1}  # (-1: never, even empty)
CHUNKS = dict(CHUNK_IDS=12, CHUNK_FRACTION=1.0, MIN_CHUNK_ROWS=1)  # chunks of 2 tokens (K = 6)
# the sources that run here: native, and triton where Triton's interpreter runs it
SOURCES = cpu_sources()


# the padded form on every way; CSR, converted to the padded form before any way is taken, on one
PATH_FORMS = [*((path, "padded") for path in PATHS), ("mask", "csr")]


@pytest.fixture(params=list(PATHS))
def path(request) -> str:
    """Runs the test on each of the sources' two ways (set by :func:`_take`, in the body: on a TP
    test's ranks)."""
    return request.param


def _take(path: str, monkeypatch) -> list[bool]:
    """The sources' way ``path`` for this test (``GATHER_FRACTION``); the list it returns gets, per
    forward or backward of the source (native, or triton / sm90: :mod:`tplogp.backends.
    fused_support`; every backward: ``native_support.gathered_backward``), whether it ran on
    gathered rows, and ``"chunks"`` where it ran in token chunks."""
    monkeypatch.setattr(native_support, "GATHER_FRACTION", PATHS[path])
    seen = []
    if path in ("chunks", "pairs"):
        for name, value in CHUNKS.items():
            monkeypatch.setattr(native_support, name, value)
    if path == "chunks":
        monkeypatch.setattr(support_pairs, "MAX_IDS", 0)  # (never from the pairs)
    if path == "pairs":  # (rows grouped by size in several widths: 2, 4, 6)
        monkeypatch.setattr(support_pairs, "BUCKET", 2)
    for name in ("forward_stats", "forward_single", "backward"):
        real_pairs = getattr(support_pairs, name)
        monkeypatch.setattr(support_pairs, name,
                            lambda *args, real=real_pairs: seen.append("pairs") or real(*args))
    for module in (native, fused_support, native_support):  # (the forwards; every backward)
        real, real_chunks = module.gathered, module.chunk_rows

        def gathered(*args, real=real):
            narrow = real(*args)
            seen.append(narrow is not None)
            return narrow

        def chunk_rows(*args, real=real_chunks):
            rows = real(*args)
            if rows is not None:
                seen.append("chunks")
            return rows

        monkeypatch.setattr(module, "gathered", gathered)
        monkeypatch.setattr(module, "chunk_rows", chunk_rows)
    return seen


def _assert_ran(path: str, seen: list, gathers: bool = True) -> None:
    """The way ``path`` ran (``gathers``: the call may gather; not under ``deterministic``): some
    forward or backward gathered exactly when the way gathers (on the pairs' way, only calls of
    narrow unions do: a fused loss's token chunks), found token chunks exactly when
    it is ``chunks`` or ``pairs``, and ran from the (token, id) pairs exactly when it is
    ``pairs``."""
    gathered = any(s is True for s in seen)
    chunked = "chunks" in seen
    assert seen and (path == "pairs" or gathered == (path != "mask" and gathers)), seen
    assert chunked == (path in ("chunks", "pairs") and gathers), seen
    assert ("pairs" in seen) == (path == "pairs" and gathers), seen


def _problem(seed: int, vocab: int = V, ignore: bool = False, length: int = L):
    """hidden ``[B, L, D]``, weight, bias, targets ``[B, L]`` and a padded support ``[B, L, K]``:
    per token 1 to K distinct ids holding the target, in random order, ``-1`` padding scattered
    among them (token 0 keeps only its target; one token keeps K); ``ignore``: two ignored tokens,
    whose rows hold only ``-1``."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, length, D, generator=g)
    weight = torch.randn(vocab, D, generator=g) / D ** 0.5 * 2
    bias = torch.randn(vocab, generator=g) * 0.3
    target = torch.randint(0, vocab, (B, length), generator=g)
    support = torch.full((B * length, K), -1, dtype=torch.int64)
    for t, y in enumerate(target.reshape(-1).tolist()):
        size = 1 if t == 0 else K if t == 3 else int(torch.randint(2, K, (), generator=g))
        others = [v for v in torch.randperm(vocab, generator=g).tolist() if v != y][: size - 1]
        slots = torch.randperm(K, generator=g)[:size].tolist()
        for slot, v in zip(slots, [y, *others]):
            support[t, slot] = v
    if ignore:
        target[0, 2] = target[1, length - 1] = IGNORE
        support[2] = support[B * length - 1] = -1
    return hidden, weight, bias, target, support.reshape(B, length, K)


def _csr(support: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded support as ``(offsets, ids)`` over the flattened tokens (in the rows' order)."""
    rows = support.reshape(-1, support.shape[-1])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), (rows >= 0).sum(1).cumsum(0)])
    return offsets, rows[rows >= 0]


def _upstream(shape, seed: int) -> list[torch.Tensor]:
    """Upstream gradients of logp, entropy and lse (float64)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3)]


def _compare(ours, ours_leaves, problem, support, upstream, rows=slice(None), **kw):
    """Three-way checks of the outputs and the gradients (``rows``: this rank's of d_W and d_b)."""
    hidden, weight, bias, target, _ = problem
    return support_checks.compare(ours, ours_leaves, (hidden, weight, bias), target, support,
                                  upstream, target != IGNORE, rows, **kw)


def _call(op, problem, support, leaves=None, **kw):
    hidden, weight, bias, target, _ = problem
    h, w, b = leaves or (t.clone().requires_grad_() for t in (hidden, weight, bias))
    out = op(h, w, target, b, return_entropy=True, return_lse=True, support=support, **kw)
    return out, (h, w, b)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("path, form", PATH_FORMS)
@pytest.mark.parametrize("options", list(OPTIONS))
def test_support_matches_the_definition(form, options, path, source, monkeypatch):
    """logp, entropy, lse and the gradients of hidden, weight and bias as the float64 definition's
    (within the fp32 reference's error), for ragged supports in both forms, on each source."""
    seen = _take(path, monkeypatch)
    kw = OPTIONS[options]
    problem = _problem(seed=3, ignore="ignore_index" in kw)
    support = problem[4]
    given = support if form == "padded" else _csr(support)
    op = tplogp.get_op("linear_logp", source)
    if source != "native" and kw.get("deterministic") == "tp_invariant":
        # the fused sources' grid kernels do not mask: an explicit request names it, the
        # registry's choice is native
        with pytest.raises(SourceUnavailableError, match="tensor-parallel-invariant grid kernels"):
            _call(op, problem, given, **kw)
        op = tplogp.linear_logp
    ours, leaves = _call(op, problem, given, **kw)
    found = _compare(ours, leaves, problem, support, _upstream((B, L), 4), **kw)
    assert not found, "; ".join(found)
    # a token whose support is its target alone: logp 0 and entropy 0 exactly
    assert ours.logp[0, 0].item() == 0.0 and ours.entropy[0, 0].item() == 0.0
    _assert_ran(path, seen, gathers="deterministic" not in kw)


@pytest.mark.parametrize("source", SOURCES)
def test_gradients_reach_the_support_only(path, source, monkeypatch):
    """d_W and d_b are 0 on every row no token keeps (and no target is)."""
    seen = _take(path, monkeypatch)
    problem = _problem(seed=5)
    support = problem[4]
    ours, (h, w, b) = _call(tplogp.get_op("linear_logp", source), problem, support)
    (ours.logp.sum() + ours.entropy.sum()).backward()
    kept = torch.zeros(V, dtype=torch.bool)
    kept[support[support >= 0]] = True
    assert kept.sum() < V
    assert torch.all(w.grad[~kept] == 0) and torch.all(b.grad[~kept] == 0)
    assert w.grad[kept].abs().sum() > 0
    _assert_ran(path, seen)


@pytest.mark.parametrize("source", SOURCES)
def test_argmax_is_over_the_support(path, source, monkeypatch):
    """``return_argmax``: the id of the largest logit among each token's support (an ignored
    token's: 0), in both forms."""
    seen = _take(path, monkeypatch)
    hidden, weight, bias, target, support = _problem(seed=12, ignore=True)
    z = reference_logits(hidden, weight, bias, mode="float64", temperature=0.9)
    expected = z.masked_fill(~support_mask(support, V), float("-inf")).argmax(-1)
    expected = torch.where(target == IGNORE, 0, expected)
    for given in (support, _csr(support)):
        out = tplogp.get_op("linear_logp", source)(hidden, weight, target, bias,
                                                   temperature=0.9, ignore_index=IGNORE,
                                                   return_argmax=True, support=given)
        assert torch.equal(out.argmax, expected), (out.argmax, expected)
    _assert_ran(path, seen)


@pytest.mark.parametrize("source", SOURCES)
def test_full_support_is_the_plain_op(source):
    """A support of every id gives the plain op's outputs and gradients."""
    problem = _problem(seed=6)
    every = torch.arange(V).expand(B, L, V)
    op = tplogp.get_op("linear_logp", source)
    ours, leaves = _call(op, problem, every)
    plain, plain_leaves = _call(op, problem, None)
    for a, p in zip(ours, plain):
        torch.testing.assert_close(a, p, rtol=1e-6, atol=1e-6)
    ga = support_checks.grads_of(list(ours), leaves, [torch.ones(B, L)] * 3)
    gp = support_checks.grads_of(list(plain), plain_leaves, [torch.ones(B, L)] * 3)
    for a, p in zip(ga, gp):
        torch.testing.assert_close(a, p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("source", SOURCES)
def test_support_under_torch_compile_runs_eagerly(source):
    """Under ``torch.compile`` a call with a support leaves the graph (the op schemas take none)
    and runs eagerly, untraced: the outputs and gradients of the eager call, bit for bit; under
    ``fullgraph=True`` the graph break names it."""
    problem = _problem(seed=13)
    op = tplogp.get_op("linear_logp", source)

    def loss(h, w, b):
        out = op(h, w, problem[3], b, return_entropy=True, support=problem[4], temperature=0.8)
        return (out.logp + 0.5 * out.entropy).sum()

    torch._dynamo.reset()
    results = []
    for fn in (loss, torch.compile(loss, backend="eager")):
        leaves = [t.clone().requires_grad_() for t in (problem[0], problem[1], problem[2])]
        value = fn(*leaves)
        results.append((value.detach(), *torch.autograd.grad(value, leaves)))
    for a, e in zip(*results):
        assert torch.equal(a, e)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="support= runs eagerly"):
        torch.compile(loss, backend="eager", fullgraph=True)(*problem[:3])


def _bad_cases(problem):
    """``{case: (support, pattern of the error)}``: every way a support can be wrong."""
    support, target = problem[4], problem[3]
    offsets, ids = _csr(support)
    missing = support.clone()
    missing[1, 2] = torch.where(missing[1, 2] == target[1, 2], -1, missing[1, 2])
    twice = support.clone()
    twice[0, 3, 0], twice[0, 3, 1] = target[0, 3], target[0, 3]
    past = support.clone()
    past[1, 0, support[1, 0].tolist().index(-1) if -1 in support[1, 0].tolist() else 0] = V
    below = support.clone()
    below[0, 1, support[0, 1].tolist().index(-1)] = -2
    negative_ids = ids.clone()
    negative_ids[3] = -1
    return {
        "target-missing": (missing, r"token 7's target \d+ is not in its support"),
        "duplicate": (twice, r"token 3 holds id \d+ more than once"),
        "past-vocab": (past, r"global vocabulary ids in \[0, 61\).*61"),
        "below": (below, r"token 1 holds -2"),
        "csr-negative": ((offsets, negative_ids), r"CSR ids hold -1 at position 3"),
        "csr-offsets": ((offsets.flip(0), ids), r"CSR offsets must be nondecreasing"),
        "shape": (support[..., 0], r"shape target_ids.shape \+ \(K,\)"),
        "dtype": (support.float(), r"must be an integer tensor"),
    }


def test_bad_supports_raise():
    """Each bad support is a LinearLogpInputError naming the problem; a good call follows."""
    problem = _problem(seed=7)
    for case, (support, pattern) in _bad_cases(problem).items():
        with pytest.raises(LinearLogpInputError, match=pattern):
            _call(tplogp.linear_logp, problem, support)
    _call(tplogp.linear_logp, problem, problem[4])


def test_label_smoothing_is_refused():
    hidden, weight, bias, target, support = _problem(seed=8)
    with pytest.raises(LinearLogpInputError, match="label smoothing.*support="):
        tplogp.linear_logp_loss(hidden, weight, target, bias, support=support,
                                loss=losses.cross_entropy(label_smoothing=0.1))


def test_every_source_runs_a_support():
    """The registry's answer: no source names a support as a missing feature (an explicit request
    of triton, where it runs, computes the call)."""
    cpu = torch.device("cpu")
    for source in ("native", "triton", "sm90"):
        assert "support" not in getattr(tplogp.backends.kernel_registry.get_backend(source),
                                        "missing_features", {})
    assert unavailable_reason("native", cpu, torch.float32, ("support",)) is None
    if unavailable_reason("triton", cpu, torch.float32) is None:  # (interpreted Triton)
        assert unavailable_reason("triton", cpu, torch.float32, ("support",)) is None
        problem = _problem(seed=9)
        out, _ = _call(tplogp.get_op(source="triton"), problem, problem[4])
        assert torch.isfinite(out.logp).all()


@pytest.mark.parametrize("source", SOURCES)
def test_fused_loss_with_support_matches_the_op(path, source, monkeypatch):
    """``linear_logp_loss`` with a support (cross-entropy plus an entropy bonus, chunks of 3
    tokens): the loss and the gradients of the op's eager loss (the native source's)."""
    seen = _take(path, monkeypatch)
    problem = _problem(seed=10, ignore=True)
    hidden, weight, bias, target, support = problem
    loss = losses.cross_entropy() + losses.entropy_bonus(0.2)
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    value = tplogp.linear_logp_loss(h, w, target, b, loss=loss, ignore_index=IGNORE,
                                    support=_csr(support), workspace_bytes=_chunks_of(3, source),
                                    source=source)
    value.backward()
    ours, leaves = _call(tplogp.get_op("linear_logp", "native"), problem, support,
                         ignore_index=IGNORE)
    keep = target != IGNORE
    eager = ((-ours.logp - 0.2 * ours.entropy) * keep).sum()
    grads = torch.autograd.grad(eager, leaves)
    torch.testing.assert_close(value, eager.detach(), rtol=1e-5, atol=1e-5)
    for a, e in zip((h.grad, w.grad, b.grad), grads):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)
    _assert_ran(path, seen)


def _chunks_of(tokens: int, source: str = "native") -> int:
    """The fused loss's budget for chunks of ``tokens`` tokens (several chunks per call) on
    ``source``."""
    return tplogp.loss_chunk_budget(tokens, D, V, dtype=torch.float32, bias_dtype=torch.float32,
                                    source=source, device=torch.device("cpu"))


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("case", ["token", "sequence"])
def test_grpo_with_support_matches_its_definition(monkeypatch, case, path, source):
    """``losses.grpo(...)`` through ``linear_logp_loss`` with a support, in chunks of 6 tokens (the
    sequence-level loss: its two phases; their unions too wide to gather whole on the ``chunks``
    and ``pairs`` ways): the loss, its metrics and every gradient as the GRPO definition over the
    renormalized log-probs (float64 truth)."""
    seen = _take(path, monkeypatch)
    problem = _problem(seed=11, ignore=True)
    hidden, weight, bias, target, support = problem

    def logp_of(h, w, b, tgt, temperature, ignore_index, dtype=torch.float64):
        out = reference_support_outputs(h, w, tgt, support, b, temperature=temperature,
                                        ignore_index=ignore_index,
                                        mode="float64" if dtype == torch.float64 else "fp32")
        return out.logp, out.entropy

    monkeypatch.setattr(grpo_reference, "logp_of", logp_of)
    loss = losses.grpo(loss_type="grpo", beta=0.04, importance_sampling_level=case)
    with torch.no_grad():
        logp, _ = logp_of(hidden, weight, bias, target, 1.0, IGNORE)
    given = grpo_reference.per_token_inputs(target, logp, 12, 0.3)
    per_token = [given[name] for name in loss.per_token]
    truth, reference = (grpo_reference.definition(loss, hidden, weight, bias, target, per_token,
                                                  ignore_index=IGNORE, dtype=dt)
                        for dt in (torch.float64, torch.float32))
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    value, metrics = tplogp.linear_logp_loss(h, w, target, b, loss=loss, per_token=per_token,
                                             ignore_index=IGNORE, return_metrics=True,
                                             support=support,
                                             workspace_bytes=_chunks_of(6, source), source=source)
    value.backward()
    grpo_reference.check_three_way((value.detach(), metrics, (h.grad, w.grad, b.grad)),
                                   reference, truth, "grpo with support")
    _assert_ran(path, seen)


# ---- tensor parallel ---------------------------------------------------------------------------

@pytest.fixture
def vocab_shards_size() -> int:
    return V


@pytest.mark.tp(world_size=[2, 4], timeout=300)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("path, form", PATH_FORMS)
def test_tp_support_matches_the_definition(tp, vocab_shards, form, path, source, monkeypatch):
    """Over the ranks (even and uneven shards; ids global, each rank masking the ids it owns):
    outputs and gradients as the float64 definition's (d_W / d_b: this rank's rows), with
    temperature, softcap and ignore_index, on each source."""
    seen = _take(path, monkeypatch)
    problem = _problem(seed=20, ignore=True)
    hidden, weight, bias, target, support = problem
    vs = vocab_shards
    kw = dict(temperature=0.8, softcap=5.0, ignore_index=IGNORE)
    leaves = (hidden.clone().requires_grad_(), vs.shard(weight).clone().requires_grad_(),
              vs.shard(bias).clone().requires_grad_())
    given = support if form == "padded" else _csr(support)
    # (CSR: the global vocabulary from the group record, the support's range checked after it)
    ours, leaves = _call(tplogp.get_op("linear_logp", source), problem, given, leaves=leaves,
                         tp_group=tp.group, vocab_start_index=vs.start,
                         global_vocab_size=V if form == "padded" else None, return_argmax=True,
                         **kw)
    found = _compare(ours, leaves, problem, support, _upstream((B, L), 21),
                     rows=slice(vs.start, vs.end), **kw)
    z = reference_logits(hidden, weight, bias, mode="float64", temperature=0.8, softcap=5.0)
    expected = z.masked_fill(~support_mask(support, V), float("-inf")).argmax(-1)
    if not torch.equal(ours.argmax, torch.where(target == IGNORE, 0, expected)):
        found.append(f"argmax {ours.argmax.tolist()} != {expected.tolist()}")
    tp.assert_all(not found, "; ".join(found))
    _assert_path_taken(tp, path, seen)


# three grid blocks of the tensor-parallel-invariant level (128 columns), cut by every TP degree
INVARIANT_VOCAB = 331


@pytest.mark.tp(world_size=[2, 3, 4], timeout=300)
def test_tp_invariant_support_bitwise_equal_to_one_shard(tp):
    """``deterministic="tp_invariant"`` with a support: on uneven shards that cut the grid's blocks,
    logp, entropy, lse and this rank's d_W / d_b rows equal the whole vocabulary's without a group
    (TP=1) bit for bit, and the fused loss's value and gradient rows too (the mask is a function of
    the global id and the row alone)."""
    from tplogp.support.shards import uneven_boundaries

    v = INVARIANT_VOCAB
    problem = _problem(seed=30, vocab=v, ignore=True)
    hidden, weight, bias, target, support = problem
    bounds = uneven_boundaries(v, tp.world_size)
    s, e = bounds[tp.rank], bounds[tp.rank + 1]
    kw = dict(deterministic="tp_invariant", temperature=0.7, softcap=6.0, ignore_index=IGNORE)
    upstream = [u.float() for u in _upstream((B, L), 31)]

    def run(w, b, **group):
        leaves = (hidden.clone().requires_grad_(), w.clone().requires_grad_(),
                  b.clone().requires_grad_())
        out, leaves = _call(tplogp.linear_logp, problem, support, leaves=leaves, **kw, **group)
        keep = (target != IGNORE).float()
        sum((o * u * keep).sum() for o, u in zip(out, upstream)).backward()
        loss_w, loss_b = w.clone().requires_grad_(), b.clone().requires_grad_()
        value = tplogp.linear_logp_loss(hidden, loss_w, target, loss_b, support=_csr(support),
                                        loss=losses.cross_entropy() + losses.entropy_bonus(0.1),
                                        **kw, **group)
        value.backward()
        return ([o.detach() for o in out] + [leaves[1].grad, leaves[2].grad, value.detach(),
                                              loss_w.grad, loss_b.grad])

    mine = run(weight[s:e], bias[s:e], tp_group=tp.group, vocab_start_index=s,
               global_vocab_size=v)
    whole = run(weight, bias)
    names = ("logp", "entropy", "lse", "d_weight", "d_bias", "loss", "loss d_weight", "loss d_bias")
    rows = {"d_weight", "d_bias", "loss d_weight", "loss d_bias"}
    bad = [n for n, a, r in zip(names, mine, whole)
           if not torch.equal(a, r[s:e] if n in rows else r)]
    tp.assert_all(not bad, f"rank {tp.rank} [{s}, {e}): not bitwise equal to TP=1: {bad}")
    found = _compare(*_call(tplogp.linear_logp, problem, support, **kw), problem, support,
                     _upstream((B, L), 32), **kw)
    tp.assert_all(not found, "; ".join(found))


@pytest.mark.tp(world_size=[2, 4], timeout=300)
@pytest.mark.parametrize("source", SOURCES)
def test_tp_sequence_parallel_support(tp, vocab_shards, source):
    """``sequence_parallel=True`` (hidden: this rank's slice of the tokens, the support and the
    targets of all of them): logp, entropy and this rank's slice of d_hidden as the float64
    definition's, on each source."""
    problem = _problem(seed=24, ignore=True, length=4)
    hidden, weight, bias, target, support = problem
    vs = vocab_shards
    rows = hidden.reshape(-1, D).chunk(tp.world_size)[tp.rank]
    h = rows.clone().requires_grad_()
    w, b = vs.shard(weight), vs.shard(bias)
    out = tplogp.get_op("linear_logp", source)(h, w, target.reshape(-1), b, tp_group=tp.group,
                                               vocab_start_index=vs.start, global_vocab_size=V,
                                               return_entropy=True, ignore_index=IGNORE,
                                               sequence_parallel=True,
                                               support=support.reshape(-1, K))
    (out.logp.sum() + 0.5 * out.entropy.sum()).backward()
    found = []
    for dtype in (torch.float64, torch.float32):
        h_ref = hidden.to(dtype).clone().requires_grad_()
        ref = reference_support_outputs(h_ref, weight.to(dtype), target, support, bias.to(dtype),
                                        ignore_index=IGNORE,
                                        mode="float64" if dtype == torch.float64 else "fp32")
        (ref.logp.sum() + 0.5 * ref.entropy.sum()).backward()
        found.append((ref.logp.reshape(-1).detach(), ref.entropy.reshape(-1).detach(),
                      h_ref.grad.reshape(-1, D).chunk(tp.world_size)[tp.rank]))
    problems = []
    for name, a, r, t in zip(("logp", "entropy", "d_hidden"), (out.logp, out.entropy, h.grad),
                             found[1], found[0]):
        try:
            assert_no_worse(name, a.detach(), r, t, torch.float32)
        except AssertionError as exc:
            problems.append(str(exc))
    tp.assert_all(not problems, "; ".join(problems))


@pytest.mark.tp(world_size=[2, 4], timeout=300)
def test_tp_bad_supports_raise_on_every_rank(tp, vocab_shards):
    """Each bad support raises the same LinearLogpInputError on every rank (the range check also
    where the global vocabulary comes from the group record), and a support bad on one rank only
    raises on all; a good call follows each, so the group is usable."""
    problem = _problem(seed=22)
    hidden, weight, bias, target, support = problem
    vs = vocab_shards
    w, b = vs.shard(weight), vs.shard(bias)
    cases = list(_bad_cases(problem).items())
    one_rank = support.clone()
    if tp.rank == 1:
        one_rank[0, 4, :2] = target[0, 4]
    cases.append(("one-rank", (one_rank, r"more than once")))
    # valid supports that differ between the ranks: one id dropped, or no support at all, on rank 1
    differs = support.clone()
    if tp.rank == 1:
        row = differs[1, 1]  # (2 ids or more)
        row[((row >= 0) & (row != target[1, 1])).nonzero()[0, 0]] = -1
    agree = r"support= \(replicated.*must be the same on every TP rank, got rank 0: #"
    cases.append(("one-rank-differs", (differs, agree)))
    cases.append(("one-rank-none", (None if tp.rank == 1 else support, agree)))
    outcome = []
    for case, (bad, pattern) in cases:
        for vocab in (V, None):
            try:
                tplogp.linear_logp(hidden, w, target, b, tp_group=tp.group,
                                   vocab_start_index=vs.start, global_vocab_size=vocab,
                                   support=bad)
                outcome.append(f"{case}: no error")
            except LinearLogpInputError as exc:
                outcome.append(f"{case}: ok" if re.search(pattern, str(exc)) else f"{case}: {exc}")
            good = tplogp.linear_logp(hidden, w, target, b, tp_group=tp.group,
                                      vocab_start_index=vs.start, global_vocab_size=V,
                                      support=support)
            if not torch.isfinite(good).all():
                outcome.append(f"{case}: the next call is not finite")
    # the same kept sets in another order within each token: the same fingerprint, no error
    shuffled = support.flip(-1) if tp.rank == 1 else support
    again = tplogp.linear_logp(hidden, w, target, b, tp_group=tp.group,
                               vocab_start_index=vs.start, global_vocab_size=V, support=shuffled)
    outcome.append("reordered: ok" if torch.isfinite(again).all() else "reordered: not finite")
    everyone = tp.all_gather_object(outcome)
    tp.assert_all(all(o == everyone[0] for o in everyone), str(everyone))
    tp.assert_all(all(o.endswith(": ok") for o in outcome), str(outcome))


@pytest.mark.tp(world_size=[2, 4], timeout=300)
@pytest.mark.parametrize("source", SOURCES)
def test_tp_fused_loss_with_support(tp, vocab_shards, path, source, monkeypatch):
    """``linear_logp_loss`` with a support over the ranks, on each source: the gradients of the
    single-process op's eager loss (the native source's; this rank's rows of d_W and d_b)."""
    seen = _take(path, monkeypatch)
    problem = _problem(seed=23, ignore=True)
    hidden, weight, bias, target, support = problem
    vs = vocab_shards
    loss = losses.cross_entropy() + losses.entropy_bonus(0.2)
    h = hidden.clone().requires_grad_()
    w, b = (vs.shard(t).clone().requires_grad_() for t in (weight, bias))
    value = tplogp.linear_logp_loss(h, w, target, b, loss=loss, ignore_index=IGNORE,
                                    tp_group=tp.group, vocab_start_index=vs.start,
                                    global_vocab_size=V, support=support,
                                    workspace_bytes=_chunks_of(3, source), source=source)
    value.backward()
    ours, leaves = _call(tplogp.get_op("linear_logp", "native"), problem, support,
                         ignore_index=IGNORE)
    keep = target != IGNORE
    eager = ((-ours.logp - 0.2 * ours.entropy) * keep).sum()
    d_h, d_w, d_b = torch.autograd.grad(eager, leaves)
    rows = slice(vs.start, vs.end)
    ok = (torch.allclose(value, eager.detach(), rtol=1e-5, atol=1e-5)
          and torch.allclose(h.grad, d_h, rtol=1e-4, atol=1e-6)
          and torch.allclose(w.grad, d_w[rows], rtol=1e-4, atol=1e-6)
          and torch.allclose(b.grad, d_b[rows], rtol=1e-4, atol=1e-6))
    tp.assert_all(ok, "fused loss with support differs from the op's eager loss")
    _assert_path_taken(tp, path, seen)


def _assert_path_taken(tp, path: str, seen: list) -> None:
    """Masking: no rank gathered. Gathering: some rank did (a rank whose shard ids the supports
    all keep masks: nothing to gather). Chunks: some rank found token chunks. Pairs: some rank ran
    from the (token, id) pairs, and only then."""
    everyone = tp.all_gather_object((any(s is True for s in seen), "chunks" in seen,
                                     "pairs" in seen))
    gathered, chunked, pairs = (any(rank[i] for rank in everyone) for i in (0, 1, 2))
    tp.assert_all((path == "pairs" or gathered == (path != "mask"))
                  and chunked == (path in ("chunks", "pairs"))
                  and pairs == (path == "pairs"),
                  f"{path}: (gathered, in chunks, from pairs) on ranks {everyone}")


@pytest.mark.parametrize("rows_way", ["_rows_by_columns", "_rows_summed", "_rows_by_kernel"])
@pytest.mark.parametrize("source", SOURCES)
def test_chunked_backward_accumulators_within_the_budget(source, rows_way, monkeypatch):
    """Narrow supports of at most ``support_pairs.MAX_IDS`` ids run from their (token, id) pairs,
    forward and backward, in fp32 and bf16, with the op's own d_W rows or the fused loss's
    accumulators, d_W from the union's columns (GEMMs) or from the id's runs (sums), as
    ``support_pairs.COLUMNS_PER_ID`` decides. Wider ones run in token chunks whose backward adds each chunk's d_W / d_b rows
    to fp32 accumulators: made for the op's backward only where the call's budget holds their
    ``4 V (D + 1)`` bytes, else it masks the whole shard; the fused loss's token chunks pass their
    own. Every way gives the definition's gradients (bf16: within the bf16 reference's error)."""
    monkeypatch.setattr(native_support, "GATHER_FRACTION", PATHS["chunks"])
    for name, value in CHUNKS.items():
        monkeypatch.setattr(native_support, name, value)
    backwards = []
    real, real_pairs = native_support.chunked_backward, support_pairs.backward
    monkeypatch.setattr(native_support, "chunked_backward",
                        lambda *args: backwards.append("chunks") or real(*args))
    monkeypatch.setattr(support_pairs, "backward",
                        lambda *args: backwards.append("pairs") or real_pairs(*args))
    monkeypatch.setattr(support_pairs, "COLUMNS_PER_ID", 1 << 20 if rows_way == "_rows_by_columns"
                        else 0)
    if rows_way == "_rows_by_kernel":  # (a GPU's way: the kernel in Triton's interpreter here)
        if not INTERPRETING:
            pytest.skip("the pairs' row kernel runs here in Triton's CPU interpreter")
        from tplogp.kernels import pairs_launch
        monkeypatch.setattr(support_pairs, "row_kernels", lambda source, device: pairs_launch)
    ways, real_way = [], getattr(support_pairs, rows_way)
    monkeypatch.setattr(support_pairs, rows_way, lambda *a: ways.append(1) or real_way(*a))
    problem = _problem(seed=21)
    support = problem[4]
    need = 4 * V * (D + 1)
    op = tplogp.get_op("linear_logp", source)
    for budget, widest, dtype, way in ((need - 1, K, torch.bfloat16, ["pairs"]),
                                       (need - 1, K, torch.float32, ["pairs"]),
                                       (need - 1, K - 1, torch.float32, []),
                                       (need + 4096, K - 1, torch.float32, ["chunks"])):
        backwards.clear()
        monkeypatch.setattr(support_pairs, "MAX_IDS", widest)  # (K - 1: too wide)
        call = tuple(t.to(dtype) if t.is_floating_point() else t for t in problem)
        ours, leaves = _call(op, call, support, workspace_bytes=budget)
        found = _compare(ours, leaves, call, support, _upstream((B, L), 22), dtype=dtype)
        assert not found, f"{dtype} {widest}: " + "; ".join(found)
        assert backwards == way, (budget, widest, dtype, backwards)
    hidden, weight, bias, target, _ = problem
    pairs_calls = 0
    for widest, way in ((K - 1, "chunks"), (K, "pairs")):  # the fused loss's token chunks (of 6)
        backwards.clear()
        monkeypatch.setattr(support_pairs, "MAX_IDS", widest)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = tplogp.linear_logp_loss(h, w, target, bias, loss=losses.cross_entropy(),
                                       support=support, workspace_bytes=_chunks_of(6, source),
                                       source=source)
        loss.backward()
        assert set(backwards) == {way} and torch.isfinite(w.grad).all(), (way, backwards)
        pairs_calls += backwards.count("pairs")
    assert len(ways) == pairs_calls + 2, (ways, pairs_calls)  # (+ the op's two pairs calls)


@pytest.mark.parametrize("source", SOURCES)
def test_wide_ragged_supports_run_from_their_pairs(source, monkeypatch):
    """A support wider than ``support_pairs.MAX_IDS`` whose rows mostly keep one id runs from its
    (token, id) pairs, its rows grouped by size (``BUCKET`` 2: widths 2 and 6; the ignored tokens'
    rows, without ids, run nothing), forward and backward, with the definition's values and
    gradients; where its grouped pairs pass ``MAX_IDS / 2`` a token, it does not."""
    monkeypatch.setattr(native_support, "GATHER_FRACTION", PATHS["pairs"])
    for name, value in CHUNKS.items():
        monkeypatch.setattr(native_support, name, value)
    monkeypatch.setattr(support_pairs, "BUCKET", 2)
    ran = []
    for name in ("forward_stats", "forward_single", "backward"):
        real = getattr(support_pairs, name)
        monkeypatch.setattr(support_pairs, name,
                            lambda *args, real=real, name=name: ran.append(name) or real(*args))
    hidden, weight, bias, target, support = _problem(seed=31, ignore=True)
    rows = support.reshape(B * L, K).clone()
    for t, y in enumerate(target.reshape(-1).tolist()):
        if t not in (0, 3) and y != IGNORE:  # (row 3 keeps K ids; the others their target)
            rows[t] = -1
            rows[t, 0] = y
    support = rows.reshape(B, L, K)
    problem = (hidden, weight, bias, target, support)
    assert support_pairs.pair_rows(rows).pairs() <= B * L * (K - 1) // 2
    op = tplogp.get_op("linear_logp", source)
    for widest, runs in ((K - 1, True), (1, False)):
        ran.clear()
        monkeypatch.setattr(support_pairs, "MAX_IDS", widest)
        ours, leaves = _call(op, problem, support, ignore_index=IGNORE)
        found = _compare(ours, leaves, problem, support, _upstream((B, L), 32),
                         ignore_index=IGNORE)
        assert not found, f"MAX_IDS {widest}: " + "; ".join(found)
        assert ("backward" in ran) == runs and bool(ran) == runs, (widest, ran)


def test_chunk_unions_are_each_chunks_own():
    """Every token chunk's union at once (one host read) equals that chunk's sorted unique ids:
    ``-1`` padding, a last chunk of fewer rows, a chunk that keeps no id of the shard."""
    g = torch.Generator().manual_seed(23)
    support = torch.randint(-1, 40, (11, 5), generator=g)
    support[4:8] = -1  # (rows 4..7: the second chunk of 4 rows keeps nothing)
    unions = native_support.chunk_unions(support, 4, 40)
    assert len(unions) == 3
    for c, union in enumerate(unions):
        part = support[4 * c:4 * c + 4]
        assert torch.equal(union, torch.unique(part[part >= 0])), (c, union)
    assert unions[1].numel() == 0


@pytest.mark.parametrize("source", SOURCES)
def test_token_chunks_find_their_unions_once(source, monkeypatch):
    """A call in token chunks finds every chunk's union in one pass per forward and backward
    (``chunk_unions``), and its chunks look for no smaller union (no ``torch.unique`` per chunk,
    no chunks within chunks): 2 searches of the whole call's union, whatever the chunk count."""
    monkeypatch.setattr(native_support, "GATHER_FRACTION", PATHS["chunks"])
    for name, value in CHUNKS.items():
        monkeypatch.setattr(native_support, name, value)
    monkeypatch.setattr(support_pairs, "MAX_IDS", 0)  # (the chunk way, not the pairs')
    problem = _problem(seed=24)
    support = problem[4]
    searches, unions = [], []
    real_unique, real_unions = torch.unique, native_support.chunk_unions
    monkeypatch.setattr(torch, "unique", lambda *a, **k: searches.append(1) or real_unique(*a, **k))
    monkeypatch.setattr(native_support, "chunk_unions",
                        lambda *a: unions.append(a[1]) or real_unions(*a))
    ours, leaves = _call(tplogp.get_op("linear_logp", source), problem, support,
                         workspace_bytes=1 << 30)
    found = _compare(ours, leaves, problem, support, _upstream((B, L), 25))
    assert not found, "; ".join(found)
    assert unions == [2, 2], unions  # (CHUNKS: 2 rows a chunk, forward and backward)
    assert len(searches) == 2, len(searches)


@pytest.mark.parametrize("source", SOURCES)
def test_keeps_every_id_read_only_for_computed_supports(source, monkeypatch):
    """Whether a row keeps every id (``KEEP_ALL``) is known for a given support (its ids are checked:
    never) and is not read from it again (a host read per way asked); a computed support's is read
    from it once per call (its tokens whose filters are off keep every id), where the local call
    is made, and the ways ask the call; the answer is the support's own."""
    monkeypatch.setattr(native_support, "GATHER_FRACTION", PATHS["gather"])
    told, real = [], native_support.keeps_all
    monkeypatch.setattr(native_support, "keeps_all",
                        lambda call: told.append((call.support_keeps_all, real(call))) or told[-1][1])
    problem = _problem(seed=26)
    ours, leaves = _call(tplogp.get_op("linear_logp", source), problem, problem[4])
    found = _compare(ours, leaves, problem, problem[4], _upstream((B, L), 27))
    assert not found, "; ".join(found)
    assert told and all(t == (False, False) for t in told), told
    told.clear()
    hidden, weight, bias, target, _ = problem
    with count_host_reads() as reads:
        tplogp.get_op("linear_logp", source)(hidden, weight, target, bias, top_p=0.5)
    assert told and all(t == (False, False) for t in told), told
    assert sum("in localize" in r for r in reads) == 1, reads
    with_off = torch.full(target.shape, 0.5)
    with_off.view(-1)[0] = 1.0  # (a token whose filters are off: it keeps every id)
    told.clear()
    tplogp.get_op("linear_logp", source)(hidden, weight, target, bias, top_p=with_off)
    assert told and all(t == (True, True) for t in told), told


def test_pair_rows_group_rows_by_size_and_follow_writes():
    """Rows grouped by their id count rounded up to ``BUCKET`` (each row's ids first), rows
    without ids in no group; the groups of a support written in place are found again."""
    support = torch.tensor([[-1, -1, -1, -1], [5, -1, 7, -1], [1, 2, 3, 4], [-1, 9, -1, -1],
                            [-1, -1, -1, -1]])
    rows = support_pairs.pair_rows(support)
    assert rows.groups[0][2] == min(support_pairs.BUCKET, 4)
    assert sum(r1 - r0 for r0, r1, _ in rows.groups) == 3
    kept = rows.order[rows.groups[0][0]:rows.groups[-1][1]].tolist()
    assert sorted(kept) == [1, 2, 3]
    for r in kept:
        width = int((support[r] >= 0).sum())
        own = support[r][support[r] >= 0]
        assert sorted(rows.packed[r, :width].tolist()) == sorted(own.tolist())
        assert (rows.packed[r, width:] == -1).all()
    assert support_pairs.pair_rows(support) is rows  # (the same call: read once)
    support[0, 1] = 11
    again = support_pairs.pair_rows(support)
    assert again is not rows and sum(r1 - r0 for r0, r1, _ in again.groups) == 4
