"""``tplogp.keep_logits_budget`` / ``loss_chunk_budget``: the budgets they return make each source
keep what they promise (read back from the sources' own planners, and from the chunks the fused loss
runs)."""

from __future__ import annotations

import pytest
import torch

import tplogp
from tplogp.backends.base import ShardCall
from tplogp.backends.native import NativeBackend
from tplogp.budgets import GPU_MIN_CHUNK_TOKENS, plan_chunk_tokens
from tplogp.backends import memory_budget
from tplogp.kernels import workspace

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
bf16 = torch.bfloat16


class _OnDevice:
    """A shape-only stand-in for a tensor on ``device`` (the native planner reads shape, dtype and
    device)."""

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, device


def _native_kept_tiles(n, v, d, budget, device=CPU):
    """``(kept tiles, all tiles, kept elements)`` of the native forward for an ``[n, d] x [v, d]``
    bf16 call under ``budget``."""
    call = ShardCall(workspace_bytes=budget, for_backward=True)
    tc, vc, (count, _) = NativeBackend()._plan(_OnDevice((n, d), torch.bfloat16, device),
                                               _OnDevice((v, d), torch.bfloat16, device), call)
    views = NativeBackend._kept_views(torch.empty(NativeBackend.kept_shape(n, d, v, torch.bfloat16,
                                                                           device, call)),
                                      n, v, tc, vc, count, False, torch.bfloat16)
    return count, -(-n // tc) * -(-v // vc), sum(t.numel() for t, _ in views.values())


def _triton_kept_columns(source, n, v, budget, device, dtype=torch.bfloat16):
    from tplogp.backends.kernel_registry import get_backend

    call = ShardCall(workspace_bytes=budget, for_backward=True)
    return get_backend(source)._keep_columns(n, v, dtype, device, call)


@pytest.mark.parametrize("device", [CPU, CUDA], ids=["cpu", "cuda"])
@pytest.mark.parametrize("n, v", [(1000, 5000), (37, 101), (8192, 32064)])
def test_keep_all_and_half_per_source(device, n, v):
    # native: tiles in the forward's order; the whole call's terms at fraction 1 (2 bytes each for
    # 16-bit inputs, plus the scales), at most half at 0.5
    full = tplogp.keep_logits_budget(n, v, source="native", device=device, dtype=torch.bfloat16)
    assert NativeBackend.transient_bytes(device) + n * v * 2 < full <= (
        NativeBackend.transient_bytes(device) + n * v * 2 * 1.02 + 4096)
    kept, tiles_all, elements = _native_kept_tiles(n, v, 64, full, device)
    assert kept == tiles_all and elements == n * v
    assert _native_kept_tiles(n, v, 64,
                              tplogp.keep_logits_budget(n, v, fraction=0.5, source="native",
                                                        dtype=bf16,
                                                                   device=device),
                                                                   device)[2] <= n * v // 2
    assert _native_kept_tiles(n, v, 64, None, device)[0] == 0
    assert tplogp.keep_logits_budget(n, v, source="native", device=device,
                                     dtype=torch.float32) - full == (
        n * v * 2)  # fp32 inputs keep fp32 terms
    # None: fp32's size
    assert tplogp.keep_logits_budget(n, v, source="native", device=device) - full == n * v * 2
    # triton / sm90: vocab columns, the whole shard at fraction 1, 256-column units below
    for source in ("triton", "sm90"):
        pytest.importorskip("triton")
        full = tplogp.keep_logits_budget(n, v, source=source, device=device, dtype=bf16)
        # scales: 32+ wide tiles
        assert full <= memory_budget.DLOGITS_WORKSPACE_BYTES + n * v * 2 + 4 * n * -(-v // 32) + 16
        assert _triton_kept_columns(source, n, v, full, device) == v
        assert _triton_kept_columns(source, n, v, full - 4, device) < v
        half = tplogp.keep_logits_budget(n, v, fraction=0.5, source=source, device=device,
                                         dtype=bf16)
        cols = _triton_kept_columns(source, n, v, half, device)
        assert cols <= v // 2 and cols % workspace.CHUNK_ALIGN == 0 and v // 2 - cols < workspace.CHUNK_ALIGN
        assert _triton_kept_columns(source, n, v, tplogp.keep_logits_budget(
            n, v, fraction=0.0, source=source, device=device, dtype=bf16), device) == 0
        full32 = tplogp.keep_logits_budget(n, v, source=source, device=device, dtype=torch.float32)
        assert _triton_kept_columns(source, n, v, full32, device, torch.float32) == v
        assert _triton_kept_columns(source, n, v, full32 - 4, device, torch.float32) < v


@pytest.mark.parametrize("source", ["native", "triton"])
@pytest.mark.parametrize("device", [CPU, CUDA], ids=["cpu", "cuda"])
def test_loss_chunk_budget_runs_chunks_of_that_size(source, device):
    if source == "triton":
        pytest.importorskip("triton")
    from tplogp.budgets import accumulator_tokens
    from tplogp.backends.kernel_registry import get_backend

    be = get_backend(source)
    for chunk, d, vocab, dtype, bias_dtype in ((GPU_MIN_CHUNK_TOKENS, 64, 5000, torch.bfloat16,
                                                torch.bfloat16),
                                               (4096, 4096, 128256, torch.bfloat16, None),
                                               (1000, 19, 7, torch.float32, torch.float32)):
        budget = tplogp.loss_chunk_budget(chunk, d, vocab, dtype=dtype, bias_dtype=bias_dtype,
                                          source=source, device=device)
        acc = accumulator_tokens(d, dtype, bias_dtype)
        assert plan_chunk_tokens(be, 10 * chunk, vocab, budget, device, acc, dtype) == chunk
        # one chunk, all kept
        assert plan_chunk_tokens(be, chunk, vocab, budget, device, acc, dtype) == chunk
    # the 8192 x 4096 x 128256 bf16 case of docs/operator.md: chunks of 4096 tokens' bf16 terms (and
    # scales) beside the fp32 d_W accumulator
    budget = tplogp.loss_chunk_budget(4096, 4096, 128256, source=source, device=device)
    assert budget == (be.transient_bytes(device) + be.kept_bytes(4096, 128256, torch.bfloat16,
                                                                 device)
                      + 4096 * 128256 * 4)
    assert budget - be.transient_bytes(device) - 4096 * 128256 * 4 <= 4096 * 128256 * 2 * 1.07 + 16


def test_loss_chunk_budget_end_to_end(monkeypatch):
    """The fused loss runs one source backward per chunk of the size asked for (native, CPU)."""
    from tests.support.problems import make_problem

    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    p = make_problem((50,), 12, 40, torch.float32, True, seed=2)
    calls = []
    real = NativeBackend.backward

    def counting(self, hidden, *args, **kwargs):
        calls.append(hidden.shape[0])
        return real(self, hidden, *args, **kwargs)

    monkeypatch.setattr(NativeBackend, "backward", counting)
    h, w, b = (x.clone().requires_grad_() for x in (p.hidden, p.weight, p.bias))
    budget = tplogp.loss_chunk_budget(16, 12, 40, dtype=torch.float32, bias_dtype=torch.float32,
                                      source="native", device="cpu")
    loss = tplogp.linear_logp_loss(h, w, p.target, b, loss=tplogp.losses.policy_gradient(),
                                   per_token=(torch.ones(50),), source="native",
                                   workspace_bytes=budget)
    loss.backward()
    assert calls == [16, 16, 16, 2]


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="fraction must be in"):
        tplogp.keep_logits_budget(10, 10, fraction=1.5, source="native")
    with pytest.raises(ValueError, match="must be >= 0"):
        tplogp.keep_logits_budget(-1, 10, source="native")
    with pytest.raises(ValueError, match="must be >= 1"):
        tplogp.loss_chunk_budget(0, 10, 10, source="native")
    with pytest.raises(KeyError, match="unknown source 'bogus'"):
        tplogp.loss_chunk_budget(1, 10, 10, source="bogus")


_MIB = 1 << 20
# The op's kept output under ignore_index is a capacity for any compacted row count
# (tplogp.op.packed_op.op_kept_shape). Layouts (planned for a CUDA device, no GPU needed) where
# fewer rows plan otherwise: native with a vocab wider than a 128-token tile of its 1 GiB tile
# budget (fewer than ~112 rows widen the vocab tile to the whole shard; a first tile that fits the
# keep bytes only below some row count), deterministic (whole 256-row chunks); triton with a budget
# that keeps part of the shard at N tokens and all of it at half of them, and the default budget
# (the whole shard kept below ~1300 tokens, nothing above; deterministic: nothing).
CAPACITY_CASES = [  # (..., whether fewer rows keep more than N do)
    pytest.param("native", 200, 500_000, 1024 * _MIB + 50 * _MIB, False, bf16, True,
                 id="native-wide-vocab"),
    pytest.param("native", 600, 500_000, 1024 * _MIB + 200 * _MIB, True, bf16, False,
                 id="native-deterministic"),
    pytest.param("native", 150, 300_000, 1024 * _MIB + 30 * _MIB, False, torch.float32, True,
                 id="native-fp32"),
    pytest.param("triton", 1000, 50_000, memory_budget.DLOGITS_WORKSPACE_BYTES + 60 * _MIB, False,
                 bf16, True, id="triton-budget"),
    pytest.param("triton", 2000, 50_000, None, False, bf16, True, id="triton-default"),
    pytest.param("triton", 2000, 50_000, None, True, bf16, False,
                 id="triton-default-deterministic"),
]


@pytest.mark.parametrize("source, n, v, budget, deterministic, dtype, fewer_keep_more",
                         CAPACITY_CASES)
def test_op_kept_capacity_holds_every_row_count(source, n, v, budget, deterministic, dtype,
                                                fewer_keep_more):
    """``kept_capacity`` of N tokens holds what every count of at most N keeps (``kept_shape``:
    fewer rows may keep more columns or other tiles), and never passes the keep part of the
    budget."""
    from tplogp.backends.kernel_registry import get_backend

    backend = get_backend(source)
    call = ShardCall(workspace_bytes=budget, for_backward=True, deterministic=deterministic)
    capacity = backend.kept_capacity(n, 64, v, dtype, CUDA, call)[0]
    kept = [backend.kept_shape(m, 64, v, dtype, CUDA, call)[0] for m in range(n + 1)]
    keep_bytes = memory_budget.DLOGITS_WORKSPACE_BYTES if source == "triton" and budget is None else (
        backend.keep_bytes(budget, CUDA))
    assert max(kept) <= capacity <= (0 if deterministic
                                     and budget is None else keep_bytes // 4), (max(kept), capacity)
    assert (max(kept) > kept[n]) == fewer_keep_more, (max(kept), kept[n])
