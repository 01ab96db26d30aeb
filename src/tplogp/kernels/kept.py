"""Layout of what the forward keeps for the backward: the softmax terms of the shard's first columns
and their per-tile scales (torch only: no Triton import).

Per kept element the softmax term ``e = exp(z - m)`` in the inputs' dtype (:func:`kept_dtype`), with
``m`` the row's running max (natural units; with a tanh in the logit transform that of the tanh,
from which the backward rebuilds both ``m`` and the transform's slope at a saturated max) when the
forward folded that element's tile, one fp32 scale per (row, forward tile). The backward's
``p = e * exp(m - M - log S)`` then carries e's rounding alone (2^-9 relative in bf16,
2^-12 in fp16: what the d_logits rounding adds anyway), whatever the logits' size; rounding the
logits themselves would give p an error of ``|z| 2^-9``. Layout: the values ``[N, cols]`` in their
dtype and the scales ``[N, cdiv(cols, block_v)]`` fp32. For the op, one flat fp32 buffer (what its
fake implementation allocates, :func:`kept_views`): the values padded to 16 bytes, the scales after
them. On the eager paths two allocations of those shapes (``ShardCall.scales_apart``: a consuming
backward frees the scales early). :func:`kept_words` counts the flat buffer's words, an upper bound
of the two allocations. How many columns a call keeps is :mod:`.workspace`'s decision.
"""

from __future__ import annotations

from typing import Optional

import torch

from .tiles import cdiv

# the narrowest forward tile a fitted GPU config runs: scales counted for it when planning
PLANNING_BLOCK_V = 64
# without the device (at most 4/64 bytes per element more than the device's config needs)


def kept_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the kept softmax terms for inputs of ``dtype``: the inputs' own (bf16, fp16 or
    fp32).

    A term carries the rounding that ``d_logits`` gets in that dtype anyway (bf16 terms for fp16
    inputs doubled the gradients' error against the fp16 reference:
    tests/kernels/test_triton_kernels.py). bf16 has fp32's exponent range. ``e = exp(z - m) <= 1``,
    so fp16 never overflows; a term below fp16's smallest subnormal (2^-24) is stored as 0, and as
    ``p <= e`` that moves its ``d_logits = g (onehot - p)`` by at most ``|g| 2^-24``."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


def kept_words(n: int, cols: int, itemsize: int, block_v: int) -> tuple[int, int]:
    """``(words of the values incl. padding, words of the scales)`` (4-byte words) of ``cols`` kept
    columns."""
    values = cdiv(cdiv(n * cols * itemsize, 4), 4) * 4
    return values, n * cdiv(cols, block_v)


def kept_bytes(n: int, cols: int, itemsize: int, block_v: int) -> int:
    """Bytes of the kept buffer for ``cols`` columns of ``n`` rows (``itemsize``: of
    :func:`kept_dtype`)."""
    if n == 0 or cols == 0:
        return 0
    return 4 * sum(kept_words(n, cols, itemsize, block_v))



def kept_scales_shape(n: int, scale_words: int) -> tuple[int, int]:
    """``[n, scales per row]`` of :func:`kept_words`' ``scale_words``."""
    return n, scale_words // max(n, 1)


def kept_views(kept: torch.Tensor, n: int, cols: int, dtype: torch.dtype,
               block_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [n, cols] of dtype, scales [n, cdiv(cols, block_v)] fp32)``: views into the flat
    fp32 buffer."""
    values, scales = kept_words(n, cols, dtype.itemsize, block_v)
    shape = kept_scales_shape(n, scales)
    # strided views of the buffer, as few view ops as can be (host time: each costs microseconds)
    return ((kept if dtype == kept.dtype else kept.view(dtype)).as_strided((n, cols), (cols, 1)),
            kept.as_strided(shape, (shape[1], 1), kept.storage_offset() + values))



class KeptTerms:
    """What the forward keeps for the backward (views into the flat buffer, :func:`kept_views`, or
    its two allocations): ``values [N, v_keep]`` the softmax terms ``exp(z - m)`` (in
    :func:`kept_dtype`) and ``scales [N, cdiv(v_keep, block_v)]`` fp32, the running max ``m``
    (natural units) per row and forward tile. Unpacks as ``values, scales``. The backward drops the
    scales (:meth:`release_scales`) once its last d_logits pass that reads them is launched: when
    nothing else holds them (their own allocation, a consuming backward) they are freed before the
    d_hidden / d_W outputs are allocated."""

    __slots__ = ("values", "scales")

    def __init__(self, values: torch.Tensor, scales: Optional[torch.Tensor]) -> None:
        self.values = values
        self.scales = scales

    def __iter__(self):
        return iter((self.values, self.scales))

    def release_scales(self) -> None:
        self.scales = None
