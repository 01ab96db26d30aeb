"""What ``linear_logp`` returns: the bare logp tensor, or a named tuple that holds exactly the requested outputs.

The tuples unpack like ``torch.unique``'s optional outputs and keep named access::

    logp = linear_logp(...)
    logp, entropy = linear_logp(..., return_entropy=True)                   # LogpEntropy
    logp, lse = linear_logp(..., return_lse=True)                           # LogpLse
    logp, entropy, lse = linear_logp(..., return_entropy=True, return_lse=True)  # LogpEntropyLse
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch


class LogpEntropy(NamedTuple):
    """``return_entropy=True``: logp and the entropy of the full-vocab distribution (fp32, the targets' shape)."""

    logp: torch.Tensor
    entropy: torch.Tensor


class LogpLse(NamedTuple):
    """``return_lse=True``: logp and the merged log-sum-exp of the logits (fp32, the targets' shape)."""

    logp: torch.Tensor
    lse: torch.Tensor


class LogpEntropyLse(NamedTuple):
    """``return_entropy=True, return_lse=True``: logp, entropy and lse (fp32, the targets' shape)."""

    logp: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor


LinearLogpResult = Union[torch.Tensor, LogpEntropy, LogpLse, LogpEntropyLse]


def pack_outputs(logp: torch.Tensor, entropy: Optional[torch.Tensor], lse: torch.Tensor, return_entropy: bool,
                 return_lse: bool) -> LinearLogpResult:
    """The requested outputs: ``logp`` alone, or the named tuple of the requested combination."""
    if return_entropy and return_lse:
        return LogpEntropyLse(logp, entropy, lse)
    if return_entropy:
        return LogpEntropy(logp, entropy)
    if return_lse:
        return LogpLse(logp, lse)
    return logp
