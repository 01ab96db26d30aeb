"""Compile the fused kernels for a GPU architecture on a machine without a GPU (Triton's bundled ptxas, cuobjdump).

Run with ``TRITON_INTERPRET`` unset (``tests/kernels/test_sm90_compile.py`` starts it in a subprocess):

* ``python -m tests.support.compiled_kernels shared-memory [KIND ...]``: one JSON line per case (of those kernel
  kinds; all without), ``{"case", "tma", "compiled": bytes Triton allots, "model":
  tplogp.kernels.tiles.gemm_shared_bytes}``;
* ``python -m tests.support.compiled_kernels sass-counts``: one JSON object, SASS instructions per opcode of the sm90
  forward-statistics kernel (default, ``KEEP`` with its TMA stores, and ``SOFTCAP``) and d_logits kernels (TMA, and
  from kept logits, also with ``SOFTCAP``), with the sm90 config, bf16, no bias / entropy; ``ptx_mul_rn``: the PTX's
  ``mul.rn.f32`` count (the products that must not fuse into an FMA, :func:`tplogp.kernels.fp32_ops.mul_rounded`);
  ``shared``: the bytes Triton allots, ``model``: :func:`tplogp.kernels.tiles.gemm_shared_bytes` for the GEMM kernels;
* ``python -m tests.support.compiled_kernels sampler``: one JSON object, SASS instructions per
  opcode of the sampler's tile kernels (:mod:`tplogp.kernels.sampler_kernels`, each variant its
  launches use), compiled for sm_90;
* ``python -m tests.support.compiled_kernels sass-counts KIND ...``: the same, and the shared-memory rows of those
  kinds under ``"shared_memory"`` (one torch and Triton import, the compilations forked over the CPUs, for the slow
  tests).
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tplogp.kernels import backward_kernels, forward_kernels, hopper_kernels, tiles

# (kernel, arch, dtype, (M, N, K, stages), dot precision)
# (the bf16 TMA forward and d_logits kernels with the sm90 tiles are the ``sass-counts`` kernels; they carry their rows)
CASES = [
    ("fwd_tma", 90, "fp32", (128, 128, 32, 3), "ieee"),
    ("bwd_tma", 90, "fp32", (128, 128, 32, 3), "tf32"),
    ("bwd", 90, "fp16", (128, 128, 32, 4), None),
    ("dh", 90, "bf16", (128, 256, 64, 3), None),
    ("fwd", 80, "fp32", (128, 128, 32, 4), "tf32"),
]
_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


def _compile(kind: str, arch: int, dt: str, blocks, precision, features: bool = True, num_warps: int = 8,
             group_n: int = 8, split_tiles: int = 4, keep: bool = False, keep_tma: bool = False,
             softcap: bool = False, support: bool = False):
    """Compile one kernel for ``sm_{arch}`` (every pointer and i32 argument marked 16-divisible, as Triton
    specializes aligned tensors and sizes); ``features``: bias, entropy and d_bias on; ``keep``: the forward's
    kept-logits variant (``KEEP``); ``softcap``: the final-logit softcap on (``SOFTCAP``). Kinds: fwd_tma, fwd, bwd_tma,
    bwd, bwd_kept (d_logits from kept logits), dh."""
    m, n, k, stages = blocks
    flags = dict(HAS_BIAS=features, WITH_ENTROPY=features)
    block_args = dict(BLOCK_N=m, BLOCK_V=n, BLOCK_D=k, GROUP_N=group_n, DOT_PRECISION=precision)
    stats = dict(p_tgt="*i64", p_parts="*fp32", p_kept=f"*{dt}", p_scale="*fp32", N="i32", V="i32", D="i32",
                 stride_kept="i32", stride_scale="i32", v_keep="i32")
    grads = dict(p_tgt="*i64", p_rmax="*fp32", p_lsum="*fp32", p_g="*fp32", p_gmg="*fp32", p_ge="*fp32",
                 p_mean_rel="*fp32", p_dz=f"*{dt}", p_dbp="*fp32", N="i32", V="i32", D="i32", v_lo="i32", v_hi="i32")
    tma = dict(d_h=f"tensordesc<{dt}[{m},{k}]>", d_w=f"tensordesc<{dt}[{n},{k}]>", p_b=f"*{dt}")
    ptrs = dict(p_h=f"*{dt}", p_w=f"*{dt}", p_b=f"*{dt}")
    if kind == "fwd_tma":
        fn, sig = hopper_kernels.fwd_stats_tma_kernel, {**tma, **stats, "inv_temp": "fp32", "num_splits": "i32", "plane": "i32"}
        const = dict(SPLIT_V=split_tiles * n, **flags, **block_args, WARP_SPECIALIZE=True, NUM_STAGES=stages,
                     KEEP=keep, KEEP_TMA=keep and keep_tma)
        if keep and keep_tma:  # the kept terms through a tensor descriptor (launches.kept_tma_ok)
            sig = {**sig, "p_kept": f"tensordesc<{dt}[{m},{n}]>"}
    elif kind == "fwd":
        fn = forward_kernels.fwd_stats_kernel
        sig = {**ptrs, **stats, "stride_hn": "i32", "stride_wv": "i32", "inv_temp": "fp32", "num_splits": "i32",
               "plane": "i32"}
        const = dict(SPLIT_V=split_tiles * n, **flags, EVEN_D=False, **block_args, KEEP=keep)
    elif kind == "bwd_tma":
        fn = hopper_kernels.bwd_dlogits_tma_kernel
        sig = {**tma, **grads, "stride_dz": "i32", "stride_dbp": "i32", "inv_temp": "fp32"}
        const = dict(**flags, NEED_DB=features, **block_args, WARP_SPECIALIZE=True, NUM_STAGES=stages)
    elif kind == "bwd":
        fn = backward_kernels.bwd_dlogits_kernel
        sig = {**ptrs, **grads, "stride_hn": "i32", "stride_wv": "i32", "stride_dz": "i32", "stride_dbp": "i32",
               "inv_temp": "fp32"}
        const = dict(**flags, NEED_DB=features, EVEN_D=False, **block_args)
    elif kind == "bwd_kept":
        fn = backward_kernels.bwd_dlogits_kept_kernel
        sig = {"p_kept": f"*{dt}", "p_scale": "*fp32", **grads, "stride_kept": "i32", "stride_scale": "i32",
               "stride_dz": "i32", "stride_dbp": "i32", "inv_temp": "fp32"}
        const = dict(WITH_ENTROPY=features, NEED_DB=features, BLOCK_N=m, BLOCK_V=n, DOT_PRECISION=precision)
    else:  # dh: acc[M, N] += dz[M, K] @ w[K, N]
        fn = backward_kernels.dh_accum_kernel
        sig = dict(p_dz=f"*{dt}", p_w=f"*{dt}", p_dh="*fp32", N="i32", K="i32", D="i32", stride_dz="i32",
                   stride_wv="i32", stride_dh="i32")
        const = dict(ACCUMULATE=True, BLOCK_N=m, BLOCK_D=n, BLOCK_K=k, GROUP_N=8, DOT_PRECISION=precision)
    # the model options (softcap, the sum of the logits, argmax) and the support off: their
    # scalars and pointers typed, flags False
    sig = {"softcap": "fp32", "cap_temp": "fp32", "p_gsz": "*fp32", "p_sup": "*i32",
           "stride_sup": "i32", **sig}
    const.update({flag: False for flag in ("SOFTCAP", "WITH_SUM_Z", "WITH_ARGMAX", "SUPPORT")
                  if flag in fn.arg_names})
    if softcap:
        const["SOFTCAP"] = True
    if support:
        const["SUPPORT"] = True
    full = {name: ("constexpr" if name in const else sig[name]) for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if full[name].startswith("*") or full[name] == "i32"}
    src = ASTSource(fn=fn, signature=full, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=stages))


_SASS_OP = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def sass_counts(cubin: bytes) -> collections.Counter:
    """Instructions per opcode (``HGMMA``, ``MUFU``, ...; modifiers dropped) of a cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    ops: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        found = _SASS_OP.match(line)
        if found:
            ops[found.group(1)] += 1
    return ops


def shared_memory_rows(kinds: list[str]) -> list[dict]:
    rows = []
    for kind, arch, dt, blocks, precision in CASES:
        if kinds and kind not in kinds:
            continue
        compiled = _compile(kind, arch, dt, blocks, precision).metadata.shared
        model = tiles.gemm_shared_bytes(*blocks, _ITEMSIZE[dt], tiles.uses_tensor_cores(_ITEMSIZE[dt], precision))
        rows.append(dict(case=f"{kind} sm_{arch} {dt} {blocks} {precision}", tma=kind.endswith("tma") and arch == 90,
                         compiled=compiled, model=model))
    return rows


# The sass-counts kernels: (name, kind, which config blocks, keep, softcap[, support]); the sm90
# config's tiles and warps.
_MACHINE_CODE = (("fwd_stats", "fwd_tma", "fwd", False, False), ("fwd_stats_keep", "fwd_tma", "fwd", True, False),
                 ("fwd_stats_softcap", "fwd_tma", "fwd", False, True), ("bwd_dlogits", "bwd_tma", "bwd", False, False),
                 ("bwd_dlogits_softcap", "bwd_tma", "bwd", False, True),
                 ("bwd_dlogits_kept", "bwd_kept", "kept", False, False),
                 ("bwd_dlogits_kept_softcap", "bwd_kept", "kept", False, True),
                 ("fwd_stats_support", "fwd_tma", "fwd", False, False, True),
                 ("bwd_dlogits_support", "bwd_tma", "bwd", False, False, True))


def _machine_code_entry(spec: tuple) -> tuple[str, dict]:
    """One sass-counts kernel: ``(name, its counts, mul.rn count, shared bytes and, for a GEMM kernel, the model)``."""
    name, kind, which, keep, softcap, *support = spec
    cfg = tiles.SM90
    blocks, warps = {"fwd": ((cfg.block_n, cfg.block_v, cfg.block_d, cfg.num_stages), cfg.num_warps),
                     "bwd": ((cfg.bwd_block_n, cfg.bwd_block_v, cfg.bwd_block_d, cfg.bwd_num_stages),
                             cfg.bwd_num_warps),
                     "kept": ((cfg.kept_block_n, cfg.block_v, cfg.bwd_block_d, cfg.bwd_num_stages),
                              cfg.kept_num_warps)}[which]
    kernel = _compile(kind, 90, "bf16", blocks, None, features=False, num_warps=warps, group_n=cfg.group_n,
                      split_tiles=cfg.split_tiles, keep=keep, keep_tma=keep, softcap=softcap,
                      support=bool(support and support[0]))
    found = dict(sass_counts(kernel.asm["cubin"]), ptx_mul_rn=kernel.asm["ptx"].count("mul.rn.f32"),
                 shared=kernel.metadata.shared)
    if kind != "bwd_kept":
        found["model"] = tiles.gemm_shared_bytes(*blocks, 2, True)
    return name, found


def machine_code(shared_memory_kinds: list[str]) -> None:
    """The sass-counts JSON object (module docstring), its kernels compiled by as many processes as there are CPUs
    (forked after the imports: each compilation is Triton's front end and one ptxas run)."""
    with multiprocessing.get_context("fork").Pool(min(os.cpu_count() or 1, len(_MACHINE_CODE))) as pool:
        rows = pool.map_async(shared_memory_rows, [[kind] for kind in shared_memory_kinds], chunksize=1)
        found = dict(pool.map(_machine_code_entry, _MACHINE_CODE, chunksize=1))
        if shared_memory_kinds:
            found["shared_memory"] = [row for kind_rows in rows.get() for row in kind_rows]
    print(json.dumps(found, sort_keys=True))


def _sampler_cases() -> list[tuple]:
    """``(name, kernel, signature, constexprs, warps)`` of the sampler's tile kernels as
    :mod:`tplogp.kernels.sampler_launch` launches them."""
    from tplogp.kernels import sampler_kernels as sk
    from tplogp.kernels import sampler_launch as sl

    tile = dict(z_ptr="*fp32", scale_ptr="*fp32", cols="i32", stride_z="i32")
    counts = dict(**tile, shift_ptr="*fp32", counts_ptr="*fp32", masses_ptr="*fp32",
                  sums_ptr="*fp64", stride_s="i32")
    move = dict(tile_max_ptr="*fp32", width_ptr="*fp64", row_max_ptr="*fp32",
                top_index_ptr="*fp64", sum_ptr="*fp64", partial_ptr="*fp64", counts_ptr="*fp32",
                masses_ptr="*fp32", counts_out_ptr="*fp32", masses_out_ptr="*fp32",
                shift_ptr="*fp32", scale_ptr="*fp32", reach_ptr="*fp64", last_ptr="*i32")
    collect = dict(**tile, at_least_ptr="*fp32", last_ptr="*i32", vals_ptr="*fp32",
                   ids_ptr="*i64", held_ptr="*i32", below_ptr="*fp32", v0="i32", m="i32",
                   stride_b="i32")
    bins = dict(BINS=64, COARSE=4, BLOCK=sl.BIN_BLOCK, SUB=sl.BIN_SUB)
    cases = [(f"bin_counts{'_mass' if mass else ''}", sk.bin_counts_kernel, counts,
              dict(**bins, WITH_MASS=mass, WITH_SUM=mass), sl.BIN_WARPS) for mass in (False, True)]
    cases += [(f"grid_move{'_last' if last else ''}", sk.grid_move_kernel, move,
               dict(P=32, BINS=64, COARSE=4, LAST=last), 1) for last in (False, True)]
    cases += [(f"collect{'_by_bin' if by_bin else ''}", sk.collect_kernel, collect,
               dict(BLOCK=sl.COLLECT_BLOCK, BY_BIN=by_bin, BINS=64), sl.COLLECT_WARPS)
              for by_bin in (False, True)]
    return cases


def sampler_machine_code(_kinds: list[str]) -> None:
    """One JSON object: per sampler kernel variant compiled for sm_90, its SASS instructions per
    opcode."""
    found = {}
    for name, fn, sig, const, warps in _sampler_cases():
        full = {arg: ("constexpr" if arg in const else sig[arg]) for arg in fn.arg_names}
        src = ASTSource(fn=fn, signature=full, constexprs=const)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=warps))
        found[name] = dict(sass_counts(kernel.asm["cubin"]))
    print(json.dumps(found, sort_keys=True))


def main() -> int:
    command, kinds = sys.argv[1], sys.argv[2:]
    if command == "shared-memory":
        for row in shared_memory_rows(kinds):
            print(json.dumps(row), flush=True)
    else:
        {"sass-counts": machine_code, "sampler": sampler_machine_code}[command](kinds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
