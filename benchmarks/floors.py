"""What a forward+backward cannot go below on this machine, measured beside the op in one process.

``python -m benchmarks floors [--shapes 8192x4096x128256,...] [--host-shape 4096x2048x8192] [--what
gemm,host]``

Two floors, each a row kind of suite ``floors``:

* **GEMM floor** (``kind: gemm``, per ``--shapes`` entry). A forward+backward that keeps every term
  for the backward still runs three GEMMs: the forward's logits ``[T, D] x [D, V]``, ``d_hidden = dz
  @ W`` (``[T, V] x [V, D]``) and ``d_W = dz^T @ h`` (``[V, T] x [T, D]``). Each is timed back to
  back with ``torch.matmul`` (cuBLAS on a GPU) in the input dtype, after a sustained warm-up, in
  GEMM-times (the first GEMM is the unit, as in ``benchmarks op``); their sum is the time of such a
  call whose GEMMs run at cuBLAS speed and which does nothing else. Beside them, in the same rounds,
  ``linear_logp`` and ``linear_logp_loss`` (cross-entropy, mean, no entropy) with everything kept
  (:func:`tplogp.budgets.keep_logits_budget`), synced and back to back. Each round times the unit
  first and divides the round's times by it; a value is the median over rounds.
* **Host floor** (``kind: host``, at ``--host-shape``). The host CPU time of one forward+backward
  (:func:`benchmarks.runner.host_us_threads`: the calling thread's, and the process's, every thread)
  of: an ``autograd.Function`` that launches nothing (it saves two tensors and returns uninitialised
  outputs and gradients: autograd's own cost, including on a GPU the hand-off of the backward to
  autograd's device thread and back), eager ``log_softmax`` + ``gather``, ``linear_logp`` and
  ``linear_logp_loss``. On a GPU each also with autograd's multithreading off
  (``torch.autograd.set_multithreading_enabled(False)``: the backward runs on the calling thread),
  which shows the device thread's share. Rounds interleave the rows; a value is the median over
  rounds of each round's median.
"""

from __future__ import annotations

import contextlib
import statistics
from typing import Callable

import torch

from . import runner
from .op import make_problem


class _NothingFunction(torch.autograd.Function):
    """Autograd's own cost: saves its inputs, launches nothing, returns uninitialised tensors."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        return hidden.new_empty(hidden.shape[0], dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        return torch.empty_like(hidden), torch.empty_like(weight)


def _problem(shape: tuple[int, int, int], dtype: str, device: torch.device):
    """The op suite's seeded problem (:func:`benchmarks.op.make_problem`), hidden and weight
    requiring grad."""
    hidden, weight, target, upstream = make_problem(*shape, runner.DTYPES[dtype], device)
    return hidden.requires_grad_(), weight.requires_grad_(), target, upstream


def _steps(hidden, weight, target, upstream, workspace_bytes=None) -> dict[str, Callable[[], None]]:
    """One forward+backward per row (gradients reset first, so each call allocates them as a
    training step does)."""
    from tplogp import linear_logp, linear_logp_loss, losses

    cross_entropy = losses.cross_entropy()

    def clear():
        hidden.grad = weight.grad = None

    def nothing():
        clear()
        _NothingFunction.apply(hidden, weight).backward(upstream)

    def eager():
        clear()
        logits = (hidden @ weight.t()).float()
        torch.log_softmax(logits, -1).gather(1, target[:, None]).squeeze(1).backward(upstream)

    def op():
        clear()
        linear_logp(hidden, weight, target, workspace_bytes=workspace_bytes).backward(upstream)

    def loss():
        clear()
        linear_logp_loss(hidden, weight, target, loss=cross_entropy, reduction="mean",
                         with_entropy=False,
                         workspace_bytes=workspace_bytes).backward()

    return {"autograd-floor": nothing, "torch-eager": eager, "tplogp": op, "tplogp-loss": loss}


def gemm_floor(shape: tuple[int, int, int], dtype: str, device: torch.device, reps: int,
               rounds: int,
               warm_ms: float) -> dict:
    """The ``kind: gemm`` row of one shape (module docstring)."""
    from tplogp.budgets import keep_logits_budget

    t, d, v = shape
    hidden, weight, target, upstream = _problem(shape, dtype, device)
    h, w = hidden.detach(), weight.detach()
    dz = torch.randn(t, v, device=device, dtype=h.dtype,
                     generator=torch.Generator(device=device).manual_seed(1))
    steps = _steps(hidden, weight, target, upstream,
                   keep_logits_budget(t, v, device=device, dtype=h.dtype))
    timed = {
        "d_hidden_gemms": (lambda: dz @ w, True),
        "d_weight_gemms": (lambda: dz.t() @ h, True),
        "keep_all_gemms": (steps["tplogp"], False),
        "keep_all_gemms_b2b": (steps["tplogp"], True),
        "loss_keep_all_gemms": (steps["tplogp-loss"], False),
        "loss_keep_all_gemms_b2b": (steps["tplogp-loss"], True),
    }
    units, ratios = [], {k: [] for k in timed}
    for _ in range(rounds):
        unit = runner.median_ms(lambda: h @ w.t(), device, reps, warm_ms=warm_ms, back_to_back=True)
        units.append(unit)
        for key, (fn, b2b) in timed.items():
            ratios[key].append(runner.median_ms(fn, device, reps, warm_ms=warm_ms, back_to_back=b2b)
                               / unit)
    row = {"suite": "floors", "kind": "gemm", "shape": runner.shape_label(shape), "dtype": dtype,
           "unit_ms": round(statistics.median(units), 4), "rounds": rounds}
    row.update({k: round(statistics.median(v), 4) for k, v in ratios.items()})
    row["floor_gemms"] = round(1.0 + row["d_hidden_gemms"] + row["d_weight_gemms"], 4)
    return row


def host_floor(shape: tuple[int, int, int], dtype: str, device: torch.device, reps: int,
               rounds: int) -> list[dict]:
    """The ``kind: host`` rows at one shape (module docstring)."""
    steps = _steps(*_problem(shape, dtype, device))
    # (the CPU runs every backward on the caller)
    modes = (True, False) if device.type == "cuda" else (True,)
    for fn in steps.values():  # first calls: plans, compiled kernels, the allocator's blocks
        for _ in range(5):
            fn()
    samples: dict[tuple, list] = {}
    for _ in range(rounds):
        for threads in modes:
            with (contextlib.nullcontext() if threads
                  else torch.autograd.set_multithreading_enabled(False)):
                for name, fn in steps.items():
                    samples.setdefault((name, threads), []).append(
                        runner.host_us_threads(fn, device, reps))
    rows = []
    for (name, threads), got in samples.items():
        rows.append({"suite": "floors", "kind": "host", "shape": runner.shape_label(shape),
                     "dtype": dtype,
                     "impl": name, "autograd_threads": threads, "rounds": rounds,
                     "host_us": round(statistics.median(x[0] for x in got), 1),
                     "host_all_us": round(statistics.median(x[1] for x in got), 1)})
    return rows


def format_row(r: dict) -> str:
    if r["kind"] == "gemm":
        return (f"{r['shape']:>18} {r['dtype']} | GEMM {r['unit_ms']:.3f} ms | d_hidden "
                f"{r['d_hidden_gemms']:.3f}, d_W {r['d_weight_gemms']:.3f}: 3-GEMM floor "
                f"{r['floor_gemms']:.3f} | keep-all {r['keep_all_gemms']:.3f} / "
                f"{r['keep_all_gemms_b2b']:.3f}, fused loss {r['loss_keep_all_gemms']:.3f} / "
                f"{r['loss_keep_all_gemms_b2b']:.3f} GEMM-times (synced / b2b)")
    threads = "autograd threads on " if r["autograd_threads"] else "autograd threads off"
    return (f"{r['shape']:>18} {r['dtype']} | {r['impl']:<14} | {threads} | host "
            f"{r['host_us']:.0f} / {r['host_all_us']:.0f} us (thread / all)")


__all__ = ["format_row", "gemm_floor", "host_floor"]
