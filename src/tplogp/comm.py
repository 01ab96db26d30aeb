"""Collective helpers that work across the supported torch versions (2.4 .. current)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(inp: torch.Tensor, group) -> torch.Tensor:
    """Gather ``inp`` ``[n, ...]`` from every rank into ``[world * n, ...]`` (rank-major), one collective."""
    world = dist.get_world_size(group)
    out = torch.empty((world * inp.shape[0],) + tuple(inp.shape[1:]), dtype=inp.dtype, device=inp.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp.contiguous(), group=group)
    return out


def group_name(group) -> str:
    """The name that identifies ``group`` to :func:`group_from_name` ("" for None: no group)."""
    return "" if group is None else group.group_name


def group_from_name(name: str):
    """The process group registered under ``name`` (None for "")."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)
