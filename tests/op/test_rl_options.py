"""RL-trainer options (temperature, entropy, lse, ignore_index, deterministic) on every source that
runs here, against float64 truth, with per-token upstream gradients on logp, entropy and lse
together."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tplogp import LogpEntropy, LogpEntropyLse, LogpLse, get_op
from tplogp.backends.kernel_registry import unavailable_reason
from tplogp.tolerances import assert_no_worse
from tests.support.problems import make_problem, run_op, run_reference
from tests.support import tolerances as tol

CPU = torch.device("cpu")
SOURCES = [s for s in ("native", "triton", "sm90") if unavailable_reason(s, CPU) is None]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IGNORE = -100


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("temperature", [pytest.param(1.0, marks=pytest.mark.slow), 0.6,
                                         pytest.param(1.7, marks=pytest.mark.slow)],
                                         ids=["t1", "t0.6", "t1.7"])
def test_temperature_entropy_lse_against_truth(source, dtype, temperature):
    dt = DTYPES[dtype]
    p = make_problem((45,), 36, 509, dt, True, seed=13, peaked=True, flat=True)
    ours = run_op(get_op("linear_logp", source=source), p, entropy=True, lse=True,
                  temperature=temperature)
    truth = run_reference(p, "float64", temperature=temperature, entropy=True, lse=True)
    ref = run_reference(p, "matching", temperature=temperature, entropy=True, lse=True)
    for name in ("logp", "entropy", "lse", "d_hidden", "d_weight", "d_bias"):
        assert_no_worse(name, getattr(ours, name), getattr(ref, name), getattr(truth, name), dt)


@pytest.mark.parametrize("source", SOURCES)
def test_entropy_limits_peaked_and_flat(source):
    """Entropy ~0 on peaked rows, ~log V on flat rows (hidden = 0, no bias: exactly uniform)."""
    d, v = 24, 300
    g = torch.Generator().manual_seed(23)
    w = torch.randn(v, d, generator=g) / d ** 0.5
    t = torch.randint(0, v, (6,), generator=g)
    h = torch.zeros(6, d)
    # hidden along the target's row, |h| = 200: the target's logit leads the rest by tens of nats
    h[:3] = w[t[:3]] * (200.0 / w[t[:3]].norm(dim=1, keepdim=True))
    out = get_op("linear_logp", source=source)(h, w, t, return_entropy=True)
    assert isinstance(out, LogpEntropy)
    assert (out.entropy[:3] >= 0).all() and (out.entropy[:3] < 1e-3).all(), out.entropy
    torch.testing.assert_close(out.entropy[3:], torch.full((3,), math.log(v)),
                               **tol.UNIFORM_ROWS._asdict())
    torch.testing.assert_close(out.logp[3:], torch.full((3,), -math.log(v)),
                               **tol.UNIFORM_ROWS._asdict())


@pytest.mark.parametrize("flags", [(True, False), (False, True), (True, True)],
                         ids=["entropy", "lse", "both"])
def test_outputs_unpack_and_keep_names(flags):
    """``logp, entropy = ...``, ``logp, lse = ...``, ``logp, entropy, lse = ...``; the same tensors
    by name."""
    ent, lse = flags
    p = make_problem((2, 5), 16, 97, torch.float32, True, seed=3)
    out = get_op("linear_logp", source="native")(p.hidden, p.weight, p.target, p.bias,
                                                 return_entropy=ent, return_lse=lse)
    kind = {(True, False): LogpEntropy, (False, True): LogpLse, (True, True): LogpEntropyLse}[flags]
    assert type(out) is kind and len(out) == 1 + ent + lse
    truth = run_reference(p, "float64", entropy=True, lse=True)
    ref = run_reference(p, "fp32", entropy=True, lse=True)
    names = ["logp"] + (["entropy"] if ent else []) + (["lse"] if lse else [])
    unpacked = dict(zip(names, out))  # plain tuple unpacking
    for name in names:
        assert unpacked[name] is getattr(out, name)
        assert unpacked[name].shape == p.target.shape and unpacked[name].dtype == torch.float32
        assert_no_worse(name, unpacked[name], getattr(ref, name), getattr(truth, name),
                        torch.float32)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("fraction", [0.5, 1.0], ids=["half-ignored", "all-ignored"])
def test_ignore_index(source, fraction):
    p = make_problem((3, 20), 16, 211, torch.float32, True, seed=17, ignore_index=IGNORE,
                     ignore_fraction=fraction)
    ours = run_op(get_op("linear_logp", source=source), p, entropy=True, lse=True,
                  ignore_index=IGNORE)
    truth = run_reference(p, "float64", ignore_index=IGNORE, entropy=True, lse=True)
    ignored = p.target == IGNORE
    assert ignored.any()
    assert (ours.logp[ignored] == 0).all() and (ours.entropy[ignored] == 0).all() and (ours.lse[ignored] == 0).all()
    assert (ours.d_hidden[ignored] == 0).all()
    if fraction == 1.0:
        assert (ours.d_weight == 0).all() and (ours.d_bias == 0).all()
        return
    ref = run_reference(p, "matching", ignore_index=IGNORE, entropy=True, lse=True)
    for name in ("logp", "entropy", "lse", "d_hidden", "d_weight", "d_bias"):
        assert_no_worse(name, getattr(ours, name), getattr(ref, name), getattr(truth, name),
                        torch.float32)


def test_ignored_targets_are_exempt_from_coverage():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    t = torch.tensor([1, IGNORE, 9, IGNORE])
    out = get_op("linear_logp", source="native")(h, w, t, ignore_index=IGNORE)
    assert out[1] == 0 and out[3] == 0 and torch.isfinite(out).all()


# the interpreted sources are slow here; tests/kernels/test_triton_kernels.py keeps a triton case in
# the inner loop
@pytest.mark.parametrize("source", [s if s == "native" else pytest.param(s, marks=pytest.mark.slow)
                                    for s in SOURCES])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_deterministic_is_bitwise_and_batch_invariant(source, dtype):
    """Twice the same call: identical bits. The same rows inside a larger batch: identical per-row
    bits."""
    dt = DTYPES[dtype]
    interpreted = source != "native" and os.environ.get("TRITON_INTERPRET") == "1"
    # the interpreter is slow: fewer rows and ids there (still several token tiles and vocab splits)
    n_big, v = (80, 300) if interpreted else (300, 700)
    big = make_problem((n_big,), 32, v, dt, True, seed=19)
    op = get_op("linear_logp", source=source)
    kw = dict(deterministic=True, entropy=True)
    a = run_op(op, big, **kw)
    b = run_op(op, big, **kw)
    for name in ("logp", "entropy", "d_hidden", "d_weight", "d_bias"):
        assert torch.equal(getattr(a, name), getattr(b, name)), f"{name} differs between two identical calls"
    # Rows at an offset that is not a multiple of any tile height. Triton's CPU interpreter computes
    # tl.dot with numpy, whose per-row results depend on the row's position inside a block, so there
    # the rows start at 0; compiled kernels are checked at an unaligned offset on the GPU
    # (tests/gpu).
    rows = slice(0, 53) if interpreted else slice(37, 37 + 101)
    small = make_problem((n_big,), 32, v, dt, True, seed=19)
    small.hidden, small.target = big.hidden[rows].clone(), big.target[rows].clone()
    small.g_logp, small.g_entropy = big.g_logp[rows].clone(), big.g_entropy[rows].clone()
    c = run_op(op, small, **kw)
    for name in ("logp", "entropy", "d_hidden"):
        assert torch.equal(getattr(c, name), getattr(a, name)[rows]), f"{name} of a row depends on the other rows"
