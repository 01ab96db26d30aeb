"""The ``native`` source on one tile: a call whose logits fit one ``[N, V]`` tile of the tile budget
and that keeps nothing for the backward (small shapes; :func:`tplogp.backends.native._one_tile`
decides).

The same arithmetic, in the same order, as the tiled loops of :mod:`tplogp.backends.native` with a
single tile, in fewer ops: what costs host time at small shapes (the tiled loops' token-chunk
vectors and zero-initialised accumulators fall away). Forward: ``z`` (fp32, under the logit
transform), its max ``M``, ``z - M`` in place, the target's ``z - M``, ``S = sum exp(z - M)`` (and
``q = sum exp(z - M) (z - M)`` for entropy), ``logp = (z_t - M) - log S``. Backward:
``dz = onehot g - p (g - g_lse + g_ent (z - M - mean_rel))`` (``+ g_sum_z``), times ``1 / T`` and
the logit transform's slope, then ``d_hidden = dz W`` and ``d_W = dz^T h`` with fp32 accumulation.
"""

from __future__ import annotations

import torch

from ..support import fp32_gemm
from ..support.masked_rows import floored, rescale_max, settle_rows
from .base import ShardCall, ShardGrads, SingleShardOutputs
from .native_tiles import call_logits_tile


def forward_one_tile(hidden, weight, bias, target, call: ShardCall) -> SingleShardOutputs:
    """:meth:`NativeBackend.forward_single <tplogp.backends.native.NativeBackend.forward_single>` on
    one tile."""
    v = weight.shape[0]
    z = call_logits_tile(hidden, weight, bias, call)
    sum_z = z.sum(1) if call.with_sum_z else None
    argmax = z.argmax(1).to(torch.float32) if call.with_argmax else None
    m = rescale_max(z.amax(1))
    z -= m.unsqueeze(1)  # z - M (an empty row's -inf stays -inf)
    column = target.clamp(0, v - 1)
    nobodys = column != target  # ids outside [0, V): owned by nobody (NaN logp)
    target_rel = z.gather(1, column.unsqueeze(1)).squeeze(1)
    if call.with_entropy:
        e = torch.exp(z)
        sum_exp, q = e.sum(1), floored(z).mul_(e).sum(1)
    else:
        sum_exp, q = z.exp_().sum(1), None
    m, log_sum, lse, mean_rel = settle_rows(m, sum_exp, q, subtracted=m)
    logp = (target_rel - log_sum).masked_fill_(nobodys, float("nan"))
    entropy = None if q is None else log_sum - mean_rel
    return SingleShardOutputs(logp, lse, m, log_sum, mean_rel, entropy, None, sum_z, argmax)


def backward_one_tile(hidden, weight, bias, target, row_max, log_sum, grad_logp, grad_entropy,
                      grad_lse, mean_rel,
                       call: ShardCall, needs: tuple[bool, bool, bool], d_hidden_ready=None,
                       grad_sum_z=None) -> ShardGrads:
    """:meth:`NativeBackend.backward <tplogp.backends.native.NativeBackend.backward>` on one
    tile."""
    need_h, need_w, need_b = needs
    v = weight.shape[0]
    gemm_dtype = weight.dtype if hidden.device.type == "cuda" else torch.float32
    # coefficient of p: grad_logp - grad_lse + grad_entropy * (z - mean_rel) (never modified)
    c0 = grad_logp
    if grad_lse is not None:
        c0 = c0 - grad_lse
    slopes: list = []  # the transform's slope, where it has one
    z = call_logits_tile(hidden, weight, bias, call, slope=slopes)
    slope = slopes[0] if slopes else None
    z -= row_max.unsqueeze(1)
    if grad_entropy is not None:
        c0 = c0 - grad_entropy * mean_rel
        p = torch.exp(z - log_sum.unsqueeze(1))
        dz = floored(z).mul_(grad_entropy.unsqueeze(1)).add_(c0.unsqueeze(1)).mul_(p).neg_()
    else:
        dz = z.sub_(log_sum.unsqueeze(1)).exp_().mul_(c0.unsqueeze(1)).neg_()
    column = target.clamp(0, v - 1)
    # + grad_logp at the target column; nothing for ids outside [0, V) (nobody's)
    dz.scatter_add_(1, column.unsqueeze(1), grad_logp.masked_fill(column != target, 0).unsqueeze(1))
    if grad_sum_z is not None:  # d(sum_v z)/dz_v = 1
        dz += grad_sum_z.unsqueeze(1)
    if call.inv_temperature != 1.0:
        dz *= call.inv_temperature
    if slope is not None:
        dz *= slope
    d_bias = None
    if need_b and bias is not None:
        d_bias = dz.sum(0)
        d_bias = d_bias if bias.dtype == torch.float32 else d_bias.to(bias.dtype)
    dz_g = dz if dz.dtype == gemm_dtype else dz.to(gemm_dtype)
    d_hidden = None
    if need_h:
        d_hidden = fp32_gemm.mm(dz_g,
                                weight if weight.dtype == gemm_dtype else weight.to(gemm_dtype))
        if d_hidden_ready is not None:
            d_hidden_ready(d_hidden)
    d_weight = None
    if need_w:
        d_weight = fp32_gemm.mm(dz_g.t(),
                                hidden if hidden.dtype == gemm_dtype else hidden.to(gemm_dtype))
        d_weight = d_weight if weight.dtype == torch.float32 else d_weight.to(weight.dtype)
    return ShardGrads(d_hidden, d_weight, d_bias)
