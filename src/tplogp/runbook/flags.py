"""The runbook's command line: flags, defaults, and the per-dtype default tolerances."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch

from ..tolerances import RUNBOOK_TOLERANCES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IGNORE_INDEX = -100


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op-source", choices=["registry", "native", "triton", "sm90"], default="registry")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--reference-mode", choices=["fp32", "matching"], default="fp32")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--uneven-shards", action="store_true")
    p.add_argument("--no-bias", action="store_true")
    p.add_argument("--atol", type=float, default=None, help="default: per dtype from tplogp.tolerances")
    p.add_argument("--rtol", type=float, default=None, help="default: per dtype from tplogp.tolerances")
    p.add_argument("--run-stress", action="store_true")
    p.add_argument("--stress-tokens", type=int, default=4096)
    p.add_argument("--stress-hidden-size", type=int, default=2048)
    p.add_argument("--stress-vocab-size", type=int, default=32768)
    p.add_argument("--stress-steps", type=int, default=10, help="timed steps after the first (warm-up) step")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="auto: NCCL with one GPU per rank when there are enough GPUs, else gloo")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--entropy", action="store_true", help="also check the per-token entropy and its gradient")
    p.add_argument("--ignore-fraction", type=float, default=0.0,
                   help=f"fraction of tokens whose target is ignore_index={IGNORE_INDEX}")
    p.add_argument("--timeout-s", type=float, default=300.0, help="process-group timeout")
    return p


def parse_args(argv: Optional[Sequence[str]] = None, description: str = "") -> argparse.Namespace:
    p = build_parser(description)
    args = p.parse_args(argv)
    tol = RUNBOOK_TOLERANCES[DTYPES[args.dtype]]
    args.atol = tol.atol if args.atol is None else args.atol
    args.rtol = tol.rtol if args.rtol is None else args.rtol
    if not 0.0 <= args.ignore_fraction <= 1.0:
        p.error("--ignore-fraction must be in [0, 1]")
    return args
