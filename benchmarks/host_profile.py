"""Host cost of one call per phase, with the Triton kernels stubbed out (no kernel work, launcher Python only).

Counts the torch ops each phase dispatches (TorchDispatchMode) and times the host side (perf_counter, median of
many calls). Runs anywhere: CPU tensors under TRITON_INTERPRET=1 (the op counts carry over to CUDA; CUDA ops cost
more host time each). On a GPU it times the real launches instead (pass --real): that is the eager host cost.

    TRITON_INTERPRET=1 python benchmarks/host_profile.py [--shape 4096x2048x8192] [--cprofile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
os.environ.setdefault("TPLOGP_CHECKS", "fast")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class _StubKernel:
    def __getitem__(self, grid):
        return lambda *a, **k: None


def stub_kernels() -> None:
    from tplogp.kernels import launch, sm90

    for mod in (launch, sm90):
        for name in dir(mod):
            if name.startswith("_") and name.endswith("_kernel"):
                setattr(mod, name, _StubKernel())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4096x2048x8192")
    ap.add_argument("--source", default="triton")
    ap.add_argument("--real", action="store_true", help="launch the real kernels (GPU)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()
    T, D, V = (int(x) for x in args.shape.split("x"))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.real:
        stub_kernels()
        T, D, V = min(T, 64), min(D, 64), min(V, 512)  # stubs do no work: keep the CPU tensors small
    from tplogp.backends.base import ShardCall
    from tplogp.backends.sm90_backend import SM90Backend
    from tplogp.backends.triton_backend import TritonBackend
    from tplogp.tp import LogpOptions, linear_logp_tp

    be = SM90Backend() if args.source == "sm90" else TritonBackend()
    dt = torch.bfloat16
    h = torch.randn(T, D, device=dev).to(dt)
    w = torch.randn(V, D, device=dev).to(dt)
    y = torch.randint(0, V, (T,), device=dev)
    gy = torch.randn(T, device=dev)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    call = ShardCall()
    st = be.forward_stats(h, w, None, y, call)
    rmax, lsum = st.row_max, st.sum_exp.log()
    out_holder = {}

    def tp_fwd_bwd_fwd():
        out_holder["o"] = linear_logp_tp(be, hg, wg, y, options=LogpOptions())

    def tp_fwd_bwd_bwd():
        out_holder.pop("o").backward(gy)
        hg.grad = wg.grad = None

    phases = {
        "fwd_stats": lambda: be.forward_stats(h, w, None, y, call),
        "fwd_single": lambda: be.forward_single(h, w, None, y, call),
        "bwd_prim": lambda: be.backward(h, w, None, y, rmax, lsum, gy, None, None, None, call, (True, True, False)),
        "tp_fwd_nograd": lambda: linear_logp_tp(be, h, w, y, options=LogpOptions()),
        "tp_fwd_grad": tp_fwd_bwd_fwd,
        "tp_bwd": tp_fwd_bwd_bwd,
    }
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"# device={dev} stub={not args.real} shape={T}x{D}x{V} source={be.name}")
    for name, fn in phases.items():
        if name == "tp_bwd":
            continue
        pair = name == "tp_fwd_grad"
        ctx = torch.no_grad() if name in ("fwd_stats", "fwd_single", "bwd_prim", "tp_fwd_nograd") else torch.enable_grad()
        with ctx:
            for _ in range(5):
                fn()
                if pair:
                    tp_fwd_bwd_bwd()
            sync()
            with _Count() as c:
                fn()
            if pair:
                with _Count() as cb:
                    tp_fwd_bwd_bwd()
            ts, tb = [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
                if pair:
                    t0 = time.perf_counter()
                    tp_fwd_bwd_bwd()
                    tb.append(time.perf_counter() - t0)
                sync()
        print(f"{name:>14}: host {statistics.median(ts)*1e6:7.1f} us  ops {sum(c.ops.values()):3d}  {dict(c.ops)}")
        if pair:
            print(f"{'tp_bwd':>14}: host {statistics.median(tb)*1e6:7.1f} us  ops {sum(cb.ops.values()):3d}  "
                  f"{dict(cb.ops)}")
    if args.cprofile:
        import cProfile
        import pstats

        with torch.no_grad():
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.reps):
                phases["tp_fwd_nograd"]()
            pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
