"""Host cost of the pieces of one small-shape forward, each timed alone (median of many calls, microseconds).

Complements latency.py's timeline: which of the steps before and inside a Triton launch is slow on this host
(torch allocations and views, input checks, tensor descriptors, Triton's launcher with and without descriptor
arguments, a plain torch kernel launch for comparison, Triton's launch hooks).

    python benchmarks/launch_cost.py [--shape 4096x2048x8192]
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
os.environ.setdefault("TPLOGP_CHECKS", "fast")

import runner  # noqa: E402


def cost_us(fn, n: int = 300, sync_every: int = 20, sleep_s: float = 0.0) -> float:
    """Median host microseconds of ``fn()`` over ``n`` calls; a synchronize every ``sync_every`` calls, each followed
    by ``sleep_s`` seconds of sleep (a thread that slept, like autograd's device thread between backward calls)."""
    ts = []
    for i in range(n):
        if i % sync_every == 0:
            torch.cuda.synchronize()
            if sleep_s:
                time.sleep(sleep_s)
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return round(statistics.median(ts) * 1e6, 1)


def dlogits_probe(be, h, w, y, gy):
    """A zero-argument callable that runs the backend's d_logits launcher once on the whole vocab (one chunk),
    with the statistics of a real forward: the launch the backward makes first."""
    from tplogp.backends.base import ShardCall
    from tplogp.kernels import launch

    T, V = h.shape[0], w.shape[0]
    cfg = be._cfg(h.device)
    st = be.forward_stats(h, w, None, y, ShardCall())
    rmax, lsum, g = st.row_max, st.sum_exp.log(), gy.float()
    dz = torch.empty((T, V), device=h.device, dtype=w.dtype)
    dlogits = be._dlogits_launch(h.device)
    precision = launch._dot_precision(h.dtype)

    def run() -> None:
        dlogits(h, w, None, y, rmax, lsum, g, g, g, g, dz, g, 0, V, 1.0, False, False, cfg, precision)

    return run


def main() -> int:
    from triton import knobs
    from triton.tools.tensor_descriptor import TensorDescriptor

    from tplogp.kernel_registry import get_backend
    from tplogp.kernels import direct_launch, launch, sm90
    from tplogp.tp import LogpOptions, linear_logp_tp
    from tplogp.validation import local_problem

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4096x2048x8192")
    args = ap.parse_args()
    T, D, V = (int(x) for x in args.shape.split("x"))
    h, w, y, gy, ge, _ = runner.bf16_problem(T, D, V)
    be = get_backend("sm90")
    opts = LogpOptions()
    with torch.no_grad():
        for _ in range(3):
            linear_logp_tp(be, h, w, y, options=opts)
    torch.cuda.synchronize()
    print(f"# {args.shape} sm90; launch_enter_hook={knobs.runtime.launch_enter_hook!r} "
          f"launch_exit_hook={knobs.runtime.launch_exit_hook!r}")
    cfg = be._cfg(h.device)
    parts = torch.empty((3, 8, T), device="cuda")
    out = torch.empty((4, T), device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    d_h = TensorDescriptor.from_tensor(h, [cfg.block_n, cfg.block_d])
    d_w = TensorDescriptor.from_tensor(w, [cfg.block_v, cfg.block_d])
    stats_args = (d_h, d_w, h, y, parts, T, V, D, 1.0, 8, 8 * T)
    stats_kw = dict(SPLIT_V=cfg.split_v, HAS_BIAS=False, WITH_ENTROPY=False,
                    BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, GROUP_N=cfg.group_n,
                    DOT_PRECISION=None, WARP_SPECIALIZE=cfg.warp_specialize, NUM_STAGES=cfg.num_stages,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    grid = ((T // cfg.block_n) * 8,)
    stats_bin = sm90._fwd_stats_tma_kernel[grid](*stats_args, **stats_kw)  # the JIT returns the compiled kernel
    direct_stats = direct_launch.launcher(sm90._fwd_stats_tma_kernel)
    params = list(inspect.signature(sm90._fwd_stats_tma_kernel.fn).parameters.values())
    values = list(stats_args) + [stats_kw.get(p.name, p.default) for p in params[len(stats_args):]]
    fin_values = [parts, y, out, T, V, 8, 8 * T, False, True, 256]
    fin_bin = launch._finalize_single_kernel[(T // 256,)](*fin_values[:7], WITH_ENTROPY=False, ACCURATE_LOG=True,
                                                           BLOCK=256, num_warps=4)
    runner_obj = getattr(stats_bin, "_run", None)
    print(f"# stats binary: global_scratch={getattr(runner_obj, 'global_scratch_size', None)} "
          f"profile_scratch={getattr(runner_obj, 'profile_scratch_size', None)} "
          f"launch wrapper={getattr(getattr(runner_obj, 'launch', None), '__name__', None)}")
    small = torch.zeros(16, device="cuda")
    rows = {
        "torch.empty [3,S,N]": lambda: torch.empty((3, 8, T), device="cuda"),
        "unbind(0) of [3,S,N]": lambda: out.unbind(0),
        "torch small add_ (one torch kernel launch)": lambda: small.add_(1.0),
        "local_problem": lambda: local_problem(h, w, y, None, 0, None, None, 1.0),
        "launch.check_inputs": lambda: launch.check_inputs(h, w, None, y),
        "TensorDescriptor.from_tensor x2": lambda: (TensorDescriptor.from_tensor(h, [128, 64]),
                                                    TensorDescriptor.from_tensor(w, [256, 64])),
        "stats binary.run (descriptors encoded + launch)": lambda: stats_bin.run(
            grid[0], 1, 1, stream, stats_bin.function, stats_bin.packed_metadata, None, None, None, *values),
        "finalize binary.run (no descriptors)": lambda: fin_bin.run(
            T // 256, 1, 1, stream, fin_bin.function, fin_bin.packed_metadata, None, None, None, *fin_values),
        "jit stats launch (Triton front end + launcher)": lambda: sm90._fwd_stats_tma_kernel[grid](*stats_args, **stats_kw),
        "direct stats launch (tplogp direct_launch)": lambda: direct_stats(grid, *stats_args, **stats_kw),
        "sm90._descriptors (two, unvalidated)": lambda: sm90._descriptors(h, w, 128, 256, 64),
        "backend.forward_single": lambda: be.forward_single(h, w, None, y, be_call),
        "linear_logp_tp no_grad": lambda: linear_logp_tp(be, h, w, y, options=opts),
    }
    from tplogp.backends.base import ShardCall

    be_call = ShardCall()
    with torch.no_grad():
        for name, fn in rows.items():
            print(f"{name:>48}: {cost_us(fn):7.1f} us")

    # The same d_logits launcher on the main thread and inside a backward (autograd's device thread), where the
    # latency timeline (latency.py) saw it take 139-156 us.
    launch_dlogits = dlogits_probe(be, h, w, y, gy)
    small_add = rows["torch small add_ (one torch kernel launch)"]
    probes = {"sm90 d_logits launcher (descriptors + launch)": launch_dlogits,
              "torch small add_": small_add,
              "TensorDescriptor.from_tensor x2": rows["TensorDescriptor.from_tensor x2"]}
    for name, fn in probes.items():
        print(f"{'main thread: ' + name:>64}: {cost_us(fn):7.1f} us")

    class _Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            for pname, pfn in probes.items():
                print(f"{'autograd thread: ' + pname:>64}: {cost_us(pfn):7.1f} us")
            return grad

    x = torch.zeros(4, device="cuda", requires_grad=True)
    _Probe.apply(x).sum().backward()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
