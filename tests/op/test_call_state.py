"""One state per call: :func:`tplogp.op.local_call.localize` builds the call's ``TPContext`` once,
with its two ``ShardCall`` objects (a sampler's support already in both), and the call's phases (the
eager forward and backward, the fused loss's chunks, forwards and backwards) run the variants they
derive (``precomputing``, ``consuming``, ``for_rows``) without replacing the context's. The native
source on CPU.
"""

from __future__ import annotations

import pytest
import torch

import tplogp
from tplogp.op import local_call

N, D, V = 12, 8, 40


def _recorded(monkeypatch) -> list:
    """``(LocalCall, its context's call, its call_for_backward)`` of every localized call."""
    seen = []
    real = local_call.localize

    def recording(*args, **kwargs):
        local = real(*args, **kwargs)
        seen.append((local, local.tpc.call, local.tpc.call_for_backward))
        return local

    monkeypatch.setattr(local_call, "localize", recording)
    return seen


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
    return hidden, weight, torch.randint(0, V, (N,), generator=g)


def _unchanged(seen: list) -> None:
    assert seen
    for local, call, for_backward in seen:
        assert local.tpc.call is call and local.tpc.call_for_backward is for_backward
        assert not call.for_backward and not call.consume_kept
        assert for_backward.for_backward and not for_backward.consume_kept


def test_an_eager_call_and_its_backward_keep_the_contexts_calls(monkeypatch):
    seen = _recorded(monkeypatch)
    hidden, weight, target = _inputs()
    op = tplogp.get_op("linear_logp", source="native")
    logp, entropy = op(hidden, weight, target, return_entropy=True)
    (logp.sum() + entropy.sum()).backward()
    assert hidden.grad is not None and len(seen) == 1
    _unchanged(seen)


@pytest.mark.parametrize("chunks", [1, 3], ids=["one-chunk", "three-chunks"])
def test_the_fused_loss_runs_its_chunks_on_derived_calls(monkeypatch, chunks):
    seen = _recorded(monkeypatch)
    hidden, weight, target = _inputs(1)
    budget = None
    if chunks > 1:  # chunks of 4 tokens
        budget = tplogp.loss_chunk_budget(4, D, V, dtype=torch.float32, source="native",
                                          device=torch.device("cpu"))
    adv = torch.randn(N)
    value = tplogp.linear_logp_loss(hidden, weight, target, loss=tplogp.losses.policy_gradient(),
                                    per_token=(adv,), source="native", workspace_bytes=budget)
    value.backward()
    assert hidden.grad is not None and len(seen) == 1
    _unchanged(seen)


def test_a_support_is_in_both_calls_of_the_context(monkeypatch):
    """The support's shard-local ids, set once in both calls (no call replaced afterwards), and
    sliced per chunk only in the derived value a chunk runs (``ShardCall.for_rows``)."""
    seen = _recorded(monkeypatch)
    hidden, weight, target = _inputs(2)
    # each row: its target and the two ids after it (distinct)
    support = (target.unsqueeze(1) + torch.arange(3)) % V
    logp = tplogp.get_op("linear_logp", source="native")(hidden, weight, target, support=support)
    logp.sum().backward()
    assert hidden.grad is not None and len(seen) == 1
    _unchanged(seen)
    (local, call, for_backward), = seen
    assert call.support is for_backward.support and torch.equal(call.support, support)
    assert call.for_rows(0, N) is call
    chunk = call.for_rows(2, 5)
    assert torch.equal(chunk.support, support[2:5]) and call.support.shape == (N, 3)
