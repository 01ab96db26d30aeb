"""tests.support.interpreter_patching: under Triton's interpreter the suite's kernels give the same
bits with the language patched once per launch as with Triton's own patching per helper call, and
the walk runs once per launch.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import interpreter_patching
from tests.support.interpreter import KERNELS, interpreter_only
from tests.support.problems import make_problem, run_op

pytestmark = interpreter_only
pytest.importorskip("triton")

from triton.runtime import interpreter  # noqa: E402

from tplogp.api import linear_logp_on  # noqa: E402
from tplogp.op.plan import LogpOptions  # noqa: E402


def _softcapped_entropy_call(p):
    backend = KERNELS["triton"]()

    def op(h, w, y, b=None, **kw):
        return linear_logp_on(backend, h, w, y, b,
                              options=LogpOptions(softcap=3.0, temperature=0.7, **kw))
    return run_op(op, p, entropy=True, lse=True)


def test_installed_under_the_interpreter():
    assert interpreter_patching.installed()
    assert interpreter.GridExecutor.__call__ is not interpreter_patching._ORIGINALS["launch"]


def test_same_bits_as_tritons_own_patching():
    p = make_problem((3, 7), 24, 150, torch.bfloat16, bias=True, seed=3)
    once = _softcapped_entropy_call(p)
    with interpreter_patching.uninstalled():
        assert interpreter._patch_lang is interpreter_patching._ORIGINALS["_patch_lang"]
        own = _softcapped_entropy_call(p)
    for name in ("logp", "entropy", "lse", "d_hidden", "d_weight", "d_bias"):
        assert torch.equal(getattr(once, name), getattr(own, name)), name


def test_one_language_walk_per_launch(monkeypatch):
    """Triton's own patching walks the language at every helper call too; the suite's once per
    launch and module."""
    walks, launches = [], []
    original_walk = interpreter_patching._ORIGINALS["_patch_lang"]
    wrapped_launch = interpreter.GridExecutor.__call__

    def walk(fn):
        walks.append(fn.__name__)
        return original_walk(fn)

    def launch(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return wrapped_launch(self, *args, **kwargs)

    monkeypatch.setitem(interpreter_patching._ORIGINALS, "_patch_lang", walk)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", launch)
    p = make_problem((9,), 16, 70, torch.float32, bias=False, seed=1)
    _softcapped_entropy_call(p)
    # at most one walk per language module (triton.language, triton.language.core) a launch's code
    # sees
    assert launches and len(walks) <= 2 * len(launches), (walks, launches)
    once = len(walks)
    walks.clear()
    with interpreter_patching.uninstalled():
        _softcapped_entropy_call(p)
    assert len(walks) > 10 * once, (len(walks), once)
