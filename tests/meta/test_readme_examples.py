"""The README's code blocks run as written: the op on the machine's device (the CPU when there is no GPU), the fused
loss after it, and the tensor-parallel call on 2 gloo ranks, checked against the one-rank call."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tplogp.reference import reference_linear_logp
from tplogp.tolerances import RUNBOOK_TOLERANCES, assert_no_worse

README = Path(__file__).resolve().parents[2] / "README.md"
_EXAMPLE = re.compile(r"<!-- example: (\S+) -->\n```python\n(.*?)```", re.S)
_DEVICE_LINE = 'device = "cuda" if torch.cuda.is_available() else "cpu"\n'


def _examples() -> dict[str, str]:
    return dict(_EXAMPLE.findall(README.read_text()))


def _run(names: list[str], **namespace) -> dict:
    """Execute the README examples ``names`` as written, in order, in one namespace (seeded: every rank draws the
    same tensors); the op example picks the machine's device itself."""
    torch.manual_seed(0)
    for name in names:
        code = _examples()[name]
        if name == "readme-op":
            assert code.count(_DEVICE_LINE) == 1, code
        exec(compile(code, f"README.md:{name}", "exec"), namespace)
    return namespace


def test_every_example_is_marked():
    assert set(_examples()) == {"readme-op", "readme-tp", "readme-loss"}


@pytest.mark.slow
def test_op_and_fused_loss_examples():
    ns = _run(["readme-op"])
    logp, hidden, weight, targets = ns["logp"], ns["hidden"], ns["weight"], ns["targets"]
    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    truth, expected = (reference_linear_logp(hidden.detach(), weight.detach(), targets, mode=mode)
                       for mode in ("float64", "matching"))  # matching: PyTorch eager's bf16 logits
    assert_no_worse("readme logp", logp.detach(), expected, truth, hidden.dtype)
    assert hidden.grad is not None and weight.grad is not None and torch.isfinite(weight.grad).all()
    hidden.grad = weight.grad = None

    ns = _run(["readme-loss"], **ns)
    loss, advantages, old_logp = ns["loss"], ns["advantages"], ns["old_logp"]
    from tplogp import losses

    ppo = losses.ppo_clip(0.2, 0.28)
    assert_no_worse("readme loss", loss.detach(), ppo(expected, None, advantages, old_logp).mean(),
                    ppo(truth, None, advantages.double(), old_logp.double()).mean(), hidden.dtype)
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


@pytest.mark.slow
@pytest.mark.tp(world_size=2, timeout=180)
def test_tensor_parallel_example(tp):
    ns = _run(["readme-op", "readme-tp"], tp_group=tp.group)
    fp32 = RUNBOOK_TOLERANCES[torch.float32]  # the same bf16 inputs, fp32 stats merged in another order
    tp.assert_close(ns["logp_tp"].detach(), ns["logp"].detach(), rtol=fp32.rtol, atol=fp32.atol)
