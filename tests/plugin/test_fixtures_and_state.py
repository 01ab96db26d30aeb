"""Standard fixtures in a TP test, the pool's fresh-state check (the mesh fixture's cache across a
session included), seeding and rank-dependent draws, the fork server's warm imports, one-line and
JUnit reports, temp-dir hygiene.

One pytester run (pools of world size 2 and 4) covers the fixtures, the meshes and the state check;
the report checks reuse its output.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

pytest_plugins = ["pytester"]

BODY = '''
import os
import random
import numpy as np
import pytest
import torch

@pytest.mark.tp
def test_a_monkeypatch(tp, monkeypatch):
    import sys
    # the pool's first test: the fork server imported what torch.testing.assert_close first imports
    assert "torch.distributed.tensor" in sys.modules
    monkeypatch.setenv("MY_FLAG", "on")
    monkeypatch.setattr(os, "sep", "!")
    assert os.environ["MY_FLAG"] == "on"

@pytest.mark.tp
def test_b_monkeypatch_was_undone(tp):
    assert "MY_FLAG" not in os.environ and os.sep == "/"

@pytest.mark.tp
def test_c_leaks_by_hand(tp):
    os.environ["RAW_FLAG"] = "1"
    os.chdir("/")
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(3)                 # the pool runs with --tp-threads=1
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(123)

@pytest.mark.tp
def test_d_leaks_were_restored(tp):
    assert "RAW_FLAG" not in os.environ and os.getcwd() != "/"
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    assert torch.get_num_threads() == 1 and not torch.are_deterministic_algorithms_enabled()
    assert torch.initial_seed() != 123       # every test is seeded from its node id
    seed = torch.initial_seed()              # random and numpy too, with the same seed
    assert random.random() == random.Random(seed).random()
    assert np.random.rand() == np.random.RandomState(seed).rand()

@pytest.mark.tp
def test_d_rank_dependent_draws(tp):
    torch.randn(2 + tp.rank, generator=torch.Generator().manual_seed(tp.rank))  # own generator...
    shared = tp.all_gather_object(torch.randn(4))
    assert all(torch.equal(shared[0], x) for x in shared)  # ...leaves the shared stream alone
    torch.randn(2 + 100 * tp.rank)  # a draw of a rank-dependent size from the shared stream...
    later = tp.all_gather_object(torch.randn(4))
    assert not torch.equal(later[0], later[1])     # ...makes the later draws differ between ranks

@pytest.mark.tp
def test_e_capsys(tp, capsys):
    pass

@pytest.mark.tp
def test_f_tmp_path_is_shared(tp, tmp_path):
    (tmp_path / f"rank{tp.rank}").write_text("x")
    tp.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}" for r in range(tp.world_size)]

@pytest.mark.tp
@pytest.mark.parametrize("k", [1])
def test_g_fails_below_the_decorators(tp, k):
    print(f"about to fail on rank {tp.rank}")
    value = 10 + tp.rank * k
    assert value == 10
'''

CALL_RECORDER = '''
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    from pytest_tplogp.session import STATE

    manager = item.config.stash[STATE]._manager
    alive = manager is not None and any(pool.alive() for pool in manager.pools.values())
    with open("calls.txt", "a") as f:
        f.write(f"{item.name} pool alive: {alive}\\n")
'''


# The mesh fixture across a session: the cache per pool and shape, and the fresh-state check (mesh
# groups are the pool's; a test's own groups and an entered mesh are not). World size 4: a pool of
# its own, after the tests above.
MESH_SESSION = '''
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
def test_fixtures_state_and_reports(pytester: pytest.Pytester, tag: str) -> None:
    """test_body.py: standard fixtures, the fresh-state check, seeding, the pool started at the
    first TP test's setup, one-line and JUnit reports, no session directory left in TMPDIR.
    test_mesh.py: a mesh is cached per pool and shape, its groups (a flattened dim's too) never
    count as leaked; a test's own groups recycle the pool, and a mesh left entered is restored."""
    pytester.makepyfile(test_body=BODY, test_mesh=MESH_SESSION)
    pytester.makeconftest(CALL_RECORDER)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "--tp-threads=1", "-rA", "-W",
                                           "always", "--tb=line",
                                           "--junitxml=junit.xml", "-o", "junit_logging=all")
    result.assert_outcomes(passed=11, failed=1, errors=1)
    out = result.stdout.str()
    # monkeypatch works per rank and is undone; changes made by hand are restored and named in a
    # warning
    result.stdout.fnmatch_lines(["*test_c_leaks_by_hand*",
                                 "*PytestWarning: tplogp: the test changed process state "
                                 "on the ranks, restored before the next test: default dtype set "
                                 "to torch.float64; deterministic algorithms switched on; "
                                 "environment variable(s) RAW_FLAG set; grad mode left off; torch "
                                 "threads set to 3; working directory changed to /*"])
    warnings = out.split("warnings summary")[-1].split("-- Docs")[0]
    assert "test_c_leaks_by_hand" in warnings and "test_a_monkeypatch" not in warnings
    # the mesh's groups and the cached mesh are never named as leaked
    assert ("test_a_mesh" not in warnings and "test_b_same_shape" not in warnings
            and "test_e_no_mesh" not in warnings), warnings
    result.stdout.fnmatch_lines(["*test_c_no_mesh_asked_builds_its_own*",
                                 "*pool recycled after this test: fresh-state check failed: 2 "
                                 "process group(s) left behind (use tp.new_group or the mesh "
                                 "fixture, which the pool caches)*"])
    result.stdout.fnmatch_lines(["*test_d_enters_the_mesh_and_leaves_it_entered*",
                                 "*restored before the next test: 1 device mesh(es) left entered "
                                 "(with mesh:)*"])
    # capsys: refused at setup with one message naming it, no pickling error about another fixture
    result.stdout.fnmatch_lines(["*ERROR at setup of test_e_capsys[[]tp2[]]*",
                                 "test_body.py::test_e_capsys[[]tp2[]]: a TP test body cannot take "
                                 "the 'capsys' fixture: capsys captures the output of the pytest "
                                 "process, but the body runs on the ranks.*"])
    assert "pickle" not in out.lower()
    # --tb=line: one proper line that points at the failing line, not at the decorator nor a
    # Crash(...) object
    # the -rA summary line ends the same way where the terminal is wide
    lines = [line for line in result.outlines
             if line.endswith("rank 1: AssertionError: assert 11 == 10")
             and not line.startswith("FAILED ")]
    assert len(lines) == 1 and lines[0].startswith(str(pytester.path / "test_body.py") + ":"), out
    lineno = int(lines[0].rsplit(".py:", 1)[1].split(":", 1)[0])
    assert ((pytester.path / "test_body.py").read_text().splitlines()[lineno - 1].strip()
            == "assert value == 10")
    assert "Crash(" not in out
    # the pool starts during the first TP test's setup, not its call (so --durations charges it to
    # the setup)
    first_call = (pytester.path / "calls.txt").read_text().splitlines()[0]
    assert first_call == "test_a_monkeypatch[tp2] pool alive: True"
    # JUnit: the failure and each rank's output, labelled per rank
    root = ET.parse(pytester.path / "junit.xml").getroot()
    case = next(c for c in root.iter("testcase")
                if c.get("name") == "test_g_fails_below_the_decorators[tp2-1]")
    assert case.find("failure").get("message") == "rank 1: AssertionError: assert 11 == 10"
    system_out = case.find("system-out").text
    assert ("[rank 0] about to fail on rank 0" in system_out
            and "[rank 1] about to fail on rank 1" in system_out)
    # hygiene: nothing of the session is left in the system temp dir (TMPDIR, see the tag fixture)
    import os

    assert [p for p in os.listdir(os.environ["TMPDIR"]) if p.startswith("tplogp-")] == []


def test_stale_session_dirs_are_removed(tmp_path) -> None:
    """The directory of a session that was killed is removed by the next session; live ones are
    kept."""
    import os
    import subprocess
    import sys

    from pytest_tplogp.pools import remove_stale_session_dirs

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)
    dead = tmp_path / f"tplogp-main-{int(gone.stdout)}-abc"
    live = tmp_path / f"tplogp-gw0-{os.getpid()}-def"
    other = tmp_path / "tplogp-main-xyz"
    for d in (dead, live, other):
        (d / "ws2-gloo-cpu-g1").mkdir(parents=True)
    assert remove_stale_session_dirs(str(tmp_path)) == [str(dead)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])



def test_project_silences_only_the_interpreters_masked_lane_warnings(
    pytester: pytest.Pytester) -> None:
    """The project's filterwarnings drop numpy's log(0) and 0/0 warnings from Triton's interpreter
    (masked lanes), and only those: the same messages from anywhere else still show."""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    filters = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
        "filterwarnings"]
    pytester.makeini("[pytest]\nfilterwarnings =\n" + "".join(f"    {f}\n" for f in filters))
    pytester.makepyfile(test_warn='''
import warnings

def test_warns():
    for module in ("triton.runtime.interpreter", "someone.else"):
        for message in ("divide by zero encountered in log", "invalid value encountered in divide"):
            warnings.warn_explicit(message, RuntimeWarning, "x.py", 1, module=module)
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, warnings=2)
