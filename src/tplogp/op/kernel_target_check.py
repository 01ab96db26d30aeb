"""The target check that a source's finishing kernel runs for a call without a group
(``forward_single`` with ``target_flag``, the triton / sm90 sources): the kernel writes an id
outside ``[0, vocab)``, if there is one, straight into a host slot, so the check costs no launch and
no copy of its own. Slots are pinned on a GPU (the kernel writes them directly), taken round-robin
and reused only once read, so a verdict read later (by the backward of one of many accumulated
forwards) is still its own call's. :mod:`tplogp.op.verdicts` decides when it is read.
"""

from __future__ import annotations

from typing import Optional

import torch

from .target_summary import TargetSummary, target_range_problem


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
