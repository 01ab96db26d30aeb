"""Shared benchmark runner: timing, memory, machine info, JSON output.

Timing: CUDA events around each call, after warm-up, median of ``reps`` (the ``triton.testing.do_bench`` recipe
with a fixed repeat count so every source gets the same number of samples). Memory: peak allocated during one call
minus what was allocated before it (inputs excluded, outputs and gradients included).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], reps: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def extra_peak_gib(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10)
        commit = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except Exception:
        return os.environ.get("TPLOGP_COMMIT", "unknown")


def machine_info() -> dict:
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": os.environ.get("TPLOGP_COMMIT") or git_commit(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
