"""Count the host reads of tensor data (what forces a device sync on a GPU) made by a piece of code."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

import torch

import tplogp
from torch.utils._python_dispatch import TorchDispatchMode

# tplogp's own source directory (with a separator at its end): a frame is tplogp's when its file
# lies below it. A substring test of the path would also match torch's frames when the environment
# lives below a folder named tplogp
_TPLOGP_DIR = os.path.join(os.path.dirname(os.path.realpath(tplogp.__file__)), "")

# aten ops that hand tensor data to the host: ``.item()`` / ``bool(t)`` and data-dependent output shapes
_READ_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique")


def _where() -> str:
    """The innermost tplogp function on the stack (``?`` when the read came from elsewhere)."""
    frame = sys._getframe(2)
    while frame is not None:
        if is_tplogp_file(frame.f_code.co_filename):
            return frame.f_code.co_name
        frame = frame.f_back
    return "?"


def is_tplogp_file(filename: str) -> bool:
    """Whether ``filename`` (a code object's) is a module of the tplogp package (not of the plugin,
    torch or the tests, wherever the checkout and its environment live)."""
    return os.path.realpath(filename).startswith(_TPLOGP_DIR)


class _Reads(TorchDispatchMode):
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(_READ_OPS):
            self.log.append(f"{name} in {_where()}")
        elif name.startswith("aten._to_copy") and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu" \
                and (kwargs or {}).get("device", None) == torch.device("cpu") and not (kwargs or {}).get("non_blocking"):
            self.log.append(f"{name} (device to host) in {_where()}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_reads() -> Iterator[list]:
    """Yields a list that collects one entry per host read, ``"<op> in <tplogp function>"``: the ops above and
    ``Tensor.tolist`` (not an aten op)."""
    log: list = []
    original = torch.Tensor.tolist

    def tolist(self):
        log.append(f"Tensor.tolist in {_where()}")
        return original(self)

    torch.Tensor.tolist = tolist
    try:
        with _Reads(log):
            yield log
    finally:
        torch.Tensor.tolist = original
