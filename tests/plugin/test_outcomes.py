"""Per-rank outcomes: pass, one-rank failure, grouped failures, agreed and disagreed skips,
collective checks."""

from __future__ import annotations

import pytest
from tests.support.plugin_helpers import leftover_processes

pytest_plugins = ["pytester"]

BODY = '''
import os, sys
import pytest
import torch
import torch.distributed as dist

@pytest.mark.tp
def test_all_pass(tp):
    t = torch.ones(1) * (tp.rank + 1)
    dist.all_reduce(t)
    assert t.item() == 3.0
    assert tp.world_size == 2 and dist.get_rank() == tp.rank

@pytest.mark.tp
def test_one_rank_fails(tp):
    print(f"out-of-rank-{tp.rank}")
    print(f"err-of-rank-{tp.rank}", file=sys.stderr)
    value = 10 + tp.rank
    assert value == 10

@pytest.mark.tp
def test_all_fail_same(tp):
    raise ValueError("same everywhere")

@pytest.mark.tp
def test_skip_agreed(tp):
    pytest.skip("not on this build")

@pytest.mark.tp
def test_skip_disagreed(tp):
    if tp.rank == 0:
        pytest.skip("only rank 0 thinks so")

@pytest.mark.tp
def test_collective_skip(tp):
    tp.skip_if(tp.rank == 1, "rank 1 lacks the feature")
    raise AssertionError("not reached")

@pytest.mark.tp
def test_collective_assert(tp):
    tp.assert_all(tp.rank != 1, f"rank {tp.rank} saw a bad value")
    dist.barrier()  # reached by nobody: every rank raised above

@pytest.mark.tp
def test_assert_close(tp):
    x = torch.zeros(3)
    tp.assert_close(x + (0.5 if tp.rank == 0 else 0.0), torch.zeros(3))

@pytest.mark.tp
def test_agree_block(tp):
    with tp.agree():
        if tp.rank == 1:
            raise KeyError("only rank 1")
    dist.barrier()

@pytest.mark.tp
def test_seeded_identically(tp):
    x = torch.randn(4)
    xs = tp.all_gather_object(x)
    assert all(torch.equal(xs[0], y) for y in xs)

@pytest.mark.tp
@pytest.mark.xfail(reason="known")
def test_xfail(tp):
    assert False

@pytest.mark.tp
@pytest.mark.xfail(raises=ValueError, strict=True)
def test_xfail_raises_matches(tp):
    raise ValueError("expected on every rank")

@pytest.mark.tp
@pytest.mark.xfail(raises=KeyError)
def test_xfail_raises_mismatch(tp):
    raise ValueError("not the expected type")

class TestInClass:
    @pytest.mark.tp
    def test_method(self, tp, tmp_path):
        assert tmp_path.exists() and isinstance(self, TestInClass)

@pytest.fixture
def lock():
    import threading
    return threading.Lock()

@pytest.mark.tp
def test_unpicklable_fixture(tp, tmp_path, lock):
    pass
'''


@pytest.mark.slow
def test_rank_outcomes(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body=BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "--tp-timeout=60", "-rA", "-vv",
                                           "--junitxml=junit.xml", "-o", "junit_logging=all")
    result.assert_outcomes(passed=3, failed=8, skipped=2, xfailed=2)
    result.stdout.fnmatch_lines([
        "*FAILED test_body.py::test_one_rank_fails[[]tp2[]] - rank 1: AssertionError: assert 11 == "
        "10*",
        "*FAILED test_body.py::test_all_fail_same[[]tp2[]] - ranks 0-1: ValueError: same "
        "everywhere*",
        "*FAILED test_body.py::test_skip_disagreed[[]tp2[]] - skip not agreed: rank 0 skipped*",
        "*FAILED test_body.py::test_collective_assert[[]tp2[]] - ranks 0-1: "
        "pytest_tplogp.CollectiveAssertionError*",
        "*FAILED test_body.py::test_assert_close[[]tp2[]] - ranks 0-1: "
        "pytest_tplogp.CollectiveAssertionError*",
        "*FAILED test_body.py::test_agree_block[[]tp2[]] - rank 0: "
        "pytest_tplogp.CollectiveAssertionError*rank 1: KeyError*",
        "*FAILED test_body.py::test_xfail_raises_mismatch[[]tp2[]] - ranks 0-1: ValueError: not "
        "the expected type*",
        "*FAILED test_body.py::test_unpicklable_fixture[[]tp2[]] - *fixture 'lock' (a lock) cannot "
        "be sent to the ranks: TypeError: *pickle*",
    ], consecutive=False)
    result.stdout.fnmatch_lines(["*XFAIL test_body.py::test_xfail_raises_matches[[]tp2[]]*"],
                                consecutive=False)
    out = result.stdout.str()
    # the one-rank failure names its rank and shows the rank's traceback, names the rank that
    # passed, and shows the captured output per rank
    result.stdout.fnmatch_lines(["*rank 1 failed: AssertionError: assert 11 == 10*",
                                 "*assert value == 10*"])
    result.stdout.fnmatch_lines(["*rank 0 passed.*"])
    result.stdout.fnmatch_lines(["*Captured stdout rank 0 call*", "out-of-rank-0*",
                                 "*Captured stdout rank 1 call*", "out-of-rank-1*"])
    result.stdout.fnmatch_lines(["*Captured stderr rank 1 call*", "err-of-rank-1*"])
    # agreed skips carry the reason; a collective skip names the rank that asked for it
    assert "not on this build" in out
    assert "rank 1 lacks the feature (on rank 1)" in out
    assert "decide it collectively with tp.skip_if" in out
    assert "collective check failed on rank 1 of 2" in out
    # no rank survives the session
    assert leftover_processes(tag) == []
    # JUnit XML: every rank's failure in the failure text, each rank's output labelled with its rank
    case = _junit_case(pytester, "test_one_rank_fails[tp2]")
    failure = case.find("failure")
    assert failure is not None
    assert failure.get("message") == "rank 1: AssertionError: assert 11 == 10"
    assert ("rank 1 failed: AssertionError: assert 11 == 10" in failure.text
            and "assert value == 10" in failure.text)
    out, err = case.find("system-out").text, case.find("system-err").text
    assert "[rank 0] out-of-rank-0" in out and "[rank 1] out-of-rank-1" in out
    assert "[rank 1] err-of-rank-1" in err
    both = _junit_case(pytester, "test_all_fail_same[tp2]").find("failure")
    assert both.get("message") == "ranks 0-1: ValueError: same everywhere"


def _junit_case(pytester: pytest.Pytester, name: str):
    import xml.etree.ElementTree as ET

    root = ET.parse(pytester.path / "junit.xml").getroot()
    return next(c for c in root.iter("testcase") if c.get("name") == name)
