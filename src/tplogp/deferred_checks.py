"""Target checks whose verdict is read later, so that the default checks add no host sync to a call.

``TPLOGP_CHECKS=full`` checks the targets (their range and, with a group, that every rank has the same ones) like
this:

1. At the call, the targets' ``[checksum, lo, hi]`` summary is computed on the device and copied to pinned host
   memory with ``non_blocking=True``; a CUDA event is recorded after the copy. Nothing waits.
2. Without a group: the next call without a group (before any of its own work), or :func:`check_errors`, waits for
   that event (long passed by then: it sits before the previous call's forward GEMM on the stream), reads the three
   integers and raises :class:`~tplogp.validation.LinearLogpInputError` if a target was outside the vocabulary.
3. With a group: the next call with the same group puts the three integers into the record that its group check
   exchanges over a CPU group (:func:`tplogp.comm.host_group`; :class:`~tplogp.validation.GroupCheck`), so every
   rank sees every rank's summary of the earlier call and raises the same error (targets that differ between
   ranks, or outside the vocabulary) before any collective of its own; :func:`check_errors` with the group does
   the same exchange on its own (every rank of the group must call it).

The pending verdict is dropped either way, so an error is raised once. Meanwhile the offending call's logp is NaN
for the tokens without exactly one owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .comm import all_gather_flat, collective_device, group_name, host_group
from .validation import LinearLogpInputError, TargetSummary, target_range_problem, target_summary_tensor

NO_GROUP_NOTE = (" [found by the check of an earlier linear_logp call without a TP group, whose logp is NaN for these "
                 "tokens; TPLOGP_CHECKS=sync raises at the call itself]")
GROUP_NOTE = (" [found by the check of the previous linear_logp call with this TP group, whose logp is NaN for the "
              "tokens without exactly one owner; TPLOGP_CHECKS=sync raises at the call itself]")


@dataclass
class PendingTargetCheck:
    summary: torch.Tensor  # [3] int64 on the CPU (pinned when copied from a GPU)
    ready: Optional[torch.cuda.Event]  # recorded after the copy; None when the summary was computed on the CPU
    vocab_size: int
    ignore_index: Optional[int]

    def read_summary(self) -> TargetSummary:
        """The three integers (waits only if the device has not reached the copy yet, normally long done)."""
        if self.ready is not None and not self.ready.query():
            self.ready.synchronize()
        return TargetSummary(*self.summary.tolist())

    def range_problem(self, summary: TargetSummary) -> Optional[str]:
        return target_range_problem(summary, self.vocab_size, self.ignore_index)


_pending: Optional[PendingTargetCheck] = None  # the last call without a group
_pending_by_group: dict[str, PendingTargetCheck] = {}  # the last call with each group (by group name)


def _start(target_ids: torch.Tensor, vocab_size: int, ignore_index: Optional[int],
           with_checksum: bool) -> PendingTargetCheck:
    summary = target_summary_tensor(target_ids, ignore_index, with_checksum=with_checksum)
    ready = None
    if summary.device.type == "cuda":
        summary = summary.to("cpu", non_blocking=True)  # pinned (caching host allocator), ordered on the stream
        ready = torch.cuda.Event()
        ready.record()
    return PendingTargetCheck(summary, ready, vocab_size, ignore_index)


def defer_target_range_check(target_ids: torch.Tensor, vocab_size: int, ignore_index: Optional[int]) -> None:
    """Start the range check of ``target_ids`` against ``[0, vocab_size)`` (a call without a group)."""
    global _pending
    if target_ids.numel() == 0:
        return
    _pending = _start(target_ids, vocab_size, ignore_index, with_checksum=False)


def defer_group_target_check(group, target_ids: torch.Tensor, vocab_size: int, ignore_index: Optional[int]) -> None:
    """Start the checks of a call with ``group``: its targets' checksum and range, read by the next call."""
    _pending_by_group[group_name(group)] = _start(target_ids, vocab_size, ignore_index, with_checksum=True)


def take_group_pending(group) -> Optional[PendingTargetCheck]:
    """The pending check of the previous call with ``group`` (removed: it is judged once), or None."""
    return _pending_by_group.pop(group_name(group), None)


def raise_pending_errors() -> None:
    """Raise the verdict of the last deferred check without a group if it failed."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return
    problem = pending.range_problem(pending.read_summary())
    if problem is not None:
        raise LinearLogpInputError(problem + NO_GROUP_NOTE)


def _raise_pending_group_errors(group) -> None:
    """:func:`check_errors` with a group: every rank's pending summary in one exchange over the CPU group."""
    comm_dev = collective_device(group, torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    host = host_group(group, comm_dev)
    pending = take_group_pending(group)
    summary = pending.read_summary() if pending is not None else None
    record = [0, 0, 0, -1, 0] if summary is None else [1, *summary, pending.vocab_size]
    world = dist.get_world_size(group)
    on = torch.device("cpu") if host is not None else comm_dev
    rows = all_gather_flat(torch.tensor(record, dtype=torch.long, device=on), host if host is not None else group)
    rows = rows.view(world, 5).cpu().tolist()
    if not all(r[0] for r in rows):
        return
    checksums = [r[1] for r in rows]
    if len(set(checksums)) > 1:
        listing = ", ".join(f"rank {i}: #{c:x}" for i, c in enumerate(checksums))
        raise LinearLogpInputError("target_ids (they must be replicated: the same global ids on every rank) must be "
                                   f"the same on every TP rank, got {listing}{GROUP_NOTE}")
    problem = target_range_problem(TargetSummary(*rows[0][1:4]), rows[0][4], pending.ignore_index)
    if problem is not None:
        raise LinearLogpInputError(problem + GROUP_NOTE)


def check_errors(tp_group=None) -> None:
    """Raise now any error found by a deferred check (``TPLOGP_CHECKS=full``).

    Without ``tp_group``: the last call without a group. Call it where a step ends (after the optimizer step, say)
    to surface a bad batch before the next one; it waits only until the device has reached that check (the start of
    the call's forward), not for later queued work. With ``tp_group``: the last call with that group, the same error
    on every rank; a collective (every rank of the group calls it), over the group's CPU companion."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        raise_pending_errors()
    else:
        _raise_pending_group_errors(tp_group)
