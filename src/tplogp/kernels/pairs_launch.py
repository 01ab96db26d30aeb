"""The pairs' ``d_W`` launch (:mod:`.pairs_kernels`): :func:`pair_rows`. Its
:class:`~.launch.Launch` is made once per sizes, strides and mode (:func:`~.launch.cached`)."""

from __future__ import annotations

import torch

from .entry_checks import KernelInputError
from .launch import Launch, cached
from .pairs_kernels import pair_rows_kernel
from .tiles import KERNEL_DTYPES, cdiv, dot_precision

PAIR_BLOCK_D, PAIR_WARPS = 512, 4


def _launch(ids: int, d: int, stride_h: int, stride_o: int, n_rows: int, accumulate: bool,
            out_dtype: torch.dtype) -> Launch:
    return Launch(pair_rows_kernel, (ids, cdiv(d, PAIR_BLOCK_D)), (d, stride_h, stride_o, n_rows),
                  PAIR_WARPS, None, dict(BLOCK_D=PAIR_BLOCK_D, ACCUMULATE=accumulate,
                                         DOT_PRECISION=dot_precision(out_dtype)))


def pair_rows(run_starts: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
              dz: torch.Tensor, hidden: torch.Tensor, out: torch.Tensor,
              accumulate: bool) -> None:
    """``out[rows[u]] (+)= sum_{p in run u} dz[p] hidden[tokens[p]]`` (fp32) for every run ``u``
    of the pairs sorted by id whose row lies in ``out`` (``run_starts``: int64 ``[U + 1]``, ``rows``
    int64 ``[U]``,
    ``tokens`` int64 and ``dz`` fp32 ``[P]``): written in ``out``'s dtype, or added to the fp32
    ``out`` (``accumulate``). ``hidden`` and ``out`` have unit column stride."""
    if hidden.dtype not in KERNEL_DTYPES or hidden.stride(1) != 1 or out.stride(1) != 1 or (
            accumulate and out.dtype != torch.float32):
        raise KernelInputError(f"pair_rows takes unit-column-stride hidden of {KERNEL_DTYPES} and "
                               f"out rows (fp32 to accumulate), got {hidden.dtype} "
                               f"{hidden.stride()} and {out.dtype} {out.stride()}")
    u, d = rows.numel(), hidden.shape[1]
    if u == 0 or d == 0:
        return
    launch = cached(_launch, u, d, hidden.stride(0), out.stride(0), out.shape[0], accumulate,
                    out.dtype)
    launch(run_starts, rows, tokens, dz, hidden, out)


__all__ = ["pair_rows", "PAIR_BLOCK_D"]
