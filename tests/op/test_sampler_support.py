"""The sampler's support computed from its parameters (``top_k=``, ``top_p=``, ``min_p=``,
docs/operator.md, "Sampler's support") against vLLM's v1 masking written out in float64 on the
whole logits (``tplogp.testing.reference.sampler_mask``): the kept ids themselves (exact ties at
the k-th logit and a top-p boundary inside a group of tied logits; per-token parameters, the
filters' off values, temperature and softcap, tiny budgets and several candidate rounds; collecting
rounds past their counted capacity, ``-inf`` logits and ties across rounds, a support that one rank
holds alone), then
logp, entropy, lse and every gradient as the float64 definition's renormalized over those ids, in
one process and on 2 and 4 uneven gloo ranks; a target outside its support; the fused loss and
``losses.grpo(...)``; every bad parameter raising the same error on every rank."""

from __future__ import annotations

import math
import re

import pytest
import torch

import tplogp
from tplogp import losses
from tplogp.backends import native_support, support_pairs
from tplogp.backends.base import ShardCall
from tplogp.op import sampler_grid, sampler_passes, sampler_support as sampler_module
from tplogp.op.sampler_params import per_token
from tplogp.op.options import LogpOptions
from tplogp.op.support_ids import KEEP_ALL
from tplogp.op.validation import LinearLogpInputError
from tplogp.testing.reference import (padded_support, reference_logits, reference_support_outputs,
                                      sampler_mask)
from tests.support import support_checks
from tests.support.interpreter import INTERPRETING
from tests.support.problems import cpu_sources

IGNORE = -100
B, L, D, V = 2, 6, 8, 61  # V prime: uneven shards
N = B * L
# the sources that run here: native, and triton where Triton's interpreter runs it (the computed
# support goes down each source's support= path)
SOURCES = cpu_sources()


def _problem(seed: int):
    """hidden ``[B, L, D]``, weight ``[V, D]``, bias ``[V]`` of small dyadic values: every logit a
    multiple of 1/32, exact in fp32 and float64, so equal logits are exact ties (many, at the k-th
    logit and elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-2, 3, (B, L, D), generator=g).float() / 2
    weight = torch.randint(-4, 5, (V, D), generator=g).float() / 4
    bias = torch.randint(-4, 5, (V,), generator=g).float() / 8
    return hidden, weight, bias


def _per_token_params(seed: int) -> dict:
    """Per-token parameters mixing values and the filters' off values."""
    g = torch.Generator().manual_seed(seed)
    top_k = torch.randint(1, 12, (B, L), generator=g)
    top_k[0, 0], top_k[0, 1], top_k[1, 0] = -1, 0, V + 3  # off
    top_p = torch.rand(B, L, generator=g, dtype=torch.float64) * 0.7 + 0.25
    top_p[0, 2] = 1.0  # off
    min_p = torch.rand(B, L, generator=g) * 0.3
    min_p[1, 1] = 0.0  # off
    return dict(top_k=top_k, top_p=top_p.float(), min_p=min_p)


CASES = {
    "top_k": dict(top_k=5),
    "top_k=1": dict(top_k=1),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.1),
    "all": dict(top_k=9, top_p=0.7, min_p=0.05),
    "top_p-min_p": dict(top_p=0.6, min_p=0.2),
    "per-token": "per-token",
}
OPTIONS = {
    "plain": dict(),
    "temperature-softcap": dict(temperature=0.5, softcap=6.0),
    "tiny-budget": dict(workspace_bytes=4096, temperature=1.25),
}


def _params(case: str) -> dict:
    return _per_token_params(1) if CASES[case] == "per-token" else dict(CASES[case])


def _truth_mask(problem, params: dict, temperature: float = 1.0, softcap=None) -> torch.Tensor:
    hidden, weight, bias = problem
    z = reference_logits(hidden, weight, bias, mode="float64", temperature=temperature,
                         softcap=softcap)
    return sampler_mask(z, **params)


def _our_mask(problem, params: dict, *, temperature: float = 1.0, softcap=None,
              workspace_bytes=None, deterministic=False, group=None, vocab_start=0,
              weight=None, bias=None) -> torch.Tensor:
    """The ids :func:`sampler_support` keeps, as a ``[B, L, V]`` mask (``KEEP_ALL``: every id)."""
    hidden, full_w, full_b = problem
    w = full_w if weight is None else weight
    b = full_b if bias is None else bias
    sp = per_token(LogpOptions(**params), N, hidden.device, V)
    if sp is None:
        return torch.ones(B, L, V, dtype=torch.bool)
    ids = sampler_module.sampler_support(
        hidden.reshape(N, -1), w, b, sp,
        call=ShardCall(inv_temperature=1.0 / temperature, softcap=softcap,
                       workspace_bytes=workspace_bytes, deterministic=deterministic),
        vocab_start=vocab_start, vocab=V, group=group, comm_device=torch.device("cpu"))
    mask = torch.zeros(N, V + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(ids >= 0, ids, V), True)
    if ids.shape[1]:
        mask[ids[:, 0] == KEEP_ALL] = True
    return mask[:, :V].reshape(B, L, V)


def _mismatch(ours: torch.Tensor, truth: torch.Tensor) -> str:
    bad = (ours != truth).any(-1).reshape(-1).nonzero().squeeze(1).tolist()
    if not bad:
        return ""
    t = bad[0]
    o, r = ours.reshape(N, V)[t], truth.reshape(N, V)[t]
    return (f"tokens {bad}: token {t} keeps {o.nonzero().squeeze(1).tolist()}, the definition "
            f"{r.nonzero().squeeze(1).tolist()}")


def _rounds(monkeypatch) -> list[int]:
    """The candidates per rank of each round (``M``), recorded."""
    real, seen = sampler_module.shard_candidates, []

    def counted(h, w, b, m, *args):
        seen.append(m)
        return real(h, w, b, m, *args)

    monkeypatch.setattr(sampler_module, "shard_candidates", counted)
    return seen


# ---- the kept ids ------------------------------------------------------------------------------

@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_kept_ids_are_vllms(case, options):
    """Every token's kept ids are those of vLLM's masking on the float64 logits, exact ties at the
    k-th logit included (the logits are exact: many ties)."""
    problem = _problem(seed=2)
    params, kw = _params(case), OPTIONS[options]
    truth = _truth_mask(problem, params, kw.get("temperature", 1.0), kw.get("softcap"))
    ours = _our_mask(problem, params, **kw)
    assert not _mismatch(ours, truth), _mismatch(ours, truth)
    if case == "top_k":  # ties at the 5th logit: some token keeps more than 5
        assert (truth.sum(-1) > 5).any()


@pytest.fixture(params=["one-drop-column", "spread", "kernels"])
def drop_columns(request, monkeypatch) -> None:
    """The passes' tiles as torch operations with the dropped logits in one column per row (a
    CPU's way) or spread over ``SPREAD`` columns (a GPU's), or as the GPU's tile kernels (Triton's
    interpreter)."""
    if request.param == "spread":
        monkeypatch.setattr(sampler_passes, "drop_columns", lambda device: sampler_passes.SPREAD)
    if request.param == "kernels":
        if not INTERPRETING:
            pytest.skip("the tile kernels run here in Triton's CPU interpreter "
                        "(TRITON_INTERPRET=1)")
        from tplogp.kernels import sampler_launch
        monkeypatch.setattr(sampler_passes, "tile_kernels", lambda device: sampler_launch)


@pytest.mark.parametrize("case", ["top_k", "top_p", "min_p", "per-token"])
def test_candidate_rounds(case, monkeypatch, drop_columns):
    """With one candidate per rank to start, the rows whose answer is not exact run again until it
    is: the same ids, after several rounds; top-p or min-p alone take two (the bins size the
    second: top-p alone's come with its first round, on its grid, min-p's from a counting pass)."""
    counted = []
    real_bins = sampler_module.shard_bins
    monkeypatch.setattr(sampler_module, "shard_bins",
                        lambda h, *args: counted.append(h.shape[0]) or real_bins(h, *args))
    seen = _rounds_from_one_candidate(case, monkeypatch)
    assert len(seen) >= 2 and seen == sorted(seen), seen
    if case in ("top_p", "min_p"):
        assert len(seen) == 2, seen
    if case in ("top_p", "min_p"):
        assert bool(counted) == (case == "min_p"), counted


@pytest.mark.parametrize("tiles", ["one", "one-per-chunk", "several"])
def test_top_p_alone_on_one_shard_settles_in_its_first_round(tiles, monkeypatch, drop_columns):
    """Top-p alone in one process, where one tile holds a row chunk's logits, collects from that
    tile what its bins reach and settles in the first round: one pass over the logits, the
    definition's ids (also over several row chunks of 5 tokens, the last one shorter); where it
    does not (a row chunk's logits in several tiles of 16 columns), it collects in a second
    round."""
    if tiles == "several":
        monkeypatch.setattr(sampler_passes, "tile_columns", lambda *args: 16)
    if tiles == "one-per-chunk":
        monkeypatch.setattr(sampler_passes, "DETERMINISTIC_ROWS", 5)
        monkeypatch.setattr(sampler_grid, "DETERMINISTIC_ROWS", 5)
    seen = _rounds(monkeypatch)
    problem = _problem(seed=4)
    params = _params("top_p")
    truth = _truth_mask(problem, params)
    ours = _our_mask(problem, params)
    assert not _mismatch(ours, truth), _mismatch(ours, truth)
    assert len(seen) == (2 if tiles == "several" else 1), seen
    assert (truth.sum(-1) > 1).any()  # (supports of several ids)


@pytest.mark.parametrize("case", ["top_p", "min_p", "per-token"])
def test_collecting_rounds_past_their_capacity_run_again(case, monkeypatch, drop_columns):
    """A collecting round whose edge holds more ids on a rank than the counting pass gave it (here
    a count of 1 for every row) leaves those rows for another round (from their bound, then the
    largest logits): the same ids."""
    real = sampler_module._binned_sizes

    def short(*args):
        last, size, whole = real(*args)
        return last, torch.ones_like(size), torch.ones_like(whole)

    monkeypatch.setattr(sampler_module, "_binned_sizes", short)
    seen = _rounds_from_one_candidate(case, monkeypatch)
    assert len(seen) >= 3 and seen == sorted(seen), seen


@pytest.mark.parametrize("case", ["top_k", "top_p", "min_p", "per-token"])
def test_candidates_ranked_and_decided_in_blocks_of_rows(case, monkeypatch):
    """A round's candidates ranked and decided a block of rows at a time (here one row: the block
    holds at most ``DECIDE_ELEMENTS`` candidates), over several rounds: the definition's ids."""
    monkeypatch.setattr(sampler_module, "DECIDE_ELEMENTS", 1)
    blocks = []
    real = sampler_module._ranked
    monkeypatch.setattr(sampler_module, "_ranked",
                        lambda values, ids: blocks.append(values.shape[0]) or real(values, ids))
    seen = _rounds_from_one_candidate(case, monkeypatch)
    assert len(seen) >= 2 and set(blocks) == {1} and len(blocks) > N, (seen, blocks)


def _rounds_from_one_candidate(case: str, monkeypatch) -> list:
    """The kept ids of ``case`` with one candidate per rank to start and a budget of one byte
    (every chunk the smallest), checked against the float64 definition; returns the rounds seen
    (:func:`_rounds`)."""
    monkeypatch.setattr(sampler_module, "SLACK", 1)
    monkeypatch.setattr(sampler_module, "MIN_CANDIDATES", 1)
    monkeypatch.setattr(sampler_module, "GRID_CANDIDATES", 1)  # (top-p alone: not in one round)
    seen = _rounds(monkeypatch)
    problem = _problem(seed=3)
    params = _params(case)
    ours = _our_mask(problem, params, workspace_bytes=1)
    truth = _truth_mask(problem, params)
    assert not _mismatch(ours, truth), _mismatch(ours, truth)
    return seen


@pytest.mark.parametrize("params", [dict(top_p=0.8), dict(min_p=0.01), dict(top_p=0.9, min_p=0.2),
                                    dict(top_k=4, top_p=0.95)])
def test_minus_inf_logits_and_ties_across_rounds(params, monkeypatch):
    """Logits of ``-inf`` (a bias of ``-inf``: never kept, never counted) and exact ties (dyadic
    logits: tied ids fall in one bin, collected or not together), with one candidate to start, so
    every row counts and collects: the definition's ids."""
    monkeypatch.setattr(sampler_module, "SLACK", 1)
    monkeypatch.setattr(sampler_module, "MIN_CANDIDATES", 1)
    hidden, weight, bias = _problem(seed=25)
    bias = bias.clone()
    bias[::3] = float("-inf")
    problem = (hidden, weight, bias)
    truth = _truth_mask(problem, params)
    ours = _our_mask(problem, params, workspace_bytes=1)
    assert not _mismatch(ours, truth), _mismatch(ours, truth)
    assert not ours.reshape(N, V)[:, ::3].any()


def test_top_p_boundary_inside_tied_logits_across_rounds(monkeypatch):
    """The tie rule when the boundary's tied logits come from a collecting round."""
    monkeypatch.setattr(sampler_module, "SLACK", 1)
    monkeypatch.setattr(sampler_module, "MIN_CANDIDATES", 1)
    problem, z = _tied_row()
    p = torch.softmax(z, 0)
    for tied_kept in (1, 2, 3):
        top_p = float(p[5] + tied_kept * p[10] - p[10] / 2)
        ours = _our_mask(problem, dict(top_p=top_p))
        assert ours[0, 0].nonzero().squeeze(1).tolist() == [5, 10, 20, 30][: 1 + tied_kept]
        assert torch.equal(ours, _truth_mask(problem, dict(top_p=top_p)))


@pytest.mark.parametrize("case", ["top_k+top_p", "top_p"])
def test_deterministic_rows_do_not_depend_on_the_batch(case, drop_columns):
    """``deterministic=True``: a token's kept ids are the same alone (its chunk padded with zero
    rows) as in its batch; top-p alone settles in its first round from the padded chunk's tile."""
    problem = _problem(seed=4)
    params = dict(top_k=7, top_p=0.85) if case == "top_k+top_p" else dict(top_p=0.85)
    batch = _our_mask(problem, params, deterministic=True)
    hidden, weight, bias = problem
    one = (hidden[:1, :1].expand(B, L, D).contiguous(), weight, bias)
    alone = _our_mask(one, params, deterministic=True)
    assert torch.equal(alone[0, 0], batch[0, 0])
    assert not _mismatch(batch, _truth_mask(problem, params))


def _tied_row():
    """One token whose logits are: id 5: 2, ids 10, 20, 30: 1 (tied), every other id -3."""
    z = torch.full((V,), -3.0)
    z[5], z[[10, 20, 30]] = 2.0, 1.0
    hidden = torch.ones(B, L, 1)
    return (hidden, z[:, None].clone(), None), z.double()


def test_top_k_keeps_every_id_tied_with_the_kth():
    problem, _ = _tied_row()
    for k, kept in ((1, [5]), (2, [5, 10, 20, 30]), (4, [5, 10, 20, 30])):
        ours = _our_mask(problem, dict(top_k=k))
        assert ours[0, 0].nonzero().squeeze(1).tolist() == kept, k
        assert torch.equal(ours, _truth_mask(problem, dict(top_k=k)))


def test_top_p_boundary_inside_tied_logits_keeps_the_lower_ids():
    """The top-p boundary falls inside the three tied logits: the lowest two ids of the three are
    kept (the documented tie rule), the third is not."""
    problem, z = _tied_row()
    p = torch.softmax(z, 0)
    for tied_kept in (1, 2, 3):
        mass = p[5] + tied_kept * p[10]
        top_p = float(mass - p[10] / 2)  # inside the tied group: needs exactly tied_kept of them
        ours = _our_mask(problem, dict(top_p=top_p))
        expected = [5, 10, 20, 30][: 1 + tied_kept]
        assert ours[0, 0].nonzero().squeeze(1).tolist() == expected, (tied_kept, top_p)
        assert torch.equal(ours, _truth_mask(problem, dict(top_p=top_p)))


def test_min_p_keeps_probabilities_at_its_threshold():
    """``min_p = p_tied / p_max`` exactly at a power of two: the tied ids are kept (``>=``)."""
    z = torch.full((V,), -8.0)
    z[3], z[[7, 9]] = 1.0, 1.0 - math.log(4.0)
    problem = (torch.ones(B, L, 1), z[:, None].clone(), None)
    z64 = z.double()
    ours = _our_mask(problem, dict(min_p=0.25 * (1 - 1e-6)))
    assert ours[0, 0].nonzero().squeeze(1).tolist() == [3, 7, 9]
    assert torch.equal(ours, sampler_mask(z64.expand(B, L, V), min_p=0.25 * (1 - 1e-6)))


# ---- the op's values and gradients -------------------------------------------------------------

def _targets_in(mask: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(mask.reshape(N, V).double(), 1, generator=g).reshape(B, L)


def _compare(ours, leaves, problem, target, support, rows=slice(None), **kw) -> list[str]:
    """Three-way checks of logp, entropy, lse and the gradients against the float64 definition
    renormalized over ``support`` (``rows``: this rank's of d_W and d_b)."""
    g = torch.Generator().manual_seed(7)
    upstream = [torch.randn(B, L, generator=g, dtype=torch.float64) for _ in range(3)]
    return support_checks.compare(ours, leaves, problem, target, support, upstream,
                                  target != IGNORE, rows, **kw)


VALUE_OPTIONS = {
    "plain": dict(),
    "temperature-softcap": dict(temperature=0.5, softcap=6.0),
    "ignore-tiled": dict(ignore_index=IGNORE, workspace_bytes=4096),
    "deterministic": dict(deterministic=True, temperature=1.25),
}


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("options", list(VALUE_OPTIONS))
@pytest.mark.parametrize("case", ["top_k", "all", "per-token"])
def test_values_and_gradients_match_the_definition(case, options, source):
    """logp, entropy, lse and the hidden, weight and bias gradients as the float64 definition's
    renormalized over vLLM's kept ids (targets drawn from them), on each source."""
    problem = _problem(seed=5)
    params, kw = _params(case), VALUE_OPTIONS[options]
    mask = _truth_mask(problem, params, kw.get("temperature", 1.0), kw.get("softcap"))
    target = _targets_in(mask, seed=6)
    if "ignore_index" in kw:
        target[0, 3] = target[1, 5] = IGNORE
    leaves = tuple(t.clone().requires_grad_() for t in problem)
    ours = tplogp.get_op("linear_logp", source)(*leaves[:2], target, leaves[2],
                                                  return_entropy=True, return_lse=True, **params,
                                                  **kw)
    found = _compare(ours, leaves, problem, target, padded_support(mask), **kw)
    assert not found, "; ".join(found)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("case", ["top_k", "top_p", "all"])
@pytest.mark.parametrize("values", ["dyadic", "random"])
def test_16_bit_calls_take_the_forward_from_the_sampler_logits(values, case, source,
                                                              monkeypatch):
    """A bf16 call's support comes with its ids' logits as the sampler's passes computed them,
    and the forward takes its statistics from them (``support_pairs.given_stats``, counted: no
    pass of its own): logp, entropy, lse and the hidden, weight and bias gradients as the float64
    definition's renormalized over vLLM's kept ids by a bf16 call's three-way rule, as those of
    the same support given explicitly (whose forward computes its own), on dyadic values (exact
    logits, many ties) and random ones. (Here a round keeps its candidates' logits however
    many: this vocabulary is smaller than ``LOGITS_FRACTION`` times them.)"""
    monkeypatch.setattr(sampler_module, "LOGITS_FRACTION", 1)
    taken = []
    real = support_pairs.given_stats
    monkeypatch.setattr(support_pairs, "given_stats",
                        lambda *args: taken.append(1) or real(*args))
    if values == "dyadic":
        problem = tuple(t.to(torch.bfloat16) for t in _problem(seed=12))
    else:
        g = torch.Generator().manual_seed(12)
        problem = (torch.randn(B, L, D, generator=g).bfloat16(),
                   (torch.randn(V, D, generator=g) * 0.7).bfloat16(),
                   (torch.randn(V, generator=g) * 0.3).bfloat16())
    params = _params(case)
    mask = _truth_mask(tuple(t.double() for t in problem), params)
    target = _targets_in(mask, seed=13)
    op = tplogp.get_op("linear_logp", source)
    for kw in (params, dict(support=padded_support(mask))):
        leaves = tuple(t.clone().requires_grad_() for t in problem)
        ours = op(*leaves[:2], target, leaves[2], return_entropy=True, return_lse=True, **kw)
        found = _compare(ours, leaves, problem, target, padded_support(mask),
                         dtype=torch.bfloat16)
        assert not found, f"{kw}: " + "; ".join(found)
        # the parameters' call took the sampler's logits; the explicit support's, none
        assert bool(taken) == ("support" not in kw), (kw, taken)
        taken.clear()


def test_sampler_logits_only_for_narrow_candidates_and_no_row_keeping_every_id():
    """The support's logits come with it while a round's candidates per token are at most
    ``vocab / LOGITS_FRACTION`` (their memory a fraction of the ids'), not where some token keeps
    every id; where they come, each kept id's logit is the float64 one's fp32 rounding and the
    padding ``-inf``."""
    problem = tuple(t.to(torch.bfloat16) for t in _problem(seed=12))
    hidden, weight, bias = problem

    def ours(fraction, params):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sampler_module, "LOGITS_FRACTION", fraction)
            return sampler_module.sampler_support_with_logits(
                hidden.reshape(N, D), weight, bias, per_token(LogpOptions(**params), N,
                                                              hidden.device, V),
                call=ShardCall(), vocab_start=0, vocab=V, group=None,
                comm_device=torch.device("cpu"))

    ids, logits = ours(1, dict(top_k=5))
    z = reference_logits(*(t.double() for t in problem), mode="float64").reshape(N, V)
    want = torch.where(ids >= 0, z.gather(1, ids.clamp(min=0)).float(), float("-inf"))
    assert logits is not None and torch.equal(logits, want)
    assert ours(sampler_module.LOGITS_FRACTION, dict(top_k=5))[1] is None  # (21 of 61 ids)
    top_k = torch.full((B, L), 5)
    top_k[0, 0] = 0  # (a token whose filters are all off: it keeps every id)
    ids, logits = ours(1, dict(top_k=top_k))
    assert ids[0, 0] == KEEP_ALL and logits is None


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("gather", [-1.0, 1.0])  # the sources' masked tiles, gathered rows
def test_a_target_outside_its_support_has_logp_minus_inf(gather, source, monkeypatch):
    """The sampler's distribution gives such a target probability 0: logp ``-inf``; entropy and
    lse those of the support, and logp's gradient that of ``-lse`` over the support (finite), on
    both ways of each source."""
    monkeypatch.setattr(native_support, "GATHER_FRACTION", gather)
    problem = _problem(seed=8)
    params = dict(top_k=3)
    mask = _truth_mask(problem, params)
    target = _targets_in(mask, seed=9)
    outside = (~mask[0, 1]).nonzero()[0, 0]
    target[0, 1] = outside
    leaves = tuple(t.clone().requires_grad_() for t in problem)
    ours = tplogp.get_op("linear_logp", source)(*leaves[:2], target, leaves[2],
                                                  return_entropy=True, return_lse=True, **params)
    assert ours.logp[0, 1].item() == float("-inf")
    assert torch.isfinite(ours.logp.flatten()[2:]).all()
    h, w, b = (t.double().clone().requires_grad_() for t in problem)
    ref = reference_support_outputs(h, w, target, padded_support(mask), b, mode="float64")
    torch.testing.assert_close(ours.entropy, ref.entropy.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.lse, ref.lse.float(), rtol=1e-5, atol=1e-6)
    mine = torch.autograd.grad((ours.logp[0, 1] * 1.0), leaves)
    theirs = torch.autograd.grad(-ref.lse[0, 1], (h, w, b))
    for a, t in zip(mine, theirs):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, t.float(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("source", SOURCES)
def test_filters_off_are_the_plain_op(source):
    """``top_k`` -1 / 0 / at least V, ``top_p`` 1 and ``min_p`` 0 (scalars) are the plain op; per
    token, a token whose filters are all off keeps every id (its values are the plain op's), on
    each source."""
    problem = _problem(seed=10)
    hidden, weight, bias = problem
    target = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(11))
    op = tplogp.get_op("linear_logp", source)
    plain = op(hidden, weight, target, bias, return_entropy=True)
    for off in (dict(top_k=-1), dict(top_k=0), dict(top_k=V), dict(top_p=1.0), dict(min_p=0.0),
                dict(top_k=0, top_p=1.0, min_p=0)):
        out = op(hidden, weight, target, bias, return_entropy=True, **off)
        assert torch.equal(out.logp, plain.logp) and torch.equal(out.entropy, plain.entropy), off
    top_k = torch.zeros(B, L, dtype=torch.int64)
    top_k[1] = 4
    mask = _truth_mask(problem, dict(top_k=top_k))
    target[1] = _targets_in(mask, seed=12)[1]
    out = op(hidden, weight, target, bias, return_entropy=True, top_k=top_k)
    torch.testing.assert_close(out.logp[0], plain.logp[0], rtol=1e-6, atol=1e-6)
    ref = reference_support_outputs(hidden, weight, target, padded_support(mask), bias,
                                    mode="float64")
    torch.testing.assert_close(out.logp, ref.logp.float(), rtol=1e-5, atol=1e-5)


def test_argmax_is_the_supports():
    """``return_argmax``: the support always holds the largest logit, so the argmax is the plain
    op's."""
    hidden, weight, bias = _problem(seed=13)
    target = torch.zeros(B, L, dtype=torch.int64)
    plain = tplogp.linear_logp(hidden, weight, target, bias, return_argmax=True)
    out = tplogp.linear_logp(hidden, weight, target, bias, return_argmax=True, top_p=0.5)
    assert torch.equal(out.argmax, plain.argmax)


def test_fused_loss_and_grpo_match_the_explicit_support():
    """``linear_logp_loss`` (cross-entropy plus an entropy bonus) and ``losses.grpo(...)`` with
    the sampler's parameters: the loss and gradients of the same call given the float64
    definition's kept ids as ``support=``."""
    problem = _problem(seed=14)
    params = dict(top_k=8, top_p=0.9)
    mask = _truth_mask(problem, params)
    target = _targets_in(mask, seed=15)
    target[1, 2] = IGNORE
    support = padded_support(mask)
    chunks = tplogp.loss_chunk_budget(3, D, V, dtype=torch.float32, bias_dtype=torch.float32,
                                      source="native", device=torch.device("cpu"))
    g = torch.Generator().manual_seed(16)
    old = torch.randn(B, L, generator=g) * 0.1 - 2.0
    advantages = torch.randn(B, L, generator=g)
    for loss, per_token_inputs, extra in (
            (losses.cross_entropy() + losses.entropy_bonus(0.2), (), {}),
            (losses.grpo(loss_type="dapo"), (advantages, old), {"return_metrics": True})):
        results = []
        for given in (params, dict(support=support)):
            leaves = tuple(t.clone().requires_grad_() for t in problem)
            value = tplogp.linear_logp_loss(*leaves[:2], target, leaves[2], loss=loss,
                                            per_token=per_token_inputs, ignore_index=IGNORE,
                                            workspace_bytes=chunks, **extra, **given)
            value = value[0] if isinstance(value, tuple) else value
            value.backward()
            results.append((value.detach(), [t.grad for t in leaves]))
        (v1, g1), (v2, g2) = results
        torch.testing.assert_close(v1, v2, rtol=1e-6, atol=1e-6)
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ---- bad parameters ----------------------------------------------------------------------------

def _bad_cases():
    """``{case: (keyword arguments, pattern of the error)}``."""
    shape = (B, L)
    top_k_bad = torch.full(shape, 5)
    top_k_bad[1, 2] = -3
    top_p_bad = torch.full(shape, 0.5)
    top_p_bad[0, 4] = 0.0
    return {
        "top_k<-1": (dict(top_k=-2), r"top_k must be an int of at least -1"),
        "top_k-float": (dict(top_k=2.5), r"top_k must be an int"),
        "top_k-bool": (dict(top_k=True), r"top_k must be an int"),
        "top_p=0": (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
        "top_p>1": (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
        "top_p-nan": (dict(top_p=float("nan")), r"top_p must be a number in \(0, 1\]"),
        "min_p<0": (dict(min_p=-0.1), r"min_p must be a number in \[0, 1\]"),
        "min_p>1": (dict(min_p=2), r"min_p must be a number in \[0, 1\]"),
        "top_k-tensor-entry": (dict(top_k=top_k_bad),
                               r"top_k must be at least -1 .*token 8 holds -3"),
        "top_p-tensor-entry": (dict(top_p=top_p_bad),
                               r"top_p must be in \(0, 1\] .*token 4 holds 0"),
        "top_k-dtype": (dict(top_k=torch.full(shape, 5.0)), r"top_k must be a number or an integer "
                                                             r"tensor of target_ids' shape"),
        "top_p-shape": (dict(top_p=torch.full((N,), 0.5)),
                        r"top_p must be a number or a floating-point tensor of target_ids'"),
        "min_p-int": (dict(min_p=torch.zeros(shape, dtype=torch.int64)), r"min_p must be a number"),
        "with-support": (dict(top_k=4, support=torch.zeros(B, L, 1, dtype=torch.int64)),
                         r"support= and top_k= both give the sampler's support"),
        "tp-invariant": (dict(top_p=0.9, deterministic="tp_invariant"),
                         r"tp_invariant.*not implemented with top_k= / top_p= / min_p="),
    }


def test_bad_parameters_raise():
    """Each bad parameter is a LinearLogpInputError naming it; a good call follows."""
    hidden, weight, bias = _problem(seed=17)
    target = torch.zeros(B, L, dtype=torch.int64)
    for case, (kw, pattern) in _bad_cases().items():
        with pytest.raises(LinearLogpInputError, match=pattern):
            tplogp.linear_logp(hidden, weight, target, bias, **kw)
    with pytest.raises(LinearLogpInputError, match=r"label smoothing.*top_k= / top_p= / min_p="):
        tplogp.linear_logp_loss(hidden, weight, target, bias, top_k=3,
                                loss=losses.cross_entropy(label_smoothing=0.1))
    assert torch.isfinite(tplogp.linear_logp(hidden, weight, target, bias, top_k=V)).all()


def test_an_ignored_tokens_parameters_are_not_read():
    hidden, weight, bias = _problem(seed=18)
    target = torch.zeros(B, L, dtype=torch.int64)
    target[0, 4] = IGNORE
    top_p = torch.full((B, L), 0.5)
    top_p[0, 4] = 0.0  # (its token is ignored)
    out = tplogp.linear_logp(hidden, weight, target, bias, top_p=top_p, ignore_index=IGNORE)
    assert out[0, 4].item() == 0.0


# ---- tensor parallel ---------------------------------------------------------------------------

@pytest.fixture
def vocab_shards_size() -> int:
    return V


@pytest.mark.tp(world_size=[2, 4], timeout=300)
@pytest.mark.parametrize("case, dtype", [("all", "fp32"), ("per-token", "fp32"),
                                         ("top_p", "fp32"), ("top_p", "bf16")])
def test_tp_kept_ids_values_and_gradients(tp, vocab_shards, case, dtype, monkeypatch):
    """Over the ranks (uneven shards, one all_gather of candidates per round; a first round of
    one candidate per rank, so several): every rank keeps vLLM's ids, and the op's values and
    gradients are the float64 definition's (d_W / d_b: this rank's rows), with temperature,
    softcap and ignore_index; in bf16 each rank's forward takes its statistics from its ids'
    logits of the gathered candidates (``support_pairs.given_stats``)."""
    monkeypatch.setattr(sampler_module, "SLACK", 1)
    monkeypatch.setattr(sampler_module, "MIN_CANDIDATES", 1)
    monkeypatch.setattr(sampler_module, "GRID_CANDIDATES", 1)  # (top-p alone: not in one round)
    monkeypatch.setattr(sampler_module, "LOGITS_FRACTION", 1)
    taken = []
    real = support_pairs.given_stats
    monkeypatch.setattr(support_pairs, "given_stats",
                        lambda *args: taken.append(1) or real(*args))
    seen = _rounds(monkeypatch)
    problem = _problem(seed=20)
    if dtype == "bf16":
        problem = tuple(t.to(torch.bfloat16) for t in problem)
    hidden, weight, bias = problem
    vs = vocab_shards
    params = _params(case)
    kw = dict(temperature=0.5, softcap=6.0)
    truth = _truth_mask(problem, params, **kw)
    ours = _our_mask(problem, params, **kw, group=tp.group, vocab_start=vs.start,
                     weight=vs.shard(weight), bias=vs.shard(bias))
    found = [_mismatch(ours, truth)] if _mismatch(ours, truth) else []
    if case == "top_p" and len(seen) < 2:
        found.append(f"one round only: {seen}")
    target = _targets_in(truth, seed=21)
    target[1, 1] = IGNORE
    leaves = (hidden.clone().requires_grad_(), vs.shard(weight).clone().requires_grad_(),
              vs.shard(bias).clone().requires_grad_())
    out = tplogp.linear_logp(leaves[0], leaves[1], target, leaves[2], tp_group=tp.group,
                             vocab_start_index=vs.start, global_vocab_size=V,
                             return_entropy=True, return_lse=True, ignore_index=IGNORE, **params,
                             **kw)
    found += _compare(out, leaves, problem, target, padded_support(truth),
                      rows=slice(vs.start, vs.end), ignore_index=IGNORE,
                      dtype=problem[0].dtype, **kw)
    if bool(taken) != (dtype == "bf16"):
        found.append(f"the sampler's logits taken {len(taken)} times")
    tp.assert_all(not found, "; ".join(found))


@pytest.mark.tp(world_size=[2, 4], timeout=300)
@pytest.mark.parametrize("case", ["top_p", "min_p", "per-token"])
def test_tp_support_on_one_rank(tp, vocab_shards, case, monkeypatch):
    """Every token's support lies in ids 0, 1, 2 (rank 0's): the other ranks collect nothing in
    the rounds after the first (one candidate per rank to start), and every rank keeps the
    definition's ids."""
    monkeypatch.setattr(sampler_module, "SLACK", 1)
    monkeypatch.setattr(sampler_module, "MIN_CANDIDATES", 1)
    monkeypatch.setattr(sampler_module, "GRID_CANDIDATES", 1)  # (top-p alone: not in one round)
    seen = _rounds(monkeypatch)
    hidden, weight, bias = _problem(seed=26)
    bias = bias.clone()
    bias[:3] += torch.tensor([30.0, 29.5, 29.5])
    problem = (hidden, weight, bias)
    vs = vocab_shards
    params = _params(case)
    truth = _truth_mask(problem, params)
    ours = _our_mask(problem, params, group=tp.group, vocab_start=vs.start,
                     weight=vs.shard(weight), bias=vs.shard(bias), workspace_bytes=1)
    found = [_mismatch(ours, truth)] if _mismatch(ours, truth) else []
    if not truth.reshape(N, V)[:, 3:].logical_not().all() and case != "per-token":
        found.append("a token's support reaches past id 2")
    if len(seen) < 2 and case != "per-token":  # (per token: top-k's candidates settle it)
        found.append(f"one round only: {seen}")
    everyone = tp.all_gather_object(ours.reshape(N, V).nonzero().tolist())
    found += [] if all(o == everyone[0] for o in everyone) else ["the ranks' supports differ"]
    tp.assert_all(not found, "; ".join(found))


@pytest.mark.tp(world_size=[2, 4], timeout=300)
def test_tp_sequence_parallel_and_fused_loss(tp, vocab_shards):
    """``sequence_parallel=True`` (this rank's slice of hidden, the parameters of all tokens; an
    ignored token, kept in place, whose parameter is not valid and not read) and the fused loss
    over the ranks: the single-process op's values and gradients."""
    problem = _problem(seed=22)
    hidden, weight, bias = problem
    vs = vocab_shards
    top_p = torch.full((B, L), 0.9)
    params = dict(top_k=6, min_p=0.05, top_p=top_p)
    target = _targets_in(_truth_mask(problem, params), seed=23)
    target[1, 3], top_p[1, 3] = IGNORE, 0.0
    single = tplogp.linear_logp(hidden, weight, target, bias, return_entropy=True,
                                ignore_index=IGNORE, **params)
    rows = hidden.reshape(N, D).chunk(tp.world_size)[tp.rank]
    out = tplogp.linear_logp(rows, vs.shard(weight), target.reshape(-1), vs.shard(bias),
                             tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=V,
                             return_entropy=True, sequence_parallel=True, ignore_index=IGNORE,
                             **{k: v.reshape(-1) if isinstance(v, torch.Tensor) else v
                                for k, v in params.items()})
    ok = torch.allclose(out.logp, single.logp.reshape(-1), rtol=1e-5, atol=1e-5)
    h = hidden.clone().requires_grad_()
    w, b = (vs.shard(t).clone().requires_grad_() for t in (weight, bias))
    loss = losses.cross_entropy()
    value = tplogp.linear_logp_loss(h, w, target, b, loss=loss, tp_group=tp.group,
                                    vocab_start_index=vs.start, global_vocab_size=V,
                                    ignore_index=IGNORE, **params)
    value.backward()
    leaves = tuple(t.clone().requires_grad_() for t in problem)
    eager = -tplogp.linear_logp(*leaves[:2], target, leaves[2], ignore_index=IGNORE,
                                **params).sum()
    d_h, d_w, d_b = torch.autograd.grad(eager, leaves)
    ok = ok and torch.allclose(value, eager.detach(), rtol=1e-5, atol=1e-5)
    ok = ok and torch.allclose(h.grad, d_h, rtol=1e-4, atol=1e-6)
    ok = ok and torch.allclose(w.grad, d_w[vs.start:vs.end], rtol=1e-4, atol=1e-6)
    ok = ok and torch.allclose(b.grad, d_b[vs.start:vs.end], rtol=1e-4, atol=1e-6)
    tp.assert_all(ok, "sequence-parallel / fused loss with the sampler's parameters differ")


@pytest.mark.tp(world_size=[2, 4], timeout=300)
def test_tp_bad_parameters_raise_on_every_rank(tp, vocab_shards):
    """Each bad parameter raises the same LinearLogpInputError on every rank, a bad value on one
    rank only and parameters given on some ranks only too; a good call follows each."""
    hidden, weight, bias = _problem(seed=24)
    vs = vocab_shards
    w, b = vs.shard(weight), vs.shard(bias)
    target = torch.zeros(B, L, dtype=torch.int64)
    cases = [(case, kw, pattern) for case, (kw, pattern) in _bad_cases().items()]
    cases.append(("one-rank-value", dict(top_p=0.0 if tp.rank == 1 else 0.5),
                  r"rank 1: top_p must be a number in \(0, 1\]"))
    cases.append(("some-ranks", dict(top_k=4) if tp.rank == 0 else dict(),
                  r"the sampler's parameters .* must be the same on every TP rank, got rank 0: "
                  r"given, rank 1: none"))
    outcome = []
    for case, kw, pattern in cases:
        try:
            tplogp.linear_logp(hidden, w, target, b, tp_group=tp.group,
                               vocab_start_index=vs.start, global_vocab_size=V, **kw)
            outcome.append(f"{case}: no error")
        except LinearLogpInputError as exc:
            outcome.append(f"{case}: ok" if re.search(pattern, str(exc)) else f"{case}: {exc}")
        good = tplogp.linear_logp(hidden, w, target, b, tp_group=tp.group,
                                  vocab_start_index=vs.start, global_vocab_size=V, min_p=1e-30)
        if not torch.isfinite(good).all():
            outcome.append(f"{case}: the next call is not finite")
    everyone = tp.all_gather_object(outcome)
    tp.assert_all(all(o == everyone[0] for o in everyone), str(everyone))
    tp.assert_all(all(o.endswith(": ok") for o in outcome), str(outcome))


@pytest.mark.parametrize("case", ["min_p", "top_p-min_p", "per-token"])
def test_min_p_rows_collect_above_their_max_in_the_first_round(case, monkeypatch):
    """Rows with min-p and no top-k take no ``topk`` in the first round: they collect the ids at
    least their running max plus ``log(min_p)`` (the other rows take their largest logits); the
    kept ids are the definition's."""
    calls = []
    real_largest, real_collect = sampler_passes._largest, sampler_passes._collect

    def largest(out, h, *args):
        calls.append(("largest", h.shape[0]))
        return real_largest(out, h, *args)

    def collect(out, h, *args, offset=None, **kw):
        calls.append(("above" if offset is not None else "edge", h.shape[0]))
        return real_collect(out, h, *args, offset=offset, **kw)

    monkeypatch.setattr(sampler_passes, "_largest", largest)
    monkeypatch.setattr(sampler_passes, "_collect", collect)
    problem, params = _problem(seed=5), _params(case)
    ours, truth = _our_mask(problem, params), _truth_mask(problem, params)
    assert not _mismatch(ours, truth), _mismatch(ours, truth)
    first = [c for c in calls if c[0] != "edge"][:2]
    if case == "per-token":  # (rows with a top-k, or min-p off, take their largest)
        k, min_p = params["top_k"].reshape(-1), params["min_p"].reshape(-1)
        by_min_p = int((((k <= 0) | (k >= V)) & (min_p > 0)).sum())  # (k >= V: off)
        assert first[0] == ("above", by_min_p) and first[1][0] == "largest", calls
    else:
        assert first[0] == ("above", N) and all(c[0] != "largest" for c in calls), calls
