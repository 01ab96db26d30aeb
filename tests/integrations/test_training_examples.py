"""The examples of docs/training.md run as written: torch.compile and autocast on CPU, the Megatron-style group and
the DTensor head on gloo ranks (the CUDA-graph one is in tests/gpu/test_training_gpu.py)."""

from __future__ import annotations

import pytest
import torch._dynamo

from tests.support.doc_examples import examples, run_example


def test_every_section_has_an_example():
    assert set(examples()) == {"compile", "autocast", "megatron", "dtensor", "cuda-graphs"}


@pytest.mark.slow
def test_compile_example():
    torch._dynamo.reset()
    run_example("compile")


def test_autocast_example():
    run_example("autocast")


@pytest.mark.tp(world_size=2, timeout=120)
@pytest.mark.parametrize("name", ["megatron", "dtensor"])
def test_distributed_examples(tp, name):
    run_example(name, tp_group=tp.group)
