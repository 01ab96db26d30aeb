"""``main``: check the flags, set up the process group, run the phases, agree on the verdict, report
it.

Errors a user can cause (a bad flag, a source this machine cannot run, inputs the op rejects) are
reported by rank 0 as one line each, without a Python traceback; an unexpected exception also prints
the failing rank's traceback.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback
from typing import Optional, Sequence

import torch.distributed as dist

from ..api import get_op
from ..backends.kernel_registry import SourceUnavailableError
from ..support.shards import ShardLayoutError
from ..op.validation import LinearLogpInputError
from .correctness import correctness
from .flags import UsageError, parse_args
from .launch import env_rank, gather_errors, init_group, launch_env, leave_last, log0, pick_device
from .stress import stress

USER_ERRORS = (SourceUnavailableError, LinearLogpInputError, ShardLayoutError)
EPILOG = """\
cost on CPU: the default stress shape (4096 x 2048 x 32768, bf16) at 4 ranks on 2 CPU cores (gloo, torch 2.13;
  docs/runbook.md) takes about 36 s for the warm-up step and 27 s per timed step, so --run-stress with the
  defaults adds about 5.5 minutes (more on a loaded machine); --stress-steps 1 makes it about 1 minute. Each step
  prints a progress line.

what a failure looks like under torchrun:
  rank 0 prints one line per problem (a bad flag: "<prog>: error: argument --tokens: ..."; a source or input
  that cannot run: "  ERROR <kind>: ..." and "[result] FAIL"; a FAIL verdict: the failing metric lines and
  "[result] FAIL") and exits non-zero (2 for a bad flag, 1 otherwise); the other ranks exit 0. torchrun itself
  then reports the one failed rank: an error line, its own Python traceback and a ChildFailedError summary
  (34 lines, printed by torchrun, not by this program); torchrun's exit status is 1.
"""


def _prog() -> str:
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "linear_logp_tp.py"
    return "python -m tplogp.runbook" if argv0 == "__main__.py" else argv0


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _parse(argv: Optional[Sequence[str]], rank: int):
    """The checked flags, or an exit status: 0 after --help, 2 after a bad flag (printed by rank 0
    only)."""
    quiet = contextlib.redirect_stdout(io.StringIO()) if rank != 0 else contextlib.nullcontext()
    try:
        with quiet:
            args = parse_args(argv, description=sys.modules[__package__].__doc__, epilog=EPILOG,
                              prog=_prog())
        env = launch_env()
        device, backend = pick_device(args.backend, env)
        return args, env, device, backend
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except UsageError as exc:
        if rank == 0:
            print(f"{_prog()}: error: {exc}", file=sys.stderr, flush=True)
            leave_last()
            return 2
        return 0


def _run_phases(args, env, device, backend) -> tuple[bool, Optional[str], Optional[str]]:
    """(verdict, error line, traceback text) of this rank."""
    try:
        op = get_op("linear_logp", source=None if args.op_source == "registry" else args.op_source)
        ok = correctness(args, env.rank, env.world_size, device, backend, op)
        if args.run_stress:
            ok &= stress(args, env.rank, env.world_size, device, backend, op)
        return ok, None, None
    except USER_ERRORS as exc:
        return False, _describe(exc), None
    except Exception as exc:  # a bug: keep its traceback for rank 0 to print
        return False, _describe(exc), traceback.format_exc()


def main(argv: Optional[Sequence[str]] = None) -> int:
    rank = env_rank()
    parsed = _parse(argv, rank)
    if isinstance(parsed, int):
        return parsed
    args, env, device, backend = parsed
    init_group(device, backend, args.timeout_s)
    ok, error, trace = _run_phases(args, env, device, backend)
    try:  # the verdict: every rank's own result, including errors other ranks did not see
        records = gather_errors(None if ok else (error, trace), env.world_size)
    # the exchange itself failed (a rank died): this rank reports and fails alone
    except Exception as exc:
        print(f"[rank {rank}] verdict exchange failed: {_describe(exc)}", file=sys.stderr,
              flush=True)
        return 1
    failed = [(r, rec) for r, rec in enumerate(records) if rec is not None]
    errors = [(r, line, tb) for r, (line, tb) in failed if line]
    if rank == 0 and errors:
        first_tb = next((tb for _, _, tb in errors if tb), None)
        if first_tb:
            print(first_tb, file=sys.stderr, end="", flush=True)
        if len({line for _, line, _ in errors}) == 1 and len(errors) == env.world_size:
            log0(rank, f"  ERROR {errors[0][1]}")
        else:
            log0(rank, *(f"  ERROR rank {r}: {line}" for r, line, _ in errors))
        log0(rank, "")
    log0(rank, "[result]", f"  {'FAIL' if failed else 'PASS'}")
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    if rank == 0 and failed:
        leave_last()
        return 1
    return 0
