"""CPU benchmark of the native source against the materializing baseline, in the same run.

For each shape (fp32, forward + backward with a per-token upstream gradient) it runs ``tests/memory_probe.py`` in a
fresh process per implementation and reports the elapsed seconds and the resident-memory growth (peak RSS above
the inputs, /proc VmHWM after resetting it), beside the size of the gradients (unavoidable) and of the full
``[N, V]`` fp32 logits (what the materializing path holds). Prints a table and writes JSON under ``results/``.

    python benchmarks/bench_cpu_memory.py [--shapes 2048x512x32768,8192x1024x65536] [--impls native,eager]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

import torch

import runner  # benchmarks/runner.py: shared commit / machine helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(ROOT, "tests", "memory_probe.py")


def probe(shape: tuple[int, int, int], impl: str) -> dict:
    out = subprocess.run([sys.executable, PROBE, *map(str, shape), impl], capture_output=True, text=True,
                         timeout=3600)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="2048x512x32768,8192x1024x65536")
    ap.add_argument("--impls", default="native,eager")
    ap.add_argument("--out", default=os.path.join(ROOT, "results"))
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    print(f"{'shape':>18} {'impl':>7} {'elapsed_s':>10} {'growth_MiB':>11} {'grads_MiB':>10} {'logits_MiB':>11}")
    for shape in shapes:
        for impl in args.impls.split(","):
            r = probe(shape, impl)
            rows.append({"shape": "x".join(map(str, shape)), "impl": impl, **r})
            if "error" in r:
                print(f"{rows[-1]['shape']:>18} {impl:>7} error: {r['error']}")
                continue
            print(f"{rows[-1]['shape']:>18} {impl:>7} {r['elapsed_s']:10.2f} {r['growth_mib']:11.1f} "
                  f"{r['grads_mib']:10.1f} {r['logits_mib']:11.1f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": runner.git_commit(),
            "machine": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "rows": rows}
    path = os.path.join(args.out, f"cpu_memory_{meta['commit']}.json")
    with open(path, "w") as f:
        json.dump(meta, f, indent=2)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
