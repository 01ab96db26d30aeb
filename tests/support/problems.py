"""Random LM-head problems for the tests: inputs, per-token upstream gradients, and float64 / same-dtype truths."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

from tplogp.reference import reference_outputs


@dataclass
class Problem:
    hidden: torch.Tensor  # [*, D] in dtype
    weight: torch.Tensor  # [V, D] (the full vocabulary)
    bias: Optional[torch.Tensor]
    target: torch.Tensor  # [*] int64
    g_logp: torch.Tensor  # [*] fp32 upstream gradient per token
    g_entropy: torch.Tensor
    g_lse: torch.Tensor


def make_problem(lead_shape, d: int, v: int, dtype: torch.dtype, bias: bool, *, seed: int = 0,
                 peaked: bool = False, flat: bool = False, ignore_index: Optional[int] = None,
                 ignore_fraction: float = 0.0) -> Problem:
    """``peaked``: a third of the rows put almost all mass on their target; ``flat``: a third have ~uniform rows."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in lead_shape:
        n *= s
    hidden = torch.randn(n, d, generator=g) * 0.5
    weight = torch.randn(v, d, generator=g) / d ** 0.5
    b = torch.randn(v, generator=g) * 0.1 if bias else None
    target = torch.randint(0, v, (n,), generator=g)
    if peaked:
        rows = torch.arange(0, n, 3)
        hidden[rows] = weight[target[rows]] * (40.0 / weight[target[rows]].norm(dim=1, keepdim=True))
    if flat:
        rows = torch.arange(1, n, 3)
        hidden[rows] = 1e-3 * torch.randn(len(rows), d, generator=g)
    if ignore_index is not None and ignore_fraction > 0:
        drop = torch.rand(n, generator=g) < ignore_fraction
        target = torch.where(drop, torch.full_like(target, ignore_index), target)
    gl, ge, gz = (torch.randn(n, generator=g) for _ in range(3))
    return Problem(
        hidden.to(dtype).reshape(*lead_shape, d), weight.to(dtype), None if b is None else b.to(dtype),
        target.reshape(lead_shape), gl.reshape(lead_shape), ge.reshape(lead_shape), gz.reshape(lead_shape),
    )


def problem_on(p: Problem, device) -> Problem:
    """``p`` with every tensor moved to ``device``."""
    return replace(p, **{f.name: None if getattr(p, f.name) is None else getattr(p, f.name).to(device)
                         for f in fields(p)})


@dataclass
class Result:
    logp: torch.Tensor
    entropy: Optional[torch.Tensor]
    lse: Optional[torch.Tensor]
    d_hidden: torch.Tensor
    d_weight: torch.Tensor
    d_bias: Optional[torch.Tensor]


def run_reference(p: Problem, mode: str, *, temperature=1.0, ignore_index=None, entropy=False, lse=False,
                  softcap=None) -> Result:
    """The materialized reference (``mode`` float64 = truth, matching = same-dtype PyTorch) with its gradients."""
    dt = torch.float64 if mode == "float64" else None
    h = (p.hidden.to(dt) if dt else p.hidden).clone().requires_grad_()
    w = (p.weight.to(dt) if dt else p.weight).clone().requires_grad_()
    b = None if p.bias is None else (p.bias.to(dt) if dt else p.bias).clone().requires_grad_()
    out = reference_outputs(h, w, p.target, b, mode=mode, temperature=temperature, ignore_index=ignore_index,
                            softcap=softcap)
    lse_out = out.lse
    if ignore_index is not None:
        lse_out = torch.where(p.target != ignore_index, lse_out, torch.zeros_like(lse_out))
    loss = (out.logp * p.g_logp.to(out.logp.dtype)).sum()
    if entropy:
        loss = loss + (out.entropy * p.g_entropy.to(out.logp.dtype)).sum()
    if lse:
        loss = loss + (lse_out * p.g_lse.to(out.logp.dtype)).sum()
    loss.backward()
    return Result(out.logp.detach(), out.entropy.detach() if entropy else None, lse_out.detach() if lse else None,
                  h.grad, w.grad, None if b is None else b.grad)


def run_op(op, p: Problem, *, entropy=False, lse=False, **kwargs) -> Result:
    h = p.hidden.clone().requires_grad_()
    w = p.weight.clone().requires_grad_()
    b = None if p.bias is None else p.bias.clone().requires_grad_()
    out = op(h, w, p.target, b, return_entropy=entropy, return_lse=lse, **kwargs)
    if entropy and lse:
        logp, ent, lse_out = out
    elif entropy:
        (logp, ent), lse_out = out, None
    elif lse:
        (logp, lse_out), ent = out, None
    else:
        logp, ent, lse_out = out, None, None
    loss = (logp * p.g_logp).sum()
    if ent is not None:
        loss = loss + (ent * p.g_entropy).sum()
    if lse_out is not None:
        loss = loss + (lse_out * p.g_lse).sum()
    loss.backward()
    return Result(logp.detach(), None if ent is None else ent.detach(), None if lse_out is None else lse_out.detach(),
                  h.grad, w.grad, None if b is None else b.grad)


def float64_stats(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], target: torch.Tensor,
                  inv_t: float) -> dict:
    """The per-shard softmax statistics of the backend contract in float64 for logits ``z = (h w^T + b) inv_t``:
    see :func:`float64_logit_stats`."""
    z = h.double() @ w.double().T
    if b is not None:
        z = z + b.double()
    return float64_logit_stats(z * inv_t, target)


def float64_logit_stats(z: torch.Tensor, target: torch.Tensor) -> dict:
    """Statistics of logits ``z [N, V]`` in float64: ``z``, row max ``row_max``, ``sum_exp = sum exp(z - max)``,
    ``target_logit = z[target]`` (0 where the target is not in ``[0, V)``) and ``sum_exp_z = sum exp(z - max)(z -
    max)``."""
    z = z.double()
    m = z.max(1).values
    e = (z - m[:, None]).exp()
    own = (target >= 0) & (target < z.shape[1])
    t = torch.where(own, z.gather(1, target.clamp(0, z.shape[1] - 1)[:, None])[:, 0], torch.zeros_like(m))
    return dict(z=z, row_max=m, sum_exp=e.sum(1), target_logit=t, sum_exp_z=(e * (z - m[:, None])).sum(1))


def cpu_sources(slow_triton: bool = False) -> list:
    """``native`` and ``triton`` as pytest parameters for tests of CPU behaviour: triton skipped unless it runs
    here (Triton's interpreter, ``TRITON_INTERPRET=1`` as the project's conftest sets it without a GPU), and marked
    ``slow`` with ``slow_triton`` (left out of the inner loop)."""
    import pytest

    from tplogp.backends.kernel_registry import unavailable_reason

    here = unavailable_reason("triton", torch.device("cpu")) is None
    marks = [pytest.mark.skipif(not here, reason="needs triton (interpreter)")]
    if slow_triton:
        marks.append(pytest.mark.slow)
    return ["native", pytest.param("triton", marks=marks)]
