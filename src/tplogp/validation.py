"""Input checks for ``linear_logp``, decided identically on every rank of a tensor-parallel group.

A check that fails on one rank only must not leave the other ranks waiting in a collective. So each rank first
runs its *local* checks without raising, then all ranks exchange one small int64 record (the local verdict plus
the layout and call metadata: tokens, hidden size, shard range, dtype, bias, a checksum of the targets) in a
single ``all_gather``. Every rank then reaches the same verdict from the same gathered data and raises the same
error. When some rank has a local problem, its message text is shared with ``all_gather_object`` (entered by all
ranks, because all of them saw the flag).

Modes (``TPLOGP_CHECKS``):

* ``full`` (default): nothing is read from the device. With a group, the record holds host values only and is
  exchanged over a CPU group (the group itself when it is gloo, else a gloo companion, :func:`tplogp.comm.
  host_group`) on every call, which proves the token counts agree before the stats exchange; metadata errors
  surface at the call. The targets' checksum and range are computed on the device, copied to the host
  asynchronously and travel in the next call's record, whose exchange raises their error on every rank. Without a
  group the range verdict is raised at the next call without a group. :func:`tplogp.check_errors` raises either at
  once (see :mod:`tplogp.deferred_checks`). A validated partition plus targets inside ``[0, vocab)`` means every
  target has exactly one owner, so the forward needs no further check.
* ``sync``: the targets' summary is read at the call (one host sync): with a group it travels in the call's own
  record, exchanged over the group and read on the host; errors surface at the call that caused them.
* ``fast``: exchanges the record only for the first call of each (group, layout, dtype, hidden size, bias,
  ignore_index, whether the call records an autograd graph) and skips the target check: one collective per forward
  and no host syncs (but the ignore_index compaction's ``nonzero``), as CUDA-graph capture needs; tokens whose
  target no shard owns then come out as NaN, and ranks that disagree on the token count are the caller's bug (they
  would block in the stats exchange).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from . import settings
from .comm import all_gather_flat
from .shards import ShardLayoutError, validate_ranges

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_CODE = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
COVERAGE_MESSAGE = "target_ids must be covered by exactly one TP vocab shard"


class LinearLogpInputError(ValueError):
    """Bad arguments to ``linear_logp`` (raised identically on every rank of the group)."""


def checks_mode() -> str:
    """``TPLOGP_CHECKS`` (:func:`tplogp.settings.checks_mode`); a bad value is a :class:`LinearLogpInputError`."""
    try:
        return settings.checks_mode()
    except settings.SettingsError as exc:
        raise LinearLogpInputError(str(exc)) from exc


def is_int(x) -> bool:
    """A Python int that is not a bool (what the op's ``int`` schema arguments accept)."""
    return isinstance(x, int) and not isinstance(x, bool)


def local_problem(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    bias: Optional[torch.Tensor],
    vocab_start_index: int,
    global_vocab_size: Optional[int],
    ignore_index: Optional[int],
    temperature: float,
    workspace_bytes: Optional[int] = None,
) -> Optional[str]:
    """Everything one rank can check alone. Returns a message, or None when the inputs are fine.

    An argument of a type that the op's schema (:mod:`tplogp.ops`) does not take is always a problem here: such
    calls run these checks eagerly to raise their error (:mod:`tplogp.api`)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("target_ids", target_ids)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if bias is not None and not isinstance(bias, torch.Tensor):
        return f"bias must be a torch.Tensor or None, got {type(bias).__name__}"
    if hidden.dim() not in (2, 3):
        return f"hidden must be [N, D] or [B, S, D], got shape {tuple(hidden.shape)}"
    if weight.dim() != 2:
        return f"weight must be [V_local, D], got shape {tuple(weight.shape)}"
    if hidden.shape[-1] != weight.shape[1]:
        return (f"hidden size mismatch: hidden is {tuple(hidden.shape)} (D={hidden.shape[-1]}) but weight is "
                f"{tuple(weight.shape)} (D={weight.shape[1]})")
    if tuple(target_ids.shape) != tuple(hidden.shape[:-1]):
        return (f"target_ids must have shape {tuple(hidden.shape[:-1])} (hidden's shape without D), "
                f"got {tuple(target_ids.shape)}")
    if target_ids.dtype.is_floating_point or target_ids.dtype.is_complex or target_ids.dtype == torch.bool:
        return f"target_ids must be an integer tensor, got {target_ids.dtype}"
    if hidden.dtype not in SUPPORTED_DTYPES:
        return f"hidden dtype must be one of float32, bfloat16, float16, got {hidden.dtype}"
    if weight.dtype != hidden.dtype:
        return f"weight dtype ({weight.dtype}) must match hidden dtype ({hidden.dtype})"
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            return f"bias must be [V_local] = [{weight.shape[0]}], got shape {tuple(bias.shape)}"
        if bias.dtype not in (weight.dtype, torch.float32):
            return f"bias dtype ({bias.dtype}) must be the weight dtype ({weight.dtype}) or float32"
    devices = {hidden.device, weight.device, target_ids.device} | ({bias.device} if bias is not None else set())
    if len(devices) > 1:
        names = f"hidden={hidden.device}, weight={weight.device}, target_ids={target_ids.device}" + (
            f", bias={bias.device}" if bias is not None else "")
        return f"all tensors must be on one device, got {names}"
    if not is_int(vocab_start_index) or vocab_start_index < 0:
        return f"vocab_start_index must be a non-negative int, got {vocab_start_index!r}"
    if global_vocab_size is not None and (not is_int(global_vocab_size) or global_vocab_size <= 0):
        return f"global_vocab_size must be a positive int or None, got {global_vocab_size!r}"
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > 0
            and temperature != float("inf")):
        return f"temperature must be a positive finite number, got {temperature!r}"
    if ignore_index is not None and not is_int(ignore_index):
        return f"ignore_index must be an int or None, got {ignore_index!r}"
    if workspace_bytes is not None and (not is_int(workspace_bytes) or workspace_bytes < 0):
        return f"workspace_bytes must be a non-negative int or None, got {workspace_bytes!r}"
    return None


class TargetSummary(NamedTuple):
    """What the checks need to know about the targets, read from the device in ONE host sync."""

    checksum: int  # fingerprint, to detect ranks given different (non-replicated) ids
    lo: int  # smallest non-ignored id
    hi: int  # largest non-ignored id (lo > hi when every position is ignored)


def target_summary_tensor(target_ids: torch.Tensor, ignore_index: Optional[int], with_checksum: bool) -> torch.Tensor:
    """``[checksum, lo, hi]`` (int64, on the targets' device) without reading anything on the host.

    ``lo``/``hi`` are the smallest/largest non-ignored ids (``lo > hi`` when every position is ignored); the
    checksum (0 without ``with_checksum``) fingerprints the ids to detect ranks given different targets.
    """
    t = target_ids.reshape(-1).long()
    if t.numel() == 0:
        return torch.tensor([0, 0, -1], dtype=torch.long, device=t.device)
    checksum = torch.zeros((), dtype=torch.long, device=t.device)
    if with_checksum:
        weights = torch.arange(1, t.numel() + 1, device=t.device, dtype=torch.long) % 1_000_003
        checksum = ((t % 1_000_003) * weights).sum() % (1 << 61)
    if ignore_index is None:
        lo, hi = torch.aminmax(t)
    else:  # ignored ids replaced by neutral values: no boolean indexing (which would sync on its own)
        keep = t != ignore_index
        lo = torch.where(keep, t, torch.iinfo(torch.long).max).amin()
        hi = torch.where(keep, t, -1).amax()
    return torch.stack([checksum, lo, hi])


def summarize_targets(target_ids: torch.Tensor, ignore_index: Optional[int], with_checksum: bool) -> TargetSummary:
    """:func:`target_summary_tensor` read on the host (one host sync)."""
    return TargetSummary(*target_summary_tensor(target_ids, ignore_index, with_checksum).tolist())


def target_range_problem(summary: TargetSummary, vocab_size: int, ignore_index: Optional[int]) -> Optional[str]:
    """Targets outside ``[0, vocab_size)``: no shard owns them."""
    if summary.hi < summary.lo:
        return None  # no non-ignored target
    if summary.lo < 0 or summary.hi >= vocab_size:
        bad = summary.lo if summary.lo < 0 else summary.hi
        return (f"{COVERAGE_MESSAGE}: target id {bad} is outside the vocabulary [0, {vocab_size})"
                + ("" if ignore_index is None else f" (ignore_index={ignore_index})"))
    return None


class GroupCheck:
    """The collective verdict. ``run`` returns the global vocab size and, when given targets, their summary."""

    # verdict, 7 metadata fields, ignore_index, differentiability, then whether a target summary travels, and its
    # checksum, lo, hi
    _FIELDS = 14
    # fast mode: vocab size of the layouts already verified, keyed by the call's layout (see ``run``)
    _verified: dict = {}

    @classmethod
    def run(
        cls,
        group,
        comm_device: torch.device,
        problem: Optional[str],
        n_tokens: int,
        hidden_size: int,
        vocab_start_index: int,
        v_local: int,
        global_vocab_size: Optional[int],
        dtype: torch.dtype,
        has_bias: bool,
        targets: Optional[torch.Tensor | TargetSummary],
        ignore_index: Optional[int],
        mode: str,
        builds_graph: bool = False,
        targets_note: str = "",
    ) -> tuple[int, Optional[TargetSummary]]:
        """``targets``: this rank's :func:`target_summary_tensor` (device ``[3]``: it travels in the record, so the
        record exchange is the call's only host read), a :class:`TargetSummary` already on the host (an earlier
        call's, :mod:`tplogp.deferred_checks`: with ``group`` a CPU group, nothing here waits for a device), or
        None. ``targets_note`` ends the error of targets that differ between ranks. The summary is returned when
        every rank sent one and they agree (a range check is the caller's)."""
        world = dist.get_world_size(group)
        key = (id(group), vocab_start_index, v_local, global_vocab_size, hidden_size, dtype, has_bias, ignore_index,
               builds_graph)
        if mode == "fast" and problem is None and key in cls._verified:
            return cls._verified[key], None
        head = torch.tensor(
            [
                0 if problem is None else 1,
                n_tokens,
                hidden_size,
                vocab_start_index,
                v_local,
                -1 if global_vocab_size is None else global_vocab_size,
                _DTYPE_CODE.get(dtype, 0),
                int(has_bias),
                -(1 << 62) if ignore_index is None else ignore_index,
                int(builds_graph),
            ] + ([0, 0, 0, -1] if targets is None else [1, *targets] if isinstance(targets, TargetSummary) else [1]),
            dtype=torch.long,
            device=comm_device,
        )
        record = head if not isinstance(targets, torch.Tensor) else torch.cat([head, targets.to(comm_device)])
        rows = cls._exchange(record, group, world)
        if any(r[0] for r in rows):
            messages: list = [None] * world
            dist.all_gather_object(messages, problem, group=group)
            bad = [(r, m) for r, m in enumerate(messages) if m]
            detail = "; ".join(f"rank {r}: {m}" for r, m in bad)
            raise LinearLogpInputError(f"linear_logp inputs rejected ({detail})")
        cls._check_agreement(rows)
        ranges = [(r[3], r[3] + r[4]) for r in rows]
        declared = {r[5] for r in rows}
        total = validate_ranges(ranges, None if declared == {-1} else max(declared))
        if mode == "fast":
            cls._verified[key] = total
        if not all(r[10] for r in rows):
            return total, None
        checksums = [r[11] for r in rows]
        if len(set(checksums)) > 1:
            listing = ", ".join(f"rank {i}: #{c:x}" for i, c in enumerate(checksums))
            raise LinearLogpInputError("target_ids (they must be replicated: the same global ids on every rank) must "
                                       f"be the same on every TP rank, got {listing}{targets_note}")
        # identical on every rank: the checksum agreement proved the targets replicated
        return total, TargetSummary(*rows[0][11:14])

    @classmethod
    def _exchange(cls, record: torch.Tensor, group, world: int) -> list[list[int]]:
        """Every rank's record, rank-major: one all_gather and one read of its result (a host read when the record
        lives on a device; nothing waits for a device when it is a CPU tensor of a CPU group)."""
        gathered = all_gather_flat(record, group)
        return gathered.view(world, cls._FIELDS).cpu().tolist()

    @staticmethod
    def _check_agreement(rows: Sequence[Sequence[int]]) -> None:
        def differ(index: int, what: str, fmt=str) -> None:
            values = [r[index] for r in rows]
            if len(set(values)) > 1:
                listing = ", ".join(f"rank {i}: {fmt(v)}" for i, v in enumerate(values))
                raise LinearLogpInputError(f"{what} must be the same on every TP rank, got {listing}")

        differ(1, "the number of tokens")
        differ(2, "the hidden size D")
        decl = [r[5] for r in rows]
        if len(set(decl)) > 1:
            listing = ", ".join(f"rank {i}: {'None' if v == -1 else v}" for i, v in enumerate(decl))
            raise LinearLogpInputError(f"global_vocab_size must be the same on every TP rank, got {listing}")
        names = {v: k for k, v in _DTYPE_CODE.items()}
        differ(6, "the input dtype", lambda c: str(names.get(c, "?")))
        differ(7, "bias presence (all ranks pass a bias or none does)", lambda b: "bias" if b else "no bias")
        differ(8, "ignore_index", lambda v: "None" if v == -(1 << 62) else str(v))
        # a rank that records no autograd graph would skip the backward all-reduce the others enter
        differ(9, "whether the call is differentiable (grad mode on and hidden.requires_grad)",
               lambda b: "yes" if b else "no")


def layout_problem_single(vocab_start_index: int, v_local: int, global_vocab_size: Optional[int],
                          group_given: bool = False) -> int:
    """Without a TP group, or with a group of one rank, the weight must be the whole vocabulary. Returns its size."""
    where = "with a tp_group of size 1" if group_given else "without a tp_group"
    if vocab_start_index != 0:
        raise ShardLayoutError(
            f"vocab shards leave a gap: {where} the single shard must start at 0, "
            f"got vocab_start_index={vocab_start_index} (ids [0, {vocab_start_index}) owned by no rank)")
    if global_vocab_size is not None and global_vocab_size != v_local:
        raise ShardLayoutError(
            f"{where} the weight must hold the whole vocabulary: weight has {v_local} rows "
            f"but global_vocab_size is {global_vocab_size}")
    return v_local
