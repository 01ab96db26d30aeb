"""Collectives a test body left unmatched: issued on some ranks of a group, never waited for.

Such a collective (``dist.all_reduce(t, async_op=True)`` on one rank only) does not fail the body
that issued it: it waits in the process group's queue and pairs with the next test's first
collective on that group, which then fails, hangs or passes with wrong values. So it is caught after
the test that left it:

1. On each rank, while a body runs, torch's work registry is switched on
   (``torch._C._distributed_c10d._set_allow_inflight_collective_as_graph_input``, what
   ``allow_inflight_collective_as_graph_input_ctx`` sets): every collective's ``Work`` is registered
   until it is waited for (a synchronous collective is waited for as it returns; send and recv are
   not registered). The growth of the registry over the body is the count of collectives the rank
   issued and never waited for.
2. After the body, each rank reads the sequence number of every process group it belongs to
   (``ProcessGroup._get_sequence_number_for_group``: one per collective issued on the group, on gloo
   also one per send or recv).
3. The controller (:func:`unmatched`) compares them: a group whose members' numbers disagree, where
   the members ahead left more collectives unwaited than another member, holds an unmatched
   collective. Either fact alone is no problem: collectives issued on every rank and never waited
   for complete together; sends and receives between some ranks only move those ranks' numbers on
   gloo.

The test that left it fails, naming the rank, the group and the numbers; the pool is recycled, so
the next test starts on a clean process group. The registry and the sequence numbers are private
torch APIs (torch 2.13); where one is missing, the check is skipped. The registry keeps a
never-waited ``Work`` (and its tensors) alive until the pool ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .protocol import format_ranks


@dataclass
class CollectiveCounts:
    """One rank's view after a body: ``groups`` maps a group's name to (its ranks, its sequence
    number); ``unwaited`` counts the collectives the body issued and never waited for (None: not
    measurable here)."""

    groups: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    unwaited: int | None = None


def _c10d_module() -> Any:
    import torch

    return getattr(torch._C, "_distributed_c10d", None)


@contextlib.contextmanager
def count_unwaited() -> Iterator[list[int | None]]:
    """While the block runs, register every collective's work; yields a one-element list that holds,
    after the block, how many of the collectives it issued were never waited for (None where torch
    has no work registry)."""
    c10d = _c10d_module()
    size = getattr(c10d, "_get_work_registry_size", None)
    get_flag = getattr(c10d, "_allow_inflight_collective_as_graph_input", None)
    set_flag = getattr(c10d, "_set_allow_inflight_collective_as_graph_input", None)
    result: list[int | None] = [None]
    if size is None or get_flag is None or set_flag is None:
        yield result
        return
    previous = get_flag()
    before = size()
    set_flag(True)
    try:
        yield result
    finally:
        set_flag(previous)
        result[0] = max(0, size() - before)


def group_counts() -> dict[str, tuple[tuple[int, ...], int]]:
    """Every live process group of this rank: name -> (global ranks, sequence number). Empty where
    torch does not expose them."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return {}
    pg_map = getattr(getattr(c10d, "_world", None), "pg_map", None) or {}
    counts: dict[str, tuple[tuple[int, ...], int]] = {}
    for pg in list(pg_map):
        try:
            ranks = tuple(dist.get_process_group_ranks(pg))
            counts[str(pg.group_name)] = (ranks, int(pg._get_sequence_number_for_group()))
        except Exception:  # noqa: BLE001 - no sequence numbers on this backend: group not checked
            continue
    return counts


def snapshot(unwaited: int | None) -> CollectiveCounts:
    return CollectiveCounts(groups=group_counts(), unwaited=unwaited)


def _group_label(name: str, ranks: tuple[int, ...], world_size: int) -> str:
    if len(ranks) == world_size and name == "0":
        return "the default group"
    return f"group {name} ({format_ranks(list(ranks))})"


def unmatched(counts: Mapping[int, CollectiveCounts], world_size: int) -> str:
    """What the ranks' counts say was left unmatched (a sentence per group), or "" when nothing was.

    A group is flagged when its members' sequence numbers disagree and the members ahead left more
    collectives unwaited than some other member: the surplus is the unmatched part. Members that all
    left the same number unwaited issued them together (they complete); disagreeing numbers alone
    are sends and receives.
    """
    per_group: dict[str, dict[int, int]] = {}
    ranks_of: dict[str, tuple[int, ...]] = {}
    for r, c in counts.items():
        for name, (ranks, seq) in c.groups.items():
            per_group.setdefault(name, {})[r] = seq
            ranks_of[name] = ranks
    problems: list[str] = []
    for name, seqs in sorted(per_group.items()):
        unwaited = {r: counts[r].unwaited for r in seqs}
        if len(set(seqs.values())) < 2 or any(u is None for u in unwaited.values()):
            continue
        top = max(seqs.values())
        ahead = sorted(r for r, s in seqs.items() if s == top)
        fewest = min(unwaited.values())  # type: ignore[type-var]
        leavers = [r for r in ahead if unwaited[r] > fewest]  # type: ignore[operator]
        if not leavers:
            continue
        surplus = max(unwaited[r] for r in leavers) - fewest  # type: ignore[operator]
        behind = ", ".join(f"{format_ranks([r])}: {s}" for r, s in sorted(seqs.items()) if s != top)
        group = _group_label(name, ranks_of[name], world_size)
        problems.append(
            f"{format_ranks(leavers)} left {surplus} collective(s) never waited for and unmatched "
            f"on {group} (sequence numbers {format_ranks(ahead)}: {top}; {behind}): an "
            f"async_op=True collective issued on some ranks only would pair with the next test's")
    return "; ".join(problems)
