"""Eager references for a vocabulary masked by a ``-inf`` bias (docs/operator.md, "Masked vocabulary
and extreme values"), and the checks that compare the op against them.

:func:`masked_outputs` is eager PyTorch's ``log_softmax(cap(h W^T + b) / T)`` in float64 (the truth)
or as a PyTorch LM head in the inputs' dtype (the same-dtype reference), the ``-inf`` bias entries
added as constants, so autograd gives eager's finite gradients of a masked column (its target's
one-hot alone). Where eager has no value the rule of :mod:`tplogp.support.masked_rows` is written out
independently: an entropy term ``p z`` with ``p = 0`` is 0, and a row whose every column is masked
gets ``logp = lse = -inf``, entropy 0 and the gradient of its target's one-hot
(``d logp / d z_target = 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from tplogp.tolerances import rel_error, slack_bound

INF = float("inf")


@dataclass
class MaskedProblem:
    hidden: torch.Tensor  # [N, D]
    weight: torch.Tensor  # [V, D] (the full vocabulary)
    bias: torch.Tensor  # [V], -inf on the masked columns
    target: torch.Tensor  # [N] int64
    g_logp: torch.Tensor  # [N] fp32 upstream gradients
    g_entropy: torch.Tensor
    g_lse: torch.Tensor

    def to(self, device, dtype: torch.dtype = torch.float32) -> "MaskedProblem":
        """The problem on ``device`` with hidden, weight and bias in ``dtype`` (the mask stays)."""
        per_token = (self.target, self.g_logp, self.g_entropy, self.g_lse)
        return MaskedProblem(*(t.to(device, dtype) for t in (self.hidden, self.weight, self.bias)),
                             *(t.to(device) for t in per_token))


def make_masked(n: int, d: int, v: int, masked, targets, *, seed: int = 0,
                scale: float = 1.0) -> MaskedProblem:
    """A problem whose bias is ``-inf`` on the ids ``masked`` (an iterable, or a bool tensor
    ``[V]``) and whose rows have the ``targets`` given; ``scale`` multiplies the unmasked bias
    (1e4: logits of that size)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g)
    weight = torch.randn(v, d, generator=g) / d ** 0.5
    bias = torch.randn(v, generator=g) * scale
    if not isinstance(masked, torch.Tensor):
        ids = torch.tensor(list(masked), dtype=torch.long)
        masked = torch.zeros(v, dtype=torch.bool).index_fill_(0, ids, True)
    bias = bias.masked_fill(masked, -INF)
    target = torch.as_tensor(targets, dtype=torch.long)
    assert target.shape == (n,)
    gl, ge, gz = (torch.randn(n, generator=g) for _ in range(3))
    return MaskedProblem(hidden, weight, bias, target, gl, ge, gz)


@dataclass
class Outputs:
    logp: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor
    argmax: torch.Tensor
    d_hidden: torch.Tensor
    d_weight: torch.Tensor
    d_bias: torch.Tensor
    margin: Optional[torch.Tensor] = None  # (references) each row's two largest z's difference


def masked_outputs(p: MaskedProblem, dtype: torch.dtype, *, temperature: float = 1.0,
                   softcap: Optional[float] = None, loss: Optional[Callable] = None) -> Outputs:
    """Eager outputs and gradients on the CPU (module docstring) of ``loss(logp, entropy, lse)``
    (default: the problem's upstream gradients dotted with the three). ``dtype`` float64: everything
    in float64 (the truth); else ``F.linear`` in ``dtype`` (the problem's inputs rounded to it), the
    rest in fp32 (what a PyTorch LM head does)."""
    p = p.to("cpu", p.hidden.dtype)
    h = p.hidden.to(dtype, copy=True).requires_grad_()
    w = p.weight.to(dtype, copy=True).requires_grad_()
    masked = p.bias.isneginf()
    b = p.bias.masked_fill(masked, 0.0).to(dtype).requires_grad_()
    y_finite = F.linear(h, w, b)
    if dtype != torch.float64:
        y_finite, dtype = y_finite.float(), torch.float32
    mask = torch.zeros(masked.shape, dtype=dtype).masked_fill(masked, -INF)  # a constant
    y = y_finite + mask
    z = y if softcap is None else softcap * torch.tanh(y / softcap)
    z = z / temperature
    empty = z.isneginf().all(-1)  # every column masked (not with a softcap: -inf -> -softcap)
    full = (~empty).nonzero().squeeze(1)
    none = empty.nonzero().squeeze(1)
    n = z.shape[0]
    zf = z[full]
    log_probs = torch.log_softmax(zf, -1)
    lse_full = torch.logsumexp(zf, -1)
    probs = log_probs.exp()
    # p z = 0 where p = 0
    entropy_full = lse_full - (probs * torch.where(zf.isfinite(), zf, 0.0)).sum(-1)
    logp_full = log_probs.gather(1, p.target[full].unsqueeze(1)).squeeze(1)
    # an empty row: logp -inf whose gradient is the target's one-hot in z
    picked = y_finite[none].gather(1, p.target[none].unsqueeze(1)).squeeze(1) / temperature
    logp_none = (picked - picked.detach()) - INF
    logp = torch.zeros(n, dtype=dtype).index_put((full,), logp_full)
    logp = logp.index_put((none,), logp_none)
    entropy = torch.zeros(n, dtype=dtype).index_put((full,), entropy_full)
    lse = torch.full((n,), -INF, dtype=dtype).index_put((full,), lse_full)
    if loss is None:
        pairs = ((p.g_logp, logp), (p.g_entropy, entropy), (p.g_lse, lse))
        value = sum((g.to(dtype) * x).sum() for g, x in pairs)
    else:
        value = loss(logp, entropy, lse)
    value.backward()
    top2 = z.detach().topk(2, dim=-1).values
    return Outputs(logp.detach(), entropy.detach(), lse.detach(), z.detach().argmax(-1), h.grad,
                   w.grad, b.grad, top2[:, 0] - top2[:, 1])


def run_masked(op, p: MaskedProblem, weight=None, bias=None, **kwargs) -> Outputs:
    """``op`` (a ``linear_logp``) on the problem (or on the shard ``weight`` / ``bias`` given) with
    every output asked for, differentiated with the problem's upstream gradients."""
    h = p.hidden.detach().clone().requires_grad_()
    w = (p.weight if weight is None else weight).detach().clone().requires_grad_()
    b = (p.bias if bias is None else bias).detach().clone().requires_grad_()
    logp, entropy, lse, argmax = op(h, w, p.target, b, return_entropy=True, return_lse=True,
                                    return_argmax=True, **kwargs)
    ((logp * p.g_logp).sum() + (entropy * p.g_entropy).sum() + (lse * p.g_lse).sum()).backward()
    return Outputs(logp.detach(), entropy.detach(), lse.detach(), argmax, h.grad, w.grad, b.grad)


def masked_problems(name: str, ours: torch.Tensor, reference: torch.Tensor, truth: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> list[str]:
    """What is wrong with ``ours``: a NaN, infinities other than the truth's (same sign, same
    place), or finite values whose error against the float64 truth is past the three-way rule's
    bound (tplogp.tolerances) beside the same-dtype reference's error."""
    ours = ours.detach().cpu().double()
    if ours.isnan().any():
        return [f"{name}: NaN at {ours.isnan().nonzero().flatten().tolist()}"]
    same_inf = (torch.equal(ours.isposinf(), truth.isposinf())
                and torch.equal(ours.isneginf(), truth.isneginf()))
    if not same_inf:
        return [f"{name}: infinities {ours.tolist()} where the truth has {truth.tolist()}"]
    finite = truth.isfinite()
    e_ours = rel_error(ours[finite], truth[finite])
    e_ref = rel_error(reference[finite], truth[finite])
    bound = slack_bound(e_ref, dtype)
    if e_ours <= bound:
        return []
    return [f"{name}: error vs float64 {e_ours:.3e} > bound {bound:.3e}"]


def compare(ours: Outputs, reference: Outputs, truth: Outputs, rows: slice = slice(None),
            dtype: torch.dtype = torch.float32, tie: float = 0.0) -> list[str]:
    """Every output and gradient of ``ours`` (inputs in ``dtype``) against the references
    (``rows``: this shard's slice of d_W and d_b) and the argmax exactly, on the rows whose two
    largest logits are more than ``tie`` apart in the truth (a GPU's fp32 sum may order nearer ones
    either way); the problems found."""
    found = []
    for name in ("logp", "entropy", "lse", "d_hidden"):
        found += masked_problems(name, getattr(ours, name), getattr(reference, name),
                                 getattr(truth, name), dtype)
    for name in ("d_weight", "d_bias"):
        found += masked_problems(name, getattr(ours, name), getattr(reference, name)[rows],
                                 getattr(truth, name)[rows], dtype)
    clear = ~(truth.margin <= tie)  # (an empty row's margin is NaN: -inf - -inf)
    got, want = ours.argmax.cpu()[clear], truth.argmax[clear]
    if not torch.equal(got, want):
        found.append(f"argmax {got.tolist()} != {want.tolist()}")
    return found
