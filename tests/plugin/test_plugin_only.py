"""The generic plugin's footprint. Without the op's dependencies (``triton`` and ``tplogp``
unimportable in the fork server and the ranks, and ``triton`` in pytest, which never imports
``tplogp``) a TP test runs and passes; and pytest's own process never imports torch."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

# Imported at start-up by every Python process whose sys.path has this directory (PYTHONPATH).
BLOCKER = '''
import sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("triton", "tplogp"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Blocker())
'''

BODY = '''
import pytest
import torch
import torch.distributed as dist

def _importable(name):
    try:
        __import__(name)
    except ImportError:
        return False
    return True

@pytest.mark.tp(world_size=2)
def test_on_ranks(tp):
    assert not _importable("triton") and not _importable("tplogp")
    t = torch.ones(1) * (tp.rank + 1)
    dist.all_reduce(t)
    tp.assert_close(t, torch.tensor([3.0]))

def test_in_pytest_after_a_tp_test():
    # pytest's assertion rewriting imports the modules of an installed plugin's distribution
    # itself, past the blocker: here what counts is that nothing imported them
    import sys

    assert "triton" not in sys.modules and "tplogp" not in sys.modules
    assert not _importable("triton")
'''


@pytest.mark.slow
def test_generic_plugin_runs_without_triton_and_tplogp(pytester: pytest.Pytester, tag: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = pytester.mkdir("blocker")
    blocker.joinpath("sitecustomize.py").write_text(BLOCKER)
    monkeypatch.setenv("PYTHONPATH", f"{blocker}:{__import__('os').environ['PYTHONPATH']}")
    pytester.makepyfile(test_body=BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-rA")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["tplogp: world size 2, backend gloo*"])


TORCH_FREE_BODY = '''
import sys

import pytest

@pytest.mark.tp(world_size=2)
def test_on_ranks(tp):
    import torch
    import torch.distributed as dist

    t = torch.ones(1) * (tp.rank + 1)
    dist.all_reduce(t)
    tp.assert_close(t, torch.tensor([3.0]))

def test_pytest_never_imported_torch():
    assert "torch" not in sys.modules
'''


@pytest.mark.slow
def test_pytest_itself_never_imports_torch(pytester: pytest.Pytester, tag: str) -> None:
    """Only the fork server and the ranks import torch: a TP test run through a pool, from a test
    module that does not import torch, leaves pytest's own process without it (on a machine without
    GPUs, as CI is)."""
    pytester.makepyfile(test_body=TORCH_FREE_BODY)
    result = pytester.runpytest_subprocess("-p", "pytest_tplogp", "-p", "no:cacheprovider", "-rA",
                                           "--tp-backend=gloo")
    result.assert_outcomes(passed=2)
