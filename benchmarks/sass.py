"""Compile the sm90 fused kernels for sm_90 on any machine (no GPU needed) and count their SASS instructions.

Used to see what an epilogue change does to the instruction stream before spending GPU time: the static count
per instruction class of the forward stats kernel and the d_logits kernel (tiles of the sm90 config, bf16, 16-byte
aligned pointers and sizes divisible by 16, as Triton specializes them at the benchmark shapes), and whether the
K loop is warp-specialized (``USETMAXREG``, register reallocation between partitions) or not.

    python -m benchmarks sass [--out DIR] [--json FILE]       # the Triton on sys.path (PYTHONPATH=... for another)

Needs a Triton with its NVIDIA backend (bundled ptxas and cuobjdump); nothing is launched.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tplogp.kernels import configs, sm90

_SASS_OP = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def _kernels(cfg):
    desc_h = f"tensordesc<bf16[{cfg.block_n},{cfg.block_d}]>"
    desc_w = f"tensordesc<bf16[{cfg.block_v},{cfg.block_d}]>"
    fwd_sig = dict(d_h=desc_h, d_w=desc_w, p_b="*bf16", p_tgt="*i64", p_parts="*fp32", N="i32", V="i32", D="i32",
                   inv_temp="fp32", num_splits="i32", plane="i32")
    fwd_const = dict(SPLIT_V=cfg.split_v, HAS_BIAS=False, WITH_ENTROPY=False,
                     BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, GROUP_N=cfg.group_n,
                     DOT_PRECISION=None, WARP_SPECIALIZE=cfg.warp_specialize, NUM_STAGES=cfg.num_stages)
    bdesc_h = f"tensordesc<bf16[{cfg.bwd_block_n},{cfg.bwd_block_d}]>"
    bdesc_w = f"tensordesc<bf16[{cfg.bwd_block_v},{cfg.bwd_block_d}]>"
    bwd_sig = dict(d_h=bdesc_h, d_w=bdesc_w, p_b="*bf16", p_tgt="*i64", p_rmax="*fp32", p_lsum="*fp32",
                   p_g="*fp32", p_gmg="*fp32", p_ge="*fp32", p_mz="*fp32", p_dz="*bf16", p_dbp="*fp32", N="i32",
                   V="i32", D="i32", v_lo="i32", v_hi="i32", stride_dz="i32", stride_dbp="i32", inv_temp="fp32")
    bwd_const = dict(HAS_BIAS=False, NEED_DB=False, WITH_ENTROPY=False, BLOCK_N=cfg.bwd_block_n,
                     BLOCK_V=cfg.bwd_block_v, BLOCK_D=cfg.bwd_block_d, GROUP_N=cfg.group_n, DOT_PRECISION=None,
                     WARP_SPECIALIZE=cfg.warp_specialize, NUM_STAGES=cfg.bwd_num_stages)
    return [("fwd_stats", sm90._fwd_stats_tma_kernel, fwd_sig, fwd_const, cfg.num_warps, cfg.num_stages),
            ("bwd_dlogits", sm90._bwd_dlogits_tma_kernel, bwd_sig, bwd_const, cfg.bwd_num_warps,
             cfg.bwd_num_stages)]


def compile_sm90(fn, sig: dict, const: dict, num_warps: int, num_stages: int):
    """triton.compile for sm_90 with every pointer and i32 argument marked 16-divisible (Triton's specialization
    of 16-byte aligned pointers and sizes that are multiples of 16)."""
    full = {name: ("constexpr" if name in const else sig[name]) for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if full[name].startswith("*") or full[name] == "i32"}
    src = ASTSource(fn=fn, signature=full, constexprs=dict(const), attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def disassemble(cubin: bytes) -> str:
    """SASS text of a cubin (Triton's bundled cuobjdump)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def count_ops(sass: str) -> collections.Counter:
    """Instructions per opcode (``HGMMA``, ``MUFU``, ...; modifiers dropped) in SASS text."""
    ops: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = _SASS_OP.match(line)
        if m:
            ops[m.group(1)] += 1
    return ops


def sass_counts(cubin: bytes, out_path: str) -> collections.Counter:
    """:func:`count_ops` of a cubin, which is written to ``out_path.cubin`` with its SASS in ``out_path.sass``."""
    with open(out_path + ".cubin", "wb") as f:
        f.write(cubin)
    sass = disassemble(cubin)
    with open(out_path + ".sass", "w") as f:
        f.write(sass)
    return count_ops(sass)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the cubin and SASS files")
    ap.add_argument("--json", default=None, help="also write {kernel: {instruction class: count}} here")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cfg = configs.SM90
    print(f"# Triton {triton.__version__}, sm_90, bf16, sm90 config {cfg.block_n}x{cfg.block_v}x{cfg.block_d}")
    found = {}
    for name, fn, sig, const, warps, stages in _kernels(cfg):
        kernel = compile_sm90(fn, sig, const, warps, stages)
        ops = found[name] = sass_counts(kernel.asm["cubin"], os.path.join(args.out, name))
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(14))
        ws = "warp-specialized" if ops.get("USETMAXREG") else "not warp-specialized"
        print(f"{name}: {sum(ops.values())} instructions, smem {kernel.metadata.shared} B, {ws}; {top}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1, sort_keys=True)
    return 0
