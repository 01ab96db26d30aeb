"""One short H200 session (run 2): checks of the new kernel options, then baseline vs variants in the same process.

    python benchmarks/gpu_run2.py --out $OUT [--budget-s 230]

Phases (JSON written after each, to ``$OUT/gpu_run2.json``; a short table printed last):
1. checks   sm90 (and triton) with the lean epilogue + overlapped backward against float64 truth and the same-dtype
            reference; a many-chunk case (small workspace) so the overlap runs; deterministic bitwise / batch
            independence; default-mode run-to-run bits with the overlap.
2. ab       sm90 base (run-1 default) vs lean / overlap / lean+overlap at the three target shapes, two interleaved
            rounds, fwd and fwd+bwd in GEMM-times of a cuBLAS GEMM timed in the same run.
3. rl       entropy, 50% ignored, deterministic=True rows at 8192x4096x128256 (base and lean+overlap).
4. d2048    forward config variants at 4096x2048x131072.
5. host     small shape: host cost per phase (enqueue only), eager and CUDA-graph times, cProfile of the TP forward,
            and the same with the Triton kernels stubbed (launcher + TP Python and torch ops only).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pstats
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
os.environ.setdefault("TPLOGP_CHECKS", "fast")

import torch  # noqa: E402

import gpu_session as gs  # noqa: E402
import runner  # noqa: E402
from tplogp.backends.sm90_backend import SM90Backend  # noqa: E402
from tplogp.backends.triton_backend import TritonBackend  # noqa: E402
from tplogp.kernels import configs  # noqa: E402
from tplogp.tp import LogpOptions, linear_logp_tp  # noqa: E402

R = dataclasses.replace
SM = configs.SM90
CFG = {
    "base": SM,
    "lean": R(SM, lean_epilogue=True),
    "ovl": R(SM, bwd_overlap=True),
    "lean-ovl": R(SM, lean_epilogue=True, bwd_overlap=True),
}
SHAPES = [(8192, 4096, 128256), (4096, 2048, 131072), (4096, 2048, 8192)]
OUT = "results"
T0 = time.time()


def save():
    runner.write_json(os.path.join(OUT, "gpu_run2.json"), dict(machine=gs.RECORDS[0] if gs.RECORDS else {},
                                                               records=gs.RECORDS))


def elapsed():
    return time.time() - T0


def checks():
    be_new = SM90Backend(CFG["lean-ovl"])
    be_tri = TritonBackend(R(configs.select(torch.device("cuda")), lean_epilogue=True, bwd_overlap=True))
    cases = [
        # name, N, D, V, dtype, bias, peaked, temperature, entropy, ignore_frac, workspace
        ("bf16-target-small", 4096, 2048, 8192, torch.bfloat16, False, False, 1.0, False, 0.0, None),
        ("bf16-odd-bias-temp-ent-chunks", 1000, 1000, 5003, torch.bfloat16, True, False, 0.7, True, 0.0, 1 << 20),
        ("bf16-peaked-ent-chunks", 2048, 1024, 32000, torch.bfloat16, True, True, 1.0, True, 0.0, 8 << 20),
        ("bf16-ignore-half", 2048, 1024, 32000, torch.bfloat16, False, False, 1.0, False, 0.5, 8 << 20),
        ("fp32-odd-bias", 515, 333, 4099, torch.float32, True, False, 1.3, True, 0.0, 1 << 20),
        ("fp16-aligned-chunks", 768, 512, 6144, torch.float16, True, False, 1.0, False, 0.0, 1 << 20),
    ]
    for be, label, sel in ((be_new, "sm90-lean-ovl", None), (be_tri, "triton-lean-ovl", {0, 2})):
        for i, (name, N, D, V, dt, bias, peaked, temp, ent, ign, ws) in enumerate(cases):
            if sel is not None and i not in sel:
                continue
            try:
                h, w, b, y, gy, ge, ii = gs.gen(N, D, V, dt, seed=len(name) * 7 + N, bias=bias, peaked=peaked,
                                                ignore_frac=ign)
                opts = dict(temperature=temp, return_entropy=ent, ignore_index=ii)
                res = gs.run_op(be, h, w, y, b, gy, ge, workspace_bytes=ws, **opts)
                truth = gs.ref_op(h, w, y, b, gy, ge, "float64", temp, ii, ent)
                same = gs.ref_op(h, w, y, b, gy, ge, "matching", temp, ii, ent)
                gs.record("check", source=label, **gs.compare(name, res, truth, same))
            except Exception as exc:
                gs.record("check", source=label, case=name, error=f"{type(exc).__name__}: {exc}"[:400],
                          tb=traceback.format_exc()[-1200:])
            torch.cuda.empty_cache()
    try:  # determinism: deterministic=True bitwise + batch independence; default mode (overlap) run to run
        be = be_new
        h, w, b, y, gy, ge, _ = gs.gen(4096, 2048, 32000, torch.bfloat16, seed=3, bias=True)
        opts = dict(return_entropy=True, deterministic=True, workspace_bytes=8 << 20)
        r1 = gs.run_op(be, h, w, y, b, gy, ge, **opts)
        r2 = gs.run_op(be, h, w, y, b, gy, ge, **opts)
        same = {k: bool(torch.equal(r1[k], r2[k])) for k in r1 if r1[k] is not None}
        k = 1000
        r3 = gs.run_op(be, h[:k], w, y[:k], b, gy[:k], ge[:k], **opts)
        sub = {f"rows_{key}": bool(torch.equal(r3[key], r1[key][:k])) for key in ("logp", "entropy", "dh")}
        o = dict(return_entropy=True, workspace_bytes=8 << 20)
        nd1 = gs.run_op(be, h, w, y, b, gy, ge, **o)
        nd2 = gs.run_op(be, h, w, y, b, gy, ge, **o)
        nondet = {f"default_{key}": bool(torch.equal(nd1[key], nd2[key])) for key in nd1 if nd1[key] is not None}
        errs = {f"ovl_vs_det_{key}": f"{runner.rel_err(nd1[key], r1[key]):.1e}" for key in ("dh", "dw", "db")}
        gs.record("determinism", source="sm90-lean-ovl", **same, **sub, **nondet, **errs,
                  **{"pass": all(same.values()) and all(sub.values())})
    except Exception as exc:
        gs.record("determinism", source="sm90-lean-ovl", error=f"{type(exc).__name__}: {exc}"[:400],
                  tb=traceback.format_exc()[-1200:])
    torch.cuda.empty_cache()


def inputs(T, D, V, ignore_frac=0.0):
    return runner.bf16_problem(T, D, V, ignore_frac=ignore_frac, ge_scale=0.1)


def tv(label, be, data, gemm_ms, shape, reps=10, entropy=False, deterministic=False, fwd_only=False, rnd=0):
    h, w, y, gy, ge, ii = data
    opts = LogpOptions(return_entropy=entropy, deterministic=deterministic, ignore_index=ii)
    rec = dict(label=label, shape=shape, round=rnd, entropy=entropy, deterministic=deterministic,
               ignore=ii is not None, gemm_ms=round(gemm_ms, 3))
    try:
        fwd, fb = runner.tp_step_fns(be, h, w, y, opts, gy, ge)
        f_ms = runner.median_ms(fwd, reps=reps)
        rec.update(fwd_ms=round(f_ms, 3), fwd_gemms=round(f_ms / gemm_ms, 3))
        if not fwd_only:
            fb_ms = runner.median_ms(fb, reps=reps)
            rec.update(fwd_bwd_ms=round(fb_ms, 3), fwd_bwd_gemms=round(fb_ms / gemm_ms, 3),
                       extra_peak_gib=round(runner.extra_peak_gib(fb), 3))
    except Exception as exc:
        rec.update(error=f"{type(exc).__name__}: {exc}"[:400], tb=traceback.format_exc()[-1200:])
    return gs.record("variant", **rec)


def gemm_time(data, reps=10):
    h, w = data[0], data[1]
    return runner.median_ms(lambda: h @ w.T, reps=reps)


def ab(budget_s):
    bes = {k: SM90Backend(c) for k, c in CFG.items()}
    for T, D, V in SHAPES:
        shape = f"{T}x{D}x{V}"
        data = inputs(T, D, V)
        for rnd in range(2):
            gm = gemm_time(data)
            gs.record("gemm", shape=shape, round=rnd, gemm_ms=round(gm, 3))
            order = list(bes) if rnd == 0 else list(reversed(list(bes)))
            for k in order:
                tv(k, bes[k], data, gm, shape, rnd=rnd)
            save()
            if elapsed() > budget_s:
                return
        del data
        torch.cuda.empty_cache()


def rl_rows():
    T, D, V = SHAPES[0]
    shape = f"{T}x{D}x{V}"
    data = inputs(T, D, V)
    gm = gemm_time(data)
    gs.record("gemm", shape=shape, phase="rl", gemm_ms=round(gm, 3))
    for k in ("base", "lean-ovl"):
        be = SM90Backend(CFG[k])
        tv(k, be, data, gm, shape, entropy=True)
        tv(k, be, data, gm, shape, deterministic=True)
    del data
    data = inputs(T, D, V, ignore_frac=0.5)
    for k in ("base", "lean-ovl"):
        tv(k, SM90Backend(CFG[k]), data, gm, shape)
    del data
    torch.cuda.empty_cache()
    T, D, V = SHAPES[2]
    shape = f"{T}x{D}x{V}"
    for frac in (0.0, 0.5):
        data = inputs(T, D, V, ignore_frac=frac)
        gm = gemm_time(data)
        for k in ("base", "lean-ovl"):
            tv(k, SM90Backend(CFG[k]), data, gm, shape, entropy=frac == 0.0)
    torch.cuda.empty_cache()


def d2048():
    T, D, V = SHAPES[1]
    shape = f"{T}x{D}x{V}"
    data = inputs(T, D, V)
    gm = gemm_time(data)
    gs.record("gemm", shape=shape, phase="d2048", gemm_ms=round(gm, 3))
    lean = CFG["lean"]
    for label, cfg in (("lean", lean), ("lean-g16", R(lean, group_n=16)), ("lean-g64", R(lean, group_n=64)),
                       ("lean-s4", R(lean, num_stages=4)), ("lean-nows", R(lean, warp_specialize=False)),
                       ("lean-again", lean)):
        tv(label, SM90Backend(cfg), data, gm, shape, fwd_only=True)
    torch.cuda.empty_cache()


def host():
    """Small shape, the default sm90 config: host / eager / graph per primitive and for the TP forward, and a
    cProfile of 200 TP forwards (host_profile.py runs in its own process, see the run command)."""
    T, D, V = SHAPES[2]
    data = inputs(T, D, V)
    gm = gemm_time(data)
    gs.overhead("base", SM90Backend(CFG["base"]), T, D, V, gm)
    h, w, y = data[0], data[1], data[2]
    be = SM90Backend(CFG["base"])
    with torch.no_grad():
        for _ in range(5):
            linear_logp_tp(be, h, w, y, options=LogpOptions())
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            linear_logp_tp(be, h, w, y, options=LogpOptions())
        pr.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
    with open(os.path.join(OUT, "host_cprofile.txt"), "w") as f:
        f.write(buf.getvalue())


def main() -> int:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--budget-s", type=float, default=215)
    ap.add_argument("--phases", default="checks,ab,host,rl,d2048")
    args = ap.parse_args()
    OUT = args.out
    gs.record("machine", **runner.machine_info())
    phases = [p for p in args.phases.split(",") if p]
    fns = dict(checks=checks, ab=lambda: ab(args.budget_s), rl=rl_rows, d2048=d2048, host=host)
    try:
        for p in phases:
            if elapsed() > args.budget_s:
                gs.record("timing", phase=p, skipped="budget")
                continue
            try:
                fns[p]()
            except Exception as exc:
                gs.record("phase_error", phase=p, error=f"{type(exc).__name__}: {exc}"[:400],
                          tb=traceback.format_exc()[-1500:])
            gs.record("timing", phase=p, elapsed_s=round(elapsed(), 1))
            save()
    finally:
        save()
    print("\n# summary")
    for r in gs.RECORDS:
        if r["kind"] in ("check", "determinism"):
            print(f"{r['kind'][:5]} {r.get('source', ''):>16} {r.get('case', ''):>30} "
                  f"{'PASS' if r.get('pass') else 'FAIL'} {r.get('error', '')[:150]}")
        elif r["kind"] == "variant":
            tag = ("E" if r.get("entropy") else "") + ("I" if r.get("ignore") else "") + \
                  ("D" if r.get("deterministic") else "")
            if "error" in r:
                print(f"var {r['label']:>11} {r['shape']:>17} {tag:3} ERR {r['error'][:150]}")
            else:
                print(f"var {r['label']:>11} {r['shape']:>17} {tag:3} r{r.get('round', 0)} fwd {r['fwd_gemms']:.3f}"
                      + (f" fb {r['fwd_bwd_gemms']:.3f} ({r['fwd_ms']:.3f}/{r['fwd_bwd_ms']:.3f} ms, G "
                         f"{r['gemm_ms']:.3f}) {r['extra_peak_gib']:.3f}GiB" if "fwd_bwd_ms" in r else
                         f" ({r['fwd_ms']:.3f} ms, G {r['gemm_ms']:.3f})"))
        elif r["kind"] == "overhead":
            print(f"ovh {r['label']:>11} " + " ".join(f"{k}={r[k]}" for k in r if k.endswith("_ms")))
        elif r["kind"] in ("timing", "phase_error"):
            print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
