"""Process-group set-up and rank-0 output for the runbook."""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist


def setup_distributed(args: argparse.Namespace) -> tuple[int, int, torch.device, str]:
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --standalone --nproc_per_node=4 tests/linear_logp_tp.py")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if n_gpus >= local_world and n_gpus > 0 else "gloo"
    if backend == "nccl":
        if n_gpus < local_world:
            raise SystemExit(f"--backend nccl needs one GPU per rank: {local_world} local ranks, {n_gpus} GPUs "
                             f"(use --backend gloo to share GPUs)")
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cuda", local_rank % n_gpus) if n_gpus > 0 else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=args.timeout_s),
                            **({"device_id": device} if backend == "nccl" else {}))
    return rank, world, device, backend


def log0(rank: int, *lines: str) -> None:
    if rank == 0:
        for line in lines:
            print(line, flush=True)


def max_over_ranks(values: list[float], device: torch.device, backend: str) -> list[float]:
    comm = device if backend == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=comm)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()
