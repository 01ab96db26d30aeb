"""The options of a call, declared once: :class:`LogpOptions`, whose fields carry their whole
description.

Each field of :class:`LogpOptions` is an :func:`option`: its Python default, the type it has in the
``torch.library`` schemas (:class:`OptionSpec`: ``"float"``, ``"bool"``, ``"int?"``, ``"float?"``,
``"str"``), the ops whose schema it crosses, a one-line doc and, where a value can be wrong, the
check that names the problem. Everything else derives from these declarations:

* the op schemas' option arguments and their order (:func:`schema_arguments`), the values a call
  passes (:func:`op_values`) and the options an op's body rebuilds from them
  (:func:`from_op_values`), so the ops (:mod:`tplogp.op.ops`), their fake implementations and their
  saved arguments take the options as one tail;
* whether a call's options are of the plain types the plan caches (:func:`keyable`) and those the op
  schemas take (:func:`crosses_schema`: other calls run eagerly, where the checks name the
  argument);
* the checks' messages for a bad option (:func:`option_problems`, run by
  :mod:`tplogp.op.validation`);
* what the sources get to know of them (:data:`SHARD_FIELDS`: the fields of
  :class:`tplogp.backends.base.ShardCall` each option fills);
* the option table of docs/operator.md (:func:`markdown_table`; tests/op/test_options.py compares
  them).

Adding an option means adding one field here and reading it where it acts (a source, the TP layer).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Optional, Union

import torch

from ..support import invariant

LOGP_OP = "linear_logp"  # tplogp::linear_logp_fwd and tplogp::linear_logp_bwd
LOSS_OP = "linear_logp_loss"  # tplogp::linear_logp_loss
# what hidden.grad holds with a group: the full gradient (summed over the ranks), or this rank's
# share of it
HIDDEN_GRADS = ("reduced", "partial")


@dataclass(frozen=True)
class OptionSpec:
    """What an option is besides its default: its schema type, the ops it crosses, its doc and its
    check."""

    schema: str  # its type in the torch.library schemas
    doc: str
    # the op schemas it crosses (none: set by the call path)
    ops: tuple[str, ...] = (LOGP_OP, LOSS_OP)
    check: Optional[Callable[[Any], Optional[str]]] = None  # the value's problem, or None when fine
    # checked before the tensors' shapes (the layout's shape rules depend on it)
    early: bool = False
    # the plain values the plan caches, as a Python expression of the value ``{v}`` (default: the
    # schema type's)
    keyable: Optional[str] = None
    # the field of tplogp.backends.base.ShardCall that takes its value as the schema type's plain
    # Python value (SHARD_FIELDS; None: the sources do not read it)
    shard: Optional[str] = None


def option(default, schema: str, doc: str, **spec) -> Any:
    """A :class:`LogpOptions` field: ``default`` and its :class:`OptionSpec`."""
    return field(default=default, metadata={"spec": OptionSpec(schema, doc, **spec)})


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _temperature(x) -> Optional[str]:
    if not (_is_number(x) and x > 0 and x != float("inf")):
        return f"temperature must be a positive finite number, got {x!r}"
    return None


def _ignore_index(x) -> Optional[str]:
    if x is not None and not _is_int(x):
        return f"ignore_index must be an int or None, got {x!r}"
    return None


def _workspace_bytes(x) -> Optional[str]:
    if x is not None and (not _is_int(x) or x < 0):
        return f"workspace_bytes must be a non-negative int or None, got {x!r}"
    return None


def _softcap(x) -> Optional[str]:
    if x is not None and not (_is_number(x) and 0 < x < float("inf")):
        return ("softcap must be a positive finite float or None (z = softcap * tanh(logits / softcap)), got "
                f"{x!r}")
    return None


def _top_k(x) -> Optional[str]:
    if x is None or isinstance(x, torch.Tensor):  # (a tensor: tplogp.op.sampler_params)
        return None
    if not (_is_int(x) and x >= -1):
        return (f"top_k must be an int of at least -1 (-1 or 0: off) or a tensor per token, got "
                f"{x!r}")
    return None


def _top_p(x) -> Optional[str]:
    if x is None or isinstance(x, torch.Tensor):
        return None
    if not (_is_number(x) and 0 < x <= 1):
        return f"top_p must be a number in (0, 1] (1: off) or a tensor per token, got {x!r}"
    return None


def _min_p(x) -> Optional[str]:
    if x is None or isinstance(x, torch.Tensor):
        return None
    if not (_is_number(x) and 0 <= x <= 1):
        return f"min_p must be a number in [0, 1] (0: off) or a tensor per token, got {x!r}"
    return None


def _bool(name: str) -> Callable[[Any], Optional[str]]:
    def check(x) -> Optional[str]:
        return None if isinstance(x, bool) else f"{name} must be a bool, got {x!r}"
    return check


def _hidden_grad(x) -> Optional[str]:
    if not isinstance(x, str) or x not in HIDDEN_GRADS:
        return f"hidden_grad must be one of {HIDDEN_GRADS}, got {x!r}"
    return None


def _deterministic(x) -> Optional[str]:
    if not (isinstance(x, bool) or x == invariant.LEVEL):
        return f"deterministic must be True, False or {invariant.LEVEL!r}, got {x!r}"
    return None


@dataclass(frozen=True)
class LogpOptions:
    """Keyword options of ``linear_logp`` beyond the bare contract (defaults keep the bare
    behaviour)."""

    temperature: float = option(
        1.0, "float", "logits divided by it before the softmax (after the softcap)",
        check=_temperature)
    return_entropy: bool = option(
        False, "bool", "also the entropy of the full-vocabulary distribution per token",
        ops=(LOGP_OP,), shard="with_entropy")
    return_lse: bool = option(False, "bool", "also the merged log-sum-exp per token", ops=())
    ignore_index: Optional[int] = option(
        None, "int?", "positions with this target get 0 and no gradient", check=_ignore_index)
    # or "tp_invariant" (tplogp.support.invariant), which runs eagerly under torch.compile
    deterministic: Union[bool, str] = option(
        False, "bool",
        'bitwise reproducible (`"tp_invariant"`: also across TP degrees; eager only)',
        check=_deterministic, keyable="(type({v}) is bool or {v} == _LEVEL)",
        shard="deterministic")
    workspace_bytes: Optional[int] = option(
        None, "int?", "the memory budget beyond inputs, outputs and gradients",
        check=_workspace_bytes, shard="workspace_bytes")
    # hidden holds this rank's contiguous 1/world of the tokens; gathered before the GEMMs, its
    # gradient reduce-scattered (docs/operator.md, "Sequence parallelism")
    sequence_parallel: bool = option(
        False, "bool", "hidden is this rank's slice of the tokens",
        check=_bool("sequence_parallel"), early=True)
    # HIDDEN_GRADS: "partial" leaves hidden.grad as this rank's share, unsummed
    hidden_grad: str = option(
        "reduced", "str", 'with a group, `"reduced"` or `"partial"` (no d_hidden collective)',
        check=_hidden_grad, early=True)
    # final-logit softcapping: z = softcap * tanh((h W^T + b) / softcap), then the temperature
    # divides z
    softcap: Optional[float] = option(
        None, "float?", "final-logit softcapping `softcap * tanh(y / softcap)`", check=_softcap,
        shard="softcap")
    return_argmax: bool = option(
        False, "bool", "also the full-vocabulary argmax id per token", ops=(LOGP_OP,),
        check=_bool("return_argmax"), shard="with_argmax")
    # the per-token sum of the logits over the whole vocabulary (the fused loss's label smoothing
    # reads it)
    with_sum_z: bool = option(False, "bool", "the per-token sum of the logits (the fused loss's)",
                              ops=(), shard="with_sum_z")
    # the sampler's kept ids per token (tplogp.op.support_ids: its forms and checks); such calls run
    # eagerly (the schemas take no support) and are planned afresh at every call
    support: Optional[Any] = option(
        None, "Tensor?", "the sampler's kept ids per token, the distribution renormalized over "
        'them (eager only; "Sampler\'s support")', ops=(), keyable="({v} is None)")
    # the sampler's parameters, per call or per token (tplogp.op.sampler_params): the support is
    # computed from them, as vLLM's sampler keeps its ids (tplogp.op.sampler_support); such calls
    # run eagerly and are planned afresh at every call
    top_k: Optional[Any] = option(
        None, "int?", "the sampler's top-k (`-1`, `0`: off; an int or a tensor per token): the "
        'support computed from the logits (eager only; "Sampler\'s support")', ops=(),
        check=_top_k, keyable="({v} is None)")
    top_p: Optional[Any] = option(
        None, "float?", "the sampler's top-p (`1`: off), after top-k and min-p (eager only)",
        ops=(), check=_top_p, keyable="({v} is None)")
    min_p: Optional[Any] = option(
        None, "float?", "the sampler's min-p (`0`: off), before top-k (eager only)", ops=(),
        check=_min_p, keyable="({v} is None)")



SPECS: dict[str, OptionSpec] = {f.name: f.metadata["spec"] for f in fields(LogpOptions)}
# option -> (ShardCall field, the schema type's plain Python value: float, bool, or as given)
SHARD_FIELDS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    name: (spec.shard, {"float": float, "bool": bool}.get(spec.schema.rstrip("?"), lambda v: v))
    for name, spec in SPECS.items() if spec.shard is not None}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(LogpOptions) if f.default is not MISSING}


def names_of(op: str) -> tuple[str, ...]:
    """The options whose values cross ``op``'s schema, in declaration order."""
    return tuple(name for name, spec in SPECS.items() if op in spec.ops)


_OP_NAMES = {op: names_of(op) for op in (LOGP_OP, LOSS_OP)}


def schema_arguments(op: str) -> str:
    """``op``'s option arguments as a schema's text: ``"float temperature, bool
    return_entropy, ..."``."""
    return ", ".join(f"{SPECS[name].schema} {name}" for name in _OP_NAMES[op])


def _crosses(schema: str, value) -> bool:
    if schema.endswith("?") and value is None:
        return True
    kind = schema.rstrip("?")
    if kind == "float":
        return _is_number(value)
    if kind == "int":
        return _is_int(value)
    return isinstance(value, bool if kind == "bool" else str)


def _key_test(name: str, spec: OptionSpec) -> str:
    """One option's term of :func:`keyable` as Python source: the exact types of its schema type."""
    value = f"options.{name}"
    if spec.keyable is not None:
        return spec.keyable.format(v=value)
    kind = spec.schema.rstrip("?")
    test = f"type({value}) in (float, int)" if kind == "float" else f"type({value}) is {kind}"
    return f"({value} is None or {test})" if spec.schema.endswith("?") else test


# one expression of every option's type test, made once from the declarations (a call's plan key
# runs it: as cheap as a hand-written test)
keyable: Callable[[LogpOptions], bool] = eval(  # noqa: S307 (the text is made above from the declarations)
    "lambda options: " + " and ".join(_key_test(name, spec) for name, spec in SPECS.items()),
    {"_LEVEL": invariant.LEVEL})
keyable.__doc__ = "Whether every option is of the plain types a plan's key holds (others: checked every call)."


def crosses_schema(options: LogpOptions, op: str) -> bool:
    """Whether the options' values cross ``op``'s schema (other calls run eagerly: the checks name
    them)."""
    return all(_crosses(SPECS[name].schema, getattr(options, name)) for name in _OP_NAMES[op])


def op_values(options: LogpOptions, op: str) -> tuple:
    """The options' values as ``op``'s schema takes them, in :func:`schema_arguments`'s order."""
    values = []
    for name in _OP_NAMES[op]:
        value = getattr(options, name)
        if value is not None and SPECS[name].schema.rstrip("?") == "float":
            value = float(value)
        values.append(value)
    return tuple(values)


def from_op_values(op: str, values: tuple, **others) -> LogpOptions:
    """The :class:`LogpOptions` of an op's body: ``values`` as :func:`op_values` gave them, and
    ``others``."""
    return LogpOptions(**dict(zip(_OP_NAMES[op], values)), **others)


def option_problems(options: LogpOptions) -> tuple[Optional[str], Optional[str]]:
    """The first bad option's message among the ``early`` ones and among the others (None: all
    fine), in declaration order: the checks take the first before the tensors' shapes, the second
    after them."""
    found: list[Optional[str]] = [None, None]
    for name, spec in SPECS.items():
        slot = 0 if spec.early else 1
        if spec.check is not None and found[slot] is None:
            found[slot] = spec.check(getattr(options, name))
    return found[0], found[1]


def markdown_table() -> str:
    """The option table of docs/operator.md ("Options"): each option's type, default, ops and
    doc."""
    rows = ["| option | schema type | default | crosses | meaning |", "|---|---|---|---|---|"]
    for name, spec in SPECS.items():
        crosses = ", ".join(f"`{op}`" for op in spec.ops) or "(set by the call path)"
        rows.append(f"| `{name}` | `{spec.schema}` | `{DEFAULTS[name]!r}` | {crosses} | {spec.doc} |")
    return "\n".join(rows)


__all__ = ["LogpOptions", "OptionSpec", "SPECS", "DEFAULTS", "HIDDEN_GRADS", "LOGP_OP", "LOSS_OP",
           "option", "names_of", "schema_arguments", "keyable", "crosses_schema", "op_values",
           "from_op_values", "option_problems", "markdown_table"]
