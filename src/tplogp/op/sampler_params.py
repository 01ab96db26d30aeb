"""The sampler's parameters of a call (``top_k=``, ``top_p=``, ``min_p=``): their forms, their
checks, and the per-token tensors the support's computation takes
(:mod:`tplogp.op.sampler_support`).

Each parameter is None (not given), a Python number for every token, or a tensor of
``target_ids``' shape (one value per token, as a sampler's per-request parameters give them). The
values that switch a filter off are vLLM's: ``top_k`` -1 or 0 (and any ``top_k`` at least the
vocabulary), ``top_p`` 1, ``min_p`` 0. A value outside ``top_k >= -1``, ``0 < top_p <= 1``,
``0 <= min_p <= 1`` is wrong (the declared check of :mod:`tplogp.op.options` names a bad number;
:func:`data_problem` a bad tensor entry, in one host read; a token whose target is
``ignore_index`` is not read). :func:`form_problem` checks the tensors' forms without reading
them, and that the call does not also pass ``support=`` (the two ways of giving the support
exclude each other).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .options import LogpOptions

NAMES = ("top_k", "top_p", "min_p")


def given(options: LogpOptions) -> bool:
    """Whether the call asks for a support computed from the sampler's parameters."""
    return options.top_k is not None or options.top_p is not None or options.min_p is not None


def form_problem(options: LogpOptions, target_ids: torch.Tensor) -> Optional[str]:
    """The parameters' forms against ``target_ids`` (no data read): a message, or None."""
    if options.support is not None:
        named = ", ".join(f"{name}=" for name in NAMES if getattr(options, name) is not None)
        return (f"support= and {named} both give the sampler's support: pass the kept ids "
                f"(support=) or the sampler's parameters (top_k= / top_p= / min_p=), not both")
    shape = tuple(target_ids.shape)
    for name in NAMES:
        value = getattr(options, name)
        if not isinstance(value, torch.Tensor):
            continue
        integer = not (value.dtype.is_floating_point or value.dtype.is_complex
                       or value.dtype == torch.bool)
        kind = "an integer" if name == "top_k" else "a floating-point"
        ok = integer if name == "top_k" else value.dtype.is_floating_point
        if not ok or tuple(value.shape) != shape:
            return (f"{name} must be a number or {kind} tensor of target_ids' shape {shape} (one "
                    f"value per token), got {value.dtype} of shape {tuple(value.shape)}")
        if value.device != target_ids.device:
            return (f"{name} must be on target_ids' device ({target_ids.device}), got "
                    f"{value.device}")
    return None


def data_problem(options: LogpOptions, target_ids: torch.Tensor,
                 ignore_index: Optional[int]) -> Optional[str]:
    """The first bad entry of the tensor parameters (a token whose target is ``ignore_index`` is
    not read), in one host read: a message, or None."""
    tensors = [(name, getattr(options, name)) for name in NAMES
               if isinstance(getattr(options, name), torch.Tensor)]
    if not tensors or target_ids.numel() == 0:
        return None
    read = torch.ones(target_ids.numel(), dtype=torch.bool, device=target_ids.device)
    if ignore_index is not None:
        read = target_ids.reshape(-1) != ignore_index
    flags = []
    for name, value in tensors:
        v = value.reshape(-1)
        if name == "top_k":
            bad = v < -1
        elif name == "top_p":
            bad = ~((v > 0) & (v <= 1))
        else:
            bad = ~((v >= 0) & (v <= 1))
        bad = bad & read
        flags.append(torch.stack([bad.any().long(), bad.long().argmax()]))
    found = torch.stack(flags).tolist()
    for (name, value), (bad, at) in zip(tensors, found):
        if bad:
            rule = {"top_k": "at least -1 (-1 or 0: off)", "top_p": "in (0, 1] (1: off)",
                    "min_p": "in [0, 1] (0: off)"}[name]
            return f"{name} must be {rule}: token {at} holds {value.reshape(-1)[at].item()}"
    return None


class SamplerParams(NamedTuple):
    """The parameters per token, flattened, each None when not given (a filter off for every
    token): ``top_k`` int64 (0: off), ``top_p`` and ``min_p`` float64 (1, 0: off)."""

    top_k: Optional[torch.Tensor]
    top_p: Optional[torch.Tensor]
    min_p: Optional[torch.Tensor]

    def rows(self, index: torch.Tensor) -> "SamplerParams":
        """The parameters of the rows ``index`` (an int64 tensor)."""
        return SamplerParams(*(None if t is None else t.index_select(0, index) for t in self))


def per_token(options: LogpOptions, n: int, device: torch.device,
              vocab: int) -> Optional[SamplerParams]:
    """The call's parameters as :class:`SamplerParams` of ``n`` tokens on ``device`` (``vocab``:
    the global vocabulary; a ``top_k`` of at least it is off), or None when every filter is off
    for every token (a scalar's off value; a tensor is not read)."""
    def flat(value, dtype):
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            return value.reshape(-1).to(device=device, dtype=dtype)
        return torch.full((n,), value, dtype=dtype, device=device)

    top_k, top_p, min_p = options.top_k, options.top_p, options.min_p
    if not isinstance(top_k, torch.Tensor) and top_k is not None and (top_k <= 0 or top_k >= vocab):
        top_k = None
    if not isinstance(top_p, torch.Tensor) and top_p is not None and top_p >= 1:
        top_p = None
    if not isinstance(min_p, torch.Tensor) and min_p is not None and min_p <= 0:
        min_p = None
    if top_k is None and top_p is None and min_p is None:
        return None
    k = flat(top_k, torch.int64)
    if k is not None:
        k = torch.where((k <= 0) | (k >= vocab), 0, k)
    return SamplerParams(k, flat(top_p, torch.float64), flat(min_p, torch.float64))


__all__ = ["NAMES", "given", "form_problem", "data_problem", "SamplerParams", "per_token"]
