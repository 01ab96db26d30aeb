"""The sampler's support (``support=``, docs/operator.md, "Sampler's support") on a CUDA GPU: the
registry's automatic choice runs such calls on the source it takes without one (the fused sources
run a support), and the outputs and gradients of the registry's choice and of the triton, sm90 and
native sources named explicitly match the float64 definition
(``tplogp.testing.reference.reference_support_outputs``) within the same-dtype PyTorch reference's
error, in bf16 and fp32, with temperature and softcap, on every way (every tile masked; the gathered
rows of the supports' union; token chunks, with a backward from fp32 accumulators or from the
(token, id) pairs), at the default budget and at one that runs the fused forward in token
chunks and its backward in column chunks (each with its support bitmask); the fused loss with a
support on each source; in one process and over ranks through the plugin (uneven shards).

Run on a GPU machine: ``python -m pytest tests/gpu/test_support_gpu.py -m gpu`` (``-n 4`` for the
TP tests on one GPU, or ``-n 1`` on 4 GPUs: NCCL).
"""

from __future__ import annotations

import pytest
import torch

import tplogp
from tplogp import losses
from tplogp.backends import native_support
from tplogp.backends.base import ShardCall
from tplogp.backends.kernel_registry import backend_for_call, unavailable_reason
from tplogp.testing.reference import reference_support_outputs
from tplogp.tolerances import assert_no_worse

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
N, D, V, K = 300, 256, 5003, 64
TP_V = 1031
OPTIONS = {"plain": dict(), "temperature-softcap": dict(temperature=0.7, softcap=30.0)}


def _problem(n: int, vocab: int, seed: int, device, dtype):
    """hidden, weight, bias, targets and a padded support of 1 to K distinct ids per token, its
    target among them, ``-1`` padding (every fourth token: its target alone)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, D, generator=g)
    weight = torch.randn(vocab, D, generator=g) / D ** 0.5 * 3
    bias = torch.randn(vocab, generator=g) * 0.2
    target = torch.randint(0, vocab, (n,), generator=g)
    scores = torch.rand(n, vocab, generator=g)
    scores[torch.arange(n), target] = 2.0
    support = scores.topk(K, dim=1).indices
    support = support.gather(1, torch.rand(n, K, generator=g).argsort(dim=1))
    sizes = torch.randint(1, K + 1, (n,), generator=g)
    sizes[::4] = 1
    ranked = (scores.gather(1, support).argsort(1, descending=True).argsort(1))
    support = torch.where(ranked < sizes.unsqueeze(1), support, -1)  # the target ranks first
    to = dict(device=device)
    return (hidden.to(**to, dtype=dtype), weight.to(**to, dtype=dtype),
            bias.to(**to, dtype=dtype), target.to(**to), support.to(**to))


def _check(outputs, leaves, problem, dtype, rows=slice(None), **kw):
    """Three-way checks of logp, entropy, lse and the gradients of ``sum(logp + 0.5 entropy +
    0.25 lse)`` (``rows``: this rank's of d_W and d_b); the problems found."""
    hidden, weight, bias, target, support = problem
    found, results = [], {}
    for ref_dtype in (torch.float64, dtype):
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        mode = ("float64" if ref_dtype == torch.float64 else
                "fp32" if dtype == torch.float32 else "matching")
        ref = reference_support_outputs(h, w, target, support, b, mode=mode, **kw)
        (ref.logp.sum() + 0.5 * ref.entropy.sum() + 0.25 * ref.lse.sum()).backward()
        results[ref_dtype] = ((ref.logp, ref.entropy, ref.lse), (h.grad, w.grad[rows],
                                                                 b.grad[rows]))
    logp, entropy, lse = outputs
    (logp.sum() + 0.5 * entropy.sum() + 0.25 * lse.sum()).backward()
    ours = ((logp, entropy, lse), tuple(t.grad for t in leaves))
    for part in (0, 1):
        names = ("logp", "entropy", "lse") if part == 0 else ("d_hidden", "d_weight", "d_bias")
        for name, a, r, t in zip(names, ours[part], results[dtype][part],
                                 results[torch.float64][part]):
            try:
                assert_no_worse(name, a.detach().float(), r.detach().float(), t.detach(), dtype)
            except AssertionError as exc:
                found.append(str(exc))
    return found


# the budgets of the explicit sources' test: the default (one forward, the shard's terms kept
# whole), and 1 byte (the fused forward in token chunks of one token block, the backward in
# 256-column chunks, each with its bitmask)
BUDGETS = {"default": None, "chunks": 1}


@pytest.mark.parametrize("path", ["mask", "gather"])
@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_support_on_the_registry_choice(dtype, options, path, monkeypatch):
    """The automatic choice with a support is the one without (a fused source on a GPU where one
    runs: none names the feature missing), and its outputs and gradients match the definition, on
    both of its ways (masked tiles; the gathered rows of the supports' union)."""
    monkeypatch.setattr(native_support, "GATHER_FRACTION", -1.0 if path == "mask" else 1.0)
    dt = DTYPES[dtype]
    device = torch.device("cuda")
    assert (backend_for_call(None, device, dt, features=("support",)).name
            == backend_for_call(None, device, dt).name)
    problem = _problem(N, V, seed=1, device=device, dtype=dt)
    hidden, weight, bias, target, support = problem
    leaves = tuple(t.clone().requires_grad_() for t in (hidden, weight, bias))
    kw = OPTIONS[options]
    out = tplogp.linear_logp(leaves[0], leaves[1], target, leaves[2], return_entropy=True,
                             return_lse=True, support=support, **kw)
    found = _check(tuple(out), leaves, problem, dt, **kw)
    assert not found, "; ".join(found)


def _op(source: str):
    """The op on ``source``; ``sm90-tma``: the sm90 source launching its TMA kernels at any size
    (the plain sm90 source launches them above ``TMA_MIN_MACS`` only)."""
    if source != "sm90-tma":
        return tplogp.get_op("linear_logp", source)
    from tplogp.api import linear_logp_on
    from tplogp.backends.sm90_backend import SM90Backend
    from tplogp.op.plan import LogpOptions

    backend = SM90Backend(tma_min_macs=0)
    return lambda h, w, y, b, **kw: linear_logp_on(backend, h, w, y, b,
                                                   options=LogpOptions(**kw))


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("path", ["mask", "gather"])
@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("source", ["sm90-tma", "sm90", "triton", "native"])
def test_support_on_each_source(source, dtype, options, path, budget, monkeypatch):
    """Each source named explicitly with a support (sm90 with its TMA kernels and with its pointer
    kernels): outputs and gradients as the definition's, on both ways, at the default budget and at
    one that chunks the fused forward's tokens and the backward's columns."""
    device = torch.device("cuda")
    dt = DTYPES[dtype]
    name = source.split("-")[0]
    if unavailable_reason(name, device, dt, ("support",)) is not None:
        pytest.skip(unavailable_reason(name, device, dt, ("support",)))
    monkeypatch.setattr(native_support, "GATHER_FRACTION", -1.0 if path == "mask" else 1.0)
    problem = _problem(N, V, seed=4, device=device, dtype=dt)
    hidden, weight, bias, target, support = problem
    leaves = tuple(t.clone().requires_grad_() for t in (hidden, weight, bias))
    kw = OPTIONS[options]
    out = _op(source)(leaves[0], leaves[1], target, leaves[2], return_entropy=True,
                      return_lse=True, support=support, workspace_bytes=BUDGETS[budget], **kw)
    found = _check(tuple(out), leaves, problem, dt, **kw)
    assert not found, f"{source}: " + "; ".join(found)


@pytest.mark.parametrize("way", ["chunks", "pairs"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("source", ["sm90", "triton", "native"])
def test_narrow_supports_in_token_chunks_on_each_source(source, dtype, way, monkeypatch):
    """Narrow supports whose union is most of the shard: from their (token, id) pairs, forward and
    backward (``pairs``: :mod:`tplogp.backends.support_pairs`), or, with that way off, in token
    chunks of 19 tokens on the gathered rows of each chunk's union, the backward adding each
    chunk's d_W rows to fp32 accumulators (``chunks``). Outputs and gradients as the
    definition's, with temperature and softcap."""
    from tplogp.backends import support_pairs

    device = torch.device("cuda")
    dt = DTYPES[dtype]
    if unavailable_reason(source, device, dt, ("support",)) is not None:
        pytest.skip(unavailable_reason(source, device, dt, ("support",)))
    monkeypatch.setattr(native_support, "GATHER_FRACTION", 0.25)
    monkeypatch.setattr(native_support, "MIN_CHUNK_ROWS", 1)
    ran = []
    real_chunks, real_pairs = native_support.chunked_backward, support_pairs.backward
    monkeypatch.setattr(native_support, "chunked_backward",
                        lambda *args: ran.append("chunks") or real_chunks(*args))
    monkeypatch.setattr(support_pairs, "backward",
                        lambda *args: ran.append("pairs") or real_pairs(*args))
    if way == "chunks":
        monkeypatch.setattr(support_pairs, "MAX_IDS", 0)  # (never from the pairs)
    problem = _problem(N, V, seed=6, device=device, dtype=dt)
    hidden, weight, bias, target, support = problem
    leaves = tuple(t.clone().requires_grad_() for t in (hidden, weight, bias))
    kw = OPTIONS["temperature-softcap"]
    out = tplogp.get_op("linear_logp", source)(leaves[0], leaves[1], target, leaves[2],
                                               return_entropy=True, return_lse=True,
                                               support=support, **kw)
    found = _check(tuple(out), leaves, problem, dt, **kw)
    assert not found, f"{source}: " + "; ".join(found)
    assert ran == [way], ran


SAMPLER_CASES = {"top_k": dict(top_k=5), "top_p": dict(top_p=0.8), "min_p": dict(min_p=0.1),
                 "all": dict(top_k=9, top_p=0.7, min_p=0.05)}


@pytest.mark.parametrize("case", list(SAMPLER_CASES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("source", ["sm90", "triton", "native"])
def test_sampler_parameters_on_each_source(source, dtype, case):
    """``top_k`` / ``top_p`` / ``min_p`` computed on the GPU (its fp32-output GEMMs, the passes'
    tile kernels): on logits exact in every dtype (small dyadic values: exact ties) the kept
    ids are the float64 definition's (``tplogp.testing.reference.sampler_mask``, exact ties at the
    k-th logit), and the op's outputs and gradients, with the parameters and with that explicit
    support (the targets drawn from it, as a sampler draws them), are the float64 definition's
    by the three-way rule and equal each other (a 16-bit call's forward takes its statistics from
    the sampler's logits, its sums in another order than the explicit support's forward: there
    its logp and entropy equal, its gradients by the three-way rule)."""
    from tplogp.op.options import LogpOptions
    from tplogp.op.sampler_params import per_token
    from tplogp.op.sampler_support import sampler_support
    from tplogp.testing.reference import padded_support, reference_logits, sampler_mask

    device, dt = torch.device("cuda"), DTYPES[dtype]
    if unavailable_reason(source, device, dt, ("support",)) is not None:
        pytest.skip(unavailable_reason(source, device, dt, ("support",)))
    n, d, v = 300, 64, 3001
    g = torch.Generator().manual_seed(7)
    hidden = torch.randint(-2, 3, (n, d), generator=g).float() / 2
    weight = torch.randint(-4, 5, (v, d), generator=g).float() / 4
    bias = torch.randint(-4, 5, (v,), generator=g).float() / 8
    params = SAMPLER_CASES[case]
    keep = sampler_mask(reference_logits(hidden, weight, bias, mode="float64"), **params)
    target = torch.multinomial(keep.float(), 1, generator=g).squeeze(1)  # (a kept id)
    hidden, weight, bias, target = (t.to(device) for t in (hidden.to(dt), weight.to(dt),
                                                          bias.to(dt), target))
    ids = sampler_support(hidden, weight, bias, per_token(LogpOptions(**params), n, device, v),
                          call=ShardCall(), vocab_start=0, vocab=v, group=None,
                          comm_device=device)
    ours = torch.zeros(n, v + 1, dtype=torch.bool, device=device)
    ours.scatter_(1, torch.where(ids >= 0, ids, v), True)
    bad = (ours[:, :v].cpu() != keep).any(1).nonzero().squeeze(1).tolist()
    assert not bad, f"{source} {dtype} {case}: tokens {bad[:8]} keep other ids"
    support = padded_support(keep).to(device)
    op = tplogp.get_op("linear_logp", source)
    results = []
    for kw in (params, dict(support=support)):
        leaves = tuple(t.clone().requires_grad_() for t in (hidden, weight, bias))
        out = op(leaves[0], leaves[1], target, leaves[2], return_entropy=True, return_lse=True,
                 **kw)
        found = _check(tuple(out), leaves, (hidden, weight, bias, target, support), dt)
        assert not found, f"{source} {dtype} {case} {list(kw)}: " + "; ".join(found)
        results.append((out.logp.detach(), out.entropy.detach(), *(t.grad for t in leaves)))
    # the same values (fp32: the same way; 16-bit: the statistics' sums in another order, so the
    # gradients, rounded to the input dtype, by the three-way rule above)
    names = ("logp", "entropy", "d_hidden", "d_weight", "d_bias")
    for name, a, b in list(zip(names, *results))[:5 if dt == torch.float32 else 2]:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True,
                                   msg=lambda m, name=name: f"{source} {case} {name}: {m}")


@pytest.mark.parametrize("source", ["sm90", "triton", "native"])
def test_fused_loss_with_support_on_each_source(source):
    """``linear_logp_loss`` (cross-entropy plus an entropy bonus, bf16) with a support on each
    source: the loss and the gradients as the definition's (float64 truth, the bf16 reference's
    error)."""
    device, dt = torch.device("cuda"), torch.bfloat16
    if unavailable_reason(source, device, dt, ("support",)) is not None:
        pytest.skip(unavailable_reason(source, device, dt, ("support",)))
    problem = _problem(N, V, seed=5, device=device, dtype=dt)
    hidden, weight, bias, target, support = problem
    leaves = tuple(t.clone().requires_grad_() for t in (hidden, weight, bias))
    value = tplogp.linear_logp_loss(*leaves[:2], target, leaves[2], support=support,
                                    loss=losses.cross_entropy() + losses.entropy_bonus(0.2),
                                    source=source)
    value.backward()
    results = {}
    for ref_dtype in (torch.float64, dt):
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        mode = "float64" if ref_dtype == torch.float64 else "matching"
        ref = reference_support_outputs(h, w, target, support, b, mode=mode)
        loss = (-ref.logp.float() - 0.2 * ref.entropy.float()).sum()
        loss.backward()
        results[ref_dtype] = (loss.detach(), h.grad, w.grad, b.grad)
    found = []
    for name, a, r, t in zip(("loss", "d_hidden", "d_weight", "d_bias"),
                             (value.detach(), *(x.grad for x in leaves)), results[dt],
                             results[torch.float64]):
        try:
            assert_no_worse(name, a.float().reshape(-1), r.float().reshape(-1),
                            t.double().reshape(-1), dt)
        except AssertionError as exc:
            found.append(str(exc))
    assert not found, f"{source}: " + "; ".join(found)


@pytest.fixture
def vocab_shards_size() -> int:
    return TP_V


@pytest.mark.tp(world_size=[2, 4], timeout=600)
def test_tp_support_gpu(tp, vocab_shards):
    """Over the ranks (bf16, uneven shards; ids global; the registry's choice, a fused source where
    one runs): outputs and this rank's gradient rows as the definition's."""
    vs = vocab_shards
    problem = _problem(64, TP_V, seed=3, device=tp.device, dtype=torch.bfloat16)
    hidden, weight, bias, target, support = problem
    leaves = (hidden.clone().requires_grad_(), vs.shard(weight).clone().requires_grad_(),
              vs.shard(bias).clone().requires_grad_())
    out = tplogp.linear_logp(leaves[0], leaves[1], target, leaves[2], tp_group=tp.group,
                             vocab_start_index=vs.start, global_vocab_size=TP_V,
                             return_entropy=True, return_lse=True, support=support,
                             temperature=0.8)
    found = _check(tuple(out), leaves, problem, torch.bfloat16, rows=slice(vs.start, vs.end),
                   temperature=0.8)
    tp.assert_all(not found, "; ".join(found))
