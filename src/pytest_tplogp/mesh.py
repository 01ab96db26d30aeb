"""Device meshes and DTensors in TP tests: the ``mesh=`` marker argument, the mesh built on the
ranks, DTensor helpers.

Shape. ``@pytest.mark.tp(world_size=4, mesh={"dp": 2, "tp": 2})`` asks for a mesh of those dim names
and sizes, in that order; a list of dicts parametrizes (ids ``tp4-dp2xtp2``). The sizes must
multiply to the world size (a usage error at collection naming both). Without ``mesh=`` the ``mesh``
fixture is the 1-D mesh ``{"tp": world_size}``. A :class:`MeshShape` is what the fixture is in the
parent: picklable, and bound on each rank to the ``DeviceMesh``.

Building (rank side, :func:`build_mesh`). The ranks are laid out row-major,
``torch.arange(W).view(sizes)``, as ``init_device_mesh`` does. For each dim ``d`` in order, the
ranks that differ only in their coordinate on ``d`` form one group; every rank creates every such
group, in the same order, through ``RankContext.new_group`` (cached for the life of the pool:
creating groups is the expensive part). A dim that spans the whole world uses the default group, as
``init_device_mesh`` does. The mesh is assembled with ``DeviceMesh.from_group`` from this rank's
group on each dim and cached per shape by the rank context, so a later test asking for the same
shape gets the same ``DeviceMesh`` for the price of a dict lookup. Its groups (and any a body adds
by flattening it) belong to the pool: the fresh-state check does not count them as left behind.

DTensors (:func:`compare_close`, :func:`distribute_randn`). A DTensor on either side of
``tp.assert_close`` is compared as its full tensor; on a mismatch each rank also compares its own
local shard with the same region of the other side (that side redistributed from replicated to the
DTensor's placements, without communication), so the error names the mesh coordinates whose shards
differ. :func:`distribute_randn` draws a global tensor from a generator of its own seed (every rank
draws the same numbers; the test's RNG is untouched) and keeps this rank's shard.

Importing this module imports neither torch nor pytest (the parent parses markers with it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .values import is_dtensor


class MeshShapeError(ValueError):
    """A ``mesh=`` value that is not a mesh shape, or whose sizes do not multiply to the world
    size."""


class MeshSupportError(RuntimeError):
    """The installed torch lacks a DeviceMesh / DTensor API that the mesh fixture or the DTensor
    helpers use."""


@dataclass(frozen=True)
class MeshShape:
    """Dim names and sizes of a device mesh, in order (outermost first, row-major over the
    ranks)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def parse(cls, value: Any, where: str = "mesh") -> MeshShape:
        """A shape from ``{"dp": 2, "tp": 2}`` (a dict keeps its order), or from a MeshShape."""
        if isinstance(value, MeshShape):
            return value
        if not isinstance(value, Mapping) or not value:
            raise MeshShapeError(f"{where}: a mesh is a non-empty dict of dim name -> size, like "
                                 f"{{'dp': 2, 'tp': 2}}; got {value!r}")
        names, sizes = tuple(value.keys()), tuple(value.values())
        bad_names = [n for n in names if not isinstance(n, str) or not n.isidentifier()]
        bad_sizes = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1]
        if bad_names or bad_sizes:
            raise MeshShapeError(f"{where}: mesh dim names must be identifiers and sizes ints >= "
                                 f"1; got {value!r}")
        return cls(names, sizes)

    @classmethod
    def default(cls, world_size: int) -> MeshShape:
        """The mesh of a test without ``mesh=``: one dim ``tp`` over the whole world."""
        return cls(("tp",), (int(world_size),))

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def id(self) -> str:
        """The parametrization id: ``dp2xtp2``."""
        return "x".join(f"{n}{s}" for n, s in zip(self.names, self.sizes))

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes))

    def describe(self) -> str:
        product = " x ".join(str(s) for s in self.sizes)
        return f"mesh {self.as_dict()} ({product} = {self.world_size} ranks)"

    def check_world_size(self, world_size: int, where: str = "mesh") -> None:
        if self.world_size != world_size:
            raise MeshShapeError(f"{where}: {self.describe()} does not match world size "
                                 f"{world_size}; the mesh sizes must multiply to the world size")

    def __tp_bind__(self, tp: Any) -> Any:
        return tp.device_mesh(self)

    def __str__(self) -> str:
        return self.id


def parse_marker_meshes(value: Any, world_sizes: Sequence[int] | None, where: str) -> list[
    MeshShape]:
    """The meshes of a ``tp`` marker's ``mesh=`` (a dict, or a list of dicts that parametrizes).

    ``world_sizes``: the marker's explicit ``world_size=`` values (None when absent: each mesh's
    product is its world size). With them, every mesh must multiply to one of them and every one of
    them must have a mesh.
    """
    raw = list(value) if isinstance(value, (list, tuple)) else [value]
    if not raw:
        raise MeshShapeError(f"{where}: @pytest.mark.tp(mesh=[]) lists no mesh")
    shapes = [MeshShape.parse(v, f"{where}: @pytest.mark.tp(mesh=...)") for v in raw]
    if len(set(shapes)) != len(shapes):
        raise MeshShapeError(f"{where}: @pytest.mark.tp(mesh=...) lists a mesh twice: {value!r}")
    if world_sizes is not None:
        for shape in shapes:
            if shape.world_size not in world_sizes:
                sizes = world_sizes[0] if len(world_sizes) == 1 else list(world_sizes)
                raise MeshShapeError(f"{where}: @pytest.mark.tp(world_size={sizes!r}, mesh=...): "
                                     f"{shape.describe()} does not match the world size; the mesh "
                                     "sizes must multiply to it")
        unmatched = [n for n in world_sizes if n not in {s.world_size for s in shapes}]
        if unmatched:
            raise MeshShapeError(f"{where}: @pytest.mark.tp(world_size={list(world_sizes)!r}, "
                                 f"mesh=...): no mesh has {unmatched[0]} ranks; give one mesh per "
                                 "world size (or leave world_size out)")
    return shapes


# ------------------------------------------------------------------------------------------------
# rank side
def dim_groups(shape: MeshShape) -> list[list[list[int]]]:
    """For each dim, its groups of ranks (row-major layout), in the order every rank creates
    them."""
    import torch

    ranks = torch.arange(shape.world_size).view(shape.sizes)
    return [ranks.movedim(d, -1).reshape(-1, size).tolist() for d, size in enumerate(shape.sizes)]


def build_mesh(tp: Any, shape: MeshShape) -> Any:
    """The ``DeviceMesh`` of ``shape`` over ``tp``'s world, from groups cached by ``tp.new_group``
    (collective)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    shape.check_world_size(tp.world_size)
    device_type = tp.device.type
    mine: list[Any] = []
    for d, groups in enumerate(dim_groups(shape)):
        if shape.sizes[d] == tp.world_size:
            mine.append(dist.group.WORLD)
            continue
        for ranks in groups:
            group = tp.new_group(ranks)
            if tp.rank in ranks:
                mine.append(group)
    if len(shape.sizes) == 1:
        return DeviceMesh.from_group(mine[0], device_type, mesh_dim_names=shape.names)
    layout = torch.arange(shape.world_size).view(shape.sizes)
    try:
        return DeviceMesh.from_group(mine, device_type, mesh=layout, mesh_dim_names=shape.names)
    except Exception as exc:
        raise MeshSupportError(
            f"DeviceMesh.from_group could not assemble {shape.describe()} from one process group "
            f"per dim (torch {torch.__version__}): {type(exc).__name__}: {exc}. The mesh fixture "
            "needs from_group to take a list of groups with mesh= and mesh_dim_names=, as torch "
            "2.13 does") from exc


def mesh_group_ids(mesh: Any) -> set[int]:
    """Identities of the process groups a cached mesh holds: its dims' and those of meshes flattened
    from it."""
    ids = {id(g) for g in mesh.get_all_groups()}
    # where torch 2.13 keeps flattened dims' groups (private)
    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        ids |= {id(g) for g in registry.values()}
    return ids


def reset_mesh_state() -> list[str]:
    """Leave no mesh entered (``with mesh:``) for the next test; names what a body left behind."""
    import sys

    module = sys.modules.get("torch.distributed.device_mesh")
    env = getattr(module, "_mesh_resources", None)
    stack = getattr(env, "mesh_stack", None)
    if not stack:
        return []
    n = len(stack)
    stack.clear()
    return [f"{n} device mesh(es) left entered (with mesh:)"]


def coordinate_label(mesh: Any) -> str:
    """``dp=1, tp=0`` for this rank on ``mesh`` (dim indices when the mesh has no names)."""
    coord = mesh.get_coordinate()
    if coord is None:
        return "not in the mesh"
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(len(coord)))
    return ", ".join(f"{n}={c}" for n, c in zip(names, coord))


def local_shard_problem(actual: Any, expected: Any, **kwargs: Any) -> str:
    """This rank's local shard of the DTensor side against the same region of the other side ('' if
    close).

    The other side, replicated, is redistributed to the DTensor side's placements (``Shard``, FSDP's
    strided shards: each rank keeps its part, no communication). Called only after the full tensors
    differed.
    """
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    ref = actual if is_dtensor(actual) else expected
    if any(p.is_partial() for p in ref.placements):
        return "partial placements: local shards are not comparable"
    mesh, placements = ref.device_mesh, tuple(ref.placements)

    def local(x: Any) -> Any:
        if is_dtensor(x):
            if x.device_mesh == mesh and tuple(x.placements) == placements:
                return x.detach().to_local()
            x = x.full_tensor()
        # replicated -> the reference's placements: each rank keeps its part, no communication
        whole = DTensor.from_local(x.detach().to(ref.device), mesh, [Replicate()] * mesh.ndim,
                                   run_check=False)
        return whole.redistribute(mesh, placements).to_local()

    try:
        mine, theirs = local(actual), local(expected)
    # noqa: BLE001 - the full comparison has failed already; this only adds detail
    except Exception as exc:
        return f"not compared ({type(exc).__name__}: {exc})"
    try:
        torch.testing.assert_close(mine, theirs, **kwargs)
    except AssertionError as exc:
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        return "; ".join(lines[:3])
    return ""


def distribute_randn(shape: Sequence[int], mesh: Any, placements: Sequence[Any], *, seed: int = 0,
                     dtype: Any = None, requires_grad: bool = False) -> Any:
    """A DTensor of ``shape`` with ``placements`` on ``mesh``, holding a global tensor that is the
    same on every rank: ``torch.randn(shape, generator=torch.Generator().manual_seed(seed))`` (CPU
    generator, then moved to the mesh's device). ``full_tensor()`` gives it back; uneven shards
    follow ``torch.chunk``, as DTensor does."""
    import inspect

    import torch
    from torch.distributed.tensor import distribute_tensor

    if "src_data_rank" not in inspect.signature(distribute_tensor).parameters:
        raise MeshSupportError("tp.distribute_randn needs "
                               "torch.distributed.tensor.distribute_tensor(..., "
                               "src_data_rank=None) (each rank keeps its shard of the same global "
                               "tensor, no broadcast), as in torch 2.13; torch "
                               f"{torch.__version__} has no src_data_rank")
    generator = torch.Generator().manual_seed(int(seed))
    global_tensor = torch.randn(tuple(shape), generator=generator, dtype=dtype or torch.float32)
    device = (torch.device(mesh.device_type, torch.cuda.current_device())
              if mesh.device_type == "cuda" else "cpu")
    out = distribute_tensor(global_tensor.to(device), mesh, list(placements), src_data_rank=None)
    return out.requires_grad_() if requires_grad else out
