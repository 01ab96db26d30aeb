"""Time sm90 tile-config variants at one shape: forward and forward+backward in GEMM-times, in one process.

Each variant is the sm90 default (``configs.SM90``) with some fields replaced; forward and backward tiles are
reported separately so the best of each can be combined. Every variant's logp is compared with the default's
(max abs difference) so a broken variant cannot win. Variants that fail to compile are reported and skipped; run
one variant per process (``--variants NAME``) where a variant may fault the GPU (a CUDA fault ends the process's
context, and every later variant would fail with it). ``--check`` compares logp with float64 instead of the
first variant.

    python benchmarks/sweep_configs.py [--shape 4096x2048x131072] [--variants base,nows,...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
os.environ.setdefault("TPLOGP_CHECKS", "fast")

import runner  # noqa: E402
from tplogp.kernels import configs  # noqa: E402

_FWD_128x128_W4 = dict(block_n=128, block_v=128, block_d=64, num_warps=4, num_stages=3, split_tiles=8)
_BWD_128x128_W4 = dict(bwd_block_n=128, bwd_block_v=128, bwd_block_d=64, bwd_num_warps=4, bwd_num_stages=3)
_PP = configs.PINGPONG
VARIANTS = {
    "base": {},
    # the opt-in Gluon ping-pong forward and its tilings (per consumer warpgroup: block_n x block_v, K step
    # block_d, ring depth, group, split)
    "pingpong": dict(pingpong=_PP),
    "pp_128x128_d64_s3": dict(pingpong=replace(_PP, block_d=64, num_stages=3)),
    "pp_128x128_d32_s5": dict(pingpong=replace(_PP, num_stages=5)),
    "pp_64x256_d32_s5": dict(pingpong=replace(_PP, block_n=64, block_v=256, num_stages=5, split_tiles=4)),
    "pp_64x256_d64_s2": dict(pingpong=replace(_PP, block_n=64, block_v=256, block_d=64, num_stages=2,
                                              split_tiles=4)),
    "pp_g4": dict(pingpong=replace(_PP, group_n=4)),
    "pp_g16": dict(pingpong=replace(_PP, group_n=16)),
    "pp_g32": dict(pingpong=replace(_PP, group_n=32)),
    "pp_st16": dict(pingpong=replace(_PP, split_tiles=16)),
    "tma_g8": dict(group_n=8),
    "tma_g16": dict(group_n=16),
    "pp_128x128_d32_s6_st16": dict(pingpong=replace(_PP, split_tiles=16)),
    "nows": dict(warp_specialize=False),
    # one consumer warpgroup per CTA, two CTAs per SM: one CTA's softmax epilogue can overlap the other's MMAs
    "fwd_w4_128x128": _FWD_128x128_W4,
    "fwd_w4_128x128_nows": dict(_FWD_128x128_W4, warp_specialize=False),
    "bwd_w4_128x128": _BWD_128x128_W4,
    "bwd_w4_128x128_nows": dict(_BWD_128x128_W4, warp_specialize=False),
    "bwd_w8_128x128_s4": dict(bwd_block_n=128, bwd_block_v=128, bwd_block_d=64, bwd_num_warps=8, bwd_num_stages=4),
    "bwd_w8_256x128": dict(bwd_block_n=256, bwd_block_v=128, bwd_block_d=64, bwd_num_warps=8, bwd_num_stages=3),
}


def main() -> int:
    from tplogp.backends.sm90_backend import SM90Backend
    from tplogp.tp import LogpOptions, linear_logp_tp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4096x2048x131072")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="error of logp against float64 (else vs the first variant)")
    ap.add_argument("--fwd-only", action="store_true", help="time the forward only")
    ap.add_argument("--warm-ms", type=float, default=300.0,
                    help="GPU milliseconds of back-to-back calls before each timing (runner.sustain; 0: off)")
    args = ap.parse_args()
    T, D, V = (int(x) for x in args.shape.split("x"))
    h, w, y, gy, ge, _ = runner.bf16_problem(T, D, V)
    gemm_ms = runner.median_ms(lambda: h @ w.T, warm_ms=args.warm_ms)
    print(f"# {args.shape} bf16, GEMM {gemm_ms:.3f} ms")
    ref = None
    if args.check:
        ref = (h.double() @ w.double().T).log_softmax(-1).gather(1, y[:, None]).squeeze(1).float()
    for name in args.variants.split(","):
        cfg = replace(configs.SM90, **VARIANTS[name])
        be = SM90Backend(cfg)
        try:
            with torch.no_grad():
                logp = linear_logp_tp(be, h, w, y, options=LogpOptions())
            torch.cuda.synchronize()
        except Exception as exc:  # a config that does not compile or does not fit
            print(f"{name:>18}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
            continue
        ref = logp if ref is None else ref
        diff = (logp - ref).abs().max().item()
        fwd, fwd_bwd = runner.tp_step_fns(be, h, w, y, LogpOptions(), gy, ge)
        f_r, fb_r, f_s, fb_s = [], [], [], []
        for _ in range(args.rounds):  # each time over the GEMM measured just before it (clock drift cancels)
            g1 = runner.median_ms(lambda: h @ w.T, reps=args.reps, warm_ms=args.warm_ms)
            f_s.append(runner.median_ms(fwd, reps=args.reps, warm_ms=args.warm_ms))
            f_r.append(f_s[-1] / g1)
            if args.fwd_only:
                continue
            g2 = runner.median_ms(lambda: h @ w.T, reps=args.reps, warm_ms=args.warm_ms)
            fb_s.append(runner.median_ms(fwd_bwd, reps=args.reps, warm_ms=args.warm_ms))
            fb_r.append(fb_s[-1] / g2)
        med = statistics.median
        both = f"  fwd+bwd {med(fb_s):7.3f} ms ({med(fb_r):.3f} G)" if fb_s else ""
        print(f"{name:>22}: fwd {med(f_s):7.3f} ms ({med(f_r):.3f} G){both}  |logp - ref| {diff:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
