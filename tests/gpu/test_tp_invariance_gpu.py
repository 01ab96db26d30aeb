"""``deterministic="tp_invariant"`` on the GPU sources: the runbook's tp_invariance check with 2 and 4 gloo ranks
sharing one GPU (each rank compares its shard's outputs and gradient rows with an in-process TP=1 run on the same
GPU), at a shape whose uneven shards cut the grid's blocks and whose vocabulary is prime. Skipped without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCRIPT = str(Path(__file__).resolve().parents[1] / "linear_logp_tp.py")


@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("source, dtype", [("triton", "bf16"), ("sm90", "bf16"), ("native", "fp32")])
def test_runbook_tp_invariance_on_one_gpu(source, dtype, nproc):
    if source == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 source needs a Hopper GPU")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", SCRIPT,
           "--backend", "gloo", "--op-source", source, "--dtype", dtype, "--tokens", "1000", "--hidden-size", "1000",
           "--vocab-size", "50021", "--uneven-shards", "--entropy", "--temperature", "0.7", "--ignore-fraction", "0.1",
           "--deterministic", "tp_invariant"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    text = out.stdout + out.stderr
    assert "PASS tp_invariance: bitwise equal to TP=1" in text, text[-4000:]
    assert out.returncode == 0, text[-4000:]
