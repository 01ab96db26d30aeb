"""Option variants of the op benchmark: what an option of tplogp costs against the same call without
it, in one run.

``--variants`` lists variants, comma-separated; one variant is one option or several joined by
``+``:

* ``softcap=C``: final-logit softcapping ``C tanh(z / C)`` (Gemma 2 / 3 use 30);
* ``deterministic=true`` / ``deterministic=tp_invariant``: the two levels of ``deterministic``;
* ``label_smoothing=E``, ``z_loss=K``: the fused cross-entropy becomes
  ``losses.cross_entropy(label_smoothing=E)`` (plus ``losses.z_loss(K)``); these apply to the plain
  fused cross-entropy rows only (``tplogp-loss-<source>``);
* ``support=K<k>-shared`` / ``support=K<k>-disjoint``: the sampler's support, ``k`` ids per token
  holding its target, shared within a sequence or disjoint across tokens
  (:mod:`benchmarks.supports`), built once per shape; the row's ``support_union`` / ``support_k``
  are the union size of the supports and their width. Every source runs it (the triton and sm90
  kernels through the support's bitmask). It composes with ``softcap`` and ``deterministic=true``;
  with ``deterministic=tp_invariant`` the native source runs it; the op refuses label smoothing,
  and so does the parser;
* ``top_k=K``, ``top_p=P``, ``min_p=M`` (e.g. ``top_k=50+top_p=0.9``): the sampler's parameters,
  the support computed inside the call (one more pass over the vocabulary), then run as a support.
  Its rows are timed only (``errors`` names why: the benchmark's random targets mostly fall outside
  such a support, where logp is ``-inf``; tests/op/test_sampler_support.py checks the values). Not
  with ``support=``, label smoothing or ``deterministic=tp_invariant``;
* ``logit_std=S`` (with ``top_k`` / ``top_p`` / ``min_p`` only): the row's hidden states scaled so
  the logits' standard deviation is ``S``. The problem's own is about 0.5, every token nearly
  uniform over the vocabulary, so that a top-p set holds most of it; an LLM's logits spread
  wider. The sampler rows report the mean and the largest support size over the first tokens
  (``support_mean``, ``support_max``: ``tplogp.testing.reference.sampler_mask`` on their rows).

For example
``softcap=30,deterministic=true,deterministic=tp_invariant,label_smoothing=0.1+z_loss=1e-4,
support=K64-shared``. Every
tplogp row the run measures (per source, budget and checks mode) that a variant applies to gets one
more row with the options added: its budget label ends with the variant's label, its ``variant``
field is that label, its errors are measured against the float64 truth of its own math (softcap and
the loss terms change it, a support renormalizes it over the support's ids; the deterministic levels
do not), and ``vs_plain`` (``_b2b``) is its
forward+backward time over the plain row's, timed in the same rounds (:mod:`benchmarks.op`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .impls import SCALAR_LOSS, Impl

DETERMINISTIC = {"true": True, "tp_invariant": "tp_invariant"}
SUPPORT = re.compile(r"K([1-9][0-9]*)-(shared|disjoint)", re.IGNORECASE)


@dataclass(frozen=True)
class Variant:
    """One ``--variants`` entry: the options it adds to a call, and its label (the canonical
    spelling)."""

    label: str
    softcap: Optional[float] = None
    deterministic: Union[bool, str] = False
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    support: Optional[str] = None  # ``K<k>-<kind>``: the support the call passes (module docstring)
    top_k: Optional[int] = None  # the sampler's parameters (module docstring)
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    logit_std: Optional[float] = None  # the spread the row's logits are scaled to

    @property
    def samples(self) -> bool:
        """Whether the call computes its support from the sampler's parameters."""
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    @property
    def support_k(self) -> int:
        """The support's ids per token (before clipping to the vocabulary)."""
        return int(SUPPORT.fullmatch(self.support).group(1))

    @property
    def support_kind(self) -> str:
        """``shared`` or ``disjoint`` (:mod:`benchmarks.supports`)."""
        return SUPPORT.fullmatch(self.support).group(2).lower()

    @property
    def loss_terms(self) -> bool:
        """Whether the variant changes the fused cross-entropy's loss."""
        return self.label_smoothing != 0.0 or self.z_loss != 0.0

    def applies_to(self, impl: Impl) -> bool:
        """tplogp's budgeted rows; a variant with loss terms, its plain fused cross-entropy rows
        only."""
        if not impl.budgeted or impl.source is None:
            return False
        return impl.contract == SCALAR_LOSS if self.loss_terms else True

    def call_options(self) -> dict:
        """The ``linear_logp`` / ``linear_logp_loss`` keywords of the variant's options other than
        the loss's and the support (a tensor of the problem, passed by the builders)."""
        options: dict = {}
        if self.softcap is not None:
            options["softcap"] = self.softcap
        if self.deterministic is not False:
            options["deterministic"] = self.deterministic
        for name in ("top_k", "top_p", "min_p"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        return options


def _number(key: str, text: str, low: float, low_open: bool, high: float = math.inf) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
        bound = (f"{'>' if low_open else '>='} {low:g}"
                 + (f" and <= {high:g}" if math.isfinite(high) else ""))
        raise ValueError(f"--variants: {key} takes a finite number {bound}, got {text!r}")
    return value


def parse_variant(text: str) -> Variant:
    """``softcap=30``, ``deterministic=tp_invariant``, ``label_smoothing=0.1+z_loss=1e-4``, ...
    (module docstring)."""
    fields: dict = {}
    labels = []
    for item in text.split("+"):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not value:
            raise ValueError(f"--variants: an option is key=value, got {item.strip()!r} in "
                             f"{text!r}")
        if key in fields:
            raise ValueError(f"--variants: {key} given twice in {text!r}")
        if key == "softcap":
            fields[key] = _number(key, value, 0.0, True)
            labels.append(f"softcap={fields[key]:g}")
        elif key == "deterministic":
            if value.lower() not in DETERMINISTIC:
                raise ValueError(f"--variants: deterministic takes {' or '.join(DETERMINISTIC)}, "
                                 f"got {value!r}")
            fields[key] = DETERMINISTIC[value.lower()]
            labels.append(f"deterministic={value.lower()}")
        elif key == "label_smoothing":
            fields[key] = _number(key, value, 0.0, True, 1.0)
            labels.append(f"label_smoothing={fields[key]:g}")
        elif key == "z_loss":
            fields[key] = _number(key, value, 0.0, True)
            labels.append(f"z_loss={fields[key]:g}")
        elif key == "support":
            match = SUPPORT.fullmatch(value)
            if match is None:
                raise ValueError(f"--variants: support takes K<ids per token>-shared or "
                                 f"K<ids per token>-disjoint (e.g. K64-shared), got {value!r}")
            fields[key] = f"K{int(match.group(1))}-{match.group(2).lower()}"
            labels.append(f"support={fields[key]}")
        elif key == "top_k":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--variants: top_k takes an int >= 1, got {value!r}")
            fields[key] = int(value)
            labels.append(f"top_k={fields[key]}")
        elif key == "top_p":
            fields[key] = _number(key, value, 0.0, True, 1.0)
            labels.append(f"top_p={fields[key]:g}")
        elif key == "min_p":
            fields[key] = _number(key, value, 0.0, False, 1.0)
            labels.append(f"min_p={fields[key]:g}")
        elif key == "logit_std":
            fields[key] = _number(key, value, 0.0, True)
            labels.append(f"logit_std={fields[key]:g}")
        else:
            raise ValueError(f"--variants: unknown option {key!r} in {text!r}; options: softcap, "
                             f"deterministic, label_smoothing, z_loss, support, top_k, top_p, "
                             f"min_p, logit_std")
    if "support" in fields and fields.get("label_smoothing"):
        raise ValueError(f"--variants: support= does not run with label_smoothing (the op "
                         f"refuses it), got {text!r}")
    if "logit_std" in fields and not any(k in fields for k in ("top_k", "top_p", "min_p")):
        raise ValueError(f"--variants: logit_std goes with top_k / top_p / min_p (it sets the "
                         f"spread a sampler's support is computed from), got {text!r}")
    if any(k in fields for k in ("top_k", "top_p", "min_p")) and (
            "support" in fields or fields.get("label_smoothing")
            or fields.get("deterministic") == DETERMINISTIC["tp_invariant"]):
        raise ValueError(f"--variants: top_k / top_p / min_p do not run with support=, "
                         f"label_smoothing or deterministic=tp_invariant, got {text!r}")
    return Variant("+".join(labels), **fields)


def parse_variants(text: Optional[str]) -> list[Variant]:
    """The comma-separated variants of ``text`` (none for None or empty), each label once."""
    out: list[Variant] = []
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        variant = parse_variant(item)
        if any(v.label == variant.label for v in out):
            raise ValueError(f"--variants: {variant.label} given twice")
        out.append(variant)
    return out


def float64_cross_entropy(stats, label_smoothing: float = 0.0, z_loss: float = 0.0) -> torch.Tensor:
    """The mean of ``F.cross_entropy(z, y, label_smoothing=E, reduction="none") + K lse^2`` from a
    problem's float64 per-token statistics (:class:`benchmarks.op.Float64Stats`): ``-(1 - E) logp +
    E (lse - sum_v z / V) + K lse^2`` (the smoothed target ``(1 - E) onehot + E / V`` against
    ``logp_v = z_v - lse``)."""
    per_token = -stats.logp
    if label_smoothing:
        per_token = (-(1.0 - label_smoothing) * stats.logp + label_smoothing
                     * (stats.lse - stats.sum_z / stats.vocab))
    if z_loss:
        per_token = per_token + z_loss * stats.lse.square()
    return per_token.mean()
