"""fp32 elementwise primitives of the kernels, and the forms they take where PTX runs: the
exponential (one MUFU ``ex2.approx.ftz``), a logarithm of 16-bit inputs' precision (one MUFU
``lg2.approx.ftz``), a tanh of two MUFU operations, a multiply that is never fused into an FMA
(:func:`mul_rounded`), and the rounding of an fp32 tile into a 16-bit store (round-to-nearest-even,
as a GPU's conversion). Under Triton's CPU interpreter, which runs no PTX, each has a plain form of
the same contract. Which form a kernel gets is a constexpr read once, when this module is imported
(:data:`PTX`)."""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import interpreting

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


def ptx_runs() -> bool:
    """Whether the kernels may use inline PTX (``ex2.approx.ftz.f32``, ``mul.rn.f32``): CUDA builds
    of torch, not Triton's CPU interpreter (which runs no PTX) and not ROCm. Read once, when this
    module is imported."""
    import torch

    return not interpreting() and torch.version.hip is None


# inline PTX on CUDA builds (not under the CPU interpreter, not on ROCm): see exp2 and mul_rounded.
PTX = tl.constexpr(ptx_runs())


@triton.jit
def mul_rounded(a, b, PTX: tl.constexpr):
    """``a * b`` rounded to fp32 before any later use: PTX's ``mul.rn.f32``, which the code
    generator never fuses into an FMA with a following add, where PTX runs (:data:`PTX`); a plain
    multiply elsewhere (the CPU interpreter rounds every operation). ``fl(z / T) - M`` is then
    exactly 0 where ``z`` is the row max (``M`` is that same rounded product), where an FMA would
    leave the product's rounding error: 1 - p at a peaked row would be that error instead of ~0."""
    if PTX:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def tanh(x, PTX: tl.constexpr):
    """``tanh(x)`` in fp32 as ``sign(x) (1 - 2 / (1 + 2^(2 |x| log2 e)))``: seven instructions, two
    of them MUFU (``ex2.approx.ftz``, ``rcp.approx.ftz``), where PTX runs (:data:`PTX`); the same
    formula in plain operations under the CPU interpreter. Its error is the rounding of ``1 - 2r``
    next to 1: within two ulp of 1 absolute, and two ulp relative once ``|tanh| >= 0.5``, for the
    plain form (tests/kernels/test_fp32_ops.py); the PTX form's approximate ``ex2`` and ``rcp`` are
    checked only through the op's errors on a GPU. Saturates to exactly +-1 where
    ``2^(2|x| log2 e)`` overflows. Why not libdevice's ``tanhf`` (a few ulp everywhere): its
    polynomial branch and its exponential branch, both evaluated per element, cost about 20
    instructions per logit in each pass that computes logits, which a call with a tanh in its logit
    transform pays on top of the softmax's own few."""
    if PTX:
        return tl.inline_asm_elementwise(
            """{
            .reg .f32 a, e, r;
            abs.f32 a, $1;
            mul.f32 a, a, 0f4038AA3B;
            ex2.approx.ftz.f32 e, a;
            add.f32 e, e, 0f3F800000;
            rcp.approx.ftz.f32 r, e;
            fma.rn.f32 r, r, 0fC0000000, 0f3F800000;
            copysign.f32 $0, $1, r;
            }""", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        e = tl.exp2(tl.abs(x) * 2.8853900817779268)  # exp(2 |x|), inf past about 44
        t = 1.0 - 2.0 / (1.0 + e)
        return tl.where(x < 0, -t, t)


@triton.jit
def store_rounded(p_out, x, mask, DOT_PRECISION: tl.constexpr):
    """Store fp32 ``x`` in the pointer's dtype with round-to-nearest-even. Under Triton's CPU
    interpreter (DOT_PRECISION "upcast") the fp32 -> bf16 cast truncates, so the rounding is done on
    the bits first."""
    if DOT_PRECISION == "upcast" and p_out.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    tl.store(p_out, x.to(p_out.dtype.element_ty), mask=mask)


@triton.jit
def exp2(x, FAST: tl.constexpr):
    """``2 ** x`` in fp32. FAST: PTX ``ex2.approx.ftz.f32``, one MUFU instruction (results below
    2^-126 flush to 0: such a term is below 2^-126 of the row max's and changes no sum). Otherwise
    ``tl.exp2``, whose non-ftz form ptxas wraps in a denormal-range fix-up (about five instructions
    per element on sm_90)."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def log2(x, FAST: tl.constexpr):
    """``log2(x)`` in fp32 of a positive normal ``x``. FAST: PTX ``lg2.approx.ftz.f32``, one MUFU
    instruction (absolute error below 2^-22 on [0.5, 2], relative below 2^-22 elsewhere, and exact 0
    at 1 by a select): for values read back from 16 bits, whose own rounding (up to 2^-9 relative in
    bf16, so up to about 2^-8.5 absolute in log2) is over ten thousand times larger. Otherwise
    ``tl.log2`` (libdevice's, accurate to an ulp: a polynomial of about 25 instructions per element
    on sm_90)."""
    if FAST:
        y = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
        return tl.where(x == 1.0, 0.0, y)
    else:
        return tl.log2(x)
