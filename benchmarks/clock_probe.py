"""Does the GPU clock itself down under the fused kernels? Per-rep times beside the SM clock and board power.

Runs back-to-back loops ("phases") of one cuBLAS GEMM, the op's forward (no grad) and its forward+backward, in
alternation, while ``nvidia-smi`` samples the SM clock, the power draw and the active clock-throttle reasons every
``--sample-ms``. Prints per phase: the median / first / last per-rep milliseconds (CUDA events), the median SM MHz
and watts of the samples that fall inside the phase, and the throttle reasons seen. A fused kernel whose per-rep
time is above its profiled kernel time while the clock in its phases is lower than in the GEMM phases is paying for
its power draw, not for its instruction count alone.

    python benchmarks/clock_probe.py [--shape 4096x2048x131072] [--sources sm90] [--reps 30] [--cycles 3]
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
os.environ.setdefault("TPLOGP_CHECKS", "fast")

import runner

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def start_sampler(sample_ms: int):
    try:
        return subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                 f"-lms={sample_ms}", f"--id={torch.cuda.current_device()}"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None


def read_samples(proc) -> list[tuple[float, float, float, float, str]]:
    if proc is None:
        return []
    proc.terminate()
    out, _ = proc.communicate(timeout=10)
    rows = []
    for rec in csv.reader(io.StringIO(out)):
        try:
            stamp = time.mktime(time.strptime(rec[0].strip().split(".")[0], "%Y/%m/%d %H:%M:%S"))
            frac = float("0." + rec[0].strip().split(".")[1]) if "." in rec[0] else 0.0
            rows.append((stamp + frac, float(rec[1]), float(rec[2]), float(rec[3]), rec[4].strip()))
        except (ValueError, IndexError):
            continue
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="4096x2048x131072")
    ap.add_argument("--sources", default="sm90")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--sample-ms", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    from tplogp.kernel_registry import get_backend
    from tplogp.tp import LogpOptions

    T, D, V = (int(x) for x in args.shape.split("x"))
    h, w, y, gy, ge, _ = runner.bf16_problem(T, D, V)
    phases = [("gemm", lambda: h @ w.T)]
    for src in args.sources.split(","):
        if src == "sm90_pingpong":  # the sm90 source with the opt-in Gluon ping-pong forward
            from tplogp.backends.sm90_backend import SM90Backend
            from tplogp.kernels import configs

            backend = SM90Backend(config=configs.SM90_PINGPONG)
        else:
            backend = get_backend(src)
        fwd, fwd_bwd = runner.tp_step_fns(backend, h, w, y, LogpOptions(), gy, ge)  # fwd runs without grad
        phases += [(f"{src} fwd", fwd), (f"{src} fwd+bwd", fwd_bwd)]
    for _, fn in phases:  # compile and warm up
        runner.samples_ms(fn, 3, back_to_back=True)
    proc = start_sampler(args.sample_ms)
    time.sleep(1.0)
    windows = []  # (name, t0, t1, per-rep ms)
    for _ in range(args.cycles):
        for name, fn in phases:
            t0 = time.time()
            ms = runner.samples_ms(fn, args.reps, back_to_back=True)  # the GPU never idles
            windows.append((name, t0, time.time(), ms))
    samples = read_samples(proc)
    print(f"# {args.shape} bf16, {args.reps} back-to-back reps per phase, {args.cycles} cycles; "
          f"{len(samples)} nvidia-smi samples")
    print(f"{'phase':>16} | {'median ms':>9} {'first':>7} {'last':>7} | {'SM MHz':>6} {'W':>5} {'C':>3} | throttle")
    rows = []
    for name, t0, t1, ms in windows:
        inside = [s for s in samples if t0 + 0.1 * (t1 - t0) <= s[0] <= t1]
        mhz = statistics.median([s[1] for s in inside]) if inside else float("nan")
        watts = statistics.median([s[2] for s in inside]) if inside else float("nan")
        temp = statistics.median([s[3] for s in inside]) if inside else float("nan")
        reasons = sorted({s[4] for s in inside})
        rows.append({"phase": name, "median_ms": statistics.median(ms), "per_rep_ms": [round(x, 4) for x in ms],
                         "sm_mhz": mhz, "watts": watts, "temp_c": temp, "throttle": reasons})
        print(f"{name:>16} | {statistics.median(ms):9.3f} {ms[0]:7.3f} {ms[-1]:7.3f} | {mhz:6.0f} {watts:5.0f} "
              f"{temp:3.0f} | {','.join(reasons)}")
    if args.out:
        runner.write_json(args.out, {"machine": runner.machine_info(), "shape": args.shape, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
