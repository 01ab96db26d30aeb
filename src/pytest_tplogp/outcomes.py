"""A test body's exception as a rank's :class:`~pytest_tplogp.protocol.RankOutcome` (rank-side;
imports nothing of the controller): skip, xfail or failure, with a one-line summary, the traceback
and where it happened in the test's file."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from .protocol import RankOutcome


def classify(exc: BaseException, rank: int, tb_skip: int = 1,
             test_file: str | None = None) -> RankOutcome:
    """A rank's :class:`RankOutcome` for an exception from a test body (skip, xfail or failure with
    traceback)."""
    pytest = sys.modules.get("pytest")
    if pytest is not None and isinstance(exc, pytest.skip.Exception):
        return RankOutcome(rank, "skipped", summary=str(getattr(exc, "msg", "") or ""))
    if pytest is not None and isinstance(exc, pytest.xfail.Exception):
        return RankOutcome(rank, "xfailed", summary=str(getattr(exc, "msg", "") or ""))
    tb = exc.__traceback__
    for _ in range(tb_skip):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    if pytest is not None and isinstance(exc, pytest.fail.Exception):
        summary = f"Failed: {getattr(exc, 'msg', '')}"
    else:
        summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    lines = [line.strip() for line in summary.splitlines() if line.strip()]
    # one line for headlines; the traceback has the rest
    summary = lines[0] if lines else type(exc).__name__
    if summary.endswith(":") and len(lines) > 1:
        summary += " " + lines[1]
    longrepr = "".join(traceback.format_exception(type(exc), exc, tb))
    exc_type = f"{type(exc).__module__}:{type(exc).__qualname__}"
    return RankOutcome(rank, "failed", summary=summary, longrepr=longrepr, exc_type=exc_type,
                       crash=_crash_location(tb, test_file))


def _crash_location(tb: Any, test_file: str | None) -> tuple[str, int] | None:
    """Where a failure happened, for one-line reports: the innermost frame in the test's file, else
    the innermost."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    if not frames:
        return None
    in_test = [f for f in frames if test_file
               and os.path.realpath(f.filename) == os.path.realpath(test_file)]
    frame = (in_test or frames)[-1]
    return (frame.filename, frame.lineno or 0)


__all__ = ["classify"]
