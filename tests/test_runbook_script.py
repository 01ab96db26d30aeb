"""The runbook script under torchrun (tests/linear_logp_tp.py, the entry of tplogp.runbook): output and exit status."""

from __future__ import annotations

import os
import re
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "linear_logp_tp.py")


def torchrun(*args: str, nproc: int = 2, entry: tuple = (SCRIPT,)) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *entry, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_pass_output_format_and_status():
    out = torchrun("--dtype", "fp32", "--tokens", "32", "--hidden-size", "48", "--vocab-size", "301",
                   "--uneven-shards", "--run-stress", "--stress-tokens", "64", "--stress-hidden-size", "32",
                   "--stress-vocab-size", "512", "--stress-steps", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "[correctness]\n  dtype=torch.float32, reference_mode=fp32, atol=1e-05, rtol=1e-05\n" in text
    assert "  tokens=32, hidden=48, vocab=301\n" in text
    bounds = [int(x) for x in re.search(r"shard_boundaries=\[(.*)\]", text).group(1).split(",")]
    sizes = [end - start for start, end in zip(bounds, bounds[1:])]
    assert bounds[0] == 0 and bounds[-1] == 301 and len(set(sizes)) > 1, f"not an uneven partition: {bounds}"
    for metric in ("output", "hidden_grad", "weight_grad", "bias_grad"):
        assert re.search(rf"  PASS {metric}: max_abs=\S+, max_rel=\S+\n", text), metric
    assert "[stress]" in text and "  finite=PASS\n" in text
    assert re.search(r"  max_rank_elapsed_ms=[\d.]+ ", text) and re.search(r"  max_rank_peak_memory_gb=[\d.]+ ", text)
    assert text.rstrip().endswith("[result]\n  PASS")


def test_fail_is_reported_and_exits_nonzero():
    out = torchrun("--dtype", "bf16", "--tokens", "32", "--hidden-size", "48", "--vocab-size", "301", "--no-bias",
                   "--atol", "0", "--rtol", "0")
    assert out.returncode != 0
    assert re.search(r"  FAIL (output|weight_grad|hidden_grad): max_abs=", out.stdout), out.stdout
    assert "bias_grad" not in out.stdout
    assert out.stdout.rstrip().endswith("[result]\n  FAIL")


def test_module_entry_runs_the_same_program():
    out = torchrun("--dtype", "fp32", "--tokens", "16", "--hidden-size", "16", "--vocab-size", "64",
                   entry=("-m", "tplogp.runbook"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "  shard_boundaries=[0, 32, 64]\n" in out.stdout
    assert out.stdout.rstrip().endswith("[result]\n  PASS")
