"""A rank process's state around a test (rank-side; imports nothing of the controller): seeded
before the body (:func:`seed_test`), put back and named after it (:class:`ProcessState`: the
environment, the working directory, torch's process settings), and the process groups alive, so a
group the body left behind is found (:func:`live_groups`, less those a library keeps for the
process: :func:`groups_kept_for_the_process`)."""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable
from typing import Any


def live_groups() -> set[int] | None:
    """Identities of the live process groups, or None when this torch does not expose them (check
    skipped)."""
    from torch.distributed import distributed_c10d as c10d

    pg_map = getattr(getattr(c10d, "_world", None), "pg_map", None)
    return None if pg_map is None else {id(pg) for pg in pg_map}


def groups_kept_for_the_process() -> set[int]:
    """Groups a library keeps on purpose for the whole process, not leaks: tplogp's CPU companion of
    each device-backend TP group (``tplogp.support.comm.host_group``), when tplogp is loaded."""
    comm = sys.modules.get("tplogp.support.comm")
    return set() if comm is None else {id(g) for g in comm.host_groups()}


def seed_test(seed: int) -> None:
    """Seed ``random``, torch and (when imported) numpy with a test's seed: every rank draws the
    same numbers."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)


def torch_settings(torch: Any) -> tuple[
    tuple[Callable[[], Any], Callable[[Any], Any], Callable[[Any], str]], ...]:
    """The torch process settings a body can change by hand: (get, set, how a changed value is
    named)."""
    return (
        (torch.get_default_dtype, torch.set_default_dtype, lambda v: f"default dtype set to {v}"),
        (torch.is_grad_enabled, torch.set_grad_enabled,
         lambda v: f"grad mode left {'on' if v else 'off'}"),
        (torch.get_num_threads, torch.set_num_threads, lambda v: f"torch threads set to {v}"),
        (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms,
         lambda v: f"deterministic algorithms switched {'on' if v else 'off'}"),
    )


class ProcessState:
    """What a test body can change in a rank process and the pool can put back
    (:meth:`restore`: the changes put back and named; the rank's ``_restore_and_check``)."""

    #: Set by libraries on first use, not by tests: neither reported nor undone. torch sets
    #: CUDA_MODULE_LOADING on CUDA initialisation, inductor TORCHINDUCTOR_CACHE_DIR on first use of
    #: its cache (torch.compile, or torch.use_deterministic_algorithms) and
    #: _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR as it loads its first compiled C++ wrapper
    #: (torch.compile on CPU).
    LIBRARY_ENV = ("CUDA_MODULE_LOADING", "TORCHINDUCTOR_CACHE_DIR",
                   "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")

    def __init__(self, torch: Any) -> None:
        self.settings = torch_settings(torch)
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.values = [get() for get, _, _ in self.settings]

    def restore(self) -> list[str]:
        changed: list[str] = []
        env = os.environ
        for name in self.LIBRARY_ENV:
            if name in env:
                self.environ[name] = env[name]
        added = sorted(set(env) - set(self.environ))
        removed = sorted(set(self.environ) - set(env))
        modified = sorted(k for k in set(env) & set(self.environ) if env[k] != self.environ[k])
        for what, names in (("set", added), ("removed", removed), ("changed", modified)):
            if names:
                changed.append(f"environment variable(s) {', '.join(names)} {what}")
        if added or removed or modified:
            env.clear()
            env.update(self.environ)
        if os.getcwd() != self.cwd:
            changed.append(f"working directory changed to {os.getcwd()}")
            os.chdir(self.cwd)
        for (get, put, named), baseline in zip(self.settings, self.values):
            now = get()
            if now != baseline:
                changed.append(named(now))
                put(baseline)
        return changed


__all__ = ["live_groups", "groups_kept_for_the_process", "seed_test", "torch_settings",
           "ProcessState"]
