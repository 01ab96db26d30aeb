"""What the target checks read of ``target_ids``: ``[checksum, lo, hi]`` formed on the device, so
the host reads it in one sync (or, for a deferred verdict, later behind an event), and the range
verdict drawn from it.

The checksum fingerprints the ids so that ranks given different targets are told apart;
``lo`` / ``hi`` are the smallest and largest ids that are not ``ignore_index``, found with neutral
fill values instead of boolean indexing (which would sync on its own).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

COVERAGE_MESSAGE = "target_ids must be covered by exactly one TP vocab shard"


class TargetSummary(NamedTuple):
    """What the checks need to know about the targets, read from the device in ONE host sync."""

    checksum: int  # fingerprint, to detect ranks given different (non-replicated) ids
    lo: int  # smallest non-ignored id
    hi: int  # largest non-ignored id (lo > hi when every position is ignored)


def target_summary_tensor(target_ids: torch.Tensor, ignore_index: Optional[int],
                          with_checksum: bool) -> torch.Tensor:
    """``[checksum, lo, hi]`` (int64, on the targets' device) without reading anything on the host.

    ``lo``/``hi`` are the smallest/largest non-ignored ids (``lo > hi`` when every position is
    ignored); the checksum (0 without ``with_checksum``) fingerprints the ids to detect ranks given
    different targets.
    """
    t = target_ids.reshape(-1).long()
    if t.numel() == 0:
        return torch.tensor([0, 0, -1], dtype=torch.long, device=t.device)
    checksum = torch.zeros((), dtype=torch.long, device=t.device)
    if with_checksum:
        weights = torch.arange(1, t.numel() + 1, device=t.device, dtype=torch.long) % 1_000_003
        checksum = ((t % 1_000_003) * weights).sum() % (1 << 61)
    if ignore_index is None:
        lo, hi = torch.aminmax(t)
    # ignored ids replaced by neutral values: no boolean indexing (which would sync on its own)
    else:
        keep = t != ignore_index
        lo = torch.where(keep, t, torch.iinfo(torch.long).max).amin()
        hi = torch.where(keep, t, -1).amax()
    return torch.stack([checksum, lo, hi])


def target_range_tensor(target_ids: torch.Tensor, ignore_index: Optional[int]) -> torch.Tensor:
    """``[lo, hi]`` (int64, on the targets' device) of the non-ignored ids of a non-empty
    ``target_ids``: the range check's part of :func:`target_summary_tensor` in the fewest ops (it
    runs at every call without a group)."""
    t = target_ids if target_ids.dim() == 1 else target_ids.reshape(-1)
    t = t if t.dtype == torch.long else t.long()
    if ignore_index is None:
        if t.device.type == "cpu":
            return torch.stack(torch.aminmax(t))
        # one kernel writes what the host copy takes
        lo_hi = torch.empty(2, dtype=torch.long, device=t.device)
        torch.aminmax(t, out=(lo_hi[0], lo_hi[1]))
        return lo_hi
    keep = t != ignore_index
    return torch.stack((torch.where(keep, t, torch.iinfo(torch.long).max).amin(),
                        torch.where(keep, t, -1).amax()))


def summarize_targets(target_ids: torch.Tensor, ignore_index: Optional[int],
                      with_checksum: bool) -> TargetSummary:
    """:func:`target_summary_tensor` read on the host (one host sync)."""
    return TargetSummary(*target_summary_tensor(target_ids, ignore_index, with_checksum).tolist())


def target_range_problem(summary: TargetSummary, vocab_size: int,
                         ignore_index: Optional[int]) -> Optional[str]:
    """Targets outside ``[0, vocab_size)``: no shard owns them."""
    if summary.hi < summary.lo:
        return None  # no non-ignored target
    if summary.lo < 0 or summary.hi >= vocab_size:
        bad = summary.lo if summary.lo < 0 else summary.hi
        return (f"{COVERAGE_MESSAGE}: target id {bad} is outside the vocabulary [0, {vocab_size})"
                + ("" if ignore_index is None else f" (ignore_index={ignore_index})"))
    return None
