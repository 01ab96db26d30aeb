"""The options are declared once (tplogp.op.options): the op schemas, the type tests, the checks'
messages and the option table of docs/operator.md derive from the declarations."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import tplogp
from tplogp.op import ops, options
from tplogp.op.options import LOGP_OP, LOSS_OP, SPECS, LogpOptions

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operator.md"


def test_docs_option_table_is_the_declared_one():
    assert options.markdown_table() in DOCS.read_text()


@pytest.mark.parametrize("op, names", [
    (ops.linear_logp_fwd, LOGP_OP), (ops.linear_logp_bwd, LOGP_OP),
    (ops.linear_logp_loss_fwd, LOSS_OP)])
def test_op_schemas_end_with_the_declared_options(op, names):
    """Each op's schema ends with the options of its op, in declaration order and with their schema
    types."""
    schema = str(op._opoverload._schema)
    assert f", {options.schema_arguments(names)}) -> " in schema, schema
    assert schema.split(") -> ")[0].endswith(options.names_of(names)[-1])


def test_public_signatures_take_every_crossing_option_with_its_default():
    """``linear_logp`` takes every option with the declared default; ``linear_logp_loss`` those of
    its op."""
    for fn, names in ((tplogp.linear_logp, [f.name for f in dataclasses.fields(LogpOptions)
                                            if f.name != "with_sum_z"]),
                      (tplogp.linear_logp_loss, options.names_of(LOSS_OP))):
        params = inspect.signature(fn).parameters
        for name in names:
            assert params[name].default == options.DEFAULTS[name], (fn.__name__, name)


@pytest.mark.parametrize("field, bad, message", [
    ("temperature", 0.0, "temperature must be a positive finite number"),
    ("ignore_index", 1.5, "ignore_index must be an int or None"),
    ("workspace_bytes", -1, "workspace_bytes must be a non-negative int or None"),
    ("softcap", float("inf"), "softcap must be a positive finite float or None"),
    ("return_argmax", 1, "return_argmax must be a bool"),
    ("deterministic", "yes", "deterministic must be True, False or 'tp_invariant'"),
    ("sequence_parallel", 0, "sequence_parallel must be a bool"),
    ("hidden_grad", "summed", "hidden_grad must be one of"),
])
def test_a_bad_option_is_named_by_its_declared_check(field, bad, message):
    """The declared check names the option; ``keyable`` refuses what the plan must not cache; the
    call raises."""
    opts = LogpOptions(**{field: bad})
    early, late = options.option_problems(opts)
    assert message in (early if SPECS[field].early else late)
    h, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(tplogp.LinearLogpInputError, match=message.replace("(", r"\(")):
        tplogp.linear_logp(h, w, t, **{field: bad})


def test_op_values_round_trip_and_type_tests():
    opts = LogpOptions(temperature=2, softcap=3, return_entropy=True, ignore_index=-100)
    values = options.op_values(opts, LOGP_OP)
    assert type(values[0]) is float and options.from_op_values(LOGP_OP,
                                                               values) == dataclasses.replace(
        opts, temperature=2.0, softcap=3.0)
    assert options.keyable(opts) and options.crosses_schema(opts, LOGP_OP)
    assert not options.keyable(LogpOptions(temperature=True))
    assert options.keyable(LogpOptions(deterministic="tp_invariant"))
    assert not options.crosses_schema(LogpOptions(deterministic="tp_invariant"), LOGP_OP)


def test_the_sources_get_the_declared_shard_fields_as_plain_values():
    """Every option with a ``shard`` field fills that field of ShardCall, as its schema type's plain
    Python value (an int softcap a float, ``"tp_invariant"`` a True); the others leave theirs at
    the defaults."""
    from tplogp.backends.base import ShardCall
    from tplogp.op import plan

    shard_names = {f.name for f in dataclasses.fields(ShardCall)}
    assert {field for field, _ in options.SHARD_FIELDS.values()} <= shard_names
    call = plan.shard_call(LogpOptions(temperature=2, softcap=30, return_entropy=True,
                                       deterministic="tp_invariant", workspace_bytes=1 << 20,
                                       return_argmax=True, with_sum_z=True))
    assert (call.inv_temperature, call.softcap, call.with_entropy, call.deterministic,
            call.workspace_bytes, call.with_argmax, call.with_sum_z) == (
        0.5, 30.0, True, True, 1 << 20, True, True)
    assert type(call.softcap) is float and type(call.deterministic) is bool
    bare = plan.shard_call(LogpOptions())
    assert (bare.softcap, bare.with_entropy, bare.deterministic, bare.workspace_bytes) == (
        None, False, False, None)
