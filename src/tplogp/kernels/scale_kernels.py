"""The upstream-scalar kernel of ``linear_logp_loss``'s backward: ``out = round(t * g)``.

The fused loss computes its gradients in the forward; its backward only multiplies them by the upstream 0-d scalar
``g``. PyTorch runs ``t * g`` with a 0-d CUDA ``g`` as a broadcast (stride-0) operand through its non-vectorized
elementwise kernel, and into a second gradient-sized buffer. Here one program owns ``BLOCK`` consecutive elements of
the flat tensor, reads ``g`` once from its device pointer (no host read: capturable in a CUDA graph), forms the
product in fp32 and rounds it once to the output's dtype as it stores it. The output may be ``t`` itself (in place:
each program reads its block before writing it) or a tensor of another dtype (an fp32 gradient rounded to 16 bits
without an fp32 transient).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import store_rounded


@triton.jit
def scale_round_kernel(
    t_ptr,  # [n] gradient to scale (fp32, bf16 or fp16), read
    out_ptr,  # [n] scaled gradient (fp32, bf16 or fp16), written; may be t_ptr
    g_ptr,  # [] upstream scalar (fp32), read
    n,  # elements
    BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # the output dtype's (tiles.dot_precision): "upcast" under the CPU interpreter
):
    i_b = tl.program_id(0)
    o_e = i_b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]; int64: a [V, D] gradient passes 2**31 bytes
    m_e = o_e < n
    b_g = tl.load(g_ptr).to(tl.float32)
    b_t = tl.load(t_ptr + o_e, mask=m_e).to(tl.float32)  # [BLOCK]
    store_rounded(out_ptr + o_e, b_t * b_g, m_e, DOT_PRECISION)  # round to nearest even, also interpreted
