"""The suite's bounds that are not the three-way rule, in one table beside :mod:`tplogp.tolerances` (whose
``ERROR_SLACK`` bounds every check against a same-dtype reference).

``REL_*`` bound a relative norm (:func:`tplogp.tolerances.rel_error`), ``ABS_*`` a largest absolute difference, and
the :class:`~tplogp.tolerances.Tolerance` entries are ``allclose`` bounds (``|x - ref| <= atol + rtol * |ref|``).
Each comment says what differs between the two sides, which is why the bound holds.
"""

from __future__ import annotations

import torch

from tplogp.tolerances import Tolerance

# fp32 results against float64 formulas of the same inputs: fp32 products accumulated in fp32, in another order
REL_FP32_ACCUMULATION = 2e-6
# two fp32 computations of the same math on one source (another chunking; the fast-mode single shard)
REL_FP32_SAME_MATH = 1e-6
# 16-bit gradients against float64 GEMMs of the d_logits rounded once to the weight dtype: rare rounding flips
REL_16BIT_ROUNDING_FLIPS = 5e-4
# a bf16 d_hidden against exact float64 truth: the d_logits' bf16 rounding
REL_BF16_VS_TRUTH = 1e-2
# a 16-bit d_bias against float64: fp32 sums rounded once to the bias dtype
REL_16BIT_ONE_ROUNDING = 4e-3
# bf16 softmax terms exp(z - m) of a kept tile against float64: bf16 rounding (and the fp32 summation order)
REL_BF16_KEPT_TERMS = 2 ** -8
# logp of peaked rows (logp ~ 0, so the gradient g (1 - p) cancels) against float64 truth: relative per dtype, or
# absolute (where logp ~ 0 leaves a relative error meaningless)
REL_PEAKED_LOGP = {torch.float32: 1e-5, torch.bfloat16: 0.05}
ABS_PEAKED_LOGP = 1e-4
# fp32 logp through a whole model (the integrations' benchmark rows) against the float64 model
ABS_FP32_MODEL_LOGP = 1e-4
# fp32 logp of a bf16 model's hidden states and head against a float64 head on the same bf16
# values (fp32 GEMM accumulation and softmax, logp ~ -4: measured 3e-7 on the TRL tests' tiny
# Qwen2, where TRL's bf16 logits give 6e-4)
ABS_FP32_HEAD_LOGP = 1e-5

# the native source with other tile sizes: only the reduction order changes
CHUNKING_LOGP = Tolerance(atol=2e-6, rtol=1e-6)
CHUNKING_GRADS = Tolerance(atol=1e-6, rtol=1e-5)
# strided inputs against their contiguous copies (other GEMM kernels)
STRIDED_INPUTS = Tolerance(atol=1e-6, rtol=0)
# inductor's generated code around the op against eager
INDUCTOR = Tolerance(atol=1e-6, rtol=1e-5)
# autocast's fp32 logp of bf16-rounded inputs against float64 truth of the same rounded inputs
AUTOCAST_LOGP = Tolerance(atol=1e-4, rtol=0)
# logp and entropy of exactly uniform rows against -log V and log V
UNIFORM_ROWS = Tolerance(atol=1e-5, rtol=1e-6)
# float64 closed forms of a loss against the loss's own float64 value
FLOAT64_FORMULA = Tolerance(atol=0, rtol=1e-15)
# the GRPO family's fp32 loss and gradients against its float64 definition: fp32 logp (its error ~1e-7) through
# exp of ratios and of sequence sums, and the float64 reference's own GEMMs
REL_FP32_GRPO = 1e-5
# its loss value: that bound, or absolute where the loss is a sum of tiny terms (a k3 KL of log-probs 0.01 apart is
# d^2 / 2 ~ 5e-5 per token, and fp32 logp's absolute error ~1e-7 moves it by ~2e-5 of itself)
GRPO_LOSS = Tolerance(atol=1e-9, rtol=REL_FP32_GRPO)
# its metrics (means of fp32 ratios, KL and entropy; fractions of counted positions) against float64, absolute
# (relative above 1)
ABS_FP32_GRPO_METRIC = 1e-5
