"""What ``linear_logp`` returns: the bare logp tensor, or a named tuple that holds exactly the
requested outputs.

The tuples unpack like ``torch.unique``'s optional outputs and keep named access::

    logp = linear_logp(...)
    logp, entropy = linear_logp(..., return_entropy=True)                   # LogpEntropy
    logp, lse = linear_logp(..., return_lse=True)                           # LogpLse
    logp, entropy, lse = linear_logp(..., return_entropy=True, return_lse=True)  # LogpEntropyLse
    logp, argmax = linear_logp(..., return_argmax=True)                     # LogpArgmax

The outputs come in the order logp, entropy, lse, argmax, each present when asked.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch


class LogpEntropy(NamedTuple):
    """``return_entropy=True``: logp and the entropy of the full-vocab distribution (fp32, the
    targets' shape)."""

    logp: torch.Tensor
    entropy: torch.Tensor


class LogpLse(NamedTuple):
    """``return_lse=True``: logp and the merged log-sum-exp of the logits (fp32, the targets'
    shape)."""

    logp: torch.Tensor
    lse: torch.Tensor


class LogpEntropyLse(NamedTuple):
    """``return_entropy=True, return_lse=True``: logp, entropy and lse (fp32, the targets'
    shape)."""

    logp: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor


class LogpArgmax(NamedTuple):
    """``return_argmax=True``: logp and the full-vocabulary argmax id of the logits (int64, the
    lowest id on ties)."""

    logp: torch.Tensor
    argmax: torch.Tensor


class LogpEntropyArgmax(NamedTuple):
    """``return_entropy=True, return_argmax=True``: logp, entropy and argmax."""

    logp: torch.Tensor
    entropy: torch.Tensor
    argmax: torch.Tensor


class LogpLseArgmax(NamedTuple):
    """``return_lse=True, return_argmax=True``: logp, lse and argmax."""

    logp: torch.Tensor
    lse: torch.Tensor
    argmax: torch.Tensor


class LogpEntropyLseArgmax(NamedTuple):
    """``return_entropy=True, return_lse=True, return_argmax=True``: logp, entropy, lse and
    argmax."""

    logp: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor
    argmax: torch.Tensor


LinearLogpResult = Union[torch.Tensor, LogpEntropy, LogpLse, LogpEntropyLse, LogpArgmax, LogpEntropyArgmax,
                         LogpLseArgmax, LogpEntropyLseArgmax]


def pack_outputs(logp: torch.Tensor, entropy: Optional[torch.Tensor], lse: torch.Tensor,
                 return_entropy: bool, return_lse: bool,
                 argmax: Optional[torch.Tensor] = None) -> LinearLogpResult:
    """The requested outputs: ``logp`` alone, or the named tuple of the requested combination
    (``argmax``: given when it was asked for)."""
    if argmax is not None:
        if return_entropy and return_lse:
            return LogpEntropyLseArgmax(logp, entropy, lse, argmax)
        if return_entropy:
            return LogpEntropyArgmax(logp, entropy, argmax)
        if return_lse:
            return LogpLseArgmax(logp, lse, argmax)
        return LogpArgmax(logp, argmax)
    if return_entropy and return_lse:
        return LogpEntropyLse(logp, entropy, lse)
    if return_entropy:
        return LogpEntropy(logp, entropy)
    if return_lse:
        return LogpLse(logp, lse)
    return logp
