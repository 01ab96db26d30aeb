"""The GRPO loss family (public path; it lives in :mod:`tplogp.losses.grpo_family`)."""

from .losses.grpo_family import (
    LOSS_TYPES, LEVELS, KL_ESTIMATORS, ROLLOUT_CORRECTIONS, NORMALIZATIONS, DEFAULT_NORMALIZATION,
    CLIPPED, METRICS, k3_kl, refuse_under_compile, check_number, GRPOLossConfig, GRPOConfig,
    GRPOLoss, Evaluation, BoundGRPO, combine_sums, finish_metrics,
)

__all__ = [
    "LOSS_TYPES",
    "LEVELS",
    "KL_ESTIMATORS",
    "ROLLOUT_CORRECTIONS",
    "NORMALIZATIONS",
    "DEFAULT_NORMALIZATION",
    "CLIPPED",
    "METRICS",
    "k3_kl",
    "refuse_under_compile",
    "check_number",
    "GRPOLossConfig",
    "GRPOConfig",
    "GRPOLoss",
    "Evaluation",
    "BoundGRPO",
    "combine_sums",
    "finish_metrics",
]
