"""``linear_logp`` as ``torch.library`` custom ops, so that ``torch.compile`` traces a call as one
opaque node.

``tplogp::linear_logp_fwd`` runs the eager call's path inside: :func:`tplogp.op.plan.prepare`
(source, checks, verdict), then the forward body of :mod:`tplogp.op.tp`; it returns one packed fp32
``[K, N]`` tensor (rows ``packed_op.PACKED_*``: logp, lse, the two normalizer parts the backward
needs, with entropy the entropy and ``E_p[z] - M``, and with ``return_argmax`` the argmax ids, exact
in fp32), the softmax terms that the ``workspace_bytes`` budget lets it keep for the backward as
eager's forward keeps them (one flat fp32 buffer of ``packed_op.op_kept_shape``; an empty tensor
when none: a budget that keeps nothing, or no graph; with ``ignore_index``, whose compaction makes
the kept size depend on the data, a capacity for any row count of which the compacted rows fill a
prefix), and a sequence-parallel call's gathered hidden rows (an empty tensor otherwise), so that
its backward does not gather them again. ``tplogp::linear_logp_bwd`` runs the backward body, reading
those instead of recomputing them; it never writes them (its schema declares no mutation, so the
compiled backward runs the read-only schedule: eager's in-place one, ``tp.consumes_kept``, is not
used here). Both have fake (meta) implementations that give the output shapes without touching data,
and the pair is joined by ``register_autograd``. The kept output's size also depends on what the
call's arguments do not say (the source chosen for the device, its tile config, the default budget
and ``TPLOGP_WORKSPACE_MB``): the forward takes those as its ``layout`` argument
(:func:`layout_key`, a constant of the traced graph), so a compiled graph that a cache saved under
other settings is never reused for these, and a graph run after they change raises an error that
says so. Everything that dynamo must not trace (the importlib-based source lookup, the checks' host
steps, collectives, Triton launches) happens inside the ops; the process group crosses the op
boundary as its name. Autocast is resolved before the op (:mod:`tplogp.api`) and disabled inside it,
so the sources always see the dtypes they were given, also when a backward runs inside an autocast
region.

``tplogp::linear_logp_loss`` is the fused loss (:func:`tplogp.linear_logp_loss`) under
``torch.compile``: its forward runs the eager chunk loop and returns the loss with its fp32
gradients (computed in the forward, as in eager); its registered backward scales them by the
upstream scalar, each fp32 product rounded once to the leaf's dtype, so the compiled gradients are
bitwise eager's. The loss crosses the schema as its :attr:`~tplogp.losses.TokenLoss.key`
(:func:`tplogp.losses.loss_by_key`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..backends import memory_budget
from ..support import settings
from ..support.comm import group_from_name
from ..backends.kernel_registry import backend_for_call
from .options import LOGP_OP, LOSS_OP, LogpOptions, from_op_values, names_of, schema_arguments
from .plan import op_call, prepare, prepare_backward
from .packed_op import backward_packed, forward_packed, op_kept_shape, packed_rows


def _options(values: tuple) -> LogpOptions:
    """The forward's and backward's options from their schema's option tail (the op returns the
    lse)."""
    return from_op_values(LOGP_OP, values, return_lse=True)


def _gathers(sequence_parallel: bool, group_name: str) -> bool:
    """Whether a call's forward gathers sequence-parallel hidden rows (a group of several ranks)."""
    group = group_from_name(group_name) if sequence_parallel else None
    return group is not None and group.size() > 1


def _source(source: str) -> Optional[str]:
    return source or None


_LAYOUT_KEYS: dict[tuple, str] = {}


def layout_key(source: str, device: torch.device, dtype: torch.dtype) -> str:
    """What decides the forward's kept output shape besides the op's arguments: the source that runs
    on ``device`` for ``dtype`` with its tile config (``ShardBackend.layout_fingerprint``) and the
    default budget's split there (with ``TPLOGP_WORKSPACE_MB``). Evaluated once at trace time (a
    constant of the graph, so part of a compiled graph's cache key); remembered per settings for the
    forward's own check at run time."""
    key = (source, device, dtype, settings.workspace_setting(), settings.triton_interpret())
    found = _LAYOUT_KEYS.get(key)
    if found is None:
        backend = backend_for_call(_source(source), device, dtype)
        found = _LAYOUT_KEYS[key] = (f"{backend.layout_fingerprint(device, dtype)}; "
                                     f"{memory_budget.split(backend.name, None, device)!r}")
    return found


# What ``torch.compiler.assume_constant_result`` marks (dynamo calls the function while tracing and
# puts its result in the graph), set here without that decorator's import of torch._dynamo (1.5 s,
# and Triton with it) at the import of tplogp; tests/op/test_compile.py checks that the decorator
# sets exactly this.
layout_key._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _check_layout(layout: str, source: str, device: torch.device, dtype: torch.dtype) -> None:
    current = layout_key(source, device, dtype)
    if layout != current:
        raise RuntimeError(f"tplogp: this compiled graph was traced for the kept layout {layout!r}, but calls now get "
                           f"{current!r} (TPLOGP_WORKSPACE_MB, the source or its tiles changed after tracing): call "
                           "torch._dynamo.reset() so that torch.compile traces it again")


# The ops' arguments: the call's tensors and layout, then the options' tail (tplogp.op.options, in
# declaration order), so an option is declared once and crosses every schema, fake and saved tuple
# below.
_FORWARD_HEAD = ("Tensor hidden, Tensor weight, Tensor target_ids, Tensor? bias, str group_name, "
                 "int vocab_start_index, int? global_vocab_size, str source, bool builds_graph, str layout")
_FORWARD_ARGS = tuple(a.split()[-1] for a in _FORWARD_HEAD.split(", ")) + names_of(LOGP_OP)
_BACKWARD_HEAD = ("Tensor hidden, Tensor weight, Tensor target_ids, Tensor? bias, Tensor packed, Tensor kept, "
                  "Tensor gathered, Tensor grad_packed, str group_name, int vocab_start_index, str source, "
                  "bool needs_hidden, bool needs_weight, bool needs_bias")


@torch.library.custom_op("tplogp::linear_logp_fwd", mutates_args=(),
                         schema=f"({_FORWARD_HEAD}, {schema_arguments(LOGP_OP)}) -> (Tensor, Tensor, Tensor)")
def linear_logp_fwd(hidden, weight, target_ids, bias, group_name, vocab_start_index,
                    global_vocab_size, source, builds_graph, layout,
                    *options) -> tuple[Tensor, Tensor, Tensor]:
    """Packed fp32 ``[K, N]`` forward of one call, the logits it keeps for the backward and the
    gathered sequence-parallel rows (see the module docstring). ``source`` "" selects per device;
    ``layout``: :func:`layout_key` when traced; ``options``: :func:`tplogp.op.options.op_values`."""
    _check_layout(layout, source, hidden.device, hidden.dtype)
    group = group_from_name(group_name)
    with torch.autocast(hidden.device.type, enabled=False):
        return forward_packed(prepare(_source(source), hidden, weight, target_ids, bias, group,
                                      vocab_start_index, global_vocab_size, _options(options),
                                      builds_graph))


@linear_logp_fwd.register_fake
def _linear_logp_fwd_fake(hidden, weight, target_ids, bias, group_name, vocab_start_index,
                          global_vocab_size, source, builds_graph, layout, *values):
    options = _options(values)
    packed = hidden.new_empty((packed_rows(options.return_entropy, options.return_argmax),
                               target_ids.numel()),
                              dtype=torch.float32)
    backend = backend_for_call(_source(source), hidden.device, hidden.dtype)
    kept = op_kept_shape(backend, target_ids.numel(), hidden.shape[-1], weight.shape[0],
                         hidden.dtype, hidden.device, op_call(options, builds_graph),
                         options.ignore_index)
    gathered = (target_ids.numel(), hidden.shape[-1]) if _gathers(options.sequence_parallel,
                                                                  group_name) else (0,)
    return packed, hidden.new_empty(kept, dtype=torch.float32), hidden.new_empty(gathered)


@torch.library.custom_op("tplogp::linear_logp_bwd", mutates_args=(),
                         schema=f"({_BACKWARD_HEAD}, {schema_arguments(LOGP_OP)}) -> (Tensor, Tensor, Tensor)")
def linear_logp_bwd(hidden, weight, target_ids, bias, packed, kept, gathered, grad_packed,
                    group_name, vocab_start_index, source, needs_hidden, needs_weight, needs_bias,
                    *options) -> tuple[Tensor, Tensor, Tensor]:
    """``(d_hidden, d_weight, d_bias)``; a gradient that is not needed comes back as an empty
    tensor."""
    group = group_from_name(group_name)
    with torch.autocast(hidden.device.type, enabled=False):
        call = prepare_backward(_source(source), hidden, weight, target_ids, bias, group,
                                vocab_start_index, _options(options))
        grads = backward_packed(call, packed, grad_packed,
                                (needs_hidden, needs_weight, needs_bias and bias is not None),
                                kept=kept, gathered=gathered)
    like = (hidden, weight, bias if bias is not None else hidden)
    return tuple(g if g is not None else x.new_empty(0) for g, x in zip(grads, like))  # type: ignore[return-value]


@linear_logp_bwd.register_fake
def _linear_logp_bwd_fake(hidden, weight, target_ids, bias, packed, kept, gathered, grad_packed,
                          group_name, vocab_start_index, source, needs_hidden, needs_weight,
                          needs_bias, *options):
    has_bias = needs_bias and bias is not None
    return (hidden.new_empty(hidden.shape if needs_hidden else (0,)),
            weight.new_empty(weight.shape if needs_weight else (0,)),
            (bias if has_bias else hidden).new_empty(bias.shape if has_bias else (0,)))


_OPTIONS_AT = _FORWARD_ARGS.index(names_of(LOGP_OP)[0])  # where the forward's option tail begins


def _setup_context(ctx, inputs, output) -> None:
    args = dict(zip(_FORWARD_ARGS, inputs))
    packed, kept, gathered = output
    ctx.mark_non_differentiable(kept, gathered)
    ctx.save_for_backward(args["hidden"], args["weight"], args["target_ids"], args["bias"], packed,
                          kept, gathered)
    ctx.call_args = (args["group_name"], args["vocab_start_index"], args["source"])
    ctx.options = tuple(inputs[_OPTIONS_AT:])


def _backward(ctx, grad_packed, grad_kept, grad_gathered):
    hidden, weight, target_ids, bias, packed, kept, gathered = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if grad_packed is None or not (needs[0] or needs[1] or (bias is not None and needs[3])):
        return (None,) * len(_FORWARD_ARGS)
    d_hidden, d_weight, d_bias = linear_logp_bwd(hidden, weight, target_ids, bias, packed, kept,
                                                 gathered, grad_packed, *ctx.call_args, needs[0],
                                                 needs[1], bias is not None and needs[3],
                                                 *ctx.options)
    return (d_hidden if needs[0] else None, d_weight if needs[1] else None, None,
            d_bias if (bias is not None and needs[3]) else None) + (None,) * (len(_FORWARD_ARGS) - 4)


linear_logp_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- the fused loss: one op whose forward runs the eager chunk loop and returns the loss and its g

_LOSS_HEAD = ("Tensor hidden, Tensor weight, Tensor target_ids, Tensor? bias, Tensor[] per_token, str loss_key, "
              "str reduction, str group_name, int vocab_start_index, int? global_vocab_size, str source, "
              "bool with_entropy, bool needs_hidden, bool needs_weight, bool needs_bias")
_LOSS_ARGS = tuple(a.split()[-1] for a in _LOSS_HEAD.split(", ")) + names_of(LOSS_OP)


@torch.library.custom_op("tplogp::linear_logp_loss", mutates_args=(),
                         schema=f"({_LOSS_HEAD}, {schema_arguments(LOSS_OP)}) -> (Tensor, Tensor, Tensor, Tensor)")
def linear_logp_loss_fwd(hidden, weight, target_ids, bias, per_token, loss_key, reduction,
                         group_name, vocab_start_index, global_vocab_size, source, with_entropy,
                         needs_hidden, needs_weight, needs_bias,
                         *options) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, d_hidden, d_weight, d_bias)`` of :func:`tplogp.linear_logp_loss` with the
    :class:`~tplogp.losses.TokenLoss` named ``loss_key``: the eager chunk loop
    (:func:`tplogp.fused_loss.loop.loss_and_grads`), the gradients unscaled in fp32 (a gradient that
    is not needed comes back empty). The call's target verdict is settled here, before the gradients
    leave the op."""
    from ..fused_loss.loop import loss_and_grads
    from ..losses.terms import loss_by_key

    group = group_from_name(group_name)
    needs = (needs_hidden, needs_weight, needs_bias and bias is not None)
    with torch.autocast(hidden.device.type, enabled=False):
        value, grads, verdict, _ = loss_and_grads(
            _source(source), hidden, weight, target_ids, bias, group, vocab_start_index,
            global_vocab_size, loss=loss_by_key(loss_key), per_token=tuple(per_token),
            reduction=reduction, needs=needs, with_entropy=with_entropy,
            **dict(zip(names_of(LOSS_OP), options)))
        if verdict is not None and any(needs):
            grads = verdict.settle(grads)
    like = (hidden, weight, bias if bias is not None else hidden)
    out = [g.to(torch.float32) if g is not None else x.new_empty(0, dtype=torch.float32) for g,
           x in zip(grads, like)]
    return (value, *out)  # type: ignore[return-value]


@linear_logp_loss_fwd.register_fake
def _linear_logp_loss_fake(hidden, weight, target_ids, bias, per_token, loss_key, reduction,
                           group_name, vocab_start_index, global_vocab_size, source, with_entropy,
                           needs_hidden, needs_weight, needs_bias, *options):
    has_bias = needs_bias and bias is not None
    f32 = torch.float32
    return (hidden.new_empty((), dtype=f32),
            hidden.new_empty(hidden.shape if needs_hidden else (0,), dtype=f32),
            weight.new_empty(weight.shape if needs_weight else (0,), dtype=f32),
            hidden.new_empty(bias.shape if has_bias else (0,), dtype=f32))


def _loss_setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias = inputs[0], inputs[1], inputs[3]
    _, d_hidden, d_weight, d_bias = output
    ctx.mark_non_differentiable(d_hidden, d_weight, d_bias)
    ctx.save_for_backward(d_hidden, d_weight, d_bias)
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.n_per_token = len(inputs[4])


def _loss_backward(ctx, g, *_):
    """Each gradient times the upstream scalar, the fp32 product rounded once to its leaf's dtype
    (as the eager fused loss's backward, :mod:`tplogp.fused_loss.grad_scaling`: bitwise with
    ``loss.backward()``)."""
    needs = ctx.needs_input_grad
    scaled = [None if not need or dtype is None else (t * g.to(torch.float32)).to(dtype)
              for need, t,
              dtype in zip((needs[0], needs[1], needs[3]), ctx.saved_tensors, ctx.dtypes)]
    return (scaled[0], scaled[1], None, scaled[2], [None] * ctx.n_per_token) + (None,) * (len(_LOSS_ARGS) - 5)


linear_logp_loss_fwd.register_autograd(_loss_backward, setup_context=_loss_setup_context)
