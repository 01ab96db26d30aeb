"""Where the host time of a small-shape backward goes (sm90 source, through the public TP path).

At 4096x2048x8192 the GPU finishes the forward ~0.2 ms after it starts, so every microsecond of host time between
the forward's last launch and the backward's first launch (autograd's hand-off to its device thread, our
preparation, the d_logits launch) is GPU idle time. This script measures, in one process:

1. the autograd engine's own cost around a trivial custom Function (hand-off to the device thread and back);
2. the real backward's timeline with the GPU idle at ``backward()`` (synchronized first) and busy (the forward's
   kernels still queued), with Triton's JIT launches and with direct launches (tplogp.kernels.direct_launch);
3. a cProfile of the real backward on autograd's thread (top functions by own time);
4. the d_logits launcher alone on the main thread: back-to-back, after a synchronize, after a 2 ms sleep.

    python benchmarks/backward_host.py [--shape 4096x2048x8192] [--calls 100]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
os.environ.setdefault("TPLOGP_CHECKS", "fast")

import runner  # noqa: E402


def _median(rows: dict) -> dict:
    return {k: round(statistics.median(v), 1) for k, v in rows.items()}


def engine_baseline(calls: int) -> dict:
    """us from ``backward()`` to a trivial custom Function's backward, and from its return to ``backward()``'s."""
    marks: dict = {}

    class _Id(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            marks["Function.backward entered"] = time.perf_counter()
            out = g * 1.0
            marks["Function.backward returning"] = time.perf_counter()
            return out

    x = torch.zeros(4096, device="cuda", requires_grad=True)
    g = torch.ones(4096, device="cuda")
    rows: dict = {}
    for i in range(calls + 5):
        y = _Id.apply(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y.backward(g)
        marks["backward() returned"] = time.perf_counter()
        x.grad = None
        if i >= 5:
            for k, t in marks.items():
                rows.setdefault(k, []).append((t - t0) * 1e6)
    return _median(rows)


def real_backward(be, h, w, y, gy, calls: int, sync: bool, profile: cProfile.Profile | None = None,
                  direct: bool = True) -> dict:
    from tplogp import tp
    from tplogp.kernels import direct_launch, sm90
    from tplogp.tp import LogpOptions, linear_logp_tp

    marks: dict = {}
    fn_cls = tp._LinearLogpFunction
    orig_fn_bwd = fn_cls.backward
    orig_desc = sm90._descriptors
    orig_launch = sm90.launch_dlogits_tma

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

    def desc(*a, **k):
        marks["descriptors entered"] = time.perf_counter()
        out = orig_desc(*a, **k)
        marks["descriptors returned"] = time.perf_counter()
        return out

    def dlogits(*a, **k):
        marks["d_logits launcher entered"] = time.perf_counter()
        orig_launch(*a, **k)
        marks["d_logits launcher returned"] = time.perf_counter()

    fn_cls.backward = staticmethod(fn_bwd)
    sm90._descriptors = desc
    sm90.launch_dlogits_tma = dlogits
    direct_launch.set_direct_launch(None if direct else False)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    rows: dict = {}
    try:
        for i in range(calls + 5):
            out = linear_logp_tp(be, hg, wg, y, options=LogpOptions())
            if sync:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out.backward(gy)
            marks["backward() returned"] = time.perf_counter()
            hg.grad = wg.grad = None
            if i >= 5:
                for k, t in sorted(marks.items(), key=lambda kv: kv[1]):
                    rows.setdefault(k, []).append((t - t0) * 1e6)
            if not sync:
                torch.cuda.synchronize()
    finally:
        fn_cls.backward = staticmethod(orig_fn_bwd)
        sm90._descriptors = orig_desc
        sm90.launch_dlogits_tma = orig_launch
        direct_launch.set_direct_launch(None)
    return _median(rows)


def launcher_alone(be, h, w, y, gy, n: int = 200) -> dict:
    from tplogp.backends.base import ShardCall
    from tplogp.kernels import launch

    T, V = h.shape[0], w.shape[0]
    cfg = be._cfg(h.device)
    st = be.forward_stats(h, w, None, y, ShardCall())
    rmax, lsum, g = st.row_max, st.sum_exp.log(), gy.float()
    dz = torch.empty((T, V), device="cuda", dtype=w.dtype)
    dlogits = be._dlogits_launch(h.device)
    prec = launch._dot_precision(h.dtype)

    def one():
        t0 = time.perf_counter()
        dlogits(h, w, None, y, rmax, lsum, g, g, g, g, dz, g, 0, V, 1.0, False, False, cfg, prec)
        return (time.perf_counter() - t0) * 1e6

    out = {}
    ts = []
    torch.cuda.synchronize()
    for i in range(n):
        if i % 10 == 0:
            torch.cuda.synchronize()
        ts.append(one())
    out["back-to-back (sync every 10)"] = ts
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        ts.append(one())
    out["after synchronize (GPU idle)"] = ts
    ts = []
    for _ in range(n // 4):
        torch.cuda.synchronize()
        time.sleep(0.002)
        ts.append(one())
    out["after synchronize + 2 ms sleep"] = ts
    torch.cuda.synchronize()
    return _median(out)


def main() -> int:
    from tplogp.kernel_registry import get_backend
    from tplogp.tp import LogpOptions

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4096x2048x8192")
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    T, D, V = (int(x) for x in args.shape.split("x"))
    h, w, y, gy, _, _ = runner.bf16_problem(T, D, V)
    be = get_backend("sm90")
    _, fwd_bwd = runner.tp_step_fns(be, h, w, y, LogpOptions(), gy, None)
    for _ in range(5):
        fwd_bwd()
    torch.cuda.synchronize()
    print(f"# {args.shape} bf16 sm90, {runner.machine_info()}")
    print(f"# cpus usable {len(os.sched_getaffinity(0))}, torch threads {torch.get_num_threads()}")
    print("engine around a trivial Function (us from backward()):", engine_baseline(args.calls))
    for direct in (False, True):
        how = "direct launches" if direct else "Triton JIT launches"
        for sync in (True, False):
            print(f"real backward, {how}, GPU {'idle' if sync else 'busy'} at backward() (us):",
                  real_backward(be, h, w, y, gy, args.calls, sync=sync, direct=direct))
    prof = cProfile.Profile()
    real_backward(be, h, w, y, gy, args.calls, sync=True, profile=prof)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print(f"cProfile of {args.calls + 5} backwards on autograd's thread, by own time:\n{s.getvalue()}")
    print("d_logits launcher alone, main thread (us):", launcher_alone(be, h, w, y, gy))
    fwd, _ = runner.tp_step_fns(be, h, w, y, LogpOptions(), gy, None)
    prof = cProfile.Profile()
    for _ in range(args.calls):
        torch.cuda.synchronize()
        prof.enable()
        fwd()
        prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(f"cProfile of {args.calls} no-grad forwards (main thread), by own time:\n{s.getvalue()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
