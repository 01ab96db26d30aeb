"""The sm90 kernels compiled for sm_90 on a machine without a GPU (Triton's bundled ptxas and cuobjdump).

The CPU interpreter runs the kernels' arithmetic but never compiles them; these tests compile them for Hopper and
check properties of the machine code that the epilogue work of docs/kernels.md ("Epilogue instruction counts")
bought, so a change that brings back the slow forms fails here rather than only in a GPU benchmark:

* the exponentials are single MUFU ops (``ex2.approx.ftz``): no per-element FSETP of the non-ftz denormal fix-up;
* the d_logits workspace is written with 16-byte vector stores (not one 2-byte store per logit);
* the K loops use wgmma and TMA loads.

And the opt-in Gluon ping-pong forward compiles (bf16, bias, entropy) with wgmma and TMA loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _needs_nvidia_toolchain():
    if not all(os.access(os.path.join(_BIN, tool), os.X_OK) for tool in ("ptxas", "cuobjdump")):
        pytest.skip(f"no executable ptxas / cuobjdump in {_BIN}")


def _env():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compile for real
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_sm90_kernels_machine_code(tmp_path):
    _needs_nvidia_toolchain()
    out = tmp_path / "counts.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks", "sass", "--out", str(tmp_path), "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(out.read_text())
    for name in ("fwd_stats", "bwd_dlogits"):
        ops = counts[name]
        assert ops.get("HGMMA", 0) > 0 and ops.get("UTMALDG", 0) > 0, (name, ops)
        assert ops.get("MUFU", 0) >= 128, (name, ops)  # one ex2 per logit of a thread's 128
        # tl.exp2's non-ftz form adds an FSETP (and two FMULs) around every ex2: 128+ per epilogue
        assert ops.get("FSETP", 0) <= 8, (name, ops)
    # two epilogue copies (interior, edge) x 16 vector stores; per-logit 2-byte stores would be 128 per copy
    assert counts["bwd_dlogits"].get("STG", 0) <= 64, counts["bwd_dlogits"]


_GLUON_COMPILE = """
import dataclasses, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from benchmarks import sass
from tplogp.kernels import gluon_sm90 as gk

cfg, gl, kern = gk.PingPongConfig(), gk.gl, gk._fwd_stats_pingpong_kernel
lay_h = gl.NVMMASharedLayout.get_default_for([cfg.block_n, cfg.block_d], gl.bfloat16)
lay_w = gl.NVMMASharedLayout.get_default_for([cfg.block_v, cfg.block_d], gl.bfloat16)
sig = {"h_desc": f"tensordesc<bf16[{cfg.block_n}, {cfg.block_d}],{lay_h!r}>",
       "w_desc": f"tensordesc<bf16[{cfg.block_v}, {cfg.block_d}],{lay_w!r}>", "p_b": "*fp32", "p_tgt": "*i64",
       "p_parts": "*fp32", "N": "i32", "V": "i32", "D": "i32", "inv_temp": "fp32", "num_splits": "i32",
       "plane": "i64"}
const = dict(SPLIT_V=cfg.split_v, HAS_BIAS=True, WITH_ENTROPY=True, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v,
             BLOCK_D=cfg.block_d, GROUP_N=cfg.group_n, NUM_STAGES=cfg.num_stages, CONSUMER_REGS=cfg.consumer_regs,
             LOADER_REGS=cfg.loader_regs)
sig = {name: sig.get(name, "constexpr") for name in kern.arg_names}
compiled = triton.compile(GluonASTSource(kern, sig, const), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4})
print(json.dumps(sass.count_ops(sass.disassemble(compiled.asm["cubin"]))))
"""


def test_gluon_pingpong_forward_compiles():
    _needs_nvidia_toolchain()
    from tplogp.kernels import gluon_sm90

    ok, why = gluon_sm90.available()
    if not ok:
        pytest.skip(why)
    run = subprocess.run([sys.executable, "-c", _GLUON_COMPILE], cwd=ROOT, capture_output=True, text=True,
                         env=_env(), timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    ops = json.loads(run.stdout.strip().splitlines()[-1])
    assert ops.get("HGMMA", 0) + ops.get("WGMMA", 0) > 0 and ops.get("UTMALDG", 0) > 0, ops
