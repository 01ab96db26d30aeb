"""The triton and sm90 sources' tensor-parallel-invariant level (``deterministic="tp_invariant"``,
:mod:`tplogp.support.invariant`; docs/operator.md, "Determinism"): one grid-aligned shard's
per-block forward stats and its backward, every step in grid-block-sized pieces.

Algorithm (a shard whose first column starts a grid block of ``B`` columns, ``B = cfg.split_v`` in
the forward):

* Forward (:func:`forward_blocks`): one launch of the stats kernel whose vocab splits are the grid
  blocks (tiles aligned to the grid, one config per device and dtype, no split-K), returning each
  block's ``(m_b, s_b, q_b)`` (and with the options its sum of ``z`` and the lowest column of its
  max) unmerged; :mod:`tplogp.support.invariant` merges them exactly.
* Backward (:func:`backward_on_grid`): d_logits recomputed in chunks that are multiples of ``B``
  (nothing kept), into a workspace whose row stride is a function of ``N``, the budget and ``B``
  alone (never of the shard); ``d_W`` is one ``[B, N] x [N, D]`` GEMM per grid block, reading the
  block in place (the vocabulary's cut last block from a zero-padded copy), so every d_W GEMM has
  one shape and one layout; ``d_b`` sums the per-token-block partial rows one after the other;
  ``d_hidden`` is the deterministic fixed-order GEMM in fp32. A column's d_W and d_b rows then do
  not depend on the shard it came in.

The launches, the d_logits and d_hidden steps are the per-call paths'
(:mod:`tplogp.kernels.forward_programs`, :mod:`tplogp.kernels.backward_programs`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..support import fp32_gemm
from ..support.tensors import f32_contiguous
from .launch import cached
from .launches import KernelOptions, LogitTransform, ensure_context, stats_launch, tma_ok
from .backward_programs import dh_gemm, empty_call_grads, launch_dlogits, mm_into, per_token_grads
from .forward_programs import stats_outputs, stats_rows
from .tiles import TileConfig, cdiv, dot_precision


def forward_blocks(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   local_target: torch.Tensor, options: KernelOptions, cfg: TileConfig,
                   tma: bool = False) -> tuple:
    """The per-split stats of a shard, unmerged: ``(row max, sum of exp, target logit, sum of
    exp * (z - max) | None, sum of z | None, lowest column of the max | None)``, each ``[S, N]``
    fp32 (the last three with ``with_entropy``, ``with_sum_z``, ``with_argmax``; the column relative
    to the shard's first; ``options``: the call's); one launch of the stats kernel. The splits
    are ``cfg.split_v`` columns from the shard's first column, so for a grid-aligned shard they are
    the blocks of the tensor-parallel-invariant grid (:mod:`tplogp.support.invariant`), each
    computed by the same tiles wherever it sits."""
    n, d = hidden.shape
    v = weight.shape[0]
    _, with_entropy, *extras = options
    parts = torch.empty((stats_rows(with_entropy, *extras), cdiv(v, cfg.split_v), n),
                        device=hidden.device, dtype=torch.float32)
    if n and v:
        tma = tma and tma_ok(hidden, weight)
        if tma:
            ensure_context(hidden.device)
        local_target = local_target if local_target.is_contiguous() else local_target.contiguous()
        launch = cached(stats_launch, n, v, d, hidden.stride(0), weight.stride(0), bias is not None,
                        options, cfg, dot_precision(hidden.dtype), None, tma, False)
        launch(hidden, weight, hidden if bias is None else bias, local_target, parts, parts, parts,
               parts)
    return stats_outputs(parts, with_entropy, *extras)


# grid_chunk's cap, itself no function of the shard: with few rows or a large budget the workspace
# would otherwise reach far past any shard's width
MAX_CHUNK_COLUMNS = 1 << 16


def grid_chunk(n: int, itemsize: int, workspace_bytes: int, columns: int) -> int:
    """Columns of the invariant backward's d_logits workspace (its row stride): as many whole grid
    blocks as the budget's transient part holds for ``n`` rows, at least one and at most
    :data:`MAX_CHUNK_COLUMNS`; from ``n``, the budget and the grid alone, so a block's d_W GEMM
    reads the same layout in every shard."""
    cols = min(workspace_bytes // max(1, n * itemsize), MAX_CHUNK_COLUMNS)
    return max(columns, cols // columns * columns)


def backward_on_grid(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     local_target: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor,
                     grad_logp: torch.Tensor, grad_entropy: Optional[torch.Tensor],
                     grad_lse: Optional[torch.Tensor], mean_rel: Optional[torch.Tensor],
                     transform: LogitTransform, columns: int, workspace_bytes: int,
                     needs: tuple[bool, bool, bool], cfg: TileConfig, tma: bool = False,
                     d_hidden_ready: Optional[Callable[[torch.Tensor], None]] = None,
                     accumulate: Optional[tuple[Optional[torch.Tensor],
                                                Optional[torch.Tensor]]] = None,
                     grad_sum_z: Optional[torch.Tensor] = None):
    """:func:`~.backward_programs.backward` of the tensor-parallel-invariant level
    (:mod:`tplogp.support.invariant`) for a grid-aligned shard: a column's ``d_W`` and ``d_b`` rows
    do not depend on the shard's size (``transform``, ``grad_sum_z``: as in
    :func:`~.backward_programs.backward`).

    d_logits chunks are multiples of the grid width ``columns`` (recomputed: nothing is kept) in a
    workspace of :func:`grid_chunk` columns per row, whatever the shard; ``d_W`` is one
    ``[columns, N] x [N, D]`` GEMM per grid block reading its d_logits columns in place (row stride:
    the workspace's), written straight into its ``d_W`` rows or added to the fp32 accumulator by the
    GEMM itself (the vocabulary's cut last block: zero-padded in a ``[N, columns]`` buffer, its rows
    copied or added), so every d_W GEMM has one shape and one operand layout; ``d_b`` sums the
    per-token-block partial rows one after the other (elementwise: the same order for every column);
    ``d_hidden`` is the deterministic fixed-order GEMM, fp32."""
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    need_dh, need_dw, need_db = needs
    need_db = need_db and bias is not None
    dw_acc, db_acc = accumulate if accumulate is not None else (None, None)
    f32 = torch.float32
    if n == 0 or v == 0:
        return empty_call_grads(hidden, weight, bias, needs, accumulate, d_hidden_ready)
    d_hidden = torch.zeros((n, d), device=dev, dtype=f32) if need_dh else None
    local_target = local_target if local_target.is_contiguous() else local_target.contiguous()
    row_max, log_sum = f32_contiguous(row_max), f32_contiguous(log_sum)
    g, gmg, ge, mean_rel = per_token_grads(grad_logp, grad_entropy, grad_lse, mean_rel)
    gsz = None if grad_sum_z is None else f32_contiguous(grad_sum_z)
    chunk = grid_chunk(n, weight.element_size(), workspace_bytes, columns)
    bounds = [(lo, min(lo + chunk, v)) for lo in range(0, v, chunk)]
    dbp = torch.empty((cdiv(n, cfg.bwd_block_n), v), device=dev, dtype=f32) if need_db else g
    precision = dot_precision(hidden.dtype)
    ws = torch.empty((n, chunk), device=dev, dtype=weight.dtype)  # one row stride for every shard
    # the vocabulary's last block, cut: through a zero-padded copy
    cut = need_dw and v % columns != 0
    block = torch.empty((n, columns), device=dev, dtype=weight.dtype) if cut else None
    d_weight = (dw_acc if dw_acc is not None else torch.empty_like(weight)) if need_dw else None
    rows = torch.empty((columns, d), device=dev,
                       dtype=f32 if dw_acc is not None else weight.dtype) if cut else None
    for i_chunk, (v_lo, v_hi) in enumerate(bounds):
        dz = ws[:, : v_hi - v_lo]
        launch_dlogits(hidden, weight, bias, local_target, row_max, log_sum, g, gmg, ge, mean_rel,
                       dz, dbp, v_lo, v_hi, transform, grad_entropy is not None, need_db, cfg,
                       precision, tma, gsz=gsz)
        if d_hidden is not None:
            dh_gemm(dz, weight[v_lo:v_hi], d_hidden, i_chunk, True, cfg, precision)
            if i_chunk == len(bounds) - 1 and d_hidden_ready is not None:
                d_hidden_ready(d_hidden)
        if d_weight is None:
            continue
        for c0 in range(v_lo, v_hi, columns):
            width = min(c0 + columns, v_hi) - c0
            # a whole block, read in place; an accumulator adds it inside the GEMM
            if width == columns:
                operand = ws[:, c0 - v_lo: c0 - v_lo + columns].t()
                if dw_acc is not None:
                    fp32_gemm.addmm_(dw_acc[c0:c0 + columns], operand, hidden)
                else:
                    mm_into(d_weight[c0:c0 + columns], operand, hidden)
                continue
            # the vocabulary's cut last block: zero-padded to the grid width
            block[:, :width] = dz[:, c0 - v_lo:]
            block[:, width:] = 0
            if dw_acc is not None:
                fp32_gemm.mm_into(rows, block.t(), hidden)
                dw_acc[c0:c0 + width] += rows[:width]
            else:
                mm_into(rows, block.t(), hidden)
                d_weight[c0:c0 + width] = rows[:width]
    d_bias = None
    if need_db:
        acc = dbp[0].clone()
        # one row after the other: every column sums in the same order
        for i in range(1, dbp.shape[0]):
            acc += dbp[i]
        d_bias = db_acc.add_(acc) if db_acc is not None else acc.to(bias.dtype)
    return d_hidden, d_weight, d_bias
