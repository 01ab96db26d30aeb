"""Tile configs: which tiles each kernel runs with, per GPU architecture and operand dtype (torch
only: no Triton import, no device work at import).

One fixed default per architecture (a capability table), no autotuning, fitted to the device's
shared memory for the operands' element size (:func:`select`), and the ``tl.dot`` precision per
dtype (:func:`dot_precision`). A config fixes every tiling choice that can change a row's
floating-point result (tile sizes, the vocab split length), so on one device and for one dtype the
per-row outputs never depend on the number of tokens.

Other tilings are explicit: pass a :class:`TileConfig` to
``TritonBackend(config=...)`` / ``SM90Backend(config=...)``; ``python -m benchmarks op --base REV``
times a variant against another commit. Nothing is timed implicitly at run time, so results never
depend on a race.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..support import settings


# Operand dtypes every Triton kernel of tplogp takes (the launchers' checks, the sources' dtype
# test, the fused loss's scaling pass).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TileConfig:
    """Tiling of the fused ``[tokens, vocab]`` GEMM tiles (``BLOCK_D`` is the reduction step over
    the hidden dim)."""

    block_n: int = 64
    block_v: int = 64
    block_d: int = 32
    num_warps: int = 4
    num_stages: int = 2
    group_n: int = 8  # token blocks that share a stretch of W in L2 (grouped launch order)
    # vocab tiles per forward split (a function of V only: see module docstring)
    split_tiles: int = 8
    # backward d_logits kernel
    bwd_block_n: int = 64
    bwd_block_v: int = 64
    bwd_block_d: int = 32
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2
    # d_logits from the kept terms (an elementwise pass: its tile is the forward's BLOCK_V wide,
    # this many rows;
    # None: the backward's bwd_block_n / bwd_num_warps; with a bias gradient always those, whose row
    # blocks the partial d_bias rows follow)
    kept_block_n: Optional[int] = None
    kept_num_warps: Optional[int] = None
    # deterministic d_hidden GEMM (acc[BN, BD] += dz[BN, BK] @ W[BK, BD])
    dh_block_n: int = 64
    dh_block_d: int = 64
    dh_block_k: int = 32
    dh_num_warps: int = 4
    dh_num_stages: int = 2
    # sm90 source only: warp-specialized K loop (producer warps issue TMA copies; Triton 3.6
    # compiles the same code
    # with or without it on sm_90: docs/kernels.md)
    warp_specialize: bool = False

    @property
    def split_v(self) -> int:
        """Vocab ids per forward split."""
        return self.split_tiles * self.block_v


# Capability table: (major, minor) -> config (the measured choices: docs/kernels.md).
_BY_CAPABILITY: dict[tuple[int, int], TileConfig] = {
    (9, 0): TileConfig(
        block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3, group_n=32, split_tiles=4,
        bwd_block_n=128, bwd_block_v=256, bwd_block_d=64, bwd_num_warps=8, bwd_num_stages=3,
        dh_block_n=128, dh_block_d=256, dh_block_k=64, dh_num_warps=8, dh_num_stages=3,
        kept_block_n=16, kept_num_warps=4,  # the kept d_logits pass: short row blocks stream faster
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
# Triton's CPU interpreter: its cost is per program and per tl op, so the vocab and K tiles are as
# wide as small test shapes allow while still cutting them (masked edges, several row tiles, vocab
# splits and K steps).
INTERPRETER = TileConfig(
    block_n=32, block_v=64, block_d=32, group_n=2, split_tiles=2,
    bwd_block_n=32, bwd_block_v=64, bwd_block_d=32,
    dh_block_n=32, dh_block_d=64, dh_block_k=32,
)

# The sm90 source (TMA kernels): the Hopper row plus warp_specialize on the K loop (Triton 3.6 emits
# the same sm_90
# code with or without it for these tiles: docs/kernels.md; kept for releases that honour it on
# Hopper).
SM90 = replace(_BY_CAPABILITY[(9, 0)], warp_specialize=True)


# Whether Triton's CPU interpreter runs the kernels:
# :func:`tplogp.support.settings.triton_interpret` itself (read at each call; no wrapper frame,
# several launches of every call ask).
interpreting = settings.triton_interpret


def cdiv(a: int, b: int) -> int:
    """Ceiling division of Python ints (``triton.cdiv`` is a constexpr function: microseconds per
    host call)."""
    return -(-a // b)


def capability(device: torch.device) -> Optional[tuple[int, int]]:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


# ------------------------------------------------------------------------------------ dot precision


def dot_precision(dtype: torch.dtype) -> Optional[str]:
    """The kernels' ``tl.dot`` precision for operands of ``dtype``.

    fp32 operands follow ``torch.get_float32_matmul_precision()``, as torch's own fp32 GEMMs (and
    the cuBLAS steps of the backward) do: ``"highest"`` (torch's default) gives ``"ieee"`` (full
    fp32 products on the CUDA cores), ``"high"`` / ``"medium"`` give ``"tf32"`` (tensor cores).
    Under Triton's CPU interpreter fp32 is always ``"ieee"``. 16-bit operands: Triton's default
    (exact products, fp32 accumulation); under the interpreter ``"upcast"`` (the kernels' ``mma``
    then computes in fp32: the interpreter's 16-bit dot is unreliable)."""
    if dtype == torch.float32:
        if interpreting() or torch.get_float32_matmul_precision() == "highest":
            return "ieee"
        return "tf32"
    return "upcast" if interpreting() else None


# ------------------------------------------------------------------------------------ shared memory

# Shared memory one block may use (bytes, the opt-in maximum) by compute capability, for devices
# whose properties do not report ``shared_memory_per_block_optin``.
SMEM_LIMIT_BY_CAPABILITY: dict[tuple[int, int], int] = {
    (8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448,
}
# the smallest limit of the sm_80+ table: safe where nothing better is known
_SMEM_LIMIT_UNKNOWN = 101376
_BARRIER_BYTES = 8  # one mbarrier per pipelined buffer (TMA loads)


def shared_memory_limit(device: torch.device) -> int:
    """Shared memory per block that kernels may opt into on ``device``: the device's own report,
    else the capability table, else the table's smallest entry."""
    props = torch.cuda.get_device_properties(device)
    found = getattr(props, "shared_memory_per_block_optin", None)
    if found:
        return int(found)
    return SMEM_LIMIT_BY_CAPABILITY.get((props.major, props.minor), _SMEM_LIMIT_UNKNOWN)


def gemm_shared_bytes(block_m: int, block_n: int, block_k: int, num_stages: int, itemsize: int,
                      tensor_cores: bool) -> int:
    """Shared memory of one pipelined K loop ``acc[M, N] += A[M, K] @ B[K, N]`` (operands of
    ``itemsize`` bytes).

    Model, fitted to what Triton reports for these kernels compiled for sm_90 (Triton 3.6 and 3.9):

    * tensor-core dots (16-bit operands, tf32): ``num_stages`` buffers of both tiles, plus one
      mbarrier per buffer (exact for the TMA kernels; the pointer kernels have no barriers, sm_80
      keeps ``num_stages - 1`` buffers);
    * fp32 ``"ieee"`` dots (CUDA-core FMA): ``num_stages - 1`` buffers, one more copy of the larger
      tile for the operands' layout change, and the barriers (exact for the TMA kernels: 262160
      bytes for the 128x256x64, 3-stage forward that the H200 refused; an upper bound for the
      pointer kernels).

    The epilogues (row reductions, the d_logits store) reuse the loop's buffers: they add nothing
    measurable, except the sm90 forward that keeps its softmax terms through TMA stores, which
    stages one ``[M, N]`` tile of them on top (within sm_90's 227 KiB per block for the sm90
    configs; tests/kernels/test_sm90_compile.py).
    """
    a = block_m * block_k * itemsize
    b = block_n * block_k * itemsize
    if tensor_cores:
        return num_stages * (a + b + _BARRIER_BYTES)
    buffers = max(num_stages - 1, 1)
    return buffers * (a + b + _BARRIER_BYTES) + max(a, b)


# (name, M field, N field, K field, stages field) of each K loop a config tiles; the forward also
# has split_tiles.
_GEMMS = (
    ("forward statistics", "block_n", "block_v", "block_d", "num_stages"),
    ("d_logits", "bwd_block_n", "bwd_block_v", "bwd_block_d", "bwd_num_stages"),
    ("deterministic d_hidden", "dh_block_n", "dh_block_d", "dh_block_k", "dh_num_stages"),
)
_MIN_BLOCK = 16  # tl.dot's smallest M, N and K
# fp32 "ieee" dots run on the CUDA cores, unrolled per K step into M*N*K / threads FMAs per thread:
# larger tiles compile for many seconds and add no tensor-core reuse there. So fp32 "ieee" configs
# are capped to these (M, N, K) tiles.
FMA_TILE_CAP = (128, 128, 32)


def uses_tensor_cores(itemsize: int, precision: Optional[str]) -> bool:
    """Whether ``tl.dot`` runs on the tensor cores for operands of ``itemsize`` bytes at
    ``precision`` (:func:`dot_precision`): everything but fp32 ``"ieee"`` dots, which run as
    CUDA-core FMAs."""
    return not (itemsize == 4 and precision == "ieee")


def shared_bytes(cfg: TileConfig, itemsize: int, precision: Optional[str]) -> dict[str, int]:
    """Shared memory (bytes) that each kernel of ``cfg`` needs for operands of ``itemsize``
    bytes."""
    tensor_cores = uses_tensor_cores(itemsize, precision)
    return {name: gemm_shared_bytes(getattr(cfg, m), getattr(cfg, n), getattr(cfg, k),
                                    getattr(cfg, s), itemsize, tensor_cores)
            for name, m, n, k, s in _GEMMS}


class TilesDoNotFitError(RuntimeError):
    """No tile configuration of a kernel fits the device's shared memory (the registry refuses the
    source)."""


def _shrink_step(m: int, n: int, k: int, stages: int) -> Optional[tuple[int, int, int, int]]:
    """The next smaller K loop tiling, in the order that costs the least throughput: fewer stages
    (down to 2), a shorter K step (down to 32), narrower then shorter tiles (down to 64), one stage,
    then the smallest blocks."""
    if stages > 2:
        return m, n, k, stages - 1
    if k > 32:
        return m, n, k // 2, stages
    if n > 64 and n >= m:
        return m, n // 2, k, stages
    if m > 64:
        return m // 2, n, k, stages
    if stages > 1:
        return m, n, k, 1
    if k > _MIN_BLOCK:
        return m, n, k // 2, stages
    if n > _MIN_BLOCK and n >= m:
        return m, n // 2, k, stages
    if m > _MIN_BLOCK:
        return m // 2, n, k, stages
    return None


def fit_shared_memory(cfg: TileConfig, itemsize: int, precision: Optional[str],
                      limit: int) -> TileConfig:
    """``cfg`` with each kernel's tiles shrunk (:func:`_shrink_step`) until it needs at most
    ``limit`` bytes of shared memory; ``cfg`` itself when it fits. The forward keeps its split
    length (``split_tiles`` grows as ``block_v`` shrinks), so the split layout stays a function of
    V. Raises :class:`TilesDoNotFitError` when even the smallest tiling does not fit."""
    tensor_cores = uses_tensor_cores(itemsize, precision)
    changes: dict[str, int] = {}
    for name, fm, fn, fk, fs in _GEMMS:
        tiles = (getattr(cfg, fm), getattr(cfg, fn), getattr(cfg, fk), getattr(cfg, fs))
        if not tensor_cores:  # CUDA-core FMA dots: at most 128x128x32 tiles (see FMA_TILE_CAP)
            tiles = (min(tiles[0], FMA_TILE_CAP[0]), min(tiles[1], FMA_TILE_CAP[1]),
                     min(tiles[2], FMA_TILE_CAP[2]), tiles[3])
        while gemm_shared_bytes(*tiles, itemsize, tensor_cores) > limit:
            smaller = _shrink_step(*tiles)
            if smaller is None:
                raise TilesDoNotFitError(
                    f"the {name} kernel needs {gemm_shared_bytes(*tiles, itemsize, tensor_cores)} bytes of shared "
                    f"memory even with {tiles[0]}x{tiles[1]}x{tiles[2]} tiles and {tiles[3]} stage(s) for "
                    f"{itemsize}-byte operands; the device allows {limit}")
            tiles = smaller
        changes.update({fm: tiles[0], fn: tiles[1], fk: tiles[2], fs: tiles[3]})
    if changes["block_v"] != cfg.block_v:
        changes["split_tiles"] = cfg.split_v // changes["block_v"]
    return replace(cfg, **changes)


def check_shared_memory(cfg: TileConfig, itemsize: int, precision: Optional[str],
                        limit: int) -> None:
    """Raise :class:`TilesDoNotFitError` naming the first kernel of an explicitly chosen ``cfg``
    that needs more than ``limit`` bytes of shared memory."""
    for name, need in shared_bytes(cfg, itemsize, precision).items():
        if need > limit:
            raise TilesDoNotFitError(
                f"the given tile config's {name} kernel needs {need} bytes of shared memory for {itemsize}-byte "
                f"operands; the device allows {limit} (fewer stages or smaller tiles fit)")


# ------------------------------------------------------------------------------------ selection


def base_config(device: torch.device) -> TileConfig:
    """The capability table's entry for ``device`` (before fitting): ``INTERPRETER`` off CUDA."""
    cap = capability(device)
    if cap is None:
        return INTERPRETER
    if cap in _BY_CAPABILITY:
        return _BY_CAPABILITY[cap]
    for (major, _minor), cfg in sorted(_BY_CAPABILITY.items()):
        if major == cap[0]:
            return cfg
    return _GENERIC_CUDA


def select(device: torch.device, dtype: torch.dtype, override: Optional[TileConfig] = None,
           base: Optional[TileConfig] = None) -> TileConfig:
    """The config for operands of ``dtype`` on ``device``: ``override`` as given (checked against
    the device's shared memory), else ``base`` (default: the capability table's entry) fitted to the
    device's shared memory for this element size and dot precision. Off CUDA (the interpreter)
    nothing is fitted. Raises :class:`TilesDoNotFitError` when nothing fits."""
    if device.type != "cuda":
        return override if override is not None else (base if base is not None else INTERPRETER)
    itemsize = dtype.itemsize
    precision = dot_precision(dtype)
    limit = shared_memory_limit(device)
    if override is not None:
        check_shared_memory(override, itemsize, precision, limit)
        return override
    return fit_shared_memory(base if base is not None else base_config(device), itemsize, precision,
                             limit)


def select_sm90(device: torch.device, dtype: torch.dtype,
                override: Optional[TileConfig] = None) -> TileConfig:
    """The sm90 source's config (the Hopper row of the table with warp specialization, or
    ``override``), fitted or checked like :func:`select`."""
    return select(device, dtype, override, base=SM90)
