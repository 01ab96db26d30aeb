"""DTensor LM heads on 4 gloo ranks: a weight (and bias) placed ``Shard(0)`` over an uneven
vocabulary (101 ids: torch.chunk gives 26, 26, 26, 23 rows) on a 1-D mesh and on the TP dimension of
a 2 x 2 mesh, against float64 (no worse than the fp32 PyTorch reference, the three-way rule of
``tplogp.tolerances``). ``weight.grad`` comes back as a DTensor with the weight's placements
(``Partial()`` over data-parallel dims of a sharded hidden)."""

from __future__ import annotations

import pytest
import torch

from tests.support.problems import make_problem, run_reference
from tplogp import LinearLogpInputError, linear_logp
from tplogp.tolerances import assert_no_worse

V, D = 101, 24


def _mesh(tp, layout):
    """(mesh, vocab dim): a 1-D mesh over the world, or a (dp, tp) = (2, 2) mesh; groups cached by
    the pool."""
    from torch.distributed.device_mesh import DeviceMesh

    if layout == "1d":
        return DeviceMesh.from_group(tp.group, "cpu", mesh_dim_names=("tp",)), 0
    ranks = torch.arange(tp.world_size).view(2, tp.world_size // 2)
    dp = [tp.new_group(col.tolist()) for col in ranks.T]
    tp_groups = [tp.new_group(row.tolist()) for row in ranks]
    row, col = divmod(tp.rank, tp.world_size // 2)
    return DeviceMesh.from_group([dp[col], tp_groups[row]], "cpu", mesh=ranks,
                                 mesh_dim_names=("dp", "tp")), 1


def _close(tp, name, ours, reference, truth):
    """The three-way rule on every rank: error vs float64 no worse than the fp32 PyTorch reference's
    (+ slack)."""
    try:
        assert_no_worse(name, ours.detach(), reference, truth, torch.float32)
        problem = ""
    except AssertionError as exc:
        problem = str(exc)
    tp.assert_all(not problem, problem)


@pytest.mark.tp(world_size=4, timeout=300)
@pytest.mark.parametrize("layout", ["1d", "2d"])
@pytest.mark.parametrize("hidden_kind", ["plain", "replicate"])
def test_dtensor_weight_against_float64(tp, layout, hidden_kind):
    """logp / entropy plain (or Replicate DTensors); weight.grad, bias.grad DTensors with the
    weight's placements."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh, tp_dim = _mesh(tp, layout)
    placements = [Replicate()] * mesh.ndim
    placements[tp_dim] = Shard(0)
    # the same tensors on every rank
    p = make_problem((3, 7), D, V, torch.float32, True, seed=8, peaked=True)
    w = distribute_tensor(p.weight, mesh, placements).requires_grad_()
    b = distribute_tensor(p.bias, mesh, placements).requires_grad_()
    h_plain = p.hidden.clone().requires_grad_()
    h = h_plain if hidden_kind == "plain" else DTensor.from_local(h_plain, mesh,
                                                                  [Replicate()] * mesh.ndim)
    logp, entropy = linear_logp(h, w, p.target, b, return_entropy=True)
    if hidden_kind == "plain":
        assert type(logp) is torch.Tensor and type(entropy) is torch.Tensor
    else:
        assert isinstance(logp, DTensor) and tuple(logp.placements) == (Replicate(),) * mesh.ndim
        assert logp.shape == p.target.shape
        logp, entropy = logp.to_local(), entropy.to_local()
    ((logp * p.g_logp).sum() + (entropy * p.g_entropy).sum()).backward()

    truth, ref = run_reference(p, "float64", entropy=True), run_reference(p, "fp32", entropy=True)
    _close(tp, "logp", logp, ref.logp, truth.logp)
    _close(tp, "entropy", entropy, ref.entropy, truth.entropy)
    _close(tp, "d_hidden", h_plain.grad, ref.d_hidden, truth.d_hidden)
    for name, param, full in (("d_weight", w, truth.d_weight), ("d_bias", b, truth.d_bias)):
        tp.assert_all(isinstance(param.grad, DTensor)
                      and tuple(param.grad.placements) == tuple(placements),
                      f"{name} must be a DTensor placed {placements}, got {type(param.grad).__name__}")
        _close(tp, name, param.grad.full_tensor(), getattr(ref, name), full)


@pytest.mark.tp(world_size=4, timeout=300)
def test_dtensor_hidden_sharded_over_data_parallel_dim(tp):
    """2 x 2 (dp, tp) mesh, hidden Shard(0) on dp: logp is sharded like hidden; weight.grad sums
    over dp (Partial)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh, _ = _mesh(tp, "2d")
    p = make_problem((8,), D, V, torch.float32, False, seed=12)
    w = distribute_tensor(p.weight, mesh, [Replicate(), Shard(0)]).requires_grad_()
    # this dp rank's 4 of the 8 tokens
    rows = slice(4 * mesh.get_local_rank(0), 4 * mesh.get_local_rank(0) + 4)
    h_local = p.hidden[rows].clone().requires_grad_()
    h = DTensor.from_local(h_local, mesh, [Shard(0), Replicate()])
    logp = linear_logp(h, w, p.target[rows])
    assert isinstance(logp, DTensor) and tuple(logp.placements) == (Shard(0), Replicate())
    assert logp.shape == p.target.shape
    (logp.to_local() * p.g_logp[rows]).sum().backward()
    truth, ref = run_reference(p, "float64"), run_reference(p, "fp32")
    _close(tp, "logp", logp.full_tensor(), ref.logp, truth.logp)
    tp.assert_all(tuple(w.grad.placements) == (Partial(), Shard(0)),
                  f"weight.grad placed {w.grad.placements}")
    _close(tp, "d_weight", w.grad.full_tensor(), ref.d_weight, truth.d_weight)
    _close(tp, "d_hidden", h_local.grad, ref.d_hidden[rows], truth.d_hidden[rows])


@pytest.mark.tp(world_size=4, timeout=120)
def test_dtensor_bad_placements_raise_on_every_rank(tp):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh, _ = _mesh(tp, "1d")
    p = make_problem((5,), D, V, torch.float32, False, seed=1)
    messages = []
    for w in (distribute_tensor(p.weight, mesh, [Replicate()]),
              distribute_tensor(p.weight, mesh, [Shard(1)])):
        try:
            linear_logp(p.hidden, w, p.target)
            messages.append("no error")
        except LinearLogpInputError as exc:
            messages.append(str(exc))
    try:
        linear_logp(p.hidden, distribute_tensor(p.weight, mesh, [Shard(0)]), p.target,
                    tp_group=tp.group)
        messages.append("no error")
    except LinearLogpInputError as exc:
        messages.append(str(exc))
    tp.assert_all(all("Shard(0) on one mesh dimension" in m for m in messages[:2]), str(messages))
    tp.assert_all("come from the DTensor" in messages[2], messages[2])
