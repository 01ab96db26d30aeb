"""The (token, id) pairs' ``d_W`` rows on a GPU (:mod:`tplogp.backends.support_pairs`): each id's
row ``sum over its pairs of dz * h[token]``, from the pairs sorted by id.

:func:`pair_rows_kernel`: one program owns one id's run of pairs and ``BLOCK_D`` columns of ``D``.
It walks its run (``run_starts[u] .. run_starts[u + 1]``), reads each pair's fp32 ``dz`` and its
token's hidden row's columns, and adds their product in fp32 registers; then writes the row once,
rounded to the output's dtype, or adds it to an fp32 accumulator row (each row is one program's:
no atomics; a run whose row lies past the output, the padding's, writes nothing). It reads each
pair's hidden row once and writes each kept row once: about ``P D`` input bytes and ``U D``
output bytes (``P`` pairs, ``U`` ids), where a GEMM over the union's columns does ``2 N U D``
flops and zeroes an ``[N, U]`` matrix.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp32_ops import store_rounded


@triton.jit
def pair_rows_kernel(
    run_starts_ptr,  # [U + 1] int64: each id's first pair in the sorted pairs, then P
    rows_ptr,  # [U] int64: the output row of each id (at least n_rows: none, the padding's)
    tokens_ptr,  # [P] int64: each pair's token
    dz_ptr,  # [P] fp32: each pair's dz
    h_ptr,  # [N, D] hidden states (bf16, fp16 or fp32), row stride stride_h
    out_ptr,  # [*, D] output rows (the weight's dtype) or fp32 accumulator rows, stride stride_o
    d, stride_h, stride_o, n_rows,
    BLOCK_D: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # add to out (fp32) instead of writing it
    DOT_PRECISION: tl.constexpr,  # tiles.dot_precision of out's dtype (its interpreted rounding)
):
    u = tl.program_id(0)
    row = tl.load(rows_ptr + u)
    if row < n_rows:
        o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        m_d = o_d < d
        start = tl.load(run_starts_ptr + u)
        end = tl.load(run_starts_ptr + u + 1)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for p in range(start, end):
            token = tl.load(tokens_ptr + p)
            g = tl.load(dz_ptr + p)  # (fp32: products and sums in fp32)
            b_h = tl.load(h_ptr + token * stride_h + o_d, mask=m_d, other=0.0)
            acc += g * b_h.to(tl.float32)
        at = out_ptr + row * stride_o + o_d
        if ACCUMULATE:
            tl.store(at, tl.load(at, mask=m_d) + acc, mask=m_d)
        else:
            store_rounded(at, acc, m_d, DOT_PRECISION)  # (round to nearest even, also interpreted)
