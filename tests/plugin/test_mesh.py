"""The mesh fixture and the DTensor helpers, as TP tests on gloo (world sizes 2 and 4, the suite's
pools; one NCCL test on GPUs).

Meshes: names, order and row-major layout, sub-mesh groups, the default 1-D mesh, parametrized
meshes, the cache. DTensors: tp.assert_close with a DTensor on either side and its failure message
naming mesh coordinates; tp.distribute_randn with Shard, Replicate and uneven shards; vocab_shards /
reference over mesh["tp"]. The collection error and the ids (test_mesh_session.py), and the
fresh-state check across tests (test_fixtures_and_state.py) are pytester runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pytest_tplogp import CollectiveAssertionError


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


@pytest.mark.tp(world_size=4, mesh={"dp": 2, "tp": 2}, backend="gloo")
def test_2d_mesh_names_layout_and_sub_mesh_groups(tp, mesh):
    from torch.distributed.device_mesh import DeviceMesh

    assert isinstance(mesh, DeviceMesh) and mesh.device_type == tp.device.type == "cpu"
    assert mesh.mesh_dim_names == ("dp", "tp")
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]  # row-major, as init_device_mesh lays it out
    row, col = divmod(tp.rank, 2)
    assert list(mesh.get_coordinate()) == [row, col]
    assert mesh.get_local_rank("dp") == row and mesh.get_local_rank("tp") == col
    assert _ranks(mesh["tp"].get_group()) == [2 * row, 2 * row + 1]
    assert _ranks(mesh.get_group("dp")) == [col, col + 2]
    # the sub-mesh groups communicate: a sum over tp is the sum of this row's ranks
    x = torch.tensor([float(tp.rank)])
    dist.all_reduce(x, group=mesh["tp"].get_group())
    assert x.item() == 4 * row + 1
    # the same shape again is the same object, and costs no new group
    from torch.distributed import distributed_c10d as c10d

    before = len(c10d._world.pg_map)
    assert tp.device_mesh({"dp": 2, "tp": 2}) is mesh
    assert len(c10d._world.pg_map) == before


@pytest.mark.tp(world_size=[2, 4], backend="gloo")
def test_default_mesh_is_1d_tp_over_the_world(tp, mesh):
    assert mesh.mesh_dim_names == ("tp",)
    assert mesh.mesh.tolist() == list(range(tp.world_size))
    # the default group, as init_device_mesh uses for a full dim
    assert mesh.get_group() is tp.group


# Three shapes: dims in a non-alphabetical order, a 1-D mesh with a name of its own, and world size
# 2.
@pytest.mark.tp(mesh=[{"tp": 2, "dp": 2}, {"cp": 4}, {"dp": 1, "tp": 2}], backend="gloo")
def test_parametrized_meshes_keep_their_names_and_order(tp, mesh):
    expected = {("tp", "dp"): [[0, 1], [2, 3]], ("cp",): [0, 1, 2, 3], ("dp", "tp"): [[0, 1]]}
    assert mesh.mesh.tolist() == expected[mesh.mesh_dim_names]
    assert mesh.size() == tp.world_size
    if mesh.mesh_dim_names == ("tp", "dp"):  # the first dim is "tp": its groups are the rows
        assert _ranks(mesh["tp"].get_group()) == [tp.rank % 2, tp.rank % 2 + 2]


def test_mesh_shape_ids_and_errors() -> None:
    from pytest_tplogp.mesh import MeshShape, MeshShapeError, parse_marker_meshes

    shapes = parse_marker_meshes([{"dp": 2, "tp": 2}, {"tp": 4}], None, "t")
    assert [s.id for s in shapes] == ["dp2xtp2", "tp4"] and [s.world_size for s in shapes] == [4, 4]
    with pytest.raises(MeshShapeError, match=r"mesh \{'dp': 2, 'tp': 3\} \(2 x 3 = 6 ranks\) does "
                                             r"not match the world size"):
        parse_marker_meshes({"dp": 2, "tp": 3}, [4], "t")
    with pytest.raises(MeshShapeError, match="no mesh has 2 ranks"):
        parse_marker_meshes({"tp": 4}, [2, 4], "t")
    for bad in ({}, {"tp": 0}, {"tp": True}, [{"tp": 2}, {"tp": 2}], "tp=2"):
        with pytest.raises(MeshShapeError):
            parse_marker_meshes(bad, None, "t")
    assert MeshShape.default(4) == MeshShape(("tp",), (4,))


def test_a_torch_without_the_mesh_apis_gets_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Old-torch behaviour, simulated in-process: from_group refusing a list of groups,
    distribute_tensor without src_data_rank. A 1 x 1 mesh over world size 1 uses the default group
    on both dims (no process group needed)."""
    from types import SimpleNamespace

    import torch.distributed.tensor as dtensor_module
    from torch.distributed.device_mesh import DeviceMesh

    from pytest_tplogp.mesh import MeshShape, MeshSupportError, build_mesh, distribute_randn

    def from_group_without_lists(group, device_type, mesh=None, *, mesh_dim_names=None):
        if isinstance(group, list):
            raise TypeError("expected a ProcessGroup")
        raise AssertionError("the 2-D mesh must be assembled from a list of groups")

    monkeypatch.setattr(DeviceMesh, "from_group", staticmethod(from_group_without_lists))
    tp = SimpleNamespace(world_size=1, rank=0, device=torch.device("cpu"))
    with pytest.raises(MeshSupportError,
                       match=r"from_group could not assemble mesh \{'dp': 1, 'tp': 1\} .* "
                                               r"\(torch .*\): TypeError: expected a "
                                               r"ProcessGroup\. The mesh fixture needs from_group "
                                               r"to take a list of groups"):
        build_mesh(tp, MeshShape(("dp", "tp"), (1, 1)))

    def distribute_tensor_without_src_data_rank(tensor, device_mesh=None, placements=None):
        raise AssertionError("not called")

    monkeypatch.setattr(dtensor_module, "distribute_tensor",
                        distribute_tensor_without_src_data_rank)
    with pytest.raises(MeshSupportError,
                       match=r"needs .*distribute_tensor\(\.\.\., src_data_rank=None\).* "
                                               r"has no src_data_rank"):
        distribute_randn((2,), None, [], seed=0)


# Shape (5, 3): 5 rows split unevenly as torch.chunk does (3 + 2 over tp=2; 2 + 2 + 1 + 0 over 4
# ranks).
@pytest.mark.tp(world_size=4, mesh={"dp": 2, "tp": 2}, backend="gloo")
def test_distribute_randn_is_one_global_tensor_with_its_placements(tp, mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    state = torch.get_rng_state()
    truth = torch.randn(5, 3, generator=torch.Generator().manual_seed(7))
    col = mesh.get_local_rank("tp")
    cases = {  # placements -> this rank's local rows/cols of the global tensor
        (Replicate(), Shard(0)): truth[[slice(0, 3), slice(3, 5)][col]],
        (Replicate(), Replicate()): truth,
        (Shard(1), Replicate()): truth[:, [slice(0, 2), slice(2, 3)][mesh.get_local_rank("dp")]],
    }
    for placements, local in cases.items():
        x = tp.distribute_randn((5, 3), mesh, placements, seed=7)
        assert isinstance(x, DTensor) and tuple(x.placements) == placements
        assert torch.equal(x.to_local(), local), placements
        assert torch.equal(x.full_tensor(), truth)
    assert torch.equal(torch.get_rng_state(), state)  # the test's random stream is untouched
    flat = tp.distribute_randn((5,), tp.device_mesh(), [Shard(0)], seed=7, requires_grad=True)
    assert flat.requires_grad and flat.to_local().shape[0] == [2, 2, 1, 0][tp.rank]


@pytest.mark.tp(world_size=4, mesh={"dp": 2, "tp": 2}, backend="gloo")
def test_assert_close_with_dtensors_names_the_differing_shards(tp, mesh):
    from torch.distributed.tensor import Replicate, Shard

    x = tp.distribute_randn((6, 4), mesh, [Replicate(), Shard(0)], seed=3)
    truth = x.full_tensor()
    tp.assert_close(x, truth)  # DTensor left
    tp.assert_close(truth, x)  # DTensor right
    # both, other placements
    tp.assert_close(x, tp.distribute_randn((6, 4), mesh, [Shard(1), Replicate()], seed=3))
    wrong = truth.clone()
    wrong[4, 1] += 1.0  # row 4: the shard of tp=1 (rows 3-5), held by ranks 1 and 3
    with pytest.raises(CollectiveAssertionError) as info:
        tp.assert_close(x, wrong)
    message = str(info.value)
    assert message.startswith("collective assert_close failed (DTensor, full tensors compared): "
                              "local shards differ at (dp=0, tp=1) on rank 1; (dp=1, tp=1) on rank "
                              "3\n"), message
    assert "Mismatched elements: 1 / 12" in message and "full tensors: " in message
    with pytest.raises(CollectiveAssertionError, match="local shards differ at .* on rank 1"):
        tp.assert_close(wrong, x)  # the same with the DTensor on the right


@pytest.mark.tp(world_size=4, mesh={"dp": 2, "tp": 2}, backend="gloo")
@pytest.mark.parametrize("op_source", ["native"], indirect=True)
def test_vocab_shards_and_reference_over_the_tp_dim(tp, mesh, vocab_shards, reference, op_source):
    from torch.distributed.tensor import Replicate, Shard

    from tplogp.tolerances import RUNBOOK_TOLERANCES

    sub = mesh["tp"]
    assert (vocab_shards.world_size, vocab_shards.rank) == (2, sub.get_local_rank())
    assert _ranks(vocab_shards.group) == _ranks(sub.get_group())
    h, t = torch.randn(6, 8), torch.randint(0, vocab_shards.vocab_size, (6,))
    w = torch.randn(vocab_shards.vocab_size, 8)
    logp = op_source(h, vocab_shards.shard(w), t, tp_group=vocab_shards.group,
                     vocab_start_index=vocab_shards.start,
                     global_vocab_size=vocab_shards.vocab_size)
    tol = RUNBOOK_TOLERANCES[torch.float32]._asdict()
    tp.assert_close(logp, reference.fp32(h, w, t), **tol)
    # A DTensor weight: the reference uses its full tensor, the weight distribute_randn documents
    # (drawn here anew)
    w_dt = tp.distribute_randn((vocab_shards.vocab_size, 8), mesh, [Replicate(), Shard(0)], seed=5)
    w_full = torch.randn(vocab_shards.vocab_size, 8, generator=torch.Generator().manual_seed(5))
    from_dtensor = reference.fp32(h, w_dt, t)
    tp.assert_close(from_dtensor, reference.fp32(h, w_full, t), rtol=0, atol=0)
    logp_full = op_source(h, vocab_shards.shard(w_full), t, tp_group=vocab_shards.group,
                          vocab_start_index=vocab_shards.start,
                          global_vocab_size=vocab_shards.vocab_size)
    tp.assert_close(logp_full, from_dtensor, **tol)


def _coordinate(tp, mesh):
    return list(mesh.get_coordinate())


@pytest.mark.tp(mesh={"dp": 2, "tp": 2}, backend="gloo")
def test_tp_pool_passes_the_shape_and_the_ranks_get_the_mesh(tp_pool, mesh):
    from pytest_tplogp.mesh import MeshShape

    assert mesh == MeshShape(("dp", "tp"), (2, 2))  # in the parent: the shape
    assert tp_pool.run(_coordinate, mesh) == [[0, 0], [0, 1], [1, 0], [1, 1]]


@pytest.mark.gpu
@pytest.mark.tp(mesh={"dp": 1, "tp": 2}, backend="nccl")
def test_nccl_mesh_lives_on_the_pools_gpus(tp, mesh):
    from torch.distributed.tensor import Replicate, Shard

    assert mesh.device_type == "cuda" and tp.backend == "nccl"
    ones = torch.ones(1, device=tp.device)
    dist.all_reduce(ones, group=mesh["tp"].get_group())
    assert ones.item() == 2
    x = tp.distribute_randn((5, 3), mesh, [Replicate(), Shard(0)], seed=1)
    assert x.to_local().device == tp.device and x.to_local().shape[0] == [3, 2][tp.rank]
    truth = torch.randn(5, 3, generator=torch.Generator().manual_seed(1)).to(tp.device)
    tp.assert_close(x, truth)
    with pytest.raises(CollectiveAssertionError,
                       match=r"local shards differ at \(dp=0, tp=1\) on rank 1"):
        tp.assert_close(x, truth + torch.arange(5, device=tp.device)[:, None].ge(3))
