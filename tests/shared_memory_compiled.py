"""Compile the fused kernels for a GPU architecture without a GPU and print the shared memory Triton allots them.

Run as ``python -m tests.shared_memory_compiled`` with ``TRITON_INTERPRET`` unset; prints one JSON line per case:
``{"case": ..., "compiled": bytes Triton reports, "model": tplogp.kernels.configs.gemm_shared_bytes}``. Used by
``tests/test_sm90_compile.py`` to check that the shared-memory model the config fitting relies on is never below
what Triton needs (exact for the TMA kernels on sm_90).
"""

from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tplogp.kernels import configs, sm90, triton_backward, triton_forward

# (kernel, arch, dtype, (M, N, K, stages), dot precision)
CASES = [
    ("fwd_tma", 90, "bf16", (128, 256, 64, 3), None),
    ("fwd_tma", 90, "fp32", (128, 128, 32, 3), "ieee"),
    ("bwd_tma", 90, "fp32", (128, 128, 32, 3), "tf32"),
    ("fwd", 90, "fp32", (128, 128, 32, 3), "ieee"),
    ("bwd", 90, "fp16", (128, 128, 32, 4), None),
    ("dh", 90, "bf16", (128, 256, 64, 3), None),
    ("fwd", 80, "bf16", (128, 128, 32, 4), None),
    ("fwd", 80, "fp32", (128, 128, 32, 4), "tf32"),
]
_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


def _compile(kind: str, arch: int, dt: str, tiles, precision):
    m, n, k, stages = tiles
    flags = dict(HAS_BIAS=True, WITH_ENTROPY=True)
    blocks = dict(BLOCK_N=m, BLOCK_V=n, BLOCK_D=k, GROUP_N=8, DOT_PRECISION=precision)
    stats = dict(p_tgt="*i64", p_parts="*fp32", N="i32", V="i32", D="i32")
    grads = dict(p_tgt="*i64", p_rmax="*fp32", p_lsum="*fp32", p_g="*fp32", p_gmg="*fp32", p_ge="*fp32",
                 p_mz="*fp32", p_dz=f"*{dt}", p_dbp="*fp32", N="i32", V="i32", D="i32", v_lo="i32", v_hi="i32")
    tma = dict(d_h=f"tensordesc<{dt}[{m},{k}]>", d_w=f"tensordesc<{dt}[{n},{k}]>", p_b=f"*{dt}")
    ptrs = dict(p_h=f"*{dt}", p_w=f"*{dt}", p_b=f"*{dt}")
    if kind == "fwd_tma":
        fn, sig = sm90._fwd_stats_tma_kernel, {**tma, **stats, "inv_temp": "fp32", "num_splits": "i32", "plane": "i32"}
        const = dict(SPLIT_V=4 * n, **flags, **blocks, WARP_SPECIALIZE=True, NUM_STAGES=stages)
    elif kind == "fwd":
        fn = triton_forward._fwd_stats_kernel
        sig = {**ptrs, **stats, "stride_hn": "i32", "stride_wv": "i32", "inv_temp": "fp32", "num_splits": "i32",
               "plane": "i32"}
        const = dict(SPLIT_V=4 * n, **flags, EVEN_D=False, **blocks)
    elif kind == "bwd_tma":
        fn = sm90._bwd_dlogits_tma_kernel
        sig = {**tma, **grads, "stride_dz": "i32", "stride_dbp": "i32", "inv_temp": "fp32"}
        const = dict(**flags, NEED_DB=True, **blocks, WARP_SPECIALIZE=True, NUM_STAGES=stages)
    elif kind == "bwd":
        fn = triton_backward._bwd_dlogits_kernel
        sig = {**ptrs, **grads, "stride_hn": "i32", "stride_wv": "i32", "stride_dz": "i32", "stride_dbp": "i32",
               "inv_temp": "fp32"}
        const = dict(**flags, NEED_DB=True, EVEN_D=False, **blocks)
    else:  # dh: acc[M, N] += dz[M, K] @ w[K, N]
        fn = triton_backward._dh_accum_kernel
        sig = dict(p_dz=f"*{dt}", p_w=f"*{dt}", p_dh="*fp32", N="i32", K="i32", D="i32", stride_dz="i32",
                   stride_wv="i32", stride_dh="i32")
        const = dict(ACCUMULATE=True, BLOCK_N=m, BLOCK_D=n, BLOCK_K=k, GROUP_N=8, DOT_PRECISION=precision)
    full = {name: ("constexpr" if name in const else sig[name]) for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if full[name].startswith("*") or full[name] == "i32"}
    src = ASTSource(fn=fn, signature=full, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=8, num_stages=stages))


def main() -> int:
    for kind, arch, dt, tiles, precision in CASES:
        compiled = _compile(kind, arch, dt, tiles, precision).metadata.shared
        model = configs.gemm_shared_bytes(*tiles, _ITEMSIZE[dt], tensor_cores=not (dt == "fp32" and precision == "ieee"))
        print(json.dumps(dict(case=f"{kind} sm_{arch} {dt} {tiles} {precision}", tma=kind.endswith("tma") and arch == 90,
                              compiled=compiled, model=model)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
