"""Per-token RL loss terms for :func:`tplogp.linear_logp_loss`: callables
``(logp, entropy, *per_token) -> [n]``.

Each sees one chunk of tokens (fp32 ``logp`` and ``entropy`` of the chunk, and the chunk's rows of
the per-token tensors, in the order given to ``per_token=``) and returns the per-token loss;
``linear_logp_loss`` reduces it. Only :func:`entropy_bonus` reads ``entropy``: a loss built of the
others runs with ``with_entropy=False`` (no entropy statistics computed; ``entropy`` is then None).

A :class:`TokenLoss` may also read per-token statistics of the logits ``z`` (:class:`TokenStats`):
the log-sum-exp ``lse`` (:func:`z_loss`) and the sum ``sum_v z`` over the whole vocabulary
(:func:`cross_entropy` with ``label_smoothing``), merged across the tensor-parallel group like logp.
``linear_logp_loss`` hands them over and feeds their derivatives to the sources' backward (the sum's
only when a term reads it: one more statistic then).

The built-ins are :class:`TokenLoss` objects: besides the value they give its derivatives with
respect to ``logp`` and ``entropy`` in closed form (:meth:`TokenLoss.value_and_derivatives`), so
that ``linear_logp_loss`` needs no autograd graph of the loss: one autograd node for the whole loss,
and no engine run per chunk. ``+`` combines them (the per-token tensors of the left term first). Any
other callable works too, differentiated by autograd.

:func:`grpo` builds the GRPO family (TRL's loss types, GSPO's sequence ratios, clip variants,
rollout corrections, KL estimators, metrics): a :class:`~tplogp.losses.grpo_family.GRPOLoss`, which
normalises itself and may need its sequences' sums before any token's gradient
(:mod:`tplogp.losses.grpo_family`).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, NamedTuple, Optional, Union

import torch

from .grpo_family import GRPOLoss, GRPOLossConfig, check_number, k3_kl, refuse_under_compile

PerTokenLoss = Callable[..., torch.Tensor]
# d(loss_token)/d(logp_token) (or entropy): a tensor of the tokens, a number when the same for every
# token, or None when the loss does not depend on it
Derivative = Optional[Union[torch.Tensor, float]]
_Parts = tuple[torch.Tensor, Derivative, Derivative]


# every TokenLoss by its ``key``, so that a compiled ``linear_logp_loss`` names the loss to its op
# (``tplogp::linear_logp_loss`` takes tensors and plain values); a loss no longer referenced drops
# out
_by_key: "weakref.WeakValueDictionary[str, TokenLoss]" = weakref.WeakValueDictionary()
_numbers = itertools.count()


def loss_by_key(key: str) -> "TokenLoss":
    """The :class:`TokenLoss` whose ``key`` is ``key`` (a compiled ``linear_logp_loss`` op's
    loss)."""
    loss = _by_key.get(key)
    if loss is None:
        raise LookupError(f"no live TokenLoss has the key {key!r}: keep the loss object referenced while code "
                          "compiled with it runs")
    return loss
class TokenStats(NamedTuple):
    """Per-token statistics of the logits ``z`` that a :class:`TokenLoss` may read (fp32, the
    chunk's tokens)."""

    lse: torch.Tensor  # log sum_v exp(z_v)
    # sum_v z_v over the whole vocabulary (None unless a term reads it)
    sum_z: Optional[torch.Tensor]
    vocab_size: int  # V, the whole vocabulary


# what a term of the statistics gives: (value, d value / d lse, d value / d sum_z)
_StatParts = tuple[torch.Tensor, Derivative, Derivative]
STATS = ("lse", "sum_z")  # the statistics a TokenLoss may read


def _add(a: Derivative, b: Derivative) -> Derivative:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


class TokenLoss:
    """A per-token loss with its derivatives: ``loss(logp, entropy, *per_token)`` gives the
    per-token value (torch ops, differentiable by autograd like any callable),
    ``loss.value_and_derivatives(...)`` the value and ``d value / d logp`` and
    ``d value / d entropy`` per token, without autograd (equal to autograd's within fp32 rounding:
    tests/loss/test_losses.py). ``per_token`` names the per-token tensors it takes, in order;
    ``reads_entropy`` whether it needs the entropy (``with_entropy=True``). ``a + b`` is the sum of
    two terms, taking ``a``'s per-token tensors then ``b``'s.
    ``parts(logp, entropy, *per_token, derivatives=...)`` computes the value and, with
    ``derivatives``, the two derivatives (without: None, so a plain call runs none of their ops).

    ``reads`` names the :class:`TokenStats` fields the loss reads (of :data:`STATS`);
    ``stat_parts(stats, *per_token, derivatives=...)`` gives their term's value and its derivatives
    with respect to ``lse`` and ``sum_z`` (the value adds to ``parts``'). Such a loss is called with
    ``stats=``."""

    def __init__(self, name: str, per_token: tuple[str, ...], parts: Callable[..., _Parts],
                 reads_entropy: bool = False,
                 coefficients: Optional[Callable[..., tuple[Derivative, Derivative]]] = None,
                 reads: frozenset = frozenset(),
                 stat_parts: Optional[Callable[..., _StatParts]] = None) -> None:
        refuse_under_compile(name)
        unknown = set(reads) - set(STATS)
        if unknown or (stat_parts is None) != (not reads):
            raise ValueError(f"a TokenLoss reads statistics of {STATS} through stat_parts, got reads={set(reads)}")
        self.name = name
        self.per_token = per_token
        self.reads_entropy = reads_entropy
        self.reads = frozenset(reads)
        self._stat_parts = stat_parts
        self._parts = parts
        # a loss linear in (logp, entropy), value = c_logp * logp + c_entropy * entropy: the
        # coefficients (its derivatives) from the per-token tensors alone; None for any other loss
        self._coefficients = coefficients
        # whether the per-token value is c_logp * logp + c_entropy * entropy exactly, with
        # coefficients that do not depend on logp or entropy (:meth:`coefficients`): then a reduced
        # loss is a dot product of its upstream gradients with logp and entropy, and needs no
        # per-token value (a loss that reads statistics is not). An attribute: read per chunk
        self.linear: bool = coefficients is not None and stat_parts is None
        # names this object to the compiled fused loss's op (loss_by_key), unique in the process
        self.key = f"{name}#{next(_numbers)}"
        _by_key[self.key] = self

    def coefficients(self, *per_token: torch.Tensor) -> tuple[Derivative, Derivative]:
        """A :attr:`linear` loss's ``(c_logp, c_entropy)``: its derivatives, each a tensor of the
        tokens, a number, or None (not a term of the loss)."""
        if self._coefficients is None:
            raise TypeError(f"the loss {self.name} is not linear in logp and entropy")
        self.check_arity(len(per_token))
        return self._coefficients(*per_token)

    def check_arity(self, count: int) -> None:
        """A clear error when ``count`` per-token tensors are not the ones this loss takes."""
        if count != len(self.per_token):
            names = ", ".join(self.per_token)
            raise ValueError(f"the loss {self.name} takes per_token=({names}{',' if len(self.per_token) == 1 else ''})"
                             f": {len(self.per_token)} tensor(s), got {count}")

    def _check_stats(self, stats: Optional[TokenStats]) -> None:
        if self.reads and (stats is None or ("sum_z" in self.reads and stats.sum_z is None)):
            raise ValueError(f"the loss {self.name} reads the statistics {sorted(self.reads)} of the logits: call it "
                             f"with stats=TokenStats(...) (linear_logp_loss does)")

    def value_and_derivatives(self, logp: torch.Tensor, entropy: Optional[torch.Tensor],
                              *per_token: torch.Tensor,
                              stats: Optional[TokenStats] = None) -> _Parts:
        """``(value [n], d value / d logp, d value / d entropy)``; a derivative is a tensor of the
        tokens, a number when constant, or None when the value does not depend on it. A loss that
        :attr:`reads` statistics takes them as ``stats`` (their derivatives:
        :meth:`stat_derivatives`)."""
        self.check_arity(len(per_token))
        self._check_stats(stats)
        value, d_logp, d_entropy = self._parts(logp, entropy, *per_token, derivatives=True)
        if self._stat_parts is not None:
            value = value + self._stat_parts(stats, *per_token, derivatives=False)[0]
        return value, d_logp, d_entropy

    def stat_derivatives(self, stats: TokenStats, *per_token: torch.Tensor) -> tuple[Derivative, Derivative]:
        """``(d value / d lse, d value / d sum_z)`` per token (None where the loss does not read the
        statistic)."""
        self.check_arity(len(per_token))
        if self._stat_parts is None:
            return None, None
        self._check_stats(stats)
        _, d_lse, d_sum_z = self._stat_parts(stats, *per_token, derivatives=True)
        return d_lse, d_sum_z

    def __call__(self, logp: torch.Tensor, entropy: Optional[torch.Tensor],
                 *per_token: torch.Tensor, stats: Optional[TokenStats] = None) -> torch.Tensor:
        self.check_arity(len(per_token))
        self._check_stats(stats)
        value = self._parts(logp, entropy, *per_token, derivatives=False)[0]
        if self._stat_parts is not None:
            value = value + self._stat_parts(stats, *per_token, derivatives=False)[0]
        return value

    def __add__(self, other: "TokenLoss") -> "TokenLoss":
        if not isinstance(other, TokenLoss):
            return NotImplemented
        split = len(self.per_token)

        def parts(logp, entropy, *per_token, derivatives):
            v1, dl1, de1 = self._parts(logp, entropy, *per_token[:split], derivatives=derivatives)
            v2, dl2, de2 = other._parts(logp, entropy, *per_token[split:], derivatives=derivatives)
            return v1 + v2, _add(dl1, dl2), _add(de1, de2)

        stat_parts = None
        if self._stat_parts is not None or other._stat_parts is not None:

            def stat_parts(stats, *per_token, derivatives):
                terms = [side._stat_parts(stats, *pt, derivatives=derivatives)
                         for side, pt in ((self, per_token[:split]), (other, per_token[split:]))
                         if side._stat_parts is not None]
                if len(terms) == 1:
                    return terms[0]
                (v1, a1, b1), (v2, a2, b2) = terms
                return v1 + v2, _add(a1, a2), _add(b1, b2)

        coefficients = None
        if self.linear and other.linear:

            def coefficients(*per_token):
                cl1, ce1 = self._coefficients(*per_token[:split])
                cl2, ce2 = other._coefficients(*per_token[split:])
                return _add(cl1, cl2), _add(ce1, ce2)

        return TokenLoss(f"{self.name} + {other.name}", self.per_token + other.per_token, parts,
                         self.reads_entropy or other.reads_entropy, coefficients,
                         self.reads | other.reads, stat_parts)

    def __repr__(self) -> str:
        return f"TokenLoss({self.name}; per_token=({', '.join(self.per_token)}))"


def _linear_loss(name: str, per_token: tuple[str, ...],
                 coefficients: Callable[..., tuple[Derivative, Derivative]],
                 reads_entropy: bool = False) -> TokenLoss:
    """The :attr:`~TokenLoss.linear` loss ``c_logp * logp + c_entropy * entropy`` of
    ``coefficients(*per_token)`` (a None coefficient: no such term): its value and derivatives both
    come from the coefficients."""

    def parts(logp, entropy, *per_token, derivatives):
        c_logp, c_entropy = coefficients(*per_token)
        terms = [c * x for c, x in ((c_logp, logp), (c_entropy, entropy)) if c is not None]
        value = terms[0] if len(terms) == 1 else terms[0] + terms[1]
        return value, c_logp if derivatives else None, c_entropy if derivatives else None

    return TokenLoss(name, per_token, parts, reads_entropy, coefficients)


def cross_entropy(label_smoothing: float = 0.0) -> TokenLoss:
    """``-logp``: the target token's cross-entropy (supervised fine-tuning); no per-token tensors.
    Reads no entropy.

    ``label_smoothing = eps`` in ``[0, 1]``: the cross-entropy against
    ``(1 - eps) onehot + eps / V``, per token ``F.cross_entropy(z, y, label_smoothing=eps,
    reduction="none")``, that is ``-(1 - eps) logp + eps (lse - sum_v z / V)``: it reads the
    statistics ``lse`` and ``sum_z`` (:class:`TokenStats`). Derivatives ``-(1 - eps)``, ``eps`` and
    ``-eps / V``."""
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if label_smoothing == 0:
        return _linear_loss("cross_entropy()", (), lambda: (-1.0, None))
    eps = float(label_smoothing)

    def parts(logp, entropy, *, derivatives):
        return -(1.0 - eps) * logp, -(1.0 - eps) if derivatives else None, None

    def stat_parts(stats, *, derivatives):
        value = eps * stats.lse - (eps / stats.vocab_size) * stats.sum_z
        return value, (eps if derivatives else None), (-eps / stats.vocab_size if derivatives else None)

    return TokenLoss(f"cross_entropy(label_smoothing={eps})", (), parts, reads=frozenset(STATS),
                     stat_parts=stat_parts)


def z_loss(coef: float) -> TokenLoss:
    """``coef * lse^2`` (PaLM's z-loss, Liger's ``lse_square_scale``); no per-token tensors. Reads
    the statistic ``lse`` (:class:`TokenStats`), no entropy. Derivative ``2 coef lse``. Combine it
    with a loss by ``+``."""
    check_number("z_loss's coef", coef)
    coef = float(coef)

    def parts(logp, entropy, *, derivatives):
        return torch.zeros_like(logp), None, None

    def stat_parts(stats, *, derivatives):
        return coef * stats.lse.square(), (2.0 * coef) * stats.lse if derivatives else None, None

    return TokenLoss(f"z_loss({coef})", (), parts, reads=frozenset({"lse"}), stat_parts=stat_parts)


def policy_gradient() -> TokenLoss:
    """``-A * logp``; per_token = ``(advantages,)``. Reads no entropy."""
    return _linear_loss("policy_gradient()", ("advantages",), lambda adv: (-adv, None))


def ppo_clip(eps_low: float = 0.2, eps_high: float = 0.2) -> TokenLoss:
    """``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` with ``r = exp(logp - old_logp)``
    (PPO / GRPO); per_token = ``(advantages, old_logp)``. Reads no entropy. ``eps_low``,
    ``eps_high``: finite, at least 0.

    Derivative: ``-A r`` where the unclipped term is the smaller one (or the two are equal, ``r``
    inside the range or ``A = 0``), else 0 (the clipped term is constant in ``logp`` outside the
    range)."""
    check_number("eps_low", eps_low, minimum=0.0)
    check_number("eps_high", eps_high, minimum=0.0)
    lo, hi = 1 - eps_low, 1 + eps_high

    def parts(logp, entropy, adv, old_logp, *, derivatives):
        ratio = torch.exp(logp - old_logp)
        plain, clipped = ratio * adv, ratio.clamp(lo, hi) * adv
        d_logp = torch.where(plain <= clipped, -plain, 0.0) if derivatives else None
        return -torch.minimum(plain, clipped), d_logp, None

    return TokenLoss(f"ppo_clip({eps_low}, {eps_high})", ("advantages", "old_logp"), parts)


def kl_to_reference(coef: float) -> TokenLoss:
    """``coef * (exp(ref - logp) - (ref - logp) - 1)`` (the k3 estimator);
    per_token = ``(ref_logp,)``. Reads no entropy. Derivative: ``coef * (1 - exp(ref - logp))``.
    ``coef``: finite, at least 0."""
    check_number("kl_to_reference's coef", coef, minimum=0.0)

    def parts(logp, entropy, ref_logp, *, derivatives):
        kl, d_kl = k3_kl(ref_logp - logp)
        return coef * kl, coef * d_kl if derivatives else None, None

    return TokenLoss(f"kl_to_reference({coef})", ("ref_logp",), parts)


def entropy_bonus(coef: float) -> TokenLoss:
    """``-coef * entropy``; no per-token tensors. Needs the entropy: ``with_entropy=True`` (the
    default). ``coef``: finite."""
    check_number("entropy_bonus's coef", coef)
    return _linear_loss(f"entropy_bonus({coef})", (), lambda: (None, -coef), reads_entropy=True)


def grpo(loss_type: str = "dapo", *, importance_sampling_level: str = "token",
         epsilon_low: float = 0.2, epsilon_high: Optional[float] = None,
         delta: Optional[float] = None, clip_ratio_c: Optional[float] = None, beta: float = 0.0,
         kl_estimator: str = "k3", bias_corrected_kl: bool = False,
         normalization: Optional[str] = None, max_completion_length: Optional[int] = None,
         num_items_in_batch=None, with_old_logp: bool = True, sapo_temperature_pos: float = 1.0,
         sapo_temperature_neg: float = 1.05, vespo_k_pos: float = 2.0,
         vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
         rollout_correction: Optional[str] = None, rollout_clip_min: Optional[float] = None,
         rollout_clip_max: Optional[float] = 3.0, entropy_coef: float = 0.0) -> GRPOLoss:
    """A GRPO-family policy loss with TRL's names and meanings (definitions:
    :mod:`tplogp.losses.grpo_family`; docs/integrations.md maps TRL, Liger and verl options).
    ``per_token`` = ``(advantages, old_logp)``, then ``ref_logp`` when ``beta != 0``, then
    ``rollout_weights`` (``rollout_correction="weights"``) or ``sampler_logp`` (the other
    corrections); without ``with_old_logp`` no ``old_logp`` (ratio 1: on-policy). Call
    :func:`tplogp.linear_logp_loss` with the default ``reduction="sum"``: the loss normalises
    itself.

    Args:
        loss_type: ``grpo`` (per-sequence token mean, then the batch mean), ``bnpo`` (token mean of
            the call), ``dr_grpo`` (token sum over ``B * max_completion_length``), ``dapo`` (token
            sum over ``num_items_in_batch``, else over the call's counted tokens), ``cispo``
            (clipped, detached ratio times logp), ``sapo`` (sigmoid gate), ``luspo`` (GSPO with each
            sequence's loss weighted by its length), ``vespo`` (gamma weights of the sequence
            ratio).
        importance_sampling_level: ``token``; ``sequence`` (GSPO: ``exp`` of the sequence's mean
            log-ratio); ``sequence_token`` (GSPO-token, its stop-gradient form: the sequence's
            ratio, each token's gradient its own).
        epsilon_low, epsilon_high: the clip range ``[1 - epsilon_low, 1 + epsilon_high]``
            (``epsilon_high`` None: ``epsilon_low``); for ``cispo`` ``epsilon_high`` is the ratio's
            cap.
        delta: INTELLECT-2's upper clamp of the unclipped ratio. clip_ratio_c: the dual clip (verl),
            ``-A r`` at most ``-clip_ratio_c A`` where ``A < 0``.
        beta, kl_estimator, bias_corrected_kl: ``beta`` times the ``k1`` / ``k2`` / ``k3`` estimator
            of the KL to the reference policy, multiplied by the importance ratio when
            ``bias_corrected_kl`` (DeepSeek-V3.2; it needs ``beta != 0``: TRL's
            ``use_bias_correction_kl`` maps to ``use_bias_correction_kl and beta``).
        normalization: verl's ``loss_agg_mode`` names, overriding the loss type's
            (:data:`~tplogp.losses.grpo_family. NORMALIZATIONS`). max_completion_length,
            num_items_in_batch: ``dr_grpo``'s and the token mean's divisors (TRL's trainer scales
            its ``num_items_in_batch`` for gradient accumulation:
            :func:`tplogp.integrations.trl.grpo_loss` maps a trainer's options).
        sapo_temperature_pos, sapo_temperature_neg, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
        vespo_lambda_neg:
            the SAPO and VESPO parameters, TRL's defaults.
        rollout_correction: None; ``"weights"`` (given per-token weights, e.g. TRL's
            ``importance_sampling_ratio``); or the sampler's log-probs turned into
            ``exp(old_logp - sampler_logp)`` per token (``token_truncate`` / ``token_mask``) or per
            sequence (``sequence_truncate`` / ``sequence_mask``), clamped to (truncate) or zero
            outside (mask) ``[rollout_clip_min, rollout_clip_max]`` (TIS / MIS). They multiply the
            policy term (vespo: folded into its sequence weight).
        entropy_coef: an entropy bonus ``-entropy_coef`` x the token mean of the entropy (over the
            token-mean normaliser for ``token-mean``; TRL 1.16 takes the counted tokens for every
            loss type); reads the entropy.
    """
    return GRPOLoss(GRPOLossConfig(
        loss_type=loss_type, importance_sampling_level=importance_sampling_level,
        epsilon_low=epsilon_low, epsilon_high=epsilon_low if epsilon_high is None else epsilon_high,
        delta=delta, clip_ratio_c=clip_ratio_c, beta=beta, kl_estimator=kl_estimator,
        bias_corrected_kl=bias_corrected_kl, normalization=normalization,
        max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch,
        with_old_logp=with_old_logp, sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg, rollout_correction=rollout_correction,
        rollout_clip_min=rollout_clip_min, rollout_clip_max=rollout_clip_max,
        entropy_coef=entropy_coef))
