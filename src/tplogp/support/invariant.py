"""The tensor-parallel-invariant level of ``deterministic`` (``deterministic="tp_invariant"``):
logp, entropy and lse with the same bits at every TP degree and for any shard boundaries.

Its pieces, used by :mod:`tplogp.op.tp` (and the fused loss), each independent of the rank count:

* **The grid.** The vocabulary is cut into blocks of ``B`` columns aligned to id 0 (``B``: the
  source's ``grid_columns``, a constant of the source, device and dtype, never of a shard). Every
  logit is computed by the
  same arithmetic whatever the shard: the sources compute whole blocks only, with tiles aligned to
  the grid and a fixed tile config (no split-K), and per block they return the block's max ``m_b``,
  ``s_b = sum exp(z - m_b)`` and, for entropy, ``q_b = sum exp(z - m_b)(z - m_b)``
  (:class:`tplogp.backends.base.BlockStats`).
* **The re-shard** (:class:`Regrid`). Shards cut blocks. Rank ``r`` owning ``[start, end)`` computes
  the blocks whose first column it owns, ``[lo, hi)`` with ``lo = ceil_B(start)`` and
  ``hi = min(ceil_B(end), V)``. The few rows of its last block that later ranks own (``[end, hi)``,
  under ``B`` rows) come from those ranks' heads ``[start_k, lo_k)`` in one ``all_gather`` per call,
  weight and bias rows packed together; in the backward the ``d_W`` / ``d_b`` rows computed for
  foreign rows go back to their owners in one ``all_gather`` as well. Every rank's boundaries come
  from the call's group record (:mod:`tplogp.op.group_record`, which gathers each rank's range
  anyway); an op's backward under ``torch.compile``, which exchanges no record, gathers them in one
  small ``all_gather`` over a CPU group (:func:`shard_bounds`: nothing waits for a device).
* **The exact merge** (:func:`merge_blocks`). The global row max ``M`` is an int64 all-reduce MAX of
  a key made of the max's fp32 bits (ordered like the floats; exact in any order). Each block's
  share ``s_b exp(m_b - M)`` (and the entropy's ``exp(m_b - M)(q_b + s_b (m_b - M))``) is rounded to
  fixed point with ``FIXED_POINT_BITS`` fraction bits as an int64, summed in int64 (associative:
  exact in any order and grouping) and all-reduced with SUM, then
  converted back: the same bits for any rank count. The target logit travels as its fp32 bit pattern
  in the same int64 all-reduce (one rank holds it, the others add 0).
* **The argmax** (``return_argmax``). The max's key carries ``2^32 - 1 - id`` in its low 32 bits
  (``id``: the global id of the lowest column of a block's max): the MAX all-reduce gives the global
  max and, among the blocks and ranks that reach it, the lowest id. Exact, in the same collective.
* **The sum of z** (label smoothing). Each block's ``sum z`` is an fp32 sum in a fixed order within
  the block. The MAX all-reduce also takes each row's largest ``|block sum|``, ``R`` (its bits), so
  every rank agrees on a per-row scale: with ``R < 2^e`` and the vocabulary's ``ceil(V / B) <= 2^c``
  blocks, each block sum is rounded to an int64 with ``k = 62 - c - e`` fraction bits
  (:func:`fixed_point_shift`), so the sum stays below ``2^62``; the int64s join the SUM all-reduce
  and come back through float64 to fp32.

Bounds. A block's share lies in ``[0, B]`` and the entropy share in ``[-B/e, 0]``, so the int64 sums
stay below ``V 2^FIXED_POINT_BITS``: the vocabulary must be below ``MAX_VOCAB = 2^23``. Each share
is rounded once, by at most ``2^-(FIXED_POINT_BITS + 1)``; the sum of exp is at least 1 (the block
holding the max adds ``s_b >= 1``), so its relative error from the rounding is at most
``(V / B) 2^-41``, below fp32's ``2^-24`` for ``V / B < 2^17``. The sum of z: each of the
``ceil(V / B)`` block sums is rounded by at most ``2^-(k+1)``, in all at most
``2^(2c + e - 63) <= R 2^(2c - 62)``, ``R 2^-28`` for ``V / B < 2^17`` (``c <= 17``): under a
sixteenth of an fp32 ulp of the largest block sum, before the result's one rounding to fp32. A row
with a non-finite logit gets NaN.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from .comm import all_gather_flat, host_group
from .masked_rows import settle_rows

LEVEL = "tp_invariant"  # the value of ``deterministic`` that asks for this level
FIXED_POINT_BITS = 40
MAX_VOCAB = 1 << 23  # V 2^FIXED_POINT_BITS < 2^63
_SCALE = float(1 << FIXED_POINT_BITS)


def ceil_to(x: int, columns: int) -> int:
    return -(-x // columns) * columns


def grid_range(start: int, end: int, vocab: int, columns: int) -> tuple[int, int]:
    """``[lo, hi)``: the columns of the grid blocks whose first column lies in the shard
    ``[start, end)`` (empty, ``lo == hi == end``, when none does)."""
    lo = ceil_to(start, columns)
    if lo >= end:
        return end, end
    return lo, min(ceil_to(end, columns), vocab)


def head_rows(start: int, end: int, columns: int) -> int:
    """How many of a shard's first rows belong to a block that an earlier rank computes."""
    return min(ceil_to(start, columns), end) - start


# ---- fixed point ---------------------------------------------------------------------------------

def to_fixed(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` (``|x| <= 2^22``) as int64 fixed point with ``FIXED_POINT_BITS`` fraction bits,
    rounded to nearest."""
    return torch.round(x.to(torch.float64) * _SCALE).to(torch.int64)


def from_fixed(i: torch.Tensor) -> torch.Tensor:
    """int64 fixed point -> fp32 (through float64: one rounding of the integer, then one to
    fp32)."""
    return (i.to(torch.float64) / _SCALE).to(torch.float32)


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns (int32) -> int32 in the order of the floats (negative ones' magnitude bits
    flipped); its own inverse."""
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


_LOW = 1 << 32  # a max key: ordered(max) * 2^32 + (2^32 - 1 - the max's global id)


def _max_keys(m: torch.Tensor, ids: Optional[torch.Tensor]) -> torch.Tensor:
    """int64 keys of per-block maxima ``m`` ``[blocks, N]`` (and their global ids): ordered like
    ``(max, -id)``, so the largest key holds the largest max and, among equal maxima, the lowest id.
    ``-0.0`` counts as ``+0.0``."""
    key = _ordered((m + 0.0).view(torch.int32)).to(torch.int64) * _LOW
    return key + (_LOW - 1 - ids) if ids is not None else key


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """``2^k`` as float64, exactly (built from its bits), for int64 ``k`` in ``[-1022, 1023]``."""
    return ((k + 1023) << 52).view(torch.float64)


def fixed_point_shift(bound: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """Per row, the fraction bits ``k`` of the sum of z's fixed point (module docstring):
    ``62 - c - e`` with ``bound < 2^e`` (``bound``: the row's largest ``|block sum|`` over every
    block, fp32) and ``n_blocks <= 2^c`` (the vocabulary's block count), so ``n_blocks`` shares
    below ``2^(62 - c)`` each sum below ``2^62``."""
    c = (n_blocks - 1).bit_length()
    # bound = mantissa 2^e, mantissa in [0.5, 1) (e = 0 for 0)
    e = torch.frexp(bound)[1].to(torch.int64)
    return 62 - c - e


def merge_blocks(blocks, owned: torch.Tensor, regrid: "Regrid", with_entropy: bool,
                 with_sum_z: bool = False, with_argmax: bool = False):
    """The exact cross-block, cross-rank merge (module docstring) of one rank's
    :class:`~tplogp.backends.base.BlockStats`; ``owned``: ``[N]`` bool, the rows whose target this
    rank's blocks hold; ``regrid``: the rank's :class:`Regrid` (group, blocks' first global id,
    vocabulary). Two collectives with a group: an int64 all-reduce MAX, then an int64 all-reduce
    SUM.

    Returns:
        ``(M, log S, lse, target logit - M, owner count, E_p[z] - M or None, sum_z or None,
        argmax or None)``, fp32 ``[N]`` (count int64; argmax: global ids as fp32), the same bits on
        every rank and for every rank count; a row with no unmasked column is settled by
        :func:`tplogp.support.masked_rows.settle_rows`.
    """
    m, s = blocks.block_max, blocks.block_sum  # [blocks, N]
    n = m.shape[1]
    group, world_size = regrid.group, len(regrid.bounds)
    ids = None
    if with_argmax:  # global ids (the grid rows start at lo)
        ids = blocks.block_argmax.to(torch.int64) + regrid.lo
    # the MAX all-reduce: the max's key (with the argmax: the lowest id of the global max) and, for
    # the sum of z, the largest |block sum| (non-negative floats order like their bits)
    rows = [_max_keys(m, ids).amax(0) if m.shape[0] else torch.full((n,),
                                                                    torch.iinfo(torch.int64).min,
                                                                      device=m.device,
                                                                      dtype=torch.int64)]
    if with_sum_z:
        bound = (blocks.block_sum_z.abs().amax(0) if m.shape[0]
                 else torch.zeros(n, device=m.device, dtype=torch.float32))
        rows.append(bound.view(torch.int32).to(torch.int64))
    top = torch.stack(rows)
    if world_size > 1:
        buf = top.to(regrid.comm_device)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
        top = buf.to(m.device)
    big_m = _ordered(torch.div(top[0], _LOW, rounding_mode="floor").to(torch.int32)).view(torch.float32)
    # m_b - M, 0 for a block with no unmasked column (s_b = 0, m_b = -inf: it adds 0)
    rel = torch.where(s > 0, m - big_m.unsqueeze(0), torch.zeros_like(s))
    scale = torch.exp(rel)  # exp(m_b - M) <= 1
    cols = [to_fixed(s * scale).sum(0)]
    if with_entropy:
        cols.append(to_fixed(scale * (blocks.block_sez + s * rel)).sum(0))
    if with_sum_z:
        bound = top[1].to(torch.int32).view(torch.float32)
        shift_bits = fixed_point_shift(bound, -(-regrid.vocab // regrid.columns))
        finite = torch.isfinite(bound)
        shift_bits = torch.where(finite, shift_bits, 0)
        # exact: a power of 2, 24-bit shares
        shares = blocks.block_sum_z.to(torch.float64) * _pow2(shift_bits)
        cols.append(torch.where(finite, shares, 0.0).round().to(torch.int64).sum(0))
    # its bits; 0 where not owned here
    cols.append(blocks.target_logit.view(torch.int32).to(torch.int64))
    cols.append(owned.to(torch.int64))
    packed = torch.stack(cols)  # [3 to 5, N] int64
    if world_size > 1:
        buf = packed.to(regrid.comm_device)
        dist.all_reduce(buf, group=group)  # int64 sums: exact, any order
        packed = buf.to(m.device)
    big_m, log_sum, lse, mean_rel = settle_rows(big_m, from_fixed(packed[0]),
                                                from_fixed(packed[1]) if with_entropy else None)
    target = packed[-2].to(torch.int32).view(torch.float32)
    count = packed[-1]
    sum_z = None
    if with_sum_z:  # a row with a non-finite logit gets NaN
        exact = (packed[-3].to(torch.float64) * _pow2(-shift_bits)).to(torch.float32)
        sum_z = torch.where(finite, exact, float("nan"))
    argmax = None
    if with_argmax:
        argmax = (_LOW - 1 - top[0] % _LOW).to(torch.float32)
    return big_m, log_sum, lse, target - big_m, count, mean_rel, sum_z, argmax


# ---- the re-shard --------------------------------------------------------------------------------

def shard_bounds(group, comm_device: torch.device, start: int, v_local: int) -> list[tuple[int, int]]:
    """Every rank's ``(start, end)``, rank-major: one small ``all_gather`` over a CPU group where
    one can be had (:func:`tplogp.support.comm.host_group`), so nothing waits for a device."""
    host = host_group(group, comm_device)
    device = torch.device("cpu") if host is not None else comm_device
    mine = torch.tensor([start, start + v_local], dtype=torch.int64, device=device)
    rows = all_gather_flat(mine, host if host is not None else group).view(-1, 2).cpu().tolist()
    return [(a, b) for a, b in rows]


class Regrid:
    """One rank's re-shard onto the grid (module docstring): which rows it computes, which it takes
    from later ranks, and where the gradients of its head rows come from.

    Args:
        group, comm_device: the TP group and where its collectives take tensors (None: one shard).
        rank: this rank's index in ``bounds``.
        bounds: every rank's ``(start, end)``.
        columns: the grid's block width ``B``.
        vocab: the global vocabulary.
    """

    def __init__(self, group, comm_device: Optional[torch.device], rank: int,
                 bounds: list[tuple[int, int]], columns: int, vocab: int) -> None:
        self.group, self.comm_device, self.rank = group, comm_device, rank
        self.bounds, self.columns, self.vocab = bounds, columns, vocab
        self.start, self.end = bounds[rank]
        self.lo, self.hi = grid_range(self.start, self.end, vocab, columns)
        self.head = head_rows(self.start, self.end, columns)
        heads = [head_rows(a, b, columns) for a, b in bounds]
        ranges = [grid_range(a, b, vocab, columns) for a, b in bounds]
        tails = [max(0, hi - b) for (_, b), (_, hi) in zip(bounds, ranges)]
        self.max_head, self.max_tail = max(heads), max(tails)
        # the foreign rows [end, hi): (rank, rows) taken from the heads of the next ranks, in order
        self.takes: list[tuple[int, int]] = []
        need, k = self.hi - self.end if self.hi > self.end else 0, self.rank + 1
        while need > 0:
            rows = min(heads[k], need)
            self.takes.append((k, rows))
            need -= rows
            k += 1
        # the rank that computes this rank's head rows and where they sit in its tail
        self.head_source: Optional[tuple[int, int]] = None
        if self.head:
            j = next(j for j, (lo, hi) in enumerate(ranges) if lo <= self.start < hi)
            self.head_source = (j, self.start - bounds[j][1])

    @property
    def identity(self) -> bool:
        """No row moves anywhere (every shard boundary on the grid, or one shard)."""
        return self.max_head == 0

    def _gather(self, parts: list[Optional[torch.Tensor]], rows: int) -> list[Optional[torch.Tensor]]:
        """Every rank's ``parts`` (tensors of ``rows`` leading rows at most, None skipped) in one
        ``all_gather`` of their bytes, padded to ``rows``; returns per part a ``[world, rows, ...]``
        tensor (None for None)."""
        present = [p for p in parts if p is not None]
        device = present[0].device
        pieces, widths = [], []
        for p in present:
            width = math.prod(p.shape[1:])  # elements per row (p may have no rows)
            b = torch.zeros((rows, width * p.element_size()), dtype=torch.uint8, device=device)
            if p.shape[0]:
                b[: p.shape[0]] = p.reshape(p.shape[0], width).contiguous().view(torch.uint8)
            pieces.append(b)
            widths.append(b.shape[1])
        packed = torch.cat(pieces, 1) if len(pieces) > 1 else pieces[0]
        world = len(self.bounds)
        got = all_gather_flat(packed.to(self.comm_device), self.group).to(device).view(world, rows,
                                                                                       -1)
        out, col = [], 0
        it = iter(zip(present, widths))
        for p in parts:
            if p is None:
                out.append(None)
                continue
            q, width = next(it)
            raw = got[:, :, col: col + width].contiguous().view(q.dtype)
            out.append(raw.view(world, rows, *q.shape[1:]))
            col += width
        return out

    def rows(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        """``(weight rows [lo, hi), bias rows or None)``: the own rows from ``lo`` on and the later
        ranks' head rows (one ``all_gather``)."""
        if self.identity:
            return weight, bias
        h = self.head
        gw, gb = self._gather([weight[: h], None if bias is None else bias[: h]], self.max_head)
        if self.hi <= self.end:  # nothing foreign: a view of the own rows
            return weight[h:], None if bias is None else bias[h:]
        w = torch.cat([weight[h:]] + [gw[k, :rows] for k, rows in self.takes])
        b = None if bias is None else torch.cat([bias[h:]] + [gb[k, :rows] for k,
                                                              rows in self.takes])
        return w, b

    def grads_back(self, d_weight: Optional[torch.Tensor], d_bias: Optional[torch.Tensor]):
        """Gradients of the rows ``[lo, hi)`` -> gradients of the own shard ``[start, end)``: the
        foreign rows go to their owners and the head rows come from the rank that computed them (one
        ``all_gather``)."""
        if self.identity or (d_weight is None and d_bias is None):
            return d_weight, d_bias
        own = self.end - self.lo if self.lo < self.end else 0
        tails = [None if t is None else t[own:] for t in (d_weight, d_bias)]
        gw, gb = self._gather(tails, self.max_tail)
        out = []
        for t, g in ((d_weight, gw), (d_bias, gb)):
            if t is None:
                out.append(None)
                continue
            mine = t[:own]
            if self.head_source is not None:
                j, offset = self.head_source
                mine = torch.cat([g[j, offset: offset + self.head], mine])
            out.append(mine)
        return tuple(out)

    def local_targets(self, target: torch.Tensor) -> torch.Tensor:
        """Global target ids -> ids relative to ``lo`` where ``[lo, hi)`` holds them, else -1."""
        rel = target - self.lo if self.lo else target
        return torch.where((rel >= 0) & (rel < self.hi - self.lo), rel, -1)


class RegridRows(torch.autograd.Function):
    """:meth:`Regrid.rows` as a differentiable step: its backward is :meth:`Regrid.grads_back`."""

    @staticmethod
    def forward(ctx, regrid: Regrid, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        ctx.regrid = regrid
        ctx.has_bias = bias is not None
        w, b = regrid.rows(weight, bias)
        return (w, b) if b is not None else (w,)

    @staticmethod
    def backward(ctx, d_weight, *rest):
        d_bias = rest[0] if ctx.has_bias else None
        d_w, d_b = ctx.regrid.grads_back(d_weight, d_bias)
        return None, d_w, d_b


def regrid_rows(regrid: Regrid, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """``(weight rows, bias rows)`` of :meth:`Regrid.rows`, differentiable when something requires a
    gradient."""
    if regrid.identity:
        return weight, bias
    if torch.is_grad_enabled() and (weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        out = RegridRows.apply(regrid, weight, bias)
        return out[0], (out[1] if bias is not None else None)
    return regrid.rows(weight, bias)


__all__ = ["LEVEL", "FIXED_POINT_BITS", "MAX_VOCAB", "grid_range", "head_rows", "to_fixed",
           "from_fixed", "fixed_point_shift", "merge_blocks", "shard_bounds", "Regrid",
           "RegridRows", "regrid_rows"]
