"""How fast, how lean and how accurate is linear_logp per source, against one cuBLAS GEMM and torch eager?

Per shape (T x D x V, bf16, one GPU, per-token random upstream gradient) and source, prints and saves:
forward ms, forward+backward ms, both in GEMM-times (one cuBLAS ``[T,D] x [D,V]`` bf16 matmul timed in the same
run: rounds of GEMM, forward, GEMM, forward+backward, each time divided by the GEMM just before it, median over
rounds, the sources interleaved within each round), effective TFLOP/s, extra peak GiB, and relative errors of
logp / d_hidden / d_W against float64.

Power state: an H200 under sustained tensor-core load runs at its 700 W cap, where the SM clock falls from 1980 MHz
to ~1450-1620 MHz and the same GEMM goes from 2.79 to 3.31 ms (benchmarks/clock_probe.py). A GEMM timed after an
idle stretch (host-side checks, another source's setup) runs at boost clock, so every timing here starts after
``--warm-ms`` of back-to-back calls of the same function: GEMM and sources are compared in the same state.

Two timing modes, both reported: synced (a host sync after every call, as ../shared/anchor_bench.py times the
anchors: a sample includes the host's launch latency) and back-to-back (no sync between calls, the host runs ahead
as in a training loop: a sample is GPU time unless the host is the slower side; triton.testing.do_bench's method).

FLOP accounting (one GEMM = 2*T*D*V): forward = 1 GEMM, forward+backward = 4 GEMMs (forward, recompute, d_hidden,
d_W: the floor for a per-token op with O(T) saved state). "Effective TFLOP/s" divides those counts by the time, so
a materializing implementation (3 GEMMs) is credited with 4 too: compare times, not only rates.

Usage (one GPU):  python benchmarks/bench_linear_logp.py [--shapes 8192x4096x128256,...] [--sources ...]
                  [--entropy] [--ignore-frac 0.5] [--out results/bench.json] [--plot results/bench.png]
Sources: torch_eager (materialized logits, fp32 log_softmax), native, triton, sm90 (tplogp), liger, cce
(when installed). TPLOGP_CHECKS=fast is set so the timed path has no host syncs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
os.environ.setdefault("TPLOGP_CHECKS", "fast")

import runner  # noqa: E402

DEFAULT_SHAPES = ((8192, 4096, 128256), (4096, 2048, 131072), (4096, 2048, 8192))
DEFAULT_SOURCES = ("torch_eager", "triton", "sm90", "liger", "cce")


def make_source(name: str, backend=None) -> Optional[Callable]:
    """A callable (h, w, y, return_entropy, ignore_index) -> logp or (logp, entropy); None if unavailable."""
    if name == "torch_eager":
        return runner.torch_eager
    if name == "sm90_pingpong":  # the sm90 source with the opt-in Gluon ping-pong forward
        from tplogp.backends.sm90_backend import SM90Backend
        from tplogp.kernels import configs

        return make_source("sm90", SM90Backend(config=configs.SM90_PINGPONG))
    if name in ("native", "triton", "sm90") or backend is not None:
        from tplogp.kernel_registry import get_backend
        from tplogp.tp import LogpOptions, linear_logp_tp

        be = backend if backend is not None else get_backend(name)
        why = be.unavailable_reason(torch.device("cuda"))
        if why is not None:
            print(f"# {name} unavailable: {why}")
            return None

        def run(h, w, y, *, return_entropy=False, ignore_index=None, deterministic=False):
            opts = LogpOptions(return_entropy=return_entropy, ignore_index=ignore_index, deterministic=deterministic)
            out = linear_logp_tp(be, h, w, y, options=opts)
            return (out.logp, out.entropy) if return_entropy else out

        return run
    if name == "liger":
        try:
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as L
        except Exception as exc:
            print(f"# liger unavailable: {exc!r}")
            return None
        return lambda h, w, y, return_entropy=False, ignore_index=None: -L.apply(
            h, w, y, None, None, -100 if ignore_index is None else ignore_index, 0.0, 0.0, "none")[0]
    if name == "cce":
        try:
            from cut_cross_entropy import linear_cross_entropy
        except Exception as exc:
            print(f"# cce unavailable: {exc!r}")
            return None
        return lambda h, w, y, return_entropy=False, ignore_index=None: -linear_cross_entropy(
            h, w, y, reduction="none", filter_eps=None, **({} if ignore_index is None else
                                                             {"ignore_index": ignore_index}))
    raise KeyError(f"unknown source {name!r}")


def float64_truth(h, w, y, gy, ge, return_entropy: bool, ignore_index):
    """logp (and entropy), d_hidden, d_W in float64 (tplogp.reference, mode float64) through autograd."""
    from tplogp.reference import reference_outputs

    hd = h.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    out = reference_outputs(hd, wd, y, mode="float64", ignore_index=ignore_index)
    if return_entropy:
        torch.autograd.backward([out.logp, out.entropy], [gy.double(), ge.double()])
    else:
        out.logp.backward(gy.double())
    res = dict(logp=out.logp.detach(), entropy=out.entropy.detach() if return_entropy else None, dh=hd.grad,
               dw=wd.grad)
    del hd, wd, out
    return res


def bench_shape(T, D, V, sources, *, return_entropy=False, ignore_frac=0.0, reps=10, check=True,
                extra_sources: Optional[dict] = None, rounds: int = 3, warm_ms: float = 300.0) -> list[dict]:
    h, w, y, gy, ge, ignore_index = runner.bf16_problem(T, D, V, ignore_frac=ignore_frac, ge_scale=0.1)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()

    def gemm():
        return h @ w.T

    gemm_ms = runner.median_ms(gemm, reps=reps, warm_ms=warm_ms)
    truth = float64_truth(h, w, y, gy, ge, return_entropy, ignore_index) if check else None
    torch.cuda.empty_cache()
    rows = [dict(source="cublas_gemm", T=T, D=D, V=V, fwd_ms=round(gemm_ms, 3))]
    print(f"# {T}x{D}x{V} entropy={return_entropy} ignore_frac={ignore_frac}: one cuBLAS GEMM {gemm_ms:.3f} ms",
          flush=True)
    table = [(name, make_source(name)) for name in sources]
    table += list((extra_sources or {}).items())
    one_gemm_flop = 2.0 * T * D * V
    kw = dict(return_entropy=return_entropy, ignore_index=ignore_index)
    live = []  # (row, fwd, fwd_bwd, samples) of the sources that ran their checks

    def step_fns(fn):
        def fwd():
            return fn(h, w, y, **kw)

        def fwd_bwd():
            out = fn(hg, wg, y, **kw)
            if return_entropy:
                torch.autograd.backward([out[0], out[1]], [gy, ge])
            else:
                out.backward(gy)
            hg.grad = wg.grad = None

        return fwd, fwd_bwd

    for name, fn in table:
        if fn is None:
            continue
        row = dict(source=name, T=T, D=D, V=V, entropy=return_entropy, ignore_frac=ignore_frac)
        rows.append(row)
        try:
            if check:
                out = fn(hg, wg, y, **kw)
                if return_entropy:
                    torch.autograd.backward([out[0], out[1]], [gy, ge])
                    row["err_entropy"] = runner.rel_err(out[1].detach(), truth["entropy"])
                    out = out[0]
                else:
                    out.backward(gy)
                row["err_logp"] = runner.rel_err(out.detach(), truth["logp"])
                row["err_d_hidden"] = runner.rel_err(hg.grad, truth["dh"])
                row["err_d_weight"] = runner.rel_err(wg.grad, truth["dw"])
                hg.grad = wg.grad = None
                del out
            live.append((row, *step_fns(fn), {k + b: [] for k in ("f_s", "fb_s", "f_r", "fb_r", "g_s")
                                              for b in ("", "_b2b")}))
        except Exception as exc:  # one broken source must not hide the others' numbers
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(fmt_row(row), flush=True)
        torch.cuda.empty_cache()
    # Rounds of (GEMM, forward, GEMM, forward+backward) per source and timing mode, the sources interleaved inside
    # each round in a rotating order: each time is divided by the GEMM measured just before it, and every source is
    # sampled across the whole run, so the GPU's clock and power drift falls on all sources alike instead of on
    # whichever ran last. Each timing starts after `warm_ms` of back-to-back calls of the same function, so the GEMM
    # and the sources are timed in the same (power-capped) state.
    for i_round in range(rounds):
        order = live[i_round % len(live):] + live[:i_round % len(live)] if live else []
        for row, fwd, fwd_bwd, smp in order:
            if "error" in row:
                continue
            try:
                for b2b, key in ((False, ""), (True, "_b2b")):
                    def t(fn, b2b=b2b):
                        return runner.median_ms(fn, reps=reps, warm_ms=warm_ms, back_to_back=b2b)

                    g1 = t(gemm)
                    with torch.no_grad():
                        f_ms = t(fwd)
                    g2 = t(gemm)
                    fb_ms = t(fwd_bwd)
                    smp["g_s" + key] += [g1, g2]
                    smp["f_s" + key].append(f_ms)
                    smp["fb_s" + key].append(fb_ms)
                    smp["f_r" + key].append(f_ms / g1)
                    smp["fb_r" + key].append(fb_ms / g2)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    med = statistics.median
    for row, fwd, fwd_bwd, smp in live:
        if "error" not in row:
            try:
                peak = runner.extra_peak_gib(fwd_bwd)
                f_ms, fb_ms = med(smp["f_s"]), med(smp["fb_s"])
                row.update(fwd_ms=round(f_ms, 3), fwd_bwd_ms=round(fb_ms, 3), gemm_ms=round(med(smp["g_s"]), 3),
                           gemm_samples_ms=[round(x, 4) for x in smp["g_s"]],
                           fwd_gemms=round(med(smp["f_r"]), 3), fwd_bwd_gemms=round(med(smp["fb_r"]), 3),
                           fwd_ms_b2b=round(med(smp["f_s_b2b"]), 3), fwd_bwd_ms_b2b=round(med(smp["fb_s_b2b"]), 3),
                           gemm_ms_b2b=round(med(smp["g_s_b2b"]), 3),
                           fwd_gemms_b2b=round(med(smp["f_r_b2b"]), 3),
                           fwd_bwd_gemms_b2b=round(med(smp["fb_r_b2b"]), 3),
                           fwd_tflops=round(one_gemm_flop / f_ms / 1e9, 1),
                           fwd_bwd_tflops=round(4 * one_gemm_flop / fb_ms / 1e9, 1),
                           extra_peak_gib=round(peak, 3), warm_ms=warm_ms)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            torch.cuda.empty_cache()
        print(fmt_row(row), flush=True)
    # memory allowance of the issue: size of d_W + d_hidden + 256 MiB
    allowance = (V * D + T * D) * h.element_size() / 2**30 + 0.25
    for r in rows:
        r["allowance_gib"] = round(allowance, 3)
    return rows


def fmt_row(r: dict) -> str:
    if "error" in r:
        return f"{r['source']:>22} | ERROR {r['error']}"
    if "fwd_bwd_ms" not in r:
        return f"{r['source']:>22} | fwd {r['fwd_ms']:.3f} ms"
    errs = " ".join(f"{k[4:]}={r[k]:.1e}" for k in ("err_logp", "err_d_hidden", "err_d_weight", "err_entropy")
                    if k in r)
    b2b = (f" | back-to-back fwd {r['fwd_gemms_b2b']:.2f} G, fwd+bwd {r['fwd_bwd_gemms_b2b']:.2f} G"
           if "fwd_gemms_b2b" in r else "")
    return (f"{r['source']:>22} | fwd {r['fwd_ms']:8.3f} ms ({r['fwd_gemms']:.2f} G) | fwd+bwd {r['fwd_bwd_ms']:8.3f} ms"
            f" ({r['fwd_bwd_gemms']:.2f} G, {r['fwd_bwd_tflops']:.0f} TF/s) | extra {r['extra_peak_gib']:.3f} GiB | {errs}"
            f"{b2b}")


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        print(f"# no plot: {exc!r}")
        return
    shapes = sorted({(r["T"], r["D"], r["V"], r.get("entropy", False), r.get("ignore_frac", 0.0)) for r in rows
                     if "fwd_bwd_ms" in r})
    fig, axes = plt.subplots(len(shapes), 2, figsize=(12, 3.2 * max(1, len(shapes))), squeeze=False)
    for i, key in enumerate(shapes):
        sel = [r for r in rows if "fwd_bwd_ms" in r and (r["T"], r["D"], r["V"], r.get("entropy", False),
                                                         r.get("ignore_frac", 0.0)) == key]
        names = [r["source"] for r in sel]
        axes[i][0].barh(names, [r["fwd_bwd_gemms"] for r in sel], label="fwd+bwd")
        axes[i][0].barh(names, [r["fwd_gemms"] for r in sel], label="fwd")
        if all("fwd_bwd_gemms_b2b" in r for r in sel):
            axes[i][0].plot([r["fwd_bwd_gemms_b2b"] for r in sel], names, "k|", ms=14, label="fwd+bwd back-to-back")
        axes[i][0].axvline(4.0, color="k", ls="--", lw=0.8)
        axes[i][0].set_xlabel("time in cuBLAS GEMM-times, synced (bars) and back-to-back (ticks); dashed: 4-GEMM floor")
        axes[i][0].set_title(f"{key[0]}x{key[1]}x{key[2]} ent={key[3]} ign={key[4]}")
        axes[i][0].legend(fontsize=7)
        axes[i][1].barh(names, [r["extra_peak_gib"] for r in sel])
        axes[i][1].axvline(sel[0]["allowance_gib"], color="k", ls="--", lw=0.8)
        axes[i][1].set_xlabel("extra peak GiB (dashed: d_W + d_hidden + 256 MiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"# plot written to {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in DEFAULT_SHAPES))
    ap.add_argument("--sources", default=",".join(DEFAULT_SOURCES))
    ap.add_argument("--entropy", action="store_true", help="also return (and differentiate) the entropy")
    ap.add_argument("--ignore-frac", type=float, default=0.0, help="fraction of targets set to ignore_index")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of (GEMM, fwd, GEMM, fwd+bwd); GEMM-times are medians of per-round ratios")
    ap.add_argument("--warm-ms", type=float, default=300.0,
                    help="GPU milliseconds of back-to-back calls before each timing (power-capped steady state; 0: off)")
    ap.add_argument("--no-check", action="store_true", help="skip the float64 error columns")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "results"), "bench_linear_logp.json"))
    ap.add_argument("--plot", default=None, help="PNG path (default: beside --out)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    sources = [s for s in args.sources.split(",") if s]
    info = runner.machine_info()
    print("#", info, flush=True)
    rows = []
    for T, D, V in shapes:
        rows += bench_shape(T, D, V, sources, return_entropy=args.entropy, ignore_frac=args.ignore_frac,
                            reps=args.reps, check=not args.no_check, rounds=args.rounds, warm_ms=args.warm_ms)
    runner.write_json(args.out, dict(machine=info, rows=rows))
    plot(rows, args.plot or os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
