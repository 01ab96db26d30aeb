"""``linear_logp`` as ``torch.library`` custom ops, so that ``torch.compile`` traces a call as one opaque node.

``tplogp::linear_logp_fwd`` runs the eager call's path inside: :func:`tplogp.plan.prepare` (source, checks,
verdict), then the forward body of :mod:`tplogp.tp`; it returns one packed fp32 ``[K, N]``
tensor (rows ``tp.PACKED_*``: logp, lse, the two normalizer parts the backward needs, with entropy the
entropy and ``E_p[z] - M``, and with ``return_argmax`` the argmax ids, exact in fp32) and the fp32 logits that the ``workspace_bytes`` budget lets it keep for the backward
(``tp.op_keeps``; an empty tensor when none: no budget, no graph, or ``ignore_index``, whose compaction would make
the size depend on the data). ``tplogp::linear_logp_bwd`` runs the backward body, reading those instead of
recomputing them; it never writes them (its schema declares no mutation, so the compiled backward runs the
read-only schedule: eager's in-place one, ``tp.consumes_kept``, is not used here). Both have fake (meta)
implementations that give the output shapes without touching data, and the pair is joined by
``register_autograd``. Everything that dynamo must not trace (the importlib-based source
lookup, the checks' host steps, collectives, Triton launches) happens inside the ops; the process group crosses
the op boundary as its name. Autocast is resolved before the op (:mod:`tplogp.api`) and disabled inside it, so the
sources always see the dtypes they were given, also when a backward runs inside an autocast region.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .comm import group_from_name
from .kernel_registry import backend_for_call
from .plan import LogpOptions, op_call, prepare, prepare_backward
from .tp import backward_packed, forward_packed, packed_rows


def _options(temperature: float, return_entropy: bool, ignore_index: Optional[int], deterministic: bool,
             workspace_bytes: Optional[int], softcap: Optional[float], return_argmax: bool) -> LogpOptions:
    return LogpOptions(temperature=temperature, return_entropy=return_entropy, return_lse=True,
                       ignore_index=ignore_index, deterministic=deterministic, workspace_bytes=workspace_bytes,
                       softcap=softcap, return_argmax=return_argmax)


def _source(source: str) -> Optional[str]:
    return source or None


@torch.library.custom_op("tplogp::linear_logp_fwd", mutates_args=())
def linear_logp_fwd(hidden: Tensor, weight: Tensor, target_ids: Tensor, bias: Optional[Tensor], group_name: str,
                    vocab_start_index: int, global_vocab_size: Optional[int], temperature: float, return_entropy: bool,
                    ignore_index: Optional[int], deterministic: bool, workspace_bytes: Optional[int], source: str,
                    builds_graph: bool, softcap: Optional[float] = None,
                    return_argmax: bool = False) -> tuple[Tensor, Tensor]:
    """Packed fp32 ``[K, N]`` forward of one call and the logits it keeps for the backward (see the module
    docstring). ``source`` "" selects per device."""
    group = group_from_name(group_name)
    with torch.autocast(hidden.device.type, enabled=False):
        return forward_packed(prepare(_source(source), hidden, weight, target_ids, bias, group, vocab_start_index,
                                      global_vocab_size,
                                      _options(temperature, return_entropy, ignore_index, deterministic,
                                               workspace_bytes, softcap, return_argmax), builds_graph))


@linear_logp_fwd.register_fake
def _linear_logp_fwd_fake(hidden, weight, target_ids, bias, group_name, vocab_start_index, global_vocab_size,
                          temperature, return_entropy, ignore_index, deterministic, workspace_bytes, source,
                          builds_graph, softcap=None, return_argmax=False):
    packed = hidden.new_empty((packed_rows(return_entropy, return_argmax), target_ids.numel()), dtype=torch.float32)
    options = _options(temperature, return_entropy, ignore_index, deterministic, workspace_bytes, softcap,
                       return_argmax)
    backend = backend_for_call(_source(source), hidden.device, hidden.dtype)
    kept = backend.kept_shape(target_ids.numel(), hidden.shape[-1], weight.shape[0], hidden.dtype, hidden.device,
                              op_call(options, builds_graph))
    return packed, hidden.new_empty(kept, dtype=torch.float32)


@torch.library.custom_op("tplogp::linear_logp_bwd", mutates_args=())
def linear_logp_bwd(hidden: Tensor, weight: Tensor, target_ids: Tensor, bias: Optional[Tensor], packed: Tensor,
                    kept: Tensor, grad_packed: Tensor, group_name: str, vocab_start_index: int, temperature: float,
                    return_entropy: bool, ignore_index: Optional[int], deterministic: bool,
                    workspace_bytes: Optional[int], source: str, needs_hidden: bool, needs_weight: bool,
                    needs_bias: bool, softcap: Optional[float] = None,
                    return_argmax: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(d_hidden, d_weight, d_bias)``; a gradient that is not needed comes back as an empty tensor."""
    group = group_from_name(group_name)
    with torch.autocast(hidden.device.type, enabled=False):
        options = _options(temperature, return_entropy, ignore_index, deterministic, workspace_bytes, softcap,
                           return_argmax)
        call = prepare_backward(_source(source), hidden, weight, target_ids, bias, group, vocab_start_index, options)
        grads = backward_packed(call, packed, grad_packed, (needs_hidden, needs_weight, needs_bias and bias is not None),
                                kept=kept)
    like = (hidden, weight, bias if bias is not None else hidden)
    return tuple(g if g is not None else x.new_empty(0) for g, x in zip(grads, like))  # type: ignore[return-value]


@linear_logp_bwd.register_fake
def _linear_logp_bwd_fake(hidden, weight, target_ids, bias, packed, kept, grad_packed, group_name, vocab_start_index,
                          temperature, return_entropy, ignore_index, deterministic, workspace_bytes, source,
                          needs_hidden, needs_weight, needs_bias, softcap=None, return_argmax=False):
    has_bias = needs_bias and bias is not None
    return (hidden.new_empty(hidden.shape if needs_hidden else (0,)),
            weight.new_empty(weight.shape if needs_weight else (0,)),
            (bias if has_bias else hidden).new_empty(bias.shape if has_bias else (0,)))


_FORWARD_ARGS = ("hidden", "weight", "target_ids", "bias", "group_name", "vocab_start_index", "global_vocab_size",
                 "temperature", "return_entropy", "ignore_index", "deterministic", "workspace_bytes", "source",
                 "builds_graph", "softcap", "return_argmax")


def _setup_context(ctx, inputs, output) -> None:
    args = dict(zip(_FORWARD_ARGS, inputs))
    packed, kept = output
    ctx.mark_non_differentiable(kept)
    ctx.save_for_backward(args["hidden"], args["weight"], args["target_ids"], args["bias"], packed, kept)
    ctx.call_args = (args["group_name"], args["vocab_start_index"], args["temperature"], args["return_entropy"],
                     args["ignore_index"], args["deterministic"], args["workspace_bytes"], args["source"])
    ctx.model_options = (args.get("softcap"), args.get("return_argmax", False))


def _backward(ctx, grad_packed, grad_kept):
    hidden, weight, target_ids, bias, packed, kept = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if grad_packed is None or not (needs[0] or needs[1] or (bias is not None and needs[3])):
        return (None,) * len(_FORWARD_ARGS)
    d_hidden, d_weight, d_bias = linear_logp_bwd(hidden, weight, target_ids, bias, packed, kept, grad_packed,
                                                 *ctx.call_args, needs[0], needs[1], bias is not None and needs[3],
                                                 *ctx.model_options)
    return (d_hidden if needs[0] else None, d_weight if needs[1] else None, None,
            d_bias if (bias is not None and needs[3]) else None) + (None,) * (len(_FORWARD_ARGS) - 4)


linear_logp_fwd.register_autograd(_backward, setup_context=_setup_context)
