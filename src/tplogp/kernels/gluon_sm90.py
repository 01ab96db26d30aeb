"""Hopper (sm_90) forward statistics kernel in Triton's Gluon dialect: ping-pong consumer warpgroups.

Same statistics as :func:`.triton_forward._fwd_stats_kernel` / :func:`.sm90._fwd_stats_tma_kernel` (per-row online
softmax over ``logits = hidden @ weight.T`` tiles, logits never written), but the epilogue is hidden behind the
tensor cores:

* persistent grid (one program per SM); a program walks work items ``w = pid, pid + nprog, ...``, each a
  ``(token block i_n, vocab split i_s)`` pair in grouped order (``GROUP_N`` token blocks sweep the splits together,
  so a W tile read from HBM is reused from L2);
* within split ``i_s`` the vocab tiles ``j = 0, 1, ...`` alternate between two consumer warpgroups: consumer ``c``
  takes ``j % 2 == c`` and writes its running stats to split index ``2 * i_s + c`` of ``p_parts [K, 2S, N]``
  (a consumer without a tile writes max -inf, sum 0, target 0, sez 0; the existing fold handles it);
* each consumer has its own shared-memory ring of ``NUM_STAGES`` (A ``[BLOCK_N, BLOCK_D]``, B ``[BLOCK_V, BLOCK_D]``)
  slots with ready/empty mbarriers, filled by its own 1-warp TMA loader partition (two loaders, so that each ring
  is refilled as soon as its consumer frees a slot, independently of the other ring);
* ping-pong order barrier (as CUTLASS's ``KernelTmaWarpSpecializedPingpong``): the MMA phases (K loops) of the
  tiles run in the global tile order of the program. Before issuing the K loop of a tile, a consumer waits on the
  other consumer's ``issued`` mbarrier when the previous tile (in program order) is the other consumer's; right
  after issuing its last wgmma of the tile it arrives on its own ``issued`` barrier, then waits for its wgmmas and
  runs the softmax epilogue while the other warpgroup's K loop keeps the tensor cores busy. Consumer 1 tiles are
  always preceded by a consumer-0 tile (odd ``j``), consumer 0 tile ``j > 0`` by consumer 1 tile ``j - 1``, and
  tile ``j = 0`` of a work item by the previous item's last tile (consumer 1's iff that item had an even tile
  count). Consumer 0 only arrives when a consumer-1 tile follows in the same split, consumer 1 always arrives, so
  every wait matches exactly one arrival and the parity phases alternate (no barrier can run two phases ahead).

Per tile (``acc`` fp32 ``[BLOCK_N, BLOCK_V]`` over the full hidden dim) each consumer folds the tile into its running
row statistics with the TMA and generic kernels' own epilogue, ``triton_forward._online_softmax_update`` (raw units,
one ex2 per logit, the column mask only in a split's last tile), and stores them through ``_natural_units`` and
``_store_stats``: the same arithmetic, so the three forwards differ only in how the tiles are computed and grouped.

Host side: :func:`launch_stats_pingpong`; :func:`available` says whether this Triton has what the kernel needs.
Nothing here touches CUDA at import time, and the module imports cleanly without Gluon.
"""

from __future__ import annotations

from typing import Optional

import torch

from .configs import PingPongConfig, cdiv
from .direct_launch import launcher, triton_version_supported
from .launch import split_parts
from .triton_forward import (
    FAST_EXP2,
    LOG2E,
    _grouped_ids,
    _natural_units,
    _online_softmax_update,
    _store_stats,
)

# Triton releases whose Gluon Hopper API this kernel was compiled against (3.6.0 also run on the H200; the
# experimental API changes between releases).
GLUON_TRITON = ((3, 6), (3, 9))

try:
    import triton

    _TRITON_VERSION = triton.__version__
except Exception:  # pragma: no cover - no Triton at all
    triton = None
    _TRITON_VERSION = "0"

_IMPORT_ERROR: Optional[str] = None
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    # The TMA load builtin: async_copy_global_to_shared in Triton 3.6, async_load since (the old name then raises).
    _tma_load = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared")
    _HAVE_GLUON = True
except Exception as exc:  # pragma: no cover - depends on the installed Triton
    _HAVE_GLUON = False
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def available() -> tuple[bool, str]:
    """(True, "") when the installed Triton has the Gluon Hopper API this kernel uses (Triton 3.6 - 3.9);
    otherwise (False, reason). No CUDA work: whether the device is an sm_90 GPU is the caller's check."""
    if triton is None:
        return False, "triton is not installed"
    if not triton_version_supported(_TRITON_VERSION, GLUON_TRITON):
        return False, f"triton {_TRITON_VERSION} is outside the supported 3.6 - 3.9 range for the gluon kernel"
    if not _HAVE_GLUON:
        return False, f"triton.experimental.gluon (hopper) unavailable: {_IMPORT_ERROR}"
    return True, ""


if _HAVE_GLUON:

    @gluon.jit
    def _consumer(a_bufs, b_bufs, ready, empty, turn_bar, issued_bar,
                  p_b, p_tgt, p_parts, N, V, D, inv_temp, num_splits, plane,
                  C: gl.constexpr, SPLIT_V: gl.constexpr, HAS_BIAS: gl.constexpr, WITH_ENTROPY: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_V: gl.constexpr, BLOCK_D: gl.constexpr, GROUP_N: gl.constexpr,
                  NUM_STAGES: gl.constexpr):
        """Consumer warpgroup C: wgmma K loops of its tiles (in ping-pong order), then the softmax epilogue."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_V, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        cols = gl.arange(0, BLOCK_V, layout=col_layout)
        rows = gl.arange(0, BLOCK_N, layout=row_layout)
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        num_n = gl.cdiv(N, BLOCK_N)
        num_work = num_n * num_splits
        k_iters = gl.cdiv(D, BLOCK_D)
        c = inv_temp * LOG2E

        cnt = 0  # slots consumed from this consumer's ring
        turn_phase = 0  # parity of the next wait on the other consumer's issued barrier
        prev_even = 0  # the previous work item ended with a consumer-1 tile (consumer 0 only)
        for w in range(pid, num_work, nprog):
            i_n, i_s = _grouped_ids(w, num_n, num_splits, GROUP_N)
            o_n = i_n * BLOCK_N + rows
            m_n = o_n < N
            tgt = gl.load(p_tgt + o_n, mask=m_n, other=-1)
            v_lo = i_s * SPLIT_V
            n_tiles = gl.cdiv(gl.minimum(v_lo + SPLIT_V, V) - v_lo, BLOCK_V)
            m_y = gl.full([BLOCK_N], float("-inf"), gl.float32, row_layout)
            s = gl.zeros([BLOCK_N], gl.float32, row_layout)
            t_y = gl.zeros([BLOCK_N], gl.float32, row_layout)
            q2 = gl.zeros([BLOCK_N], gl.float32, row_layout)
            for j in range(C, n_tiles, 2):
                v0 = v_lo + j * BLOCK_V
                # --- wait for our turn on the tensor cores
                if C == 0:
                    need = (j > 0) | (prev_even != 0)
                    mbarrier.wait(turn_bar, turn_phase, pred=need)
                    turn_phase = turn_phase ^ need.to(gl.int32)
                else:
                    mbarrier.wait(turn_bar, turn_phase)
                    turn_phase = turn_phase ^ 1
                # --- K loop: async wgmma, at most one group in flight; free the previous slot after each wait.
                # The first step starts from a fresh zero accumulator (use_acc=False), so the previous tile's
                # accumulator is dead once its epilogue has read it (no live 128-register copy across epilogues).
                slot = cnt % NUM_STAGES
                mbarrier.wait(ready.index(slot), (cnt // NUM_STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)),
                                    gl.zeros([BLOCK_N, BLOCK_V], gl.float32, mma_layout),
                                    use_acc=False, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # nothing older: does not block
                cnt += 1
                for k in range(1, k_iters):
                    slot = cnt % NUM_STAGES
                    mbarrier.wait(ready.index(slot), (cnt // NUM_STAGES) & 1)
                    acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    mbarrier.arrive(empty.index((cnt + NUM_STAGES - 1) % NUM_STAGES))
                    cnt += 1
                # --- hand the tensor cores to the other consumer, then finish ours and run the epilogue
                if C == 0:
                    mbarrier.arrive(issued_bar, pred=j + 1 < n_tiles)
                else:
                    mbarrier.arrive(issued_bar)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index((cnt + NUM_STAGES - 1) % NUM_STAGES))
                if v0 + BLOCK_V <= V:
                    m_y, s, t_y, q2 = _online_softmax_update(acc, cols, v0, V, p_b, tgt, m_y, s, t_y, q2, c,
                                                             False, HAS_BIAS, WITH_ENTROPY, FAST_EXP2, BLOCK_V)
                else:
                    m_y, s, t_y, q2 = _online_softmax_update(acc, cols, v0, V, p_b, tgt, m_y, s, t_y, q2, c,
                                                             True, HAS_BIAS, WITH_ENTROPY, FAST_EXP2, BLOCK_V)
            if C == 0:
                prev_even = (n_tiles % 2 == 0).to(gl.int32)
            # --- natural units, stored as split 2 * i_s + C
            m_y, t_y, q2 = _natural_units(m_y, t_y, q2, inv_temp)
            _store_stats(p_parts, plane, (2 * i_s + C).to(gl.int64) * N + o_n, m_n, m_y, s, t_y, q2, WITH_ENTROPY)

    @gluon.jit
    def _loader(h_desc, w_desc, a_bufs, b_bufs, ready, empty, N, V, D, num_splits,
                C: gl.constexpr, SPLIT_V: gl.constexpr,
                BLOCK_N: gl.constexpr, BLOCK_V: gl.constexpr, BLOCK_D: gl.constexpr, GROUP_N: gl.constexpr,
                NUM_STAGES: gl.constexpr):
        """1-warp TMA producer of consumer C's ring: the same walk as the consumer, one slot per K step."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        num_n = gl.cdiv(N, BLOCK_N)
        num_work = num_n * num_splits
        k_iters = gl.cdiv(D, BLOCK_D)
        nbytes: gl.constexpr = h_desc.block_type.nbytes + w_desc.block_type.nbytes
        cnt = 0
        for w in range(pid, num_work, nprog):
            i_n, i_s = _grouped_ids(w, num_n, num_splits, GROUP_N)
            off_n = i_n * BLOCK_N
            v_lo = i_s * SPLIT_V
            n_tiles = gl.cdiv(gl.minimum(v_lo + SPLIT_V, V) - v_lo, BLOCK_V)
            for j in range(C, n_tiles, 2):
                v0 = v_lo + j * BLOCK_V
                for k in range(k_iters):
                    slot = cnt % NUM_STAGES
                    # fresh barrier: a wait on parity 1 passes, so the first NUM_STAGES slots need no release
                    mbarrier.wait(empty.index(slot), ((cnt // NUM_STAGES) & 1) ^ 1)
                    mbarrier.expect(ready.index(slot), nbytes)
                    _tma_load(h_desc, [off_n, k * BLOCK_D], ready.index(slot), a_bufs.index(slot))
                    _tma_load(w_desc, [v0, k * BLOCK_D], ready.index(slot), b_bufs.index(slot))
                    cnt += 1

    @gluon.jit
    def _fwd_stats_pingpong_kernel(
        h_desc,  # gluon tensor descriptor over hidden [N, D], block [BLOCK_N, BLOCK_D]
        w_desc,  # gluon tensor descriptor over weight [V, D], block [BLOCK_V, BLOCK_D]
        p_b,  # [V] bias (unused unless HAS_BIAS)
        p_tgt,  # [N] int64 local target (owned iff 0 <= id < V)
        p_parts,  # [3 or 4, 2 * S, N] fp32 split stats (max, sum, target logit[, sez]), out
        N, V, D,
        inv_temp,  # 1 / temperature
        num_splits, plane,  # plane = 2 * S * N
        SPLIT_V: gl.constexpr,  # vocab ids per split, a multiple of 2 * BLOCK_V
        HAS_BIAS: gl.constexpr, WITH_ENTROPY: gl.constexpr,
        BLOCK_N: gl.constexpr, BLOCK_V: gl.constexpr, BLOCK_D: gl.constexpr, GROUP_N: gl.constexpr,
        NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
    ):
        gl.static_assert(SPLIT_V % (2 * BLOCK_V) == 0, "SPLIT_V must be a multiple of 2 * BLOCK_V")
        dtype: gl.constexpr = h_desc.dtype
        a0 = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_D], h_desc.layout)
        b0 = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_V, BLOCK_D], w_desc.layout)
        a1 = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_D], h_desc.layout)
        b1 = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_V, BLOCK_D], w_desc.layout)
        ready0 = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty0 = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        ready1 = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty1 = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        issued = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready0.index(i), count=1)
            mbarrier.init(empty0.index(i), count=1)
            mbarrier.init(ready1.index(i), count=1)
            mbarrier.init(empty1.index(i), count=1)
        mbarrier.init(issued.index(0), count=1)
        mbarrier.init(issued.index(1), count=1)
        fence_async_shared()

        gl.warp_specialize(
            [
                (_consumer, (a0, b0, ready0, empty0, issued.index(1), issued.index(0),
                             p_b, p_tgt, p_parts, N, V, D, inv_temp, num_splits, plane,
                             0, SPLIT_V, HAS_BIAS, WITH_ENTROPY, BLOCK_N, BLOCK_V, BLOCK_D, GROUP_N, NUM_STAGES)),
                (_consumer, (a1, b1, ready1, empty1, issued.index(0), issued.index(1),
                             p_b, p_tgt, p_parts, N, V, D, inv_temp, num_splits, plane,
                             1, SPLIT_V, HAS_BIAS, WITH_ENTROPY, BLOCK_N, BLOCK_V, BLOCK_D, GROUP_N, NUM_STAGES)),
                (_loader, (h_desc, w_desc, a0, b0, ready0, empty0, N, V, D, num_splits,
                           0, SPLIT_V, BLOCK_N, BLOCK_V, BLOCK_D, GROUP_N, NUM_STAGES)),
                (_loader, (h_desc, w_desc, a1, b1, ready1, empty1, N, V, D, num_splits,
                           1, SPLIT_V, BLOCK_N, BLOCK_V, BLOCK_D, GROUP_N, NUM_STAGES)),
            ],
            [4, 1, 1],
            [CONSUMER_REGS, LOADER_REGS, LOADER_REGS],
        )


# ---------------------------------------------------------------------------------------------------------------------
# host side

_SM_COUNT: dict = {}


def _sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (the persistent grid's size); cached per device index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _SM_COUNT.get(index)
    if found is None:
        found = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return found


def _gl_dtype(torch_dtype):
    if torch_dtype == torch.bfloat16:
        return gl.bfloat16
    if torch_dtype == torch.float16:
        return gl.float16
    raise TypeError(f"gluon ping-pong kernel supports bf16/fp16 operands, got {torch_dtype}")


def descriptors(hidden, weight, block_n: int, block_v: int, block_d: int):
    """Gluon TMA descriptors over hidden [N, D] (block [block_n, block_d]) and weight [V, D] (block
    [block_v, block_d]), NVMMA-swizzled smem layouts. Needs 16-byte aligned bases and row strides."""
    dt = _gl_dtype(hidden.dtype)
    lay_h = gl.NVMMASharedLayout.get_default_for([block_n, block_d], dt)
    lay_w = gl.NVMMASharedLayout.get_default_for([block_v, block_d], dt)
    return (GluonTensorDescriptor.from_tensor(hidden, [block_n, block_d], lay_h),
            GluonTensorDescriptor.from_tensor(weight, [block_v, block_d], lay_w))


def launch_stats_pingpong(hidden, weight, bias, local_target, inv_temperature: float, with_entropy: bool,
                          cfg: PingPongConfig):
    """Launch the ping-pong kernel; returns ``(parts, S2)``: fp32 ``parts [4 or 3, S2, N]`` with ``S2 = 2 S``
    half-split stats (``S = cdiv(V, cfg.split_v)``; index ``2 s + c`` holds consumer ``c``'s tiles of split ``s``;
    a consumer without a tile writes max -inf, sum 0, target 0, sez 0), folded like ``S2`` ordinary splits
    (``triton_forward._fold_splits``). The caller has checked: an sm_90 device, :func:`available`, bf16 / fp16
    operands contiguous along D with 16-byte aligned bases and row strides (``sm90.tma_ok``)."""
    n, d = hidden.shape
    v = weight.shape[0]
    num_splits = cdiv(v, cfg.split_v)
    parts = split_parts(hidden, 2 * num_splits, with_entropy)
    d_h, d_w = descriptors(hidden, weight, cfg.block_n, cfg.block_v, cfg.block_d)
    grid = (max(1, min(cdiv(n, cfg.block_n) * num_splits, _sm_count(hidden.device))),)
    launcher(_fwd_stats_pingpong_kernel)(
        grid, d_h, d_w, bias if bias is not None else hidden, local_target, parts,
        n, v, d, inv_temperature, num_splits, 2 * num_splits * n,
        SPLIT_V=cfg.split_v, HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, GROUP_N=cfg.group_n,
        NUM_STAGES=cfg.num_stages, CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs,
        num_warps=4,
    )
    return parts, 2 * num_splits
