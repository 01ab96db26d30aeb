"""Process-group set-up, rank-0 output, and the exit policy of the runbook under torchrun.

Everything that can be decided from the command line and the launcher's environment (rank, world
size, GPUs per node) is decided before the process group starts, so a bad value ends every rank at
once without a collective.

Exit policy: rank 0 prints every verdict and carries it in its exit status; the other ranks exit 0
once the verdict is agreed (or when a flag is bad, which every rank knows alike). torchrun's agent
prints its ``ChildFailedError`` report for each rank that exits non-zero, so this keeps that report
to one entry; and rank 0, when it exits non-zero, first waits (a few seconds at most) for its
sibling ranks to exit, so that the agent does not signal them and list them as failed too. A rank
that cannot take part in the verdict exchange exits 1 itself.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..support.settings import LauncherEnv, SettingsError, launcher_env
from .flags import UsageError

LAUNCH_HINT = "launch with torchrun, e.g. torchrun --standalone --nproc_per_node=4 tests/linear_logp_tp.py"


def launch_env() -> LauncherEnv:
    """This process's place in the job, from torchrun's variables. Raises :class:`UsageError`
    without them."""
    env = _launcher_env()
    if env is None:
        raise UsageError(LAUNCH_HINT)
    return env


def env_rank() -> int:
    """The global rank if launched by torchrun, else 0 (plain ``python``, or unusable variables:
    this process prints)."""
    try:
        env = launcher_env()
    except SettingsError:
        return 0
    return 0 if env is None else env.rank


def _launcher_env() -> Optional[LauncherEnv]:  # malformed variables are a usage error
    try:
        return launcher_env()
    except SettingsError as exc:
        raise UsageError(str(exc)) from None


def pick_device(backend: str, env: LauncherEnv) -> tuple[torch.device, str]:
    """(device, process-group backend). The GPU count is the node's, the same on every rank of a
    node."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        backend = "nccl" if n_gpus >= env.local_world_size and n_gpus > 0 else "gloo"
    if backend == "nccl":
        if n_gpus < env.local_world_size:
            raise UsageError(f"argument --backend: nccl needs one GPU per rank: {env.local_world_size} "
                             f"local ranks, {n_gpus} GPUs (use --backend gloo to share GPUs)")
        return torch.device("cuda", env.local_rank), backend
    return (torch.device("cuda", env.local_rank % n_gpus) if n_gpus > 0 else torch.device("cpu")), backend


def init_group(device: torch.device, backend: str, timeout_s: float) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                            **({"device_id": device} if backend == "nccl" else {}))


def log0(rank: int, *lines: str) -> None:
    if rank == 0:
        for line in lines:
            print(line, flush=True)


def max_over_ranks(values: list[float], device: torch.device, backend: str) -> list[float]:
    comm = device if backend == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=comm)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def gather_errors(error: Optional[tuple], world: int) -> list[Optional[tuple]]:
    """Every rank's failure record (None: it passed), in rank order."""
    errors: list = [None] * world
    dist.all_gather_object(errors, error)
    return errors


def _running_siblings() -> list[int]:
    """Other live (not exited) children of this process's parent: under torchrun, the node's other
    ranks."""
    parent, me = os.getppid(), os.getpid()
    live = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent and fields[0] not in ("Z", "X"):
            live.append(int(name))
    return live


def leave_last(timeout_s: float = 5.0) -> None:
    """Before a non-zero exit under torchrun: wait until the node's other ranks have exited
    (bounded)."""
    try:
        env = launcher_env()
    except SettingsError:
        return
    if env is None or not env.under_torchrun or env.local_world_size <= 1:
        return
    deadline = time.monotonic() + timeout_s
    while _running_siblings() and time.monotonic() < deadline:
        time.sleep(0.02)
