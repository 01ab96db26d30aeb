"""A vocabulary masked by a ``-inf`` bias, and other extreme logits, on the triton and sm90 sources
on a CUDA GPU (docs/operator.md, "Masked vocabulary and extreme values"): the cases of
tests/op/test_masked_vocab.py at sizes that span several vocab splits and tiles of the GPU tile
configs (the leading masked ids are whole splits), in bf16 and fp32, on the default (kept terms),
recompute and keep-everything budgets, against float64 truth and the same-dtype PyTorch reference
(tests/support/masked.py), in one process and over ranks through the plugin.

Run on a GPU machine: ``python -m pytest tests/gpu/test_masked_vocab_gpu.py -m gpu`` (``-n 4`` for
the TP tests on one GPU, or ``-n 1`` on 4 GPUs: NCCL).
"""

from __future__ import annotations

import pytest
import torch

import tplogp
from tests.support.cuda import cuda_backend
from tests.support.masked import compare, make_masked, masked_outputs, masked_problems, run_masked
from tplogp.backends.memory_budget import DLOGITS_WORKSPACE_BYTES

pytestmark = pytest.mark.gpu

SOURCES = ["triton", "sm90"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
N, D, V = 300, 256, 5003
# ids [0, 2048) (whole vocab splits of every config), two forbidden ids, the padded tail past 4991
MASKED = [*range(0, 2048), 2500, 3001, *range(4992, V)]
OPTIONS = {
    "plain": dict(),
    "temperature-softcap": dict(temperature=0.7, softcap=30.0),
    "deterministic": dict(deterministic=True),  # (sm90: the TMA kernels)
    "invariant": dict(temperature=1.3, deterministic="tp_invariant"),
}
# rows whose two largest logits are nearer are left out of the argmax check (GPU fp32 sum order)
TIE = 1e-2


def _targets(seed: int) -> list[int]:
    """Every fifth row a masked target (a leading, a forbidden or a padded id), the others
    unmasked ids."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(2048, 4992, (N,), generator=g)
    targets[targets == 2500] = 2501
    targets[targets == 3001] = 3002
    masked = torch.tensor([7, 2500, 3001, 4995, 2047]).repeat(N // 25 + 1)
    targets[::5] = masked[: len(targets[::5])]
    return targets.tolist()


def _budget(name: str, dtype: torch.dtype):
    if name == "keep_all":
        return tplogp.keep_logits_budget(N, V, source="triton", device="cuda", dtype=dtype)
    return {"default": None, "recompute": DLOGITS_WORKSPACE_BYTES}[name]


def _check(source, p, dtype, **kw):
    cuda_backend(source)
    ref_kw = {k: v for k, v in kw.items() if k in ("temperature", "softcap")}
    on_gpu = p.to("cuda", dtype)
    ours = run_masked(tplogp.get_op("linear_logp", source), on_gpu, **kw)
    truth = masked_outputs(on_gpu, torch.float64, **ref_kw)
    reference = masked_outputs(on_gpu, dtype, **ref_kw)
    found = compare(ours, reference, truth, dtype=dtype, tie=TIE)
    assert not found, "; ".join(found)
    return ours


@pytest.mark.parametrize("budget", ["default", "recompute", "keep_all"])
@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("source", SOURCES)
def test_masked_columns_match_eager_gpu(source, dtype, options, budget):
    """Masked columns give eager's finite outputs and gradients; masked targets logp -inf,
    gradients finite."""
    dt = DTYPES[dtype]
    p = make_masked(N, D, V, MASKED, _targets(1), seed=1)
    ours = _check(source, p, dt, workspace_bytes=_budget(budget, dt), **OPTIONS[options])
    if "softcap" not in OPTIONS[options]:
        assert ours.logp[::5].isneginf().all()


@pytest.mark.parametrize("source", SOURCES)
def test_every_column_masked_but_one_gpu(source):
    targets = [4000 if i % 3 else 11 for i in range(N)]
    p = make_masked(N, D, V, [i for i in range(V) if i != 4000], targets, seed=2)
    ours = _check(source, p, torch.float32, temperature=0.5)
    rows = torch.arange(N) % 3 != 0
    assert torch.equal(ours.logp[rows].cpu(), torch.zeros(int(rows.sum())))
    assert ours.logp[~rows].isneginf().all()
    assert torch.equal(ours.entropy.cpu(), torch.zeros(N))
    assert torch.equal(ours.argmax.cpu(), torch.full((N,), 4000))


@pytest.mark.parametrize("deterministic", [False, True, "tp_invariant"],
                         ids=["default", "det", "invariant"])
@pytest.mark.parametrize("source", SOURCES)
def test_every_column_masked_gpu(source, deterministic):
    p = make_masked(N, D, V, range(V), _targets(3), seed=3)
    ours = _check(source, p, torch.bfloat16, temperature=2.0, deterministic=deterministic)
    assert ours.logp.isneginf().all() and ours.lse.isneginf().all()
    assert torch.equal(ours.entropy.cpu(), torch.zeros(N))
    assert torch.equal(ours.argmax.cpu(), torch.zeros(N, dtype=torch.long))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("source", SOURCES)
def test_logits_of_1e4_gpu(source, dtype):
    p = make_masked(N, D, V, [3, 50], _targets(4), seed=4, scale=1e4)
    _check(source, p, DTYPES[dtype], temperature=0.9)


@pytest.mark.parametrize("source", SOURCES)
def test_plus_inf_and_nan_gpu(source):
    cuda_backend(source)
    op = tplogp.get_op("linear_logp", source)
    p = make_masked(N, D, V, [7], _targets(5), seed=5)
    p.bias[11] = float("inf")
    ours = run_masked(op, p.to("cuda", torch.bfloat16))
    for name in ("logp", "entropy", "lse", "d_hidden", "d_weight", "d_bias"):
        assert getattr(ours, name).isnan().all(), name
    _check(source, p, torch.bfloat16, softcap=30.0)
    p = make_masked(N, D, V, [7], _targets(6), seed=6)
    p.hidden[2, 5] = float("nan")
    ours = run_masked(op, p.to("cuda", torch.bfloat16))
    rows = torch.arange(N, device="cuda") != 2
    for name in ("logp", "entropy", "lse"):
        out = getattr(ours, name)
        assert out[2].isnan() and not out[rows].isnan().any(), name


@pytest.mark.parametrize("source", SOURCES)
def test_fused_loss_with_masked_columns_gpu(source):
    cuda_backend(source)
    targets = torch.randint(2048, 4992, (N,), generator=torch.Generator().manual_seed(8)).tolist()
    p = make_masked(N, D, V, MASKED, [t + 1 if t in (2500, 3001) else t for t in targets], seed=8)
    on_gpu = p.to("cuda", torch.bfloat16)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(9))
    loss = (tplogp.losses.policy_gradient() + tplogp.losses.entropy_bonus(0.1)
            + tplogp.losses.z_loss(1e-3))

    def eager(logp, entropy, lse):
        return (-adv.to(logp.device, logp.dtype) * logp - 0.1 * entropy + 1e-3 * lse.square()).sum()

    h, w, b = (t.clone().requires_grad_() for t in (on_gpu.hidden, on_gpu.weight, on_gpu.bias))
    tplogp.linear_logp_loss(h, w, on_gpu.target, b, loss=loss, per_token=(adv.cuda(),),
                            temperature=0.8, source=source).backward()
    truth = masked_outputs(on_gpu, torch.float64, temperature=0.8, loss=eager)
    reference = masked_outputs(on_gpu, torch.bfloat16, temperature=0.8, loss=eager)
    found = []
    for name, ours in (("d_hidden", h.grad), ("d_weight", w.grad), ("d_bias", b.grad)):
        found += masked_problems(name, ours, getattr(reference, name), getattr(truth, name),
                                 torch.bfloat16)
    assert not found, "; ".join(found)


# ---- over ranks (the plugin's placement: a GPU per rank over NCCL, or ranks sharing one) --------

TP_V = 1031  # the LM-head fixtures' prime vocabulary: uneven shards, none a multiple of a tile


@pytest.fixture
def vocab_shards_size() -> int:
    return TP_V


# The fused sources on uneven shards (native, the registry's other choice, runs these cases on 2
# and 4 gloo ranks in tests/op/test_masked_vocab.py; even shards are a special case of the layout)
@pytest.mark.tp(world_size=[2, 4], timeout=600)
@pytest.mark.parametrize("op_source", SOURCES, indirect=True)
@pytest.mark.parametrize("vocab_shards", ["uneven"], indirect=True)
@pytest.mark.parametrize("case", ["shard", "one", "empty"])
@pytest.mark.parametrize("options", ["plain", "deterministic", "invariant"])
def test_tp_masked_vocab_gpu(tp, vocab_shards, op_source, case, options):
    """Rank 1's whole shard, the padded tail and two ids masked (``shard``), one unmasked column
    (``one``) or none (``empty``): the single-rank eager outputs and gradients on every rank."""
    vs = vocab_shards
    bounds = vs.boundaries()
    masked = torch.ones(TP_V, dtype=torch.bool)
    targets = [3, 3, 500, 3, 1030, 0] * 5
    if case == "shard":
        masked[:] = False
        masked[bounds[1]: bounds[2]] = True
        masked[1020:] = True
        masked[[4, 700]] = True
        targets = [bounds[1], 0, 4, 1025, 700, 60] * 5
    elif case == "one":
        masked[3] = False
    p = make_masked(30, 64, TP_V, masked, targets, seed=10).to(tp.device, torch.bfloat16)
    kw = dict(OPTIONS[options])
    ours = run_masked(op_source, p, weight=vs.shard(p.weight), bias=vs.shard(p.bias),
                      tp_group=tp.group, vocab_start_index=vs.start, global_vocab_size=TP_V, **kw)
    ref_kw = {k: v for k, v in kw.items() if k == "temperature"}
    truth = masked_outputs(p, torch.float64, **ref_kw)
    reference = masked_outputs(p, torch.bfloat16, **ref_kw)
    found = compare(ours, reference, truth, rows=slice(vs.start, vs.end), dtype=torch.bfloat16,
                    tie=TIE)
    tp.assert_all(not found, "; ".join(found))
