"""DirectKernel: which calls reuse a compiled binary and what it is launched with (a fake JIT function and binary,
so this runs on CPU; tests/gpu exercise the real launches on every GPU test)."""

from __future__ import annotations

import pytest
import torch

from tplogp.kernels import fastlaunch
from tplogp.kernels.fastlaunch import DirectKernel


def _kernel(p_x, n, scale, FLAG: "constexpr", BLOCK: "constexpr" = 64):  # noqa: F821 - signature only
    pass


class _FakeBinary:
    function = "fn-handle"
    packed_metadata = "packed"

    def __init__(self):
        self.runs = []

    def launch_metadata(self, grid, stream, *args):
        return ("md", grid)

    def run(self, *args):
        self.runs.append(args)


class _FakeJit:
    """Quacks like triton.JITFunction: ``.fn``, ``.constexprs`` (param indices), ``[grid](...)`` returns a binary."""

    def __init__(self):
        self.fn = _kernel
        self.__name__ = "_kernel"
        self.constexprs = [3, 4]
        self.jit_calls = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return _FakeBinary()
        return call


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setattr(fastlaunch, "direct_launch_enabled", lambda: True)
    monkeypatch.setattr(fastlaunch, "_current_device", lambda: 0)
    monkeypatch.setattr(fastlaunch, "_current_stream", lambda device: 1234)
    monkeypatch.setattr(fastlaunch, "_launch_hooks", lambda: (None, None))


def test_second_call_reuses_binary_with_all_params_in_order(direct):
    jit = _FakeJit()
    k = DirectKernel(jit)
    x = torch.zeros(64)
    k[(3,)](x, 4096, 0.5, FLAG=True, num_warps=4)
    assert len(jit.jit_calls) == 1
    binary = k._binaries[next(iter(k._binaries))]
    k[(5, 2)](x, 4096 + 16, 0.25, FLAG=True, num_warps=4)  # same residues mod 16: same binary
    assert len(jit.jit_calls) == 1
    (run,) = binary.runs
    assert run[:7] == (5, 2, 1, 1234, "fn-handle", "packed", None)
    assert run[9:] == (x, 4096 + 16, 0.25, True, 64)  # constexprs included, the default filled in


@pytest.mark.parametrize("change", ["int_residue", "int_one", "int_64bit", "constexpr", "option", "dtype", "align"])
def test_specialization_changes_go_through_the_jit(direct, change):
    jit = _FakeJit()
    k = DirectKernel(jit)
    base = torch.zeros(64)
    args, kw = [base, 4096, 0.5], dict(FLAG=True, num_warps=4)
    k[(1,)](*args, **kw)
    if change == "int_residue":
        args[1] = 4100
    elif change == "int_one":
        args[1] = 1
    elif change == "int_64bit":
        args[1] = 4096 << 32
    elif change == "constexpr":
        kw["FLAG"] = False
    elif change == "option":
        kw["num_warps"] = 8
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float64)
    elif change == "align":
        args[0] = base[1:]  # 4 bytes past a 16-byte aligned base
    k[(1,)](*args, **kw)
    assert len(jit.jit_calls) == 2
    assert len(k._binaries) == 2


def test_disabled_always_uses_the_jit(monkeypatch):
    monkeypatch.setenv("TPLOGP_DIRECT_LAUNCH", "0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fastlaunch.direct_launch_enabled()
    jit = _FakeJit()
    k = DirectKernel(jit)
    for _ in range(3):
        k[(1,)](torch.zeros(4), 16, 1.0, FLAG=True)
    assert len(jit.jit_calls) == 3 and not k._binaries


def test_interpreter_disables_direct_launch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("TPLOGP_DIRECT_LAUNCH", raising=False)
    assert not fastlaunch.direct_launch_enabled()
