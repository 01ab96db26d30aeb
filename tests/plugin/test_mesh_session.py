"""The mesh fixture across a session (pytester): parametrization ids, the collection error,
vocab_shards over a mesh without its dim, the cache per pool and shape, and the fresh-state check
(mesh groups are the pool's; a test's own groups and an entered mesh are not)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

IDS = '''
import pytest

@pytest.mark.tp(mesh=[{"dp": 2, "tp": 2}, {"tp": 4}, {"tp": 2}])
def test_listed(tp, mesh):
    pass

@pytest.mark.tp(world_size=4, mesh={"dp": 2, "cp": 2})
def test_one(tp, mesh):
    pass

@pytest.mark.tp(world_size=2)
def test_default(tp, mesh):
    pass
'''

BAD = '''
import pytest

@pytest.mark.tp(world_size=4, mesh={"dp": 2, "tp": 3})
def test_bad(tp, mesh):
    pass
'''

VOCAB = '''
import pytest

@pytest.mark.tp(mesh={"dp": 2, "cp": 2})
def test_vocab(tp, mesh, vocab_shards):
    pass
'''


def test_mesh_ids_and_the_collection_error(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_ids=IDS)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "--collect-only", "-q", "-m",
                                           "tp4 or tp2")
    result.stdout.fnmatch_lines(["test_ids.py::test_listed[[]tp4-dp2xtp2[]]",
                                 "test_ids.py::test_listed[[]tp4-tp4[]]",
                                 "test_ids.py::test_listed[[]tp2-tp2[]]",
                                 "test_ids.py::test_one[[]tp4-dp2xcp2[]]",
                                 "test_ids.py::test_default[[]tp2[]]", "5 tests collected*"])
    pytester.makepyfile(test_bad=BAD)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "--collect-only", "-q",
                                           "test_bad.py")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*ERROR collecting test_bad.py*",
                                 "test_bad.py::test_bad: @pytest.mark.tp(world_size=4, mesh=...): "
                                 "mesh {'dp': 2, 'tp': 3} (2 x 3 = 6 ranks) does not match the "
                                 "world size; the mesh sizes must multiply to it", "*1 error*"])
    assert "Traceback" not in result.stdout.str() and "pluggy" not in result.stdout.str()
    # vocab_shards over a mesh without its dim: an error at setup naming the dims
    pytester.makepyfile(test_vocab=VOCAB)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp.lmhead", "-q", "test_vocab.py",
                                           "--tp-shards=uneven")
    result.assert_outcomes(passed=0, errors=1)
    result.stdout.fnmatch_lines(["*test_vocab.py::test_vocab[[]uneven-tp4-dp2xcp2[]]: vocab_shards "
                                 "shards the vocabulary over mesh dim 'tp', which mesh {'dp': 2, "
                                 "'cp': 2} (2 x 2 = 4 ranks) does not have; name one of dp, cp by "
                                 "overriding the vocab_shards_mesh_dim fixture"])


SESSION = '''
import pytest
import torch.distributed as dist

SEEN = []

def _mesh_stack():
    from torch.distributed.device_mesh import _mesh_resources
    return list(_mesh_resources.mesh_stack)

@pytest.mark.tp(mesh={"dp": 2, "tp": 2})
def test_a_mesh_and_a_flattened_dim(tp, mesh):
    SEEN.append(mesh)
    flat = mesh["dp", "tp"]._flatten("dp_tp")      # new groups, kept with the cached mesh
    assert dist.get_process_group_ranks(flat.get_group()) == [0, 1, 2, 3]

@pytest.mark.tp(mesh={"dp": 2, "tp": 2})
def test_b_same_shape_same_mesh(tp, mesh):
    assert mesh is SEEN[0]

@pytest.mark.tp(world_size=4)
def test_c_no_mesh_asked_builds_its_own(tp):
    from torch.distributed.device_mesh import init_device_mesh
    assert _mesh_stack() == []
    init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))  # its groups: left behind

@pytest.mark.tp(mesh={"dp": 2, "tp": 2})
def test_d_enters_the_mesh_and_leaves_it_entered(tp, mesh):
    assert not SEEN or mesh is not SEEN[0]  # the pool was recycled after test_c: a fresh mesh
    mesh.__enter__()

@pytest.mark.tp(world_size=4)
def test_e_no_mesh_left_entered(tp):
    assert _mesh_stack() == []
'''


@pytest.mark.slow
def test_meshes_are_cached_and_never_counted_as_leaked(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_session=SESSION)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "--tp-threads=1", "-W", "always",
                                           "-rA")
    result.assert_outcomes(passed=5)
    warnings = result.stdout.str().split("warnings summary")[-1].split("-- Docs")[0]
    assert ("test_a_" not in warnings and "test_b_" not in warnings
            and "test_e_" not in warnings), warnings
    result.stdout.fnmatch_lines(["*test_c_no_mesh_asked_builds_its_own*",
                                 "*pool recycled after this test: fresh-state check failed: 2 "
                                 "process group(s) left behind (use tp.new_group or the mesh "
                                 "fixture, which the pool caches)*"])
    result.stdout.fnmatch_lines(["*test_d_enters_the_mesh_and_leaves_it_entered*",
                                 "*restored before the next test: 1 device mesh(es) left entered "
                                 "(with mesh:)*"])
