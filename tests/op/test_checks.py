"""Checks without host syncs: the default (``full``) checks of a call without a TP group read
nothing on the host; their verdict is raised by the next call (or ``tplogp.check_errors``); with a
group they read nothing from the device either, and every rank raises the same error at the next
call with the group; ``sync`` raises at the call."""

from __future__ import annotations

import re

import pytest
import torch

from tests.support.host_reads import count_host_reads, is_tplogp_file
from tests.support.problems import make_problem, run_op
from tplogp import LinearLogpInputError, check_errors, get_op


@pytest.mark.parametrize("ignore", [None, -100], ids=["plain", "ignore-index"])
@pytest.mark.parametrize("mode", ["full", "fast", "sync"])
def test_host_reads_per_call(mode, ignore, monkeypatch):
    """Forward + backward of one call without a group: with the default checks the only host read is
    that of the previous call's verdict, which was copied to the host asynchronously (on a GPU:
    pinned memory, behind an event the device passed long ago), so nothing waits for the device. The
    counter does count: ``sync`` shows its read of the targets' range at the call, and ignore_index
    the read of its row compaction in every mode."""
    monkeypatch.setenv("TPLOGP_CHECKS", mode)
    op = get_op("linear_logp", source="native")
    p = make_problem((3, 11), 16, 97, torch.float32, True, seed=3, ignore_index=ignore,
                     ignore_fraction=0.3 if ignore is not None else 0.0)
    kw = {} if ignore is None else {"ignore_index": ignore}
    run_op(op, p, entropy=True, **kw)  # warm: lazy probes, and a first pending verdict
    with count_host_reads() as reads:
        run_op(op, p, entropy=True, **kw)
        run_op(op, p, entropy=True, **kw)
    expected = {"full": ["Tensor.tolist in read_summary"], "fast": [],
                "sync": ["Tensor.tolist in summarize_targets"]}[mode]
    if ignore is not None:
        expected = expected + ["aten.nonzero.default in localize"]
    assert sorted(reads) == sorted(2 * expected), reads
    check_errors()


def test_host_reads_name_tplogp_frames_by_the_package_directory(tmp_path):
    """The read counter names the tplogp function of a read by the package's directory: torch's
    files below a checkout named tplogp (its environment inside it) are not tplogp's, nor is the
    plugin."""
    import pytest_tplogp
    import tplogp.op.plan

    site = tmp_path / "tplogp" / ".venv" / "lib" / "site-packages"
    venv_torch = site / "torch" / "nn" / "functional.py"
    assert not is_tplogp_file(str(venv_torch))
    assert not is_tplogp_file(torch.nn.functional.__file__)
    assert not is_tplogp_file(pytest_tplogp.__file__)
    assert is_tplogp_file(tplogp.op.plan.__file__)


def test_check_errors_raises_the_pending_verdict_once(monkeypatch):
    monkeypatch.setenv("TPLOGP_CHECKS", "full")
    op = get_op("linear_logp", source="native")
    # (a call that records a graph defers its verdict)
    h, w = torch.randn(5, 8, requires_grad=True), torch.randn(20, 8)
    op(h, w, torch.tensor([0, 1, 2, 3, 4]))
    check_errors()  # a good call leaves nothing to raise
    out = op(h, w, torch.tensor([0, 25, 2, -3, 4])).detach()
    assert torch.isnan(out).tolist() == [False, True, False, True, False]
    with pytest.raises(LinearLogpInputError,
                       match=r"target id -3 is outside the vocabulary \[0, 20\)"):
        check_errors()
    check_errors()


def test_fast_mode_drops_nothing_pending(monkeypatch):
    """A fast-mode call neither raises nor clears the verdict of an earlier full-mode call."""
    op = get_op("linear_logp", source="native")
    h, w = torch.randn(3, 4, requires_grad=True), torch.randn(6, 4)
    monkeypatch.setenv("TPLOGP_CHECKS", "full")
    op(h, w, torch.tensor([0, 9, 1]))
    monkeypatch.setenv("TPLOGP_CHECKS", "fast")
    op(h, w, torch.tensor([0, 1, 2]))
    with pytest.raises(LinearLogpInputError, match="target id 9 is outside"):
        check_errors()


def _calls(tp, targets_per_call, finish=None, graph=True):
    """Run ``linear_logp`` once per target tensor on uneven shards of a 64-id vocab; per call the
    outcome ("ok" or the error) and the host reads it made. ``finish``: called last (check_errors),
    its outcome appended too. ``graph``: whether the calls record an autograd graph (hidden requires
    grad; no backward runs)."""
    from tplogp.support.shards import shard_boundaries, shard_range

    start, end = shard_range(shard_boundaries(64, tp.world_size, uneven=True), tp.rank)
    h, w = torch.randn(6, 8).requires_grad_(graph), torch.randn(end - start, 8)
    op = get_op("linear_logp", source="native")
    outcome = []
    for t in targets_per_call:
        out = None
        with count_host_reads() as reads:
            try:
                out = op(h, w, t(tp.rank) if callable(t) else t, tp_group=tp.group,
                         vocab_start_index=start)
            except LinearLogpInputError as exc:
                outcome.append(str(exc))
        if out is not None:
            outcome.append("ok" if torch.isfinite(out).all() else "nan")
        outcome.append(reads)
    if finish is not None:
        try:
            finish()
            outcome.append("ok")
        except LinearLogpInputError as exc:
            outcome.append(str(exc))
    return outcome


BAD = torch.tensor([0, 5, 63, 64, 2, 1])
GOOD = torch.tensor([0, 5, 63, 7, 2, 1])


@pytest.mark.tp(world_size=4, timeout=120)
def test_tp_sync_checks_raise_at_the_call_on_every_rank(tp, monkeypatch):
    """``sync`` with a group: the targets' summary travels in the call's record exchange (its one
    host read), so every rank raises the same error at the call, and nothing is left pending."""
    monkeypatch.setenv("TPLOGP_CHECKS", "sync")  # per rank, undone after the test
    outcome = _calls(tp, [BAD, GOOD], finish=lambda: check_errors(tp.group))
    everyone = tp.all_gather_object(outcome)
    assert all(o == everyone[0] for o in everyone), everyone
    assert re.search(r"target id 64 is outside the vocabulary \[0, 64\)",
                     everyone[0][0]), everyone[0]
    assert "previous" not in everyone[0][0]
    assert everyone[0][1:] == [["Tensor.tolist in _exchange"], "ok", ["Tensor.tolist in _exchange"],
                               "ok"], everyone[0]


@pytest.mark.tp(world_size=4, timeout=120)
def test_tp_full_checks_raise_at_the_next_call_on_every_rank(tp, monkeypatch):
    """The default checks with a group read nothing from the device: the record goes over a CPU
    group, and the targets' summary of a call travels in the next call's record. So a bad call gives
    NaN for its uncovered token, and the next call with the group raises the same error on every
    rank before any collective of its own, once; ``check_errors(group)`` raises it at once
    instead."""
    monkeypatch.setenv("TPLOGP_CHECKS", "full")
    nxt = _calls(tp, [GOOD, BAD, GOOD, GOOD])
    now = _calls(tp, [BAD], finish=lambda: check_errors(tp.group))
    clean = _calls(tp, [GOOD], finish=lambda: check_errors(tp.group))
    everyone = tp.all_gather_object((nxt, now, clean))
    assert all(o == everyone[0] for o in everyone), everyone
    nxt, now, clean = everyone[0]
    assert nxt[0] == "ok" and nxt[2] == "nan" and nxt[6] == "ok", nxt
    assert re.search(r"target id 64 is outside the vocabulary \[0, 64\) \[found by the check of the previous "
                     r"linear_logp call with this TP group", nxt[4]), nxt
    # per call: the CPU record's read (host values only) and the pinned copy of the previous call's
    # summary
    for reads in nxt[1::2]:
        assert set(reads) <= {"Tensor.tolist in _exchange", "Tensor.tolist in read_summary"}, reads
        assert reads.count("Tensor.tolist in _exchange") == 1, reads
    assert now[0] == "nan" and "target id 64 is outside" in now[2] and clean[::2] == ["ok", "ok"], (now, clean)


@pytest.mark.tp(world_size=[2, 4], timeout=120)
def test_tp_full_checks_of_a_call_without_graph_raise_at_the_call(tp, monkeypatch):
    """A call that records no autograd graph (no_grad: a GRPO step's old / reference log-probs) has
    no backward to carry its verdict: with the default checks it reads its own targets' summary at
    the call and exchanges it over the CPU group, so every rank raises the same error at that call
    (no NaN handed out), and the group goes on."""
    monkeypatch.setenv("TPLOGP_CHECKS", "full")
    with torch.no_grad():
        outcome = _calls(tp, [GOOD, BAD, GOOD, lambda rank: GOOD + rank],
                         finish=lambda: check_errors(tp.group), graph=False)
    everyone = tp.all_gather_object(outcome)
    assert all(o == everyone[0] for o in everyone), everyone
    outcome = everyone[0]
    assert outcome[0] == "ok" and outcome[4] == "ok" and outcome[8] == "ok", outcome
    assert re.search(r"target id 64 is outside the vocabulary \[0, 64\) \[checked at the call: "
                     r"it records no autograd graph", outcome[2]), outcome
    assert re.search(r"target_ids \(they must be replicated.*rank 0: #[0-9a-f]+, "
                     r"rank 1: #[0-9a-f]+.*checked at the call", outcome[6]), outcome
    # per call: the CPU record's read and the exchange of the call's own summary (one small host
    # read of it)
    for reads in outcome[1:8:2]:
        assert sorted(reads) == ["Tensor.tolist in _exchange",
                                 "Tensor.tolist in _judge_group_summary",
                                 "Tensor.tolist in read_summary"], reads


@pytest.mark.tp(world_size=2, timeout=120)
@pytest.mark.parametrize("mode", ["full", "sync"])
def test_tp_targets_that_differ_between_ranks(tp, mode, monkeypatch):
    """Targets that are not replicated: every rank raises the same error naming each rank's checksum
    (at the call with ``sync``, at the next call with the default checks)."""
    monkeypatch.setenv("TPLOGP_CHECKS", mode)
    outcome = _calls(tp, [lambda rank: GOOD + rank, GOOD])
    everyone = tp.all_gather_object(outcome)
    assert all(o == everyone[0] for o in everyone), everyone
    raised = everyone[0][0 if mode == "sync" else 2]
    assert re.search(r"target_ids \(they must be replicated.*rank 0: #[0-9a-f]+, rank 1: #[0-9a-f]+", raised), raised
    assert ("previous linear_logp call" in raised) == (mode == "full"), raised


# a pool recycled for a "leaked" companion fails
@pytest.mark.filterwarnings("error::pytest.PytestWarning")
@pytest.mark.tp(world_size=4, timeout=120)
def test_host_group_companion_of_a_device_group(tp):
    """A group whose backend takes no CPU tensors (NCCL; here a gloo sub-group reported as NCCL)
    gets a gloo companion over its ranks, made by those ranks alone (the other sub-group makes its
    own at the same time), kept for the process and not counted as a leaked group by the plugin;
    when no rank can make one, every rank gets None (and the checks keep to the device group)."""
    from unittest import mock

    import torch.distributed as dist

    from tplogp.support import comm

    # every rank creates both (as dist.new_group wants)
    low, high = tp.new_group([0, 1]), tp.new_group([2, 3])
    mine = low if tp.rank < 2 else high
    real_backend = dist.get_backend
    as_nccl = mock.patch.object(comm.dist, "get_backend",
                                lambda g=None: "nccl" if g is mine else real_backend(g))
    with as_nccl:
        companion = comm.host_group(mine, torch.device("cpu"))
        assert companion is not None and companion is not mine
        assert comm.host_group(mine, torch.device("cpu")) is companion  # made once
        assert dist.get_process_group_ranks(companion) == dist.get_process_group_ranks(mine)
        got = comm.all_gather_flat(torch.tensor([tp.rank]), companion).tolist()
        assert got == ([0, 1] if tp.rank < 2 else [2, 3]), got
        assert companion in comm.host_groups()
        # a rank set for which gloo cannot be made: every rank of it gets None
        other = tp.new_group([0, 1, 2, 3])
        with mock.patch.object(comm.dist, "get_backend", lambda g=None: "nccl"), \
                mock.patch.object(comm.dist, "new_group", side_effect=RuntimeError("no gloo here")):
            assert comm.host_group(other, torch.device("cpu")) is None
            # remembered, no second attempt
            assert comm.host_group(other, torch.device("cpu")) is None
