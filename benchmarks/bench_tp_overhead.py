"""Host cost of the shared TP layer (validation, target localisation, merge, autograd), without the kernels.

A null backend returns precomputed stats and gradients, so what is timed is the Python and the small torch ops of
``tplogp.tp.linear_logp_tp`` around the backend. Baseline in the same run: the null backend's own calls. Prints
microseconds per call (median of 7 rounds) for the forward (no grad) and forward+backward, per checks mode, and writes JSON to results/.

    python benchmarks/bench_tp_overhead.py [--device cpu|cuda] [--calls 2000]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch

import runner  # benchmarks/runner.py: shared commit helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class NullBackend:
    """Returns fixed stats/grads: isolates the TP layer's own cost."""

    name = "null"

    def unavailable_reason(self, device=None):
        return None

    def __init__(self, n: int, d: int, v: int, device: torch.device) -> None:
        from tplogp.backends.base import ShardGrads, ShardStats

        z = torch.zeros(n, device=device)
        self.stats = ShardStats(z, z + 1, z, None)
        self.grads = ShardGrads(torch.zeros(n, d, device=device), torch.zeros(v, d, device=device), None)

    def forward_stats(self, hidden, weight, bias, local_target, call):
        return self.stats

    def backward(self, *args, **kwargs):
        return self.grads


def per_call_us(fn, calls: int, sync, rounds: int = 7) -> float:
    """Median over ``rounds`` of the mean per-call time of ``calls`` calls (this VM's timing noise is ~+-40%)."""
    for _ in range(50):
        fn()
    samples = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--shape", default="64x32x128", help="N x D x V (small: the point is the host cost)")
    args = ap.parse_args()
    from tplogp.tp import linear_logp_tp

    dev = torch.device(args.device)
    n, d, v = (int(x) for x in args.shape.split("x"))
    be = NullBackend(n, d, v, dev)
    h = torch.randn(n, d, device=dev, requires_grad=True)
    w = torch.randn(v, d, device=dev, requires_grad=True)
    t = torch.randint(0, v, (n,), device=dev)
    g = torch.randn(n, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def baseline():
        be.forward_stats(h, w, None, t, None)
        be.backward()

    def fwd():
        with torch.no_grad():
            linear_logp_tp(be, h, w, t)

    def fwd_bwd():
        linear_logp_tp(be, h, w, t).backward(g)

    rows = {"backend_alone_us": per_call_us(baseline, args.calls, sync)}
    for mode in ("full", "fast"):
        os.environ["TPLOGP_CHECKS"] = mode
        rows[f"{mode}_forward_us"] = per_call_us(fwd, args.calls, sync)
        rows[f"{mode}_forward_backward_us"] = per_call_us(fwd_bwd, args.calls, sync)
    for k, val in rows.items():
        print(f"{k:>28}: {val:8.1f}")
    commit = runner.git_commit()
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
           "device": args.device, "torch": torch.__version__, "machine": platform.platform(), "shape": args.shape,
           "calls": args.calls, **{k: round(x, 1) for k, x in rows.items()}}
    os.makedirs(os.path.join(ROOT, "results"), exist_ok=True)
    path = os.path.join(ROOT, "results", f"tp_overhead_{args.device}_{commit}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
