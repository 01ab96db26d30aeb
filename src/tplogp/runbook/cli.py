"""``main``: parse the flags, set up the process group, run the phases, print ``[result]``."""

from __future__ import annotations

import sys
import traceback
from typing import Optional, Sequence

import torch.distributed as dist

from ..kernel_registry import get_op
from .correctness import correctness
from .flags import parse_args
from .launch import log0, setup_distributed
from .stress import stress


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv, description=sys.modules["tplogp.runbook"].__doc__)
    rank, world, device, backend = setup_distributed(args)
    ok = True
    try:
        op = get_op("linear_logp", source=None if args.op_source == "registry" else args.op_source)
        ok &= correctness(args, rank, world, device, backend, op)
        if args.run_stress:
            ok &= stress(args, rank, world, device, backend, op)
    except Exception as exc:  # same error on every rank by design; report it and fail
        ok = False
        if rank == 0:
            traceback.print_exc()
        log0(rank, f"  ERROR {type(exc).__name__}: {exc}", "")
    log0(rank, "[result]", f"  {'PASS' if ok else 'FAIL'}")
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return 0 if ok else 1
