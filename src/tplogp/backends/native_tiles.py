"""The native source's shared tile arithmetic: one fp32 logits tile, row padding, and a backward
token chunk's per-token vectors.

* :func:`_logits_tile` is one GEMM with fp32 output (:mod:`tplogp.support.fp32_gemm`), the bias, the
  softcap ``cap(y) = softcap * tanh(y / softcap)`` and the temperature, in that order
  (:func:`logit_transform`, also on the (token, id) pairs' products of
  :mod:`tplogp.backends.support_pairs`): the target logit is read from the fp32 accumulator,
  never from a rounded logit.
* ``deterministic`` pads a token chunk to :data:`DETERMINISTIC_TOKEN_CHUNK` rows
  (:func:`_pad_rows`), so every GEMM has one shape whatever the batch; padded rows get ``p = 0``
  (``log S = inf``) and no target (-1).
* :func:`_token_chunk` gathers the per-token vectors every vocab tile (or grid block) of the
  backward reads, with the coefficient of ``p`` formed once:
  ``c0 = grad_logp - grad_lse - grad_entropy * mean_rel``.
* A backward tile's ``dz = d loss / d z``: :func:`_recomputed_dz` recomputes the logits and forms
  ``-p (c0 + grad_entropy (z - M))`` in their buffer; :func:`_finish_dz` adds what does not go
  through ``p`` (the target's ``grad_logp``, ``grad_sum_z``) and the chain rule's factors (the
  temperature, the softcap's slope), on recomputed and on kept tiles alike.
* :func:`call_logits_tile` and :func:`call_recomputed_dz` are the two first under a
  :class:`~tplogp.backends.base.ShardCall`'s logit transform, for the modules that pass the call.

Used by the tiled loops (:mod:`tplogp.backends.native`) and the tensor-parallel-invariant grid
(:mod:`tplogp.backends.native_grid`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..support import fp32_gemm
from ..support.masked_rows import floored

# Token chunk used by deterministic mode (independent of N by construction).
DETERMINISTIC_TOKEN_CHUNK = 256


def _logits_tile(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], inv_t: float,
                 out: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
                 slope: Optional[list] = None, tanh_max: Optional[list] = None) -> torch.Tensor:
    """``cap(h @ w^T + b) * inv_t`` in fp32, ``cap(y) = softcap * tanh(y / softcap)`` (identity
    without one). With a softcap, ``slope`` (a list) gets ``d cap / d y = 1 - tanh^2`` from the tanh
    itself appended, and ``tanh_max`` (a list) the rows' largest tanh."""
    if out is None:
        z = fp32_gemm.mm(h, w.t())
    else:
        z = out
        fp32_gemm.mm_into(z, h, w.t())
    return logit_transform(z, b, inv_t, softcap, slope, tanh_max)


def logit_transform(z: torch.Tensor, b: Optional[torch.Tensor], inv_t: float,
                    softcap: Optional[float], slope: Optional[list] = None,
                    tanh_max: Optional[list] = None) -> torch.Tensor:
    """The logit transform of :func:`_logits_tile` on the fp32 products ``z``, in place: the bias
    (broadcast over ``z``'s last dimension, or of ``z``'s shape), the softcap, the temperature."""
    if b is not None:
        z += b.float()
    if softcap is not None:
        z.div_(softcap).tanh_()
        if slope is not None:
            slope.append(z.square().neg_().add_(1.0))
        if tanh_max is not None:
            tanh_max.append(z.amax(1))
        return _capped(z, softcap, inv_t)
    if inv_t != 1.0:
        z *= inv_t
    return z


def call_logits_tile(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], call,
                     slope: Optional[list] = None,
                     tanh_max: Optional[list] = None) -> torch.Tensor:
    """:func:`_logits_tile` under the logit transform of ``call`` (a ShardCall)."""
    return _logits_tile(h, w, b, call.inv_temperature, softcap=call.softcap, slope=slope,
                        tanh_max=tanh_max)


def call_logit_transform(y: torch.Tensor, b: Optional[torch.Tensor], call,
                         slope: Optional[list] = None) -> torch.Tensor:
    """:func:`logit_transform` of ``call`` (a ShardCall) on the fp32 products ``y``."""
    return logit_transform(y, b, call.inv_temperature, call.softcap, slope)


def has_slope(call) -> bool:
    """Whether ``call``'s transform has a slope other than ``1 / T`` (a softcap): then kept terms
    are scaled by the running max of the tanh (:func:`kept_slope`), not of ``z``."""
    return call.softcap is not None


def kept_slope(log_terms: torch.Tensor, tanh_max: torch.Tensor,
               call) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d cap / d y, the kept scales as logits)`` of a kept tile of ``call`` (:func:`has_slope`).
    The slope ``(1 - t)(1 + t)`` with ``t = tanh(y / softcap) = t_m + log(e) / (softcap inv_t)``
    from the terms' logs (not modified) and the running max ``t_m`` of the tanh kept as their
    scale. Where the cap saturates, ``1 - t`` is a few ulp of 1: the max's own tanh (``e = 1``,
    ``t = t_m`` exactly) keeps them all, where ``z / (softcap inv_t)`` (two roundings after the
    tanh) is an ulp or two off, often past 1. ``t`` is clamped to ``[-1, 1]``: a term far below
    the max may step past -1. The scales as logits: ``_capped(t_m)``, bit for bit the forward's."""
    t = log_terms.mul(1.0 / (call.softcap * call.inv_temperature)).add_(tanh_max.unsqueeze(1))
    t.clamp_(-1.0, 1.0)
    slope = torch.sub(1.0, t).mul_(t.add_(1.0))
    return slope, _capped(tanh_max.clone(), call.softcap, call.inv_temperature)


def _capped(t: torch.Tensor, softcap: float, inv_t: float) -> torch.Tensor:
    """``z = softcap * t * inv_t`` from ``t = tanh(y / softcap)``, in place: the two roundings of
    every softcapped logit, so the running max of the tanh kept with softcapped terms gives the
    running max of ``z`` bit for bit."""
    t.mul_(softcap)
    if inv_t != 1.0:
        t *= inv_t
    return t


def _pad_rows(x: torch.Tensor, rows: int, value: float | int = 0) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    pad = x.new_full((rows - x.shape[0],) + tuple(x.shape[1:]), value)
    return torch.cat([x, pad], 0)


class _TokenChunk(NamedTuple):
    t0: int
    t1: int
    h: torch.Tensor  # [rows, D] hidden rows (padded in deterministic mode)
    m: torch.Tensor  # global row max M
    ls: torch.Tensor  # log S (inf on padded rows: p = 0)
    g: torch.Tensor  # grad_logp
    c0: torch.Tensor  # grad_logp - grad_lse - grad_entropy * mean_rel
    ge: Optional[torch.Tensor]  # grad_entropy
    lt: torch.Tensor  # local target (-1: not owned, and on padded rows)
    gsz: Optional[torch.Tensor] = None  # grad_sum_z (0 on padded rows), or None


def _token_chunk(hidden, row_max, log_sum, grad_logp, grad_entropy, grad_lse, mean_rel,
                 local_target, t0: int, t1: int, pad_to: Optional[int],
                 grad_sum_z=None) -> _TokenChunk:
    """The per-token vectors of rows ``[t0, t1)`` that every vocab tile of the backward reads
    (padded to ``pad_to`` rows in deterministic mode: padded rows get p = 0 and no target)."""
    rows = pad_to if pad_to is not None else t1 - t0
    h = _pad_rows(hidden[t0:t1], rows)
    g = _pad_rows(grad_logp[t0:t1], rows)
    # coefficient of p: grad_logp - grad_lse + grad_entropy * (z - mean_rel)
    c0 = g.clone()
    if grad_lse is not None:
        c0 -= _pad_rows(grad_lse[t0:t1], rows)
    ge = None
    if grad_entropy is not None:
        ge = _pad_rows(grad_entropy[t0:t1], rows)
        c0 -= ge * _pad_rows(mean_rel[t0:t1], rows)
    gsz = None if grad_sum_z is None else _pad_rows(grad_sum_z[t0:t1], rows)
    return _TokenChunk(t0, t1, h, _pad_rows(row_max[t0:t1], rows),
                       _pad_rows(log_sum[t0:t1], rows, float("inf")), g, c0, ge,
                       _pad_rows(local_target[t0:t1], rows, -1), gsz)


def _recomputed_dz(ch: _TokenChunk, w: torch.Tensor, b: Optional[torch.Tensor], inv_t: float,
                   softcap: Optional[float]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(-p (c0 + ge (z - M)), the softcap's slope or None)`` of the ``[rows, len(w)]`` tile of
    chunk ``ch``, recomputed (:func:`_logits_tile`). ``z - M`` is exact at the max, so ``1 - p``
    does not cancel at a peak; ``dz`` is built in the logits' buffer."""
    slopes: Optional[list] = [] if softcap is not None else None
    z = _logits_tile(ch.h, w, b, inv_t, softcap=softcap, slope=slopes)
    z -= ch.m.unsqueeze(1)
    if ch.ge is not None:
        p = torch.exp(z - ch.ls.unsqueeze(1))
        dz = floored(z).mul_(ch.ge.unsqueeze(1)).add_(ch.c0.unsqueeze(1)).mul_(p).neg_()
    else:  # -p * c0, all in place
        dz = z.sub_(ch.ls.unsqueeze(1)).exp_().mul_(ch.c0.unsqueeze(1)).neg_()
    return dz, (slopes[0] if slopes else None)


def call_recomputed_dz(ch: _TokenChunk, w: torch.Tensor, b: Optional[torch.Tensor],
                       call) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`_recomputed_dz` under the logit transform of ``call`` (a ShardCall)."""
    return _recomputed_dz(ch, w, b, call.inv_temperature, call.softcap)


def _finish_dz(dz: torch.Tensor, ch: _TokenChunk, v0: int, v1: int, inv_t: float,
               slope: Optional[torch.Tensor]) -> torch.Tensor:
    """``dz`` of the tile of columns ``[v0, v1)`` (its width may pad past ``v1``: those columns get
    0), in place: ``+ grad_logp`` at the owned target column (a scatter: no host sync),
    ``+ grad_sum_z``, then times the temperature's ``1 / T`` and the softcap's slope."""
    rel = ch.lt - v0
    own = (rel >= 0) & (rel < v1 - v0)
    dz.scatter_add_(1, rel.clamp(0, dz.shape[1] - 1).unsqueeze(1),
                    torch.where(own, ch.g, torch.zeros_like(ch.g)).unsqueeze(1))
    if ch.gsz is not None:  # d(sum_v z)/dz_v = 1
        dz += ch.gsz.unsqueeze(1)
    if v1 - v0 < dz.shape[1]:  # padding columns: no gradient anywhere
        dz[:, v1 - v0:] = 0.0
    if inv_t != 1.0:
        dz *= inv_t
    if slope is not None:
        dz *= slope
    return dz
