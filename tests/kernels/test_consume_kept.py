"""The per-token op's keep-all backward on the triton source (CPU interpreter): when no later
backward can read the kept terms (the graph is not retained, no saved-tensor hooks hold them, not
under a compiler), the backward writes d_logits in place of them and runs one full-size d_hidden and
one d_W GEMM, with no d_logits workspace; otherwise (``retain_graph=True``, saved-tensor hooks, the
compiled op) it reads them and leaves them as the forward wrote them. Either way the gradients are
the same bits here (one chunk, the same GEMMs), a repeated backward through a retained graph gives
them again, and a fullgraph compile has no graph break and eager's gradients. The native source
reads its kept tiles even when told it may consume them.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tplogp
from tests.support.problems import make_problem, run_reference
from tests.support.fullgraph import compile_fullgraph
from tests.support.interpreter import interpreter_only as triton_interpreter
from tplogp.backends import memory_budget
from tplogp.kernels import kept as kept_layout, backward_programs
from tplogp.tolerances import assert_no_worse

TRITON = tplogp.get_op("linear_logp", source="triton")
# one 256-column unit plus a partial one: the whole shard is kept only with a keep-all budget
N, D, V = 24, 32, 300


class Allocations(TorchDispatchMode):
    """Shapes of the tensors of ``dtype`` with at least ``numel`` elements allocated inside the
    mode."""

    def __init__(self, dtype: torch.dtype, numel: int):
        super().__init__()
        self.dtype, self.numel, self.found = dtype, numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (isinstance(out, torch.Tensor) and out.dtype == self.dtype and out.numel() >= self.numel
                and func in (torch.ops.aten.empty.memory_format,
                             torch.ops.aten.empty_strided.default)):
            self.found.append(tuple(out.shape))
        return out


@pytest.fixture
def in_place(monkeypatch):
    """One entry per kept d_logits launch: whether it wrote d_logits over the kept terms it read."""
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    seen = []
    real = backward_programs.launch_dlogits_kept

    def launch(kept, *args, **options):
        seen.append(args[7].data_ptr() == kept.values.data_ptr())  # args[7]: dz
        return real(kept, *args, **options)

    monkeypatch.setattr(backward_programs, "launch_dlogits_kept", launch)
    return seen


def _budget(dtype):
    return tplogp.keep_logits_budget(N, V, source="triton", device="cpu", dtype=dtype)


def _leaves(p):
    return [x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias)]


def _loss(leaves, p, dtype):
    h, w, b = leaves
    logp, entropy = TRITON(h, w, p.target, b, return_entropy=True, workspace_bytes=_budget(dtype))
    return (logp * p.g_logp).sum() + (entropy * p.g_entropy).sum()


@triton_interpreter
@pytest.mark.parametrize("dtype",
                         [pytest.param(torch.bfloat16, marks=pytest.mark.slow), torch.float32],
                         ids=["bf16", "fp32"])
def test_keep_all_backward_consumes_the_kept_terms_only_when_no_backward_follows(in_place, dtype):
    p = make_problem((N,), D, V, dtype, True, seed=11, peaked=True)
    # retain_graph=True: read-only (a d_logits workspace); the second backward, which frees the
    # graph, consumes
    leaves = _leaves(p)
    loss = _loss(leaves, p, dtype)
    with Allocations(dtype, N * 256) as retained:
        loss.backward(retain_graph=True)
    first = [x.grad.clone() for x in leaves]
    with Allocations(dtype, N * 256) as consumed:
        loss.backward()
    assert in_place == [False, True]
    assert (N, V) in retained.found and not consumed.found, (retained.found, consumed.found)
    for x, g in zip(leaves, first):
        assert torch.equal(x.grad, 2 * g)  # the second backward gave the first one's bits
    # a plain backward consumes at once: the same bits as the read-only schedule
    in_place.clear()
    leaves = _leaves(p)
    _loss(leaves, p, dtype).backward()
    assert in_place == [True]
    for x, g in zip(leaves, first):
        assert torch.equal(x.grad, g)
    truth = run_reference(p, "float64", entropy=True)
    ref = run_reference(p, "matching" if dtype != torch.float32 else "fp32", entropy=True)
    for name, x in zip(("d_hidden", "d_weight", "d_bias"), leaves):
        assert_no_worse(f"consumed {name}", x.grad, getattr(ref, name), getattr(truth, name), dtype)
    # torch.autograd.grad frees the graph too; saved-tensor hooks (a pack hook may hold the buffer)
    # keep it read-only
    in_place.clear()
    leaves = _leaves(p)
    grads = torch.autograd.grad(_loss(leaves, p, dtype), leaves)
    held = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t):
        leaves = _leaves(p)
        loss = _loss(leaves, p, dtype)
    kept = [t for t in held if tuple(t.shape) == (N, V)]  # the kept terms (their scales apart)
    assert len(kept) == 1
    before = kept[0].clone()
    loss.backward()
    assert in_place == [True, False]
    assert torch.equal(kept[0], before)  # what the hook holds is still what the forward kept
    for x, a, g in zip(leaves, grads, first):
        assert torch.equal(a, g) and torch.equal(x.grad, g)


@triton_interpreter
def test_consumed_keep_all_holds_no_workspace_beyond_the_kept_buffer(in_place):
    """The budget's accounting: ``keep_logits_budget`` = the default d_logits workspace (what a
    read-only backward through a retained graph uses) + what is kept (the terms' buffer and the
    scales, in two allocations on the eager path); the consuming backward allocates nothing of the
    d_logits size beyond it."""
    dtype = torch.bfloat16
    p = make_problem((N,), D, V, dtype, True, seed=12)
    from tplogp.backends.triton_backend import TritonBackend

    be = TritonBackend()
    budget = _budget(dtype)
    assert budget == memory_budget.DLOGITS_WORKSPACE_BYTES + be.kept_bytes(N, V, dtype,
                                                                           torch.device("cpu"))
    held = []

    def pack(t):
        held.append(t.numel() * t.element_size() if tuple(t.shape) == (N, V) else 0)
        return t

    leaves = _leaves(p)
    with Allocations(dtype, N * 16) as seen:
        loss = _loss(leaves, p, dtype)
        forward_allocations = list(seen.found)
        loss.backward()
    assert in_place == [True]
    # the kept terms, in their own [N, V] buffer; no logits, no d_logits workspace
    assert forward_allocations == [(N, V)] and seen.found == [(N, V)], seen.found
    # the kept terms' buffer (saved) and the scales (kept apart, so that the backward can free them
    # early) are within the budget's kept part (which counts the terms in whole fp32 words)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss(_leaves(p), p, dtype)
    value_words, scale_words = kept_layout.kept_words(N, V, 2,
                                                      be._keep_block_v(torch.device("cpu"), dtype))
    assert N * V * 2 == max(held) <= 4 * value_words < N * V * 2 + 4
    assert 4 * (value_words + scale_words) == budget - memory_budget.DLOGITS_WORKSPACE_BYTES


@pytest.mark.slow
@triton_interpreter
def test_compiled_keep_all_reads_the_kept_terms_with_eager_gradients(in_place):
    """``tplogp::linear_logp_bwd`` declares no mutation: the compiled backward runs the read-only
    schedule; fullgraph with no graph break, and the compiled gradients are eager's (consuming)
    bits."""
    dtype = torch.float32
    p = make_problem((N,), D, V, dtype, True, seed=13)
    budget = _budget(dtype)

    def loss_fn(h, w, t, b):
        logp, entropy = TRITON(h, w, t, b, return_entropy=True, workspace_bytes=budget)
        return (logp * p.g_logp).sum() + (entropy * p.g_entropy).sum()

    def run(fn):
        h, w, b = _leaves(p)
        fn(h, w, p.target, b).backward()
        return h.grad, w.grad, b.grad

    torch._dynamo.reset()
    in_place.clear()
    eager = run(loss_fn)
    assert in_place == [True]
    compiled_fn, graphs = compile_fullgraph(loss_fn)  # fullgraph: a graph break raises
    compiled = run(compiled_fn)
    assert len(graphs) == 1 and in_place == [True, False], graphs
    for c, e in zip(compiled, eager):
        assert torch.equal(c, e)


def test_native_reads_its_kept_tiles_even_when_it_may_consume_them(monkeypatch):
    from tplogp.backends.base import ShardCall
    from tplogp.backends.native import NativeBackend

    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    dtype = torch.bfloat16
    p = make_problem((N,), D, V, dtype, True, seed=14)
    be = NativeBackend()
    budget = tplogp.keep_logits_budget(N, V, source="native", device="cpu", dtype=dtype)
    grads = {}
    for consume in (False, True):
        call = ShardCall(workspace_bytes=budget, for_backward=True, consume_kept=consume)
        out = be.forward_single(p.hidden, p.weight, p.bias, p.target, call)
        assert out.kept is not None
        before = out.kept.clone()
        grads[consume] = be.backward(p.hidden, p.weight, p.bias, p.target, out.row_max, out.log_sum,
                                     p.g_logp, None, None, None, call, (True, True, True),
                                     kept=out.kept)
        assert torch.equal(out.kept, before)
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)


class _ScalesAtAllocation(TorchDispatchMode):
    """For each allocation of a gradient-shaped tensor (``shapes``), whether the latest kept scales
    were alive."""

    def __init__(self, shapes, scales_refs):
        super().__init__()
        self.shapes, self.refs, self.alive = shapes, scales_refs, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                     torch.ops.aten.empty_like.default)
                and isinstance(out, torch.Tensor) and tuple(out.shape) in self.shapes
                and self.refs):
            self.alive.append(self.refs[-1]() is not None)
        return out


def _record_kept_scales(monkeypatch) -> list:
    """Weak references to the scales of every buffer the forward keeps apart (``KeptBuffers``), in
    order."""
    import weakref

    from tplogp.backends import base

    refs = []
    real = base.KeptBuffers.__init__

    # the forward's kept buffers, from either launch path of the source
    def recording(self, values, scales):
        real(self, values, scales)
        if scales is not None and not any(r() is scales for r in refs):
            refs.append(weakref.ref(scales))

    monkeypatch.setattr(base.KeptBuffers, "__init__", recording)
    return refs


@triton_interpreter
def test_a_consuming_backward_frees_the_kept_scales_before_allocating_the_gradients(monkeypatch,
                                                                                    in_place):
    """The eager path keeps the scales apart from the terms (``ShardCall.scales_apart``). A
    consuming backward drops them once its d_logits pass has read them: they are freed before the
    d_hidden and d_W outputs are allocated (on a GPU the backward's peak is lower by the scales).
    Through a retained graph they stay for the next backward, which gives the same gradients."""
    dtype = torch.bfloat16
    p = make_problem((N,), D, V, dtype, True, seed=13)
    refs = _record_kept_scales(monkeypatch)
    grads = []
    for retain in (True, False):
        leaves = _leaves(p)
        value = _loss(leaves, p, dtype)
        assert len(refs) == 1 and refs[-1]() is not None  # held from forward to backward
        watch = _ScalesAtAllocation({(N, D), (V, D)}, refs)
        with watch:
            value.backward(retain_graph=retain)
        if retain:  # read-only: the scales stay for a later backward, which reads them again
            assert watch.alive and all(watch.alive) and refs[-1]() is not None
            first = [x.grad.clone() for x in leaves]
            for x in leaves:
                x.grad = None
            value.backward()
            assert all(torch.equal(x.grad, g) for x, g in zip(leaves, first))
        else:
            # freed before either gradient's allocation
            assert watch.alive and not any(watch.alive), watch.alive
        grads.append([x.grad for x in leaves])
        refs.clear()
    assert in_place == [False, True, True]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@triton_interpreter
def test_the_fused_loss_frees_its_kept_scales_before_allocating_the_gradients(monkeypatch,
                                                                              in_place):
    """``linear_logp_loss`` computes its gradients in the forward: the chunk's backward writes
    d_logits over the terms its forward kept and frees the kept scales before the d_hidden and d_W
    outputs are allocated, so nothing kept outlives the forward. The loss's backward only scales the
    saved gradients: through a retained graph a second backward gives the same gradients."""
    dtype = torch.bfloat16
    p = make_problem((N,), D, V, dtype, True, seed=13)
    refs = _record_kept_scales(monkeypatch)
    leaves = _leaves(p)
    watch = _ScalesAtAllocation({(N, D), (V, D)}, refs)
    with watch:
        value = tplogp.linear_logp_loss(*leaves[:2], p.target, leaves[2],
                                        loss=tplogp.losses.cross_entropy(), source="triton",
                                        with_entropy=False, workspace_bytes=_budget(dtype))
    # the forward's one chunk kept its scales apart, and freed them
    assert len(refs) == 1 and refs[-1]() is None
    assert watch.alive and not any(watch.alive), watch.alive  # before either gradient's allocation
    assert in_place == [True]  # d_logits written over the kept terms
    value.backward(retain_graph=True)
    first = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    value.backward()
    assert all(torch.equal(x.grad, g) for x, g in zip(leaves, first))
    assert in_place == [True]  # the loss's backwards launch no d_logits pass
