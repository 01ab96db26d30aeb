"""The two ops' calls under ``torch.compile`` (the front of :mod:`tplogp.api` picks them): whether
a call's arguments cross its ``torch.library`` op's schema (:mod:`tplogp.op.ops`; the options' as
declared in :mod:`tplogp.op.options`), and the call as that op: ``linear_logp``'s packed result
viewed back as its outputs, ``linear_logp_loss``'s value (its gradients travel in the op's
autograd formula). Other calls run eagerly.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..losses.terms import TokenLoss
from ..outputs import LinearLogpResult, pack_outputs
from ..support.comm import group_name
from . import ops
from .options import LOGP_OP, LOSS_OP, LogpOptions, crosses_schema, names_of, op_values
from .packed_op import PACKED_ENTROPY, PACKED_LOGP, PACKED_LSE, packed_rows
from .validation import is_int


def fits_op_schema(hidden, weight, target_ids, bias, vocab_start_index, global_vocab_size,
                   options: LogpOptions, op: str = LOGP_OP) -> bool:
    """Whether the arguments' Python types cross ``op``'s schema (the options': as declared in
    :mod:`tplogp.op.options`); when not, :func:`tplogp.op.validation.local_problem` names the
    argument (checked in tests/op/test_linear_logp.py). ``deterministic="tp_invariant"`` runs
    eagerly (:mod:`tplogp.support.invariant`)."""
    return (all(isinstance(t, torch.Tensor) for t in (hidden, weight, target_ids))
            and (bias is None or isinstance(bias, torch.Tensor))
            and is_int(vocab_start_index)
            and (global_vocab_size is None or is_int(global_vocab_size))
            and crosses_schema(options, op) and options.support is None
            and options.top_k is None and options.top_p is None and options.min_p is None)


def linear_logp(source, hidden, weight, target_ids, bias, tp_group, vocab_start_index: int,
                global_vocab_size: Optional[int], options: LogpOptions) -> LinearLogpResult:
    """The call as the op pair of :mod:`tplogp.op.ops` (traced by ``torch.compile``)."""
    builds_graph = torch.is_grad_enabled() and hidden.requires_grad
    name = source if source is None or isinstance(source, str) else source.name
    packed, _, _ = ops.linear_logp_fwd(
        hidden, weight, target_ids, bias, group_name(tp_group), vocab_start_index,
        global_vocab_size, name or "", builds_graph,
        ops.layout_key(name or "", hidden.device, hidden.dtype), *op_values(options, LOGP_OP))
    shape = target_ids.shape
    logp = packed[PACKED_LOGP].view(shape)
    lse = packed[PACKED_LSE].view(shape)
    entropy = packed[PACKED_ENTROPY].view(shape) if options.return_entropy else None
    argmax = None
    if options.return_argmax:  # the last row: exact ids in fp32
        argmax = packed[packed_rows(options.return_entropy)].view(shape).to(torch.int64)
    return pack_outputs(logp, entropy, lse, options.return_entropy, options.return_lse, argmax)


def loss_fits_op_schema(hidden, weight, target_ids, bias, vocab_start_index, global_vocab_size,
                        source, options: dict) -> bool:
    """Whether a fused-loss call crosses ``tplogp::linear_logp_loss``'s schema: a
    :class:`~tplogp.losses.TokenLoss` (named by its key), plain tensors, plain option values. Other
    calls run eagerly (``tplogp.api``): a callable loss, a GRPO-family loss (its sequences and
    metrics), DTensors (which the caller asks about)."""
    return (isinstance(options["loss"], TokenLoss)
            and options["cu_seqlens"] is None and options["support"] is None
            and options["top_k"] is None and options["top_p"] is None and options["min_p"] is None
            and options["return_metrics"] is False
            and isinstance(options["per_token"], tuple)
            and all(isinstance(t, torch.Tensor) for t in options["per_token"])
            and isinstance(options["reduction"], str)
            and (source is None or isinstance(source, str))
            and isinstance(options["with_entropy"], bool)
            and fits_op_schema(hidden, weight, target_ids, bias, vocab_start_index,
                               global_vocab_size, _loss_options(options), LOSS_OP))


def _loss_options(options: dict) -> LogpOptions:
    """The :class:`LogpOptions` of a fused-loss call's keyword options (those its op's schema
    takes)."""
    return LogpOptions(**{name: options[name] for name in names_of(LOSS_OP)})


def linear_logp_loss(source, hidden, weight, target_ids, bias, tp_group,
                     vocab_start_index: int, global_vocab_size: Optional[int], *, loss: TokenLoss, per_token, reduction,
                     with_entropy, cu_seqlens: None = None, return_metrics: bool = False, **options):
    """The fused loss as the op of :mod:`tplogp.op.ops` (traced by ``torch.compile``): its value;
    the gradients it computed travel in the op's autograd formula (a
    :class:`~tplogp.losses.TokenLoss`: no sequences, no metrics)."""
    grad_on = torch.is_grad_enabled()
    needs = [grad_on and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    value, _, _, _ = ops.linear_logp_loss_fwd(
        hidden, weight, target_ids, bias, list(per_token), loss.key, reduction,
        group_name(tp_group), vocab_start_index, global_vocab_size, source or "", with_entropy,
        *needs, *op_values(_loss_options(options), LOSS_OP))
    return value


__all__ = ["fits_op_schema", "linear_logp", "loss_fits_op_schema", "linear_logp_loss"]
