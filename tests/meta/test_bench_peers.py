"""The suite's verl peer (``benchmarks.impls.load_verl_kernel``): verl's kernel modules load from the installed
files without running the verl package's ``__init__`` (which imports its whole framework), with a stub for
``verl.utils.device`` present only while they load. Its Triton kernels assert CUDA tensors, so on CPU the test
stops at the import; ``python -m benchmarks op --impls verl`` runs them on a GPU.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from benchmarks import impls


def _forget_loaded():
    for name in [n for n in sys.modules if n.startswith("_benchmarks_verl_kernel")]:
        del sys.modules[name]


@pytest.fixture
def fresh():
    _forget_loaded()
    yield
    _forget_loaded()


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed (pip install "
                                                                      "verl==0.9.1 --no-deps)")
def test_loads_the_kernel_modules_without_the_verl_package(fresh):
    before = {n for n in sys.modules if n == "verl" or n.startswith("verl.")}
    module = impls.load_verl_kernel()
    assert callable(module.linear_cross_entropy)
    kernels = sys.modules["_benchmarks_verl_kernel.kernels"]
    assert callable(kernels.efficient_entropy_forward) and callable(kernels.efficient_entropy_backward)
    assert kernels.HAVE_TRITON  # it found Triton (the stub is not a MagicMock fallback)
    assert kernels.is_cuda_available == torch.cuda.is_available()
    assert kernels.get_torch_device() is torch.cuda
    # neither verl's __init__ nor the stub stays behind
    assert {n for n in sys.modules if n == "verl" or n.startswith("verl.")} == before
    assert impls.load_verl_kernel() is module  # loaded once per process
    if not torch.cuda.is_available():
        with pytest.raises(impls.ImplUnavailable, match="CUDA"):
            impls.BY_NAME["verl"].build(torch.device("cpu"), None)


def test_missing_verl_is_an_unavailable_row_naming_the_install(fresh, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(impls.ImplUnavailable, match="verl==0.9.1 --no-deps"):
        impls.load_verl_kernel()
    assert not any(n.startswith("_benchmarks_verl_kernel") for n in sys.modules)
    assert "verl.utils.device" not in sys.modules


def test_broken_kernel_file_is_an_unavailable_row(fresh, monkeypatch, tmp_path):
    (tmp_path / "verl" / "utils" / "kernel").mkdir(parents=True)
    (tmp_path / "verl" / "utils" / "kernel" / "kernels.py").write_text("from verl.utils.device import missing\n")
    spec = importlib.machinery.ModuleSpec("verl", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path / "verl")]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec)
    with pytest.raises(impls.ImplUnavailable, match="ImportError"):
        impls.load_verl_kernel()
    assert not any(n.startswith("_benchmarks_verl_kernel") for n in sys.modules)
    assert "verl.utils.device" not in sys.modules
