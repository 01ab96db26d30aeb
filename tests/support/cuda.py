"""The CUDA tests' shared helper."""

from __future__ import annotations

import pytest
import torch


def cuda_backend(source: str):
    """The backend of ``source`` for the current CUDA device; skips the calling test where it cannot run there."""
    from tplogp.backends.kernel_registry import get_backend, unavailable_reason

    why = unavailable_reason(source, torch.device("cuda"))
    if why is not None:
        pytest.skip(why)
    return get_backend(source)
