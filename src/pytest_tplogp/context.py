"""The ``tp`` rank context and collective assertion helpers.

A :class:`RankContext` is what a test body receives as ``tp`` on each rank: rank, world size,
backend, device and the process group, plus helpers that turn a *local* check into a *collective*
decision. Design rule: a check that fails on one rank must fail the test on every rank, and nobody
may be left waiting in a collective. Each helper therefore exchanges a small verdict over a gloo
control group (the default group itself under gloo, a dedicated gloo group under NCCL) and then
every rank raises the same error (or skips with the same reason).

This module is rank-side: it imports torch but nothing of the controller, and it works both inside
the plugin's rank pool and when pytest itself was launched by torchrun (external mode).
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .protocol import format_ranks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from .mesh import MeshShape

_CURRENT: RankContext | None = None


class CollectiveAssertionError(AssertionError):
    """A collective check failed on at least one rank; raised identically on every rank."""


# short name in reports; resolvable via the package
CollectiveAssertionError.__module__ = "pytest_tplogp"


def current_context() -> RankContext:
    """The rank context of this process (inside a rank of the pool or under torchrun)."""
    if _CURRENT is None:
        raise RuntimeError(
            "no tplogp rank context in this process: current_context() works only inside a test "
            "body running on the ranks (@pytest.mark.tp) or in a function passed to tp_pool.run"
        )
    return _CURRENT


def _is_skip(exc: BaseException) -> bool:
    pytest = sys.modules.get("pytest")
    return pytest is not None and isinstance(exc, pytest.skip.Exception)


class RankContext:
    """This rank's view of the pool: ``rank``, ``world_size``, ``backend``, ``device``, ``group``
    and helpers.

    ``group`` is the default (world) process group. Sub-groups must come from :meth:`new_group`,
    which caches them for the life of the pool; groups created directly with ``dist.new_group`` and
    not destroyed make the pool's fresh-state check recycle the pool after the test.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device,
        *,
        local_rank: int | None = None,
        external: bool = False,
        ctrl_group: Any = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.local_rank = rank if local_rank is None else local_rank
        self.external = external
        self._ctrl_group = ctrl_group
        self._subgroups: dict[tuple[tuple[int, ...], bool], Any] = {}
        self._meshes: dict[MeshShape, DeviceMesh] = {}  # for the life of the pool

    def __repr__(self) -> str:
        return (f"RankContext(rank={self.rank}, world_size={self.world_size}, "
                f"backend={self.backend!r}, device={self.device})")

    # ---------------------------------------------------------------- process groups
    @property
    def group(self) -> Any:
        """The default (world) process group."""
        return dist.group.WORLD

    def new_group(self, ranks: Sequence[int], use_local_synchronization: bool = False) -> Any:
        """A sub-group over ``ranks``, created once and cached for the life of the pool.

        Like ``dist.new_group``, every rank of the world must call it with the same ``ranks``;
        with ``use_local_synchronization=True`` (passed through to ``dist.new_group``) only the
        ranks of ``ranks`` call it. The two kinds are cached apart, so each call finds the group
        its callers made together.
        """
        members = tuple(sorted(int(r) for r in ranks))
        key = (members, bool(use_local_synchronization))
        if key not in self._subgroups:
            local = bool(use_local_synchronization)
            self._subgroups[key] = dist.new_group(list(members), backend=self.backend,
                                                  use_local_synchronization=local)
        return self._subgroups[key]

    def device_mesh(self, shape: MeshShape | Mapping[str, int] | None = None) -> DeviceMesh:
        """The ``DeviceMesh`` of ``shape`` (a :class:`~pytest_tplogp.mesh.MeshShape` or a dict such
        as ``{"dp": 2, "tp": 2}``; None: ``{"tp": world_size}``), row-major over the ranks like
        ``init_device_mesh``.

        Collective the first time a shape is asked for (its groups are created); cached for the life
        of the pool.
        """
        from .mesh import MeshShape, build_mesh

        key = (MeshShape.default(self.world_size) if shape is None
               else MeshShape.parse(shape, "tp.device_mesh"))
        mesh = self._meshes.get(key)
        if mesh is None:
            mesh = self._meshes[key] = build_mesh(self, key)
        return mesh

    def owned_group_ids(self) -> set[int]:
        """Identities of the process groups the pool keeps (cached sub-groups, cached meshes'
        groups); the fresh-state check does not count them as left behind."""
        from .mesh import mesh_group_ids

        # (a rank outside a sub-group holds a sentinel)
        ids = {id(g) for g in self._subgroups.values()}
        for mesh in self._meshes.values():
            ids |= mesh_group_ids(mesh)
        return ids

    def reset_after_test(self) -> list[str]:
        """Put back what a body can leave in torch's global mesh state; names what was put back."""
        from .mesh import reset_mesh_state

        return reset_mesh_state()

    def barrier(self) -> None:
        dist.barrier(group=self._ctrl_group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather a picklable object from every rank over the gloo control group (no device
        work)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._ctrl_group)
        return out

    # ---------------------------------------------------------------- collective checks
    def assert_all(self, condition: Any, message: str = "") -> None:
        """Collective ``assert``: if ``condition`` is false on any rank, every rank raises the same
        error.

        The error names the failing ranks and each one's message, so the report groups it as "ranks
        0-3".
        """
        ok = bool(condition)
        verdicts = self.all_gather_object((ok, "" if ok else str(message)))
        self._raise_if_failed(verdicts, what="check")

    def assert_close(self, actual: Any, expected: Any, **kwargs: Any) -> None:
        """Collective ``torch.testing.assert_close``: a mismatch on any rank fails every rank with
        its details.

        Either side may be a DTensor (every rank must then call this, like any collective): the full
        tensors are compared, and on a mismatch the error also names the mesh coordinates whose
        local shard differs.
        """
        from .values import is_dtensor

        dtensors = [x for x in (actual, expected) if is_dtensor(x)]
        if dtensors:
            self._assert_close_dtensor(actual, expected, dtensors[0].device_mesh, **kwargs)
            return
        try:
            torch.testing.assert_close(actual, expected, **kwargs)
            verdict: tuple[bool, str] = (True, "")
        except AssertionError as exc:
            verdict = (False, str(exc))
        self._raise_if_failed(self.all_gather_object(verdict), what="assert_close")

    def _assert_close_dtensor(self, actual: Any, expected: Any, mesh: Any, **kwargs: Any) -> None:
        from .mesh import coordinate_label, local_shard_problem
        from .values import full

        try:
            torch.testing.assert_close(full(actual), full(expected), **kwargs)
            problem = ""
        except AssertionError as exc:
            problem = str(exc)
        verdicts = self.all_gather_object((not problem, problem))
        if all(ok for ok, _ in verdicts):
            return
        shards = self.all_gather_object(
            (coordinate_label(mesh), local_shard_problem(actual, expected, **kwargs)))
        differing = [(r, label, why) for r, (label, why) in enumerate(shards) if why]
        if differing:
            where = ("local shards differ at "
                     + "; ".join(f"({label}) on rank {r}" for r, label, _ in differing))
        else:
            where = "no local shard differs on its own (a shape or placement mismatch)"
        details = "".join(f"\n  ({label}) on rank {r}: {why}" for r, label, why in differing)
        first_bad = next(msg for ok, msg in verdicts if not ok)
        raise CollectiveAssertionError("collective assert_close failed (DTensor, full tensors "
                                       f"compared): {where}{details}\n  full tensors: {first_bad}")

    def distribute_randn(self, shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Any], *,
                         seed: int = 0,
                         dtype: torch.dtype | None = None, requires_grad: bool = False) -> Any:
        """A DTensor holding the same seeded global ``randn`` tensor on every rank, placed with
        ``placements`` (``Shard``, ``Replicate``; uneven shards as ``torch.chunk``);
        ``.full_tensor()`` gives it back. The test's RNG is untouched (a generator of its own,
        seeded with ``seed``)."""
        from .mesh import distribute_randn

        return distribute_randn(shape, mesh, placements, seed=seed, dtype=dtype,
                                requires_grad=requires_grad)

    def _raise_if_failed(self, verdicts: list[tuple[bool, str]], what: str) -> None:
        bad = [r for r, (ok, _) in enumerate(verdicts) if not ok]
        if not bad:
            return
        by_msg: dict[str, list[int]] = {}
        for r in bad:
            by_msg.setdefault(verdicts[r][1], []).append(r)
        details = "\n".join(f"  {format_ranks(rs)}: {msg}" if msg else f"  {format_ranks(rs)}"
                            for msg, rs in by_msg.items())
        raise CollectiveAssertionError(f"collective {what} failed on {format_ranks(bad)} of "
                                       f"{self.world_size}:\n{details}")

    @contextlib.contextmanager
    def agree(self) -> Iterator[None]:
        """Run a block whose failure or skip on any rank must be shared by all ranks.

        If the block raises on some ranks, those ranks re-raise their own exception and the others
        raise :class:`CollectiveAssertionError` naming them; if it skips (``pytest.skip``) on some
        ranks and fails on none, every rank skips with the first reason. Nobody is left in a later
        collective.
        """
        err: BaseException | None = None
        try:
            yield
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - decided collectively below
            err = exc
        if err is None:
            mine: tuple[str, str] = ("ok", "")
        elif _is_skip(err):
            mine = ("skip", str(getattr(err, "msg", err)))
        else:
            mine = ("error", "".join(traceback.format_exception_only(type(err), err)).strip())
        verdicts = self.all_gather_object(mine)
        errors = [r for r, (kind, _) in enumerate(verdicts) if kind == "error"]
        skips = [r for r, (kind, _) in enumerate(verdicts) if kind == "skip"]
        if errors:
            if err is not None and mine[0] == "error":
                raise err
            lines = "\n".join(f"  rank {r}: {verdicts[r][1]}" for r in errors)
            raise CollectiveAssertionError(
                f"tp.agree(): the block failed on {format_ranks(errors)}:\n{lines}")
        if skips:
            import pytest

            pytest.skip(verdicts[skips[0]][1] if len(skips) == self.world_size else
                        f"skipped on {format_ranks(skips)}: {verdicts[skips[0]][1]}")

    def skip_if(self, condition: Any, reason: str) -> None:
        """Collective skip: if ``condition`` holds on any rank, every rank skips (never a one-rank
        skip)."""
        verdicts = self.all_gather_object(bool(condition))
        hit = [r for r, v in enumerate(verdicts) if v]
        if hit:
            import pytest

            pytest.skip(reason if len(hit) == self.world_size
                        else f"{reason} (on {format_ranks(hit)})")


def set_current(ctx: RankContext | None) -> None:
    global _CURRENT
    _CURRENT = ctx
