"""``tplogp.integrations.trl`` against TRL's fused LM head on a CUDA GPU (skipped without CUDA),
where TRL runs its Triton kernel on the completion's positions only: a bf16 model's trainer, its own
``compute_loss`` with TRL's head and with tplogp's log-probs, three-way against the stock trainer of
a float64 copy on the CPU (log-probs, entropies, loss, the continuous metrics, every gradient; the
clip fractions count tokens, which bf16 rounding may move across a clip bound on either path)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytest.importorskip("trl")

from tests.support.grpo_trainer import (  # noqa: E402
    B, CASES, COMPLETION_MASK, CONTINUOUS_METRICS, K, P, PROMPT_MASK, V, assert_three_way,
    compute_loss_step, configure, grpo_trainer, tiny_model)

GPU_CASES = ["loss_type-dapo", "loss_type-grpo", "gspo", "beta-bias-corrected",
             "entropy-mask-and-bonus", "off-policy-mask"]


@pytest.fixture(scope="module")
def gpu_trainers(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_gpu")
    stock = grpo_trainer(tiny_model(dtype=torch.bfloat16).cuda(), out, use_cpu=False, bf16=True)
    truth = grpo_trainer(tiny_model(dtype=torch.bfloat16).double(), out)  # the same bf16 weights
    g = torch.Generator().manual_seed(3)
    old = torch.randn(B, K, generator=g) * 0.3 - 4.0
    batch = dict(prompt_ids=torch.randint(3, V, (B, P), generator=g), prompt_mask=PROMPT_MASK,
                 completion_ids=torch.randint(3, V, (B, K), generator=g),
                 completion_mask=COMPLETION_MASK, advantages=torch.randn(B, generator=g),
                 old_per_token_logps=old * COMPLETION_MASK,
                 ref_per_token_logps=(old + 0.2) * COMPLETION_MASK,
                 sampling_per_token_logps=(old - 0.1) * COMPLETION_MASK,
                 num_items_in_batch=COMPLETION_MASK.sum().float())
    return stock, truth, batch


@pytest.mark.parametrize("case", GPU_CASES)
def test_bf16_compute_loss_matches_trls_triton_head(gpu_trainers, monkeypatch, case):
    stock, truth, batch = gpu_trainers
    results = []
    for trainer, patched in ((stock, True), (stock, False), (truth, False)):
        configure(monkeypatch, trainer, CASES[case])
        results.append(compute_loss_step(trainer, batch, patched))
    assert_three_way(*results, dtype=torch.bfloat16, metrics=CONTINUOUS_METRICS)


FUSED_GPU_CASES = ["loss_type-dapo", "loss_type-grpo", "loss_type-cispo", "loss_type-sapo",
                   "beta-bias-corrected"]


@pytest.mark.parametrize("case", FUSED_GPU_CASES)
def test_bf16_fused_loss_matches_trls_triton_head(gpu_trainers, monkeypatch, case):
    """patch(trainer, fused_loss=True): the loss as one fused call, its loss, continuous metrics
    and gradients three-way as above."""
    stock, truth, batch = gpu_trainers
    results = []
    for trainer, patched in ((stock, True), (stock, False), (truth, False)):
        configure(monkeypatch, trainer, CASES[case])
        results.append(compute_loss_step(trainer, batch, patched, fused=patched))
    assert_three_way(*results, dtype=torch.bfloat16, metrics=CONTINUOUS_METRICS)
