"""The GRPO family of policy losses for :func:`tplogp.linear_logp_loss`: the loss, its normalisation
and its metrics from every token's fp32 ``logp`` (and ``entropy``), with the upstream gradients of
both in closed form.

:func:`tplogp.losses.grpo` builds a :class:`GRPOLoss` from TRL's names. Per token ``t`` of sequence
``i``, with
``m_t`` 1 where the position counts (its target is not ``ignore_index``) and ``L_i = sum_t m_t``::

    rho_t = logp_t - old_t                      (0 without old log-probs: ratio 1, gradient through
    logp) s_t   = exp(rho_t)                          importance_sampling_level="token"
    s_i   = exp(sum_t m_t rho_t / max(L_i, 1))  "sequence" (GSPO; ds_i / dlogp_t = s_i m_t / L_i)
                                                "sequence_token" (GSPO-token: the value s_i,
                                                ds / dlogp_t = s_i)
    policy P_t (loss_type):
      grpo, bnpo, dr_grpo, dapo, luspo   -min(min(s, delta) A, clamp(s, 1 - eps_low, 1 + eps_high)
      A); with the dual
                                         clip, for A < 0 at most -clip_ratio_c A
      cispo                              -sg(min(s, eps_high)) A logp
      sapo                               -A sigmoid(tau (s - 1)) 4 / tau, tau = tau_pos (A > 0) or
      tau_neg vespo                              -sg(phi_i) A logp, phi_i = exp(lambda + k log
      w_i - lambda w_i) with
                                         log w_i = clamp(sum_t m_t clamp(rho_t, -20, 20) + log IS
                                         weights, log 1e-8, 20)
    l_t = P_t c_t + beta KL_t (x s if bias-corrected) - entropy_coef H_t / n_H
    loss = sum_t m_t norm_t l_t

``c_t`` is the rollout correction (1 without one; folded into ``w_i`` for vespo), ``KL_t`` the
k1 / k2 / k3 estimator of the KL to the reference policy and ``norm_t`` the normalisation
(:data:`NORMALIZATIONS`).

A loss whose tokens need their sequence's sums (the sequence levels, vespo) says so
(:attr:`GRPOLoss.needs_sums`); the fused loss then evaluates it on chunks of whole sequences, or on
every token's logp at once when a sequence is longer than a chunk (:mod:`tplogp.fused_loss.loop`).
Every quantity is a function of the merged logp, identical on every rank of a tensor-parallel group,
so the loss, its gradients' coefficients and its metrics need no collective of their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
LEVELS = ("token", "sequence", "sequence_token")
KL_ESTIMATORS = ("k1", "k2", "k3")
ROLLOUT_CORRECTIONS = ("weights", "token_truncate", "token_mask", "sequence_truncate",
                       "sequence_mask")
# The normalisations, by verl's ``loss_agg_mode`` names: over the counted tokens (TRL's bnpo;
# dapo / cispo / vespo with a global token count), the batch mean of per-sequence token means (grpo,
# sapo), the batch mean of per-sequence token sums (luspo), and the token sum over batch size x
# max_completion_length (dr_grpo).
NORMALIZATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm")
DEFAULT_NORMALIZATION = {"grpo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean",
                         "bnpo": "token-mean", "dapo": "token-mean", "cispo": "token-mean",
                         "vespo": "token-mean", "luspo": "seq-mean-token-sum",
                         "dr_grpo": "seq-mean-token-sum-norm"}
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the PPO-clipped policy term
METRICS = ("kl_mean", "clip_low_fraction", "clip_high_fraction", "clip_region_fraction",
           "ratio_mean", "ratio_min", "ratio_max", "entropy_mean")
_LOG_MIN_WEIGHT = math.log(1e-8)  # VESPO's lower clamp of log w


def k3_kl(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k3 KL estimator of ``d = ref_logp - logp``, ``exp(d) - d - 1`` (with ``expm1``: no
    cancellation against 1 for small ``d``), and its derivative with respect to ``logp``,
    ``1 - exp(d)``."""
    e = torch.expm1(d)
    return e - d, -e


def refuse_under_compile(name: str) -> None:
    """A loss is built outside ``torch.compile``'d code: a loss object holds a process-wide key that
    names it to the compiled fused loss's op (and a GRPO loss's work runs eagerly), which a trace
    cannot create. Under a trace this is a graph break whose message says where to build the loss
    (under ``fullgraph=True``, the error); eagerly, nothing."""
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(msg=(
            f"tplogp: the loss {name} is built inside a function that torch.compile traces; "
            f"build tplogp losses (losses.grpo(...), losses.ppo_clip(...), ...) once outside the "
            f"compiled function (where the model and optimizer are built) and pass the loss in or "
            f"close over it"))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_number(name: str, value, minimum: Optional[float] = None, open_minimum: bool = False,
                 optional: bool = False) -> None:
    """A loss option that must be a finite real number (not a bool), at least ``minimum`` (above it
    with ``open_minimum``); None passes when ``optional``.

    Raises:
        ValueError: naming the option, what it must be and what it got.
    """
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > minimum if open_minimum else value >= minimum
    if not ok:
        bound = "" if minimum is None else f" {'>' if open_minimum else '>='} {minimum:g}"
        none = " or None" if optional else ""
        raise ValueError(f"{name} must be a finite number{bound}{none}, got {value!r}")


@dataclass(frozen=True)
class GRPOLossConfig:
    """The options of :func:`tplogp.losses.grpo` (see there), checked. (``GRPOConfig`` is an alias
    of this name, kept for existing code; ``trl.GRPOConfig`` is TRL's trainer config, another
    thing.)"""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: Optional[float] = None
    clip_ratio_c: Optional[float] = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    bias_corrected_kl: bool = False
    normalization: Optional[str] = None
    max_completion_length: Optional[int] = None
    num_items_in_batch: Optional[object] = None  # a number or a 0-d tensor
    with_old_logp: bool = True
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    rollout_correction: Optional[str] = None
    rollout_clip_min: Optional[float] = None
    rollout_clip_max: Optional[float] = 3.0
    entropy_coef: float = 0.0

    def __post_init__(self):
        def one_of(name, value, allowed):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")

        one_of("loss_type", self.loss_type, LOSS_TYPES)
        one_of("importance_sampling_level", self.importance_sampling_level, LEVELS)
        one_of("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        one_of("rollout_correction", self.rollout_correction, (None,) + ROLLOUT_CORRECTIONS)
        one_of("normalization", self.normalization, (None,) + NORMALIZATIONS)
        if self.importance_sampling_level != "token" and self.loss_type in ("cispo", "sapo",
                                                                            "vespo"):
            raise ValueError(f"loss_type={self.loss_type!r} takes importance_sampling_level='token' (vespo computes "
                             f"its sequence weights itself), got {self.importance_sampling_level!r}")
        for name in ("epsilon_low", "epsilon_high", "beta"):
            check_number(name, getattr(self, name), minimum=0.0)
        check_number("entropy_coef", self.entropy_coef)
        for name in ("delta", "clip_ratio_c", "sapo_temperature_pos", "sapo_temperature_neg",
                     "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            check_number(name, getattr(self, name), minimum=0.0, open_minimum=True, optional=True)
        for name in ("rollout_clip_min", "rollout_clip_max"):
            check_number(name, getattr(self, name), minimum=0.0, optional=True)
        if None not in (self.rollout_clip_min, self.rollout_clip_max) and \
                self.rollout_clip_min > self.rollout_clip_max:
            raise ValueError(f"rollout_clip_min ({self.rollout_clip_min}) must be at most "
                             f"rollout_clip_max ({self.rollout_clip_max})")
        length = self.max_completion_length
        if length is not None and (not _is_int(length) or length <= 0):
            raise ValueError(f"max_completion_length must be a positive int, got {length!r}")
        items = self.num_items_in_batch
        # (a 0-d tensor passes: its value is not read here)
        if items is not None and not (isinstance(items, torch.Tensor) and items.dim() == 0
                                      and items.dtype != torch.bool):
            check_number("num_items_in_batch", items, minimum=0.0)
        for name in ("bias_corrected_kl", "with_old_logp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c (the dual clip's bound on -A r for A < 0) must be > 1, got "
                             f"{self.clip_ratio_c}")
        if self.delta is not None and self.loss_type not in CLIPPED:
            raise ValueError(f"delta clamps the unclipped ratio of the clipped losses {CLIPPED}, not "
                             f"{self.loss_type!r}")
        if self.clip_ratio_c is not None and self.loss_type not in CLIPPED:
            raise ValueError(f"clip_ratio_c is the dual clip of the clipped losses {CLIPPED}, not {self.loss_type!r}")
        if self.norm == "seq-mean-token-sum-norm" and self.max_completion_length is None:
            raise ValueError(f"normalization {self.norm!r} (loss_type 'dr_grpo') divides by batch size x "
                             f"max_completion_length: pass max_completion_length")
        if self.num_items_in_batch is not None and self.norm != "token-mean":
            raise ValueError(f"num_items_in_batch is the token-mean normaliser (dapo, cispo, vespo, bnpo); "
                             f"normalization {self.norm!r} takes none")
        if self.bias_corrected_kl and self.beta == 0:
            raise ValueError("bias_corrected_kl corrects the KL term: set beta != 0 (with beta=0 leave it out, "
                             "as TRL's use_bias_correction_kl=True does nothing then)")
        if self.loss_type == "vespo" and self.rollout_correction in ("sequence_truncate",
                                                                     "sequence_mask"):
            raise ValueError("vespo folds per-token rollout weights into its sequence weight: use "
                             "rollout_correction 'token_truncate', 'token_mask' or 'weights'")

    @property
    def norm(self) -> str:
        """The normalisation: the given one, else the loss type's."""
        return self.normalization or DEFAULT_NORMALIZATION[self.loss_type]


GRPOConfig = GRPOLossConfig  # the former name


class GRPOLoss:
    """A GRPO-family loss (:func:`tplogp.losses.grpo`). ``per_token`` names the tensors it takes, in
    order; ``needs_sums`` whether a token's gradient needs its sequence's sums of logp-dependent
    values (the fused loss then computes every token's logp first); ``needs_sequences`` whether it
    needs to know the sequences at all (a per-sequence normalisation or sum); ``reads_entropy``
    whether it needs the entropy (an entropy bonus)."""

    def __init__(self, config: GRPOLossConfig) -> None:
        refuse_under_compile("grpo(...)")
        self.config = c = config
        names = ["advantages"] + (["old_logp"] if c.with_old_logp else []) + (["ref_logp"] if c.beta else [])
        if c.rollout_correction == "weights":
            names.append("rollout_weights")
        elif c.rollout_correction is not None:
            names.append("sampler_logp")
        self.per_token = tuple(names)
        self.reads_entropy = c.entropy_coef != 0
        self.needs_sums = c.importance_sampling_level != "token" or c.loss_type == "vespo"
        self.needs_sequences = (self.needs_sums or c.norm != "token-mean"
                                or c.rollout_correction in ("sequence_truncate", "sequence_mask"))
        if c.rollout_correction is not None and c.rollout_correction != "weights" and not c.with_old_logp:
            raise ValueError(f"rollout_correction={c.rollout_correction!r} weighs by exp(old_logp - sampler_logp): "
                             f"it needs old_logp (with_old_logp=True)")
        self.name = f"grpo(loss_type={c.loss_type!r}, importance_sampling_level={c.importance_sampling_level!r})"

    def check_arity(self, count: int) -> None:
        """A clear error when ``count`` per-token tensors are not the ones this loss takes."""
        if count != len(self.per_token):
            raise ValueError(f"the loss {self.name} takes per_token=({', '.join(self.per_token)}): "
                             f"{len(self.per_token)} tensors, got {count}")

    def bind(self, per_token: list[torch.Tensor], counted: Optional[torch.Tensor],
             segments) -> "BoundGRPO":
        """The loss for one call's rows: ``per_token`` fp32 ``[n]`` tensors (the call's rows, in
        ``per_token`` order), ``counted`` the ``[n]`` bool mask of rows that count (None: all),
        ``segments`` a :class:`tplogp.support.sequences.Segments` of the rows (None when
        :attr:`needs_sequences` is False)."""
        self.check_arity(len(per_token))
        return BoundGRPO(self.config, dict(zip(self.per_token, per_token)), counted, segments)

    def __repr__(self) -> str:
        return f"GRPOLoss({self.config})"


class Evaluation:
    """What :meth:`BoundGRPO.evaluate` gives for some rows: the loss's share, the upstream gradients
    of logp and entropy (``[rows]`` fp32, 0 where a row does not count; entropy's None when not
    read) and the metric sums."""

    __slots__ = ("total", "g_logp", "g_entropy", "sums")

    def __init__(self, total, g_logp, g_entropy, sums):
        self.total, self.g_logp, self.g_entropy, self.sums = total, g_logp, g_entropy, sums


class BoundGRPO:
    """A :class:`GRPOLoss` bound to one call's rows: the constant per-token factors (counted mask,
    normalisation, rollout weights) made once, then :meth:`evaluate` on a chunk of rows (losses
    without sequence sums) or on all of them."""

    def __init__(self, config: GRPOLossConfig, tensors: dict, counted: Optional[torch.Tensor],
                 segments) -> None:
        c = config
        self.c, self.segments = c, segments
        adv = tensors["advantages"]
        n = adv.numel()
        self.adv, self.old, self.ref = adv, tensors.get("old_logp"), tensors.get("ref_logp")
        m = torch.ones(n, device=adv.device) if counted is None else counted.to(torch.float32)
        self.m = m
        self.count = m.sum()  # counted rows (0-d, on the device)
        # [B] counted rows per sequence
        self.seq_len = None if segments is None else segments.sum(m)
        self.norm = self._normalisation(m)  # [n] or 0-d: m_t norm_t
        # c_t ([n] or None); vespo: log c_t
        self.weight, self.log_weight = self._rollout(tensors, m)
        self.policy_scale = self.norm if self.weight is None or c.loss_type == "vespo" else self.norm * self.weight
        if c.entropy_coef:
            denom = self._normaliser() if c.norm == "token-mean" else self.count.clamp_min(1.0)
            self.entropy_scale = m * (-c.entropy_coef / denom)
        else:
            self.entropy_scale = None

    def _normaliser(self):
        """token-mean's divisor: num_items_in_batch, else the call's counted rows (at least 1)."""
        given = self.c.num_items_in_batch
        if given is None:
            return self.count.clamp_min(1.0)
        if isinstance(given, torch.Tensor):
            return given.to(device=self.m.device, dtype=torch.float32).clamp_min(1.0)
        return max(float(given), 1.0)

    def _normalisation(self, m: torch.Tensor) -> torch.Tensor:
        """``m_t norm_t`` per row."""
        c, seg = self.c, self.segments
        if c.norm == "token-mean":
            return m / self._normaliser()
        batch = seg.count
        if c.norm == "seq-mean-token-mean":
            return m * (1.0 / (batch * self.seq_len.clamp_min(1.0)))[seg.index]
        if c.norm == "seq-mean-token-sum":
            return m / batch
        return m / (batch * c.max_completion_length)

    def _rollout(self, tensors: dict, m: torch.Tensor):
        """``(c_t, log c_t)``: the rollout correction's per-row weight (None without one) and, for
        vespo, its log (clamped to ``[log 1e-8, 20]``, folded into the sequence weight)."""
        c = self.c
        mode = c.rollout_correction
        if mode is None:
            return None, None
        if mode == "weights":
            weight = tensors["rollout_weights"]
        else:
            diff = torch.where(m > 0, self.old - tensors["sampler_logp"], 0.0)
            if mode.startswith("sequence"):
                diff = self.segments.sum(diff)[self.segments.index]
            ratio = torch.exp(diff)
            lo = -math.inf if c.rollout_clip_min is None else c.rollout_clip_min
            hi = math.inf if c.rollout_clip_max is None else c.rollout_clip_max
            if mode.endswith("truncate"):
                weight = ratio.clamp(lo, hi)
            else:
                weight = torch.where((ratio < lo) | (ratio > hi), 0.0, ratio)
        weight = torch.where(m > 0, weight, 0.0)
        if c.loss_type != "vespo":
            return weight, None
        return None, torch.where(m > 0, torch.log(weight).clamp(_LOG_MIN_WEIGHT, 20.0), 0.0)

    def evaluate(self, logp: torch.Tensor, entropy: Optional[torch.Tensor],
                 rows: Optional[slice] = None, metrics: bool = False,
                 sequences: Optional[slice] = None) -> Evaluation:
        """The loss's share of ``rows`` (a slice of the call's rows; None: all of them), its
        upstream gradients and, with ``metrics``, its metric sums (:func:`finish_metrics`). A loss
        with sequence sums (:attr:`GRPOLoss. needs_sums`) takes rows that hold whole sequences: all
        of them, or the ``sequences`` (a slice of the sequences) and no other.
        ``logp`` / ``entropy``: those rows' fp32 values (0 at rows that do not count)."""
        c = self.c

        def part(t):
            return t if rows is None or not isinstance(t, torch.Tensor) or t.dim() == 0 else t[rows]

        m, adv, scale = part(self.m), part(self.adv), part(self.policy_scale)
        rho = None if self.old is None else torch.where(m > 0, logp - part(self.old), 0.0)
        level = c.importance_sampling_level
        seq, seq_len = self.segments, self.seq_len
        if sequences is not None:  # whole sequences: their sums are the chunk's
            seq, seq_len = seq.part(rows, sequences), seq_len[sequences]
        seq_ratio = None
        if level == "token":
            ratio = torch.ones_like(logp) if rho is None else torch.exp(rho)
        else:
            mean_rho = seq.sum(rho) / seq_len.clamp_min(1.0) if rho is not None else None
            seq_ratio = torch.ones(seq.count, device=logp.device) if mean_rho is None else torch.exp(mean_rho)
            ratio = seq_ratio[seq.index]
        g_logp = torch.zeros_like(logp)
        d_ratio = None  # d loss / d ratio per row, before the chain rule through the ratio
        lt = c.loss_type
        if lt in CLIPPED:
            lo, hi = 1 - c.epsilon_low, 1 + c.epsilon_high
            coef1 = ratio if c.delta is None else ratio.clamp(max=c.delta)
            plain, clipped = coef1 * adv, ratio.clamp(lo, hi) * adv
            d1 = 1.0 if c.delta is None else (ratio <= c.delta).to(logp.dtype)
            d2 = ((ratio >= lo) & (ratio <= hi)).to(logp.dtype)
            policy = -torch.minimum(plain, clipped)
            d_policy = -adv * torch.where(plain <= clipped, d1, d2)
            if c.clip_ratio_c is not None:  # the dual clip: -A r at most -c A for A < 0
                floor = -c.clip_ratio_c * adv
                capped = (adv < 0) & (policy > floor)
                policy = torch.where(capped, floor, policy)
                d_policy = torch.where(capped, 0.0, d_policy)
            value = scale * policy
            d_ratio = scale * d_policy
        elif lt == "sapo":
            tau = torch.where(adv > 0, c.sapo_temperature_pos, c.sapo_temperature_neg)
            gate = torch.sigmoid(tau * (ratio - 1))
            value = scale * (-adv * gate * 4 / tau)
            d_ratio = scale * (-4 * adv * gate * (1 - gate))
        elif lt == "cispo":
            coef = -ratio.clamp(max=c.epsilon_high) * adv * scale
            value, g_logp = coef * logp, coef
        else:  # vespo (whole sequences: its weights are sequence sums)
            phi = self._vespo_weights(rho, adv, seq, part(self.log_weight))
            coef = -phi * adv * scale
            value, g_logp = coef * logp, coef
        kl = None
        if c.beta:
            ref = part(self.ref)
            d = torch.where(m > 0, ref - logp, 0.0)
            if c.kl_estimator == "k3":
                kl, d_kl = k3_kl(d)
            elif c.kl_estimator == "k2":
                kl, d_kl = 0.5 * d * d, -d
            else:
                kl, d_kl = -d, torch.ones_like(d)
            kl_scale = part(self.norm) * c.beta
            # KL x ratio (DeepSeek-V3.2): d = (KL' + KL) ratio on the row's own logp,
            if c.bias_corrected_kl:
                # through the sequence ratio's mean at the sequence level
                value = value + kl_scale * kl * ratio
                g_logp = g_logp + kl_scale * d_kl * ratio
                extra = kl_scale * kl
                d_ratio = extra if d_ratio is None else d_ratio + extra
                kl = kl * ratio
            else:
                value = value + kl_scale * kl
                g_logp = g_logp + kl_scale * d_kl
        if d_ratio is not None:  # the chain rule through the ratio
            if level == "sequence":  # d s_i / d logp_t = s_i m_t / L_i
                per_seq = seq.sum(d_ratio) * seq_ratio / seq_len.clamp_min(1.0)
                g_logp = g_logp + m * per_seq[seq.index]
            # token: d s_t / d logp_t = s_t; sequence_token: the stop-gradient form, d s / d
            # logp_t = s_i
            else:
                g_logp = g_logp + d_ratio * ratio
        g_entropy = None
        if entropy is not None and self.entropy_scale is not None:
            g_entropy = part(self.entropy_scale)
            value = value + g_entropy * entropy
        g_logp = torch.where(m > 0, g_logp, 0.0)
        total = torch.where(m > 0, value, 0.0).sum()
        sums = self._metric_sums(m, ratio, adv, kl, entropy) if metrics else None
        return Evaluation(total, g_logp, g_entropy, sums)

    def _vespo_weights(self, rho: Optional[torch.Tensor], adv: torch.Tensor, seq,
                       log_weight: Optional[torch.Tensor]) -> torch.Tensor:
        """VESPO's ``phi`` per row of the whole sequences ``seq`` (a constant: no gradient flows
        through it); ``log_weight``: those rows' log rollout weights (None without)."""
        c = self.c
        log_w = torch.zeros(seq.count, device=adv.device)
        if rho is not None:
            log_w = seq.sum(rho.clamp(-20.0, 20.0))
        if log_weight is not None:
            log_w = log_w + seq.sum(log_weight)
        log_w = log_w.clamp(_LOG_MIN_WEIGHT, 20.0)[seq.index]
        nonneg = adv >= 0
        k = torch.where(nonneg, c.vespo_k_pos, c.vespo_k_neg)
        lam = torch.where(nonneg, c.vespo_lambda_pos, c.vespo_lambda_neg).clamp_min(1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)

    def _metric_sums(self, m, ratio, adv, kl, entropy) -> torch.Tensor:
        """``[count, kl, low, high, region, ratio, entropy, ratio_min, ratio_max]`` over the counted
        rows."""
        c = self.c
        on = m > 0
        zero = torch.zeros((), device=m.device)
        if c.loss_type in CLIPPED:
            low = on & (ratio < 1 - c.epsilon_low) & (adv < 0)
            high = on & (ratio > 1 + c.epsilon_high) & (adv > 0)
        elif c.loss_type == "cispo":
            low, high = torch.zeros_like(on), on & (ratio > c.epsilon_high) & (adv > 0)
        else:
            low = high = torch.zeros_like(on)
        f = torch.float32
        row = [m.sum(), zero if kl is None else torch.where(on, kl, 0.0).sum(), low.to(f).sum(),
               high.to(f).sum(), (low | high).to(f).sum(), torch.where(on, ratio, 0.0).sum(),
               zero if entropy is None else torch.where(on, entropy, 0.0).sum(),
               torch.where(on, ratio, math.inf).amin() if ratio.numel() else torch.full((), math.inf, device=m.device),
               torch.where(on, ratio, -math.inf).amax() if ratio.numel() else torch.full((),
                                                                                         -math.inf,
                                                                                          device=m.device)]
        return torch.stack(row)


def combine_sums(a: Optional[torch.Tensor], b: torch.Tensor) -> torch.Tensor:
    """Two chunks' metric sums as one."""
    if a is None:
        return b
    return torch.cat([a[:7] + b[:7], torch.minimum(a[7:8], b[7:8]), torch.maximum(a[8:], b[8:])])


def finish_metrics(sums: Optional[torch.Tensor], device: torch.device, with_kl: bool,
                   with_entropy: bool) -> dict[str, torch.Tensor]:
    """The metrics (:data:`METRICS`; ``kl_mean`` with a KL term, ``entropy_mean`` where the entropy
    is computed) from the metric sums: means over the counted rows (0 when none counts; the ratio's
    min and max NaN then)."""
    if sums is None:
        sums = torch.tensor([0.0] * 7 + [math.inf, -math.inf], device=device)
    count = sums[0].clamp_min(1.0)
    none = sums[0] == 0
    out = {"kl_mean": sums[1] / count, "clip_low_fraction": sums[2] / count,
           "clip_high_fraction": sums[3] / count, "clip_region_fraction": sums[4] / count,
           "ratio_mean": sums[5] / count, "ratio_min": torch.where(none, math.nan, sums[7]),
           "ratio_max": torch.where(none, math.nan, sums[8]), "entropy_mean": sums[6] / count}
    if not with_kl:
        del out["kl_mean"]
    if not with_entropy:
        del out["entropy_mean"]
    return out
