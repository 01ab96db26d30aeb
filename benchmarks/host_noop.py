"""Host CPU time of the triton / sm90 call path on CPU, with every Triton kernel launch replaced by
a no-op.

``python -m benchmarks.host_noop [--shape 16x32x256] [--dtype fp32] [--reps 300] [--rounds 7]
[--profile NAME]``

What it measures: the Python and torch host work of one ``linear_logp`` forward+backward (no group)
and of one ``linear_logp_loss`` forward+backward, as on a GPU host but without a GPU: the kernels
are not run, so the numbers are the host path alone (planning, checks, allocations, small torch ops,
autograd, launch bookkeeping), plus the CPU GEMMs of the backward (tiny at the default shape).
Launches keep their host work: every launch goes through :class:`tplogp.kernels.launch.Launch`'s hot
path (the alignment key built from the tensors, the kept compiled kernel looked up), whose compiled
kernel is a no-op; the first launch of a key keeps it without compiling. Rows: ``torch-eager``
(log_softmax + gather, for scale), ``triton`` (``get_op(source="triton")``), ``sm90-tma`` (the sm90
source's TMA host path: descriptors and their launchers, through :func:`tplogp.api.linear_logp_on`
since the registry offers sm90 on Hopper only; every size takes it here, where the source itself
launches the pointer kernels up to ``TMA_MIN_MACS``), ``torch-eager-loss`` (mean ``cross_entropy``
of the logits), ``loss-triton`` (``linear_logp_loss`` with the built-in ``losses.cross_entropy()``,
mean) and ``loss-triton-callable`` (the same loss as a plain callable, differentiated by autograd).

Each number is the minimum over ``--rounds`` of the mean ``time.thread_time`` per call over
``--reps`` calls (CPU time of this thread: a loaded machine's preemption does not count; the minimum
drops rounds slowed by cache pollution from other processes). ``TPLOGP_CHECKS`` applies as usual
(run once with ``fast`` to compare). ``--profile NAME`` prints a cProfile table of that row instead
(its absolute times are inflated by the profiler). Without CUDA it sets ``TRITON_INTERPRET=1`` at
import, before tplogp imports the kernels (importing it on a GPU host, as
:mod:`benchmarks.host_stages` does, leaves the compiled kernels on).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import time
import types
from typing import Callable, Iterator

import torch  # noqa: E402

# (no CUDA context is made here) a GPU host keeps its compiled kernels
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .runner import DTYPES  # noqa: E402


def install_noop_launches() -> list:
    """Make every kernel launch take its hot path with a no-op compiled kernel (see the module
    docstring): the first call of a launch's key keeps a no-op in place of compiling. Returns the
    list of the launches that keep one (for :func:`noop_launches` to empty afterwards)."""
    from tplogp.kernels import launch

    touched: list = []

    def noop(*args) -> None:
        return None

    def through_jit(self, tensors) -> None:
        if self.descriptors:
            self._describe(tensors)  # (the descriptors' host work, as a first launch does it)
        self._compiled[(0, *[t.data_ptr() % 16 for t in tensors])] = (noop, None, None)
        self._device, self._stream = (lambda: 0), (lambda device: 0)
        touched.append(self)

    launch._RUNTIME = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    launch.Launch._through_jit = through_jit
    launch._CACHE.clear()
    return touched


@contextlib.contextmanager
def noop_launches() -> Iterator[None]:
    """:func:`install_noop_launches` for the duration of the block, the real launches back after it
    (for callers that share the process with real launches, such as tests)."""
    from tplogp.kernels import launch

    saved = (launch._RUNTIME, launch.Launch._through_jit)
    touched = install_noop_launches()
    try:
        yield
    finally:
        launch._RUNTIME, launch.Launch._through_jit = saved
        # the launches made or used meanwhile (held by plans too) keep no no-op kernel
        for made in touched:
            made._compiled.clear()
            made._device = made._stream = None
        launch._CACHE.clear()


def calls(shape: tuple[int, int, int], dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    """One forward+backward per row (module docstring)."""
    import tplogp
    from tplogp.api import linear_logp_on
    from tplogp.backends.sm90_backend import SM90Backend

    n, d, v = shape
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=gen) / d ** 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    op = tplogp.get_op("linear_logp", source="triton")
    sm90 = SM90Backend(tma_min_macs=0)

    cross_entropy = tplogp.losses.cross_entropy()

    def neg_logp(logp, entropy):  # the same loss as a plain callable: differentiated by autograd
        return -logp

    def loss(per_token_loss):
        return lambda: tplogp.linear_logp_loss(hidden, weight, targets, loss=per_token_loss,
                                               reduction="mean",
                                               source="triton", with_entropy=False).backward()

    return {
        "torch-eager": lambda: torch.log_softmax((hidden @ weight.t()).float(), -1).gather(
            1, targets[:, None]).sum().backward(),
        "torch-eager-loss": lambda: torch.nn.functional.cross_entropy(
            (hidden @ weight.t()).float(), targets).backward(),
        "triton": lambda: op(hidden, weight, targets).sum().backward(),
        "sm90-tma": lambda: linear_logp_on(sm90, hidden, weight, targets).sum().backward(),
        "loss-triton": loss(cross_entropy),
        "loss-triton-callable": loss(neg_logp),
    }


def per_call_us(fn: Callable[[], None], reps: int, rounds: int) -> float:
    """Minimum over rounds of the mean thread CPU microseconds per call (after 50 warm-up calls)."""
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.thread_time() - t0) / reps * 1e6)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_noop",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="16x32x256", help="NxDxV (default %(default)s)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows",
                        default="torch-eager,triton,sm90-tma,torch-eager-loss,loss-triton,"
                                             "loss-triton-callable")
    parser.add_argument("--profile", metavar="ROW",
                        help="print a cProfile table of ROW instead of timing")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    install_noop_launches()
    shape = tuple(int(x) for x in args.shape.split("x"))
    rows = calls(shape, DTYPES[args.dtype])  # type: ignore[arg-type]
    if args.profile:
        fn = rows[args.profile]
        for _ in range(50):
            fn()
        prof = cProfile.Profile()
        prof.runcall(lambda: [fn() for _ in range(args.reps)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(40)
        return 0
    checks = os.environ.get("TPLOGP_CHECKS", "full (default)")
    for name in args.rows.split(","):
        us = per_call_us(rows[name], args.reps, args.rounds)
        print(f"{name:12s} {args.shape} {args.dtype} TPLOGP_CHECKS={checks}: {us:7.1f} us per "
              "fwd+bwd (host CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
