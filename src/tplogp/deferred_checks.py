"""Target checks whose verdict is read later, so that the default checks add no host sync to a call.

Without a TP group, ``TPLOGP_CHECKS=full`` checks the targets' range like this:

1. At the call, the targets' ``[checksum, lo, hi]`` summary is computed on the device and copied to pinned host
   memory with ``non_blocking=True``; a CUDA event is recorded after the copy. Nothing waits.
2. The next call without a group (before any of its own work), or :func:`check_errors`, waits for that event (long
   passed by then: it sits before the previous call's forward GEMM on the stream), reads the three integers and
   raises :class:`~tplogp.validation.LinearLogpInputError` if a target was outside the vocabulary. The pending
   verdict is dropped either way, so an error is raised once.

Meanwhile the offending call's logp is NaN for the uncovered tokens (no shard owns them). Calls with a group read
their checks at the call (see :mod:`tplogp.validation`) and never raise a deferred verdict: a rank-local verdict
raised before a collective could leave the other ranks waiting in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .validation import LinearLogpInputError, TargetSummary, target_range_problem, target_summary_tensor


@dataclass
class _PendingRangeCheck:
    summary: torch.Tensor  # [3] int64 on the CPU (pinned when copied from a GPU)
    ready: Optional[torch.cuda.Event]  # recorded after the copy; None when the summary was computed on the CPU
    vocab_size: int
    ignore_index: Optional[int]


_pending: Optional[_PendingRangeCheck] = None


def defer_target_range_check(target_ids: torch.Tensor, vocab_size: int, ignore_index: Optional[int]) -> None:
    """Start the range check of ``target_ids`` against ``[0, vocab_size)`` without waiting for it."""
    global _pending
    if target_ids.numel() == 0:
        return
    summary = target_summary_tensor(target_ids, ignore_index, with_checksum=False)
    ready = None
    if summary.device.type == "cuda":
        summary = summary.to("cpu", non_blocking=True)  # pinned (caching host allocator), ordered on the stream
        ready = torch.cuda.Event()
        ready.record()
    _pending = _PendingRangeCheck(summary, ready, vocab_size, ignore_index)


def raise_pending_errors() -> None:
    """Raise the verdict of the last deferred check if it failed (waits for it if the device has not got there)."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return
    if pending.ready is not None and not pending.ready.query():  # normally long done: no wait, no sync call
        pending.ready.synchronize()
    problem = target_range_problem(TargetSummary(*pending.summary.tolist()), pending.vocab_size,
                                   pending.ignore_index)
    if problem is not None:
        raise LinearLogpInputError(
            f"{problem} [found by the check of an earlier linear_logp call without a TP group, whose logp is NaN "
            f"for these tokens; TPLOGP_CHECKS=sync raises at the call itself]")


def check_errors() -> None:
    """Raise now any error found by a deferred check (``TPLOGP_CHECKS=full`` calls without a TP group).

    Call it where a step ends (after the optimizer step, say) to surface a bad batch before the next one. Waits
    only until the device has reached that check (the start of the call's forward), not for later queued work.
    """
    raise_pending_errors()
