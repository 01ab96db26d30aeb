"""``losses.grpo(...)`` through ``linear_logp_loss`` against its written definition in float64 eager
PyTorch (tests/support/grpo_reference.py): the loss, its metrics and every gradient (hidden, weight,
bias), for each loss type, importance-sampling level, clip variant, KL estimator and rollout
correction; with ignored positions, a sequence with no counted token, packed sequences
(``cu_seqlens``), several chunks (the two-phase schedule of the sequence-level losses), on one
process and on 2 and 4 gloo ranks with uneven vocab shards."""

from __future__ import annotations

import pytest
import torch

import tplogp
from tests.support.grpo_reference import check_three_way, definition, logp_of, per_token_inputs
from tests.support.problems import cpu_sources
from tplogp import losses

IGNORE = -100
CPU = torch.device("cpu")


def _problem(b: int, l: int, d: int, v: int, seed: int, empty_row: bool = False):
    """hidden ``[b, l, d]``, weight, bias, targets ``[b, l]`` with trailing padding of uneven length
    (ignored) and a few ignored positions inside; ``empty_row``: row 2 ignored entirely."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, l, d, generator=g) * 0.7
    weight = torch.randn(v, d, generator=g) / d ** 0.5
    bias = torch.randn(v, generator=g) * 0.1
    target = torch.randint(0, v, (b, l), generator=g)
    for row in range(b):
        target[row, l - (row % 3):] = IGNORE
    target[0, 1] = IGNORE
    if empty_row:
        target[2] = IGNORE
    return hidden, weight, bias, target


def _inputs(loss, hidden, weight, bias, target, seed, temperature=1.0, spread=0.3):
    with torch.no_grad():
        logp, _ = logp_of(hidden, weight, bias, target, temperature, IGNORE)
    given = per_token_inputs(target, logp, seed, spread, sampler=True, weights=True)
    return [given[name] for name in loss.per_token]


def _truth_and_reference(loss, hidden, weight, bias, target, per_token, temperature=1.0,
                         offsets=None):
    """The written definition in float64 (the truth) and in fp32 (the same-dtype eager
    reference)."""
    return tuple(definition(loss, hidden, weight, bias, target, per_token, temperature=temperature,
                            ignore_index=IGNORE, offsets=offsets,
                            dtype=dt) for dt in (torch.float64, torch.float32))


def _ours(loss, hidden, weight, bias, target, per_token, **kw):
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    value, metrics = tplogp.linear_logp_loss(h, w, target, b, loss=loss, per_token=per_token,
                                             ignore_index=IGNORE, return_metrics=True, **kw)
    value.backward()
    return value.detach(), metrics, (h.grad, w.grad, b.grad)


# Each loss type at its importance-sampling levels, with the options that change its formula; KL to
# a reference on most (its estimator and bias correction vary), rollout corrections on a few. One
# small shape: 4 sequences of 9 tokens, D 16, V 97 (ratios on both sides of the clip range,
# mixed-sign and zero advantages).
CASES = {
    "grpo-token-kl3": dict(loss_type="grpo", beta=0.04),
    "grpo-gspo-kl3": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    "bnpo-delta-k2": dict(loss_type="bnpo", delta=1.5, beta=0.1, kl_estimator="k2",
                          epsilon_high=0.28),
    "dr_grpo-dual-k1": dict(loss_type="dr_grpo", max_completion_length=12, clip_ratio_c=1.5,
                            beta=0.1, kl_estimator="k1"),
    "dapo-items-tis": dict(loss_type="dapo", num_items_in_batch=40.0, epsilon_high=0.28,
                           rollout_correction="token_truncate", rollout_clip_max=1.6),
    "dapo-gspo_token-biaskl": dict(loss_type="dapo", importance_sampling_level="sequence_token",
                                   beta=0.1, bias_corrected_kl=True),
    "grpo-gspo-biaskl-seqmis": dict(loss_type="grpo", importance_sampling_level="sequence",
                                    beta=0.1, bias_corrected_kl=True,
                                    rollout_correction="sequence_mask", rollout_clip_min=0.2,
                                    rollout_clip_max=3.0),
    "cispo-weights": dict(loss_type="cispo", epsilon_high=1.1, rollout_correction="weights",
                          beta=0.04),
    "sapo-kl-entropy": dict(loss_type="sapo", beta=0.04, entropy_coef=0.01),
    "luspo-gspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo-tokenmask": dict(loss_type="vespo", rollout_correction="token_mask",
                            rollout_clip_max=2.0, beta=0.04),
    "bnpo-onpolicy": dict(loss_type="bnpo", with_old_logp=False, beta=0.04),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_loss_matches_its_definition(case):
    loss = losses.grpo(**CASES[case])
    hidden, weight, bias, target = _problem(4, 9, 16, 97, seed=3)
    per_token = _inputs(loss, hidden, weight, bias, target, seed=4, temperature=0.9)
    truth, ref = _truth_and_reference(loss, hidden, weight, bias, target, per_token,
                                      temperature=0.9)
    ours = _ours(loss, hidden, weight, bias, target, per_token, temperature=0.9, source="native")
    check_three_way(ours, ref, truth, case)


@pytest.mark.parametrize("case", ["grpo-gspo-kl3", "vespo-tokenmask", "dapo-items-tis"])
def test_several_chunks_and_a_sequence_with_no_counted_token(case):
    """Chunks of 5 tokens: the sequence-level losses run their two phases (every chunk's forward
    first), the token-level one its chunk loop; row 2 has no counted token (it counts in the batch
    size, adds 0)."""
    loss = losses.grpo(**CASES[case])
    hidden, weight, bias, target = _problem(4, 9, 16, 97, seed=5, empty_row=True)
    per_token = _inputs(loss, hidden, weight, bias, target, seed=6)
    truth, ref = _truth_and_reference(loss, hidden, weight, bias, target, per_token)
    budget = tplogp.loss_chunk_budget(5, 16, 97, dtype=torch.float32, bias_dtype=torch.float32,
                                      source="native", device=CPU)
    ours = _ours(loss, hidden, weight, bias, target, per_token, source="native",
                 workspace_bytes=budget)
    check_three_way(ours, ref, truth, case)


@pytest.mark.parametrize("case", ["grpo-gspo-biaskl-seqmis", "luspo-gspo", "sapo-kl-entropy"])
def test_packed_sequences(case):
    """Packed input: 1-D tokens with ``cu_seqlens`` (sequences of 7, 1, 12 and 4 tokens, one of them
    with ignored positions), against the definition on the sequences padded to rows."""
    loss = losses.grpo(**CASES[case])
    offsets = [0, 7, 8, 20, 24]
    hidden, weight, bias, target = _problem(1, 24, 16, 97, seed=7)
    hidden, target = hidden[0], target[0]
    target[13:15] = IGNORE
    per_token = [t[0] for t in _inputs(loss, hidden[None], weight, bias, target[None], seed=8)]
    truth, ref = _truth_and_reference(loss, hidden, weight, bias, target, per_token,
                                      offsets=offsets)
    ours = _ours(loss, hidden, weight, bias, target, per_token, source="native",
                 cu_seqlens=torch.tensor(offsets, dtype=torch.int32))
    check_three_way(ours, ref, truth, case)


def test_offsets_are_read_only_by_losses_with_sequences(monkeypatch):
    """``cu_seqlens`` is read to the host (a sync for a device tensor) only by a loss with
    per-sequence terms; a token-mean loss never uses the offsets and gives the same value and
    gradients with or without them."""
    offsets = [0, 7, 8, 20, 24]
    hidden, weight, bias, target = _problem(1, 24, 16, 97, seed=7)
    hidden, target = hidden[0], target[0]
    reads = []
    tolist = torch.Tensor.tolist

    def spy(self):
        reads.append(self is cu)
        return tolist(self)

    for loss_type, want in (("dapo", 0), ("grpo", 1)):
        loss = losses.grpo(loss_type)
        per_token = [t[0] for t in _inputs(loss, hidden[None], weight, bias, target[None], seed=8)]
        cu = torch.tensor(offsets, dtype=torch.int32)
        reads.clear()
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "tolist", spy)
            packed = _ours(loss, hidden, weight, bias, target, per_token, source="native",
                           cu_seqlens=cu)
        assert sum(reads) == want, (loss_type, reads)  # host reads of cu_seqlens itself
        if loss_type == "dapo":
            plain = _ours(loss, hidden, weight, bias, target, per_token, source="native")
            assert torch.equal(packed[0], plain[0]) and packed[1].keys() == plain[1].keys()
            assert all(torch.equal(packed[1][k], plain[1][k]) for k in plain[1])
            assert all(torch.equal(a, b) for a, b in zip(packed[2], plain[2]))
    with pytest.raises(tplogp.LinearLogpInputError,
                       match="cu_seqlens must be a 1-D integer tensor"):
        _ours(losses.grpo("dapo"), hidden, weight, bias, target, per_token, source="native",
              cu_seqlens=torch.tensor([0.0, 24.0]))


@pytest.mark.parametrize("source", cpu_sources())
def test_gspo_on_each_source(monkeypatch, source):
    """GSPO with KL and a rollout correction on each CPU source (triton through its interpreter),
    its 3 sequences of 5, 5 and 4 counted tokens in chunks of 5 tokens: each chunk holds whole
    sequences, so each chunk's backward reads its own kept terms (3 chunks, no recompute); in chunks
    of 4 tokens, shorter than a sequence: the two phases, the first chunk's backward reading its
    kept terms and the 3 others recomputing their logits (the launches counted on triton)."""
    seen = {"recompute": 0, "kept": 0}
    if source == "triton":
        from tplogp.kernels import backward_programs

        for name, key in (("launch_dlogits", "recompute"), ("launch_dlogits_kept", "kept")):
            real = getattr(backward_programs, name)
            monkeypatch.setattr(backward_programs, name, lambda *a, real=real, key=key, **o: (
                seen.__setitem__(key, seen[key] + 1), real(*a, **o))[1])
    loss = losses.grpo("dapo", importance_sampling_level="sequence", beta=0.04,
                       rollout_correction="token_truncate")
    hidden, weight, bias, target = _problem(3, 6, 16, 67, seed=9)
    per_token = _inputs(loss, hidden, weight, bias, target, seed=10)
    truth, ref = _truth_and_reference(loss, hidden, weight, bias, target, per_token)
    for chunk, launches in ((5, {"recompute": 0, "kept": 3}), (4, {"recompute": 3, "kept": 1})):
        budget = tplogp.loss_chunk_budget(chunk, 16, 67, dtype=torch.float32,
                                          bias_dtype=torch.float32, source=source, device=CPU)
        ours = _ours(loss, hidden, weight, bias, target, per_token, source=source,
                     workspace_bytes=budget)
        check_three_way(ours, ref, truth, f"{source} chunks of {chunk}")
        if source == "triton":
            assert seen == launches, (chunk, seen)
            seen.update(recompute=0, kept=0)


@pytest.mark.tp(world_size=2, timeout=300)
@pytest.mark.parametrize("case", ["grpo-gspo-biaskl-seqmis", "vespo-tokenmask", "dr_grpo-dual-k1"])
def test_uneven_ranks(tp, case):
    """2 ranks holding 40 and 57 rows of the vocabulary (uneven): each rank's loss, metrics and
    gradients are the float64 definition's (its weight rows' share), the same loss and metrics on
    both ranks; chunks of 5 tokens."""
    _check_on_ranks(tp, CASES[case], [0, 40, 97], case, packed=False)


# 4 ranks holding 1, 29, 32 and 35 rows (one shard of a single row: a rank that owns almost no
# target); each
# case a different path: packed sequences in chunks of 5 tokens, shorter than some sequences (GSPO:
# the two phases), and in chunks of 12 tokens, each holding whole sequences (VESPO's sequence
# weights chunk by chunk); the entropy's gradient with the per-sequence normalisation (SAPO); a
# token-level loss with a given global token count (DAPO's num_items_in_batch, a tensor) and TIS.
# (case, packed, tokens per chunk)
FOUR_RANK_CASES = {"packed-gspo": ("grpo-gspo-biaskl-seqmis", True, 5),
                   "packed-vespo": ("vespo-tokenmask", True, 12),
                   "sapo-entropy": ("sapo-kl-entropy", False, 5),
                   "dapo-items": ("dapo-items-tis", False, 5)}


@pytest.mark.tp(world_size=4, timeout=300)
@pytest.mark.parametrize("case", list(FOUR_RANK_CASES))
def test_four_uneven_ranks(tp, case):
    """4 ranks with uneven shards, ignored positions and chunks of 5 tokens: every rank's loss,
    metrics and gradients are the float64 definition's, the loss and metrics the same on every
    rank."""
    name, packed, chunk = FOUR_RANK_CASES[case]
    options = dict(CASES[name])
    if "num_items_in_batch" in options:  # a global count handed over as a tensor, as trainers do
        options["num_items_in_batch"] = torch.tensor(options["num_items_in_batch"])
    _check_on_ranks(tp, options, [0, 1, 30, 62, 97], case, packed=packed, chunk=chunk)


def _check_on_ranks(tp, options: dict, boundaries: list[int], what: str, packed: bool,
                    chunk: int = 5) -> None:
    """``losses.grpo(**options)`` with this rank's shard of ``boundaries`` against the float64
    definition (this rank's rows of the weight and bias gradients), and the loss and metrics equal
    on every rank. ``packed``: the tokens as one 1-D sequence with ``cu_seqlens`` (sequences of 7,
    1, 12, 4 and 12 tokens); ``chunk``: tokens per chunk."""
    from tplogp.support.shards import shard_range

    v = boundaries[-1]
    loss = losses.grpo(**options)
    hidden, weight, bias, target = _problem(4, 9, 16, v, seed=11)
    per_token = _inputs(loss, hidden, weight, bias, target, seed=12)
    offsets, kw = None, {}
    if packed:
        offsets = [0, 7, 8, 20, 24, 36]
        hidden, target = hidden.reshape(-1, 16), target.reshape(-1)
        per_token = [t.reshape(-1) for t in per_token]
        kw["cu_seqlens"] = torch.tensor(offsets)
    truth, ref = _truth_and_reference(loss, hidden, weight, bias, target, per_token,
                                      offsets=offsets)
    start, end = shard_range(boundaries, tp.rank)
    budget = tplogp.loss_chunk_budget(chunk, 16, v, dtype=torch.float32, bias_dtype=torch.float32,
                                      source="native", device=CPU)
    value, metrics, grads = _ours(loss, hidden, weight[start:end], bias[start:end], target,
                                  per_token, tp_group=tp.group, vocab_start_index=start,
                                  global_vocab_size=v, source="native", workspace_bytes=budget,
                                  **kw)

    def own(result):  # this rank's rows of the weight and bias gradients
        d_h, d_w, d_b = result[2]
        return result[0], result[1], (d_h, d_w[start:end], d_b[start:end])

    with tp.agree():
        check_three_way((value, metrics, grads), own(ref), own(truth), f"{what} rank {tp.rank}")
        same = torch.stack([value, *metrics.values()])
        gathered = [torch.empty_like(same) for _ in range(tp.world_size)]
        torch.distributed.all_gather(gathered, same, group=tp.group)
        assert all(torch.equal(x, gathered[0]) for x in gathered), "loss and metrics differ between ranks"


def test_errors_name_the_fix():
    hidden, weight, bias, target = _problem(2, 5, 8, 31, seed=1)
    gspo = losses.grpo("grpo", importance_sampling_level="sequence")
    per_token = _inputs(gspo, hidden, weight, bias, target, seed=2)
    with pytest.raises(ValueError, match="reduction='sum'"):
        tplogp.linear_logp_loss(hidden, weight, target, bias, loss=gspo, per_token=per_token,
                                reduction="mean", ignore_index=IGNORE)
    with pytest.raises(ValueError, match="cu_seqlens"):  # one sequence per row needs rows
        tplogp.linear_logp_loss(hidden.reshape(-1, 8), weight, target.reshape(-1), bias, loss=gspo,
                                per_token=[t.reshape(-1) for t in per_token], ignore_index=IGNORE)
    with pytest.raises(tplogp.LinearLogpInputError, match="cu_seqlens must be nondecreasing"):
        tplogp.linear_logp_loss(hidden.reshape(-1, 8), weight, target.reshape(-1), bias, loss=gspo,
                                per_token=[t.reshape(-1) for t in per_token],
                                cu_seqlens=[0, 6, 4, 10], ignore_index=IGNORE)
    with pytest.raises(ValueError, match=r"per_token=\(advantages, old_logp\): 2 tensors, got 1"):
        tplogp.linear_logp_loss(hidden, weight, target, bias, loss=gspo, per_token=per_token[:1],
                                ignore_index=IGNORE)
    with pytest.raises(ValueError, match="return_metrics is an option of the losses.grpo"):
        tplogp.linear_logp_loss(hidden, weight, target, bias, loss=losses.cross_entropy(),
                                return_metrics=True, ignore_index=IGNORE)
    with pytest.raises(ValueError, match="max_completion_length"):
        losses.grpo("dr_grpo")
    with pytest.raises(ValueError, match="importance_sampling_level='token'"):
        losses.grpo("cispo", importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        losses.grpo("ppo")


@pytest.mark.parametrize("build, message", [
    (lambda: losses.grpo(epsilon_low=-0.1), r"epsilon_low must be a finite number >= 0, got -0.1"),
    (lambda: losses.grpo(epsilon_high=-1.0),
     r"epsilon_high must be a finite number >= 0, got -1.0"),
    (lambda: losses.grpo(epsilon_low=float("nan")),
     r"epsilon_low must be a finite number >= 0, got nan"),
    (lambda: losses.grpo(delta=0.0), r"delta must be a finite number > 0 or None, got 0.0"),
    (lambda: losses.grpo(delta=-2.0), r"delta must be a finite number > 0 or None, got -2.0"),
    (lambda: losses.grpo(delta="4"), r"delta must be a finite number > 0 or None, got '4'"),
    (lambda: losses.grpo(beta=-0.04), r"beta must be a finite number >= 0, got -0.04"),
    (lambda: losses.grpo(entropy_coef=float("inf")),
     r"entropy_coef must be a finite number, got inf"),
    (lambda: losses.grpo("vespo", vespo_k_pos=0),
     r"vespo_k_pos must be a finite number > 0 or None, got 0"),
    (lambda: losses.grpo(rollout_correction="token_truncate", rollout_clip_min=-1.0),
     r"rollout_clip_min must be a finite number >= 0 or None, got -1.0"),
    (lambda: losses.grpo(rollout_correction="token_mask", rollout_clip_min=4.0,
                         rollout_clip_max=2.0),
     r"rollout_clip_min \(4.0\) must be at most rollout_clip_max \(2.0\)"),
    (lambda: losses.grpo("dr_grpo", max_completion_length=0),
     r"max_completion_length must be a positive int"),
    (lambda: losses.grpo("dr_grpo", max_completion_length=2.5),
     r"max_completion_length must be a positive int"),
    (lambda: losses.grpo(num_items_in_batch=-3),
     r"num_items_in_batch must be a finite number >= 0, got -3"),
    (lambda: losses.grpo(with_old_logp="yes"), r"with_old_logp must be a bool, got 'yes'"),
    (lambda: losses.grpo("sapo", sapo_temperature_neg=-1.0),
     r"sapo_temperature_neg must be a finite number > 0"),
    (lambda: losses.grpo("ppo"), r"loss_type must be one of \('grpo', "),
    (lambda: losses.ppo_clip(-0.2, 0.2), r"eps_low must be a finite number >= 0, got -0.2"),
    (lambda: losses.ppo_clip(0.2, float("nan")), r"eps_high must be a finite number >= 0, got nan"),
    (lambda: losses.kl_to_reference(-0.1),
     r"kl_to_reference's coef must be a finite number >= 0, got -0.1"),
    (lambda: losses.entropy_bonus(None), r"entropy_bonus's coef must be a finite number, got None"),
    (lambda: losses.z_loss(float("inf")), r"z_loss's coef must be a finite number, got inf"),
    (lambda: losses.cross_entropy(label_smoothing=1.5),
     r"label_smoothing must be a float in \[0, 1\], got 1.5"),
], ids=lambda x: "" if callable(x) else x.split(" must")[0].replace("\\", ""))
def test_loss_options_that_cannot_be_right_are_refused_at_construction(build, message):
    """A loss's options are checked where the loss is built (every rank builds it alike; options
    that differ between ranks are the group record's: tests/loss/test_loss_checks.py)."""
    with pytest.raises(ValueError, match=message):
        build()


def test_loss_options_at_their_bounds_are_accepted():
    losses.grpo(epsilon_low=0.0, epsilon_high=0.0, beta=0.0, num_items_in_batch=torch.tensor(12.0))
    losses.grpo("cispo", epsilon_high=5.0, entropy_coef=-0.01)
    losses.grpo(rollout_correction="token_truncate", rollout_clip_min=0.0, rollout_clip_max=0.0)
    losses.ppo_clip(0.0, 0.0), losses.kl_to_reference(0.0), losses.entropy_bonus(-0.5)
