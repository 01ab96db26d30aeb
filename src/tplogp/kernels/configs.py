"""Tile configurations: one fixed default per GPU architecture, autotuning only on request.

A config fixes every tiling choice that can change a row's floating-point result (tile sizes, the vocab split
length), so on one device the per-row outputs never depend on the number of tokens. Nothing here touches CUDA at
import time; :func:`select` reads the device's capability when a launcher asks.

Tuning is opt-in and explicit: pass a :class:`TileConfig` to ``TritonBackend(config=...)`` /
``SM90Backend(config=...)``; ``benchmarks/gpu_session.py`` sweeps the candidates of :data:`SWEEP_CANDIDATES` and
records which won (docs/kernels.md). Nothing is timed implicitly at run time, so results never depend on a race.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

import torch


@dataclass(frozen=True)
class TileConfig:
    """Tiling of the fused ``[tokens, vocab]`` GEMM tiles (``BLOCK_D`` is the reduction step over the hidden dim)."""

    block_n: int = 64
    block_v: int = 64
    block_d: int = 32
    num_warps: int = 4
    num_stages: int = 2
    group_n: int = 8  # token blocks that share a stretch of W in L2 (grouped launch order)
    split_tiles: int = 8  # vocab tiles per forward split (a function of V only: see module docstring)
    # backward d_logits kernel
    bwd_block_n: int = 64
    bwd_block_v: int = 64
    bwd_block_d: int = 32
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2
    # deterministic d_hidden GEMM (acc[BN, BD] += dz[BN, BK] @ W[BK, BD])
    dh_block_n: int = 64
    dh_block_d: int = 64
    dh_block_k: int = 32
    dh_num_warps: int = 4
    dh_num_stages: int = 2
    # sm90 source only: warp-specialized K loop (producer warps issue TMA copies)
    warp_specialize: bool = False
    # Lean softmax epilogue: no column mask when V (the chunk) is a multiple of BLOCK_V, and the target-logit /
    # one-hot extraction only in tiles that hold some row's target (generic kernels; the sm90 forward only drops the
    # masks). The same results up to FMA contraction (bitwise under the interpreter). Measured SLOWER on the H200
    # with the sm90 source (run 2, docs/kernels.md): off everywhere but in the interpreter tests.
    lean_epilogue: bool = False
    # Backward (default mode only, never with deterministic=True): two half-budget workspaces; the cuBLAS d_hidden
    # and d_W GEMMs of chunk i run on a side CUDA stream while the fused d_logits kernel of chunk i+1 runs.
    # Measured on the H200 (run 2): no gain (ties or 2-3% slower), so off by default.
    bwd_overlap: bool = False
    # sm90 source only. Forward: the vocab-tile loop and its K loop flattened into one software-pipelined loop
    # (the next tile's first loads issue under this tile's softmax epilogue); the K loop is then not
    # warp-specialized. Backward: a persistent d_logits kernel (at most one program per SM walking the tiles in one
    # flattened loop). Results are bitwise the same either way (same per-tile arithmetic).
    flatten_fwd: bool = False
    persistent_bwd: bool = False


# Capability table: (major, minor) -> config. Measured choices are documented in docs/kernels.md.
_BY_CAPABILITY: dict[tuple[int, int], TileConfig] = {
    (9, 0): TileConfig(
        block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3, group_n=32, split_tiles=4,
        bwd_block_n=128, bwd_block_v=256, bwd_block_d=64, bwd_num_warps=8, bwd_num_stages=3,
        dh_block_n=128, dh_block_d=256, dh_block_k=64, dh_num_warps=8, dh_num_stages=3,
    ),
    (8, 0): TileConfig(
        block_n=128, block_v=128, block_d=32, num_warps=8, num_stages=4, group_n=16, split_tiles=8,
        bwd_block_n=128, bwd_block_v=128, bwd_block_d=32, bwd_num_warps=8, bwd_num_stages=4,
        dh_block_n=128, dh_block_d=128, dh_block_k=32, dh_num_warps=8, dh_num_stages=4,
    ),
}
# Other architectures of the same major fall back to that major's entry, then to this.
_GENERIC_CUDA = TileConfig(
    block_n=64, block_v=128, block_d=32, num_warps=4, num_stages=3, group_n=16, split_tiles=8,
    bwd_block_n=64, bwd_block_v=128, bwd_block_d=32, bwd_num_warps=4, bwd_num_stages=3,
    dh_block_n=64, dh_block_d=128, dh_block_k=32, dh_num_warps=4, dh_num_stages=3,
)
# Triton's CPU interpreter: small tiles keep the numpy emulation fast and exercise the edge masks.
INTERPRETER = TileConfig(
    block_n=16, block_v=32, block_d=16, group_n=2, split_tiles=2,
    bwd_block_n=16, bwd_block_v=32, bwd_block_d=16,
    dh_block_n=16, dh_block_d=32, dh_block_k=16,
    lean_epilogue=True, bwd_overlap=True,  # the CPU tests cover the new paths; INTERPRETER_PLAIN the old ones
)
INTERPRETER_PLAIN = replace(INTERPRETER, lean_epilogue=False, bwd_overlap=False)

# The sm90 source (TMA kernels): the Hopper row plus a warp-specialized K loop (measured on an H200, Triton 3.6:
# 8192x4096x128256 fwd 1.06 vs 1.09 GEMM-times, fwd+bwd 4.21 vs 4.37 in one run, a tie in another; docs/kernels.md).
SM90 = replace(_BY_CAPABILITY[(9, 0)], warp_specialize=True)

SWEEP_CANDIDATES: tuple[TileConfig, ...] = (
    _BY_CAPABILITY[(9, 0)],
    replace(_BY_CAPABILITY[(9, 0)], block_v=128, num_warps=8, num_stages=4),
    replace(_BY_CAPABILITY[(9, 0)], block_n=256, block_v=128, num_warps=8, num_stages=3),
    replace(_BY_CAPABILITY[(9, 0)], group_n=16),
    _BY_CAPABILITY[(8, 0)],
)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of Python ints (``triton.cdiv`` is a constexpr function: microseconds per host call)."""
    return -(-a // b)


def capability(device: torch.device) -> Optional[tuple[int, int]]:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def select(device: torch.device, override: Optional[TileConfig] = None) -> TileConfig:
    """The fixed default config for ``device`` (or ``override``)."""
    if override is not None:
        return override
    cap = capability(device)
    if cap is None:
        return INTERPRETER
    if cap in _BY_CAPABILITY:
        return _BY_CAPABILITY[cap]
    for (major, _minor), cfg in sorted(_BY_CAPABILITY.items()):
        if major == cap[0]:
            return cfg
    return _GENERIC_CUDA


def select_sm90(override: Optional[TileConfig] = None) -> TileConfig:
    """The sm90 source's config (the Hopper row of the table, or ``override``)."""
    return override if override is not None else SM90
