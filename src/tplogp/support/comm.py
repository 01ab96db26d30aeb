"""Collective helpers that work across the supported torch versions (2.4 .. current)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def all_gather_flat(inp: torch.Tensor, group) -> torch.Tensor:
    """Gather ``inp`` ``[n, ...]`` from every rank into ``[world * n, ...]`` (rank-major), one
    collective."""
    world = dist.get_world_size(group)
    out = torch.empty((world * inp.shape[0],) + tuple(inp.shape[1:]), dtype=inp.dtype,
                      device=inp.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp.contiguous(), group=group)
    return out


def reduce_scatter_rows(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """``out`` ``[n, ...]`` = rank r's rows ``[r * n, (r + 1) * n)`` of ``inp`` ``[world * n, ...]``
    summed over the group (one collective); the work handle with ``async_op``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, inp.contiguous(), group=group, async_op=async_op)


def collective_device(group, tensor_device: torch.device) -> torch.device:
    """Where ``group``'s collectives take their tensors: the CUDA device for NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl":
        if tensor_device.type == "cuda":
            return tensor_device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_name(group) -> str:
    """The name that identifies ``group`` to :func:`group_from_name` ("" for None: no group)."""
    return "" if group is None else group.group_name


def group_from_name(name: str):
    """The process group registered under ``name`` (None for "")."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


# ranks of a device-backend group -> its gloo companion (None: none could be made on some rank of
# the group)
_host_groups: dict[tuple[int, ...], object] = {}


def host_group(group, comm_device: torch.device):
    """A group over ``group``'s ranks whose collectives take CPU tensors and never wait for a
    device.

    ``group`` itself when its backend runs CPU collectives (gloo, alone or beside NCCL). Otherwise a
    gloo companion, created on first use by the group's ranks alone
    (``new_group(..., use_local_synchronization=True)``: no other rank takes part, and the global
    group counter that names ordinary groups is left alone) and kept for the process. Like a
    collective, that first use must be entered by every rank of the group. Whether every rank made
    one is agreed once over ``group`` itself (one small collective and host read, at the first use
    only); when some rank could not (gloo missing, a name taken), every rank gets None and the
    caller keeps to ``group``."""
    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _host_groups:
        try:
            made = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
        except Exception:  # agreed below: every rank then falls back alike
            made = None
        everyone = torch.tensor([0 if made is None else 1], dtype=torch.int32, device=comm_device)
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
        _host_groups[ranks] = made if int(everyone.item()) == 1 else None
    return _host_groups[ranks]


def known_host_group(group, comm_device: torch.device):
    """:func:`host_group` when it needs no collective now (``group`` is gloo, or its companion was
    made by an earlier call), else None: what a CUDA-graph capture, which cannot run the first use's
    device collective, may call."""
    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    return _host_groups.get(tuple(dist.get_process_group_ranks(group)))


def host_groups() -> list:
    """The companion groups :func:`host_group` holds for the process (the test plugin does not count
    them as leaked)."""
    return [g for g in _host_groups.values() if g is not None]


class OverlappedAllReduce:
    """Sum a tensor over ``group`` with an async collective started as soon as the tensor is
    complete.

    ``start(t)`` issues ``all_reduce(async_op=True)`` on ``t`` (moved to ``comm_device`` first when
    the group cannot reduce tensors where they are): the caller keeps computing (e.g. ``d_W``) while
    it runs, and must not modify ``t`` afterwards. ``finish(t)`` starts it if nobody did, waits, and
    returns the sum on ``t``'s device. Identical sums to a blocking ``all_reduce``: the same
    collective on the same data.
    """

    def __init__(self, group, comm_device: torch.device):
        self.group = group
        self.comm_device = comm_device
        self._work = None
        self._buf: torch.Tensor | None = None
        self._source: torch.Tensor | None = None

    @property
    def started(self) -> bool:
        return self._buf is not None

    def start(self, t: torch.Tensor) -> None:
        if self._buf is not None:
            raise RuntimeError("OverlappedAllReduce.start called twice")
        self._source = t
        self._buf = t.to(self.comm_device)
        self._work = self._collective(self._buf)

    def finish(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if self._buf is None:
            self.start(t)
        elif self._source is not t:
            raise RuntimeError("OverlappedAllReduce.finish got another tensor than the one started")
        self._work.wait()
        return self._result().to(t.device)

    def _collective(self, buf: torch.Tensor):
        return dist.all_reduce(buf, group=self.group, async_op=True)

    def _result(self) -> torch.Tensor:
        return self._buf


class OverlappedReduceScatter(OverlappedAllReduce):
    """:class:`OverlappedAllReduce` whose collective is a reduce-scatter over rows: ``finish(t)``
    returns this rank's rows ``[r * n, (r + 1) * n)`` of the sum, ``n = t.shape[0] / world`` (the
    gradient of a sequence-parallel hidden). Half the bytes of an all-reduce per rank."""

    def _collective(self, buf: torch.Tensor):
        world = dist.get_world_size(self.group)
        self._out = buf.new_empty((buf.shape[0] // world,) + tuple(buf.shape[1:]))
        return reduce_scatter_rows(self._out, buf, self.group, async_op=True)

    def _result(self) -> torch.Tensor:
        return self._out


def overlapped_reduce(kind: Optional[str], group, comm_device: torch.device):
    """The overlapped ``d_hidden`` collective of a call (``start`` at ``d_hidden_ready``, ``finish``
    at the end) that ``kind`` names (``TPContext.hidden_reduce``): ``"all_reduce"``
    (:class:`OverlappedAllReduce`), ``"reduce_scatter"`` (:class:`OverlappedReduceScatter`, a
    sequence-parallel hidden), or None when ``d_hidden`` is handed over as computed."""
    if kind == "all_reduce":
        return OverlappedAllReduce(group, comm_device)
    if kind == "reduce_scatter":
        return OverlappedReduceScatter(group, comm_device)
    return None
