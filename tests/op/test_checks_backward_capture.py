"""A bad target never updates a model silently, and the default checks work under a (simulated)
CUDA-graph capture.

Default checks (``full``): the backward of the call that had a target outside the vocabulary raises
before it writes any gradient (the parameters keep no ``.grad``, so ``optimizer.step()`` is never
reached), on one process and on every rank of a gloo group alike. Under a capture (simulated on the
CPU by answering "capturing" from ``tplogp.support.tensors.is_capturing``, which the call path
consults) nothing is read on the host: the verdict is a device flag, the captured backward zeroes
the call's gradients when it is set, and ``check_errors`` (or the next call outside the capture)
raises after the "replay"."""

from __future__ import annotations

import re

import pytest
import torch

from tests.support.interpreter import interpreter_only as triton_interpreter
from tplogp import LinearLogpInputError, check_errors, get_op, linear_logp_loss
from tplogp.op import verdicts
from tplogp.support import tensors

V, D = 20, 8
GOOD = torch.tensor([0, 3, 19, 7, 2, 1])
BAD = torch.tensor([0, 3, 25, 7, 2, 1])  # 25 is outside [0, 20)


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(D, V, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g) / D ** 0.5)
        head.bias.copy_(torch.randn(V, generator=g) * 0.1)
    hidden = torch.randn(len(GOOD), D, generator=g)
    return head, hidden


def _logp_step(head, hidden, targets, **kw):
    op = get_op("linear_logp", source="native")
    h = hidden.clone().requires_grad_()
    logp = op(h, head.weight, targets, head.bias, **kw)
    return logp, (lambda: (-logp.sum()).backward())


def _loss_step(head, hidden, targets, **kw):
    h = hidden.clone().requires_grad_()
    loss = linear_logp_loss(h, head.weight, targets, head.bias, loss=lambda lp, ent: -lp,
                            source="native", **kw)
    return loss, loss.backward


@pytest.mark.parametrize("step", [_logp_step, _loss_step], ids=["linear_logp", "linear_logp_loss"])
def test_a_training_step_with_a_bad_target_raises_before_step(step, monkeypatch):
    monkeypatch.delenv("TPLOGP_CHECKS", raising=False)
    head, hidden = _model()
    before = [p.detach().clone() for p in head.parameters()]
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    _, backward = step(head, hidden, BAD)  # the forward reads nothing on the host: no error yet
    with pytest.raises(LinearLogpInputError,
                       match=r"target id 25 is outside the vocabulary \[0, 20\) \[found by "
                                                  r"the backward of the linear_logp call that had it"):
        backward()
        opt.step()
    assert all(p.grad is None for p in head.parameters())
    assert all(torch.equal(p, b) for p, b in zip(head.parameters(), before))
    check_errors()  # raised once: nothing left pending
    _, backward = step(head, hidden, GOOD)  # and the next step runs
    backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in head.parameters())


def test_fast_checks_give_finite_gradients_for_a_bad_target(monkeypatch):
    """``TPLOGP_CHECKS=fast`` checks no target: the bad row's logp is NaN and its gradient is its
    softmax term alone (docs/operator.md says so); nothing raises."""
    monkeypatch.setenv("TPLOGP_CHECKS", "fast")
    head, hidden = _model()
    logp, backward = _logp_step(head, hidden, BAD)
    assert torch.isnan(logp).tolist() == [False, False, True, False, False, False]
    backward()
    check_errors()
    assert torch.isfinite(head.weight.grad).all()


@pytest.fixture
def capturing(monkeypatch):
    """Calls in its ``with`` block run as if a CUDA graph were being captured."""
    state = {"on": False}
    real = tensors.is_capturing
    monkeypatch.setattr(tensors, "is_capturing", lambda device: state["on"] or real(device))
    monkeypatch.setattr(verdicts, "_captured", {})  # this test's captured calls only
    monkeypatch.delenv("TPLOGP_CHECKS", raising=False)

    class Capture:
        def __enter__(self):
            state["on"] = True

        def __exit__(self, *exc):
            state["on"] = False

    check_errors()
    yield Capture()
    state["on"] = False
    try:
        check_errors()
    except LinearLogpInputError:
        pass


@pytest.mark.parametrize("ignore_index", [None, -100], ids=["plain", "ignore-index"])
def test_captured_checks_read_nothing_and_the_flag_surfaces_after_replay(capturing, ignore_index):
    from tests.support.host_reads import count_host_reads

    head, hidden = _model()
    targets = BAD.clone()
    kw = {}
    if ignore_index is not None:
        # kept in place under a capture (no compaction: that needs a host read)
        targets[1] = ignore_index
        kw["ignore_index"] = ignore_index
    with count_host_reads() as reads:
        with capturing:
            logp, backward = _logp_step(head, hidden, targets, **kw)
            backward()
    assert reads == [], reads
    assert torch.isnan(logp).tolist() == [False, False, True, False, False, False]
    if ignore_index is not None:
        assert logp[1].item() == 0.0
    # the captured backward zeroes the call's gradients when its flag is set: a step changes nothing
    assert all(torch.count_nonzero(p.grad) == 0 for p in head.parameters())
    with pytest.raises(LinearLogpInputError,
                       match=r"a target id is outside the vocabulary \[0, 20\).*captured in "
                                                  r"a CUDA graph"):
        check_errors()
    check_errors()  # raised once per replay
    # what a second replay with the bad target does to the flag
    verdicts._captured[""][-1].bad.fill_(True)
    with pytest.raises(LinearLogpInputError, match="captured in a CUDA graph"):
        check_errors()


def test_captured_good_targets_give_the_eager_gradients_and_the_next_call_raises_a_bad_replay(capturing):
    head, hidden = _model()
    _, backward = _logp_step(head, hidden, GOOD)
    backward()
    eager = [p.grad.clone() for p in head.parameters()]
    head.zero_grad(set_to_none=True)
    with capturing:
        _, backward = _logp_step(head, hidden, GOOD)
        backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(head.parameters(), eager))
    check_errors()  # a good flag raises nothing
    with capturing:
        _logp_step(head, hidden, BAD)
    # the next call outside a capture
    with pytest.raises(LinearLogpInputError, match="captured in a CUDA graph"):
        _logp_step(head, hidden, GOOD)


def test_captured_fused_loss_zeroes_its_gradients(capturing):
    head, hidden = _model()
    with capturing:
        loss, backward = _loss_step(head, hidden, BAD)
        backward()
    assert all(torch.count_nonzero(p.grad) == 0 for p in head.parameters())
    with pytest.raises(LinearLogpInputError, match="captured in a CUDA graph"):
        check_errors()


def test_sync_checks_refuse_a_capture_with_a_clear_error(capturing, monkeypatch):
    monkeypatch.setenv("TPLOGP_CHECKS", "sync")
    head, hidden = _model()
    with capturing, pytest.raises(LinearLogpInputError,
                                  match=r"TPLOGP_CHECKS=sync .* CUDA-graph capture"):
        _logp_step(head, hidden, GOOD)


@pytest.mark.tp(world_size=2, timeout=120)
@pytest.mark.parametrize("bad", ["range", "differ"])
def test_tp_a_bad_target_raises_in_the_backward_on_every_rank(tp, bad, monkeypatch):
    """Gloo ranks: the backward of the call with a bad target (outside the vocabulary, or targets
    that differ between ranks) raises the same error on every rank before its d_hidden all-reduce
    (no hang), and no rank's parameters get a gradient; the next step runs."""
    from tplogp.support.shards import shard_boundaries, shard_range

    monkeypatch.delenv("TPLOGP_CHECKS", raising=False)
    start, end = shard_range(shard_boundaries(64, tp.world_size, uneven=True), tp.rank)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, D, generator=g)
    weight = torch.nn.Parameter(torch.randn(64, D, generator=g)[start:end].clone())
    op = get_op("linear_logp", source="native")
    good = torch.tensor([0, 5, 63, 7, 2, 1])
    targets = {"range": torch.tensor([0, 5, 63, 64, 2, 1]), "differ": good + tp.rank}[bad]
    outcome = []
    for t in (targets, good):
        h = hidden.clone().requires_grad_()
        logp = op(h, weight, t, tp_group=tp.group, vocab_start_index=start)
        try:
            (-logp.sum()).backward()
            outcome.append("ok" if weight.grad is not None else "no grad")
        except LinearLogpInputError as exc:
            outcome.append(str(exc) + (" [grad]" if weight.grad is not None else ""))
        weight.grad = None
    everyone = tp.all_gather_object(outcome)
    assert all(o == everyone[0] for o in everyone), everyone
    first, second = everyone[0]
    expected = (r"target id 64 is outside the vocabulary \[0, 64\)" if bad == "range"
                else r"target_ids \(they must be replicated")
    assert re.search(expected, first) and "found by the backward" in first and "[grad]" not in first, first
    assert second == "ok", second


def test_compiled_backward_raises_a_bad_target_before_any_gradient(monkeypatch):
    """Under torch.compile the op's backward (a separate ``torch.library`` op) settles the latest
    call's verdict."""
    monkeypatch.delenv("TPLOGP_CHECKS", raising=False)
    op = get_op("linear_logp", source="native")
    head, hidden = _model()
    fn = torch.compile(lambda h, w, t, b: -op(h, w, t, b).sum(), backend="aot_eager",
                       fullgraph=True)
    loss = fn(hidden.clone().requires_grad_(), head.weight, BAD, head.bias)
    with pytest.raises(LinearLogpInputError, match="found by the backward"):
        loss.backward()
    assert all(p.grad is None for p in head.parameters())
    check_errors()
    fn(hidden.clone().requires_grad_(), head.weight, GOOD, head.bias).backward()
    w_eager, b_eager = (t.detach().clone().requires_grad_() for t in (head.weight, head.bias))
    (-op(hidden.clone(), w_eager, GOOD, b_eager).sum()).backward()
    # the good call's gradient, as eager computes it
    assert torch.equal(head.weight.grad, w_eager.grad)


@triton_interpreter
def test_kernel_target_check_keeps_each_calls_verdict_across_slot_reuse(monkeypatch):
    """The triton source's finishing kernel writes the target verdict into a host slot
    (tplogp.checks KernelTargetCheck); slots are reused round-robin. A call whose backward runs
    after its slot was reused (many forwards that record a graph accumulated before one backward)
    still gets its own verdict; the bad call that reused the slot is raised by check_errors,
    once."""
    monkeypatch.delenv("TPLOGP_CHECKS", raising=False)
    check_errors()
    head, hidden = _model(3)
    op = get_op("linear_logp", source="triton")
    h = hidden.clone().requires_grad_()
    first = op(h, head.weight, GOOD, head.bias)  # good; its backward runs last
    # calls that record a graph defer their verdict to their backward (never run here)
    for _ in range(verdicts.FlagSlots.SIZE - 1):
        op(hidden.clone().requires_grad_(), head.weight, GOOD, head.bias)
    # takes the first call's slot
    bad = op(hidden.clone().requires_grad_(), head.weight, BAD, head.bias).detach()
    assert torch.isnan(bad[2]) and torch.isfinite(bad[[0, 1, 3, 4, 5]]).all()
    (-first.sum()).backward()  # the first call's own verdict: good
    with pytest.raises(LinearLogpInputError,
                       match=r"target id 25 is outside the vocabulary \[0, 20\)"):
        check_errors()
    check_errors()
    h_again = hidden.clone().requires_grad_()
    (-op(h_again, head.weight, GOOD, head.bias).sum()).backward()
    assert torch.equal(h.grad, h_again.grad)  # the gradient the good call gets on its own


@triton_interpreter
@pytest.mark.parametrize("bad_id", [-4, 25])
def test_kernel_target_check_raises_in_the_backward_and_in_a_later_forward(bad_id, monkeypatch):
    """With the verdict in the triton source's kernel: a bad target raises in the same call's
    backward with nothing handed to the parameters; a no-grad call's bad target raises at the call
    itself (no backward would carry it), and a later call runs."""
    monkeypatch.delenv("TPLOGP_CHECKS", raising=False)
    check_errors()
    head, hidden = _model(4)
    op = get_op("linear_logp", source="triton")
    targets = BAD.clone()
    targets[2] = bad_id
    h = hidden.clone().requires_grad_()
    logp = op(h, head.weight, targets, head.bias)
    with pytest.raises(LinearLogpInputError,
                       match=rf"target id {bad_id} is outside the vocabulary \[0, 20\) "
                                                   r"\[found by the backward"):
        (-logp.sum()).backward()
    assert h.grad is None and all(p.grad is None for p in head.parameters())
    with torch.no_grad():
        message = rf"target id {bad_id} is outside the vocabulary \[0, 20\) \[checked at the call"
        with pytest.raises(LinearLogpInputError, match=message):
            op(hidden, head.weight, targets, head.bias)
        assert torch.isfinite(op(hidden, head.weight, GOOD, head.bias)).all()
    check_errors()


def test_kernel_target_check_slots_share_one_alignment():
    """Every host slot a kernel writes its verdict into has the same 16-byte alignment: Triton
    specializes a compiled kernel on its pointers' 16-byte alignment, so 8-byte slots taken
    round-robin would make each finishing kernel keep two compilations (and launch through the JIT
    again on the second). The host values read and write the slots the kernels see."""
    slots = verdicts.FlagSlots(pinned=False)
    flags = [slots.take(object())[1] for _ in range(slots.SIZE)]
    assert len({f.data_ptr() % 16 for f in flags}) == 1
    flags[5].fill_(7)
    assert int(slots.values[5]) == 7 and int(slots.values[4]) == 0
    slots.values[6] = 3
    assert int(flags[6]) == 3
