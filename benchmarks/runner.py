"""The one runner of the suite: timing, memory, machine and version info, the results file.

Timing (:func:`median_ms`): on CUDA, CUDA events around each call after ``warmup`` calls and, when
``warm_ms`` > 0, a sustained warm-up (:func:`sustain`); the median of ``reps`` samples, either
*synced* (a host sync after every call, so a sample includes the host's launch latency) or
*back-to-back* (no sync between calls: the host runs ahead as in a training loop, and a sample is
GPU time unless the host is the slower side). On CPU, wall-clock ``time.perf_counter`` per call (the
smoke mode's only use of it).

Memory (:func:`extra_peak_gib`): the CUDA allocator's peak during one call minus what was allocated
before it (inputs excluded; outputs, gradients and anything kept from forward to backward included).
None on CPU.

Results: every run appends one JSON object per row to ``<out>/results.jsonl`` (:func:`append_rows`);
each row carries the run's :func:`run_info` (date, device, driver, commit of the measured tplogp,
versions).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

RESULTS_FILE = "results.jsonl"
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PEER_DISTRIBUTIONS = ("liger-kernel", "cut-cross-entropy", "quack-kernels", "nvidia-cutlass-dsl",
                      "verl")


# ------------------------------------------------------------------------------------------- timing
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sustain(fn: Callable[[], object], warm_ms: float, max_calls: int = 5000) -> None:
    """Keep the GPU busy with back-to-back calls of ``fn`` for about ``warm_ms`` of GPU time (no
    host syncs).

    An H200 under sustained tensor-core load sits at its 700 W power cap, where its SM clock drops
    from 1980 MHz to 1230-1620 MHz (docs/performance.md, "Method"): a kernel timed right after an
    idle or lighter stretch runs at boost clock and looks up to ~18% faster than it does in
    training. Timing every function (the reference GEMM too) after this warm-up puts them all in the
    same power state."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end), 1e-3)
    for _ in range(min(max_calls, max(1, int(warm_ms / one)))):
        fn()


def samples_ms(fn: Callable[[], object], reps: int, back_to_back: bool,
               device: torch.device) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn`` in call order (see the module docstring)."""
    if device.type != "cuda":
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
        if not back_to_back:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def median_ms(fn: Callable[[], object], device: torch.device, reps: int = 10, warmup: int = 3,
              warm_ms: float = 0.0, back_to_back: bool = False) -> float:
    """Median milliseconds per call of ``fn`` after ``warmup`` calls and (CUDA, ``warm_ms`` > 0)
    :func:`sustain`."""
    for _ in range(warmup):
        fn()
    if warm_ms > 0 and device.type == "cuda":
        sustain(fn, warm_ms)
    return statistics.median(samples_ms(fn, reps, back_to_back, device))


def host_us(fn: Callable[[], object], device: torch.device, reps: int = 10) -> float:
    """Median host CPU microseconds per call of ``fn``: the calling thread's CPU time
    (``time.thread_time``) around each call, with the device synchronized before and after it (those
    two syncs not counted), so a sample is the host work of one call (Python, dispatch, launches). A
    sync *inside* the call (a ``.item()``, a blocking copy, an explicit synchronize) is counted:
    CUDA's default scheduling spins the calling thread while it waits, and that spin is CPU time, so
    such a call's sample includes the device time it waited for. CPU time, not wall-clock: a loaded
    machine's preemption does not count. Only the calling thread's: on a GPU, autograd runs the
    backward functions of CUDA tensors on its own device thread, so their host work is not in the
    sample (a lower bound of a forward+backward's host time there; on the CPU the backward runs on
    the calling thread and is counted)."""
    return host_us_threads(fn, device, reps)[0]


def host_us_threads(fn: Callable[[], object], device: torch.device, reps: int = 10,
                    before: Optional[Callable[[], object]] = None) -> tuple[float, float]:
    """``(calling thread, all threads)``: :func:`host_us`, and from the same calls the process's CPU
    time (``time.process_time``: every thread, autograd's device thread included, the whole host
    cost of a forward+backward on a GPU, and whatever else the process runs meanwhile). Medians over
    ``reps`` calls; each call's process time includes its thread time, so the second is never below
    the first. ``before``: run before each call, after the sync, outside the timed region (a barrier
    that starts every rank's call together)."""
    thread, process = [], []
    for _ in range(max(reps, 1)):
        synchronize(device)
        if before is not None:
            before()
        p0, t0 = time.process_time(), time.thread_time()
        fn()
        t1, p1 = time.thread_time(), time.process_time()
        synchronize(device)
        thread.append((t1 - t0) * 1e6)
        process.append((p1 - p0) * 1e6)
    return statistics.median(thread), statistics.median(process)


def extra_peak_gib(fn: Callable[[], object], device: torch.device) -> Optional[float]:
    """Peak allocated GiB during one call of ``fn`` above what was allocated before it; None off
    CUDA."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**30


def device_profile(fn: Callable[[], object], device: torch.device,
                   top: int = 6) -> Optional[tuple[float, list]]:
    """One call of ``fn`` under ``torch.profiler``: the device's busy time in ms
    (its kernels' and copies' device time, summed) and its ``top`` kernels by device time,
    ``[name, ms, calls]``; None off CUDA. Beside the call's wall time it tells how long the device
    waits on the host."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize(device)
    on_device = [e for e in prof.key_averages()
                 if e.device_type == torch.autograd.DeviceType.CUDA]

    def ms(e) -> float:
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) / 1e3

    on_device.sort(key=ms, reverse=True)
    return (sum(ms(e) for e in on_device),
            [[e.key, round(ms(e), 3), e.count] for e in on_device[:top]])


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ------------------------------------------------------------------------------------------ parsing
def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"8192x4096x128256,64x32x320"`` -> [(T, D, V), ...]."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError("a shape is TxDxV with three positive integers (e.g. "
                             f"8192x4096x128256), got {item!r}")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_budget(text: str) -> Optional[int]:
    """``"default"`` -> None (the source's own default); ``"512MiB"``, ``"4GiB"``, ``"1048576"`` ->
    bytes."""
    text = text.strip()
    if text.lower() == "default":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?i?b?)", text.lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError("a budget is 'default' or bytes with an optional KiB / MiB / GiB unit, "
                         f"got {text!r}")
    value = int(float(m.group(1)) * _UNITS[m.group(2)])
    if value <= 0:
        raise ValueError(f"a budget must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class BudgetSpec:
    """One ``--budgets`` entry. ``default``; bytes (``4GiB``); ``keep:F``: the budget with which
    ``linear_logp`` keeps the share F of the call's ``[T, V]`` logits; ``chunk:C``: the budget with
    which ``linear_logp_loss`` runs chunks of C tokens with every chunk's logits kept. The last two
    are resolved per shape and source by ``tplogp.keep_logits_budget`` /
    ``tplogp.loss_chunk_budget`` (each source's own transient default added), and give every tplogp
    row of a shape, per-token or loss, the same bytes per source."""

    label: str
    nbytes: Optional[int] = None
    keep: Optional[float] = None
    chunk: Optional[int] = None

    def resolve(self, source: Optional[str], shape: tuple[int, int, int], dtype: torch.dtype,
                device: torch.device) -> Optional[int]:
        """``workspace_bytes`` for ``source`` at ``shape`` (T, D, V) in ``dtype`` (no bias) on
        ``device``."""
        T, D, V = shape
        if self.keep is not None:
            from tplogp import keep_logits_budget

            return keep_logits_budget(T, V, fraction=self.keep, source=source, device=device,
                                      dtype=dtype)
        if self.chunk is not None:
            from tplogp import loss_chunk_budget

            return loss_chunk_budget(self.chunk, D, V, dtype=dtype, source=source, device=device)
        return self.nbytes


def parse_budget_spec(text: str) -> BudgetSpec:
    """``default``, bytes (:func:`parse_budget`), ``keep:F`` (0 <= F <= 1) or ``chunk:C`` (C >= 1
    tokens)."""
    text = text.strip()
    kind, _, value = text.lower().partition(":")
    try:
        if kind == "keep" and value:
            share = float(value)
            if 0.0 <= share <= 1.0:
                return BudgetSpec(f"keep {share:.0%}", keep=share)
        elif kind == "chunk" and value:
            tokens = int(value)
            if tokens >= 1:
                return BudgetSpec(f"chunk {tokens}", chunk=tokens)
        else:
            nbytes = parse_budget(text)
            return BudgetSpec(budget_label(nbytes), nbytes=nbytes)
    except ValueError:
        pass
    raise ValueError("a budget is 'default', bytes with an optional KiB / MiB / GiB unit, "
                     "'keep:F' (a share of the logits, 0 to 1) or 'chunk:C' (loss chunks of C "
                     f"tokens), got {text!r}")


def budget_label(nbytes: Optional[int]) -> str:
    if nbytes is None:
        return "default"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


def shape_label(shape: tuple[int, int, int]) -> str:
    return "x".join(map(str, shape))


# ----------------------------------------------------------------------------------------- run info
def _git(args: list[str], cwd: str) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20)
    return out.stdout.strip() if out.returncode == 0 else ""


def source_commit(path: str, version: Optional[str] = None) -> str:
    """Which tplogp ``path`` (the package's folder) is: the short commit of the enclosing git
    repository when that repository tracks the package's files (``+dirty`` when any of those tracked
    files differs from the commit; changes elsewhere in the repository do not count), else ``v`` +
    ``version`` (default: the ``__version__`` written in the package's ``__init__.py``, else the
    installed distribution's), else 'unknown'.

    A copy of the package unpacked, untracked, inside another repository (vendored into a monorepo,
    say) is not that repository's commit: it is named by its version."""
    where = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        tracked = _git(["ls-files", "--", "."], where)
        commit = _git(["rev-parse", "--short", "HEAD"], where) if tracked else ""
        if commit:
            dirty = _git(["status", "--porcelain", "--untracked-files=no", "--", "."], where)
            return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    if version is None:
        version = _package_version(where) or _version("tplogp")
    return f"v{version}" if version else "unknown"


def _package_version(where: str) -> Optional[str]:
    """``__version__`` as written in the package's ``__init__.py`` (a copy that is not an installed
    distribution)."""
    try:
        with open(os.path.join(where, "__init__.py")) as f:
            m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return (out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip()
                else None)
    except (OSError, subprocess.SubprocessError):
        return None


def run_info(device: torch.device) -> dict:
    """Fields every row of this run carries: when, where, which code and which versions."""
    import tplogp

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("TPLOGP_COMMIT")
        or source_commit(os.path.dirname(tplogp.__file__)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "peers": {d: _version(d) for d in PEER_DISTRIBUTIONS},
        "checks": os.environ.get("TPLOGP_CHECKS", "full"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, driver=_driver(), cuda=torch.version.cuda,
                    capability=f"{props.major}.{props.minor}")
    else:
        info.update(device=f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} "
                           "cores)",
                    driver=None, cuda=None, capability=None)
    return info


# ------------------------------------------------------------------------------------------ results
def results_path(out_dir: str) -> str:
    return os.path.join(out_dir, RESULTS_FILE)


def append_rows(out_dir: str, rows: Iterable[dict]) -> str:
    """Append ``rows`` (one JSON object per line) to ``<out_dir>/results.jsonl``; returns the
    path."""
    os.makedirs(out_dir, exist_ok=True)
    path = results_path(out_dir)
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    return path


def read_rows(out_dir: str) -> list[dict]:
    path = results_path(out_dir)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def latest_rows(rows: Iterable[dict], suite: str, key_fields: Sequence[str]) -> list[dict]:
    """The latest row (by date) per ``key_fields`` value among ``suite``'s rows of full runs (smoke
    and A/B rows left out): the rows the report and the plots show."""
    latest: dict[tuple, dict] = {}
    for r in rows:
        if r.get("suite") != suite or r.get("smoke") or r.get("ab"):
            continue
        key = tuple(r.get(k) for k in key_fields)
        if key not in latest or r["date"] >= latest[key]["date"]:
            latest[key] = r
    return list(latest.values())
