"""Project-level pytest setup.

The project's own suite uses the pytest_tplogp plugin, which is opt-in: it is asked for here, with its LM-head
fixtures and options (``pytest_tplogp.lmhead``: vocab_shards, reference, op_source, dtype, bias; --tp-dtype, ...).

Without a CUDA device, Triton kernels run through Triton's interpreter: ``TRITON_INTERPRET=1`` must be set before
any kernel is defined, so it is set here, before test modules import tplogp's Triton sources. Set
``TRITON_INTERPRET=0`` explicitly to keep the Triton sources reported as unavailable on CPU.
"""

import os
import sys

import torch

pytest_plugins = ["pytest_tplogp", "pytest_tplogp.lmhead"]

# The suite starts hundreds of Python processes (rank pools, torchrun launches of the runbook and the benchmarks, the
# plugin tests' pytest sessions), most of them importing tplogp. Where PYTHONDONTWRITEBYTECODE is set (container images
# often set it) each would compile the sources again and each xdist worker would rewrite every test module's asserts:
# the suite writes its bytecode caches (git-ignored __pycache__ folders) for itself and the processes it starts.
if sys.dont_write_bytecode:
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tests.support  # noqa: E402,F401  (under the interpreter: its launches patch triton.language once)

# xdist workers share the cores: cores // workers torch threads each (torch's default, one per core, would have the
# workers' OpenMP threads contend with each other and with the TP ranks, which the plugin already sizes the same way)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
