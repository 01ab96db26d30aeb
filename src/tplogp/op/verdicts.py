"""The target verdict of a call: whether every target id lies inside the vocabulary (and, with a
group, is the same on every rank), decided without stalling the host.

One entry in the forward, :func:`open_call` (called by the plan for every call), and one in the
backward, :meth:`BackwardVerdict.settle` (called by :func:`tplogp.op.tp.shard_backward`). Verdicts
not yet read wait in this module's queues; :func:`check_errors` reads them on demand.

With a TP group the data part travels in the group record (:mod:`tplogp.op.group_record`), exchanged
by the same entry, so every rank raises the same error.

Modes (``TPLOGP_CHECKS``):

* ``full`` (default): a call that records an autograd graph reads nothing from the device at the
  call; one that records none (``torch.no_grad()``: no backward would carry its verdict) reads its
  targets' range at the call (one small host read; with a group, every rank's summary in one more
  exchange over the CPU group) and raises there. For the others, the targets' ``[checksum, lo, hi]``
  summary is computed on the device and copied to pinned host memory behind an event
  (:class:`PendingTargetCheck`); without a group, on the triton / sm90 sources and without
  ``ignore_index``, the forward's finishing kernel writes a bad id straight into a pinned host slot
  instead (:class:`KernelTargetCheck`: no launch or copy of its own). The verdict reaches the user
  at the first of: the **backward of the same call** (which raises before any gradient is handed to
  autograd: without a group after launching its kernels, so that a wait for the event leaves them
  queued; with a group first, after one exchange over the group's CPU companion, so every rank
  raises the same error), a later call (without a group: the first whose start finds the verdict
  delivered, never waiting for it; with a group: the next call, in its record exchange), or
  :func:`check_errors`. With a group the record holds host values only and is exchanged over a CPU
  group (:func:`tplogp.support.comm.host_group`) on every call, which proves the token counts agree
  before the stats exchange; metadata errors surface at the call. A validated partition plus targets
  inside ``[0, vocab)`` means every target has exactly one owner; meanwhile a bad call's logp is NaN
  at those tokens.
* ``sync``: the targets' summary is read at the call (one host sync); errors surface at the call
  that caused them.
* ``fast``: exchanges the record only for the first call of each (group, layout, dtype, hidden size,
  bias, ignore_index, whether the call records an autograd graph) and skips the target check: one
  collective per forward and no host syncs (but the ignore_index compaction's ``nonzero``); tokens
  whose target no shard owns come out as NaN with finite gradients, and ranks that disagree on the
  token count are the caller's bug.

Under a CUDA-graph capture (:func:`tplogp.support.tensors.is_capturing`; also
``torch.compile(mode="reduce-overhead")``), ``full`` reads nothing on the host: the target check
writes a device flag (:class:`CapturedTargetCheck`), recomputed by every replay. The captured
backward zeroes the call's ``d_hidden``, ``d_weight`` and ``d_bias`` when the flag is set, and the
flag is read after a replay by :func:`check_errors` or by the next call outside a capture (which
raise). What a capture cannot hold raises :class:`LinearLogpInputError` before anything of the call
is captured: ``sync``, and a first call with a group that has no CPU companion yet (both name
``TPLOGP_CHECKS=fast`` and the warm-up call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from ..support import tensors
from ..support.comm import (all_gather_flat, collective_device, group_name, host_group,
                            known_host_group)
from .group_record import GroupRecord
from .validation import LinearLogpInputError, LossCheck


# ---- what the checks read of the targets ---------------------------------------------------------
# ``[checksum, lo, hi]`` formed on the device, so the host reads it in one sync (or, for a deferred
# verdict, later behind an event), and the range verdict drawn from it. The checksum fingerprints the
# ids so that ranks given different targets are told apart; ``lo`` / ``hi`` are the smallest and
# largest ids that are not ``ignore_index``, found with neutral fill values instead of boolean
# indexing (which would sync on its own).

COVERAGE_MESSAGE = "target_ids must be covered by exactly one TP vocab shard"


class TargetSummary(NamedTuple):
    """What the checks need to know about the targets, read from the device in ONE host sync."""

    checksum: int  # fingerprint, to detect ranks given different (non-replicated) ids
    lo: int  # smallest non-ignored id
    hi: int  # largest non-ignored id (lo > hi when every position is ignored)


def target_summary_tensor(target_ids: torch.Tensor, ignore_index: Optional[int],
                          with_checksum: bool) -> torch.Tensor:
    """``[checksum, lo, hi]`` (int64, on the targets' device) without reading anything on the host.

    ``lo``/``hi`` are the smallest/largest non-ignored ids (``lo > hi`` when every position is
    ignored); the checksum (0 without ``with_checksum``) fingerprints the ids to detect ranks given
    different targets.
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
    # ignored ids replaced by neutral values: no boolean indexing (which would sync on its own)
    else:
        keep = t != ignore_index
        lo = torch.where(keep, t, torch.iinfo(torch.long).max).amin()
        hi = torch.where(keep, t, -1).amax()
    return torch.stack([checksum, lo, hi])


def target_range_tensor(target_ids: torch.Tensor, ignore_index: Optional[int]) -> torch.Tensor:
    """``[lo, hi]`` (int64, on the targets' device) of the non-ignored ids of a non-empty
    ``target_ids``: the range check's part of :func:`target_summary_tensor` in the fewest ops (it
    runs at every call without a group)."""
    t = target_ids if target_ids.dim() == 1 else target_ids.reshape(-1)
    t = t if t.dtype == torch.long else t.long()
    if ignore_index is None:
        if t.device.type == "cpu":
            return torch.stack(torch.aminmax(t))
        # one kernel writes what the host copy takes
        lo_hi = torch.empty(2, dtype=torch.long, device=t.device)
        torch.aminmax(t, out=(lo_hi[0], lo_hi[1]))
        return lo_hi
    keep = t != ignore_index
    return torch.stack((torch.where(keep, t, torch.iinfo(torch.long).max).amin(),
                        torch.where(keep, t, -1).amax()))


def summarize_targets(target_ids: torch.Tensor, ignore_index: Optional[int]) -> TargetSummary:
    """The range of the non-ignored targets read on the host (one host sync; no checksum:
    :func:`target_range_tensor`'s fewer ops)."""
    if target_ids.numel() == 0:
        return TargetSummary(0, 0, -1)
    return TargetSummary(0, *target_range_tensor(target_ids, ignore_index).tolist())


def target_range_problem(summary: TargetSummary, vocab_size: int,
                         ignore_index: Optional[int]) -> Optional[str]:
    """Targets outside ``[0, vocab_size)``: no shard owns them."""
    if summary.hi < summary.lo:
        return None  # no non-ignored target
    if summary.lo < 0 or summary.hi >= vocab_size:
        bad = summary.lo if summary.lo < 0 else summary.hi
        return (f"{COVERAGE_MESSAGE}: target id {bad} is outside the vocabulary [0, {vocab_size})"
                + ("" if ignore_index is None else f" (ignore_index={ignore_index})"))
    return None


# ---- the target check a source's finishing kernel runs -------------------------------------------
# For a call without a group (``forward_single`` with ``target_flag``, the triton / sm90 sources) the
# kernel writes an id outside ``[0, vocab)``, if there is one, straight into a host slot, so the
# check costs no launch and no copy of its own. Slots are pinned on a GPU (the kernel writes them
# directly), taken round-robin and reused only once read, so a verdict read later (by the backward of
# one of many accumulated forwards) is still its own call's.

class KernelTargetCheck:
    """The target check of a call without a group whose source's finishing kernel does it
    (``forward_single`` with ``target_flag``, the triton / sm90 sources): no launch and no copy of
    its own. The kernel writes an id outside ``[0, vocab)``, if there is one, straight into a pinned
    host slot (:class:`FlagSlots`); ``ready``, the slot's event (None on the CPU), recorded by the
    launching code right after the kernel on the current stream, says when the slot holds the
    verdict."""

    __slots__ = ("flag", "index", "slots", "ready", "vocab_size", "bad")

    def __init__(self, slots: "FlagSlots", vocab_size: int) -> None:
        self.slots, self.vocab_size = slots, vocab_size
        # the slot's value, once read (a slot is reused only after that)
        self.bad: Optional[int] = None
        # (the slot's previous check has been read: its event is free)
        self.index, self.flag = slots.take(self)
        self.ready: Optional[torch.cuda.Event] = slots.event(self.index) if slots.pinned else None

    def done(self) -> bool:
        """Whether the verdict can be read without waiting for the device."""
        return self.bad is not None or self.ready is None or self.ready.query()

    def read(self) -> int:
        """The slot's value (waits only if the device has not finished the kernel yet), kept once
        read."""
        if self.bad is None:
            if self.ready is not None:
                self.ready.synchronize()  # (returns at once when the kernel is done)
            self.bad = int(self.slots.values[self.index])
        return self.bad

    def problem(self) -> Optional[str]:
        """The verdict (waits only if the device has not finished the kernel yet): the slot's id as
        a one-id summary (0, the slot's "none", lies inside every vocabulary)."""
        bad = self.read()
        if bad == 0:  # (the common case: no id outside the vocabulary was written)
            return None
        return target_range_problem(TargetSummary(0, bad, bad), self.vocab_size, None)


class FlagSlots:
    """Host int64 slots for the verdicts of :class:`KernelTargetCheck` (pinned where the device is a
    GPU, whose kernels then write them directly), taken round-robin; a slot is reused only once its
    last check has read it (waiting for that check's kernel only when ``SIZE`` checks are in
    flight), so a verdict read later, e.g. by the backward of one of many accumulated forwards, is
    still that call's."""

    SIZE = 64
    SPACING = 2  # int64 elements from one slot to the next (16 bytes)

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        # one slot per 16 bytes: every flag has the same 16-byte alignment, which Triton specializes
        # a compiled kernel on (8-byte slots alternate two alignments, so a kernel's launcher would
        # be kept twice)
        self.slots = torch.zeros(self.SIZE * self.SPACING, dtype=torch.int64, pin_memory=pinned)
        self.values = self.slots.numpy()[::self.SPACING]  # host reads and writes without a torch op
        # made once
        self.flags = [self.slots[i * self.SPACING:i * self.SPACING + 1] for i in range(self.SIZE)]
        # one reusable CUDA event per slot, made at its first use
        self.events: list = [None] * self.SIZE
        self.owners: list = [None] * self.SIZE
        self.next = 0

    def take(self, check: KernelTargetCheck) -> tuple:
        i = self.next
        self.next = (i + 1) % self.SIZE
        previous = self.owners[i]
        if previous is not None:
            previous.read()  # its verdict kept with it (a wait only when SIZE checks are in flight)
        self.owners[i] = check
        self.values[i] = 0
        return i, self.flags[i]

    def event(self, i: int) -> "torch.cuda.Event":
        """Slot ``i``'s event (re-recorded by each check that takes the slot, after the previous one
        was read)."""
        found = self.events[i]
        if found is None:
            found = self.events[i] = torch.cuda.Event(blocking=True)  # a waiting host sleeps
        return found


# ---- verdicts read later: the default checks without a host sync ---------------------------------

NO_GROUP_NOTE = (" [found by the check of an earlier linear_logp call without a TP group, whose logp is NaN for these "
                 "tokens; TPLOGP_CHECKS=sync raises at the call itself]")
GROUP_NOTE = (" [found by the check of the previous linear_logp call with this TP group, whose logp is NaN for the "
              "tokens without exactly one owner; TPLOGP_CHECKS=sync raises at the call itself]")
BACKWARD_NOTE = (" [found by the backward of the linear_logp call that had it, before writing any gradient; its logp "
                 "is NaN for these tokens; TPLOGP_CHECKS=sync raises at the call itself]")
CAPTURED_NOTE = (" [found by the target check of a linear_logp call captured in a CUDA graph, at its last replay; "
                 "that replay's logp is NaN for these tokens and its gradients of hidden, weight and bias are zero]")
NO_GRAPH_NOTE = (" [checked at the call: it records no autograd graph (torch.no_grad(), or hidden "
                 "does not require grad), so no backward would carry its verdict]")
CAPTURE_FIX = ("run one call of this layout outside the capture first (a warm-up), or set TPLOGP_CHECKS=fast "
               "(no target check)")



@dataclass
class PendingTargetCheck:
    """The targets' summary of one call on its way to the host (module docstring, ``full``)."""

    # [3] int64 [checksum, lo, hi] or [2] [lo, hi] on the CPU (pinned when copied from a GPU)
    summary: torch.Tensor
    # recorded after the copy; None when the summary was computed on the CPU
    ready: Optional[torch.cuda.Event]
    vocab_size: int
    ignore_index: Optional[int]

    def read_summary(self) -> TargetSummary:
        """The integers (waits only if the device has not reached the copy yet, normally long
        done)."""
        if self.ready is not None and not self.ready.query():
            self.ready.synchronize()
        values = self.summary.tolist()
        return TargetSummary(*values) if len(values) == 3 else TargetSummary(0, *values)

    def range_problem(self, summary: TargetSummary) -> Optional[str]:
        return target_range_problem(summary, self.vocab_size, self.ignore_index)

    def done(self) -> bool:
        """Whether the verdict can be read without waiting for the device."""
        return self.ready is None or self.ready.query()

    def problem(self) -> Optional[str]:
        """The verdict (waits only if the device has not reached the copy yet)."""
        return self.range_problem(self.read_summary())


@dataclass
class CapturedTargetCheck:
    """The target check of a call captured in a CUDA graph: a device flag that every replay
    recomputes."""

    # 0-d bool on the targets' device: some non-ignored target is outside [0, vocab_size)
    bad: torch.Tensor
    vocab_size: int
    ignore_index: Optional[int]

    def message(self) -> str:
        where = "" if self.ignore_index is None else f" (ignore_index={self.ignore_index})"
        return f"{COVERAGE_MESSAGE}: a target id is outside the vocabulary [0, {self.vocab_size}){where}"


# _BLOCKING_WAIT: the events that say when a verdict is on the host are blocking-sync events, so
# that a host that waits for one sleeps instead of spinning a CPU core. A backward settles its
# forward's verdict after launching its kernels; at large shapes it then waits for the forward's
# kernels (tens of milliseconds), which would otherwise keep autograd's device thread spinning all
# that time. Where the verdict has arrived (small shapes, the usual case by the backward) nothing
# waits.


_flag_slots: dict = {}


def start_kernel_target_check(device: torch.device, vocab_size: int) -> KernelTargetCheck:
    """A :class:`KernelTargetCheck` for a call on ``device`` without a group and without
    ``ignore_index`` (the call's deferred verdict)."""
    slots = _flag_slots.get(device.type)
    if slots is None:
        slots = _flag_slots[device.type] = FlagSlots(pinned=device.type == "cuda")
    check = KernelTargetCheck(slots, vocab_size)
    _defer(check)
    return check


# The unjudged checks of calls without a group, oldest first. A call's start judges those whose
# verdict the device has delivered (it never waits, unless _MAX_UNJUDGED are in flight); their
# backward or check_errors the others.
_unjudged: list = []
_MAX_UNJUDGED = 32


def _defer(check) -> None:
    _unjudged.append(check)
    if len(_unjudged) > _MAX_UNJUDGED:
        _judge_oldest()


def _judge_oldest() -> None:
    """Judge the oldest unjudged check (waiting for the device if needed); on an error the later
    calls' verdicts go with it (one error per bad batch)."""
    problem = _unjudged.pop(0).problem()
    if problem is not None:
        del _unjudged[:]
        raise LinearLogpInputError(problem + NO_GROUP_NOTE)


# the last call with each group (by group name)
_pending_by_group: dict[str, PendingTargetCheck] = {}
# captured checks by scope ("" without a group, else the group name): the latest few, read after
# replays by check_errors, and by the first call outside a capture after a capture (scopes in
# _captured_unread)
_captured: dict[str, list[CapturedTargetCheck]] = {}
_captured_unread: set[str] = set()
_CAPTURED_KEPT = 64


def _start(target_ids: torch.Tensor, vocab_size: int, ignore_index: Optional[int],
           with_checksum: bool) -> PendingTargetCheck:
    summary = (target_summary_tensor(target_ids, ignore_index, with_checksum=True) if with_checksum
               else target_range_tensor(target_ids, ignore_index))
    ready = None
    if summary.device.type == "cuda":
        # pinned (caching host allocator), ordered on the stream
        summary = summary.to("cpu", non_blocking=True)
        ready = torch.cuda.Event(blocking=True)  # (_BLOCKING_WAIT)
        ready.record()
    return PendingTargetCheck(summary, ready, vocab_size, ignore_index)


def _capture_check(scope: str, target_ids: torch.Tensor, vocab_size: int,
                   ignore_index: Optional[int]) -> CapturedTargetCheck:
    """The device flag of a captured call (no host read, no allocation outside the graph's pool)."""
    t = target_ids.reshape(-1)
    outside = (t < 0) | (t >= vocab_size)
    if ignore_index is not None:
        outside &= t != ignore_index
    check = CapturedTargetCheck(outside.any(), vocab_size, ignore_index)
    kept = _captured.setdefault(scope, [])
    kept.append(check)
    del kept[:-_CAPTURED_KEPT]
    _captured_unread.add(scope)
    return check


def _captured_problem(scope: str, first_read_only: bool = False) -> Optional[str]:
    """Read the flags of the captured calls of ``scope`` (one host read; a set flag is cleared once
    raised, until the graph's next replay sets it again). ``first_read_only``: only if not read
    since the last capture."""
    if first_read_only and scope not in _captured_unread:
        return None
    _captured_unread.discard(scope)
    kept = _captured.get(scope)
    if not kept:
        return None
    bad = torch.stack([c.bad.to(kept[0].bad.device) for c in kept]).tolist()
    for c, b in zip(kept, bad):
        if b:
            c.bad.zero_()
            return c.message() + CAPTURED_NOTE
    return None


def defer_target_range_check(target_ids: torch.Tensor, vocab_size: int,
                             ignore_index: Optional[int]) -> Optional[PendingTargetCheck]:
    """Start the range check of ``target_ids`` against ``[0, vocab_size)`` (a call without a
    group)."""
    if target_ids.numel() == 0:
        return None
    check = _start(target_ids, vocab_size, ignore_index, with_checksum=False)
    _defer(check)
    return check


def defer_group_target_check(scope: str, target_ids: torch.Tensor, vocab_size: int,
                             ignore_index: Optional[int]) -> PendingTargetCheck:
    """Start the checks of a call with the group named ``scope``: its targets' checksum and range,
    read by its backward or the next call."""
    pending = _pending_by_group[scope] = _start(target_ids, vocab_size, ignore_index,
                                                with_checksum=True)
    return pending


def take_group_pending(scope: str) -> Optional[PendingTargetCheck]:
    """The pending check of the previous call with the group named ``scope`` (removed: it is judged
    once), or None."""
    return _pending_by_group.pop(scope, None)


def raise_pending_errors(everything: bool = True) -> None:
    """Raise the verdict of deferred checks without a group, or of captured calls, if one failed.
    ``everything=False`` (a call's own start): only the deferred verdicts that the device has
    delivered (oldest first; no wait), and the captured flags only at the first call after a
    capture. ``everything=True``: all of them (waiting for the device where needed)."""
    problem = _captured_problem("", first_read_only=not everything) if _captured else None
    if problem is not None:
        raise LinearLogpInputError(problem)
    while _unjudged and (everything or _unjudged[0].done()):
        _judge_oldest()


def _judge_group_summary(group, pending: Optional[PendingTargetCheck], note: str,
                         host=None) -> None:
    """Every rank's ``pending`` summary in one exchange over the group's CPU companion ``host`` (the
    call's, else looked up here); the same error on every rank. Rows: sent, checksum, lo, hi, vocab
    size, ignore_index sent, ignore_index."""
    comm_dev = torch.device("cpu")
    if host is None:
        comm_dev = collective_device(group, torch.device("cuda") if torch.cuda.is_available()
                                     else torch.device("cpu"))
        host = host_group(group, comm_dev)
    summary = pending.read_summary() if pending is not None else None
    record = [0, 0, 0, -1, 0] if summary is None else [1, *summary, pending.vocab_size]
    world = dist.get_world_size(group)
    on = torch.device("cpu") if host is not None else comm_dev
    rows = all_gather_flat(torch.tensor(record, dtype=torch.long, device=on),
                           host if host is not None else group)
    rows = rows.view(world, 5).cpu().tolist()
    if not all(r[0] for r in rows):
        return
    checksums = [r[1] for r in rows]
    if len(set(checksums)) > 1:
        listing = ", ".join(f"rank {i}: #{c:x}" for i, c in enumerate(checksums))
        raise LinearLogpInputError("target_ids (they must be replicated: the same global ids on every rank) must be "
                                   f"the same on every TP rank, got {listing}{note}")
    problem = target_range_problem(TargetSummary(*rows[0][1:4]), rows[0][4], pending.ignore_index)
    if problem is not None:
        raise LinearLogpInputError(problem + note)


def _raise_pending_group_errors(group) -> None:
    """:func:`check_errors` with a group: every rank's pending summary in one exchange over the CPU
    group."""
    problem = _captured_problem(group_name(group)) if _captured else None
    _judge_group_summary(group, take_group_pending(group_name(group)), GROUP_NOTE)
    if problem is not None:  # targets are replicated: every rank read the same flags
        raise LinearLogpInputError(problem)


def check_errors(tp_group=None) -> None:
    """Raise now any error found by a deferred check (``TPLOGP_CHECKS=full``).

    Without ``tp_group``: the last call without a group, and the flags of calls captured in CUDA
    graphs (read after their last replay). Call it where a step ends to surface a bad batch before
    the next one; it waits only until the device has reached that check (the start of the call's
    forward), not for later queued work. With ``tp_group``: the last call with that group, the same
    error on every rank; a collective (every rank of the group calls it), over the group's CPU
    companion."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        raise_pending_errors()
    else:
        _raise_pending_group_errors(tp_group)


# ---- the backward of a call: its own verdict before any gradient ---------------------------------

class BackwardVerdict:
    """What the backward of one call (``full`` checks) settles before it writes a gradient.

    Outside a capture: the call's :class:`PendingTargetCheck`, read (its event has normally passed
    long before; with a group, exchanged over the CPU companion so that every rank raises the same
    error, before the ``d_hidden`` all-reduce). Under a capture: the call's
    :class:`CapturedTargetCheck`; the gradients are zeroed where its flag is set
    (:meth:`settle`). With a group it holds the group's name (``scope``) and its CPU companion
    (``host``, None: looked up when settled), so that settling costs the exchange alone."""

    __slots__ = ("pending", "captured", "group", "scope", "host")

    def __init__(self, pending: Optional[PendingTargetCheck] = None,
                 captured: Optional[CapturedTargetCheck] = None, group=None, scope: str = "",
                 host=None) -> None:
        self.pending, self.captured, self.group = pending, captured, group
        self.scope, self.host = scope, host

    def settle(self, grads: tuple = ()) -> tuple:
        """Settle the call's verdict before its gradients are handed to autograd (a bad target never
        updates weights).

        Args:
            grads: the call's gradients (None entries stay None); empty when settled before the
                work.
        Returns:
            ``grads``, zeroed where a captured call's flag is set (themselves outside a capture).
        Raises:
            LinearLogpInputError: the call's target check failed (the verdict is then dropped from
                what later calls judge).
        """
        pending = self.pending
        if pending is not None:
            if self.group is None:
                for i, unjudged in enumerate(_unjudged):
                    if unjudged is pending:
                        del _unjudged[i]  # judged here, once
                        break
                problem = pending.problem()
                if problem is not None:
                    raise LinearLogpInputError(problem + BACKWARD_NOTE)
            else:
                if _pending_by_group.get(self.scope) is pending:
                    del _pending_by_group[self.scope]
                _judge_group_summary(self.group, pending, BACKWARD_NOTE, self.host)
        if self.captured is None:
            return grads
        bad = self.captured.bad
        return tuple(None if g is None else g.masked_fill(bad.to(g.device), 0) for g in grads)


def latest_verdict(mode: str, group, device: torch.device) -> Optional[BackwardVerdict]:
    """The verdict of the last call, for a backward that cannot hold its forward's (the
    ``torch.library`` op of :mod:`tplogp.op.ops`, whose arguments are tensors and plain values).

    Args:
        mode: the layout's ``TPLOGP_CHECKS`` mode (only ``full`` defers a verdict).
        group: the call's TP group (None: without a group).
        device: the call's device (a capture there reads the captured flag).
    Returns:
        A :class:`BackwardVerdict`, or None when nothing is deferred.
    """
    if mode != "full":
        return None
    scope = group_name(group)
    if tensors.is_capturing(device):
        kept = _captured.get(scope)
        return BackwardVerdict(captured=kept[-1]) if kept else None
    if group is None or dist.get_world_size(group) == 1:
        return BackwardVerdict(pending=_unjudged[-1] if _unjudged else None)
    return BackwardVerdict(pending=_pending_by_group.get(scope), group=group, scope=scope)


# ---- the forward's entry -------------------------------------------------------------------------

def open_call(plan, args, problem: Optional[str],
              loss_check: Optional[LossCheck] = None,
              support_digest: int = -1) -> tuple[int, Optional[BackwardVerdict],
                                                               Optional[KernelTargetCheck],
                                                               Optional[list[tuple[int, int]]]]:
    """Open one call's verdict: judge what earlier calls left (those delivered), raise ``problem``
    (the call's :func:`tplogp.op.validation.local_problem`, None when fine or when the layout passed
    before) and start this call's target check.

    The target check reads tensor data, so it is started here on the device and read later, where a
    host wait costs nothing (the backward, a later call); with a group the record exchange makes
    every rank raise alike.

    Args:
        plan: the layout's :class:`tplogp.op.plan.CallPlan` (``mode``, ``world_size``,
            ``comm_device``, ``kernel_target_check``, ``vocab_size``: set for one shard, None for a
            group's first call).
        args: the call's :class:`tplogp.op.plan.CallArgs`.
        problem: the call's local problem, or None.
        loss_check: a fused-loss call's checks of its own arguments
            (:func:`tplogp.op.validation.check_loss`): its problem is the call's when the layout has
            none; with a group its digests travel in the record.
        support_digest: the fingerprint of the call's support
            (:class:`tplogp.op.support_ids.SupportData`), -1 without one; with a group it travels
            in the record and the ranks' must agree.
    Returns:
        ``(global vocab size, what the backward settles or None, the target check that the source's
        finishing kernel runs or None, every rank's shard range (start, end) from the group record,
        None without a group)``. A returned :class:`KernelTargetCheck` reaches the source
        (``forward_single``'s ``target_flag``) and its ``ready`` event is recorded right after that
        launch.
    """
    mode = plan.mode
    if problem is None and loss_check is not None:
        problem = loss_check.problem
    device = args.hidden.device if isinstance(args.hidden, torch.Tensor) else torch.device("cpu")
    capturing = tensors.is_capturing(device)
    if capturing and mode == "sync":
        raise LinearLogpInputError("TPLOGP_CHECKS=sync reads the targets on the host at the call, which a CUDA-graph "
                                   "capture cannot do: capture with the default checks (TPLOGP_CHECKS unset or full), "
                                   "which keep the verdict on the device, or with TPLOGP_CHECKS=fast")
    if plan.world_size > 1:
        total, verdict, ranges = _open_group_call(plan, args, problem, capturing, loss_check,
                                                  support_digest)
        return total, verdict, None, ranges
    if mode != "fast" and not capturing:
        # the deferred verdict of the previous call without a group
        raise_pending_errors(everything=False)
    if problem is not None:
        raise LinearLogpInputError(problem)
    total, target_ids, ignore_index = plan.vocab_size, args.target_ids, args.options.ignore_index
    verdict = in_kernel = None
    # a call that records no graph has no backward to carry its verdict: decided now (no capture)
    at_call = mode == "full" and not args.builds_graph and not capturing and target_ids.numel()
    if mode == "sync" or at_call:
        msg = target_range_problem(summarize_targets(target_ids, ignore_index),
                                   total, ignore_index)
        if msg is not None:
            raise LinearLogpInputError(msg + ("" if mode == "sync" else NO_GRAPH_NOTE))
    elif mode == "full" and target_ids.numel():
        if capturing:
            verdict = BackwardVerdict(captured=_capture_check("", target_ids, total, ignore_index))
        # read by this call's backward, else a later call (no host sync now); NaN logp meanwhile
        else:
            if plan.kernel_target_check:
                pending = in_kernel = start_kernel_target_check(device, total)
            else:
                pending = defer_target_range_check(target_ids, total, ignore_index)
            verdict = BackwardVerdict(pending=pending) if args.builds_graph else None
    return total, verdict, in_kernel, None


def _samples(options) -> bool:
    """Whether a call computes its support from the sampler's parameters
    (:func:`tplogp.op.sampler_params.given`, asked here: a plain call enters no room for it)."""
    return options.top_k is not None or options.top_p is not None or options.min_p is not None


def _open_group_call(plan, args, problem: Optional[str], capturing: bool,
                     loss_check: Optional[LossCheck],
                     support_digest: int = -1) -> tuple[int, Optional[BackwardVerdict],
                                                               list[tuple[int, int]]]:
    """:func:`open_call` with a group of several ranks (module docstring):
    ``(global vocab size, verdict, every rank's shard range)``."""
    mode, comm_dev, group = plan.mode, plan.comm_device, args.group
    scope = group.group_name  # (support.comm.group_name of a group)
    hidden, weight, target_ids, bias = args.hidden, args.weight, args.target_ids, args.bias
    ignore_index = args.options.ignore_index
    ok = problem is None
    builds_graph = bool(ok and args.builds_graph)
    # full checks exchange the record over a CPU group: nothing waits for the device; the targets'
    # summary travels one call later. sync (or no CPU group to be had): the device record, read
    # here.
    host = None
    if mode == "full":
        host = host_group(group, comm_dev) if not capturing else known_host_group(group, comm_dev)
        if capturing and host is None:
            raise LinearLogpInputError("the default checks of a linear_logp call with a TP group exchange their record "
                                       "over a CPU companion group, made by the group's first call, which cannot "
                                       f"run in a CUDA-graph capture: {CAPTURE_FIX}")
    elif mode == "fast" and capturing and not GroupRecord.is_verified(
            group, args.vocab_start_index, weight.shape[0], args.global_vocab_size,
            hidden.shape[-1], hidden.dtype, bias is not None, ignore_index, builds_graph,
            args.options.sequence_parallel, args.options.hidden_grad, loss_check,
            _samples(args.options)):
        raise LinearLogpInputError("TPLOGP_CHECKS=fast checks a layout with a TP group at its first call, which reads "
                                   "the group's verdict on the host and so cannot run in a CUDA-graph capture: run one "
                                   "call of this layout outside the capture first (a warm-up)")
    earlier = None
    if host is not None and not capturing:
        captured = _captured_problem(scope, first_read_only=True) if _captured else None
        # a local problem: shared with the others by the record exchange
        if captured is not None and ok:
            problem, ok = captured, False
        # the previous call's pending target check, judged by this one
        earlier = take_group_pending(scope)
        record_targets = None if earlier is None else tuple(earlier.read_summary())
    elif host is not None:
        # a capture reads nothing: earlier verdicts wait for a call outside it
        record_targets = None
    else:
        record_targets = (target_summary_tensor(target_ids, ignore_index, with_checksum=True)
                          if ok and mode != "fast" else None)
    total, summary, ranges = GroupRecord.exchange(
        host if host is not None else group, torch.device("cpu") if host is not None else comm_dev,
        problem, n_tokens=int(target_ids.numel()) if ok else -1,
        hidden_size=int(hidden.shape[-1]) if ok else -1,
        vocab_start_index=int(args.vocab_start_index) if ok else -1,
        v_local=int(weight.shape[0]) if ok else -1,
        global_vocab_size=args.global_vocab_size if ok else None,
        dtype=hidden.dtype if ok else torch.float32,
        has_bias=bias is not None,
        targets=record_targets,
        ignore_index=ignore_index,
        mode=mode,
        builds_graph=builds_graph,
        targets_note=GROUP_NOTE if host is not None else "",
        sequence_parallel=args.options.sequence_parallel,
        hidden_grad=args.options.hidden_grad,
        loss_check=loss_check,
        support_digest=support_digest,
        samples=_samples(args.options),
    )
    summary = None if summary is None else TargetSummary(*summary)
    verdict = None
    # the summary is the previous call's (replicated, per the checksums): its range now
    if host is not None:
        msg = None if summary is None else earlier.range_problem(summary)
        if msg is not None:
            raise LinearLogpInputError(msg + GROUP_NOTE)
        if capturing:
            verdict = BackwardVerdict(captured=_capture_check(scope, target_ids, total,
                                                              ignore_index))
        elif builds_graph:  # this call's targets: judged by its backward, else by the next call
            pending = defer_group_target_check(scope, target_ids, total, ignore_index)
            verdict = BackwardVerdict(pending=pending, group=group, scope=scope, host=host)
        else:  # no backward would carry the verdict: judged now, one more exchange (CPU group)
            own = _start(target_ids, total, ignore_index, with_checksum=True)
            _judge_group_summary(group, own, NO_GRAPH_NOTE, host)
    # sync: this call's own targets, identical on every rank (the checksums agree)
    elif summary is not None:
        msg = target_range_problem(summary, total, ignore_index)
        if msg is not None:
            raise LinearLogpInputError(msg)
    return total, verdict, ranges
