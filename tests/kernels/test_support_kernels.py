"""A sampler's support (``support=``) in the fused kernels (CPU interpreter): the triton source and
the sm90 kernels (tensor-descriptor loads, bypassing the Hopper check) mask the columns outside each
row's support through its bitmask (:mod:`tplogp.kernels.support_bits`), against the float64
definition (``tplogp.testing.reference.reference_support_outputs``) within the same-dtype
reference's error, fp32 and bf16, with temperature and softcap; at budgets that run the forward in
token chunks and the backward in column chunks (each with its chunk's bitmask), that keep part of
the shard's terms, and that keep all of them; on the gathered rows of a small union. The bitmask
against its definition, bit 31 and the words' edges included."""

from __future__ import annotations

import pytest
import torch

from tests.support.interpreter import KERNELS, interpreter_only
from tplogp.backends import memory_budget, native_support
from tplogp.kernels import support_bits
from tplogp.support.tensors import KEEP_ALL
from tplogp.testing.reference import reference_support_outputs
from tplogp.tolerances import assert_no_worse

pytestmark = interpreter_only
pytest.importorskip("triton")

from tplogp.api import linear_logp_on  # noqa: E402
from tplogp.backends import fused_support  # noqa: E402
from tplogp.kernels import backward_programs  # noqa: E402
from tplogp.op.plan import LogpOptions  # noqa: E402

CPU = torch.device("cpu")
DEFAULT = memory_budget.DLOGITS_WORKSPACE_BYTES
# two token blocks of the interpreter's tiles (the second cut); V past two 256-column chunks; D a
# multiple of 8 (the sm90 kernels' descriptors)
N, D, V, K = 37, 48, 600, 40
# ids at the words' and the chunks' edges (bit 31 among them), in every support that has room
EDGES = [31, 32, 63, 255, 256, 511, 512, 599]


def _problem(dtype: torch.dtype, seed: int):
    """hidden, weight, bias, targets ``[N]`` and a padded support ``[N, K]``: per token 1 to K
    distinct ids holding the target, the edge ids among them, ``-1`` padding; token 0 keeps its
    target alone, token 1 every edge id."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g)
    weight = torch.randn(V, D, generator=g) / D ** 0.5 * 3
    bias = torch.randn(V, generator=g) * 0.3
    target = torch.randint(0, V, (N,), generator=g)
    support = torch.full((N, K), -1, dtype=torch.int64)
    for t, y in enumerate(target.tolist()):
        size = 1 if t == 0 else K if t == 1 else int(torch.randint(2, K + 1, (), generator=g))
        first = [y] + [e for e in EDGES if e != y][: size - 1 if t == 1 or t % 3 == 0 else 0]
        rest = [v for v in torch.randperm(V, generator=g).tolist() if v not in first]
        ids = (first + rest)[:size]
        slots = torch.randperm(K, generator=g)[:size]
        support[t, slots] = torch.tensor(ids)
    return (hidden.to(dtype), weight.to(dtype), bias.to(dtype), target, support)


def _run(be, problem, **kw):
    """logp, entropy, lse and the gradients of ``sum(logp + 0.5 entropy + 0.25 lse)`` on the
    backend ``be``."""
    hidden, weight, bias, target, support = problem
    leaves = tuple(t.clone().requires_grad_() for t in (hidden, weight, bias))
    out = linear_logp_on(be, *leaves[:2], target, leaves[2],
                         options=LogpOptions(return_entropy=True, return_lse=True, support=support,
                                             **kw))
    (out.logp.sum() + 0.5 * out.entropy.sum() + 0.25 * out.lse.sum()).backward()
    return (out.logp, out.entropy, out.lse), tuple(t.grad for t in leaves)


def _reference(problem, mode: str, **kw):
    hidden, weight, bias, target, support = problem
    dt = torch.float64 if mode == "float64" else None
    leaves = tuple((t.to(dt) if dt else t).clone().requires_grad_() for t in (hidden, weight, bias))
    kw = {k: v for k, v in kw.items() if k in ("temperature", "softcap")}
    ref = reference_support_outputs(leaves[0], leaves[1], target, support, leaves[2], mode=mode,
                                    **kw)
    (ref.logp.sum() + 0.5 * ref.entropy.sum() + 0.25 * ref.lse.sum()).backward()
    return (ref.logp, ref.entropy, ref.lse), tuple(t.grad for t in leaves)


def _check(ours, problem, dtype, **kw):
    """The problems of ``ours`` against the float64 definition, within the same-dtype reference's
    error (three-way)."""
    truth = _reference(problem, "float64", **kw)
    ref = _reference(problem, "fp32" if dtype == torch.float32 else "matching", **kw)
    found = []
    names = (("logp", "entropy", "lse"), ("d_hidden", "d_weight", "d_bias"))
    for part in (0, 1):
        for name, a, r, t in zip(names[part], ours[part], ref[part], truth[part]):
            try:
                assert_no_worse(name, a.detach().float(), r.detach().float(), t.detach(), dtype)
            except AssertionError as exc:
                found.append(str(exc))
    return found


def _seen(monkeypatch) -> dict:
    """Records the forward's token chunks (rows of each chunk's bitmask) and the backward's
    recomputed column chunks (the width of each one's bitmask, None without one)."""
    seen = {"forward rows": [], "backward chunks": [], "kept chunks": 0}
    real_bits, real_dlogits = support_bits.column_bits, backward_programs.launch_dlogits
    real_kept = backward_programs.launch_dlogits_kept

    def column_bits(ids, v_lo, v_hi):
        if v_lo == 0 and v_hi == V:  # (the forward's: the whole shard)
            seen["forward rows"].append(ids.shape[0])
        return real_bits(ids, v_lo, v_hi)

    def launch_dlogits(*args, bits=None, **kw):
        seen["backward chunks"].append((args[12], args[13],
                                        None if bits is None else tuple(bits.shape)))
        return real_dlogits(*args, bits=bits, **kw)

    def launch_dlogits_kept(*args, **kw):
        seen["kept chunks"] += 1
        return real_kept(*args, **kw)

    monkeypatch.setattr(support_bits, "column_bits", column_bits)
    monkeypatch.setattr(backward_programs, "launch_dlogits", launch_dlogits)
    monkeypatch.setattr(backward_programs, "launch_dlogits_kept", launch_dlogits_kept)
    return seen


@pytest.mark.parametrize("kernels", list(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("options", [{}, {"temperature": 0.7, "softcap": 6.0}],
                         ids=["plain", "temperature-softcap"])
def test_masked_chunks_match_the_definition(kernels, dtype, options, monkeypatch):
    """A budget of 1 byte: the forward in token chunks of one token block (32 rows, then 5), the
    backward in three column chunks, each with the bitmask of its columns only; outputs and
    gradients as the definition's."""
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    monkeypatch.setattr(native_support, "GATHER_FRACTION", -1.0)
    problem = _problem(dtype, seed=1)
    seen = _seen(monkeypatch)
    ours = _run(KERNELS[kernels](), problem, workspace_bytes=1, **options)
    found = _check(ours, problem, dtype, **options)
    assert not found, "; ".join(found)
    assert seen["forward rows"] == [32, N - 32], seen
    words = support_bits.bit_words(256)
    assert seen["backward chunks"] == [(0, 256, (N, words)), (256, 512, (N, words)),
                                       (512, V, (N, support_bits.bit_words(V - 512)))], seen
    assert seen["kept chunks"] == 0, seen
    # a token whose support is its target alone: logp 0 and entropy 0 exactly
    assert ours[0][0][0].item() == 0.0 and ours[0][1][0].item() == 0.0


@pytest.mark.parametrize("kernels", list(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kept_terms_with_a_support(kernels, dtype, monkeypatch):
    """Budgets that keep the terms of the first 512 columns (their d_logits from the kept terms,
    0 outside the support; the rest recomputed with its bitmask) and of the whole shard (no
    bitmask in the backward): outputs and gradients as the definition's."""
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    monkeypatch.setattr(native_support, "GATHER_FRACTION", -1.0)
    problem = _problem(dtype, seed=2)
    be = KERNELS[kernels]()
    kw = dict(temperature=0.9)
    for budget, recomputed in ((DEFAULT + be.kept_bytes(N, 520, dtype, CPU), [(512, V)]),
                               (None, [])):
        with monkeypatch.context() as m:
            seen = _seen(m)
            ours = _run(be, problem, workspace_bytes=budget, **kw)
        found = _check(ours, problem, dtype, **kw)
        assert not found, f"budget {budget}: " + "; ".join(found)
        assert [c[:2] for c in seen["backward chunks"]] == recomputed, (budget, seen)
        assert all(c[2] is not None for c in seen["backward chunks"]), seen
        assert seen["kept chunks"] >= 1 and seen["forward rows"] == [N], (budget, seen)


@pytest.mark.parametrize("kernels", list(KERNELS))
def test_gathered_rows_with_the_kernels(kernels, monkeypatch):
    """A small union (supports of 1 to 4 ids): the kernels run on its gathered rows (forward and
    backward), argmax and d_W / d_b rows put back at the shard's ids (0 on the others)."""
    monkeypatch.setattr(native_support, "GATHER_FRACTION", 0.5)
    hidden, weight, bias, target, _ = _problem(torch.float32, seed=3)
    support = torch.full((N, 4), -1, dtype=torch.int64)
    for t, y in enumerate(target.tolist()):  # its target, then up to 3 ids of a pool of 5
        others = [v for v in (3, 31, 100, 256, 599) if v != y][: t % 4]
        support[t, : 1 + len(others)] = torch.tensor([y, *others])
    problem = (hidden, weight, bias, target, support)
    calls = []
    for module in (fused_support, native_support):  # (the forward's; the backward's)
        real = module.gathered

        def gathered(*args, real=real):
            narrow = real(*args)
            calls.append(narrow is not None)
            return narrow

        monkeypatch.setattr(module, "gathered", gathered)
    ours = _run(KERNELS[kernels](), problem, softcap=5.0)
    found = _check(ours, problem, torch.float32, softcap=5.0)
    assert not found, "; ".join(found)
    assert calls.count(True) == 2, calls  # (the forward's and the backward's)
    kept = torch.zeros(V, dtype=torch.bool)
    kept[support[support >= 0]] = True
    assert torch.all(ours[1][1][~kept] == 0) and torch.all(ours[1][2][~kept] == 0)
    out = linear_logp_on(KERNELS[kernels](), hidden, weight, target, bias,
                         options=LogpOptions(return_argmax=True, support=support))
    z = hidden.double() @ weight.double().T + bias.double()
    expected = z.masked_fill(~kept_mask(support), float("-inf")).argmax(1)
    assert torch.equal(out.argmax, expected), (out.argmax, expected)


def kept_mask(support: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` bool of the padded support (the definition)."""
    mask = torch.zeros(support.shape[0], V + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(support >= 0, support, V), True)
    return mask[:, :V]


@pytest.mark.parametrize("v_lo, v_hi", [(0, V), (256, 512), (512, V), (31, 33), (5, 5)])
def test_column_bits_are_the_definition(v_lo, v_hi):
    """Bit ``c % 32`` of word ``c // 32`` of row ``t`` is set iff the column ``v_lo + c`` is one of
    the row's ids: bit 31 (a negative word), ``-1`` padding, ids outside the range, rows keeping
    nothing."""
    _, _, _, _, support = _problem(torch.float32, seed=4)
    support[5] = -1
    bits = support_bits.column_bits(support, v_lo, v_hi)
    cols = v_hi - v_lo
    assert bits.dtype == torch.int32 and bits.shape == (N, support_bits.bit_words(cols))
    c = torch.arange(cols)
    unpacked = ((bits[:, c // 32] >> (c % 32)) & 1).bool()
    assert torch.equal(unpacked, kept_mask(support)[:, v_lo:v_hi])
    if (v_lo, v_hi) == (0, V):  # token 1 keeps id 31: bit 31, a negative word
        assert bits[1, 0] < 0
    # the words past the last column stay 0
    tail = support_bits.bit_words(cols) * 32 - cols
    if tail:
        assert torch.all((bits[:, -1].long() & 0xFFFFFFFF) >> (32 - tail) == 0)


@pytest.mark.parametrize("edges", [[0, V], [0, 31, 256, 300, V], [64, 65, 512, V], [256, 512]])
def test_column_chunks_are_column_bits(edges):
    """Each range's bitmask from the ids sorted by column once equals :func:`column_bits` of the
    range: ids below the first edge or past the last left out, padding, a row keeping nothing, a
    row keeping every id (``KEEP_ALL``), bit 31, a one-column range."""
    _, _, _, _, support = _problem(torch.float32, seed=5)
    support[5] = -1
    support[6, 0] = KEEP_ALL
    chunks = support_bits.ColumnChunks(support, edges)
    for i, (v_lo, v_hi) in enumerate(zip(edges[:-1], edges[1:])):
        assert torch.equal(chunks.bits(i), support_bits.column_bits(support, v_lo, v_hi)), i
        assert torch.all(chunks.bits(i)[6] == -1) and not chunks.bits(i)[5].any()


def test_forward_rows_follow_the_budget():
    """All rows when their bitmask fits, else whole token blocks that fit, at least one."""
    per_row = 4 * support_bits.bit_words(V)  # 76 bytes
    assert support_bits.forward_rows(N, V, N * per_row, 32) == N
    assert support_bits.forward_rows(1000, V, 100 * per_row, 32) == 96
    assert support_bits.forward_rows(1000, V, 1, 32) == 32
    assert support_bits.forward_rows(0, V, 0, 32) == 1
    # the backward's workspace and its chunk's bitmask fit the budget together
    for itemsize in (2, 4):
        part = support_bits.chunk_itemsize_budget(1 << 20, itemsize)
        assert part + part / (8 * itemsize) <= 1 << 20


def test_tiles_narrower_than_a_word():
    """Tiles of 16 columns (a config shrunk to fit a small shared memory; the softcap's half tiles
    of 8): each element's word is read; outputs and gradients as the definition's, in chunks."""
    import dataclasses

    from tplogp.backends.triton_backend import TritonBackend
    from tplogp.kernels import tiles

    cfg = dataclasses.replace(tiles.INTERPRETER, block_v=16, bwd_block_v=16, split_tiles=4)
    problem = _problem(torch.float32, seed=6)
    kw = dict(softcap=5.0, temperature=1.2)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(native_support, "GATHER_FRACTION", -1.0)
        ours = _run(TritonBackend(cfg), problem, workspace_bytes=1, **kw)
    found = _check(ours, problem, torch.float32, **kw)
    assert not found, "; ".join(found)
