"""The CPU interpreter tests' shared pieces: their skip condition and the kernel sets they run.

``interpreter_only`` skips a test unless Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, which the
project's conftest sets without CUDA) on a machine without CUDA; the GPU versions of these tests live in tests/gpu.
``KERNELS`` maps a name to a factory of a backend whose kernels run here: the triton source, and the sm90 kernels
(tensor-descriptor loads) through their launchers, bypassing the sm90 source's Hopper check.
"""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run in the interpreter here, on a machine without CUDA
INTERPRETING = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
interpreter_only = pytest.mark.skipif(
    not INTERPRETING,
    reason="CPU interpreter tests (need TRITON_INTERPRET=1 and no CUDA; the GPU versions live in tests/gpu)")


def _triton():
    from tplogp.backends.triton_backend import TritonBackend

    return TritonBackend()


def _sm90_on_cpu():
    """An SM90Backend whose TMA kernels run in the interpreter (bypassing its capability check; every size takes
    the TMA kernels)."""
    from tplogp.backends.sm90_backend import SM90Backend
    from tplogp.kernels import tiles

    be = SM90Backend(tma_min_macs=0)
    be._cfg = lambda device, dtype: tiles.INTERPRETER
    return be


KERNELS = {"triton": _triton, "sm90-kernels": _sm90_on_cpu}
