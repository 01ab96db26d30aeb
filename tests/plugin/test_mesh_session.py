"""The mesh fixture in a session (pytester): parametrization ids, the collection error, vocab_shards
over a mesh without its dim. (The cache per pool and shape, and the fresh-state check of mesh
groups and an entered mesh: test_fixtures_and_state.py.)"""

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
