"""Small-shape latency in one process: where the host time before the first kernel goes, and per-call times
measured in interleaved rounds.

At 4096x2048x8192 a forward's GPU work (~0.21 ms) is about one GEMM, so a per-call timing (CUDA events around one
call on an idle GPU, as bench_linear_logp.py does) is GPU time plus the host time until the first kernel is
enqueued. This script measures, for the sm90 source through the public TP path:

* host timeline per call (median of ``--calls``, microseconds from op entry): backend ``forward_single`` entered,
  stats launcher entered (before its tensor descriptors) / returned, op returned;
* CUDA-event time per call in ``--rounds`` interleaved rounds (medians) of one cuBLAS GEMM, torch eager and sm90,
  forward and forward+backward (sm90 also with Triton's JIT launches instead of tplogp's direct launches), and the
  forward replayed from a CUDA graph (GPU time alone).

    python benchmarks/latency.py [--shape 4096x2048x8192] [--rounds 15] [--reps 20]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
os.environ.setdefault("TPLOGP_CHECKS", "fast")

import runner  # noqa: E402


def timeline(be, h, w, y, calls: int) -> dict:
    """Host microseconds from op entry to each mark, median over calls (the kernels really launch)."""
    from tplogp.tp import LogpOptions, linear_logp_tp

    marks: dict = {}
    orig_single = be.forward_single
    orig_launch = be._stats_launch(h.device)

    def single(*a, **k):
        marks["forward_single entered"] = time.perf_counter()
        return orig_single(*a, **k)

    def launch(*a, **k):
        marks["stats launcher entered"] = time.perf_counter()
        found = orig_launch(*a, **k)
        marks["stats launcher returned"] = time.perf_counter()
        return found

    def one_call(call_marks: dict) -> float:
        nonlocal marks
        marks = call_marks
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        linear_logp_tp(be, h, w, y, options=LogpOptions())
        marks["op returned"] = time.perf_counter()
        return t0

    be.forward_single = single
    be._stats_launch = lambda device: launch
    try:
        with torch.no_grad():
            return runner.median_marks(one_call, calls)
    finally:
        del be.forward_single
        del be._stats_launch


def backward_timeline(be, h, w, y, gy, calls: int, sync: bool = True, direct: bool = True,
                      profile: Optional[cProfile.Profile] = None) -> dict:
    """Host microseconds from ``out.backward(gy)`` to each mark of the backward (autograd's device thread),
    median over calls: Function.backward entered, backend.backward entered, d_logits launcher entered / returned,
    backend.backward returned, Function.backward returning, ``backward()`` returned.

    ``sync``: the GPU is idle at ``backward()`` (else the forward's kernels are still queued); ``direct``: tplogp's
    direct launches (else Triton's JIT launches); ``profile``: a cProfile enabled inside Function.backward."""
    from tplogp import tp
    from tplogp.kernels import direct_launch
    from tplogp.tp import LogpOptions, linear_logp_tp

    marks: dict = {}
    fn_cls = tp._LinearLogpFunction
    orig_fn_bwd = fn_cls.backward
    orig_be_bwd = be.backward
    orig_launch = be._dlogits_launch(h.device)

    def fn_bwd(ctx, *grads):
        marks["Function.backward entered"] = time.perf_counter()
        if profile is not None:
            profile.enable()
        try:
            return orig_fn_bwd(ctx, *grads)
        finally:
            if profile is not None:
                profile.disable()
            marks["Function.backward returning"] = time.perf_counter()

    def be_bwd(*a, **k):
        marks["backend.backward entered"] = time.perf_counter()
        out = orig_be_bwd(*a, **k)
        marks["backend.backward returned"] = time.perf_counter()
        return out

    def launch(*a, **k):
        marks["d_logits launcher entered"] = time.perf_counter()
        orig_launch(*a, **k)
        marks["d_logits launcher returned"] = time.perf_counter()

    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()

    def one_call(call_marks: dict) -> float:
        nonlocal marks
        marks = call_marks
        out = linear_logp_tp(be, hg, wg, y, options=LogpOptions())
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out.backward(gy)
        marks["backward() returned"] = time.perf_counter()
        hg.grad = wg.grad = None
        if not sync:
            torch.cuda.synchronize()
        return t0

    fn_cls.backward = staticmethod(fn_bwd)
    be.backward = be_bwd
    be._dlogits_launch = lambda device: launch
    direct_launch.set_direct_launch(None if direct else False)
    try:
        return runner.median_marks(one_call, calls)
    finally:
        fn_cls.backward = staticmethod(orig_fn_bwd)
        del be.backward
        del be._dlogits_launch
        direct_launch.set_direct_launch(None)


def graph_ms(fn, reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return runner.median_ms(g.replay, reps=reps)


def main() -> int:
    from tplogp.kernel_registry import get_backend
    from tplogp.kernels import direct_launch
    from tplogp.tp import LogpOptions

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4096x2048x8192")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warm-ms", type=float, default=300.0,
                    help="GPU milliseconds of back-to-back calls before each timing (runner.sustain; 0: off)")
    args = ap.parse_args()
    T, D, V = (int(x) for x in args.shape.split("x"))
    h, w, y, gy, ge, _ = runner.bf16_problem(T, D, V)
    be = get_backend("sm90")
    fwd, fwd_bwd = runner.tp_step_fns(be, h, w, y, LogpOptions(), gy, ge)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()

    def eager_fwd():
        with torch.no_grad():
            return runner.torch_eager(h, w, y)

    def eager_fwd_bwd():
        runner.torch_eager(hg, wg, y).backward(gy)
        hg.grad = wg.grad = None

    print(f"# {args.shape} bf16 sm90, {runner.machine_info()}")
    fwd()
    print("host timeline (us from op entry):", timeline(be, h, w, y, args.calls))
    print("backward host timeline (us from out.backward()):", backward_timeline(be, h, w, y, gy, args.calls))
    samples: dict = {}
    cases = {  # name: (fn, direct launches on)
        "gemm": (lambda: h @ w.T, True),
        "eager fwd": (eager_fwd, True),
        "sm90 fwd": (fwd, True),
        "sm90 fwd, JIT launches": (fwd, False),
        "eager fwd+bwd": (eager_fwd_bwd, True),
        "sm90 fwd+bwd": (fwd_bwd, True),
        "sm90 fwd+bwd, JIT launches": (fwd_bwd, False),
    }
    for _ in range(args.rounds):
        for name, (fn, direct) in cases.items():
            direct_launch.set_direct_launch(None if direct else False)
            samples.setdefault(name, []).append(runner.median_ms(fn, reps=args.reps, warm_ms=args.warm_ms))
        direct_launch.set_direct_launch(None)
    gemm = statistics.median(samples["gemm"])
    for name, v in samples.items():
        m = statistics.median(v)
        print(f"{name:>22}: {m:.4f} ms  ({m / gemm:.2f} GEMM-times)  rounds min {min(v):.4f} max {max(v):.4f}")
    g_fwd = graph_ms(fwd, args.reps)
    print(f"{'sm90 fwd graph replay':>22}: {g_fwd:.4f} ms  ({g_fwd / gemm:.2f} GEMM-times, GPU time alone)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
