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
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
os.environ.setdefault("TPLOGP_CHECKS", "fast")

import launch_cost  # noqa: E402
import runner  # noqa: E402
from latency import backward_timeline  # noqa: E402


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

    def one_call(call_marks: dict) -> float:
        nonlocal marks
        marks = call_marks
        out = _Id.apply(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out.backward(g)
        marks["backward() returned"] = time.perf_counter()
        x.grad = None
        return t0

    return runner.median_marks(one_call, calls)


def launcher_alone(be, h, w, y, gy, n: int = 200) -> dict:
    """The d_logits launcher on the main thread: back to back, after a synchronize, after a synchronize and a 2 ms
    sleep."""
    run = launch_cost.dlogits_probe(be, h, w, y, gy)
    return {
        "back-to-back (sync every 10)": launch_cost.cost_us(run, n, sync_every=10),
        "after synchronize (GPU idle)": launch_cost.cost_us(run, n, sync_every=1),
        "after synchronize + 2 ms sleep": launch_cost.cost_us(run, n // 4, sync_every=1, sleep_s=0.002),
    }


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
                  backward_timeline(be, h, w, y, gy, args.calls, sync=sync, direct=direct))
    prof = cProfile.Profile()
    backward_timeline(be, h, w, y, gy, args.calls, sync=True, profile=prof)
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
