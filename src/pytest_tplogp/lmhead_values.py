"""Picklable values of the LM-head fixtures (``pytest_tplogp.lmhead``): vocabulary layouts,
references, op sources.

Shared by the parent and the ranks; imports neither torch nor pytest at import time, and tplogp only
when a value is used (``tplogp.support.shards``, ``tplogp.reference``, ``tplogp.get_op``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .values import full

#: Default vocabulary of ``vocab_shards``: odd on purpose so the "even" layout has a remainder at
#: world size 2 and 4.
DEFAULT_VOCAB_SIZE = 1031

DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
OP_SOURCES: tuple[str, ...] = ("registry", "native", "triton", "sm90")
BIASES: dict[str, bool] = {"nobias": False, "bias": True}
SHARD_KINDS: tuple[str, ...] = ("even", "uneven")


@dataclass(frozen=True)
class VocabShards:
    """One vocab-sharding layout (``kind`` "even" or "uneven") over ``world_size`` ranks.

    In the parent ``rank`` is None; on a rank it is bound, so ``start``/``end``/``range`` are that
    rank's shard of the default vocabulary. Use :meth:`boundaries` / :meth:`range_for` for a
    vocabulary of your own. Boundaries come from :func:`tplogp.support.shards.shard_boundaries` (never
    ``rank * V_local``).

    With a mesh (``mesh``: the test's :class:`~pytest_tplogp.mesh.MeshShape`), the vocabulary is
    sharded over the mesh dim ``mesh_dim``: ``world_size`` is that dim's size, ``rank`` this rank's
    coordinate on it, and :attr:`group` the dim's process group (the world without a mesh).
    """

    kind: str
    world_size: int
    rank: int | None = None
    vocab_size: int = DEFAULT_VOCAB_SIZE
    mesh: Any = None
    mesh_dim: str = "tp"
    group: Any = field(default=None, compare=False, repr=False)

    def __tp_bind__(self, tp: Any) -> VocabShards:
        if self.mesh is None:
            return VocabShards(self.kind, tp.world_size, tp.rank, self.vocab_size, group=tp.group)
        sub = tp.device_mesh(self.mesh)[self.mesh_dim]
        return VocabShards(self.kind, sub.size(), sub.get_local_rank(), self.vocab_size, self.mesh,
                           self.mesh_dim,
                           group=sub.get_group())

    @property
    def uneven(self) -> bool:
        return self.kind == "uneven"

    def boundaries(self, vocab_size: int | None = None) -> list[int]:
        """``[0, b_1, ..., V]`` for ``vocab_size`` (default: :attr:`vocab_size`)."""
        from tplogp.support.shards import shard_boundaries

        return shard_boundaries(self.vocab_size if vocab_size is None else vocab_size,
                                self.world_size, uneven=self.uneven)

    def range_for(self, rank: int | None = None, vocab_size: int | None = None) -> Any:
        """``ShardRange(start, end)`` of ``rank`` (default: this rank)."""
        from tplogp.support.shards import shard_range

        r = self.rank if rank is None else rank
        if r is None:
            raise ValueError("VocabShards is not bound to a rank here (parent side); pass rank=")
        return shard_range(self.boundaries(vocab_size), r)

    @property
    def range(self) -> Any:
        return self.range_for()

    @property
    def start(self) -> int:
        return int(self.range.start)

    @property
    def end(self) -> int:
        return int(self.range.end)

    def shard(self, full: Any, dim: int = 0, rank: int | None = None) -> Any:
        """This rank's slice of a full ``[V, ...]`` tensor (rows ``[start, end)`` along ``dim``)."""
        rng = self.range_for(rank, vocab_size=int(full.shape[dim]))
        return full.narrow(dim, rng.start, rng.end - rng.start)

    def __str__(self) -> str:
        return self.kind


@dataclass(frozen=True)
class Reference:
    """Materialized full-vocab references from :mod:`tplogp.reference` (fp32, matching and float64
    modes).

    Arguments may be DTensors (a vocab-sharded weight on ``mesh["tp"]``, say): they are used as
    their full tensors.

    ``reference(hidden, weight_full, target_ids, bias=None, mode="fp32", ...)`` calls
    ``reference_linear_logp``; :meth:`fp32`, :meth:`matching`, :meth:`float64` fix the mode;
    :meth:`outputs` returns logp, entropy and lse.
    """

    default_mode: str = "fp32"

    def __call__(self, hidden: Any, weight: Any, target_ids: Any, bias: Any = None, *,
                 mode: str | None = None,
                 **kwargs: Any) -> Any:
        from tplogp.reference import reference_linear_logp

        hidden, weight, target_ids, bias = (full(x) for x in (hidden, weight, target_ids, bias))
        return reference_linear_logp(hidden, weight, target_ids, bias, mode=mode
                                     or self.default_mode, **kwargs)

    def fp32(self, hidden: Any, weight: Any, target_ids: Any, bias: Any = None,
             **kwargs: Any) -> Any:
        return self(hidden, weight, target_ids, bias, mode="fp32", **kwargs)

    def matching(self, hidden: Any, weight: Any, target_ids: Any, bias: Any = None,
                 **kwargs: Any) -> Any:
        return self(hidden, weight, target_ids, bias, mode="matching", **kwargs)

    def float64(self, hidden: Any, weight: Any, target_ids: Any, bias: Any = None,
                **kwargs: Any) -> Any:
        return self(hidden, weight, target_ids, bias, mode="float64", **kwargs)

    def outputs(self, hidden: Any, weight: Any, target_ids: Any, bias: Any = None, *,
                mode: str | None = None,
                **kwargs: Any) -> Any:
        from tplogp.reference import reference_outputs

        hidden, weight, target_ids, bias = (full(x) for x in (hidden, weight, target_ids, bias))
        return reference_outputs(hidden, weight, target_ids, bias, mode=mode or self.default_mode,
                                 **kwargs)


@dataclass(frozen=True)
class OpSource:
    """An op source ("registry", "native", "triton", "sm90"); calling it calls the op from the
    kernel registry.

    ``name == "registry"`` means automatic selection (``get_op(op, source=None)``). Availability was
    checked in the parent before any rank was involved; the op callable is resolved lazily on first
    call, on the rank.
    """

    name: str
    op_name: str = "linear_logp"

    @property
    def source(self) -> str | None:
        """The ``source=`` argument for ``get_op`` (None for the registry's automatic choice)."""
        return None if self.name == "registry" else self.name

    @property
    def op(self) -> Callable[..., Any]:
        from tplogp import get_op

        return get_op(self.op_name, source=self.source)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **kwargs)

    def __str__(self) -> str:
        return self.name
