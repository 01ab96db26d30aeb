"""Masked columns and empty rows: the arithmetic that keeps a ``-inf`` logit (a column masked by a
``-inf`` bias) as eager PyTorch has it, shared by every finishing path (torch only; the Triton
kernels do the same in their own code).

* A masked column has ``p = exp(z - M) = 0``: it adds nothing to ``S``, to the entropy or to any
  gradient but its own target's one-hot (a masked target: ``logp = -inf``, ``dz = g`` at that
  column, finite, as eager).
* Where a row's running max is still ``-inf`` (every column so far masked: a tile, a split, a
  shard), the online rescale subtracts :func:`rescale_max` (a finite value there) instead, so
  ``exp(-inf - -inf)`` never forms a NaN.
* The entropy's terms ``p (z - M)`` read ``z - M`` floored at :data:`RELATIVE_FLOOR`
  (:func:`floored`): below it ``p`` is 0 in fp32 anyway, so no value changes, but ``0 * -inf`` is
  never formed (one max per element, only where entropy is asked for). NaN stays NaN.
* A row whose every column is masked (``S = 0``) is empty (:func:`settle_rows`): ``lse = -inf``,
  ``logp = -inf``, entropy 0, argmax the lowest id, and the backward sees a finite ``M`` (the most
  negative fp32), ``log S = 0``, ``E_p[z] - M = 0``, so every ``p`` is 0 and its gradient is the
  target's one-hot alone. (Eager PyTorch gives NaN logp and entropy there.)
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

# z - M below this has p = exp(z - M - log S) = 0 in fp32 (log S >= 0; exp underflows below -104)
RELATIVE_FLOOR = -1024.0


# the most negative finite fp32: what an empty row's max becomes where it is subtracted
_LOWEST = torch.finfo(torch.float32).min


def rescale_max(row_max: torch.Tensor) -> torch.Tensor:
    """The max an online softmax subtracts: ``row_max``, the most negative finite fp32 where it is
    ``-inf`` (every column so far masked; NaN stays NaN), one operation. Such a row's logits are all
    ``-inf``, so ``z - rescale_max(M)`` is ``-inf`` and ``exp(M_old - rescale_max(M))`` is 0 there,
    as with any finite value subtracted; never ``-inf - -inf``."""
    return row_max.clamp_min(_LOWEST)


def floored(relative: torch.Tensor) -> torch.Tensor:
    """``z - M`` floored at :data:`RELATIVE_FLOOR`, in place (NaN stays NaN): what the entropy's
    terms multiply."""
    return relative.clamp_min_(RELATIVE_FLOOR)


class RowNormalizer(NamedTuple):
    """A row's softmax normalizer as the outputs and the backward read it (all fp32 ``[N]``)."""

    row_max: torch.Tensor  # M (the most negative fp32 on empty rows)
    log_sum: torch.Tensor  # log S (0 on empty rows)
    lse: torch.Tensor  # M + log S (-inf on empty rows)
    mean_rel: Optional[torch.Tensor]  # E_p[z] - M (0 on empty rows), with entropy


def settle_rows(row_max: torch.Tensor, total: torch.Tensor, sez: Optional[torch.Tensor], *,
                subtracted: Optional[torch.Tensor] = None) -> RowNormalizer:
    """The normalizer of rows with max ``row_max``, ``total = S = sum exp(z - M)`` and ``sez = sum
    exp(z - M)(z - M)`` (or None), empty rows (``S = 0``) settled by the module's rule; pass
    ``subtracted`` (``rescale_max(row_max)``) when the caller has it. ``logp = (z_t - M) - log S``
    with the settled ``M`` and ``log S`` is then ``-inf`` on empty rows, and ``entropy = log S -
    mean_rel`` is 0 there.

    In three ops: a non-empty row has ``S >= 1`` (its max's own term is ``exp(0) = 1`` and a sum of
    non-negative terms never rounds below one of them), so ``log S`` floored at 0 changes only the
    empty rows (``log 0 = -inf``); ``lse = M + log 0 = -inf`` there with ``M`` finite or not."""
    m = rescale_max(row_max) if subtracted is None else subtracted
    log_sum = torch.log(total)
    lse = m + log_sum  # -inf on empty rows
    mean_rel = None if sez is None else sez / total.clamp_min(1.0)
    return RowNormalizer(m, log_sum.clamp_min_(0.0), lse, mean_rel)
