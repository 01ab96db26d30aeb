"""The TP backward's d_hidden all-reduce is issued as soon as d_hidden is complete and runs under
the d_W work: the gradients are bitwise those of a blocking all-reduce after the whole backward (4
uneven gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.support.backward_schedule import overlap_problem, record_schedule
from tests.support.problems import make_problem, run_op

LEAD, D, V = (3, 23), 19, 301


def _blocking_reference(tp, op, p, vs, workspace_bytes):
    """The op with the pre-overlap schedule: the backend's whole backward, then the all_reduce (its
    hook dropped)."""
    from tplogp.backends.native import NativeBackend

    original = NativeBackend.backward
    NativeBackend.backward = lambda self, *a, d_hidden_ready=None, **kw: original(self, *a, **kw)
    try:
        return run_op(op, p, tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=V,
                      workspace_bytes=workspace_bytes)
    finally:
        NativeBackend.backward = original


@pytest.mark.tp(world_size=4, timeout=300)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_overlapped_all_reduce_is_issued_before_the_last_d_w_update(tp, dtype):
    from pytest_tplogp import VocabShards
    from tplogp import get_op

    vs = VocabShards("uneven", tp.world_size, vocab_size=V).__tp_bind__(tp)
    p = make_problem(LEAD, D, V, dtype, True, seed=4)
    p.weight, p.bias = vs.shard(p.weight).clone(), vs.shard(p.bias).clone()
    op = get_op("linear_logp", source="native")
    # 16-token chunks: d_hidden is complete only in the last one
    ws = 16 * 4 * 4 * (vs.end - vs.start)
    with record_schedule() as events:
        ours = run_op(op, p, tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=V,
                      workspace_bytes=ws)
    problem = overlap_problem(events)
    tp.assert_all(problem is None, problem)
    ref = _blocking_reference(tp, op, p, vs, ws)
    for name in ("logp", "d_hidden", "d_weight", "d_bias"):
        tp.assert_all(torch.equal(getattr(ours, name), getattr(ref, name)),
                      f"{name} differs from the blocking run")
