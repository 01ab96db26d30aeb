"""Liger-Kernel's GRPO loss cases (its ``test/chunked_loss/test_grpo_loss.py``), re-created through
``linear_logp_loss`` with ``losses.grpo(...)`` alone: its loss types, importance-sampling levels,
``delta``, KL and temperature settings, reference and old log-probs given or not, bias, the
bias-corrected KL, ``vllm_is_ratio`` and ``num_items_in_batch``, at Liger's small shape
``B, T, H, V = 3, 47, 31, 123`` with its random padding mask, against the float64 definition
(tests/support/grpo_reference.py) with the table's bounds.

Liger's options map onto tplogp's: ``old_per_token_logps=None`` is ``with_old_logp=False``; a
reference model without given log-probs is ``ref_logp`` from the reference head;
``use_ref_model=False`` (KL to the policy itself: 0, with no gradient) is ``beta=0``;
``vllm_is_ratio`` is ``rollout_correction="weights"``; ``dr_grpo``'s ``max_completion_length`` is
``T``. The full product of the axes is marked slow; the inner loop runs each loss type at each level
once, the other axes rotated over those cases."""

from __future__ import annotations

import itertools

import pytest
import torch

import tplogp
from tests.support import tolerances as tol
from tests.support.grpo_reference import check_three_way, definition, logp_of
from tplogp import losses
from tplogp.tolerances import rel_error

IGNORE = -100
B, T, H, V = 3, 47, 31, 123
LEVELS = {"token": ("bnpo", "grpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo"),
          "sequence": ("bnpo", "grpo", "dr_grpo", "dapo", "luspo")}  # Liger's valid pairs
# beta, epsilon_low, epsilon_high, temperature
SETTINGS = [(0.1, 0.2, 0.2, 1.0), (0.0, 0.1, 0.1, 2.0)]
# use_ref_model, ref logps given, old given
REFS = [(True, True, True), (True, False, False), (False, False, True)]


def _case(seed, loss_type, level, delta, setting, refs, bias, bias_kl=False, vllm=False,
          items=None):
    """Liger's inputs for one case; the fused loss and the float64 definition's loss, metrics and
    gradients."""
    beta, eps_low, eps_high, temperature = setting
    use_ref, ref_given, old_given = refs
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, H, generator=g)
    b = torch.randn(V, generator=g) if bias else torch.zeros(V)
    ref_weight = weight + 0.01 * torch.randn(V, H, generator=g)
    ref_bias = b + 0.01 * torch.randn(V, generator=g)
    hidden = torch.randn(B, T, H, generator=g)
    target = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B * T)
    mask[torch.randperm(B * T, generator=g)[:int(torch.randint(1, B * T // 2, (1,),
                                                               generator=g))]] = 0
    target = torch.where(mask.view(B, T) > 0, target, IGNORE)
    adv = torch.randn(B, generator=g)
    adv[0], adv[1] = -adv[0].abs(), adv[1].abs()
    with torch.no_grad():
        logp, _ = logp_of(hidden, weight, b, target, temperature, IGNORE)
        ref_input = hidden + 0.01 * torch.randn(B, T, H, generator=g)
        ref_model_logp, _ = logp_of(ref_input, ref_weight, ref_bias, target, temperature, IGNORE)
    named = {"advantages": adv[:, None].expand(B, T).contiguous()}
    if old_given:
        named["old_logp"] = logp.float() + 0.01 * torch.randn(B, T, generator=g)
    if use_ref and beta:
        named["ref_logp"] = (logp.float() + 0.01 * torch.randn(B, T, generator=g) if ref_given
                             else ref_model_logp.float())
    if vllm:
        named["rollout_weights"] = torch.rand(B, T, generator=g) * 0.999 + 0.001
    loss = losses.grpo(loss_type, importance_sampling_level=level, epsilon_low=eps_low,
                       epsilon_high=eps_high, delta=delta, beta=beta if use_ref else 0.0,
                       bias_corrected_kl=bias_kl,
                       max_completion_length=T if loss_type == "dr_grpo" else None,
                       with_old_logp=old_given, rollout_correction="weights" if vllm else None,
                       num_items_in_batch=items)
    per_token = [named[name] for name in loss.per_token]

    truth, reference = (definition(loss, hidden, weight, b if bias else None, target, per_token,
                                   temperature=temperature, ignore_index=IGNORE, dtype=dt)
                        for dt in (torch.float64, torch.float32))

    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b2 = b.clone().requires_grad_() if bias else None
    ours_value, ours_metrics = tplogp.linear_logp_loss(h2, w2, target, b2, loss=loss,
                                                       per_token=per_token, temperature=temperature,
                                                       ignore_index=IGNORE, return_metrics=True,
                                                       source="native")
    ours_value.backward()
    ours = (ours_value.detach(), ours_metrics, (h2.grad, w2.grad, b2.grad if bias else None))
    return ours, reference, truth, float((target != IGNORE).sum())


def _grid():
    for level, types in LEVELS.items():
        for loss_type in types:
            deltas = (None, 2.0) if loss_type not in ("cispo", "sapo", "vespo") else (None,)
            for delta, setting, refs, bias in itertools.product(deltas, SETTINGS, REFS,
                                                                (True, False)):
                yield loss_type, level, delta, setting, refs, bias


def _param(args):
    loss_type, level, delta, setting, refs, bias = args
    name = (f"{loss_type}-{level}-delta{delta}-beta{setting[0]}-T{setting[3]}-"
            f"ref{int(refs[0])}{int(refs[1])}-old{int(refs[2])}-{'bias' if bias else 'nobias'}")
    return pytest.param(*args, id=name)


# the inner loop: each (loss type, level) pair once, delta / settings / references / bias rotated
# over the pairs so that every value of each axis is run
INNER = []
for i, (level, loss_type) in enumerate((lv, lt) for lv, types in LEVELS.items() for lt in types):
    delta = (None, 2.0)[i % 2] if loss_type not in ("cispo", "sapo", "vespo") else None
    INNER.append(_param((loss_type, level, delta, SETTINGS[i % 2], REFS[i % 3], i % 2 == 0)))
INNER_IDS = {p.id for p in INNER}
FULL = [p for p in map(_param, _grid()) if p.id not in INNER_IDS]


@pytest.mark.parametrize("loss_type, level, delta, setting, refs, bias", INNER)
def test_liger_correctness_cases(loss_type, level, delta, setting, refs, bias):
    check_three_way(*_case(20, loss_type, level, delta, setting, refs, bias)[:3],
                    f"{loss_type} {level}")


@pytest.mark.slow
@pytest.mark.parametrize("loss_type, level, delta, setting, refs, bias", FULL)
def test_liger_correctness_full_grid(loss_type, level, delta, setting, refs, bias):
    check_three_way(*_case(21, loss_type, level, delta, setting, refs, bias)[:3],
                    f"{loss_type} {level}")


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_liger_bias_correction_kl(loss_type, level):
    """Liger's ``use_bias_correction_kl`` cases: KL x the importance ratio of the level (its
    sequence ratio at the sequence level), reference log-probs from the reference head."""
    case = _case(22, loss_type, level, None, (0.1, 0.2, 0.2, 1.0), (True, False, True), False,
                 bias_kl=True)
    check_three_way(*case[:3], f"{loss_type} {level}")


@pytest.mark.parametrize("loss_type", ["bnpo", "grpo", "dapo", "cispo", "sapo", "vespo"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_liger_vllm_is_ratio(loss_type, beta):
    """Liger's ``vllm_is_ratio`` cases: per-token rollout weights in (0, 1] multiply the policy term
    (vespo: folded into its sequence weight in log space), before the KL term."""
    case = _case(23, loss_type, "token", None, (beta, 0.2, 0.2, 1.0), (True, True, False), False,
                 vllm=True)
    check_three_way(*case[:3], f"{loss_type} beta {beta}")


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_liger_num_items_in_batch(loss_type):
    """Liger's ``num_items_in_batch`` cases: the token-mean divisor given; the counted tokens give
    the default's loss and gradients, 1.7 x them scale the loss and every gradient by 1 / 1.7."""
    args = (24, loss_type, "token", None, (0.0, 0.2, 0.2, 1.0), (False, False, True), False)
    base, reference, truth, counted = _case(*args)
    check_three_way(base, reference, truth, f"{loss_type} default")
    for items, scale in ((counted, 1.0), (1.7 * counted, 1.7)):
        ours, reference, truth, _ = _case(*args, items=items)
        check_three_way(ours, reference, truth, f"{loss_type} num_items_in_batch={items}")
        assert rel_error(ours[0] * scale, base[0]) <= tol.REL_FP32_SAME_MATH
        for a, e in zip(ours[2][:2], base[2][:2]):  # (no bias in these cases)
            assert rel_error(a * scale, e) <= tol.REL_FP32_SAME_MATH
