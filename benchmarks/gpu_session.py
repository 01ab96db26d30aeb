"""One GPU session for the triton / sm90 sources: correctness at real sizes, then timing of config variants.

Run on one CUDA GPU (the device lease is short: everything that belongs together is in this one script):

    python benchmarks/gpu_session.py [--skip-checks] [--skip-variants] [--variants a,b] [--out $OUT]

Phases (each prints a compact table; full records go to ``$OUT/gpu_session.json``):

1. ``checks``   triton and sm90 through the shared TP op against float64 truth and the same-dtype reference:
                odd shapes with bias / temperature / entropy / ignore_index, peaked rows, T*V > 2^31 (with a
                workspace that puts the d_logits index past 2^31) and V*D > 2^31 (weight offsets), bitwise
                run-to-run and batch-independence checks in deterministic mode.
2. ``variants`` forward and forward+backward time of config variants at the target shapes, in GEMM-times of one
                cuBLAS GEMM of the same shape timed in the same run; a per-phase breakdown for the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
os.environ.setdefault("TPLOGP_CHECKS", "fast")

import runner  # noqa: E402
from tplogp.backends.base import ShardCall  # noqa: E402
from tplogp.backends.native import NativeBackend  # noqa: E402
from tplogp.backends.sm90_backend import SM90Backend  # noqa: E402
from tplogp.backends.triton_backend import TritonBackend  # noqa: E402
from tplogp.reference import reference_outputs  # noqa: E402
from tplogp.tp import LogpOptions, linear_logp_tp  # noqa: E402

RECORDS: list[dict] = []
PHASES: set = {"breakdown"}


def record(kind: str, **kw) -> dict:
    kw["kind"] = kind
    RECORDS.append(kw)
    print(json.dumps(kw), flush=True)
    return kw


# ------------------------------------------------------------------------------------------------ checks


def run_op(be, h, w, y, b=None, g=None, ge=None, **opts):
    """logp (+entropy), and grads of (h, w, b) for upstream (g, ge)."""
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    out = linear_logp_tp(be, h, w, y, b, options=LogpOptions(**opts))
    if opts.get("return_entropy"):
        torch.autograd.backward([out.logp, out.entropy], [g, ge])
        logp, ent = out.logp.detach(), out.entropy.detach()
    else:
        out.backward(g)
        logp, ent = out.detach(), None
    return dict(logp=logp, entropy=ent, dh=h.grad, dw=w.grad, db=None if b is None else b.grad)


def ref_op(h, w, y, b, g, ge, mode, temperature=1.0, ignore_index=None, return_entropy=False):
    dt = torch.float64 if mode == "float64" else torch.float32
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    out = reference_outputs(h, w, y, b, mode=mode, temperature=temperature, ignore_index=ignore_index)
    if return_entropy:
        torch.autograd.backward([out.logp, out.entropy], [g.to(dt), ge.to(dt)])
    else:
        out.logp.backward(g.to(dt))
    return dict(logp=out.logp.detach(), entropy=out.entropy.detach() if return_entropy else None, dh=h.grad,
                dw=w.grad, db=None if b is None else b.grad)


def compare(name, res, truth, same):
    row = dict(case=name)
    ok = True
    for k in ("logp", "entropy", "dh", "dw", "db"):
        if res.get(k) is None or truth.get(k) is None:
            continue
        e = runner.rel_err(res[k], truth[k])
        e_ref = runner.rel_err(same[k], truth[k])
        row[f"err_{k}"] = f"{e:.2e}"
        row[f"ref_{k}"] = f"{e_ref:.2e}"
        finite = bool(torch.isfinite(res[k]).all())
        good = finite and e <= 1.1 * e_ref + 1e-6
        ok &= good
    row["pass"] = ok
    return row


def gen(N, D, V, dtype, seed, bias=True, peaked=False, ignore_frac=0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = (torch.randn(N, D, device="cuda", generator=g) * 0.5).to(dtype)
    w = (torch.randn(V, D, device="cuda", generator=g) / D**0.5).to(dtype)
    b = (torch.randn(V, device="cuda", generator=g) * 0.1).to(dtype) if bias else None
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    if peaked:  # every 3rd row: hidden aligned with its target's weight row -> softmax near one-hot
        rows = torch.arange(0, N, 3, device="cuda")
        h[rows] = (w[y[rows]].float() * 40.0).to(dtype)
    ignore_index = None
    if ignore_frac:
        ignore_index = -100
        y = torch.where(torch.rand(N, device="cuda", generator=g) < ignore_frac, torch.full_like(y, -100), y)
    gy = torch.randn(N, device="cuda", generator=g)
    ge = torch.randn(N, device="cuda", generator=g) * 0.3
    return h, w, b, y, gy, ge, ignore_index


def checks(backends) -> None:
    cases = [
        # (name, N, D, V, dtype, bias, peaked, temperature, entropy, ignore_frac): why
        ("bf16-target-small", 4096, 2048, 8192, torch.bfloat16, False, False, 1.0, False, 0.0),  # runbook stress shard
        ("bf16-odd-bias-temp-ent", 1000, 1000, 5003, torch.bfloat16, True, False, 0.7, True, 0.0),  # odd edges
        ("bf16-peaked-ent", 2048, 1024, 32000, torch.bfloat16, True, True, 1.0, True, 0.0),  # entropy near 0
        ("bf16-ignore-half", 2048, 1024, 32000, torch.bfloat16, False, False, 1.0, False, 0.5),
        ("fp32-odd-bias", 515, 333, 4099, torch.float32, True, False, 1.3, True, 0.0),  # ieee fp32 dots
        ("fp16-odd", 777, 512, 6007, torch.float16, True, False, 1.0, False, 0.0),
    ]
    for be in backends:
        for name, N, D, V, dt, bias, peaked, temp, ent, ign in cases:
            try:
                h, w, b, y, gy, ge, ii = gen(N, D, V, dt, seed=len(name) * 7 + N, bias=bias, peaked=peaked,
                                             ignore_frac=ign)
                opts = dict(temperature=temp, return_entropy=ent, ignore_index=ii)
                res = run_op(be, h, w, y, b, gy, ge, **opts)
                truth = ref_op(h, w, y, b, gy, ge, "float64", temp, ii, ent)
                same = ref_op(h, w, y, b, gy, ge, "matching", temp, ii, ent)
                record("check", source=be.name, **compare(name, res, truth, same))
            except Exception as exc:
                record("check", source=be.name, case=name, error=f"{type(exc).__name__}: {exc}"[:400],
                       tb=traceback.format_exc()[-800:])
            torch.cuda.empty_cache()

    # Large-index cases against the native source (fp32 chunks): full references would not fit comfortably.
    big = [
        # T*V > 2^31, and a workspace holding all of V so the d_logits offset n * V passes 2^31
        ("TxV>2^31", 16384, 256, 140000, 8 << 30),
        # V*D > 2^31: weight row offsets past 2^31 elements
        ("VxD>2^31", 512, 16384, 140000, None),
    ]
    nat = NativeBackend()
    for name, N, D, V, ws in big:
        for be in backends:
            try:
                h, w, b, y, gy, ge, _ = gen(N, D, V, torch.bfloat16, seed=7, bias=True)
                res = run_op(be, h, w, y, b, gy, ge, workspace_bytes=ws)
                ref = run_op(nat, h, w, y, b, gy, ge)
                errs = {k: f"{runner.rel_err(res[k], ref[k]):.2e}" for k in ("logp", "dh", "dw", "db")}
                finite = all(bool(torch.isfinite(res[k]).all()) for k in ("logp", "dh", "dw", "db"))
                record("check", source=be.name, case=name, vs="native", **errs,
                       **{"pass": finite and all(float(e) < 2e-2 for e in errs.values())})
                del h, w, b, res, ref
            except Exception as exc:
                record("check", source=be.name, case=name, error=f"{type(exc).__name__}: {exc}"[:400])
            torch.cuda.empty_cache()

    # Determinism: bitwise run to run, and a row's results independent of the other rows.
    for be in backends:
        try:
            h, w, b, y, gy, ge, _ = gen(4096, 2048, 32000, torch.bfloat16, seed=3, bias=True)
            opts = dict(return_entropy=True, deterministic=True)
            r1 = run_op(be, h, w, y, b, gy, ge, **opts)
            r2 = run_op(be, h, w, y, b, gy, ge, **opts)
            same = {k: bool(torch.equal(r1[k], r2[k])) for k in r1 if r1[k] is not None}
            k = 1000
            r3 = run_op(be, h[:k], w, y[:k], b, gy[:k], ge[:k], **opts)
            sub = {f"rows_{key}": bool(torch.equal(r3[key], r1[key][:k])) for key in ("logp", "entropy", "dh")}
            nd1 = run_op(be, h, w, y, b, gy, ge, return_entropy=True)
            nd2 = run_op(be, h, w, y, b, gy, ge, return_entropy=True)
            nondet = {f"default_{key}": bool(torch.equal(nd1[key], nd2[key])) for key in nd1 if nd1[key] is not None}
            record("determinism", source=be.name, **same, **sub, **nondet,
                   **{"pass": all(same.values()) and all(sub.values())})
        except Exception as exc:
            record("determinism", source=be.name, error=f"{type(exc).__name__}: {exc}"[:400])
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- variants


def time_variant(label, be, T, D, V, gemm_ms, reps=10, entropy=False, deterministic=False):
    h, w, y, gy, ge, _ = runner.bf16_problem(T, D, V)
    opts = LogpOptions(return_entropy=entropy, deterministic=deterministic)
    try:
        fwd, fb = runner.tp_step_fns(be, h, w, y, opts, gy, ge)
        f_ms = runner.median_ms(fwd, reps=reps)
        fb_ms = runner.median_ms(fb, reps=reps)
        peak = runner.extra_peak_gib(fb)
        rec = record("variant", label=label, shape=f"{T}x{D}x{V}", entropy=entropy, deterministic=deterministic,
                     fwd_ms=round(f_ms, 3), fwd_bwd_ms=round(fb_ms, 3), gemm_ms=round(gemm_ms, 3),
                     fwd_gemms=round(f_ms / gemm_ms, 3), fwd_bwd_gemms=round(fb_ms / gemm_ms, 3),
                     extra_peak_gib=round(peak, 3))
    except Exception as exc:
        rec = record("variant", label=label, shape=f"{T}x{D}x{V}", error=f"{type(exc).__name__}: {exc}"[:400],
                     tb=traceback.format_exc()[-1500:])
    torch.cuda.empty_cache()
    return rec


def breakdown(label, be, T, D, V, gemm_ms, reps=10):
    """Time the pieces of one call with the backend primitives directly (no TP layer)."""
    h, w, y, gy, _, _ = runner.bf16_problem(T, D, V)
    call = ShardCall()
    st = be.forward_stats(h, w, None, y, call)
    rmax, lsum = st.row_max, st.sum_exp.log()
    out = dict(label=label, shape=f"{T}x{D}x{V}", gemm_ms=round(gemm_ms, 3))
    pieces = {
        "forward_stats": lambda: be.forward_stats(h, w, None, y, call),
        "bwd_all": lambda: be.backward(h, w, None, y, rmax, lsum, gy, None, None, None, call, (True, True, False)),
        "bwd_dh_only": lambda: be.backward(h, w, None, y, rmax, lsum, gy, None, None, None, call, (True, False, False)),
        "bwd_dw_only": lambda: be.backward(h, w, None, y, rmax, lsum, gy, None, None, None, call, (False, True, False)),
        "bwd_all_deterministic": lambda: be.backward(h, w, None, y, rmax, lsum, gy, None, None, None,
                                                     ShardCall(deterministic=True), (True, True, False)),
    }
    for k, fn in pieces.items():
        try:
            ms = runner.median_ms(fn, reps=reps)
            out[k + "_ms"] = round(ms, 3)
            out[k + "_gemms"] = round(ms / gemm_ms, 3)
        except Exception as exc:
            out[k + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
    record("breakdown", **out)


def overhead(label, be, T, D, V, gemm_ms, reps=20):
    """Host cost per call (enqueue only, no sync) and pure GPU time (CUDA-graph replay) of the primitives."""
    h, w, y, gy, _, _ = runner.bf16_problem(T, D, V)
    call = ShardCall()
    st = be.forward_stats(h, w, None, y, call)
    rmax, lsum = st.row_max, st.sum_exp.log()
    out = dict(label=label, shape=f"{T}x{D}x{V}", gemm_ms=round(gemm_ms, 3))
    pieces = {
        "fwd_stats": lambda: be.forward_stats(h, w, None, y, call),
        "bwd_all": lambda: be.backward(h, w, None, y, rmax, lsum, gy, None, None, None, call, (True, True, False)),
        "tp_fwd": lambda: linear_logp_tp(be, h, w, y, options=LogpOptions()),
    }
    for k, fn in pieces.items():
        try:
            with torch.no_grad():
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                host_ms = (time.perf_counter() - t0) * 1e3 / reps
                torch.cuda.synchronize()
                eager_ms = runner.median_ms(fn, reps=reps)
                out[k + "_host_ms"] = round(host_ms, 3)
                out[k + "_eager_ms"] = round(eager_ms, 3)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    fn()
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                graph_ms = runner.median_ms(graph.replay, reps=reps)
                out[k + "_graph_ms"] = round(graph_ms, 3)
                out[k + "_graph_gemms"] = round(graph_ms / gemm_ms, 3)
                del graph
        except Exception as exc:
            out[k + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
    record("overhead", **out)


def variant_table():
    from tplogp.kernels import configs

    base = configs.select(torch.device("cuda"))
    sm = configs.SM90
    r = dataclasses.replace
    return {
        "triton-default": TritonBackend(),
        "sm90-default": SM90Backend(),
        "sm90-ws": SM90Backend(r(sm, warp_specialize=True)),
        # 128x128 tiles, 3 stages: 96 KiB smem and 64 acc regs/thread -> two CTAs per SM overlap epilogues
        "sm90-bv128-s3": SM90Backend(r(sm, block_v=128, num_stages=3, bwd_block_v=128, bwd_num_stages=3)),
        "sm90-bv128-s3-ws": SM90Backend(r(sm, block_v=128, num_stages=3, bwd_block_v=128, bwd_num_stages=3,
                                          warp_specialize=True)),
        # 64x256x32 tiles, one warpgroup, 4 stages: 80 KiB smem -> two CTAs per SM
        "sm90-bn64-w4": SM90Backend(r(sm, block_n=64, block_d=32, num_warps=4, num_stages=4, bwd_block_n=64,
                                      bwd_block_d=32, bwd_num_warps=4, bwd_num_stages=4)),
        "sm90-g8": SM90Backend(r(sm, group_n=8)),
        "sm90-ws-g8": SM90Backend(r(sm, group_n=8, warp_specialize=True)),
        "sm90-ws-g16": SM90Backend(r(sm, group_n=16, warp_specialize=True)),
        "sm90-ws-s4": SM90Backend(r(sm, warp_specialize=True, num_stages=4, bwd_num_stages=4)),
        "triton-bv128-s3": TritonBackend(r(base, block_v=128, num_stages=3, bwd_block_v=128, bwd_num_stages=3)),
    }


def variants(names, shapes, reps) -> None:
    table = variant_table()
    for T, D, V in shapes:
        h = torch.randn(T, D, device="cuda").to(torch.bfloat16)
        w = torch.randn(V, D, device="cuda").to(torch.bfloat16)
        gemm_ms = runner.median_ms(lambda: h @ w.T, reps=reps)
        record("gemm", shape=f"{T}x{D}x{V}", gemm_ms=round(gemm_ms, 3))
        for label in names:
            time_variant(label, table[label], T, D, V, gemm_ms, reps=reps)
        gemm_ms = runner.median_ms(lambda: h @ w.T, reps=reps)  # again: drift check
        record("gemm", shape=f"{T}x{D}x{V}", gemm_ms_again=round(gemm_ms, 3))
        del h, w
        for label in names:
            if "breakdown" in PHASES:
                breakdown(label, table[label], T, D, V, gemm_ms, reps=reps)
            if "overhead" in PHASES:
                overhead(label, table[label], T, D, V, gemm_ms)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--skip-variants", action="store_true")
    ap.add_argument("--check-sources", default="triton,sm90")
    ap.add_argument("--phases", default="breakdown", help="extra per-variant phases: breakdown,overhead")
    ap.add_argument("--variants", default="triton-default,sm90-default,sm90-ws,sm90-bv128-s4,sm90-g8")
    ap.add_argument("--shapes", default="8192x4096x128256,4096x2048x8192")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = ap.parse_args()
    info = runner.machine_info()
    record("machine", **info)
    PHASES.clear()
    PHASES.update(p for p in args.phases.split(",") if p)
    t0 = time.time()
    try:
        if not args.skip_checks:
            srcs = {"triton": TritonBackend, "sm90": SM90Backend}
            checks([srcs[x]() for x in args.check_sources.split(",") if x])
            record("timing", phase="checks", elapsed_s=round(time.time() - t0, 1))
        if not args.skip_variants:
            shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
            variants([v for v in args.variants.split(",") if v], shapes, args.reps)
            record("timing", phase="variants", elapsed_s=round(time.time() - t0, 1))
    finally:
        runner.write_json(os.path.join(args.out, "gpu_session.json"), dict(machine=info, records=RECORDS))
    print("\n# summary")
    for r in RECORDS:
        if r["kind"] in ("check", "determinism"):
            print(f"{r['kind']:>11} {r.get('source', ''):>6} {r.get('case', ''):>24} "
                  f"{'PASS' if r.get('pass') else 'FAIL'} {r.get('error', '')[:120]}")
        elif r["kind"] == "breakdown":
            print(f"  breakdown {r['label']:>18} {r['shape']:>18} " + " ".join(
                f"{k[:-6]}={r[k]:.2f}G" for k in r if k.endswith("_gemms")))
        elif r["kind"] == "overhead":
            print(f"   overhead {r['label']:>18} {r['shape']:>18} " + " ".join(
                f"{k}={r[k]}" for k in r if k.endswith("_ms") and k != "gemm_ms") + " "
                + " ".join(str(r[k])[:80] for k in r if k.endswith("_error")))
        elif r["kind"] == "variant":
            print(f"    variant {r['label']:>18} {r['shape']:>18} "
                  + (f"fwd {r['fwd_gemms']:.2f} G  fwd+bwd {r['fwd_bwd_gemms']:.2f} G  ({r['fwd_ms']:.2f} / "
                     f"{r['fwd_bwd_ms']:.2f} ms, GEMM {r['gemm_ms']:.2f})  extra {r['extra_peak_gib']:.2f} GiB"
                     if "error" not in r else r["error"][:150]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
