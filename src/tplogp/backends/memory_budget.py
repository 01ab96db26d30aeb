"""How a call's memory budget splits between transient memory and kept softmax terms, for every
source.

The budget is the most memory the op may hold beyond its inputs, outputs and gradients: the call's
``workspace_bytes``, else ``TPLOGP_WORKSPACE_MB`` (:func:`tplogp.support.settings.workspace_bytes`),
else none (the source's default). :func:`split` cuts it in two for a source on a device:

* the transient part, allocated and freed within a forward or a backward: ``native``'s fp32 tiles,
  the ``triton`` / ``sm90`` backward's d_logits chunk workspace. It gets the budget up to the
  source's transient size (a smaller budget: smaller tiles or chunks);
* the kept part, the rest: the softmax terms ``exp(z - m)`` (with their fp32 row scales) that the
  forward keeps for the backward, which then skips the recompute GEMM of what was kept (the first
  tiles on ``native``, the first vocab columns on ``triton`` / ``sm90``).

A budget means that on every source, and a budget equal to the transient size keeps nothing. Without
a budget (``None`` and the variable unset) a source gets its transient size and keeps what its row
of :data:`SOURCE_BUDGETS` says: ``native`` nothing, ``triton`` / ``sm90`` the whole shard when its
terms and scales fit the transient size, unless the call is ``deterministic``. docs/operator.md
("Memory budget") states the rows as a table.

Why ``triton`` / ``sm90`` keep small calls whole without a budget: such a call's backward runs one
d_logits chunk either way, and with the terms kept it writes d_logits in their place
(``ShardCall.consume_kept``) instead of allocating an ``[N, V]`` workspace, so its peak grows at
most by the scales (the eager paths free them before allocating the gradients,
``ShardCall.scales_apart``) and it skips the recompute GEMM: at small shapes, where that GEMM is a
quarter of the GPU time, the default runs 3 GEMMs. Not when ``deterministic``: whether a call keeps
would depend on its token count, and kept terms give other d_logits bits than a recompute, so a
row's gradient would depend on the batch it came in.

Only the device's type is read (no device work); the variable is read at each call.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..support import settings

_MIB = 1 << 20
# native: fp32 [tokens, vocab] tiles and their temporaries (tplogp.backends.native.plan_chunks)
NATIVE_TILE_BYTES_CUDA = 1024 * _MIB
NATIVE_TILE_BYTES_ELSEWHERE = 64 * _MIB
# triton / sm90: the backward's d_logits chunk workspace, large enough for full-efficiency GEMMs at
# N = 8192 ([8192, 8192] bf16 chunks), small against the 256 MiB extra-memory allowance
DLOGITS_WORKSPACE_BYTES = 128 * _MIB


class SourceBudget(NamedTuple):
    """One source's row of the table (module docstring)."""

    transient_cuda: int  # the transient part's size on a CUDA device
    transient_elsewhere: int  # on any other device (the CPU; Triton's interpreter)
    # without a budget: a shard whose kept terms and scales fit the transient size is kept whole
    keeps_whole: bool


# The defaults of every source, the one place they are decided (docs/operator.md, "Memory budget",
# states them).
SOURCE_BUDGETS: dict[str, SourceBudget] = {
    "native": SourceBudget(NATIVE_TILE_BYTES_CUDA, NATIVE_TILE_BYTES_ELSEWHERE, keeps_whole=False),
    "triton": SourceBudget(DLOGITS_WORKSPACE_BYTES, DLOGITS_WORKSPACE_BYTES, keeps_whole=True),
    "sm90": SourceBudget(DLOGITS_WORKSPACE_BYTES, DLOGITS_WORKSPACE_BYTES, keeps_whole=True),
}


class BudgetSplit(NamedTuple):
    """A budget cut for one source on one device (:func:`split`)."""

    transient: int  # bytes of the transient part (tiles, d_logits workspace)
    # bytes the kept terms and scales may take: the first tiles / columns that fit are kept
    keep: int
    # without a budget: the whole shard is kept when its terms and scales fit this many bytes, else
    keep_whole: int
    # nothing (0: never; ``keep`` is then 0)


def call_budget(workspace_bytes: Optional[int]) -> Optional[int]:
    """The call's budget in bytes, else ``TPLOGP_WORKSPACE_MB``'s, else None (the source's
    default)."""
    if workspace_bytes is not None:
        return workspace_bytes
    return settings.workspace_bytes()


def transient_bytes(source: str, device: torch.device) -> int:
    """The size of ``source``'s transient part on ``device``: all of the default budget, and the
    share of any budget that goes to it before anything is kept."""
    row = SOURCE_BUDGETS[source]
    return row.transient_cuda if device.type == "cuda" else row.transient_elsewhere


def split(source: str, workspace_bytes: Optional[int], device: torch.device,
          deterministic: bool = False) -> BudgetSplit:
    """``workspace_bytes`` (else ``TPLOGP_WORKSPACE_MB``, else the default) cut for ``source`` on
    ``device``: the transient part up to the source's transient size, the rest kept; without a
    budget the table's default (``deterministic`` calls keep nothing then)."""
    transient = transient_bytes(source, device)
    budget = call_budget(workspace_bytes)
    if budget is None:
        whole = transient if SOURCE_BUDGETS[source].keeps_whole and not deterministic else 0
        return BudgetSplit(transient, 0, whole)
    return BudgetSplit(min(budget, transient), max(0, budget - transient), 0)
