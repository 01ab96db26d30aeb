"""Single-rank numerics of every source that can run here, three ways: float64 truth, the same-dtype
PyTorch reference, and the op. The op's error must be no worse than the reference's
(tolerances.ERROR_SLACK)."""

from __future__ import annotations

import zlib

import pytest
import torch

from tplogp import get_op
from tplogp.backends.kernel_registry import unavailable_reason
from tplogp.tolerances import assert_no_worse, rel_error
from tests.support.problems import make_problem, run_op, run_reference
from tests.support import tolerances as tol

CPU = torch.device("cpu")
SOURCES = [s for s in ("native", "triton", "sm90") if unavailable_reason(s, CPU) is None]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_three_way(ours, ref, truth, dtype, what=("logp", "d_hidden", "d_weight", "d_bias")):
    for name in what:
        o, r, t = getattr(ours, name), getattr(ref, name), getattr(truth, name)
        if t is None:
            assert o is None, f"{name}: expected no gradient"
            continue
        assert o.dtype == (torch.float32 if name in ("logp", "entropy", "lse") else r.dtype), name
        assert torch.isfinite(o).all(), f"{name} has non-finite values"
        assert_no_worse(name, o, r, t, dtype)


# Shapes: a tiny square-ish case, an odd one (N, D, V not multiples of 8; V prime), and a [B, S, D]
# one.
SHAPES = {"37x19x101": ((37,), 19, 101), "odd-29x67x1009": ((29,), 67, 1009),
          "3x17x40x256": ((3, 17), 40, 256)}
SHAPE_PARAMS = [pytest.param(k, marks=pytest.mark.slow) if k.startswith("odd") else k for k in SHAPES]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", SHAPE_PARAMS, ids=list(SHAPES))
def test_matches_float64_truth(source, dtype, bias, shape):
    lead, d, v = SHAPES[shape]
    dt = DTYPES[dtype]
    # stable across processes
    p = make_problem(lead, d, v, dt, bias, seed=zlib.crc32(shape.encode()) % 1000)
    ours = run_op(get_op("linear_logp", source=source), p)
    truth = run_reference(p, "float64")
    ref = run_reference(p, "matching")
    assert ours.logp.shape == p.target.shape
    check_three_way(ours, ref, truth, dt)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_peaked_and_flat_rows(source, dtype):
    """Rows with almost all mass on the target (softmax(z_y) - 1 cancels) and near-uniform rows
    (logp ~ -log V)."""
    dt = DTYPES[dtype]
    p = make_problem((48,), 32, 500, dt, True, seed=7, peaked=True, flat=True)
    ours = run_op(get_op("linear_logp", source=source), p)
    truth = run_reference(p, "float64")
    ref = run_reference(p, "matching")
    check_three_way(ours, ref, truth, dt)
    peaked = torch.arange(0, 48, 3)
    assert (truth.logp[peaked] > -1e-3).all(), "problem construction: peaked rows should have logp ~ 0"
    # the gradient at a peaked row's target is g * (1 - p) ~ 0: no catastrophic cancellation allowed
    assert rel_error(ours.logp[peaked], truth.logp[peaked]) < tol.REL_PEAKED_LOGP[dt] \
        or (ours.logp[peaked] - truth.logp[peaked]).abs().max() < tol.ABS_PEAKED_LOGP


@pytest.mark.parametrize("workspace_kib", [pytest.param(4, marks=pytest.mark.slow), 64, 1 << 14],
                         ids=["tiny-tiles", "mid-tiles", "one-tile"])
def test_chunk_size_invariance(workspace_kib):
    """Tile sizes (token chunk x vocab chunk) change only the reduction order: results agree to fp32
    rounding."""
    p = make_problem((70,), 24, 777, torch.float32, True, seed=3)
    op = get_op("linear_logp", source="native")
    base = run_op(op, p, workspace_bytes=64 << 20, entropy=True)
    other = run_op(op, p, workspace_bytes=workspace_kib << 10, entropy=True)
    torch.testing.assert_close(other.logp, base.logp, **tol.CHUNKING_LOGP._asdict())
    for name in ("d_hidden", "d_weight", "d_bias"):
        torch.testing.assert_close(getattr(other, name), getattr(base, name),
                                   **tol.CHUNKING_GRADS._asdict(), msg=lambda m: f"{name}: {m}")


def test_non_contiguous_inputs_are_handled():
    """Transposed / strided inputs give the same results as their contiguous copies (never silently
    wrong)."""
    p = make_problem((40,), 24, 300, torch.float32, True, seed=5)
    op = get_op("linear_logp", source="native")
    h_t = p.hidden.t().contiguous().t()  # same values, column-major
    w_t = p.weight.t().contiguous().t()
    b_s = torch.stack([p.bias, p.bias], 1)[:, 0]  # stride 2
    tgt_s = torch.stack([p.target, p.target], 1)[:, 0]
    assert not (h_t.is_contiguous() or w_t.is_contiguous() or b_s.is_contiguous()
                or tgt_s.is_contiguous())
    got = op(h_t, w_t, tgt_s, b_s)
    want = op(p.hidden, p.weight, p.target, p.bias)
    torch.testing.assert_close(got, want, **tol.STRIDED_INPUTS._asdict())


def test_repeated_backward_accumulates():
    p = make_problem((16,), 8, 50, torch.float32, True, seed=9)
    h = p.hidden.clone().requires_grad_()
    w = p.weight.clone().requires_grad_()
    op = get_op("linear_logp", source="native")
    out = op(h, w, p.target)
    (out * p.g_logp).sum().backward(retain_graph=True)
    g1 = h.grad.clone(), w.grad.clone()
    (out * p.g_logp).sum().backward()
    torch.testing.assert_close(h.grad, 2 * g1[0])
    torch.testing.assert_close(w.grad, 2 * g1[1])


def test_low_precision_weight_grad_accumulates_in_fp32():
    """d_W of bf16 weights summed over many token chunks is rounded once (bf16 accumulation would
    drift)."""
    p = make_problem((512,), 16, 64, torch.bfloat16, False, seed=11)
    op = get_op("linear_logp", source="native")
    ours = run_op(op, p, workspace_bytes=2 << 10)  # many token chunks
    truth = run_reference(p, "float64")
    bf16_ulp_rel = 2.0 ** -8
    assert rel_error(ours.d_weight, truth.d_weight) < bf16_ulp_rel, "d_W error above one bf16 rounding"


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_fp16_native(bias):
    """fp16 inputs (the fused sources' fp16 paths are checked on the GPU, tests/gpu)."""
    p = make_problem((3, 17), 40, 257, torch.float16, bias, seed=31, peaked=True)
    ours = run_op(get_op("linear_logp", source="native"), p, entropy=True)
    truth = run_reference(p, "float64", entropy=True)
    ref = run_reference(p, "matching", entropy=True)
    check_three_way(ours, ref, truth, torch.float16,
                    what=("logp", "entropy", "d_hidden", "d_weight", "d_bias"))


@pytest.mark.parametrize("bad", [-1, 50, -100],
                         ids=["negative", "past-the-end", "unignored-sentinel"])
@pytest.mark.parametrize("mode", ["full", "sync"])
def test_target_outside_the_vocabulary_is_rejected(bad, mode, monkeypatch):
    """One shard: a target no shard owns raises the runbook's coverage message (ignore_index only
    exempts itself): at the call with TPLOGP_CHECKS=sync, and with the default (full) at the call of
    a call that records no autograd graph; a call that records one gives NaN for that token and the
    next call raises, once (here no backward runs)."""
    from tplogp import LinearLogpInputError

    monkeypatch.setenv("TPLOGP_CHECKS", mode)
    op = get_op("linear_logp", source="native")
    h, w = torch.randn(4, 8), torch.randn(50, 8)
    t = torch.tensor([1, bad, 3, -7])
    message = rf"covered by exactly one TP vocab shard: target id {bad} "
    at_call = "" if mode == "sync" else r".*checked at the call"
    with pytest.raises(LinearLogpInputError, match=message + at_call):
        op(h, w, t, ignore_index=-7)
    if mode == "sync":
        return
    out = op(h.requires_grad_(), w, t, ignore_index=-7)
    assert torch.isnan(out.detach()).tolist() == [False, True, False, False]
    with pytest.raises(LinearLogpInputError, match=message + r".*earlier linear_logp call"):
        op(h, w, torch.tensor([1, 2, 3, 4]))
    assert torch.isfinite(op(h, w, torch.tensor([1, 2, 3, 4]))).all()  # raised once; good calls run


@pytest.mark.parametrize("name, value", [
    ("vocab_start_index", True), ("global_vocab_size", True), ("ignore_index", False),
    ("temperature", True), ("workspace_bytes", 1.5), ("workspace_bytes", "64"),
    ("workspace_bytes", -1),
])
def test_option_of_the_wrong_type_is_rejected(name, value):
    """An option the op's schema does not take (a bool for an int, a float budget), or a negative
    budget, raises the checks' error naming it; it never runs on a path that skips the op's handling
    (autocast, torch.compile)."""
    from tplogp import LinearLogpInputError

    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(LinearLogpInputError, match=rf"{name} must be"):
        get_op("linear_logp", source="native")(h, w, t, **{name: value})
