"""Former home of the input checks, now :mod:`tplogp.checks`; these names stay importable from here."""

from .checks import (  # noqa: F401
    COVERAGE_MESSAGE,
    SUPPORTED_DTYPES,
    GroupCheck,
    LinearLogpInputError,
    TargetSummary,
    checks_mode,
    is_int,
    layout_problem_single,
    local_problem,
    summarize_targets,
    target_range_problem,
    target_summary_tensor,
)
