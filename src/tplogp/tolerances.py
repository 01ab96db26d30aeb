"""The tolerance table (public path; it lives in :mod:`tplogp.testing.tolerances`)."""

from .testing.tolerances import (
    Tolerance, ErrorSlack, RUNBOOK_TOLERANCES, ERROR_SLACK, rel_error, slack_bound, assert_no_worse,
    assert_no_worse_shared,
)

__all__ = [
    "Tolerance",
    "ErrorSlack",
    "RUNBOOK_TOLERANCES",
    "ERROR_SLACK",
    "rel_error",
    "slack_bound",
    "assert_no_worse",
    "assert_no_worse_shared",
]
