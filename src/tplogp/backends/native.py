"""The ``native`` source: chunked PyTorch, runs on any device.

Algorithm (one vocab shard, see :mod:`tplogp.backends.base` for the contract):

* The ``[N, V_local]`` logits are not held whole unless the budget allows it. Work is tiled into
  ``[tokens_chunk, vocab_chunk]`` fp32 tiles. The byte budget (``ShardCall.workspace_bytes``, else
  ``TPLOGP_WORKSPACE_MB``, else the default) goes to the tiles up to the source's transient size;
  the rest keeps (:func:`tplogp.backends.memory_budget.split`), for the first tiles (in the
  forward's order), the softmax terms ``e = exp(z - m)`` (in the inputs' dtype: bf16, fp16 or fp32)
  with the running max ``m`` per row, whose backward then forms ``p = e exp(m - M - log S)`` instead
  of recomputing the tile (no GEMM; ``p`` carries e's rounding alone, whatever the logits' size:
  docs/operator.md, "Memory budget"). Each tile is one GEMM with fp32 output
  (``torch.mm(..., out_dtype=float32)`` on CUDA, fp32 operands on CPU), so the target logit is read
  from the fp32 accumulator, never from a rounded logit.
* Forward keeps an online softmax per token across vocab tiles: running max ``m``,
  ``s = sum exp(z - m)`` and, for entropy, ``q = sum exp(z - m) (z - m)``; when ``m`` grows to
  ``m'``, ``s <- s e^{m-m'}`` and ``q <- e^{m-m'} (q + s (m - m'))``.
* Backward (vocab tiles outer, token chunks inner: :mod:`tplogp.backends.native_backward`)
  recomputes each tile (or reads a kept one), forms ``dz`` in fp32, then accumulates ``d_hidden``
  (fp32) and ``d_weight`` with fp32-accumulating GEMMs; a low-precision ``d_weight`` is summed per
  vocab tile in an fp32 tile buffer within the tile budget and rounded once. Saved state is O(N).
* ``deterministic=True`` uses a token chunk that does not depend on N and pads the last chunk to it,
  so every GEMM has the same shape whatever the batch: a row's results do not change when other rows
      are added or removed.
* ``deterministic="tp_invariant"`` (:mod:`tplogp.support.invariant`):
  :meth:`NativeBackend.forward_blocks` and the backward run :mod:`tplogp.backends.native_grid`: grid
  blocks of ``GRID_COLUMNS`` columns, each copied into a zero-padded ``[GRID_COLUMNS, D]`` buffer,
  with the deterministic token chunk: every GEMM, every reduction and every elementwise op has one
      shape, so a column's logits, d_W and d_b do not depend on the shard it came in.

The shared tile arithmetic (the fp32 logits tile, row padding, a backward token chunk's vectors) is
in :mod:`tplogp.backends.native_tiles`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..support import settings
from . import memory_budget
from ..kernels.kept import kept_dtype  # (torch only: no Triton import)
from ..support.masked_rows import floored, rescale_max, settle_rows
from . import native_grid
from .base import BlockStats, BudgetParts, ShardCall, ShardGrads, ShardStats, SingleShardOutputs
from .native_backward import backward_tiles
from .native_one_tile import backward_one_tile, forward_one_tile
from . import support_pairs
from .native_support import (by_pairs, chunk_rows, chunked_forward, gathered,
                             gathered_backward, kept_columns, scattered_argmax, support_rows)
from .native_tiles import DETERMINISTIC_TOKEN_CHUNK, _pad_rows, call_logits_tile

# fp32 [tokens, vocab] tiles alive at once in the worst case (z, exp/p, dz) plus slack for
# temporaries.
_TILE_COPIES = 4

def kept_tile_words(rows: int, cols: int, itemsize: int) -> tuple[int, int]:
    """4-byte words of one kept tile: ``(its terms, padded to 16 bytes; its rows' scales)``."""
    return -(-(rows * cols * itemsize) // 16) * 4, rows


def kept_tiles(n_tokens: int, vocab: int, tc: int, vc: int, keep_bytes: int, deterministic: bool,
               itemsize: int = 4) -> tuple[int, int]:
    """``(tiles, 4-byte words)``: the first tiles, in the forward's order (token chunks, then vocab
    tiles), whose kept softmax terms (``itemsize`` bytes each) and per-row scales fit ``keep_bytes``
    together."""
    count, used = 0, 0
    for t0 in range(0, n_tokens, tc):
        rows = tc if deterministic else min(tc, n_tokens - t0)
        for v0 in range(0, vocab, vc):
            size = sum(kept_tile_words(rows, min(v0 + vc, vocab) - v0, itemsize))
            if (used + size) * 4 > keep_bytes:
                return count, used
            used += size
            count += 1
    return count, used


def plan_chunks(n_tokens: int, vocab: int, dim: int, workspace_bytes: int, deterministic: bool,
                low_precision_cpu: bool, dw_tile: bool = False) -> tuple[int, int]:
    """(tokens_chunk, vocab_chunk) so that the fp32 tiles (and CPU upcast copies, and with
    ``dw_tile`` the backward's fp32 ``[vocab_chunk, D]`` d_W tile of low-precision weights) fit
    ``workspace_bytes``."""
    budget_elems = max(workspace_bytes // (4 * _TILE_COPIES), 1)
    # per vocab row, in units of the _TILE_COPIES tile copies: the CPU upcast of a weight slice to
    # fp32, and the one fp32 d_W tile row
    extra_per_vocab = (dim if low_precision_cpu else 0) + (-(-dim // _TILE_COPIES) if dw_tile else 0)
    if deterministic:
        tc = DETERMINISTIC_TOKEN_CHUNK
        vc = max(1, min(vocab, budget_elems // (tc + extra_per_vocab)))
        return tc, vc
    n = max(n_tokens, 1)
    # Whole shard per tile when at least a modest token chunk fits: each token chunk then reads W
    # once.
    min_tokens = min(n, 128)
    if vocab * (min_tokens + extra_per_vocab) <= budget_elems:
        vc = vocab
        tc = min(n, max(1, (budget_elems - vocab * extra_per_vocab) // vocab))
    else:
        tc = min_tokens
        vc = max(1, min(vocab, budget_elems // (tc + extra_per_vocab)))
    return tc, vc


# the forward's plans, by (sizes, dtype, device, call, TPLOGP_WORKSPACE_MB): planned once per layout
# (host time at small shapes); emptied beyond 1024 entries
_plans: dict = {}


def _planned(n: int, d: int, v: int, dtype: torch.dtype, device: torch.device,
             call: ShardCall) -> tuple[int, int, tuple[int, int], torch.dtype]:
    """:func:`_plan_sizes` and the kept dtype of a call, remembered per layout and
    ``TPLOGP_WORKSPACE_MB`` (as the plan read it: ``call.env``; read here for a call without)."""
    key = (n, d, v, dtype, device, call.key, call.env or settings.workspace_setting())
    found = _plans.get(key)
    if found is None:
        if len(_plans) > 1024:
            _plans.clear()
        found = _plans[key] = (*_plan_sizes(n, d, v, dtype, device, call), kept_dtype(dtype))
    return found


def _plan_sizes(n: int, d: int, v: int, dtype: torch.dtype, device: torch.device,
                call: ShardCall) -> tuple[int, int, tuple[int, int]]:
    """``(tokens_chunk, vocab_chunk, (kept tiles, their 4-byte words))`` of an ``[n, d] x [v, d]``
    call."""
    budget = memory_budget.split(NativeBackend.name, call.workspace_bytes, device)
    low_cpu = device.type != "cuda" and dtype != torch.float32
    tc, vc = plan_chunks(n, v, d, budget.transient, call.deterministic, low_cpu,
                         dw_tile=dtype != torch.float32)
    return tc, vc, kept_tiles(n, v, tc, vc, budget.keep, call.deterministic,
                              kept_dtype(dtype).itemsize)


class NativeBackend(BudgetParts):
    """Chunked PyTorch implementation of the per-shard primitives."""

    name = "native"

    def unavailable_reason(self, device: Optional[torch.device] = None) -> Optional[str]:
        return None

    def _plan(self, hidden: torch.Tensor, weight: torch.Tensor,
              call: ShardCall) -> tuple[int, int, tuple[int, int]]:
        """``(tokens_chunk, vocab_chunk, (kept tiles, their 4-byte words))``."""
        return _plan_sizes(hidden.shape[0], hidden.shape[1], weight.shape[0], weight.dtype,
                           hidden.device, call)

    @staticmethod
    def layout_fingerprint(device: torch.device, dtype: torch.dtype) -> str:
        """The source's name: its chunk planning is a function of the call's sizes and the budget
        alone."""
        return NativeBackend.name

    @staticmethod
    def kept_shape(n: int, d: int, v: int, dtype: torch.dtype, device: torch.device,
                   call: ShardCall) -> tuple[int, ...]:
        """Shape of the flat fp32 buffer of the tiles the forward keeps for the backward; ``(0,)``:
        none."""
        if not call.for_backward:
            return (0,)
        _, _, (count, words) = _plan_sizes(n, d, v, dtype, device, call)
        return (words,) if count else (0,)

    @staticmethod
    def kept_capacity(n: int, d: int, v: int, dtype: torch.dtype, device: torch.device,
                      call: ShardCall) -> tuple[int, ...]:
        """A flat fp32 buffer that holds the kept tiles of any call of at most ``n`` rows
        (``ShardBackend``).

        Fewer rows may plan other tiles (a narrower token chunk, a wider vocab tile), so the bound
        is counted for any plan of at most ``n`` rows: a vocab tile is never narrower than ``n``
        rows' (the vocab chunk grows as the rows shrink), every kept tile's words are its terms
        padded to 16 bytes (at most 4 words of padding per tile, at most one tile per row and vocab
        tile) and one scale per row; and the kept tiles' words never pass the keep part of the
        budget."""
        if not call.for_backward or n == 0 or v == 0:
            return (0,)
        tile_bytes, keep_bytes, _ = memory_budget.split(NativeBackend.name, call.workspace_bytes,
                                                        device)
        low_cpu = device.type != "cuda" and dtype != torch.float32
        tc, vc = plan_chunks(n, v, d, tile_bytes, call.deterministic, low_cpu,
                             dw_tile=dtype != torch.float32)
        # (deterministic chunks are whole: padded rows)
        token_chunks = -(-n // tc) if call.deterministic else n
        rows = token_chunks * tc if call.deterministic else n
        vocab_tiles = -(-v // vc)
        bound = -(-(rows * v * kept_dtype(dtype).itemsize) // 4) + rows * vocab_tiles + 4 * token_chunks * vocab_tiles
        words = min(keep_bytes // 4, bound)
        return (words,) if words else (0,)

    @staticmethod
    def _kept_views(kept: Optional[torch.Tensor], n: int, v: int, tc: int, vc: int, count: int,
                    deterministic: bool, dtype: torch.dtype) -> dict:
        """``{(t0, v0): (terms [rows, cols] of dtype, scales [rows] fp32)}``: views of the kept
        tiles in ``kept`` (laid out in the forward's order, each tile's terms then its scales)."""
        views, offset = {}, 0
        if kept is None or count == 0:
            return views
        for t0 in range(0, n, tc):
            rows = tc if deterministic else min(tc, n - t0)
            for v0 in range(0, v, vc):
                if len(views) == count:
                    return views
                cols = min(v0 + vc, v) - v0
                words, scale_words = kept_tile_words(rows, cols, dtype.itemsize)
                terms = kept[offset: offset + words].view(dtype)[: rows * cols].view(rows, cols)
                views[(t0, v0)] = (terms, kept[offset + words: offset + words + scale_words])
                offset += words + scale_words
        return views

    def _support_ways(self, hidden, weight, bias, local_target, call: ShardCall,
                      kept_out: Optional[torch.Tensor]) -> Optional[ShardStats]:
        """The forward statistics of a call with a support that runs on gathered rows: a small
        union of the supports' ids, else narrow supports from their (token, id) pairs, else token
        chunks with small unions; None where the tiles mask the whole shard."""
        narrow = gathered(weight, bias, local_target, call)
        if narrow is not None:
            st = self.forward_stats(hidden, narrow.weight, narrow.bias, narrow.local_target,
                                    narrow.call)
            # a target this shard owns outside every support (a computed support need not hold
            # it): its logit is masked, -inf, as on the masked tiles
            lost = (narrow.local_target < 0) & (local_target >= 0)
            return st._replace(argmax=scattered_argmax(st.argmax, narrow.rows),
                               target_logit=st.target_logit.masked_fill(lost, float("-inf")))
        if kept_out is not None:
            return None
        if by_pairs(call, weight):
            return support_pairs.forward_stats(self.name, hidden, weight, bias, local_target, call)
        rows = chunk_rows(hidden.shape[0], weight.shape[0], call)
        if rows is None:
            return None
        return chunked_forward(lambda h, t, c: self.forward_stats(h, weight, bias, t, c), rows,
                               hidden, local_target, weight.shape[0], call)

    def forward_stats(self, hidden, weight, bias, local_target, call: ShardCall,
                      kept_out: Optional[torch.Tensor] = None) -> ShardStats:
        n, v = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        row_max = torch.full((n,), float("-inf"), device=dev, dtype=torch.float32)
        sum_exp = torch.zeros(n, device=dev, dtype=torch.float32)
        target_logit = torch.zeros(n, device=dev, dtype=torch.float32)
        sum_exp_z = torch.zeros(n, device=dev, dtype=torch.float32) if call.with_entropy else None
        sum_z = torch.zeros(n, device=dev, dtype=torch.float32) if call.with_sum_z else None
        argmax = torch.zeros(n, device=dev, dtype=torch.float32) if call.with_argmax else None
        if n == 0 or v == 0:
            return ShardStats(row_max, sum_exp, target_logit, sum_exp_z, None, sum_z, argmax)
        if call.support is not None:  # (a plain call asks none of the support's questions)
            found = self._support_ways(hidden, weight, bias, local_target, call, kept_out)
            if found is not None:
                return found
        tc, vc, (n_kept, kept_words), terms_dtype = _planned(n, hidden.shape[1], v, weight.dtype,
                                                             dev, call)
        kept = None
        support = call.support  # (a support keeps nothing: its backward recomputes)
        if call.for_backward and n_kept and support is None:  # zeroed: padding bytes defined too
            if kept_out is None:
                kept = torch.zeros(kept_words, device=dev, dtype=torch.float32)
            else:  # the op's buffer (ShardBackend: ``kept_out``)
                assert kept_out.shape == (kept_words,), (kept_out.shape, kept_words)
                kept = kept_out.zero_()
        kept_views = self._kept_views(kept, n, v, tc, vc, n_kept, call.deterministic, terms_dtype)
        # with a slope the kept scale is the running max of the tanh (native_tiles.kept_slope),
        # not of z: the tiles give their tanh max where the transform has one
        ask_tanh_max = bool(kept_views)
        for t0 in range(0, n, tc):
            t1 = min(t0 + tc, n)
            h = hidden[t0:t1]
            if call.deterministic:
                h = _pad_rows(h, tc)
            lt = local_target[t0:t1]
            ids = None if support is None else support_rows(support, t0, t1, h.shape[0])
            m = torch.full((h.shape[0],), float("-inf"), device=dev, dtype=torch.float32)
            # running max of the tanh (a transform with a slope, kept terms): m = the tanh max as
            # a logit, bit for bit
            mt = None
            s = torch.zeros_like(m)
            q = torch.zeros_like(m) if call.with_entropy else None
            tl = torch.zeros(t1 - t0, device=dev, dtype=torch.float32)
            sz = torch.zeros_like(m) if sum_z is not None else None
            am = torch.zeros_like(m) if argmax is not None else None
            for v0 in range(0, v, vc):
                v1 = min(v0 + vc, v)
                keep = kept_views.get((t0, v0))  # its terms exp(z - m') and scales m' are kept
                tile_tanh_max = [] if ask_tanh_max else None
                z = call_logits_tile(h, weight[v0:v1], None if bias is None else bias[v0:v1],
                                     call, tanh_max=tile_tanh_max)
                if ids is not None:  # outside the row's support: -inf (masked columns)
                    z.masked_fill_(~kept_columns(ids, v0, v1), float("-inf"))
                if tile_tanh_max:
                    mt = tile_tanh_max[0] if mt is None else torch.maximum(mt, tile_tanh_max[0])
                rel = lt - v0
                own = (rel >= 0) & (rel < v1 - v0)
                picked = z[: t1 - t0].gather(1, rel.clamp(0, v1 - v0 - 1).unsqueeze(1)).squeeze(1)
                tl = torch.where(own, picked, tl)
                if sz is not None:
                    sz += z.sum(1)
                tile_max = z.amax(1)
                # a later tile's max replaces the id only when larger (the lowest id on ties)
                if am is not None:
                    am = torch.where(tile_max > m, z.argmax(1).to(torch.float32) + v0, am)
                m_new = torch.maximum(m, tile_max)
                m_sub = rescale_max(m_new)  # (finite while every column so far is masked)
                alpha = torch.exp(m - m_sub)  # 0 on the first tile (m = -inf)
                z -= m_sub.unsqueeze(1)  # z - m'
                if q is not None:
                    e = torch.exp(z)
                    shifted = torch.where(alpha > 0, alpha * (q + s * (m - m_new)),
                                          torch.zeros_like(q))
                    q = shifted + floored(z).mul_(e).sum(1)  # e (z - m'), in z's buffer
                else:
                    e = z.exp_()  # in place: the tile is not needed any more
                # the terms, rounded once to the kept dtype, and the running max they follow
                if keep is not None:
                    keep[0].copy_(e)
                    keep[1].copy_(m_new if mt is None else mt)
                s = s * alpha + e.sum(1)
                m = m_new
                del z, e
            row_max[t0:t1] = m[: t1 - t0]
            sum_exp[t0:t1] = s[: t1 - t0]
            target_logit[t0:t1] = tl
            if sum_exp_z is not None:
                sum_exp_z[t0:t1] = q[: t1 - t0]
            if sum_z is not None:
                sum_z[t0:t1] = sz[: t1 - t0]
            if argmax is not None:
                argmax[t0:t1] = am[: t1 - t0]
        return ShardStats(row_max, sum_exp, target_logit, sum_exp_z, kept, sum_z, argmax)

    def forward_single(self, hidden, weight, bias, target, call: ShardCall,
                       kept_out: Optional[torch.Tensor] = None) -> SingleShardOutputs:
        """One shard holds the whole vocab: the outputs finished here (``target`` outside
        ``[0, V)``: nobody's, NaN logp). A call whose logits fit one tile and keep nothing takes
        :func:`forward_one_tile` (fewest ops)."""
        if _one_tile(hidden, weight, call):
            return forward_one_tile(hidden, weight, bias, target, call)
        st = self.forward_stats(hidden, weight, bias, target, call, kept_out)
        row_max, log_sum, lse, mean_rel = settle_rows(st.row_max, st.sum_exp, st.sum_exp_z)
        owned = (target >= 0) & (target < weight.shape[0])
        logp = torch.where(owned, (st.target_logit - row_max) - log_sum, float("nan"))
        return SingleShardOutputs(logp, lse, row_max, log_sum, mean_rel,
                                  None if mean_rel is None else log_sum - mean_rel, st.kept,
                                  st.sum_z, st.argmax)

    @staticmethod
    def grid_columns(device: torch.device, dtype: torch.dtype) -> int:
        """The invariant level's grid block width (:mod:`tplogp.support.invariant`)."""
        return native_grid.GRID_COLUMNS

    def forward_blocks(self, hidden, weight, bias, local_target, call: ShardCall) -> BlockStats:
        """Per-block stats of a grid-aligned shard
        (:func:`tplogp.backends.native_grid.forward_blocks`)."""
        return native_grid.forward_blocks(hidden, weight, bias, local_target, call)

    @staticmethod
    def kept_bytes(n: int, v: int, dtype: torch.dtype, device: torch.device) -> int:
        """Bytes that keep the terms of ``v`` columns of ``n`` tokens (:func:`kept_tiles`): 2 per
        term for 16-bit inputs (4 for fp32), and per tile one fp32 scale per row and up to 16 bytes
        of padding, counted for vocab tiles of at least 256 columns and token chunks of at least 128
        rows (the default tile budgets' tiles are thousands of columns wide: an upper bound
        there)."""
        if n == 0 or v == 0:
            return 0
        vocab_tiles, token_chunks = -(-v // 256), -(-n // 128)
        return n * v * kept_dtype(dtype).itemsize + 4 * n * vocab_tiles + 16 * token_chunks * vocab_tiles

    def backward(self, hidden, weight, bias, local_target, row_max, log_sum, grad_logp,
                 grad_entropy, grad_lse, mean_rel, call: ShardCall, needs: tuple[bool, bool, bool],
                 d_hidden_ready=None, kept=None, accumulate=None, grad_sum_z=None) -> ShardGrads:
        if call.support is not None:  # the gathered rows of a small union, or of token chunks
            grads = gathered_backward(self, hidden, weight, bias, local_target, row_max, log_sum,
                                      grad_logp, grad_entropy, grad_lse, mean_rel, call, needs,
                                      d_hidden_ready, kept, accumulate, grad_sum_z)
            if grads is not None:
                return grads
        if call.grid_columns:
            return native_grid.backward_blocks(hidden, weight, bias, local_target, row_max, log_sum,
                                               grad_logp, grad_entropy, grad_lse, mean_rel, call,
                                               needs, d_hidden_ready, accumulate, grad_sum_z)
        if accumulate is None and kept is None and _one_tile(hidden, weight, call):
            return backward_one_tile(hidden, weight, bias, local_target, row_max, log_sum,
                                     grad_logp, grad_entropy,
                                      grad_lse, mean_rel, call, needs, d_hidden_ready, grad_sum_z)
        need_h, need_w, need_b = needs
        n, d = hidden.shape
        v = weight.shape[0]
        dev = hidden.device
        dw_acc, db_acc = accumulate if accumulate is not None else (None, None)
        d_hidden = torch.zeros(n, d, device=dev, dtype=torch.float32) if need_h else None
        # d_W: the caller's fp32 accumulator, else the output itself for fp32 weights, else the
        # output in the weight dtype, each vocab tile's rows summed in an fp32 tile buffer and
        # rounded once (no [V, D] fp32 buffer)
        d_weight = None
        if need_w:
            d_weight = dw_acc if dw_acc is not None else (
                torch.zeros(v, d, device=dev, dtype=torch.float32) if weight.dtype == torch.float32
                else torch.empty(v, d, device=dev, dtype=weight.dtype))
        d_bias32 = None
        if need_b and bias is not None:
            d_bias32 = db_acc if db_acc is not None else torch.zeros(v, device=dev,
                                                                     dtype=torch.float32)
        if n > 0 and v > 0 and (need_h or need_w or d_bias32 is not None):
            tc, vc, (n_kept, _) = self._plan(hidden, weight, call)
            kept_views = self._kept_views(kept, n, v, tc, vc, n_kept, call.deterministic,
                                          kept_dtype(weight.dtype))
            tile_bytes = memory_budget.split(self.name, call.workspace_bytes, dev).transient
            # d_W rows updated per GEMM when the update needs a temporary (low-precision operands
            # on CUDA)
            rows_per_block = max(1, tile_bytes // (4 * _TILE_COPIES * max(d, 1)))
            backward_tiles(hidden, weight, bias, local_target, row_max, log_sum, grad_logp,
                           grad_entropy, grad_lse, mean_rel, call, d_hidden, d_weight, d_bias32,
                           tc, vc, kept_views, rows_per_block, d_hidden_ready, grad_sum_z)
        else:
            if d_weight is not None and d_weight.dtype != torch.float32:
                d_weight.zero_()
            if d_hidden is not None and d_hidden_ready is not None:
                d_hidden_ready(d_hidden)
        d_bias = None
        if d_bias32 is not None:
            d_bias = d_bias32 if (bias.dtype == torch.float32 or db_acc is not None) else d_bias32.to(bias.dtype)
        return ShardGrads(d_hidden, d_weight, d_bias)

# ---- one tile: a call whose logits fit one [N, V] tile in the tile budget and keep nothing (small
# (its arithmetic: tplogp.backends.native_one_tile)

_one_tile_cache: dict = {}


def _one_tile(hidden: torch.Tensor, weight: torch.Tensor, call: ShardCall) -> bool:
    """Whether the call's plan is one ``[N, V]`` tile that keeps nothing for the backward (and not
    deterministic: that pads token chunks), remembered per (sizes, dtype, device, the call's
    settings ``call.key``, ``TPLOGP_WORKSPACE_MB``: ``call.env``, or read here for a call
    without)."""
    if call.deterministic or call.support is not None:
        return False
    key = (hidden.shape, weight.shape, weight.dtype, hidden.device, call.key,
           call.env or settings.workspace_setting())
    one = _one_tile_cache.get(key)
    if one is None:
        n, v = hidden.shape[0], weight.shape[0]
        tc, vc, (n_kept, _) = _plan_sizes(n, hidden.shape[1], v, weight.dtype, hidden.device, call)
        one = _one_tile_cache[key] = n > 0 and v > 0 and tc >= n and vc >= v and not (call.for_backward and n_kept)
        if len(_one_tile_cache) > 1024:
            _one_tile_cache.clear()
    return one
