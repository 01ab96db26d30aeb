"""CPU memory benchmark: resident growth and time of one fp32 forward+backward, native source
against eager.

Per shape ``N x D x V`` and implementation, ``tests/support/memory_probe.py`` (the probe the memory
tests use) runs in a fresh process and reports elapsed seconds and resident growth (peak RSS above
the inputs, /proc VmHWM after resetting it), beside the size of the gradients (unavoidable) and of
the full ``[N, V]`` fp32 logits (what the materializing ``eager`` baseline holds). Linux only
(/proc).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from . import runner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SHAPES = "2048x512x32768,8192x1024x65536"
SMOKE_SHAPES = "256x64x2048"
IMPLS = ("native", "eager")


def probe(shape: tuple[int, int, int], impl: str, timeout_s: float = 3600) -> dict:
    """One probe process; its JSON, or ``{"error": ...}``."""
    cmd = [sys.executable, "-m", "tests.support.memory_probe", *map(str, shape), impl]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit status {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(shapes: list[tuple[int, int, int]], impls: list[str]) -> list[dict]:
    rows = []
    for shape in shapes:
        for impl in impls:
            if impl not in IMPLS:
                raise ValueError(f"the memory benchmark compares {', '.join(IMPLS)}; got {impl!r}")
            r = probe(shape, impl)
            row = {"suite": "memory", "shape": runner.shape_label(shape), "impl": impl,
                   "dtype": "fp32"}
            if "error" in r:
                row["error"] = r["error"]
            else:
                row.update(elapsed_s=round(r["elapsed_s"], 3), growth_mib=round(r["growth_mib"], 1),
                           grads_mib=round(r["grads_mib"], 1), logits_mib=round(r["logits_mib"], 1),
                           finite=r["finite"])
            rows.append(row)
    return rows


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['shape']:>18} {r['impl']:>7} | {r['error']}"
    return (f"{r['shape']:>18} {r['impl']:>7} | {r['elapsed_s']:8.2f} s | growth "
            f"{r['growth_mib']:8.1f} MiB | grads {r['grads_mib']:7.1f} MiB | full logits "
            f"{r['logits_mib']:8.1f} MiB")
