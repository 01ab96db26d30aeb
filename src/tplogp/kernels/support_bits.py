"""A sampler's support as the fused kernels read it: per token row, a bitmask of a range of the
shard's columns (torch only: no Triton import).

The call path gives the support as shard-local ids, int64 ``[rows, K]`` with ``-1`` for none
(``ShardCall.support``). The kernels read, per token row and column ``c`` of a range
``[v_lo, v_hi)``, bit ``c % 32`` of int32 word ``c // 32`` (:func:`column_bits`,
``tile_ops.support_masked``): ``cdiv(v_hi - v_lo, 32)`` words a row, 1/32 of the bytes of the
range's fp32 logits.

Algorithm (:func:`column_bits`): each id of the range becomes a word index and a one-bit value
``2^(c % 32)`` (bit 31 as ``-2^31``), and one ``scatter_add`` over the flattened ``[rows, words]``
words sums them. A row's ids are distinct (the call's checks), so the bits that meet in one word are
distinct and their sum is their OR, without a carry and without overflow (bits 0..30 sum to at most
``2^31 - 1``; adding ``-2^31`` stays in range). Ids outside the range and ``-1`` add 0 to a word of
their own row (spread over the row's words: not one shared word). No host sync.

The backward's column chunks (:class:`ColumnChunks`): their bitmasks come from the support's ids
sorted by column once (one sort of the ``N K`` ids, one host read: where each chunk's ids start),
each chunk then one ``scatter_add`` of its own ids alone, where :func:`column_bits` at every chunk
would read all ``N K`` ids again.

Memory (:func:`forward_rows`): the forward masks the whole shard, so its bitmask is
``rows * cdiv(V, 32) * 4`` bytes; a call whose rows' bitmask exceeds the budget's transient part
runs its forward in token chunks whose bitmask fits (each chunk reads the weight again). The
backward builds the bitmask of each d_logits chunk's columns only, which its chunk planning counts
(:func:`chunk_itemsize_budget`): ``1/16`` of a 16-bit d_logits workspace.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..support.tensors import KEEP_ALL

WORD_BITS = 32


def bit_words(cols: int) -> int:
    """int32 words a row's bitmask of ``cols`` columns takes."""
    return -(-cols // WORD_BITS)


def column_bits(ids: torch.Tensor, v_lo: int, v_hi: int) -> torch.Tensor:
    """int32 ``[rows, bit_words(v_hi - v_lo)]``: bit ``c % 32`` of word ``c // 32`` of row ``t`` is
    set iff the column ``v_lo + c`` is one of row ``t``'s ``ids`` (int64 ``[rows, K]``, shard-local,
    ``-1`` for none; distinct per row; a row that starts with ``KEEP_ALL`` keeps every column).
    Module docstring: the algorithm."""
    rows, k = ids.shape
    cols = v_hi - v_lo
    if rows == 0 or bit_words(cols) == 0 or k == 0:
        return torch.zeros((rows, bit_words(cols)), dtype=torch.int32, device=ids.device)
    rel = ids - v_lo
    valid = (ids >= 0) & (rel >= 0) & (rel < cols)
    # an id outside the range adds 0 to a word of its own row picked by the id (spread: the zeros
    # of a narrow range's many outside ids would otherwise all meet in one word, one atomic add
    # after another: ~3 ms per 4M ids on a GPU)
    rel = torch.where(valid, rel, torch.remainder(ids, cols))
    row = torch.arange(rows, device=ids.device).unsqueeze(1).expand(rows, k)
    return _words_of(row.reshape(-1), rel.reshape(-1), cols, ids, valid.reshape(-1))


def _words_of(rows: torch.Tensor, rel: torch.Tensor, cols: int, ids: torch.Tensor,
              valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int32 ``[len(ids), bit_words(cols)]``: the bits of columns ``rel`` (in ``[0, cols)``) of
    rows ``rows`` (integer tensors; ``valid``: which of them count, the others add 0), distinct
    per row, summed into their words (module docstring); the rows of ``ids`` that start with
    ``KEEP_ALL``: every bit."""
    out = torch.zeros((ids.shape[0], bit_words(cols)), dtype=torch.int32, device=ids.device)
    if rel.numel() and out.shape[1]:
        rel = rel.long()
        shift = rel & (WORD_BITS - 1)
        one = torch.where(shift == WORD_BITS - 1, -(1 << (WORD_BITS - 1)),
                          torch.ones_like(rel) << shift)  # bit 31 as -2^31
        if valid is not None:
            one = torch.where(valid, one, 0)
        out.view(-1).scatter_add_(0, rows.long() * out.shape[1] + (rel >> 5), one.to(torch.int32))
    if ids.shape[1]:  # (a computed support's row that keeps every id)
        out.masked_fill_((ids[:, 0] == KEEP_ALL).unsqueeze(1), -1)
    return out


class ColumnChunks:
    """The bitmasks of the column ranges ``[edges[i], edges[i + 1])`` of one support (int64
    ``[rows, K]``, shard-local ids, ``-1`` for none, a ``KEEP_ALL`` row keeping every column), each
    :func:`column_bits`' of its range, from the ids sorted by column once (module docstring).
    ``edges``: increasing column boundaries; one host read here."""

    def __init__(self, ids: torch.Tensor, edges: list[int]) -> None:
        self.ids, self.edges = ids, list(edges)
        k = ids.shape[1]
        # (padding and KEEP_ALL sort past every range; int32: half the bytes of the held ids)
        key = torch.where(ids >= 0, ids, self.edges[-1]).reshape(-1).to(torch.int32)
        self.cols, order = key.sort()
        self.rows = (order // k if k else order).to(torch.int32)
        at = torch.tensor(self.edges, dtype=self.cols.dtype, device=self.cols.device)
        self.starts = torch.searchsorted(self.cols, at).tolist()

    def bits(self, i: int) -> torch.Tensor:
        """Range ``i``'s bitmask: int32 ``[rows, bit_words(edges[i + 1] - edges[i])]``."""
        s, e = self.starts[i], self.starts[i + 1]
        return _words_of(self.rows[s:e], self.cols[s:e] - self.edges[i],
                         self.edges[i + 1] - self.edges[i], self.ids)


def forward_rows(n: int, v: int, budget_bytes: int, align: int) -> int:
    """Token rows per forward chunk: all ``n`` when their bitmask of the ``v`` shard columns fits
    ``budget_bytes`` (the transient part of the call's budget), else the most that fit, a multiple
    of ``align`` (the kernels' token block) and at least ``align``."""
    per_row = 4 * bit_words(v)
    if n * per_row <= budget_bytes:
        return max(n, 1)
    rows = budget_bytes // per_row // align * align
    return max(align, rows)


def chunk_itemsize_budget(workspace_bytes: int, itemsize: int) -> int:
    """The part of the backward's transient budget that its ``[N, chunk]`` d_logits workspace of
    ``itemsize`` bytes an element may take when each chunk also holds its support bitmask
    (``cdiv(chunk, 32)`` int32 words a row, 1/8 byte a column): the two fit ``workspace_bytes``
    together."""
    return workspace_bytes * 8 * itemsize // (8 * itemsize + 1)


__all__ = ["WORD_BITS", "bit_words", "column_bits", "ColumnChunks", "forward_rows",
           "chunk_itemsize_budget"]
