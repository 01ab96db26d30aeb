"""Project-level pytest setup.

The project's own suite uses the pytest_tplogp plugin, which is opt-in: it is asked for here, with its LM-head
fixtures and options (``pytest_tplogp.lmhead``: vocab_shards, reference, op_source, dtype, bias; --tp-dtype, ...).

Without a CUDA device, Triton kernels run through Triton's interpreter: ``TRITON_INTERPRET=1`` must be set before
any kernel is defined, so it is set here, before test modules import tplogp's Triton sources. Set
``TRITON_INTERPRET=0`` explicitly to keep the Triton sources reported as unavailable on CPU.
"""

import os

import torch

pytest_plugins = ["pytest_tplogp", "pytest_tplogp.lmhead"]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
