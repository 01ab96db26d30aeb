"""``tplogp.integrations.trl`` against TRL's fused LM head on a CUDA GPU (skipped without CUDA),
where TRL runs its Triton kernel on the completion's positions only: a bf16 model's trainer, its own
``compute_loss`` with TRL's head and with tplogp's log-probs, against the stock trainer of a float64
copy on the CPU by the shared-error rule (:func:`tplogp.tolerances.assert_no_worse_shared`: the bf16
backbone's error, which every head carries, measured with a float64 head on the same bf16 model, is
the floor): log-probs, entropies, loss, the continuous metrics, every gradient; the clip fractions
count tokens, which bf16 rounding may move across a clip bound on either path."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytest.importorskip("trl")

from tests.support.grpo_trainer import (  # noqa: E402
    CASES, CONTINUOUS_METRICS, assert_three_way, bf16_steps, bf16_trainers)

GPU_CASES = ["loss_type-dapo", "loss_type-grpo", "gspo", "beta-bias-corrected",
             "entropy-mask-and-bonus", "off-policy-mask"]


@pytest.fixture(scope="module")
def gpu_trainers(tmp_path_factory):
    return bf16_trainers(tmp_path_factory.mktemp("grpo_gpu"), "cuda")


@pytest.mark.parametrize("case", GPU_CASES)
def test_bf16_compute_loss_matches_trls_triton_head(gpu_trainers, monkeypatch, case):
    ours, stock, truth, exact = bf16_steps(monkeypatch, gpu_trainers, CASES[case])
    assert_three_way(ours, stock, truth, dtype=torch.bfloat16, metrics=CONTINUOUS_METRICS,
                     exact_head=exact)


FUSED_GPU_CASES = ["loss_type-dapo", "loss_type-grpo", "loss_type-cispo", "loss_type-sapo",
                   "beta-bias-corrected"]


@pytest.mark.parametrize("case", FUSED_GPU_CASES)
def test_bf16_fused_loss_matches_trls_triton_head(gpu_trainers, monkeypatch, case):
    """patch(trainer, fused_loss=True): the loss as one fused call, its loss, continuous metrics
    and gradients by the same rule."""
    ours, stock, truth, exact = bf16_steps(monkeypatch, gpu_trainers, CASES[case], fused=True)
    assert_three_way(ours, stock, truth, dtype=torch.bfloat16, metrics=CONTINUOUS_METRICS,
                     exact_head=exact)
