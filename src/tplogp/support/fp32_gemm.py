"""GEMMs that accumulate in fp32 and write fp32, for any input dtype, shared by the sources.

On CUDA, low-precision operands go straight into one cuBLAS call with ``out_dtype=torch.float32``
(fp32 accumulation, fp32 output, nothing rounded to the input dtype); torch versions without that
argument (it is probed once per device type) and the CPU, where low-precision GEMMs have no
fp32-output path, upcast the operands instead.
"""

from __future__ import annotations

import torch

_OUT_DTYPE_OK: dict[str, bool] = {}
_BMM_OUT_DTYPE_OK: dict[str, bool] = {}


def _native_f32_out(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a @ b`` can run on the inputs' dtype with an fp32 output (low-precision CUDA
    operands)."""
    if a.device.type != "cuda":
        return False
    ok = _OUT_DTYPE_OK.get(a.device.type)
    if ok is None:
        try:
            torch.mm(a[:1], b[:, :1], out_dtype=torch.float32)
            ok = True
        except (TypeError, RuntimeError, NotImplementedError):
            ok = False
        _OUT_DTYPE_OK[a.device.type] = ok
    return ok


def _operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(a, b, extra torch.mm kwargs)`` for an fp32-accumulating, fp32-output GEMM of ``a`` and
    ``b``."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a, b, {}
    if _native_f32_out(a, b):
        return a, b, {"out_dtype": torch.float32}
    return a.float(), b.float(), {}


def _bmm_out_dtype(a: torch.Tensor) -> bool:
    """Whether batched products of low-precision CUDA operands like ``a`` have an fp32 output in
    torch (probed once per device type, on one element)."""
    ok = _BMM_OUT_DTYPE_OK.get(a.device.type)
    if ok is None:
        one = a.new_zeros(1, 1, 1)
        try:
            torch.bmm(one, one, out_dtype=torch.float32)
            ok = True
        except (TypeError, RuntimeError, NotImplementedError):
            ok = False
        _BMM_OUT_DTYPE_OK[a.device.type] = ok
    return ok


def bmm_keeps_dtype(a: torch.Tensor) -> bool:
    """Whether :func:`bmm` takes operands like ``a`` as they are (fp32, or low-precision CUDA
    operands with an fp32 output), rather than upcast copies."""
    return a.dtype == torch.float32 or (a.device.type == "cuda" and _bmm_out_dtype(a))


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` batched (``[B, n, k] @ [B, k, m]``) as a new fp32 tensor: low-precision CUDA
    operands in one cuBLAS call with an fp32 output where torch has it, else upcast."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.device.type == "cuda" and _bmm_out_dtype(a):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as a new fp32 tensor."""
    a, b, kw = _operands(a, b)
    return torch.mm(a, b, **kw)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b`` into an fp32 tensor."""
    a, b, kw = _operands(a, b)
    torch.mm(a, b, out=out, **kw)


def addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into an fp32 accumulator (one GEMM call)."""
    a, b, kw = _operands(a, b)
    torch.addmm(acc, a, b, out=acc, **kw)
