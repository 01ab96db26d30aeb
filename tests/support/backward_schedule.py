"""Record the TP backward's schedule on the native source: when the d_hidden all-reduce is issued, relative to
the d_W updates (``native._accumulate_dw``), for the overlap tests."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch.distributed as dist


@contextlib.contextmanager
def record_schedule() -> Iterator[list]:
    """Yields the list of events, in order: ``("all_reduce", async_op)`` and ``("d_W", None)``."""
    from tplogp.backends import native

    events: list = []
    real_all_reduce, real_dw = dist.all_reduce, native._accumulate_dw

    def all_reduce(t, *args, **kwargs):
        events.append(("all_reduce", kwargs.get("async_op", False)))
        return real_all_reduce(t, *args, **kwargs)

    def accumulate_dw(*args, **kwargs):
        events.append(("d_W", None))
        return real_dw(*args, **kwargs)

    dist.all_reduce, native._accumulate_dw = all_reduce, accumulate_dw
    try:
        yield events
    finally:
        dist.all_reduce, native._accumulate_dw = real_all_reduce, real_dw


def overlap_problem(events: list) -> Optional[str]:
    """None when there was one async all_reduce, issued before the last of several d_W updates; else what was
    seen."""
    names = [e[0] for e in events]
    if names.count("all_reduce") != 1 or events[names.index("all_reduce")][1] is not True:
        return f"expected one async all_reduce, got {events}"
    if not (names.count("d_W") > 1 and names.index("all_reduce") < len(names) - 1 and names[-1] == "d_W"):
        return f"the all_reduce must be issued before the last d_W update: {names}"
    return None
