"""The upstream-scalar kernel of ``linear_logp_loss``'s backward: ``out = round(t * g)``.

The fused loss computes its gradients in the forward; its backward only multiplies them by the
upstream 0-d scalar ``g``. PyTorch runs ``t * g`` with a 0-d CUDA ``g`` as a broadcast (stride-0)
operand through its non-vectorized elementwise kernel, and into a second gradient-sized buffer. Here
one program owns ``BLOCK`` consecutive elements of the flat tensor, reads ``g`` once from its device
pointer (no host read: capturable in a CUDA graph), forms the product in fp32 and rounds it once to
the output's dtype as it stores it. The output may be ``t`` itself (in place: each program reads its
block before writing it) or a tensor of another dtype (an fp32 gradient rounded to 16 bits without
an fp32 transient). In place (``SKIP_AT_ONE``), a program whose ``g`` is exactly 1 neither reads nor
writes: ``round(t * 1)`` is ``t`` bit for bit, and ``loss.backward()`` hands ``g == 1``, so the
common backward moves no gradient bytes at all (decided on the device: no host read).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp32_ops import store_rounded


@triton.jit
def _scale_block(t_ptr, out_ptr, n, i_b, b_g, BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 SKIP_AT_ONE: tl.constexpr):
    """Block ``i_b`` of one flat tensor: ``out = round(t * g)`` (``SKIP_AT_ONE``: ``out`` is ``t``,
    left as it is when ``g == 1``)."""
    if SKIP_AT_ONE:
        if b_g != 1.0:
            _scale_elements(t_ptr, out_ptr, n, i_b, b_g, BLOCK, DOT_PRECISION)
    else:
        _scale_elements(t_ptr, out_ptr, n, i_b, b_g, BLOCK, DOT_PRECISION)


@triton.jit
def _scale_elements(t_ptr, out_ptr, n, i_b, b_g, BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``out = round(t * g)`` over block ``i_b``."""
    # [BLOCK]; int64: a [V, D] gradient passes 2**31 bytes
    o_e = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_e = o_e < n
    b_t = tl.load(t_ptr + o_e, mask=m_e).to(tl.float32)  # [BLOCK]
    # round to nearest even, also interpreted
    store_rounded(out_ptr + o_e, b_t * b_g, m_e, DOT_PRECISION)


@triton.jit
def scale_round_kernel(
    g_ptr,  # [] upstream scalar (fp32), read
    # the first tensor: [n0] to scale (fp32, bf16 or fp16), read; [n0] written (may be t0)
    t0_ptr, out0_ptr,
    t1_ptr, out1_ptr,  # the second
    t2_ptr, out2_ptr,  # the third
    n0, n1, n2,  # their element counts (0: no such tensor)
    BLOCK: tl.constexpr,
    P0: tl.constexpr,  # each output dtype's tiles.dot_precision: "upcast" under the CPU interpreter
    P1: tl.constexpr,
    P2: tl.constexpr,
    # each tensor's SKIP_AT_ONE: scaled in place (out is t), skipped when g == 1
    S0: tl.constexpr = False,
    S1: tl.constexpr = False,
    S2: tl.constexpr = False,
):
    """Up to three tensors in one launch (host time: one launch per backward): programs
    ``[0, cdiv(n0, BLOCK))`` scale the first, the next ``cdiv(n1, BLOCK)`` the second, the rest the
    third."""
    i_b = tl.program_id(0)
    b_g = tl.load(g_ptr).to(tl.float32)
    nb0 = tl.cdiv(n0, BLOCK)
    nb1 = tl.cdiv(n1, BLOCK)
    if i_b < nb0:
        _scale_block(t0_ptr, out0_ptr, n0, i_b, b_g, BLOCK, P0, S0)
    elif i_b < nb0 + nb1:
        _scale_block(t1_ptr, out1_ptr, n1, i_b - nb0, b_g, BLOCK, P1, S1)
    else:
        _scale_block(t2_ptr, out2_ptr, n2, i_b - nb0 - nb1, b_g, BLOCK, P2, S2)
