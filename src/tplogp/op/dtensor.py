"""DTensor LM heads: a weight (and bias) placed ``Shard(0)`` over the vocabulary on one mesh
dimension.

How FSDP2 + tensor-parallel stacks hold the head. The call is rewritten to the plain tensor-parallel
form:

* the TP group is the weight's mesh dimension that holds ``Shard(0)`` (every other dimension must be
  ``Replicate()``); the global vocab is ``weight.shape[0]``; this rank's vocab start follows
  ``torch.chunk``'s split, the one DTensor uses (chunks of ``ceil(V / W)`` rows, the last ones
  smaller or empty: uneven shards);
* the local shard comes from ``to_local()``, so ``weight.grad`` (and ``bias.grad``) come back as
  DTensors with the weight's placements; on a mesh dimension over which a DTensor hidden is sharded
  (data parallel tokens), the gradient is ``Partial()`` there, because each rank holds its tokens'
  share of the sum;
* hidden is a plain tensor (the same on every rank of the TP dimension) or a DTensor that is
  ``Replicate()`` on the TP dimension and does not shard its last (hidden-size) dimension. With a
  plain hidden the outputs are plain tensors; with a DTensor hidden they are DTensors on hidden's
  mesh with hidden's placements (replicated over the vocab dimension, sharded like hidden's tokens
  elsewhere). ``target_ids`` may be plain or a DTensor.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch

from ..support.shards import chunk_boundaries, shard_range
from .validation import LinearLogpInputError


def is_dtensor(x) -> bool:
    """Whether ``x`` is a DTensor (without importing the DTensor package when nothing has made
    one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def _vocab_mesh_dim(weight) -> int:
    from torch.distributed.tensor import Shard

    placements = tuple(weight.placements)
    sharded = [i for i, p in enumerate(placements) if not p.is_replicate()]
    if len(sharded) != 1 or placements[sharded[0]] != Shard(0):
        raise LinearLogpInputError(
            f"a DTensor weight must be placed Shard(0) on one mesh dimension and Replicate() on the others, "
            f"got {placements}")
    return sharded[0]


def unwrap_dtensors(run: Callable, hidden, weight, target_ids, bias, tp_group,
                    vocab_start_index: int, global_vocab_size: Optional[int], options):
    """Call ``run(hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
    options)`` on the local tensors and the layout the DTensors describe; wrap the outputs as
    DTensors when hidden is one."""
    from torch.distributed.tensor import DTensor, Partial

    hidden_mesh = hidden.device_mesh if is_dtensor(hidden) else None
    if is_dtensor(weight):
        if tp_group is not None or vocab_start_index != 0 or global_vocab_size is not None:
            raise LinearLogpInputError(
                "with a DTensor weight the TP group, vocab start and global vocab come from the DTensor: pass no "
                f"tp_group, vocab_start_index or global_vocab_size (got {tp_group!r}, {vocab_start_index!r}, "
                f"{global_vocab_size!r})")
        mesh, dim = weight.device_mesh, _vocab_mesh_dim(weight)
        if hidden_mesh is not None and hidden_mesh != mesh:
            raise LinearLogpInputError(f"hidden and weight must be on one device mesh, got {hidden_mesh} and {mesh}")
        if bias is not None and not (is_dtensor(bias) and bias.device_mesh == mesh
                                     and tuple(bias.placements) == tuple(weight.placements)):
            raise LinearLogpInputError(
                f"with a DTensor weight the bias must be a DTensor on the same mesh with the same placements "
                f"{tuple(weight.placements)}, got {type(bias).__name__}"
                + (f" with {tuple(bias.placements)}" if is_dtensor(bias) else ""))
        if hidden_mesh is not None and not hidden.placements[dim].is_replicate():
            raise LinearLogpInputError(
                f"a DTensor hidden must be Replicate() on the weight's vocab mesh dimension {dim}, "
                f"got {tuple(hidden.placements)}")
        tp_group = mesh.get_group(dim)
        global_vocab_size = int(weight.shape[0])
        vocab_start_index, vocab_end = shard_range(chunk_boundaries(global_vocab_size,
                                                                    mesh.size(dim)),
                                                   mesh.get_local_rank(dim))
        # data-parallel dimensions of a DTensor hidden: each rank's gradient is its tokens' part of
        # the sum
        grad_placements = [Partial() if hidden_mesh is not None
                           and hidden.placements[i].is_shard() else p
                           for i, p in enumerate(weight.placements)]
        weight = weight.to_local(grad_placements=grad_placements)
        bias = None if bias is None else bias.to_local(grad_placements=grad_placements)
        if weight.shape[0] != vocab_end - vocab_start_index:
            raise LinearLogpInputError(
                f"the DTensor weight's local shard has {weight.shape[0]} rows where torch.chunk's split gives "
                f"{vocab_end - vocab_start_index} (rows [{vocab_start_index}, {vocab_end}))")
    if hidden_mesh is None:
        return run(hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
                   options)

    placements = tuple(hidden.placements)
    if any(p.is_shard() and p.dim in (-1, hidden.dim() - 1) for p in placements) or any(
            p.is_partial() for p in placements):
        raise LinearLogpInputError(f"a DTensor hidden must not be sharded over its last dimension nor partial, "
                                   f"got {placements}")
    out_shape = tuple(hidden.shape[:-1])
    hidden = hidden.to_local()
    target_ids = target_ids.to_local() if is_dtensor(target_ids) else target_ids
    out = run(hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
              options)
    stride = torch.empty(out_shape, device="meta").stride()

    def wrap(x: torch.Tensor):
        return DTensor.from_local(x, hidden_mesh, placements, run_check=False, shape=out_shape,
                                  stride=stride)

    return wrap(out) if isinstance(out, torch.Tensor) else type(out)(*(wrap(x) for x in out))
