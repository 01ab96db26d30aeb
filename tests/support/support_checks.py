"""The three-way check of a call renormalized over a sampler's support: its logp, entropy, lse and
gradients against the float64 definition (``tplogp.testing.reference.reference_support_outputs``)
within the fp32 reference's error, for the tests of ``support=`` and of the sampler's parameters."""

from __future__ import annotations

import torch

from tplogp.testing.reference import reference_support_outputs
from tplogp.tolerances import assert_no_worse


def grads_of(outputs, leaves, weights):
    """The gradients of ``sum(g_logp logp + g_entropy entropy + g_lse lse)`` for the leaves."""
    total = sum((o.to(weights[0].dtype) * w).sum() for o, w in zip(outputs, weights))
    return torch.autograd.grad(total, [x for x in leaves if x is not None])


def compare(ours, leaves, problem, target, support, upstream, keep, rows=slice(None),
            dtype: torch.dtype = torch.float32, **kw) -> list[str]:
    """What differs (empty when nothing does): ``ours`` (the op's outputs of ``leaves``, the
    ``(hidden, weight, bias)`` given to it) against the definition on ``problem`` ``(hidden, weight,
    bias)`` with ``target`` and the padded ``support``, under the upstream gradients ``upstream``
    (three float64 tensors of the targets' shape) times ``keep`` (the tokens that count; an ignored
    token's lse is not compared). ``rows``: this rank's rows of d_W and d_b; ``dtype``: the
    call's (a 16-bit call: ``problem`` holds its values, the reference runs in it, and its
    tolerances apply); ``kw``: the call's options (temperature, softcap and ignore_index reach the
    definition)."""
    ref_kw = {k: v for k, v in kw.items() if k in ("temperature", "softcap", "ignore_index")}
    keep = keep.float()
    results = {}
    for ref_dtype in (torch.float64, dtype):
        h, w, b = (t.to(ref_dtype).clone().requires_grad_() for t in problem)
        mode = ("float64" if ref_dtype == torch.float64 else
                "fp32" if ref_dtype == torch.float32 else "matching")
        out = reference_support_outputs(h, w, target, support, b, **ref_kw, mode=mode)
        outs = (out.logp, out.entropy, out.lse * keep.to(ref_dtype))
        wide = torch.float64 if ref_dtype == torch.float64 else torch.float32
        results[ref_dtype] = ([o.detach().to(wide) for o in outs],
                              [x.to(wide) for x in grads_of(outs, (h, w, b),
                                                            [u.to(ref_dtype) * keep.to(ref_dtype)
                                                             for u in upstream])])
    (truth, t_grads), (ref, r_grads) = results[torch.float64], results[dtype]
    mine = [ours.logp, ours.entropy, ours.lse * keep]
    my_grads = [x.float() for x in grads_of(mine, leaves, [u.float() * keep for u in upstream])]
    found = []
    for name, a, r, t in zip(("logp", "entropy", "lse"), mine, ref, truth):
        try:
            assert_no_worse(name, a.detach().float(), r, t, dtype)
        except AssertionError as exc:
            found.append(str(exc))
    for name, a, r, t in zip(("d_hidden", "d_weight", "d_bias"), my_grads, r_grads, t_grads):
        if name != "d_hidden":
            r, t = r[rows], t[rows]
        try:
            assert_no_worse(name, a, r, t, dtype)
        except AssertionError as exc:
            found.append(str(exc))
    return found
