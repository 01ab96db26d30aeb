"""Checks without host syncs: the default (``full``) checks of a call without a TP group read nothing on the host;
their verdict is raised by the next call (or ``tplogp.check_errors``); with a group every rank raises the same error
at the call; ``sync`` raises at the call."""

from __future__ import annotations

import re

import pytest
import torch

from tests.host_reads import count_host_reads
from tests.problems import make_problem, run_op
from tplogp import LinearLogpInputError, check_errors, get_op


@pytest.mark.parametrize("ignore", [None, -100], ids=["plain", "ignore-index"])
@pytest.mark.parametrize("mode", ["full", "fast", "sync"])
def test_host_reads_per_call(mode, ignore, monkeypatch):
    """Forward + backward of one call without a group: with the default checks the only host read is that of the
    previous call's verdict, which was copied to the host asynchronously (on a GPU: pinned memory, behind an event
    the device passed long ago), so nothing waits for the device. The counter does count: ``sync`` shows its read
    of the targets' range at the call, and ignore_index the read of its row compaction in every mode."""
    monkeypatch.setenv("TPLOGP_CHECKS", mode)
    op = get_op("linear_logp", source="native")
    p = make_problem((3, 11), 16, 97, torch.float32, True, seed=3, ignore_index=ignore,
                     ignore_fraction=0.3 if ignore is not None else 0.0)
    kw = {} if ignore is None else {"ignore_index": ignore}
    run_op(op, p, entropy=True, **kw)  # warm: lazy probes, and a first pending verdict
    with count_host_reads() as reads:
        run_op(op, p, entropy=True, **kw)
        run_op(op, p, entropy=True, **kw)
    expected = {"full": ["Tensor.tolist in raise_pending_errors"], "fast": [],
                "sync": ["Tensor.tolist in summarize_targets"]}[mode]
    if ignore is not None:
        expected = expected + ["aten.nonzero.default in localize_call"]
    assert sorted(reads) == sorted(2 * expected), reads
    check_errors()


def test_check_errors_raises_the_pending_verdict_once(monkeypatch):
    monkeypatch.setenv("TPLOGP_CHECKS", "full")
    op = get_op("linear_logp", source="native")
    h, w = torch.randn(5, 8), torch.randn(20, 8)
    op(h, w, torch.tensor([0, 1, 2, 3, 4]))
    check_errors()  # a good call leaves nothing to raise
    out = op(h, w, torch.tensor([0, 25, 2, -3, 4]))
    assert torch.isnan(out).tolist() == [False, True, False, True, False]
    with pytest.raises(LinearLogpInputError, match=r"target id -3 is outside the vocabulary \[0, 20\)"):
        check_errors()
    check_errors()


def test_fast_mode_drops_nothing_pending(monkeypatch):
    """A fast-mode call neither raises nor clears the verdict of an earlier full-mode call."""
    op = get_op("linear_logp", source="native")
    h, w = torch.randn(3, 4), torch.randn(6, 4)
    monkeypatch.setenv("TPLOGP_CHECKS", "full")
    op(h, w, torch.tensor([0, 9, 1]))
    monkeypatch.setenv("TPLOGP_CHECKS", "fast")
    op(h, w, torch.tensor([0, 1, 2]))
    with pytest.raises(LinearLogpInputError, match="target id 9 is outside"):
        check_errors()


@pytest.mark.tp(world_size=4, timeout=120)
@pytest.mark.parametrize("mode", ["full", "sync"])
def test_tp_target_errors_at_the_call_on_every_rank(tp, mode):
    """With a group the target verdict travels in the one record exchange: every rank raises the same error at the
    call, and nothing is left pending for a later call."""
    import os

    from tplogp.shards import shard_boundaries, shard_range

    old = os.environ.get("TPLOGP_CHECKS")
    os.environ["TPLOGP_CHECKS"] = mode
    try:
        start, end = shard_range(shard_boundaries(64, tp.world_size, uneven=True), tp.rank)
        h, w = torch.randn(6, 8), torch.randn(end - start, 8)
        op = get_op("linear_logp", source="native")
        outcome = []
        for t in (torch.tensor([0, 5, 63, 64, 2, 1]), torch.tensor([0, 5, 63, 7, 2, 1])):
            with count_host_reads() as reads:
                try:
                    op(h, w, t, tp_group=tp.group, vocab_start_index=start)
                    outcome.append("ok")
                except LinearLogpInputError as exc:
                    outcome.append(str(exc))
            outcome.append(reads)
        check_errors()  # nothing deferred with a group
    finally:
        if old is None:
            os.environ.pop("TPLOGP_CHECKS")
        else:
            os.environ["TPLOGP_CHECKS"] = old
    everyone = tp.all_gather_object(outcome)
    assert all(o == everyone[0] for o in everyone), everyone
    assert re.search(r"target id 64 is outside the vocabulary \[0, 64\)", everyone[0][0]), everyone[0]
    # one host read per call: the record exchange, which carries the targets' checksum and range
    assert everyone[0][1:] == [["Tensor.tolist in run"], "ok", ["Tensor.tolist in run"]], everyone[0]
