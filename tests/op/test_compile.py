"""torch.compile: a loss that calls ``linear_logp`` compiles as one graph (no graph breaks,
``fullgraph=True``) with every option, in both check modes, with and without a TP group, and gives
eager's value and gradients (bitwise with ``aot_eager``, which runs eager's kernels).
The op pair itself passes ``torch.library.opcheck`` (schema, fake implementations, autograd
registration)."""

from __future__ import annotations


import pytest
import torch
import torch._dynamo

from tplogp import get_op, linear_logp, linear_logp_loss, losses
from tplogp.op import ops
from tplogp.tolerances import assert_no_worse
from tests.support.problems import cpu_sources, make_problem, run_reference
from tests.support import tolerances as tol
from tests.support.fullgraph import compile_fullgraph

OPTIONS = {
    "plain": {},
    "temperature": dict(temperature=0.7),
    "entropy": dict(return_entropy=True),
    "lse": dict(return_lse=True),
    "ignore_index": dict(ignore_index=-100),
    "deterministic": dict(deterministic=True),
    "workspace_bytes": dict(workspace_bytes=4096),
    # above every source's transient default: the call's logits are kept
    "keep": dict(workspace_bytes=1 << 30),
    "all": dict(temperature=1.3, return_entropy=True, return_lse=True, ignore_index=-100,
                deterministic=True, workspace_bytes=8192),
}
CHECK_MODES = ("full", "fast")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # every test compiles its own graphs (no recompile limit across parametrizations)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_loss(op, opts: dict, grads: tuple, **call_kw):
    """``sum(output * upstream gradient)`` over the outputs the options request."""

    def loss_fn(h, w, t, b):
        out = op(h, w, t, b, **opts, **call_kw)
        parts = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        loss = (parts[0] * grads[0]).sum()
        for part, g in zip(parts[1:], grads[1:]):
            loss = loss + (part * g).sum()
        return loss

    return loss_fn


def loss_and_grads(fn, p):
    h, w = p.hidden.clone().requires_grad_(), p.weight.clone().requires_grad_()
    b = None if p.bias is None else p.bias.clone().requires_grad_()
    loss = fn(h, w, p.target, b)
    loss.backward()
    return [loss.detach(), h.grad, w.grad] + ([] if b is None else [b.grad])


def assert_same_bits(compiled, eager):
    """aot_eager runs the traced graph with eager's kernels: the loss and every gradient are eager's
    bits."""
    for name, c, e in zip(("loss", "d_hidden", "d_weight", "d_bias"), compiled, eager):
        assert torch.equal(c, e), f"{name}: compiled differs from eager by {float((c - e).abs().max()):.2e}"


def compiled_in_one_graph(fn, p) -> list:
    """``fn``'s loss and gradients through ``torch.compile(fullgraph=True, backend="aot_eager")`` (a
    graph break raises there), after checking that dynamo captured one graph and that the op is in
    it."""
    compiled, graphs = compile_fullgraph(fn)
    out = loss_and_grads(compiled, p)
    assert len(graphs) == 1 and "tplogp.linear_logp_fwd" in graphs[0], graphs
    return out


def _problem(opts, seed=0, lead=(3, 11), d=24, v=97):
    ignore = opts.get("ignore_index")
    return make_problem(lead, d, v, torch.float32, True, seed=seed, ignore_index=ignore,
                        ignore_fraction=0.3 if ignore is not None else 0.0)


@pytest.mark.parametrize("mode", ["full", pytest.param("fast", marks=pytest.mark.slow)])
@pytest.mark.parametrize("opts", list(OPTIONS))
def test_compile_fullgraph_matches_eager(opts, mode, monkeypatch):
    monkeypatch.setenv("TPLOGP_CHECKS", mode)
    o = OPTIONS[opts]
    p = _problem(o, seed=len(opts))
    loss_fn = make_loss(linear_logp, o, (p.g_logp, p.g_entropy, p.g_lse) if o.get("return_entropy")
                        else (p.g_logp, p.g_lse))
    eager = loss_and_grads(loss_fn, p)
    assert_same_bits(compiled_in_one_graph(loss_fn, p), eager)


def test_compiled_against_float64_truth():
    """The op path alone (compiled) against float64: every output and gradient, the three-way
    rule."""
    o = OPTIONS["all"]
    p = _problem(o, seed=9)
    ent_lse = (p.g_logp, p.g_entropy, p.g_lse)

    def outputs(h, w, t, b):
        return linear_logp(h, w, t, b, **o)

    compiled = torch.compile(outputs, fullgraph=True, backend="aot_eager")
    h, w, b = (x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias))
    logp, entropy, lse = compiled(h, w, p.target, b)
    sum((x * g).sum() for x, g in zip((logp, entropy, lse), ent_lse)).backward()
    kw = dict(temperature=o["temperature"], ignore_index=o["ignore_index"], entropy=True, lse=True)
    truth, ref = run_reference(p, "float64", **kw), run_reference(p, "fp32", **kw)
    ours = dict(logp=logp, entropy=entropy, lse=lse, d_hidden=h.grad, d_weight=w.grad,
                d_bias=b.grad)
    for name, value in ours.items():
        assert_no_worse(name, value.detach(), getattr(ref, name), getattr(truth, name),
                        torch.float32)


def _peer_compile_problem(n: int):
    """QuACK's compile case at a CPU size: ``n`` bf16 tokens of D = 32 over V = 211, every 7th
    target -100."""
    g = torch.Generator().manual_seed(3)
    p = make_problem((n,), 32, 211, torch.bfloat16, True)
    p.hidden = (torch.randn(n, 32, generator=g) * 0.1).bfloat16()
    p.weight = (torch.randn(211, 32, generator=g) / 32 ** 0.5).bfloat16()
    p.bias = (torch.randn(211, generator=g) * 0.1).bfloat16()
    p.target = torch.randint(0, 211, (n,), generator=g)
    p.target[::7] = -100
    return p


@pytest.mark.slow
@pytest.mark.parametrize("source", cpu_sources()[1:])
def test_a_graph_traced_under_other_tiles_is_never_reused(source, monkeypatch):
    """The kept output's size depends on the source's tile config (and ``TPLOGP_WORKSPACE_MB``),
    which no argument of the op carries: the traced graph holds :func:`tplogp.op.ops.layout_key`, so
    inductor's caches never hand a graph traced under one config to a trace under another (its
    compiled code would assert the other kept size). Also the default backend (inductor) around the
    op with entropy, lse and a temperature: one graph, eager's values."""
    from dataclasses import replace

    from tplogp.backends.kernel_registry import backend_for_call
    from tplogp.kernels import tiles
    from tplogp.op.plan import clear_plans

    p = _peer_compile_problem(20)
    op = get_op("linear_logp", source=source)

    def plain(h, w, t, b):
        logp, entropy, lse = op(h, w, t, b, ignore_index=-100, return_entropy=True, return_lse=True,
                                temperature=0.9)
        return -logp.sum() + 0.5 * entropy.sum() + 0.01 * lse.sum()

    backend = backend_for_call(source, torch.device("cpu"), torch.bfloat16)
    narrow = replace(tiles.INTERPRETER, block_v=tiles.INTERPRETER.block_v // 2,
                     bwd_block_v=tiles.INTERPRETER.bwd_block_v // 2)
    for config in (narrow, tiles.INTERPRETER):  # the kept layout's scales are one per vocab tile
        monkeypatch.setattr(tiles, "INTERPRETER", config)
        monkeypatch.setitem(backend.__dict__, "_cfg_cache", {})
        monkeypatch.setattr(ops, "_LAYOUT_KEYS", {})
        clear_plans()
        torch._dynamo.reset()
        eager = loss_and_grads(plain, p)
        compiled = loss_and_grads(torch.compile(plain, fullgraph=True), p)
        # inductor's sums of the outputs
        torch.testing.assert_close(compiled[0], eager[0], **tol.INDUCTOR._asdict())
        compiled[0] = eager[0]
        # the op's backward: eager's kernels on the same upstream gradients
        assert_same_bits(compiled, eager)
    clear_plans()


def test_layout_key_is_marked_as_the_public_decorator_marks():
    """``ops.layout_key`` carries what ``torch.compiler.assume_constant_result`` sets (set without
    importing dynamo at tplogp's import): a torch whose decorator marks differently fails here."""
    def probe():
        return ""

    marked = torch.compiler.assume_constant_result(probe)
    assert vars(marked) == {"_dynamo_marked_constant": True}, vars(marked)
    assert all(getattr(ops.layout_key, name) == value for name, value in vars(marked).items())


def test_a_compiled_call_after_the_budget_setting_changed_names_the_cause(monkeypatch):
    """A graph traced under one ``TPLOGP_WORKSPACE_MB`` (whose value sizes the kept output) and run
    under another raises an error that says to retrace."""
    o = dict(return_entropy=True)
    p = _problem(o, seed=5)
    loss_fn = make_loss(get_op("linear_logp", source="native"), o, (p.g_logp, p.g_entropy))
    monkeypatch.setenv("TPLOGP_WORKSPACE_MB", "0.01")  # keeps nothing
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    assert_same_bits(loss_and_grads(compiled, p), loss_and_grads(loss_fn, p))
    monkeypatch.setenv("TPLOGP_WORKSPACE_MB", "1024")  # keeps every logit tile
    with pytest.raises(RuntimeError,
                       match=r"traced for the kept layout .* call torch._dynamo.reset\(\)"):
        loss_and_grads(compiled, p)


def test_compile_with_triton_source_and_bare_weight():
    """A bound source (``get_op``) and no bias compile the same way."""
    p = make_problem((13,), 16, 45, torch.float32, False, seed=6)
    loss_fn = make_loss(get_op("linear_logp", source="triton"), dict(return_lse=True),
                        (p.g_logp, p.g_lse))
    eager = loss_and_grads(loss_fn, p)
    assert_same_bits(compiled_in_one_graph(loss_fn, p), eager)


def test_fused_loss_with_a_plain_callable_runs_eagerly_inside_compiled_code():
    """``linear_logp_loss`` with a loss that is not a TokenLoss (any callable: it cannot cross the
    op's schema) runs eagerly inside compiled code, untraced (no GEMM in any captured graph, no
    warning from dynamo about the registry's caches), with eager's loss and gradients."""
    import warnings

    p = make_problem((12,), 16, 50, torch.float32, True, seed=5)

    def loss_fn(h, w, t, b):
        return 2 * linear_logp_loss(h, w, t, b, loss=lambda logp, entropy, adv: -adv * logp,
                                    per_token=(p.g_logp,))

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.compile(loss_fn, backend=capture)(p.hidden, p.weight, p.target, p.bias)
    traced = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert graphs and not [t for t in traced if any(k in t for k in ("mm", "linear", "matmul",
                                                                     "exp"))], traced
    eager = loss_and_grads(loss_fn, p)
    assert_same_bits(loss_and_grads(torch.compile(loss_fn, backend="aot_eager"), p), eager)


BUILD_OUTSIDE = (r"the loss .* is built inside a function that torch.compile traces; build tplogp "
                 r"losses .* once outside the compiled function")


@pytest.mark.parametrize("build", [
    pytest.param(lambda: losses.ppo_clip(0.2, 0.28), id="ppo_clip"),
    pytest.param(lambda: losses.cross_entropy() + losses.z_loss(1e-4), id="sum-of-terms"),
    pytest.param(lambda: losses.grpo("bnpo"), id="grpo"),
])
def test_a_loss_built_under_fullgraph_names_where_to_build_it(build):
    """A loss object built inside a function compiled with ``fullgraph=True`` raises dynamo's error
    with a message that says where to build it (dynamo raises at the trace, before any work);
    compiled without ``fullgraph`` the loss is built eagerly at a graph break and the value is
    eager's."""
    p = make_problem((6,), 8, 20, torch.float32, False, seed=2)
    old = -torch.rand(6)

    def loss_fn(h, w, t):
        loss = build()
        per_token = (p.g_logp, old)[:len(loss.per_token)]
        return linear_logp_loss(h, w, t, loss=loss, per_token=per_token, source="native")

    with pytest.raises(torch._dynamo.exc.Unsupported, match=BUILD_OUTSIDE):
        compile_fullgraph(loss_fn)[0](p.hidden, p.weight, p.target)
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend="eager")(p.hidden, p.weight, p.target)
    assert torch.equal(compiled, loss_fn(p.hidden, p.weight, p.target))


def test_a_loss_that_runs_eagerly_names_the_cause_under_fullgraph():
    """A ``losses.grpo(...)`` loss (built outside) runs eagerly inside compiled code: under
    ``fullgraph=True`` the graph break's message says why and what compiles as one graph."""
    p = make_problem((6,), 8, 20, torch.float32, False, seed=2)
    loss, old = losses.grpo("bnpo"), -torch.rand(6)

    def loss_fn(h, w, t):
        return linear_logp_loss(h, w, t, loss=loss, per_token=(p.g_logp, old), source="native")

    eager = r"linear_logp_loss runs eagerly inside compiled code \(a graph break, so not under "
    with pytest.raises(torch._dynamo.exc.Unsupported, match=eager + r"fullgraph=True\)"):
        compile_fullgraph(loss_fn)[0](p.hidden, p.weight, p.target)


# The peers' compile case (bf16, ignore_index -100 on every 7th token, sum and mean) at a CPU size:
# 48 tokens of D = 32 over V = 211 (one chunk); the triton source in the interpreter at 20 tokens.
# Inductor, the default backend.
FUSED_COMPILE_CASES = [pytest.param("native", 48, "sum", id="native-sum"),
                       pytest.param("native", 48, "mean", id="native-mean"),
                       pytest.param(*cpu_sources()[1].values, 20, "sum",
                                    marks=(*cpu_sources()[1].marks, pytest.mark.slow),
                                    id="triton-interpreter-sum")]


@pytest.mark.parametrize("source, n, reduction", FUSED_COMPILE_CASES)
def test_fused_loss_compiles_fullgraph_bitwise(source, n, reduction):
    """``linear_logp_loss`` with a TokenLoss under ``torch.compile(fullgraph=True)``: one op in the
    graph, and the compiled loss and gradients are eager's bits; for ``linear_logp`` with the same
    loss written out, the gradients (the loss is inductor's sum of the op's logp: another summation
    order)."""
    p = _peer_compile_problem(n)
    ce, op = losses.cross_entropy(), get_op("linear_logp", source=source)

    def fused(h, w, t, b):
        return linear_logp_loss(h, w, t, b, loss=ce, reduction=reduction, ignore_index=-100,
                                source=source, with_entropy=False)

    def plain(h, w, t, b):
        per_token = -op(h, w, t, b, ignore_index=-100)
        return per_token.sum() if reduction == "sum" else per_token.sum() / (t != -100).sum()

    # linear_logp with ignore_index on triton: eager compacts the ignored rows and keeps their
    # softmax terms (bf16) for the backward; the op keeps the same terms in a prefix of a capacity
    # for any row count (packed_op.op_kept_shape)
    for fn in (fused, plain):
        eager = loss_and_grads(fn, p)
        compiled_fn, graphs = compile_fullgraph(fn, backend="inductor")
        compiled = loss_and_grads(compiled_fn, p)
        assert len(graphs) == 1, (fn.__name__, graphs)
        if fn is plain:
            torch.testing.assert_close(compiled[0], eager[0], **tol.INDUCTOR._asdict())
            compiled[0] = eager[0]
        assert_same_bits(compiled, eager)


KEEP_SOURCES = cpu_sources()


@pytest.mark.parametrize("source", KEEP_SOURCES)
@pytest.mark.parametrize("budget", ["default", pytest.param("keep", marks=pytest.mark.slow)])
@pytest.mark.parametrize("entropy", [False, True], ids=["logp-lse", "entropy"])
def test_opcheck(entropy, budget, source):
    """Schema, fake (meta) implementation and autograd registration of the op pair
    (torch.library.opcheck), also with a budget that keeps logits (the fake kept buffer has the real
    one's shape)."""
    from tplogp import keep_logits_budget
    from tplogp.op.options import LOGP_OP, LogpOptions, op_values

    p = make_problem((6,), 8, 23, torch.float32, True, seed=1)
    h, w, b = (x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias))
    ws = None if budget == "default" else keep_logits_budget(6, 23, source=source, device="cpu")
    options = op_values(LogpOptions(temperature=0.8, return_entropy=entropy, workspace_bytes=ws),
                        LOGP_OP)
    args = (h, w, p.target, b, "", 0, None, source, True, ops.layout_key(source, h.device, h.dtype),
            *options)
    packed, kept, gathered = ops.linear_logp_fwd(*args)
    # (rows are gathered only by a sequence-parallel call with a group)
    assert gathered.numel() == 0
    # the triton sources keep a call this small under the default budget too
    # (tplogp.backends.memory_budget)
    assert (kept.numel() > 0) == (budget == "keep" or source != "native"), kept.shape
    torch.library.opcheck(ops.linear_logp_fwd, args)


def _count_recomputes(monkeypatch, source):
    """Count the backward's recompute GEMMs (native: logits tiles computed in the backward; triton:
    recompute launches, beside the launches that read kept logits)."""
    seen = {"recompute": 0}
    if source == "triton":
        from tplogp.kernels import backward_programs

        real = backward_programs.launch_dlogits

        def recompute(*args, **options):
            seen["recompute"] += 1
            return real(*args, **options)

        monkeypatch.setattr(backward_programs, "launch_dlogits", recompute)
    else:
        from tplogp.backends import native, native_tiles

        real_tile = native_tiles._logits_tile
        inside = {"backward": False}

        def tile(*args, **kwargs):
            seen["recompute"] += inside["backward"]
            return real_tile(*args, **kwargs)

        def in_backward(real):
            def run(*args, **kwargs):
                inside["backward"] = True
                try:
                    return real(*args, **kwargs)
                finally:
                    inside["backward"] = False

            return run

        # every logits tile, forward and backward, is made in native_tiles
        monkeypatch.setattr(native_tiles, "_logits_tile", tile)
        monkeypatch.setattr(native, "backward_tiles", in_backward(native.backward_tiles))
        # a call whose logits fit one tile and keep nothing: the one-tile backward recomputes it
        monkeypatch.setattr(native, "backward_one_tile", in_backward(native.backward_one_tile))
    return seen


@pytest.mark.parametrize("source", KEEP_SOURCES)
@pytest.mark.parametrize("opts",
                         ["plain", pytest.param("entropy", marks=pytest.mark.slow), "ignore_index"])
def test_compiled_call_keeps_logits_within_the_budget(monkeypatch, source, opts):
    """Under torch.compile a budget that holds the logits makes the op's forward keep their terms
    and its backward read them (no recompute GEMM), with eager's bits; with ignore_index too (the
    compacted rows' terms, in a prefix of a capacity for any row count: packed_op.op_kept_shape)."""
    from tplogp import keep_logits_budget

    o = OPTIONS[opts]
    p = _problem(o, seed=7)
    n = p.target.numel()
    budget = keep_logits_budget(n, p.weight.shape[0], source=source, device="cpu")
    loss_fn = make_loss(get_op("linear_logp", source=source), o,
                        (p.g_logp, p.g_entropy) if o.get("return_entropy") else (p.g_logp,),
                        workspace_bytes=budget)
    eager = loss_and_grads(loss_fn, p)
    seen = _count_recomputes(monkeypatch, source)
    compiled = loss_and_grads(torch.compile(loss_fn, backend="aot_eager", fullgraph=True), p)
    assert_same_bits(compiled, eager)
    assert seen["recompute"] == 0, seen
    # the counter sees recomputes: a budget of the transient part alone keeps nothing
    from tplogp.backends import memory_budget

    transient = memory_budget.transient_bytes(source, torch.device("cpu"))
    loss_and_grads(make_loss(get_op("linear_logp", source=source), o, (p.g_logp, p.g_entropy)
                             if o.get("return_entropy") else (p.g_logp,),
                             workspace_bytes=transient), p)
    assert seen["recompute"] > 0, seen


# ---- with a TP group: gloo ranks of the plugin ---------------------------------------------------

# 3 uneven ranks (16, 34 and 51 ids): each rank traces its graph with another shard size.
@pytest.mark.tp(world_size=3, timeout=300)
@pytest.mark.parametrize("opts, mode", [
    ("all", "full"), pytest.param("all", "fast", marks=pytest.mark.slow),
    pytest.param("plain", "full", marks=pytest.mark.slow),
    pytest.param("keep", "full", marks=pytest.mark.slow)], ids=["all-full", "all-fast",
                                                              "plain-full", "keep-full"])
def test_compile_with_tp_group(tp, opts, mode, monkeypatch):
    """Uneven vocab shards over the group: no graph break, compiled loss and gradients equal
    eager's; the fast checks with every option on."""
    from pytest_tplogp import VocabShards

    monkeypatch.setenv("TPLOGP_CHECKS", mode)  # per rank, undone after the test
    torch._dynamo.reset()
    o = OPTIONS[opts]
    v = 101
    vs = VocabShards("uneven", tp.world_size, vocab_size=v).__tp_bind__(tp)
    p = _problem(o, seed=4, v=v)
    p.weight, p.bias = vs.shard(p.weight).clone(), vs.shard(p.bias).clone()
    loss_fn = make_loss(linear_logp, o, (p.g_logp, p.g_entropy, p.g_lse) if o.get("return_entropy")
                        else (p.g_logp, p.g_lse), tp_group=tp.group, vocab_start_index=vs.start,
                        global_vocab_size=v)
    eager = loss_and_grads(loss_fn, p)
    compiled = compiled_in_one_graph(loss_fn, p)
    same = all(torch.equal(c, e) for e, c in zip(eager, compiled))
    tp.assert_all(same, "compiled loss or gradients differ from eager's bits")
