"""The ``sm90`` source: the Triton kernels specialised for Hopper (compute capability 9.0).

Same algorithm and programs as :mod:`tplogp.backends.triton_backend`; operand tiles are loaded
through tensor descriptors (TMA bulk copies) with the Hopper entry of the config table (see
:mod:`tplogp.kernels.hopper_kernels`). Small calls (:func:`uses_tma`) run the pointer kernels with
the same tiles instead: there a launch's host work, which the three tensor descriptors lengthen, is
the critical path, not the GEMM. No build step: the kernels are JIT-compiled by Triton on first use.
Reports itself unavailable, with the reason, on anything but a compute-capability-9.0 CUDA device
(the generic ``triton`` source covers the rest, and the CPU interpreter).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels import tiles
from .triton_backend import TritonBackend, _default_device, triton_unavailable_reason

REQUIRED_CAPABILITY = (9, 0)

# Calls whose forward GEMM is at most this many multiply-accumulates (N * D * V_local) launch the
# pointer kernels. There the GPU work is shorter than the host's, and a TMA launch's host work
# (tensor descriptors built and encoded per launch) delays every later kernel; above it the TMA
# loads' speed wins (docs/kernels.md, "TMA or pointer loads by size").
TMA_MIN_MACS = 1 << 36


def uses_tma(n: int, d: int, v: int, deterministic: bool, min_macs: int = TMA_MIN_MACS,
             tensor_cores: bool = True) -> bool:
    """Whether an ``[n, d] x [v, d]`` call launches the TMA kernels (else the pointer kernels, same
    tiles): above ``min_macs``. Deterministic calls always do: a row's bits must not depend on the
    batch it came in, and the two kernels are not promised to round alike.

    Calls whose dots run on the CUDA cores (fp32 at ``"highest"`` matmul precision:
    :func:`tplogp.kernels.tiles.uses_tensor_cores`) never do, at any size: TMA feeds wgmma and buys
    an FMA loop nothing, and ptxas (Triton 3.6) compiles the 128x128x32 FMA loop of the TMA kernels
    to 32 registers and a 5.9 KB stack per thread, so a process that launches it once keeps
    ~1.4 GiB of local memory reserved on an H100 (the pointer kernel: 255 registers, 72 bytes).
    Triton's CPU interpreter compiles nothing: there the backend passes ``tensor_cores=True``."""
    return tensor_cores and (deterministic or n * d * v > min_macs)


class SM90Backend(TritonBackend):
    """Per-shard primitives with Hopper TMA kernels (see module docstring)."""

    name = "sm90"

    def __init__(self, config=None, tma_min_macs: int = TMA_MIN_MACS):
        # config: as TritonBackend's; tma_min_macs: the size above which calls launch the TMA
        # kernels (uses_tma)
        super().__init__(config)
        self.tma_min_macs = tma_min_macs

    def unavailable_reason(self, device: Optional[torch.device] = None) -> Optional[str]:
        reason = triton_unavailable_reason()
        if reason is not None:
            return reason
        device = torch.device(device) if device is not None else _default_device()
        if device.type != "cuda":
            return (f"the sm90 source needs a CUDA device of compute capability 9.0 (Hopper); found a "
                    f"{device.type} device (the triton source runs elsewhere, including Triton's CPU interpreter)")
        if not torch.cuda.is_available():
            return "the sm90 source needs a CUDA device of compute capability 9.0; torch.cuda.is_available() is False"
        cap = torch.cuda.get_device_capability(device)
        if cap != REQUIRED_CAPABILITY:
            return (f"the sm90 source needs compute capability 9.0 (Hopper); {torch.cuda.get_device_name(device)} "
                    f"has {cap[0]}.{cap[1]}")
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
        except Exception as exc:
            return f"this Triton has no host tensor descriptors (triton.tools.tensor_descriptor): {exc}"
        return None

    def _select(self, device: torch.device, dtype: torch.dtype):
        return tiles.select_sm90(device, dtype, self._config)

    def _uses_tma(self, hidden, weight, call) -> bool:
        """Whether a call launches the Hopper TMA kernels (:func:`uses_tma`)."""
        return uses_tma(hidden.shape[0], hidden.shape[1], weight.shape[0], call.deterministic,
                        self.tma_min_macs, tiles.interpreting() or tiles.uses_tensor_cores(
                            hidden.element_size(), tiles.dot_precision(hidden.dtype)))
