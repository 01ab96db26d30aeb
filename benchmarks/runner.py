"""Shared benchmark runner: timing, memory, machine info, JSON output.

Timing: CUDA events around each call, after warm-up (optionally a sustained one, see :func:`sustain`), median of
``reps``, either synced after every call or back to back (:func:`median_ms`). Memory: peak allocated during one call
minus what was allocated before it (inputs excluded, outputs and gradients included).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from typing import Callable

import torch

from tplogp.tolerances import rel_error as rel_err  # noqa: F401  (re-exported for the scripts)


def sustain(fn: Callable[[], object], warm_ms: float, max_calls: int = 5000) -> None:
    """Keep the GPU busy with back-to-back calls of ``fn`` for about ``warm_ms`` of GPU time (no host syncs).

    An H200 under a sustained tensor-core load sits at its 700 W power cap, where its SM clock drops from 1980 MHz
    to about 1450-1620 MHz (benchmarks/clock_probe.py): a kernel timed right after an idle or lighter stretch runs at
    boost clock and looks up to ~18% faster than it does in training. Timing every function after this warm-up puts
    the GEMM and the sources in the same power state."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end), 1e-3)
    for _ in range(min(max_calls, max(1, int(warm_ms / one)))):
        fn()


def median_ms(fn: Callable[[], object], reps: int = 10, warmup: int = 3, warm_ms: float = 0.0,
              back_to_back: bool = False) -> float:
    """Median milliseconds per call of ``fn`` (CUDA events around each call), after ``warmup`` calls and, when
    ``warm_ms`` > 0, :func:`sustain`. Synced (default, the anchor benchmark's method): a host sync after every call,
    so each sample includes the host's launch latency. ``back_to_back``: no sync between calls, so the host runs ahead
    as in a training loop and a sample is GPU time unless the host is the slower side (triton.testing.do_bench's
    method)."""
    for _ in range(warmup):
        fn()
    if warm_ms > 0:
        sustain(fn, warm_ms)
    times = sorted(samples_ms(fn, reps, back_to_back))
    return times[len(times) // 2]


def samples_ms(fn: Callable[[], object], reps: int, back_to_back: bool) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn`` in call order (CUDA events; see :func:`median_ms`)."""
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
        if not back_to_back:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def median_marks(one_call: Callable[[dict], float], calls: int, warmup: int = 5) -> dict:
    """Host timelines: ``one_call(marks)`` does one call, stores ``time.perf_counter()`` stamps into ``marks`` and
    returns the stamp the others count from. Returns, per mark, the median microseconds after that stamp over
    ``calls`` calls (after ``warmup``), in time order."""
    rows: dict = {}
    for i in range(calls + warmup):
        marks: dict = {}
        t0 = one_call(marks)
        if i >= warmup:
            for k, t in sorted(marks.items(), key=lambda kv: kv[1]):
                rows.setdefault(k, []).append((t - t0) * 1e6)
    return {k: round(statistics.median(v), 1) for k, v in rows.items()}


def extra_peak_gib(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def bf16_problem(T: int, D: int, V: int, ignore_frac: float = 0.0, ge_scale: float = 1.0):
    """Seeded bf16 inputs on the GPU: (hidden, weight, targets, grad_logp, grad_entropy, ignore_index or None)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(T, D, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    w = (torch.randn(V, D, device="cuda", generator=g) / D**0.5).to(torch.bfloat16)
    y = torch.randint(0, V, (T,), device="cuda", generator=g)
    ii = None
    if ignore_frac:
        ii = -100
        y = torch.where(torch.rand(T, device="cuda", generator=g) < ignore_frac, torch.full_like(y, -100), y)
    gy = torch.randn(T, device="cuda", generator=g)
    ge = torch.randn(T, device="cuda", generator=g) * ge_scale
    return h, w, y, gy, ge, ii


def torch_eager(h, w, y, *, return_entropy=False, ignore_index=None):
    """The materializing baseline: bf16 logits, fp32 log_softmax, gather (logp, and entropy when asked).
    ``ignore_index`` positions get 0."""
    logits = (h @ w.T).float()
    logprobs = logits.log_softmax(-1)
    safe = y if ignore_index is None else torch.where(y == ignore_index, torch.zeros_like(y), y)
    logp = logprobs.gather(1, safe[:, None]).squeeze(1)
    if ignore_index is not None:
        logp = torch.where(y == ignore_index, torch.zeros_like(logp), logp)
    if return_entropy:
        ent = -(logprobs.exp() * logprobs).sum(-1)
        return logp, ent
    return logp


def tp_step_fns(be, h, w, y, opts, gy, ge):
    """(forward, forward+backward) closures through the public TP path, with per-token upstream gradients."""
    from tplogp.tp import linear_logp_tp

    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()

    def fwd():
        with torch.no_grad():
            return linear_logp_tp(be, h, w, y, options=opts)

    def fwd_bwd():
        out = linear_logp_tp(be, hg, wg, y, options=opts)
        if opts.return_entropy:
            torch.autograd.backward([out.logp, out.entropy], [gy, ge])
        else:
            out.backward(gy)
        hg.grad = wg.grad = None

    return fwd, fwd_bwd


def git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10)
        commit = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except Exception:
        return os.environ.get("TPLOGP_COMMIT", "unknown")


def machine_info() -> dict:
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": os.environ.get("TPLOGP_COMMIT") or git_commit(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
