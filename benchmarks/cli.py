"""``python -m benchmarks op|tp|floors|memory|plugin|integrations|report [options]``: the suite's
one entry point.

Every measuring subcommand prints its rows and appends them to ``<out>/results.jsonl`` (default
``benchmarks/results``); ``op`` also redraws the Pareto plots there. ``--smoke`` runs the same code
on tiny problems in seconds (what the test suite runs on CPU). ``--base REV`` runs the same
measurement on this tree and on ``REV`` (a temporary git worktree), interleaved, and prints per-row
ratios (:mod:`benchmarks.ab`). ``report`` regenerates docs/performance.md from the results file.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from . import runner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OP_SHAPES = "8192x4096x128256,4096x4096x128256,8192x4096x32768,4096x2048x8192"
OP_SMOKE_SHAPES = "64x32x320"
OP_BUDGETS = "default,keep:0.5,keep:1,chunk:4096"
OP_SMOKE_BUDGETS = "default,16KiB,keep:1,chunk:16"
FLOOR_SHAPES = "8192x4096x128256,4096x4096x128256,8192x4096x32768"


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", default=runner.DEFAULT_OUT,
                        help="folder of results.jsonl and the plots (default: %(default)s)")
    common.add_argument("--smoke", action="store_true",
                        help="tiny problems, few repetitions: seconds, on CPU too")
    common.add_argument("--base", metavar="REV",
                        help="also run on REV (a git revision, or a folder holding a source tree) "
                             "and print this / base ratios")
    common.add_argument("--ab-rounds", type=int, default=None,
                        help="with --base: rounds per side, alternating order (default 3; 1 with "
                             "--smoke)")
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    op = sub.add_parser("op", parents=[common],
                        help="speed, memory and accuracy per implementation and budget")
    op.add_argument("--shapes", help=f"TxDxV,... (default {OP_SHAPES}; smoke {OP_SMOKE_SHAPES})")
    op.add_argument("--impls", help="comma-separated names from benchmarks/impls.py (default: all)")
    op.add_argument("--budgets", help="workspace_bytes values for tplogp: default, bytes (4GiB), "
                                      "keep:F (keep the share F of the logits), chunk:C (loss "
                                      f"chunks of C tokens) (default {OP_BUDGETS}; smoke "
                                      f"{OP_SMOKE_BUDGETS})")
    op.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    op.add_argument("--reps", type=int, help="timed calls per timing (default 10; smoke 2)")
    op.add_argument("--rounds", type=int, help="interleaved rounds (default 3; smoke 1)")
    op.add_argument("--warm-ms", type=float,
                    help="sustained warm-up before each timing, GPU ms (default 300)")
    op.add_argument("--checks", default=None,
                    help="TPLOGP_CHECKS modes of tplogp's rows, comma-separated: full, sync, fast "
                         "(default: TPLOGP_CHECKS, else full)")
    op.add_argument("--variants", metavar="V,...",
                    help="also measure each tplogp row with options added, one row per variant, "
                         "its float64 errors against its own math and its time over the plain "
                         "row's (vs_plain): softcap=C, deterministic=true, "
                         "deterministic=tp_invariant, label_smoothing=E, z_loss=K (the last two on "
                         "the fused cross-entropy rows), support=K<k>-shared / "
                         "support=K<k>-disjoint (a sampler's support of k ids per token, its union "
                         "size in the row; benchmarks/supports.py), top_k=K / top_p=P / min_p=M "
                         "(the sampler's parameters; logit_std=S scales their problem's logits "
                         "to that spread); join options of one variant "
                         "with '+', e.g. "
                         "softcap=30,deterministic=tp_invariant,label_smoothing=0.1+z_loss=1e-4,"
                         "support=K64-shared (benchmarks/variants.py)")
    op.add_argument("--no-check", action="store_true", help="skip the float64 error columns")
    op.add_argument("--device-profile", action="store_true",
                    help="CUDA: each row also profiles one forward+backward: the device's busy "
                         "ms beside the wall time (the rest: the device waiting on the host) and "
                         "its top kernels")
    op.add_argument("--no-plot", action="store_true", help="do not redraw the plots")

    mem = sub.add_parser("memory", parents=[common],
                         help="CPU: native source vs eager, resident growth")
    mem.add_argument("--shapes", help="NxDxV,... (default 2048x512x32768,8192x1024x65536; smoke "
                                      "256x64x2048)")
    mem.add_argument("--impls", default="native,eager")

    plug = sub.add_parser("plugin", parents=[common],
                          help="pytest_tplogp rank pool: dispatch, start, skip, recovery, mesh")
    plug.add_argument("--sections", help="comma-separated subset of "
                                         "dispatch,start,skip,recovery,mesh (default: all)")

    tp = sub.add_parser("tp", parents=[common], help="TP scaling over torchrun launches")
    tp.add_argument("--shapes", help="NxDxV (default 8192x4096x128256; smoke 64x32x320)")
    tp.add_argument("--impls", default="registry",
                    help="the tplogp source: registry, native, triton or sm90")
    tp.add_argument("--degrees", help="TP degrees (default 1,2,4,... up to the GPUs; smoke 1,2)")
    tp.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                    help="default bf16; smoke fp32")
    tp.add_argument("--steps", type=int, default=None)
    tp.add_argument("--variants", default=None, metavar="KEY=VALUE[+...][,...]",
                    help="rows besides the plain call's whose calls are given a sampler's "
                         "support (support=K<k>-shared "
                         "/ support=K<k>-disjoint, benchmarks/supports.py; its union size in the "
                         "row) or its parameters (top_k= / top_p= / min_p=, logit_std=S the "
                         "logits' spread), in op --variants' grammar, e.g. "
                         "support=K64-shared,top_p=0.9+logit_std=4")
    tp.add_argument("--layouts", default="replicated,gather-allreduce,sequence-parallel",
                    help="hidden layouts, comma-separated: replicated, gather-allreduce (a "
                         "sequence-parallel caller gathering by hand), sequence-parallel (the op's "
                         "option); benchmarks/tp.py")

    fl = sub.add_parser("floors", parents=[common],
                        help="the 3-GEMM floor of a keep-all call and the host floor of "
                                                         "a forward+backward, beside the op")
    fl.add_argument("--shapes", help=f"TxDxV,... of the GEMM floor (default {FLOOR_SHAPES}; smoke "
                                     "64x32x320)")
    fl.add_argument("--host-shape", help="TxDxV of the host floor (default 4096x2048x8192 on a "
                                         "GPU, 16x32x256 on the CPU)")
    fl.add_argument("--what", default="gemm,host", help="gemm, host or both (default: %(default)s)")
    fl.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                    help="default bf16 on a GPU, fp32 on the CPU")
    fl.add_argument("--reps", type=int, help="calls per timing (default 10 GEMM floor, 100 host "
                                             "floor; smoke 2)")
    fl.add_argument("--rounds", type=int, help="interleaved rounds (default 3; smoke 1)")
    fl.add_argument("--warm-ms", type=float,
                    help="sustained warm-up before each GPU timing, ms (default 300)")

    hf = sub.add_parser("integrations", parents=[common],
                        help="HF causal LM: TRL 1.16's fused LM head vs tplogp.integrations.hf "
                             "(log-probs, GRPO step)")
    hf.add_argument("--reps", type=int, help="timed calls per implementation (default 5; smoke 1)")
    hf.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                    help="default bf16; smoke fp32")

    rep = sub.add_parser("report", help="regenerate docs/performance.md and the plots from the "
                                        "results file")
    rep.add_argument("--out", default=runner.DEFAULT_OUT,
                     help="folder of results.jsonl (default: %(default)s)")
    rep.add_argument("--doc", default=os.path.join(REPO, "docs", "performance.md"))

    return ap


def _device():
    import torch

    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


def _finish(out: str, rows: list[dict], info: dict, smoke: bool, fmt) -> None:
    for r in rows:
        # a row's own fields (its checks mode) stay
        r.update({k: v for k, v in info.items() if k not in r})
        if smoke:
            r["smoke"] = True
        print(fmt(r), flush=True)
    print(f"# {len(rows)} rows appended to {runner.append_rows(out, rows)}")


def _op(args) -> int:
    from . import impls as impl_table
    from . import op, plots
    from .variants import parse_variants

    device = _device()
    smoke = args.smoke
    shapes = runner.parse_shapes(args.shapes or (OP_SMOKE_SHAPES if smoke else OP_SHAPES))
    budgets = [runner.parse_budget_spec(b)
               for b in (args.budgets or (OP_SMOKE_BUDGETS if smoke else OP_BUDGETS))
               .split(",") if b.strip()]
    chosen = impl_table.select(args.impls)
    variants = tuple(parse_variants(args.variants))
    reps = args.reps or (2 if smoke else 10)
    rounds = args.rounds or (1 if smoke else 3)
    warm_ms = args.warm_ms if args.warm_ms is not None else (0.0 if smoke else 300.0)
    info = runner.run_info(device)
    checks = tuple(m.strip() for m in (args.checks or info["checks"]).split(",") if m.strip())
    print(f"# {info['device']} | torch {info['torch']} | triton {info['triton']} | tplogp "
          f"{info['commit']} | peers {info['peers']} | checks {','.join(checks)}", flush=True)
    for shape in shapes:
        rows = op.bench_shape(shape, chosen, budgets, args.dtype, device, reps=reps, rounds=rounds,
                              warm_ms=warm_ms, check=not args.no_check, checks=checks,
                              variants=variants, device_profile=args.device_profile)
        _finish(args.out, rows, info, smoke, op.format_row)
    if not args.no_plot and not smoke:
        for path in plots.write_all(runner.read_rows(args.out), args.out):
            print(f"# plot {path}")
    return 0


def _memory(args) -> int:
    from . import memory

    shapes = runner.parse_shapes(args.shapes
                                 or (memory.SMOKE_SHAPES if args.smoke else memory.DEFAULT_SHAPES))
    info = runner.run_info(_device_cpu())
    rows = memory.bench(shapes, [i.strip() for i in args.impls.split(",") if i.strip()])
    _finish(args.out, rows, info, args.smoke, memory.format_row)
    return 0


def _device_cpu():
    import torch

    return torch.device("cpu")


def _plugin(args) -> int:
    from . import plugin

    info = runner.run_info(_device_cpu())
    sections = [x.strip() for x in args.sections.split(",") if x.strip()] if args.sections else None
    rows = plugin.bench(args.smoke, sections)
    _finish(args.out, rows, info, args.smoke, plugin.format_row)
    return 0


def _tp(args) -> int:
    import torch

    from . import tp

    smoke = args.smoke
    (shape,) = runner.parse_shapes(args.shapes or ("64x32x320" if smoke else "8192x4096x128256"))[
        :1]
    gpus = torch.cuda.device_count()
    powers = [2**i for i in range(gpus.bit_length()) if 2**i <= gpus]
    default_degrees = "1,2" if smoke or not gpus else ",".join(str(p) for p in powers)
    degrees = [int(d) for d in (args.degrees or default_degrees).split(",")]
    dtype = args.dtype or ("fp32" if smoke else "bf16")
    info = runner.run_info(_device())
    layouts = tuple(args.layouts.split(","))
    unknown = set(layouts) - set(tp.LAYOUTS)
    if unknown:
        raise SystemExit(f"--layouts: unknown {sorted(unknown)}; choose from "
                         f"{', '.join(tp.LAYOUTS)}")
    variant_list = tp.parse_variants(args.variants) if args.variants else ()
    rows = tp.bench(shape, degrees, args.impls, dtype, args.steps or (2 if smoke else 10),
                    1 if smoke else 3, layouts, variant_list)
    _finish(args.out, rows, info, smoke, tp.format_row)
    return 0


def _floors(args) -> int:
    from . import floors

    device, smoke = _device(), args.smoke
    gpu = device.type == "cuda"
    dtype = args.dtype or ("bf16" if gpu and not smoke else "fp32")
    what = {w.strip() for w in args.what.split(",") if w.strip()}
    if not what or what - {"gemm", "host"}:
        raise SystemExit(f"--what takes gemm, host or both, got {args.what!r}")
    rounds = args.rounds or (1 if smoke else 3)
    warm_ms = args.warm_ms if args.warm_ms is not None else (0.0 if smoke else 300.0)
    info = runner.run_info(device)
    print(f"# {info['device']} | torch {info['torch']} | triton {info['triton']} | tplogp "
          f"{info['commit']}", flush=True)
    rows = []
    if "gemm" in what:
        for shape in runner.parse_shapes(args.shapes or ("64x32x320" if smoke else FLOOR_SHAPES)):
            rows.append(floors.gemm_floor(shape, dtype, device, args.reps or (2 if smoke else 10),
                                          rounds, warm_ms))
    if "host" in what:
        (shape,) = runner.parse_shapes(args.host_shape
                                       or ("4096x2048x8192" if gpu and not smoke else "16x32x256"))[
                                           :1]
        rows += floors.host_floor(shape, dtype, device, args.reps or (2 if smoke else 100), rounds)
    _finish(args.out, rows, info, smoke, floors.format_row)
    return 0


def _report(args) -> int:
    from . import report

    path = report.write(args.out, args.doc)
    print(f"# wrote {path}")
    return 0


def _integrations(args) -> int:
    from . import integrations

    device = _device()
    info = runner.run_info(device)
    info["transformers"] = runner._version("transformers")
    info["trl"] = runner._version("trl")
    rows = integrations.bench(args.smoke, args.reps or (1 if args.smoke else 5),
                              args.dtype or ("fp32" if args.smoke else "bf16"))
    r = rows[0]
    print(f"# {info['device']} | torch {info['torch']} | transformers {info['transformers']} | "
          f"trl {info['trl']} | tplogp {info['commit']}\n# {r['model']} vocab {r['vocab']}, hidden "
          f"{r['hidden']}, {r['layers']} layers, {r['batch']} x {r['seq']} tokens, logits_to_keep "
          f"{r['logits_to_keep']}, {r['dtype']}\n{integrations.TABLE_HEADER}", flush=True)
    _finish(args.out, rows, info, args.smoke, integrations.format_row)
    print("\n# to paste between the integrations-benchmark markers of docs/integrations.md:\n")
    print(integrations.markdown(rows, info), flush=True)
    return 0


COMMANDS = {"op": _op, "memory": _memory, "plugin": _plugin, "tp": _tp, "floors": _floors,
            "integrations": _integrations, "report": _report}


def _without_base(argv: list[str]) -> list[str]:
    """argv less --base / --ab-rounds / --out (the A/B runner sets --out per child)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--base", "--ab-rounds", "--out"):
            skip = True
            continue
        if a.startswith(("--base=", "--ab-rounds=", "--out=")):
            continue
        out.append(a)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if getattr(args, "base", None):
        from . import ab

        rounds = args.ab_rounds or (1 if args.smoke else 3)
        # no plots during the A/B; the float64 checks in the first round only
        op = args.command == "op"
        ab.run(_without_base(argv) + (["--no-plot"] if op else []), args.base, rounds, args.out,
               later_rounds=("--no-check",) if op else ())
        return 0
    return COMMANDS[args.command](args)
