"""The triton / sm90 kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py).

Three layers: the per-shard primitives against float64 formulas; the op through the registry against
float64 truth and the same-dtype reference (tolerances.ERROR_SLACK); the shared TP path on 4 gloo
ranks with uneven shards. The sm90 kernel bodies (tensor-descriptor loads) run here through their
launchers even though the sm90 *source* reports itself unavailable off Hopper.
"""

from __future__ import annotations

import pytest
import torch

from tplogp.tolerances import assert_no_worse, rel_error
from tests.support.interpreter import KERNELS, interpreter_only
from tests.support.problems import float64_stats, make_problem, run_op, run_reference
from tests.support import tolerances as tol

pytestmark = interpreter_only
triton = pytest.importorskip("triton")

from tplogp.backends.base import ShardCall  # noqa: E402
from tplogp.backends.sm90_backend import SM90Backend  # noqa: E402
from tplogp.backends.triton_backend import TritonBackend  # noqa: E402
from tplogp.backends import memory_budget  # noqa: E402

CPU = torch.device("cpu")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _truth(h, w, b, tgt, inv_t, g, ge, gl):
    """float64 stats and grads from the backend contract's formulas."""
    st = float64_stats(h, w, b, tgt, inv_t)
    z, m, s, q, tl = st["z"], st["row_max"], st["sum_exp"], st["sum_exp_z"], st["target_logit"]
    own = tgt >= 0
    lsum = s.log()
    p = (z - m[:, None] - lsum[:, None]).exp()
    mean_rel = (p * (z - m[:, None])).sum(1)
    onehot = torch.zeros_like(z)
    onehot[own.nonzero()[:, 0], tgt[own]] = 1.0
    zr = z - m[:, None]
    coef = (g - gl).double()[:, None] + ge.double()[:, None] * (zr - mean_rel[:, None])
    dz = g.double()[:, None] * onehot - p * coef
    dl = dz * inv_t
    return dict(row_max=m, sum_exp=s, target_logit=tl, sum_exp_z=q, lsum=lsum, mean_rel=mean_rel,
                d_logits=dl, d_hidden=dl @ w.double(), d_weight=dl.T @ h.double(), d_bias=dl.sum(0))


# Shapes on purpose: odd everything (masks on N, D and V edges); exact multiples of the interpreter
# tiles; V smaller than one vocab tile; a single token; D a multiple of 8 so the sm90 kernels take
# the tensor-descriptor path.
SHAPES = {"odd-37x45x101": (37, 45, 101), "exact-32x32x64": (32, 32, 64),
          "tinyV-50x24x7": (50, 24, 7), "one-token-1x40x70": (1, 40, 70),
          "tma-33x48x129": (33, 48, 129)}


# The inner loop keeps fp32 with a bias on every shape and both kernel sets; bf16 and no bias are
# slow.
@pytest.mark.parametrize("kernels", list(KERNELS))
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("bias", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_primitives_match_float64_formulas(kernels, dtype, bias, shape):
    n, d, v = SHAPES[shape]
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(n * 1000 + v)
    h = (torch.randn(n, d, generator=gen) * 0.5).to(dt)
    w = (torch.randn(v, d, generator=gen) / d**0.5).to(dt)
    b = (torch.randn(v, generator=gen) * 0.1).to(dt) if bias else None
    tgt = torch.randint(0, v, (n,), generator=gen)
    tgt[::4] = -1  # rows whose target this shard does not own
    g, ge, gl = (torch.randn(n, generator=gen) for _ in range(3))
    inv_t = 1 / 0.7
    be = KERNELS[kernels]()
    # several chunks
    call = ShardCall(inv_temperature=inv_t, with_entropy=True, workspace_bytes=n * 2 * 256)
    truth = _truth(h, w, b, tgt, inv_t, g, ge, gl)

    st = be.forward_stats(h, w, b, tgt, call)
    for name in ("row_max", "sum_exp", "target_logit", "sum_exp_z"):
        got = getattr(st, name)
        assert got.dtype == torch.float32 and got.shape == (n,)
        # z comes from exact products of the inputs with fp32 accumulation, in either dtype
        assert rel_error(got, truth[name]) < tol.REL_FP32_ACCUMULATION, name

    grads = be.backward(h, w, b, tgt, truth["row_max"].float(), truth["lsum"].float(), g, ge, gl,
                        truth["mean_rel"].float(), call, (True, True, True))
    assert grads.d_hidden.dtype == torch.float32 and grads.d_weight.dtype == dt
    if dt == torch.float32:  # only reduction order differs
        assert rel_error(grads.d_hidden, truth["d_hidden"]) < tol.REL_FP32_ACCUMULATION
        assert rel_error(grads.d_weight, truth["d_weight"]) < tol.REL_FP32_ACCUMULATION
    else:
        # 16-bit: d_logits is rounded once to the weight dtype, then accumulated in fp32. Against
        # float64 GEMMs of the rounded d_logits the only differences are rare rounding flips;
        # against exact truth, bf16 rounding.
        dl_r = truth["d_logits"].to(dt).double()
        assert rel_error(grads.d_hidden, dl_r @ w.double()) < tol.REL_16BIT_ROUNDING_FLIPS
        assert rel_error(grads.d_weight, (dl_r.T @ h.double()).to(dt)) < tol.REL_16BIT_ROUNDING_FLIPS
        assert rel_error(grads.d_hidden, truth["d_hidden"]) < tol.REL_BF16_VS_TRUTH
    if bias:
        assert grads.d_bias.dtype == dt
        # d_bias sums the fp32 d_logits (never rounded), then rounds once to the bias dtype
        assert rel_error(grads.d_bias, truth["d_bias"]) < (tol.REL_FP32_ACCUMULATION if dt == torch.float32
                                                            else tol.REL_16BIT_ONE_ROUNDING)
    else:
        assert grads.d_bias is None


def test_empty_shard_and_no_tokens():
    be = TritonBackend()
    h = torch.randn(5, 8)
    st = be.forward_stats(h, torch.randn(0, 8), None, torch.full((5,), -1),
                          ShardCall(with_entropy=True))
    assert torch.isinf(st.row_max).all() and (st.row_max < 0).all() and (st.sum_exp == 0).all()
    gr = be.backward(torch.randn(0, 8), torch.randn(6, 8), torch.randn(6),
                     torch.zeros(0, dtype=torch.int64), torch.zeros(0), torch.zeros(0),
                     torch.zeros(0), None, None, None, ShardCall(), (True, True, True))
    assert gr.d_hidden.shape == (0, 8) and (gr.d_weight == 0).all() and (gr.d_bias == 0).all()


@pytest.mark.parametrize("kernels", ["triton", "sm90-kernels"])
def test_single_shard_ids_outside_the_vocab_are_nan_in_fast_mode(kernels, monkeypatch):
    """One shard: the kernels get the target ids as given. With TPLOGP_CHECKS=fast (no range check)
    an id outside [0, V) -- past the end, negative, inside the last tile's padding -- gives NaN
    logp; every other row, and the gradients of the finite rows' loss, match the same call on only
    those rows (to rounding: the interpreter's per-row dot results depend on a row's position in its
    block)."""
    from tplogp.api import linear_logp_on
    from tplogp.op.plan import LogpOptions

    monkeypatch.setenv("TPLOGP_CHECKS", "fast")
    be = KERNELS[kernels]()
    # V not a multiple of the interpreter's 64-wide vocab tile: ids 45..63 are tile padding
    n, d, v = 9, 16, 45
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(n, d, generator=gen, requires_grad=True)
    w = (torch.randn(v, d, generator=gen) / 4).requires_grad_()
    t = torch.randint(0, v, (n,), generator=gen)
    bad = [1, 4, 7]
    t[bad] = torch.tensor([v + 3, -5, v])
    out = linear_logp_on(be, h, w, t, options=LogpOptions(return_lse=True))
    assert torch.isnan(out.logp[bad]).all() and torch.isfinite(out.lse).all()
    good = [i for i in range(n) if i not in bad]
    assert torch.isfinite(out.logp[good]).all()
    out.logp[good].sum().backward()
    h2, w2 = h.detach()[good].clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = linear_logp_on(be, h2, w2, t[good], options=LogpOptions(return_lse=True))
    assert rel_error(out.logp[good], ref.logp) < tol.REL_FP32_SAME_MATH
    assert rel_error(out.lse[good], ref.lse) < tol.REL_FP32_SAME_MATH
    ref.logp.sum().backward()
    assert torch.equal(h.grad[bad], torch.zeros_like(h.grad[bad]))
    assert rel_error(h.grad[good], h2.grad) < tol.REL_FP32_SAME_MATH
    assert rel_error(w.grad, w2.grad) < tol.REL_FP32_SAME_MATH


# ---- the op through the registry: three-way against float64 truth --------------------------------

OPTION_SETS = {
    "plain": {},
    "temp-ent-lse": dict(temperature=0.7, entropy=True, lse=True),
    "ignore": dict(ignore_index=-100),
}


# The inner loop keeps fp32 on peaked rows (every option set, kept terms); bf16, flat rows and the
# recomputing schedule (the primitives' tests run it) are slow.
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("opts", list(OPTION_SETS))
@pytest.mark.parametrize("rows", ["peaked", pytest.param("flat", marks=pytest.mark.slow)])
@pytest.mark.parametrize("schedule", ["kept", pytest.param("recomputed", marks=pytest.mark.slow)])
def test_op_three_way(dtype, opts, rows, schedule):
    """Both backward schedules of the default budget: a call this small keeps its softmax terms
    (tplogp.backends.memory_budget); a budget of the default workspace alone recomputes the
    logits."""
    from tplogp import get_op

    dt = DTYPES[dtype]
    o = dict(OPTION_SETS[opts])
    ignore = o.get("ignore_index")
    p = make_problem((2, 13), 48, 311, dt, True, seed=5, peaked=rows == "peaked",
                     flat=rows == "flat", ignore_index=ignore,
                     ignore_fraction=0.3 if ignore is not None else 0.0)
    ent, lse, temp = o.pop("entropy", False), o.pop("lse", False), o.get("temperature", 1.0)
    if schedule == "recomputed":
        o["workspace_bytes"] = memory_budget.DLOGITS_WORKSPACE_BYTES
    ours = run_op(get_op("linear_logp", source="triton"), p, entropy=ent, lse=lse, **o)
    truth = run_reference(p, "float64", temperature=temp, ignore_index=ignore, entropy=ent, lse=lse)
    ref = run_reference(p, "matching" if dt != torch.float32 else "fp32", temperature=temp,
                        ignore_index=ignore, entropy=ent, lse=lse)
    for name in ("logp", "entropy", "lse", "d_hidden", "d_weight", "d_bias"):
        if getattr(truth, name) is not None:
            assert_no_worse(name, getattr(ours, name), getattr(ref, name), getattr(truth, name), dt)
    if ignore is not None:
        ignored = (p.target == ignore).reshape(-1)
        assert (ours.logp.reshape(-1)[ignored] == 0).all()
        assert (ours.d_hidden.reshape(-1, 48)[ignored] == 0).all()


def test_all_targets_ignored():
    from tplogp import get_op

    p = make_problem((9,), 16, 50, torch.float32, True, seed=2, ignore_index=-1,
                     ignore_fraction=1.0)
    ours = run_op(get_op("linear_logp", source="triton"), p, entropy=True, ignore_index=-1)
    assert (ours.logp == 0).all() and (ours.entropy == 0).all()
    assert (ours.d_hidden == 0).all() and (ours.d_weight == 0).all() and (ours.d_bias == 0).all()


# ---- determinism ---------------------------------------------------------------------------------


def test_deterministic_bitwise_and_batch_independent():
    from tplogp import get_op

    op = get_op("linear_logp", source="triton")
    p = make_problem((40,), 32, 203, torch.bfloat16, True, seed=9, peaked=True)
    kw = dict(entropy=True, deterministic=True)
    a = run_op(op, p, **kw)
    b = run_op(op, p, **kw)
    for name in ("logp", "entropy", "d_hidden", "d_weight", "d_bias"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    # the first 13 rows alone, with a different chunking of the backward: the same bits row by row
    k = 13
    sub = make_problem((40,), 32, 203, torch.bfloat16, True, seed=9, peaked=True)
    sub.hidden, sub.target = sub.hidden[:k], sub.target[:k]
    sub.g_logp, sub.g_entropy, sub.g_lse = sub.g_logp[:k], sub.g_entropy[:k], sub.g_lse[:k]
    c = run_op(op, sub, workspace_bytes=1, **kw)
    for name in ("logp", "entropy", "d_hidden"):
        assert torch.equal(getattr(c, name), getattr(a, name)[:k]), name


@pytest.mark.slow
def test_workspace_size_does_not_change_results():
    """Chunked (tiny workspace) and one-chunk backward agree; in deterministic mode bit for bit."""
    from tplogp import get_op

    op = get_op("linear_logp", source="triton")
    p = make_problem((30,), 24, 600, torch.float32, True, seed=4)
    for det in (False, True):
        small = run_op(op, p, workspace_bytes=1, deterministic=det)  # 256-column chunks: 3 chunks
        # the default workspace: one chunk, nothing kept (a larger budget keeps terms:
        # tests/op/test_kept_terms.py)
        big = run_op(op, p, workspace_bytes=memory_budget.DLOGITS_WORKSPACE_BYTES,
                     deterministic=det)
        for name in ("d_hidden", "d_weight", "d_bias"):
            x, y = getattr(small, name), getattr(big, name)
            assert torch.equal(x, y) if det else rel_error(x, y) < tol.REL_FP32_SAME_MATH, (name,
                                                                                            det)


# ---- availability and input errors ---------------------------------------------------------------


def test_unavailable_reasons(monkeypatch):
    reason = SM90Backend().unavailable_reason(CPU)
    assert "9.0" in reason and "cpu" in reason
    assert TritonBackend().unavailable_reason(CPU) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET" in TritonBackend().unavailable_reason(CPU)


def test_launcher_rejects_bad_inputs():
    from tplogp.kernels.entry_checks import KernelInputError

    be = TritonBackend()
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(KernelInputError, match="hidden size mismatch"):
        be.forward_stats(h, torch.randn(10, 9), None, t, ShardCall())
    with pytest.raises(KernelInputError, match="int64"):
        be.forward_stats(h, w, None, t.int(), ShardCall())
    with pytest.raises(KernelInputError, match="unit stride"):
        be.forward_stats(torch.randn(8, 4).t(), w, None, t, ShardCall())
    with pytest.raises(KernelInputError, match="dtypes differ"):
        be.forward_stats(h.bfloat16(), w, None, t, ShardCall())


def test_op_calls_skip_the_launchers_repeat_checks_and_direct_calls_keep_them(monkeypatch):
    """The op checks its inputs once (tplogp.checks) and hands the sources 2-D contiguous int64
    tensors: its forward and backward launch without the launchers' own checks (host time). A direct
    call of a source, with a plain ShardCall, still gets them."""
    import tplogp
    from tplogp.kernels import backward_programs, forward_programs

    seen = []
    for module in (forward_programs, backward_programs):
        monkeypatch.setattr(module, "check_inputs",
                            lambda *a, real=module.check_inputs: (seen.append(1), real(*a))[1])
    p = make_problem((3, 5), 16, 40, torch.float32, True, seed=5)  # 3-D hidden: the op flattens it
    ours = run_op(tplogp.get_op("linear_logp", source="triton"), p)
    assert seen == []
    truth, ref = run_reference(p, "float64"), run_reference(p, "fp32")
    for name in ("logp", "d_hidden", "d_weight", "d_bias"):
        assert_no_worse(name, getattr(ours, name), getattr(ref, name), getattr(truth, name),
                        torch.float32)
    TritonBackend().forward_stats(p.hidden.reshape(15, 16), p.weight, p.bias, p.target.reshape(15),
                                  ShardCall())
    assert seen == [1]
    assert ShardCall().inputs_checked is False


# ---- 4 gloo ranks, uneven shards -----------------------------------------------------------------


@pytest.mark.tp(world_size=4, timeout=300)
@pytest.mark.parametrize("dtype_name,opts", [
    ("fp32", {}),
    pytest.param("bf16", dict(temperature=0.8, entropy=True, lse=True, ignore_index=-100),
                 marks=pytest.mark.slow),
], ids=["fp32-plain", "bf16-temp-ent-lse-ignore"])
def test_tp4_uneven_triton(tp, dtype_name, opts):
    """Runs on a pool of 4 gloo ranks (pytest_tplogp)."""
    from tests.support.problems import make_problem, run_op, run_reference
    from tplogp.tolerances import assert_no_worse
    from tplogp import get_op
    from tplogp.support.shards import shard_boundaries, shard_range

    rank, world, group = tp.rank, tp.world_size, tp.group
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    opts = dict(opts)
    ent, lse = opts.pop("entropy", False), opts.pop("lse", False)
    ignore, temp = opts.get("ignore_index"), opts.get("temperature", 1.0)
    v = 389
    p = make_problem((23,), 32, v, dt, True, seed=11, peaked=True, ignore_index=ignore,
                     ignore_fraction=0.3 if ignore is not None else 0.0)
    start, end = shard_range(shard_boundaries(v, world, uneven=True), rank)
    full_w, full_b = p.weight, p.bias
    p.weight, p.bias = full_w[start:end].clone(), full_b[start:end].clone()
    ours = run_op(get_op("linear_logp", source="triton"), p, entropy=ent, lse=lse, tp_group=group,
                  vocab_start_index=start, global_vocab_size=v, **opts)
    p.weight, p.bias = full_w, full_b
    truth = run_reference(p, "float64", temperature=temp, ignore_index=ignore, entropy=ent, lse=lse)
    ref = run_reference(p, "matching" if dt != torch.float32 else "fp32", temperature=temp,
                        ignore_index=ignore, entropy=ent, lse=lse)
    sl = slice(start, end)
    checks = [("logp", ours.logp, ref.logp, truth.logp),
              ("d_hidden", ours.d_hidden, ref.d_hidden, truth.d_hidden),
              ("d_weight", ours.d_weight, ref.d_weight[sl], truth.d_weight[sl]),
              ("d_bias", ours.d_bias, ref.d_bias[sl], truth.d_bias[sl])]
    if ent:
        checks.append(("entropy", ours.entropy, ref.entropy, truth.entropy))
    for name, o, r, t in checks:
        assert_no_worse(f"rank {rank} {name}", o, r, t, dt)
    sizes = tp.all_gather_object(end - start)
    assert len(set(sizes)) > 1 and sum(sizes) == 389  # really uneven, and a partition


@pytest.mark.parametrize("bias", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["nobias", "bias"])
def test_fp16_inputs_keep_fp16_terms(bias):
    """fp16 inputs keep fp16 softmax terms (kept.kept_dtype): bf16 terms carry 2^-9 where fp16's
    d_logits carry 2^-12, and doubled the gradients' error against the fp16 reference at this shape
    (a call small enough to keep by default)."""
    from tplogp import get_op
    from tplogp.kernels import kept

    assert kept.kept_dtype(torch.float16) == torch.float16
    p = make_problem((37,), 1000, 7, torch.float16, bias, seed=1044)
    extra = dict(entropy=bias, lse=bias)
    ours = run_op(get_op("linear_logp", source="triton"), p, temperature=0.7, **extra)
    truth = run_reference(p, "float64", temperature=0.7, **extra)
    ref = run_reference(p, "matching", temperature=0.7, **extra)
    for name in ("logp", "d_hidden", "d_weight", "d_bias"):
        if getattr(truth, name) is not None:
            assert_no_worse(name, getattr(ours, name), getattr(ref, name), getattr(truth, name),
                            torch.float16)
