"""Phase ``stress``: a larger TP-only shape, each rank holding only its shard: finiteness, step
time, memory.

Rank 0 prints a progress line as each step ends (the step's time, max over ranks, and an estimate of
the time left), so a long CPU run is not silent.

Memory on CPU is the growth of the resident set (``VmHWM`` after resetting it through
``/proc/self/clear_refs`` where the kernel allows, else ``VmRSS``); on a GPU it is the caching
allocator's peak.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from ..support.shards import shard_boundaries, shard_range
from .flags import DTYPES
from .inputs import make_targets, op_kwargs, token_rows
from .launch import log0, max_over_ranks


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def progress_line(step: int, timed_steps: int, step_ms: float, own_ms: list[float]) -> str:
    """One line per step as it ends: its time (max over ranks) and the time left, estimated from
    this rank.

    The estimate multiplies the steps left by the median warmed step so far (after the warm-up step:
    by the warm-up step's time, which includes one-time compilation, so the first estimate is high).
    """
    left = timed_steps - step
    per_step_ms = statistics.median(own_ms[1:]) if len(own_ms) > 1 else own_ms[0]
    label = "step 0 (warm-up)" if step == 0 else f"step {step}/{timed_steps}"
    eta = f", about {_duration(left * per_step_ms / 1e3)} left" if left else ""
    return f"  {label}: {step_ms:.1f} ms{eta}"


def stress(args: argparse.Namespace, rank: int, world: int, device: torch.device, backend: str,
           op: Callable) -> bool:
    dtype = DTYPES[args.dtype]
    T, D, V = args.stress_tokens, args.stress_hidden_size, args.stress_vocab_size
    bounds = shard_boundaries(V, world, uneven=args.uneven_shards)
    start, end = shard_range(bounds, rank)
    log0(rank, "[stress]",
         f"  dtype={dtype}, tokens={T}, hidden={D}, vocab={V}, steps={args.stress_steps}",
         f"  shard_boundaries={bounds}")
    gen = torch.Generator().manual_seed(args.seed + 1)
    hidden = (torch.randn(T, D, generator=gen) * 0.5).to(dtype).to(device)  # replicated: same seed
    target = make_targets(gen, T, V, args.ignore_fraction, device)
    g_logp = torch.randn(T, generator=gen).to(device)
    # shard only, never the full weight
    wgen = torch.Generator().manual_seed(args.seed + 100 + rank)
    weight = (torch.randn(end - start, D, generator=wgen) / D ** 0.5).to(dtype).to(device)
    bias = None if args.no_bias else (torch.randn(end - start, generator=wgen) * 0.1).to(dtype).to(device)
    h = hidden[token_rows(args, rank, world, T)].clone().requires_grad_()
    w = weight.requires_grad_()
    b = None if bias is None else bias.requires_grad_()
    kw = op_kwargs(args, start, V)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        sync()
        torch.cuda.reset_peak_memory_stats(device)
        base_alloc = torch.cuda.memory_allocated(device)
    else:
        have_clear = _reset_peak_rss()
        base_rss = _rss_bytes("VmRSS")
    elapsed_ms = []
    finite = True
    for step in range(1 + args.stress_steps):
        h.grad = w.grad = None
        if b is not None:
            b.grad = None
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        out = op(h, w, target, b, **kw)
        logp = out.logp if args.entropy else out
        (logp * g_logp).sum().backward()
        sync()
        elapsed_ms.append((time.perf_counter() - t0) * 1e3)
        log0(rank,
             progress_line(step, args.stress_steps,
                           max_over_ranks(elapsed_ms[-1:], device, backend)[0],
                                 elapsed_ms))
        finite &= bool(torch.isfinite(logp).all() and torch.isfinite(h.grad).all()
                       and torch.isfinite(w.grad).all()
                       and (b is None or torch.isfinite(b.grad).all()))
    if device.type == "cuda":
        peak_gb = torch.cuda.max_memory_allocated(device) / 1e9
        extra_gb = (torch.cuda.max_memory_allocated(device) - base_alloc) / 1e9
        mem_kind = "allocator peak"
    else:
        hwm = _rss_bytes("VmHWM") if have_clear else _rss_bytes("VmRSS")
        peak_gb = extra_gb = max(hwm - base_rss, 0) / 1e9
        mem_kind = "resident growth"
    first = elapsed_ms[0]
    warmed = statistics.median(elapsed_ms[1:]) if len(elapsed_ms) > 1 else first
    m_first, m_warm, m_peak, m_extra, not_finite = max_over_ranks(
        [first, warmed, peak_gb, extra_gb, 0.0 if finite else 1.0], device, backend)
    log0(rank,
         f"  finite={'FAIL' if not_finite else 'PASS'}",
         f"  first_step_max_rank_elapsed_ms={m_first:.3f}",
         f"  max_rank_elapsed_ms={m_warm:.3f} (median of {args.stress_steps} warmed steps, max over ranks)",
         f"  max_rank_peak_memory_gb={m_peak:.3f} ({mem_kind})",
         f"  max_rank_extra_memory_gb={m_extra:.3f} (above the inputs)",
         "")
    return not not_finite
