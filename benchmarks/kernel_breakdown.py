"""Where the GPU time of one forward+backward goes, kernel by kernel (torch.profiler, CUDA activity).

Prints per shape and source a table of the kernels of ``reps`` profiled fwd+bwd steps (after warm-up): name, calls
per step, GPU ms per step, share of the step, and the step's GPU total against one cuBLAS GEMM of the same shape.
Used to find which piece of the backward is over its GEMM budget (docs/performance.md).

    python benchmarks/kernel_breakdown.py [--shapes 4096x2048x131072] [--sources sm90] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
os.environ.setdefault("TPLOGP_CHECKS", "fast")

import runner  # noqa: E402


def trace(fwd_bwd, path: str, steps: int = 2) -> None:
    """Chrome trace (CPU ops and CUDA kernels on one timeline) of ``steps`` fwd+bwd steps: where the GPU waits."""
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, with_stack=False) as prof:
        for _ in range(steps):
            fwd_bwd()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    print(f"# trace written to {path}")


def breakdown(source: str, T: int, D: int, V: int, reps: int, trace_path: str = "") -> None:
    from tplogp.kernel_registry import get_backend
    from tplogp.tp import LogpOptions

    h, w, y, gy, ge, _ = runner.bf16_problem(T, D, V)
    gemm_ms = runner.median_ms(lambda: h @ w.T, warm_ms=300)
    _, fwd_bwd = runner.tp_step_fns(get_backend(source), h, w, y, LogpOptions(), gy, ge)
    for _ in range(3):
        fwd_bwd()
    runner.sustain(fwd_bwd, 300)  # profile in the power-capped state the GEMM references are timed in
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fwd_bwd()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            rec = per_kernel[ev.name[:90]]
            rec[0] += 1
            rec[1] += ev.device_time_total / 1e3  # us -> ms
    total = sum(r[1] for r in per_kernel.values()) / reps
    wall_ms = runner.median_ms(fwd_bwd, reps=10, warm_ms=300)
    gemm_after = runner.median_ms(lambda: h @ w.T, warm_ms=300)
    print(f"\n## {source} {T}x{D}x{V} bf16: kernels {total:.3f} ms per fwd+bwd = {total / gemm_ms:.2f} GEMM-times "
          f"(GEMM {gemm_ms:.3f} ms before, {gemm_after:.3f} after); wall (CUDA events, same process) {wall_ms:.3f} ms "
          f"= {wall_ms / gemm_after:.2f} GEMM-times: {wall_ms - total:.3f} ms outside kernels")
    if trace_path:
        trace(fwd_bwd, trace_path)
    print(f"{'calls':>6} {'ms/step':>9} {'share':>6} {'GEMMs':>6}  kernel")
    for name, (calls, ms) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1]):
        ms /= reps
        print(f"{calls / reps:6.1f} {ms:9.3f} {ms / total:6.1%} {ms / gemm_ms:6.2f}  {name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4096x2048x131072")
    ap.add_argument("--sources", default="sm90")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--trace", default="", help="also write a Chrome trace of 2 steps of the first shape/source here")
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        T, D, V = (int(x) for x in shape.split("x"))
        for source in args.sources.split(","):
            breakdown(source, T, D, V, args.reps, args.trace)
            args.trace = ""
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
