"""The fixtures every TP test has: ``tp_world_size`` (autouse: fixes the placement at setup), ``tp``, ``tp_pool``.

``tp_world_size`` is the indirect parametrization ``[tpN]`` of a TP test. At setup it decides the :class:`Plan`
(backend, devices, deadline) and skips, before any rank is spawned, when this process cannot run the test.
"""

from __future__ import annotations

from typing import Any

import pytest

from .dispatch import PoolHandle, refuse_parent_only_fixtures
from .placement import Plan, plan_for
from .session import PLAN, STATE
from .values import TPPlaceholder


@pytest.fixture(autouse=True)
def tp_world_size(request: pytest.FixtureRequest) -> int | None:
    """World size of a TP test (its ``[tpN]`` parametrization); None for other tests.

    For TP tests this also fixes the placement (backend, devices, deadline) and skips, before any rank is
    spawned, when this process cannot run it.
    """
    ws = getattr(request, "param", None)
    if ws is None:
        return None
    state = request.config.stash[STATE]
    ctx = state.external.ctx if state.external is not None else None
    plan = plan_for(request.node, int(ws), state.settings, ctx)
    request.node.stash[PLAN] = plan
    if plan.skip_reason:
        pytest.skip(plan.skip_reason)
    if not plan.in_parent:
        refuse_parent_only_fixtures(request.node)
    return int(ws)  # the pool starts at the end of the test's setup (hooks.pytest_runtest_setup)


def plan_of(request: pytest.FixtureRequest) -> Plan | None:
    return request.node.stash.get(PLAN, None)


@pytest.fixture
def tp(request: pytest.FixtureRequest) -> Any:
    """This rank's context in a TP test body: ``rank``, ``world_size``, ``backend``, ``device``, ``group`` and the
    collective helpers ``assert_all``, ``assert_close``, ``agree()``, ``skip_if``, ``new_group``, ``barrier``."""
    plan = plan_of(request)
    if plan is None:
        raise pytest.UsageError(f"{request.node.nodeid}: the tp fixture only works in TP tests")
    return TPPlaceholder(plan.world_size)


@pytest.fixture
def tp_pool(request: pytest.FixtureRequest) -> PoolHandle:
    """Explicit dispatch from a test body that stays in the parent: ``tp_pool.run(fn, *args)`` calls
    ``fn(tp, *args)`` on every rank and returns the list of results (index = rank)."""
    plan = plan_of(request)
    assert plan is not None, "tp_world_size sets the plan of every tp_pool test"
    return PoolHandle(request.node, request.config.stash[STATE], plan)
