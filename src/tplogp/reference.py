"""The references of the operator (public path; they live in :mod:`tplogp.testing.reference`)."""

from .testing.reference import (
    ReferenceMode, REFERENCE_MODES, ReferenceOutputs, reference_logits, reference_outputs,
    reference_linear_logp, reference_support_outputs, support_mask, sampler_mask,
    padded_support,
)

__all__ = [
    "ReferenceMode",
    "REFERENCE_MODES",
    "ReferenceOutputs",
    "reference_logits",
    "reference_outputs",
    "reference_linear_logp",
    "reference_support_outputs",
    "support_mask",
    "sampler_mask",
    "padded_support",
]
