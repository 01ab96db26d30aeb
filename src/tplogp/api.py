"""The public operator ``linear_logp`` and the per-source callables the registry hands out."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence, Union

import torch

from .tp import LogpOptions, LogpOutputs, linear_logp_tp


_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(LogpOptions))


def _options(kwargs: dict) -> LogpOptions:
    unknown = set(kwargs) - _OPTION_NAMES
    if unknown:
        raise TypeError(f"linear_logp got unexpected keyword argument(s) {sorted(unknown)}; options are "
                        f"tp_group, vocab_start_index, global_vocab_size, {', '.join(sorted(_OPTION_NAMES))}")
    return LogpOptions(**kwargs)


def _run(source: Optional[str], hidden, weight, target_ids, bias, tp_group, vocab_start_index: int,
         global_vocab_size: Optional[int], options: LogpOptions) -> Union[torch.Tensor, LogpOutputs]:
    """Resolve the backend for this call's device, then run the shared TP path."""
    from .kernel_registry import backend_for_call

    device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
    return linear_logp_tp(
        backend_for_call(source, device, getattr(hidden, "dtype", None)), hidden, weight, target_ids, bias,
        tp_group=tp_group, vocab_start_index=vocab_start_index, global_vocab_size=global_vocab_size,
        options=options,
    )


def linear_logp(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    tp_group=None,
    vocab_start_index: int = 0,
    global_vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    return_lse: bool = False,
    ignore_index: Optional[int] = None,
    deterministic: bool = False,
    workspace_bytes: Optional[int] = None,
) -> Union[torch.Tensor, LogpOutputs]:
    """Per-token log-probability of ``target_ids`` through a (vocab-sharded) LM head.

    ``logp[t] = log_softmax((hidden @ weight.T + bias) / temperature)[t, target_ids[t]]`` over the whole vocabulary
    of all ranks of ``tp_group``, without materializing the ``[tokens, vocab]`` logits. Differentiable in hidden,
    weight and bias for any upstream gradient.

    Args:
        hidden: ``[N, D]`` or ``[B, S, D]``, float32 / bfloat16 / float16.
        weight: ``[V_local, D]``, this rank's rows ``[vocab_start_index, vocab_start_index + V_local)``, hidden's dtype.
        target_ids: integer global token ids with hidden's leading shape, the same on every rank.
        bias: ``[V_local]`` or None.
        tp_group: the process group the vocab is sharded over (None: the weight is the whole vocab).
        vocab_start_index: first global id of this rank's shard (shards may be uneven).
        global_vocab_size: total vocab; inferred from the shards when None.
        temperature: logits are divided by it before the softmax (gradients follow).
        return_entropy: also return the entropy of the full-vocab distribution per token (differentiable).
        return_lse: also return the merged log-sum-exp per token (differentiable, for z-loss / KL terms).
        ignore_index: positions with this target get logp 0 (entropy 0, lse 0) and no gradient.
        deterministic: bitwise reproducible outputs and gradients, and per-row results that do not depend on the
            other rows of the batch (costs some speed: fixed token tiles).
        workspace_bytes: the most memory the op may hold beyond inputs, outputs and gradients (transient tiles plus
            logits kept from forward to backward, which spare the backward their recompute GEMM); default:
            ``TPLOGP_WORKSPACE_MB``, else the source's default tile memory with nothing kept (docs/operator.md).

    Returns:
        float32 logp with target_ids' shape, or :class:`~tplogp.tp.LogpOutputs` ``(logp, entropy, lse)`` when
        ``return_entropy`` or ``return_lse`` is set (the unrequested field is None).
    """
    return _run(None, hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
                LogpOptions(temperature=temperature, return_entropy=return_entropy, return_lse=return_lse,
                            ignore_index=ignore_index, deterministic=deterministic, workspace_bytes=workspace_bytes))


@functools.lru_cache(maxsize=None)
def make_linear_logp(source: Optional[str]) -> Callable[..., Union[torch.Tensor, LogpOutputs]]:
    """``linear_logp`` bound to one source (None: automatic selection per call)."""
    if source is None:
        return linear_logp

    @functools.wraps(linear_logp)
    def op(hidden, weight, target_ids, bias=None, *, tp_group=None, vocab_start_index: int = 0,
           global_vocab_size: Optional[int] = None, **options):
        return _run(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index, global_vocab_size,
                    _options(options))

    op.__name__ = f"linear_logp_{source}"
    op.source = source  # type: ignore[attr-defined]
    return op


def linear_logp_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    loss: Callable[..., torch.Tensor],
    per_token: Sequence[torch.Tensor] = (),
    reduction: str = "sum",
    tp_group=None,
    vocab_start_index: int = 0,
    global_vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    ignore_index: Optional[int] = None,
    deterministic: bool = False,
    workspace_bytes: Optional[int] = None,
    source: Optional[str] = None,
) -> torch.Tensor:
    """A per-token loss of the token log-probs (and entropies), reduced to a scalar, with the gradients computed in
    the forward chunk by chunk (see :mod:`tplogp.fused_loss`).

    ``loss(logp, entropy, *per_token_chunk)`` returns the per-token loss of a chunk (``tplogp.losses`` has PPO/GRPO
    clipping, policy gradient, KL to a reference and an entropy bonus); ``per_token`` tensors have target_ids'
    shape and are constants. ``reduction``: ``"sum"`` or ``"mean"`` (over the tokens not ignored). Ignored
    positions add nothing. The other arguments are those of :func:`linear_logp`. Returns a 0-d fp32 tensor whose
    backward scales the precomputed gradients of hidden, weight and bias.
    """
    from .fused_loss import fused_loss
    from .kernel_registry import backend_for_call

    device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
    backend = backend_for_call(source, device, getattr(hidden, "dtype", None))
    return fused_loss(backend, hidden, weight, target_ids, bias, loss=loss,
                      per_token=tuple(per_token), reduction=reduction, tp_group=tp_group,
                      vocab_start_index=vocab_start_index, global_vocab_size=global_vocab_size,
                      temperature=temperature, ignore_index=ignore_index, deterministic=deterministic,
                      workspace_bytes=workspace_bytes)
