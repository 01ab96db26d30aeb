"""Picklable fixture values shared by the parent and the ranks.

Binding protocol: a fixture value that has a ``__tp_bind__(self, tp)`` method is computed in the
parent (cheap, picklable, rank-agnostic), sent to every rank, and replaced there by
``value.__tp_bind__(tp)``. This is how ``tp``, ``vocab_shards`` (``lmhead_values``) and downstream
rank-side fixtures (via :class:`RankValue`) reach the test body. The module imports neither torch
nor pytest at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

def bind(value: Any, tp: Any) -> Any:
    """Apply the binding protocol to one fixture value."""
    binder = getattr(type(value), "__tp_bind__", None)
    return value if binder is None else binder(value, tp)


@dataclass(frozen=True)
class RankValue:
    """A fixture value built on each rank: ``fn(tp, *args)``. ``fn`` must be importable
    (module-level)."""

    fn: Callable[..., Any]
    args: tuple = ()

    def __tp_bind__(self, tp: Any) -> Any:
        return self.fn(tp, *self.args)


@dataclass(frozen=True)
class PerRankMonkeyPatch:
    """What a TP test's ``monkeypatch`` is on the ranks: a fresh ``pytest.MonkeyPatch`` per rank,
    undone after the body (:func:`undo_per_rank`), before the pool's fresh-state check."""

    def __tp_bind__(self, tp: Any) -> Any:
        import pytest

        return pytest.MonkeyPatch()


def undo_per_rank(kwargs: dict[str, Any]) -> None:
    """Undo every per-rank ``monkeypatch`` among a body's bound fixture values (rank side, after the
    body)."""
    import sys

    pytest = sys.modules.get("pytest")
    if pytest is None:
        return
    for value in kwargs.values():
        if isinstance(value, pytest.MonkeyPatch):
            value.undo()


@dataclass(frozen=True)
class TPPlaceholder:
    """What the ``tp`` fixture is in the parent; bound to the rank's
    :class:`~pytest_tplogp.context.RankContext`."""

    world_size: int

    def __tp_bind__(self, tp: Any) -> Any:
        return tp


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a DTensor (False without importing torch when ``torch.distributed.tensor``
    is not loaded)."""
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def full(x: Any) -> Any:
    """The full tensor of a DTensor (collective: every rank of its mesh must call this), anything
    else as it is."""
    return x.full_tensor() if is_dtensor(x) else x
