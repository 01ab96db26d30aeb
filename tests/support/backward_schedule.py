"""Record the TP backward's schedule on the native source: when the d_hidden all-reduce (or a sequence-parallel
call's reduce-scatter) is issued, relative to the d_W updates (``native_backward._accumulate_dw``), for the overlap tests."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch.distributed as dist


@contextlib.contextmanager
def record_schedule() -> Iterator[list]:
    """Yields the list of events, in order: ``("all_reduce", async_op)``, ``("reduce_scatter", async_op)`` and
    ``("d_W", None)``."""
    from tplogp.support import comm
    from tplogp.backends import native_backward

    events: list = []
    real_all_reduce, real_dw, real_scatter = dist.all_reduce, native_backward._accumulate_dw, comm.reduce_scatter_rows

    def all_reduce(t, *args, **kwargs):
        events.append(("all_reduce", kwargs.get("async_op", False)))
        return real_all_reduce(t, *args, **kwargs)

    def accumulate_dw(*args, **kwargs):
        events.append(("d_W", None))
        return real_dw(*args, **kwargs)

    def reduce_scatter(out, inp, group, async_op=False):
        events.append(("reduce_scatter", async_op))
        return real_scatter(out, inp, group, async_op)

    dist.all_reduce, native_backward._accumulate_dw, comm.reduce_scatter_rows = all_reduce, accumulate_dw, reduce_scatter
    try:
        yield events
    finally:
        dist.all_reduce, native_backward._accumulate_dw, comm.reduce_scatter_rows = real_all_reduce, real_dw, real_scatter


def overlap_problem(events: list, collective: str = "all_reduce") -> Optional[str]:
    """None when there was one async ``collective`` (and no other d_hidden collective), issued before the last of
    several d_W updates; else what was seen."""
    names = [e[0] for e in events]
    other = {"all_reduce", "reduce_scatter"} - {collective}
    if names.count(collective) != 1 or events[names.index(collective)][1] is not True or other & set(names):
        return f"expected one async {collective}, got {events}"
    if not (names.count("d_W") > 1 and names.index(collective) < len(names) - 1 and names[-1] == "d_W"):
        return f"the {collective} must be issued before the last d_W update: {names}"
    return None
