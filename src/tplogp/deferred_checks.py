"""Former home of the deferred target checks, now :mod:`tplogp.checks`; these names stay importable from here."""

from .checks import (  # noqa: F401
    GROUP_NOTE,
    NO_GROUP_NOTE,
    PendingTargetCheck,
    check_errors,
    defer_group_target_check,
    defer_target_range_check,
    raise_pending_errors,
    take_group_pending,
)
