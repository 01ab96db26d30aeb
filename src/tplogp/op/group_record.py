"""The group record: one small int64 record per rank, exchanged in a single ``all_gather``, so that
every rank of a TP group reaches the same verdict on a call and raises the same error (none is left
waiting in a collective).

The record holds the rank's local verdict, the call's layout (tokens, hidden size, shard range,
declared vocab, dtype, bias, ignore_index, whether it records an autograd graph, the hidden layout:
sequence-parallel and ``hidden_grad``), for a fused-loss call the digests of what its ranks must
pass alike (:class:`tplogp.op.validation.LossCheck`: the loss's options, the per-token tensors'
shapes and dtypes, the sequences' offsets; 0 for an op call) and optionally a summary
``[checksum, lo, hi]`` of the targets. From the gathered rows every rank checks the ranks' agreement
and the shard partition (:func:`tplogp.support.shards.validate_ranges`), giving the global
vocabulary size. When some rank has a local problem, the message texts follow in one
``all_gather_object`` (entered by all ranks, since all of them saw the flag); so do the descriptions
of a fused-loss part whose digests differ. Used by the per-call verdict (:mod:`tplogp.op.verdicts`),
whose deferred target summary travels in the record.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..support.comm import all_gather_flat
from ..support.shards import validate_ranges
from .validation import AGREED, DTYPE_CODE, LinearLogpInputError, LossCheck

# the record's fields: the verdict and the layout (0 to 10), the fused loss's digests, then the
# targets' summary
_LOSS = 11  # the first of the len(AGREED) digests
_SUPPORT = _LOSS + len(AGREED)  # the support's fingerprint (-1: none)
_SENT = _SUPPORT + 1  # whether a target summary travels, then its checksum, lo, hi

class GroupRecord:
    """The collective verdict of a call with a group. :meth:`exchange` returns the global vocab size
    and, when every rank sent one, the targets' summary."""

    # verdict, 7 metadata fields, ignore_index, differentiability, the hidden layout, the fused
    # loss's digests, the support's fingerprint, then whether a target summary travels, and its checksum, lo, hi
    _FIELDS = _SENT + 4
    # fast mode: (vocab size, every rank's shard range) of the layouts already verified, keyed by
    # the call's layout
    _verified: dict = {}

    @classmethod
    def exchange(
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
        targets: Optional[torch.Tensor | tuple[int, int, int]],
        ignore_index: Optional[int],
        mode: str,
        builds_graph: bool = False,
        targets_note: str = "",
        sequence_parallel: bool = False,
        hidden_grad: str = "reduced",
        loss_check: Optional[LossCheck] = None,
        support_digest: int = -1,
        samples: bool = False,
    ) -> tuple[int, Optional[tuple[int, int, int]], list[tuple[int, int]]]:
        """``targets``: this rank's targets summary as a device ``[3]`` tensor (it travels in the
        record, so the record exchange is the call's only host read), ``(checksum, lo, hi)`` already
        on the host (an earlier call's deferred summary: with ``group`` a CPU group, nothing here
        waits for a device), or None. ``targets_note`` ends the error of targets that differ between
        ranks. The summary is returned when every rank sent one and they agree (a range check is the
        caller's), and every rank's shard range ``(start, end)``, rank-major (in ``fast`` mode those
        of the layout's verified call). ``sequence_parallel``, ``hidden_grad``: the call's hidden
        layout (ranks that disagree would enter different collectives); ``samples``: whether the
        call computes its support from the sampler's parameters (a collective of its own, so it
        travels in the same field). ``loss_check``: a fused-loss
        call's own arguments (its ranks' digests must agree; errors then name
        ``linear_logp_loss``). ``support_digest``: the fingerprint of the call's support (-1:
        none), which the ranks' must agree on where the record is exchanged (not part of ``fast``
        mode's key: a verified layout's later calls compare nothing, as with the targets)."""
        world = dist.get_world_size(group)
        hidden_layout = hidden_layout_code(sequence_parallel, hidden_grad, samples)
        digests = [0] * len(AGREED)
        if loss_check is not None and problem is None:
            digests = loss_check.digests()
        key = (id(group), vocab_start_index, v_local, global_vocab_size, hidden_size, dtype,
               has_bias, ignore_index, builds_graph, hidden_layout, *digests)
        if mode == "fast" and problem is None and key in cls._verified:
            total, ranges = cls._verified[key]
            return total, None, ranges
        head = torch.tensor(
            [
                0 if problem is None else 1,
                n_tokens,
                hidden_size,
                vocab_start_index,
                v_local,
                -1 if global_vocab_size is None else global_vocab_size,
                DTYPE_CODE.get(dtype, 0),
                int(has_bias),
                -(1 << 62) if ignore_index is None else ignore_index,
                int(builds_graph),
                hidden_layout,
                *digests,
                support_digest,
            ] + ([0, 0, 0, -1] if targets is None else [1, *targets] if isinstance(targets,
                                                                                   tuple) else [1]),
            dtype=torch.long,
            device=comm_device,
        )
        record = head if not isinstance(targets, torch.Tensor) else torch.cat([head, targets.to(comm_device)])
        rows = cls._exchange(record, group, world)
        caller = "linear_logp" if loss_check is None else loss_check.caller
        if any(r[0] for r in rows):
            messages: list = [None] * world
            dist.all_gather_object(messages, problem, group=group)
            bad = [(r, m) for r, m in enumerate(messages) if m]
            detail = "; ".join(f"rank {r}: {m}" for r, m in bad)
            raise LinearLogpInputError(f"{caller} inputs rejected ({detail})")
        cls._check_agreement(rows)
        cls._check_loss_agreement(rows, group, world, loss_check)
        supports = [r[_SUPPORT] for r in rows]
        if len(set(supports)) > 1:
            listing = ", ".join(f"rank {i}: " + ("none" if d < 0 else f"#{d:x}")
                                for i, d in enumerate(supports))
            raise LinearLogpInputError(f"{caller}: support= (replicated, like target_ids: the same "
                                       f"kept ids per token) must be the same on every TP rank, "
                                       f"got {listing}")
        ranges = [(r[3], r[3] + r[4]) for r in rows]
        declared = {r[5] for r in rows}
        total = validate_ranges(ranges, None if declared == {-1} else max(declared))
        if mode == "fast":
            cls._verified[key] = (total, ranges)
        if not all(r[_SENT] for r in rows):
            return total, None, ranges
        checksums = [r[_SENT + 1] for r in rows]
        if len(set(checksums)) > 1:
            listing = ", ".join(f"rank {i}: #{c:x}" for i, c in enumerate(checksums))
            raise LinearLogpInputError("target_ids (they must be replicated: the same global ids on every rank) must "
                                       f"be the same on every TP rank, got {listing}{targets_note}")
        # identical on every rank: the checksum agreement proved the targets replicated
        return total, tuple(rows[0][_SENT + 1:_SENT + 4]), ranges

    @classmethod
    def is_verified(cls, group, vocab_start_index: int, v_local: int,
                    global_vocab_size: Optional[int], hidden_size: int, dtype: torch.dtype,
                    has_bias: bool, ignore_index: Optional[int], builds_graph: bool,
                    sequence_parallel: bool = False, hidden_grad: str = "reduced",
                    loss_check: Optional[LossCheck] = None, samples: bool = False) -> bool:
        """Whether ``fast`` mode has verified this layout with ``group`` (its later calls exchange
        nothing)."""
        hidden_layout = hidden_layout_code(sequence_parallel, hidden_grad, samples)
        digests = [0] * len(AGREED) if loss_check is None else loss_check.digests()
        return (id(group), vocab_start_index, v_local, global_vocab_size, hidden_size, dtype,
                has_bias, ignore_index, builds_graph, hidden_layout, *digests) in cls._verified

    @classmethod
    def _exchange(cls, record: torch.Tensor, group, world: int) -> list[list[int]]:
        """Every rank's record, rank-major: one all_gather and one read of its result (a host read
        when the record lives on a device; nothing waits for a device when it is a CPU tensor of a
        CPU group)."""
        gathered = all_gather_flat(record, group)
        return gathered.view(world, cls._FIELDS).cpu().tolist()

    @staticmethod
    def _check_loss_agreement(rows: Sequence[Sequence[int]], group, world: int,
                              loss_check: Optional[LossCheck]) -> None:
        """The fused loss's parts (:data:`tplogp.op.validation.AGREED`) must have the same digest on
        every rank; where one differs, every rank's description follows in one
        ``all_gather_object`` (all ranks saw the difference) and every rank raises the same
        error."""
        for index, what in enumerate(AGREED if loss_check is None else loss_check.labels):
            values = [r[_LOSS + index] for r in rows]
            if len(set(values)) == 1:
                continue
            texts: list = [None] * world
            mine = None if loss_check is None else loss_check.describe(index)
            dist.all_gather_object(texts, mine, group=group)
            listing = "; ".join(f"rank {i}: {t}" for i, t in enumerate(texts))
            caller = "linear_logp_loss" if loss_check is None else loss_check.caller
            raise LinearLogpInputError(f"{caller}: {what} must be the same on every TP rank, got "
                                       f"{listing}")

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
        names = {v: k for k, v in DTYPE_CODE.items()}
        differ(6, "the input dtype", lambda c: str(names.get(c, "?")))
        differ(7, "bias presence (all ranks pass a bias or none does)",
               lambda b: "bias" if b else "no bias")
        differ(8, "ignore_index", lambda v: "None" if v == -(1 << 62) else str(v))
        # a rank that records no autograd graph would skip the backward all-reduce the others enter
        differ(9, "whether the call is differentiable (grad mode on and hidden.requires_grad)",
               lambda b: "yes" if b else "no")
        layouts = [r[10] for r in rows]
        if len({c & 3 for c in layouts}) > 1:
            listing = ", ".join(f"rank {i}: {HIDDEN_LAYOUTS.get(c & 3, '?')}"
                                for i, c in enumerate(layouts))
            raise LinearLogpInputError("the hidden layout (sequence_parallel, hidden_grad) must be "
                                       f"the same on every TP rank, got {listing}")
        if len({c >> 2 for c in layouts}) > 1:  # a support computed on some ranks only
            listing = ", ".join(f"rank {i}: {'given' if c >> 2 else 'none'}"
                                for i, c in enumerate(layouts))
            raise LinearLogpInputError("the sampler's parameters (top_k= / top_p= / min_p=: given "
                                       f"or not) must be the same on every TP rank, got {listing}")


# the hidden layout as it travels in the record: sequence_parallel and hidden_grad
HIDDEN_LAYOUTS = {0: "replicated, hidden_grad='reduced'", 1: "sequence_parallel=True",
                  2: "replicated, hidden_grad='partial'",
                  3: "sequence_parallel=True, hidden_grad='partial'"}


def hidden_layout_code(sequence_parallel: bool, hidden_grad: str, samples: bool = False) -> int:
    """The hidden layout of a call's options as one record field (keys of
    :data:`HIDDEN_LAYOUTS`, plus 4 when the call computes its support from the sampler's
    parameters)."""
    return int(bool(sequence_parallel)) + 2 * int(hidden_grad == "partial") + 4 * int(samples)


