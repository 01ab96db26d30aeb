"""GPU tests share one device among xdist workers and their pools' ranks (``-n 4``): each worker gives
its allocator's cached free blocks back after every test, as the ranks do after theirs
(:mod:`pytest_tplogp.cuda_memory`), so that no process keeps the memory of its largest test."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _release_cached_cuda_memory():
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
