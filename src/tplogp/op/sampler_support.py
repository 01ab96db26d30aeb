"""The sampler's support computed from its parameters (``top_k=``, ``top_p=``, ``min_p=``), as
vLLM's v1 sampler keeps its ids, without the ``[tokens, vocab]`` logits in memory.

Definition, per token ``t`` with ``z`` the logits after the softcap and the temperature (the op's
``z``, in fp32), in vLLM's order (temperature, then min-p, then top-k, then top-p):

1. min-p: keep ``v`` when ``p_v >= min_p * max_u p_u`` (``p = softmax(z)``), i.e.
   ``exp(z_v - max z) >= min_p``;
2. top-k: keep ``v`` when ``z_v`` is at least the ``k``-th largest logit (every id tied with the
   ``k``-th is kept). The two sets are top sets of the logits, so their intersection does not
   depend on their order;
3. top-p, over the distribution renormalized over what 1 and 2 kept (``R``; the whole vocabulary
   when neither is on): rank ``R``'s ids by logit, largest first, ties by id, the LOWER id first
   (as ``return_argmax`` takes the lowest id); keep an id when the renormalized mass of the ids
   ranked before it is below ``top_p``. That is vLLM's rule (sort ascending, drop the ids whose
   cumulative mass is at most ``1 - top_p``, always keep the largest), with the order of tied
   logits, which vLLM's sort leaves unspecified, fixed: at a boundary that falls inside a group of
   tied logits, the lower ids are kept. ``top_p = 1`` keeps every id of ``R``.

Ids whose logit is ``-inf`` are never kept. A token whose target is not in its support gets logp
``-inf`` (the target has probability 0 under the sampler's distribution).

Algorithm (:func:`sampler_support`). Every token's support is a top prefix of its logits in the
order above. The first round streams each rank's shard of the logits once (token chunks x vocab
chunks, fp32 GEMMs, within the call's transient budget) and keeps per token its ``M`` largest
logits and their ids, the ``M + 1``-th value (its *floor*: every id of the shard above it is among
the candidates) and the shard's max. One ``all_gather`` of these (float64, ``[tokens, 2 M + 3]``
per rank) gives every rank the same candidates and max; each rank then applies the
definition in float64 to the merged candidates, ranked as above (one sort of int64 keys: the fp32
value's order-preserving bits, then the id's complement). A token's answer is exact when some
candidate strictly above the merged floor (the largest rank floor) is left out of the support (of
``R`` when top-k or min-p is on, whose normalizer is then among the candidates), when for top-p
alone (normalized with the merged log-sum-exp) the candidates above the floor hold ``top_p`` (every
id below has at least that much ranked before it), when the floor lies below a bound ``lo`` of the
support's logits (min-p's ``max z + log(min_p)``; for top-p alone the bottom of its grid window,
below ``lse + log((1 - top_p) / V) - 1``, below which all ids together hold less than
``1 - top_p``), or when no rank left an id out.
Tokens whose answer is not yet exact run again (only they, every rank alike: the decision comes
from the gathered data).

Tokens with top-p alone (no top-k, no min-p) take no ``topk`` in the first round either: each rank
keeps their max, softmax sum (fp32 terms, float64 sums) and 64 bins below the running max on a
grid fixed before the pass (width ``(log V + 1 - log(1 - top_p)) / 59``: the window reaches below
the bound ``lo`` below), each bin's count and each group of 4 bins' mass, the bins moved down and
rescaled as the max rises (:func:`tplogp.op.sampler_grid.grid_candidates`); the gather merges
the ranks' windows by their tops' grid indices and gives the log-sum-exp and, per bin, a mass
whose sum from the top is at most the true one (the groups' masses, refined within a group by the
counts times the bins' bottoms: :func:`_grid_edges`), and the tokens collect next from their
windows as the counted tokens below do, with no counting pass (16 more slots per rank: a logit
within rounding of a bin's edge may fall on its other side in the collecting round). On one shard
(no group), where one tile holds a token chunk's logits, the first round does that collecting
itself, from the tile in hand, as soon as its bins are counted (up to ``GRID_CANDIDATES`` ids a
token; a token whose bins hold more collects in the next round), when every token of the call with
a filter on has top-p alone (the first round's candidates are every token's): the decision then
needs no second pass.

Tokens with min-p and no top-k take no ``topk`` in the first round: each rank collects its ids at
least its running max plus ``log(min_p)`` (rounded down to fp32; the max only rises, so this holds
every id of the support: a rank's max is at most the merged one), as a collecting round does
(below), and the floor is the largest logit not collected; the answer is then exact unless a rank
held more than ``M`` such ids (those rows count and collect from their bound, below).

The other tokens with a bound then take one counting pass (one more ``all_gather``): each rank
counts its logits in ``BINS`` = 64 equal bins between ``lo`` and the max
(``floor((max - z) 64 / (max - lo))`` in fp32, non-increasing in ``z``, so the ids of the top bins
are a top set of the logits; below ``lo``: none). A top-p-alone token's window is such a range
too, its bins those of the first round. The next round *collects*: down to the first bin where the
mass from the top passes ``top_p`` by ``MASS_MARGIN`` (top-p alone), else down to ``lo``. Per vocab
chunk, the ids of those bins (those at least a threshold found once per token by bisection over the
fp32 values with the same bin function) get their slots from a running count and a cumulative sum
along the row and are scattered into a ``[tokens, M]`` buffer (``M``: the most ids any rank counted
there, known on the host after the counting pass's read; where the tiles run as torch
operations on a GPU, the ids not collected, and the counting pass's logits below ``lo``, go to
``SPREAD`` columns per row that are dropped, by column, so that no one address takes them all;
where they run as kernels, :mod:`tplogp.kernels.sampler_kernels`); the floor is the largest logit
not collected.
No host read per chunk and no ``topk``: the candidates are sorted once, after the gather.
The two passes compute the same logits in the same chunks and the same bins, so a rank's ids fit; a
token whose ids do not (a GEMM that gave other bits) or that its bins did not settle collects again
down to ``lo``, then takes the largest logits. Tokens without a bound (ties at top-k's ``k``-th
logit) take ``4 M`` per round up to the vocabulary, where every rank sends every id. ``M`` starts at
the largest ``top_k`` plus 16 (at least 256 when some token has min-p without top-k) and never
shrinks. Tokens whose filters are all off keep every id (the ``KEEP_ALL`` row of
:mod:`tplogp.op.support_ids`).

Cost: one forward pass over the vocabulary per round and one collective and one host read per round.
A token whose support fits the first ``M`` (a top-k; min-p over a peaked distribution) settles in
the first round, whose ``topk`` of ``M + 1`` per chunk costs about its GEMM on a CPU. Top-p alone
takes two passes, whatever its distribution (the first round with its bins, the collecting round),
both with a few elementwise operations per logit and no ``topk``, and one sort of
``[tokens, world M]`` candidates; one pass on one shard whose token chunks fit a tile and whose
supports fit ``GRID_CANDIDATES``. Min-p alone whose ids pass the first round's ``M`` on a rank
takes three (the first round, the counting pass, the collecting round). Why 256 to start: a
smaller first ``M`` saves part of the first round's ``topk``, but a token whose support is past it
takes the two further passes.

The kept ids' logits are the ranked candidates' values: :func:`sampler_support_with_logits` returns
them beside the ids (while the candidates are few enough to keep), and a 16-bit call's forward takes
its statistics from them with no pass of its own (:func:`tplogp.op.tp.shard_forward`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..backends import memory_budget
from ..backends.base import ShardCall
from ..support.comm import all_gather_flat
from .sampler_params import SamplerParams
from .sampler_grid import COARSE, bin_masses, grid_candidates, grid_columns, last_bin
from .sampler_passes import (BINS, bin_scale, from_key, moved_bins, ordered, shard_bins,
                             shard_candidates)
from .support_ids import KEEP_ALL

SLACK = 16  # candidates beyond the largest top_k (ties at the k-th logit, the excluded one)
MIN_CANDIDATES = 256  # with top-p or min-p: the first round's candidates at least
# top-p alone on one shard: the candidates its first round collects from its tile at most (a row
# whose bins hold more collects in the next round)
GRID_CANDIDATES = 2048
GROWTH = 4  # a round's candidates over the previous round's


def _lower_bounds(params: SamplerParams, top: torch.Tensor) -> torch.Tensor:
    """Per row, a logit below which no id of the support lies, or ``-inf`` when none is known:
    ``max z + log(min_p)`` with min-p (the support lies within min-p's ids). (Top-p alone's is the
    bottom of its grid window: :func:`_grid_width`.)"""
    lo = torch.full_like(top, float("-inf"))
    if params.min_p is not None:
        lo = torch.where(params.min_p > 0, top + torch.log(params.min_p), lo)
    return torch.where(torch.isfinite(lo) & (lo < top), lo, float("-inf"))


def _binned_sizes(bins: torch.Tensor, params: SamplerParams, slack: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From every rank's bins (``[world, rows, 2 BINS]``): per row, the last bin the next round
    collects (top-p alone: the first where the mass from the top passes ``top_p`` by
    ``MASS_MARGIN``; else the last, down to the bound), and the most ids any rank holds in the
    bins up to it plus ``slack`` (float64 ``[rows]``), and in all (float64)."""
    counts, masses = bins[..., :BINS], bins[..., BINS:].sum(0)
    last = torch.full((counts.shape[1],), BINS - 1, dtype=torch.int64, device=bins.device)
    if params.top_p is not None:
        first = last_bin(masses, params.top_p)
        only_p = (params.top_k <= 0 if params.top_k is not None else True)
        only_p = only_p & (params.min_p <= 0 if params.min_p is not None else True)
        last = torch.where(only_p & (params.top_p < 1), first, last)
    inside = torch.arange(BINS, device=bins.device)[None, :] <= last[:, None]
    size = (counts * inside).sum(2).max(0).values + slack
    return last.double(), size, counts.sum(2).max(0).values


def _grid_width(top_p: torch.Tensor, vocab: int) -> torch.Tensor:
    """Per row with top-p alone (``top_p``), the width of its grid bins (float64): ``BINS - COARSE
    - 1`` of them span ``log V + 1 - log(1 - top_p)``. The ids below ``lse + log((1 - top_p) / V)
    - 1`` hold less than ``1 - top_p`` of the mass together, so the support reaches no lower, and
    that bound lies at most the span below the max (``lse >= max``): a window of ``BINS`` whose
    top is less than ``COARSE`` bins above the max (:func:`~.sampler_grid.grid_index`) reaches
    below it, and its bottom is the row's bound ``lo``."""
    span = math.log(vocab) + 1 - torch.log1p(-top_p.double().clamp(max=1 - 1e-12))
    return span / (BINS - COARSE - 1)


def _grid_edges(ranks: torch.Tensor, m: int, width: torch.Tensor, lse: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """From every rank's grid rows of a first round (``[world, rows, 2 m + 4 + BINS +
    MASS_BINS]``): the merged window's top (the largest rank top: float64 ``[rows]``) and every
    rank's bins moved into it (``[world, rows, 2 BINS]``: the counts, then per bin a mass
    ``exp(z - lse)`` whose sum from the top through any bin is at most the logits' there:
    :func:`~.sampler_grid.bin_masses`, linear in the ranks' counts and groups' masses)."""
    index = ranks[:, :, 2 * m + 3]
    top_index = index.max(0).values
    moved = top_index[None, :] - index
    counts = moved_bins(ranks[:, :, 2 * m + 4:2 * m + 4 + BINS], moved)
    groups = moved_bins(ranks[:, :, 2 * m + 4 + BINS:], moved, COARSE)
    row_max = ranks[:, :, 2 * m + 1]
    groups = groups * torch.exp(row_max - lse[None, :]).nan_to_num_(nan=0.0)[:, :, None]
    top = top_index * width
    return top, torch.cat([counts, bin_masses(counts, groups, top, width, lse)], 2)


def _ranked(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates ranked by value, largest first, ties by id, lowest first; padding (``-inf``,
    ``-1``) last. One sort of int64 keys, read back: the value (an fp32 logit, exact in float64;
    ``-0`` as ``+0``) as its order-preserving key in the high 32 bits, the id's complement in the
    low 32."""
    low = (1 << 32) - 1
    keys = ordered(values.float() + 0.0) * (1 << 32) + (low - torch.where(ids < 0, low, ids))
    keys = keys.sort(dim=1, descending=True).values
    ranked_ids = low - (keys & low)
    return (from_key(keys >> 32).double(),
            ranked_ids.masked_fill_(ranked_ids == low, -1))


def _decide(x: torch.Tensor, lse: torch.Tensor, floor: torch.Tensor,
            params: SamplerParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The definition on ranked candidates ``x`` (float64 ``[rows, C]``): ``(kept [rows, C],
    exact [rows], need [rows])`` (module docstring; ``need``: for a top-p row without top-k or
    min-p, a lower bound of the ids its answer takes: those above the floor, plus the mass still
    missing over the floor's probability, which bounds every unseen id's; else 0)."""
    valid = x > float("-inf")
    top = x[:, :1]
    kept = valid.clone()
    narrowed = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    if params.min_p is not None:
        kept &= torch.exp(x - top) >= params.min_p[:, None]
        narrowed |= params.min_p > 0
    if params.top_k is not None:
        k = params.top_k
        kth = x.gather(1, (k - 1).clamp(0, x.shape[1] - 1)[:, None])
        kept &= (x >= kth) | (k[:, None] <= 0)
        narrowed |= k > 0
    outside_r = valid & ~kept
    if params.top_p is not None:
        masked = x.masked_fill(~kept, float("-inf"))
        norm = lse  # (R's own normalizer only where top-k or min-p is given)
        if params.min_p is not None or params.top_k is not None:
            norm = torch.where(narrowed, torch.logsumexp(masked, 1), lse)
        mass = torch.exp(masked - norm[:, None])
        through = torch.cumsum(mass, 1)
        before = through - mass
        kept &= (before < params.top_p[:, None]) | (params.top_p[:, None] >= 1)
    kept[:, 0] = valid[:, 0]  # the largest, always
    above = valid & (x > floor[:, None])
    left_out = torch.where(narrowed[:, None], above & outside_r, above & ~kept).any(1)
    exact = (floor == float("-inf")) | left_out | torch.isnan(top[:, 0])
    if params.top_p is not None:  # top-p alone: the ids above the floor hold top_p, so every id
        # below it has at least that much ranked before it
        reach = torch.where(above, through, 0.0).amax(1) >= params.top_p
        exact |= ~narrowed & (params.top_p < 1) & reach
    need = torch.zeros_like(lse)
    if params.top_p is not None:
        covered = (mass * above).sum(1)  # (a row without top-k or min-p: exp(x - lse))
        at_floor = torch.exp(floor - lse)
        missing = (params.top_p - covered).clamp_(min=0)
        bound = above.sum(1) + missing / at_floor
        need = torch.where(~narrowed & (params.top_p < 1) & (at_floor > 0), bound, need)
    return kept, exact, need


# the candidates a block of rows ranks and decides at once: its float64 and int64 temporaries
# (a dozen of them) stay within a few GiB however many ids a round collects
DECIDE_ELEMENTS = 1 << 25


def _ranked_and_decided(values: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor,
                        floor: torch.Tensor, params: SamplerParams, bounded: torch.Tensor,
                        unfit: torch.Tensor, todo: torch.Tensor, done: list, with_logits: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_ranked` and :func:`_decide` on a round's candidates (``[rows, C]``), in blocks of
    rows of at most ``DECIDE_ELEMENTS`` candidates; a row is exact as :func:`_decide` says or where
    ``bounded`` (every id at or above a bound of its support is a candidate), unless ``unfit``.
    The exact rows' ``(rows of todo, ranked ids, kept lengths, their logits (fp32) or None)`` are
    appended to ``done`` (the logits ``with_logits``); returns ``(exact, need)`` of every row."""
    count = values.shape[0]
    block = max(1, DECIDE_ELEMENTS // max(values.shape[1], 1))
    exact, need = [], []
    for r0 in range(0, count, block):
        rows = slice(r0, min(r0 + block, count))
        x, ranked_ids = _ranked(values[rows], ids[rows])
        index = torch.arange(rows.start, rows.stop, device=values.device)
        kept, block_exact, block_need = _decide(x, lse[rows], floor[rows], params.rows(index))
        block_exact = (block_exact | bounded[rows]) & ~unfit[rows]
        lengths = kept.sum(1)
        done.append((todo[rows][block_exact], ranked_ids[block_exact], lengths[block_exact],
                     x.float()[block_exact] if with_logits else None))
        exact.append(block_exact)
        need.append(block_need)
    return torch.cat(exact), torch.cat(need)


def _active(params: SamplerParams, n: int, device: torch.device) -> torch.Tensor:
    """``[n]`` bool: the tokens with some filter on."""
    on = torch.zeros(n, dtype=torch.bool, device=device)
    if params.top_k is not None:
        on |= params.top_k > 0
    if params.top_p is not None:
        on |= params.top_p < 1
    if params.min_p is not None:
        on |= params.min_p > 0
    return on


def sampler_support(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    params: SamplerParams, *, call: ShardCall, vocab_start: int, vocab: int,
                    group, comm_device: torch.device) -> torch.Tensor:
    """The support of every row of ``hidden`` (``[n, D]``, this shard's ``weight`` rows
    ``[vocab_start, vocab_start + V_local)``, ``vocab`` the global vocabulary; ``group``: the TP
    group, or None for one shard) as padded GLOBAL ids ``[n, K]`` (``-1`` pads; a row of
    ``KEEP_ALL`` keeps every id), the module docstring's algorithm, on the logits of ``call``'s
    transform (the op's own: :func:`tplogp.backends.native_tiles.call_logits_tile`) within its
    transient budget. Every rank of ``group`` calls it with the same rows and parameters and gets
    the same result."""
    return _support(hidden, weight, bias, params, call, vocab_start, vocab, group, comm_device,
                    False)[0]


def sampler_support_with_logits(hidden: torch.Tensor, weight: torch.Tensor,
                                bias: Optional[torch.Tensor], params: SamplerParams, *,
                                call: ShardCall, vocab_start: int, vocab: int, group,
                                comm_device: torch.device
                                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`sampler_support` and the logits of its ids as the passes computed them (fp32
    ``[n, K]``, ``-inf`` on padding; every rank's the same), or None where some row keeps every id
    or a round's candidates were too many to keep theirs (more than ``vocab / LOGITS_FRACTION`` a
    row)."""
    return _support(hidden, weight, bias, params, call, vocab_start, vocab, group, comm_device,
                    True)


# a round keeps its candidates' logits (sampler_support_with_logits) while a row has at most
# vocab / LOGITS_FRACTION of them: a narrow support's logits cost a fraction of its ids' memory
LOGITS_FRACTION = 8


@torch.no_grad()  # (a set of ids: nothing of it is differentiated)
def _support(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
             params: SamplerParams, call: ShardCall, vocab_start: int, vocab: int, group,
             comm_device: torch.device, with_logits: bool
             ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`sampler_support` (and :func:`sampler_support_with_logits`' logits)."""
    n, dev = hidden.shape[0], hidden.device
    workspace_bytes, deterministic = call.workspace_bytes, call.deterministic
    world = 1 if group is None else torch.distributed.get_world_size(group)
    transient = memory_budget.split("native", workspace_bytes, dev).transient
    tile_elements = max(transient // 16, 1 << 12)
    on = _active(params, n, dev)
    todo = on.nonzero().squeeze(1)  # (a host read)
    count = todo.numel()
    # rows with a top-k need k + SLACK candidates at most
    k_max, unbounded, gridded, above = 0, count, 0, 0
    if count:
        p = params.rows(todo)
        k = p.top_k if p.top_k is not None else torch.zeros_like(todo)
        alone = (k <= 0) & (p.min_p <= 0 if p.min_p is not None else True)
        alone &= p.top_p < 1 if p.top_p is not None else False
        # min-p without top-k: the first round collects above the running max (no topk); first.
        # top-p alone: the first round bins on a grid (no topk); last
        by_min_p = (k <= 0) & (p.min_p > 0) if p.min_p is not None else torch.zeros_like(alone)
        todo = todo[(alone.to(torch.int8) * 2 + ~by_min_p).argsort(stable=True)]
        k_max, unbounded, gridded, above = torch.stack([
            k.max(), ((k <= 0) & ~alone).sum(), alone.sum(), by_min_p.sum()]).tolist()
    m = k_max + SLACK
    if unbounded:
        m = max(m, MIN_CANDIDATES)
    # top-p alone on one shard collects in its first round where a tile holds a row chunk; only
    # when every row is top-p alone: the first round's candidates are every row's (a top-k row
    # would take a topk of as many)
    collect_first = world == 1 and count > 0 and gridded == count
    if collect_first:
        m = max(m, GRID_CANDIDATES)
    m = min(m, vocab)
    done: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # rows, ranked ids, lengths
    # per row of todo, from the first round: the max, the log-sum-exp and the bound of the
    # support's logits (-inf: none); the rows that collect come first, with their edges and the
    # most ids any rank holds at or above the bound (the counting pass's)
    top = lse = lo = whole = torch.empty(0, dtype=torch.float64, device=dev)
    last, collecting, first = None, 0, True
    # per row of todo: whether its bins came with the first round (its grid), and those bins
    on_grid = torch.arange(count, device=dev) >= count - gridded
    binned = torch.zeros(world, count, 2 * BINS, dtype=torch.float64, device=dev)
    while count:
        rows_params = params.rows(todo)
        edge = None
        if collecting:
            edge = torch.stack([lo[:collecting], top[:collecting], last[:collecting]], 1)
        rows = hidden.index_select(0, todo)
        g = gridded if first else 0  # (the last rows: on their grid)
        part = shard_candidates(rows[:count - g], weight, bias, m, call, tile_elements,
                                deterministic, edge,
                                torch.log(rows_params.min_p[:above].double())
                                if first and above else None,
                                grid_columns(m) - (2 * m + 3) if g else 0)
        if g:
            grid_p = rows_params.top_p[count - g:]
            width = _grid_width(grid_p, vocab)
            grid_rows = grid_candidates(rows[count - g:], weight, bias, m, width, call,
                                        tile_elements, deterministic,
                                        grid_p if collect_first else None)
            part = torch.cat([part, grid_rows]) if count > g else grid_rows
        shifted = part[:, m:2 * m]
        part[:, m:2 * m] = torch.where(shifted >= 0, shifted + vocab_start, -1)
        if world > 1:
            part = all_gather_flat(part.to(comm_device), group).to(dev)
        ranks = part.view(world, count, part.shape[1])
        values = ranks[:, :, :m].permute(1, 0, 2).reshape(count, world * m)
        ids = ranks[:, :, m:2 * m].permute(1, 0, 2).reshape(count, world * m).long()
        floor = ranks[:, :, 2 * m].max(0).values
        if first:
            row_max, sums = ranks[:, :, 2 * m + 1], ranks[:, :, 2 * m + 2]
            top = row_max.max(0).values
            base = torch.where(top == float("-inf"), 0.0, top)
            lse = base + torch.log((sums * torch.exp(row_max - base)).sum(0))
            lo = _lower_bounds(rows_params, top)
            whole = torch.zeros_like(top)
            if gridded:  # (collected next from their windows on the grid: the same bins)
                g0 = count - gridded
                window_top, binned[:, g0:] = _grid_edges(ranks[:, g0:], m, width, lse[g0:])
                top[g0:], lo[g0:] = window_top, window_top - BINS * width
        # exact too: every id at or above a bound of the support's logits is a candidate; not: a
        # collecting row (the first round's: a min-p's above its max) whose ids pass the round's
        # candidates on some rank
        held = ranks[:, :, 2 * m + 2].max(0).values
        was = torch.arange(count, device=dev) < (above if first else collecting)
        exact, need = _ranked_and_decided(values, ids, lse, floor, rows_params, floor < lo,
                                          was & (held > m), todo, done,
                                          with_logits and values.shape[1] * LOGITS_FRACTION
                                          <= vocab)
        # the next round: the rows after the first collect from their bound, at an edge counted
        # first; a collecting row left (its ids past the candidates, or an edge that did not
        # settle it) collects from its bound, then takes the largest, as the rows without a bound
        if first:
            step = torch.where(lo > float("-inf"), BINS - 1.0, float("nan"))
            size = torch.zeros_like(lo)
        else:
            again = was & (last < BINS - 1)
            step = torch.where(again, BINS - 1.0, float("nan"))
            size = torch.where(again, torch.maximum(whole, held), 0.0)
        left = ~exact
        step, size = step[left], size[left]
        order = torch.isnan(step).to(torch.int8).argsort(stable=True)
        todo, step, size = todo[left][order], step[order], size[order]
        top, lse, lo, whole, on_grid = (t[left][order] for t in (top, lse, lo, whole, on_grid))
        binned = binned[:, left][:, order]
        need = torch.where(exact, 0.0, need).nan_to_num_(nan=vocab, posinf=vocab)
        # (one host read per round: every rank the same)
        # (the collecting rows come first, and among them the grid rows last: todo's order, kept
        # by the stable sorts; so the rows to count are the first `counted`)
        count, need, collecting, counted, size_max = torch.stack([
            left.sum().double(), need.max(), (~torch.isnan(step)).sum().double(),
            (~torch.isnan(step) & ~on_grid).sum().double(),
            size.max() if size.numel() else size.new_zeros(())]).tolist()
        count, collecting, counted = int(count), int(collecting), int(counted)
        if first and collecting:  # once: the edges the bounded rows collect from, counted
            # (the grid rows' bins came with the first round; a counted row's mass is not read)
            bins = binned[:, :collecting]
            if counted:
                more = shard_bins(hidden.index_select(0, todo[:counted]), weight, bias,
                                  bin_scale(lo[:counted], top[:counted]), call, tile_elements,
                                  deterministic)
                if world > 1:
                    more = all_gather_flat(more.to(comm_device), group).to(dev)
                bins[:, :counted, :BINS] = more.view(world, counted, BINS)
            # (a grid row's bins were counted in another window than its collecting round's: a
            # logit within rounding of an edge may fall on the other side)
            step[:collecting], size[:collecting], whole[:collecting] = _binned_sizes(
                bins, params.rows(todo[:collecting]), SLACK * on_grid[:collecting].double())
            size_max = size[:collecting].max().item()
        last, first = step, False
        grown = m
        if count > collecting:  # 4x the candidates, or twice a top-p row's bound over the ranks
            grown = int(min(vocab, max(m * GROWTH, math.ceil(min(2 * need / world, vocab)))))
        # (the most ids a rank counted in a collecting row's bins: a row with more runs again)
        m = int(min(vocab, max(grown, size_max if collecting else 0, 1)))
    widths = [torch.zeros((), dtype=torch.int64, device=dev)] + [lengths.max() for _, _, lengths, _
                                                                 in done if lengths.numel()]
    every = bool((~on).any()) if n else False
    width = max(int(torch.stack(widths).max()), 1 if every else 0)
    out = torch.full((n, width), -1, dtype=torch.int64, device=dev)
    if every:
        out[~on, 0] = KEEP_ALL
    logits = None
    if with_logits and not every and all(values is not None for *_, values in done):
        logits = torch.full((n, width), float("-inf"), dtype=torch.float32, device=dev)
    for rows, ranked_ids, lengths, values in done:
        w = min(width, ranked_ids.shape[1])
        inside = torch.arange(w, device=dev)[None, :] < lengths[:, None]
        out[rows, :w] = torch.where(inside, ranked_ids[:, :w], -1)
        if logits is not None:
            logits[rows, :w] = torch.where(inside, values[:, :w], float("-inf"))
    return out, logits


__all__ = ["sampler_support", "sampler_support_with_logits", "SLACK", "MIN_CANDIDATES", "GROWTH",
           "LOGITS_FRACTION"]
