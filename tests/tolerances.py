"""Re-export of the project's one tolerance table (:mod:`tplogp.tolerances`) for test modules."""

from tplogp.tolerances import ERROR_SLACK, RUNBOOK_TOLERANCES, assert_no_worse, rel_error  # noqa: F401
