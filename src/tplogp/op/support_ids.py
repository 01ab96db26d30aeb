"""The sampler's support of a call (``support=``): its two forms made one, its checks and the ids
each shard owns.

A support is, per token ``t``, the set ``S_t`` of GLOBAL vocabulary ids that the sampler kept; the
op then renormalizes over ``S_t`` (docs/operator.md, "Sampler's support"). Two forms are taken:

* padded: an integer tensor of shape ``target_ids.shape + (K,)``, ``-1`` for "none", in any order;
* CSR: a pair ``(offsets, ids)`` over the flattened tokens, ``offsets`` an integer ``[N + 1]``
  tensor from 0 to ``len(ids)``, nondecreasing, ``ids`` a 1-D integer tensor.

:func:`form_problem` checks the form without reading tensor data. :func:`padded` turns either form
into the padded int64 ``[N, K]`` the call path carries (CSR: one host read of the offsets' summary,
then one scatter) and :func:`data_problem` reads the data once (one host read of a few numbers) to
name the first problem: an id outside ``[0, vocab)`` (``-1`` pads the padded form; ``vocab`` when
the call knows it), an id twice in one token's support, a token whose target is not in its support
(a token whose target is ``ignore_index`` needs no support: its row is not read). With a group
every rank runs the same checks on the same (replicated) support, and a problem travels in the
group record (:mod:`tplogp.op.verdicts`), so every rank raises it before any collective of the
call's work. :func:`local_ids` gives the ids a shard owns, shard-local, ``-1`` elsewhere.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from ..support.tensors import KEEP_ALL

Support = Union[torch.Tensor, tuple]  # padded, or (offsets, ids)


def _int_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and not (t.dtype.is_floating_point or t.dtype.is_complex
                                                or t.dtype == torch.bool)


def form_problem(support, target_ids: torch.Tensor) -> Optional[str]:
    """The support's form against ``target_ids`` (no data read): a message, or None when it is
    one of the two forms of the module docstring, on the targets' device."""
    shape = tuple(target_ids.shape)
    if isinstance(support, torch.Tensor):
        if (not _int_tensor(support) or support.dim() != len(shape) + 1
                or tuple(support.shape[:-1]) != shape):
            return (f"support must be an integer tensor of shape target_ids.shape + (K,) = "
                    f"{shape + ('K',)} (-1 for none), or a CSR pair (offsets [N + 1], ids); got "
                    f"{support.dtype} of shape {tuple(support.shape)}")
        tensors = (support,)
    elif isinstance(support, (tuple, list)) and len(support) == 2:
        offsets, ids = support
        n = target_ids.numel()
        if not (_int_tensor(offsets) and offsets.dim() == 1 and offsets.numel() == n + 1):
            got = (f"{offsets.dtype} of shape {tuple(offsets.shape)}"
                   if isinstance(offsets, torch.Tensor) else type(offsets).__name__)
            return (f"support's CSR offsets must be a 1-D integer tensor of N + 1 = {n + 1} "
                    f"values (the flattened tokens'), got {got}")
        if not (_int_tensor(ids) and ids.dim() == 1):
            got = (f"{ids.dtype} of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor)
                   else type(ids).__name__)
            return f"support's CSR ids must be a 1-D integer tensor, got {got}"
        tensors = (offsets, ids)
    else:
        return (f"support must be an integer tensor of shape target_ids.shape + (K,) or a pair "
                f"(offsets, ids), got {type(support).__name__}")
    if any(t.device != target_ids.device for t in tensors):
        return (f"support must be on target_ids' device ({target_ids.device}), got "
                f"{', '.join(str(t.device) for t in tensors)}")
    return None


def padded(support: Support, n: int) -> tuple[Optional[torch.Tensor], Optional[str]]:
    """``(the padded int64 [n, K] support, None)``, or ``(None, problem)`` for CSR offsets that are
    not nondecreasing from 0 to ``len(ids)``. A form that passed :func:`form_problem`."""
    if isinstance(support, torch.Tensor):
        return support.reshape(n, support.shape[-1]).long(), None
    offsets, ids = support[0].long(), support[1].long()
    lengths = offsets[1:] - offsets[:-1]
    bad = (offsets[0] != 0) | (offsets[-1] != ids.numel())
    if n:
        bad = bad | (lengths < 0).any()
    negative = (ids < 0).any() if ids.numel() else bad & False
    width, bad, negative = torch.stack([lengths.max() if n else offsets[0] * 0, bad.long(),
                                        negative.long()]).tolist()
    if bad:
        shown = offsets[:8].tolist()
        return None, (f"support's CSR offsets must be nondecreasing from 0 to len(ids) = "
                      f"{ids.numel()}, got {shown}{'...' if offsets.numel() > 8 else ''}")
    if negative:
        at = int((ids < 0).long().argmax())
        return None, (f"support ids must be global vocabulary ids, at least 0: the CSR ids hold "
                      f"{int(ids[at])} at position {at}")
    out = torch.full((n, max(width, 0)), -1, dtype=torch.int64, device=ids.device)
    if ids.numel():
        row = torch.repeat_interleave(torch.arange(n, device=ids.device), lengths)
        out[row, torch.arange(ids.numel(), device=ids.device) - offsets[row]] = ids
    return out, None


class SupportData(NamedTuple):
    """What :func:`data_problem` read: the first problem or None, the largest id, and a fingerprint
    of the kept sets (each token's ids in sorted order, padding and ignored tokens left out), equal
    on ranks given the same supports in any order within a token."""

    problem: Optional[str]
    largest: int
    fingerprint: int


def data_problem(ids: torch.Tensor, target_ids: torch.Tensor, ignore_index: Optional[int],
                 vocab: Optional[int]) -> SupportData:
    """The first problem of the padded support ``ids`` [N, K] (module docstring), its largest id and
    its fingerprint, in one host read. ``vocab``: the global vocabulary when the call knows it (else
    the caller checks the largest id against it later)."""
    n = ids.shape[0]
    if n == 0 or ids.shape[1] == 0:
        tgt = target_ids.reshape(-1)
        if n and (ignore_index is None or bool((tgt != ignore_index).any())):
            t = 0 if ignore_index is None else int((tgt != ignore_index).int().argmax())
            return SupportData(_missing(t, int(tgt[t])), -1, 0)
        return SupportData(None, -1, 0)
    tgt = target_ids.reshape(-1).long()
    ignored = torch.zeros(n, dtype=torch.bool, device=ids.device) if ignore_index is None \
        else tgt == ignore_index
    rows = torch.where(ignored.unsqueeze(1), -1, ids)
    below = (rows < -1).any(1) & ~ignored
    past = ((rows >= vocab).any(1) if vocab is not None else torch.zeros_like(ignored)) & ~ignored
    ordered = rows.sort(1).values
    twice = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(1)
    missing = ~(rows == tgt.unsqueeze(1)).any(1) & ~ignored
    flags = torch.stack([m.any().long() for m in (below, past, twice, missing)]
                        + [m.long().argmax() for m in (below, past, twice, missing)]
                        + [rows.max(), _fingerprint(ordered)])
    (b, p, w, m, tb, tp, tw, tm, hi, digest) = flags.tolist()
    span = f"[0, {vocab})" if vocab is not None else "[0, the global vocabulary)"
    if b or p:
        t = tb if b else tp
        row = ids[t]
        bad = int(row[(row < -1) | (row >= (vocab if vocab is not None else 2 ** 62))][0])
        return SupportData(f"support ids must be global vocabulary ids in {span} (-1 pads a row): "
                           f"token {t} holds {bad}", hi, digest)
    if w:
        row = ordered[tw]
        same = int(row[1:][(row[1:] == row[:-1]) & (row[1:] >= 0)][0])
        return SupportData(f"support must hold each kept id once per token: token {tw} holds id "
                           f"{same} more than once", hi, digest)
    if m:
        return SupportData(_missing(tm, int(tgt[tm])), hi, digest)
    return SupportData(None, hi, digest)


def _fingerprint(ordered: torch.Tensor) -> torch.Tensor:
    """A 61-bit fingerprint of the sorted rows ``ordered`` [N, K] (``-1`` for none): a position- and
    token-weighted sum of the ids modulo a prime, on the device."""
    prime = 1_000_003
    n, k = ordered.shape
    token = torch.arange(1, n + 1, device=ordered.device, dtype=torch.long).unsqueeze(1)
    slot = torch.arange(1, k + 1, device=ordered.device, dtype=torch.long)
    weights = (token * 7919 + slot) % prime
    return (((ordered + 1) % prime) * weights).sum() % (1 << 61)


def _missing(t: int, target: int) -> str:
    return (f"support must contain each token's target (a token whose target is ignore_index "
            f"needs none): token {t}'s target {target} is not in its support")


def past_vocab_problem(largest: int, vocab: int) -> Optional[str]:
    """The range check of a call that learned its global vocabulary from the group record."""
    if largest >= vocab:
        return (f"support ids must be global vocabulary ids in [0, {vocab}): the support holds "
                f"{largest}")
    return None


def local_ids(ids: torch.Tensor, start: int, v_local: int) -> torch.Tensor:
    """The ids of ``[start, start + v_local)`` shard-local, ``-1`` elsewhere (and for padding);
    ``KEEP_ALL`` stays."""
    rel = ids - start if start else ids
    return torch.where((ids >= 0) & (rel >= 0) & (rel < v_local), rel,
                       torch.where(ids == KEEP_ALL, KEEP_ALL, -1))


__all__ = ["Support", "SupportData", "KEEP_ALL", "form_problem", "padded", "data_problem",
           "past_vocab_problem",
           "local_ids"]
