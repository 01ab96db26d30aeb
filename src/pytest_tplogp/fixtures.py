"""The fixtures every TP test has: ``tp_world_size`` (autouse: fixes the placement at setup),
``tp``, ``tp_pool``, ``mesh``.

``tp_world_size`` is the indirect parametrization ``[tpN]`` of a TP test (``[tpN-dp2xtp2]`` with
``mesh=``: the parameter is then the :class:`~pytest_tplogp.mesh.MeshShape`, kept in the item's
stash for ``mesh`` and ``vocab_shards``). At setup it decides the :class:`Plan` (backend, devices,
deadline) and skips, before any rank is spawned, when this process cannot run the test.
"""

from __future__ import annotations

from typing import Any

import pytest

from .dispatch import PoolHandle, refuse_parent_only_fixtures
from .mesh import MeshShape
from .placement import Plan, plan_for
from .session import PLAN, SHARING_PROPERTY, STATE
from .values import TPPlaceholder

#: The mesh shape a test's ``mesh=`` parametrization gave it (absent: the default 1-D mesh).
MESH_SHAPE = pytest.StashKey[MeshShape]()


@pytest.fixture(autouse=True)
def tp_world_size(request: pytest.FixtureRequest) -> int | None:
    """World size of a TP test (its ``[tpN]`` parametrization); None for other tests.

    For TP tests this also fixes the placement (backend, devices, deadline) and skips, before any
    rank is spawned, when this process cannot run it.
    """
    ws = getattr(request, "param", None)
    if ws is None:
        return None
    if isinstance(ws, MeshShape):
        request.node.stash[MESH_SHAPE] = ws
        ws = ws.world_size
    state = request.config.stash[STATE]
    ctx = state.external.ctx if state.external is not None else None
    plan = plan_for(request.node, int(ws), state.settings, ctx)
    request.node.stash[PLAN] = plan
    if plan.skip_reason:
        pytest.skip(plan.skip_reason)
    if plan.sharing is not None:  # the test's report says where its ranks ran, and why not on NCCL
        request.node.user_properties.append((SHARING_PROPERTY, plan.sharing))
        request.node.add_report_section("setup", "tplogp placement", plan.sharing)
    if not plan.in_parent:
        refuse_parent_only_fixtures(request.node)
    return int(ws)  # the pool starts at the end of the test's setup (hooks.pytest_runtest_setup)


def plan_of(request: pytest.FixtureRequest) -> Plan | None:
    return request.node.stash.get(PLAN, None)


@pytest.fixture
def tp(request: pytest.FixtureRequest) -> Any:
    """This rank's context in a TP test body: ``rank``, ``world_size``, ``backend``, ``device``,
    ``group`` and the collective helpers ``assert_all``, ``assert_close`` (DTensors too),
    ``agree()``, ``skip_if``, ``new_group``, ``barrier``, ``device_mesh``, ``distribute_randn``."""
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


def mesh_shape_of(request: pytest.FixtureRequest) -> MeshShape | None:
    """The mesh shape of a TP test: its ``mesh=`` parameter, else ``{"tp": world_size}``; None for
    other tests."""
    plan = plan_of(request)
    if plan is None:
        return None
    return request.node.stash.get(MESH_SHAPE, None) or MeshShape.default(plan.world_size)


@pytest.fixture
def mesh(request: pytest.FixtureRequest) -> MeshShape:
    """The test's ``torch.distributed.device_mesh.DeviceMesh`` on the ranks: the marker's
    ``mesh={"dp": 2, "tp": 2}`` (dim names and sizes in that order, row-major over the ranks, as
    ``init_device_mesh`` builds it) or the 1-D ``{"tp": world_size}``; on the pool's device type.
    Cached per pool and shape. In the parent (``tp_pool`` tests) it is the
    :class:`~pytest_tplogp.mesh.MeshShape`, which becomes the mesh when passed to
    ``tp_pool.run``."""
    shape = mesh_shape_of(request)
    if shape is None:
        raise pytest.UsageError(f"{request.node.nodeid}: the mesh fixture only works in TP tests "
                                f"(@pytest.mark.tp(mesh={{...}}))")
    return shape
