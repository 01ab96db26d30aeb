"""Compile the Gluon ping-pong forward-stats kernel (src/tplogp/kernels/gluon_sm90.py) for sm_90 without a GPU.

Run with a Triton that has Gluon (e.g. ``PYTHONPATH=/tmp/t36 python benchmarks/gluon_compile_check.py``). For every
(HAS_BIAS, WITH_ENTROPY, dtype) variant it prints shared memory, num_warps, registers and a SASS census (WGMMA,
UTMALDG, setmaxnreg); exits non-zero when a variant fails to compile or its SASS lacks WGMMA / UTMALDG.
Options: ``--sass DIR`` writes each variant's SASS there; ``--stages``, ``--block-n``, ``--block-v``, ``--block-d``,
``--split-tiles`` override the config (configs.PINGPONG); ``--quick`` compiles one variant (bf16, bias, entropy).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def _signature(kern, dtype_str, cfg, lay_h, lay_w, has_bias):
    sig = {
        "h_desc": f"tensordesc<{dtype_str}[{cfg.block_n}, {cfg.block_d}],{lay_h!r}>",
        "w_desc": f"tensordesc<{dtype_str}[{cfg.block_v}, {cfg.block_d}],{lay_w!r}>",
        "p_b": "*fp32" if has_bias else f"*{dtype_str}",
        "p_tgt": "*i64",
        "p_parts": "*fp32",
        "N": "i32", "V": "i32", "D": "i32",
        "inv_temp": "fp32",
        "num_splits": "i32", "plane": "i64",
    }
    names = list(kern.arg_names)
    for name in names:
        if name not in sig:
            sig[name] = "constexpr"
    return {name: sig[name] for name in names}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", default=None, help="directory to write SASS into")
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--block-v", type=int, default=None)
    ap.add_argument("--block-n", type=int, default=None)
    ap.add_argument("--block-d", type=int, default=None)
    ap.add_argument("--split-tiles", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="only the bf16 variant with bias and entropy")
    args = ap.parse_args()

    import sass_counts  # benchmarks/, beside this script
    import triton
    from triton.backends.compiler import GPUTarget

    from tplogp.kernels import gluon_sm90 as gk

    ok, why = gk.available()
    print(f"triton {triton.__version__} from {os.path.dirname(triton.__file__)}; available(): {ok} {why}")
    if not ok:
        return 2
    from triton.experimental.gluon._runtime import GluonASTSource
    gl = gk.gl

    import dataclasses

    cfg = gk.PingPongConfig()
    cfg = dataclasses.replace(cfg, num_stages=args.stages or cfg.num_stages, block_v=args.block_v or cfg.block_v,
                              block_n=args.block_n or cfg.block_n, block_d=args.block_d or cfg.block_d,
                              split_tiles=args.split_tiles or cfg.split_tiles)
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)

    kern = gk._fwd_stats_pingpong_kernel
    target = GPUTarget("cuda", 90, 32)
    failures = 0
    dtypes = (("bf16", gl.bfloat16),) if args.quick else (("bf16", gl.bfloat16), ("fp16", gl.float16))
    flags = (True,) if args.quick else (False, True)
    for dtype_str, gdt in dtypes:
        lay_h = gl.NVMMASharedLayout.get_default_for([cfg.block_n, cfg.block_d], gdt)
        lay_w = gl.NVMMASharedLayout.get_default_for([cfg.block_v, cfg.block_d], gdt)
        for has_bias in flags:
            for with_entropy in flags:
                name = f"{dtype_str} bias={int(has_bias)} entropy={int(with_entropy)}"
                constexprs = dict(
                    SPLIT_V=cfg.split_v, HAS_BIAS=has_bias, WITH_ENTROPY=with_entropy,
                    BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, GROUP_N=cfg.group_n,
                    NUM_STAGES=cfg.num_stages, CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs,
                )
                try:
                    src = GluonASTSource(kern, _signature(kern, dtype_str, cfg, lay_h, lay_w, has_bias), constexprs)
                    compiled = triton.compile(src, target=target, options={"num_warps": 4})
                except Exception:
                    failures += 1
                    print(f"[FAIL] {name}: compile error")
                    traceback.print_exc()
                    continue
                md = compiled.metadata
                regs = getattr(compiled, "n_regs", None)
                census = ""
                if "cubin" in compiled.asm:
                    sass = sass_counts.disassemble(compiled.asm["cubin"])
                    if args.sass:
                        tag = name.replace(" ", "_").replace("=", "")
                        with open(os.path.join(args.sass, f"{tag}.sass"), "w") as f:
                            f.write(sass)
                        with open(os.path.join(args.sass, f"{tag}.ptx"), "w") as f:
                            f.write(compiled.asm["ptx"])
                        with open(os.path.join(args.sass, f"{tag}.ttgir"), "w") as f:
                            f.write(compiled.asm["ttgir"])
                    ops = sass_counts.count_ops(sass)
                    n_wgmma, n_tma = ops["HGMMA"] + ops["WGMMA"], ops["UTMALDG"]
                    maxreg = sorted(set(re.findall(r"USETMAXREG\.[A-Z_.]+\s+(?:UP\d+,\s*)?0x[0-9a-f]+", sass)))
                    census = f" sass: HGMMA={n_wgmma} UTMALDG={n_tma} setmaxnreg={maxreg}"
                    if n_wgmma == 0 or n_tma == 0:
                        failures += 1
                        census += "  <-- missing WGMMA or UTMALDG"
                ptx_regs = re.findall(r"\.maxnreg\s+(\d+)", compiled.asm.get("ptx", ""))
                print(f"[ok] {name}: shared={md.shared} B num_warps={md.num_warps} "
                      f"n_regs={regs} ptx.maxnreg={ptx_regs} spills={getattr(compiled, 'n_spills', None)}{census}")
    if failures:
        print(f"{failures} failure(s)")
        return 1
    print("all variants compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
