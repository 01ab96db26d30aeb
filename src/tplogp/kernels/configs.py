"""Tile configurations: one fixed default per GPU architecture, no autotuning.

A config fixes every tiling choice that can change a row's floating-point result (tile sizes, the vocab split
length), so on one device the per-row outputs never depend on the number of tokens. Nothing here touches CUDA at
import time; :func:`select` reads the device's capability when a launcher asks.

Other tilings are explicit: pass a :class:`TileConfig` to ``TritonBackend(config=...)`` / ``SM90Backend(config=...)``;
docs/kernels.md records the variants measured and which won. Nothing is timed implicitly at
run time, so results never depend on a race.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from .. import settings


@dataclass(frozen=True)
class PingPongConfig:
    """Tiling of the Gluon ping-pong forward (kernels/gluon_sm90.py): each of two consumer warpgroups owns a
    ``[block_n, block_v]`` fp32 accumulator; ``num_stages`` is the depth of each consumer's shared-memory ring;
    splits are ``split_tiles * block_v`` vocab ids (even ``split_tiles``: both consumers get the same number of tiles
    in every full split). Opt-in (``SM90Backend(config=configs.SM90_PINGPONG)``): after the epilogue diet of the TMA
    kernel it is no faster (docs/kernels.md, "Ping-pong forward").

    Measured on the H200 (forward GEMM-times through the op, one process per shape, before the benchmark timed in
    the power-capped state): at 4096x2048x131072 group_n 8 1.10-1.11 vs the TMA kernel 1.18-1.19 in the same process
    (group_n 4 1.14, 16 1.14, 32 1.20; split_tiles 16 1.13; block_d 64 with 3 stages 1.43; 64x256 tiles 1.30), at
    8192x4096x128256 1.08-1.12 vs 1.03-1.05; in milliseconds the two forwards were within 2% at 4096x2048x131072
    (3.64 vs 3.62 ms, 3.69 vs 3.67 ms), and back to back under the power cap the ping-pong forward took 3.65-3.78 ms
    against the TMA forward's 3.41-3.45 ms."""

    block_n: int = 128
    block_v: int = 128
    block_d: int = 32
    group_n: int = 8
    num_stages: int = 6
    split_tiles: int = 8
    consumer_regs: int = 232  # setmaxnreg of the second consumer warpgroup (a worker partition)
    loader_regs: int = 24  # setmaxnreg of the two 1-warp TMA loader partitions

    @property
    def split_v(self) -> int:
        return self.split_tiles * self.block_v


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
    # sm90 source only: warp-specialized K loop (producer warps issue TMA copies; Triton 3.6 compiles the same code
    # with or without it on sm_90: docs/kernels.md)
    warp_specialize: bool = False
    # sm90 source only: the forward statistics run the Gluon ping-pong kernel (kernels/gluon_sm90.py) with these
    # tiles wherever it can run, instead of the TMA kernel with the tiles above; None (default): the TMA kernel
    pingpong: Optional[PingPongConfig] = None

    @property
    def split_v(self) -> int:
        """Vocab ids per forward split."""
        return self.split_tiles * self.block_v


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
)

# The sm90 source (TMA kernels): the Hopper row plus warp_specialize on the K loop (Triton 3.6 emits the same sm_90
# code with or without it for these tiles: docs/kernels.md; kept for releases that honour it on Hopper).
SM90 = replace(_BY_CAPABILITY[(9, 0)], warp_specialize=True)
# The opt-in Gluon ping-pong forward's tiling (TileConfig.pingpong), and the sm90 config that uses it.
PINGPONG = PingPongConfig()
SM90_PINGPONG = replace(SM90, pingpong=PINGPONG)


def interpreting() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (:func:`tplogp.settings.triton_interpret`)."""
    return settings.triton_interpret()


def fast_exp2_available() -> bool:
    """Whether the kernels may use PTX's ``ex2.approx.ftz.f32`` (inline assembly): CUDA builds of torch, not Triton's
    CPU interpreter (which runs no PTX) and not ROCm. Read once, when the kernel modules are imported."""
    return not interpreting() and torch.version.hip is None


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
