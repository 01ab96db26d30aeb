"""Tensor-parallel scaling: forward+backward of one shape at TP = 1, 2, 4, ... (strong scaling).

For each degree P the runner starts ``torchrun --standalone --nproc_per_node=P -m benchmarks.tp``
once (this module's worker, which measures every layout in turn on one process group). Each rank
holds the shard ``[start, end)`` of a ``V``-row LM head (even shards) and the replicated ``[N, D]``
hidden states; a step is the op's forward and backward with a per-token upstream gradient through
``tplogp.get_op`` (the registry's source unless ``--impls`` names one). Reported per degree: the
median step time of the slowest rank, effective TFLOP/s per GPU (4 GEMMs of ``2 N D V / P`` FLOP per
rank), the allocator peak per rank, the efficiency ``T(1) / (P * T(P))`` against the TP=1 row of the
same run, and the host CPU time of a step (the highest rank's median;
:func:`benchmarks.runner.host_us_threads`: the calling thread's, and the process's with autograd's
device thread and the collectives' threads; TP=1 runs the op without a group, so the rows compare
the host cost of the group path with the plain one). On a CPU run the host time includes the
kernels' own CPU work. NCCL with one GPU per rank when there are enough GPUs; else gloo, with the
ranks sharing the GPUs (CUDA tensors) where there are some, on CPU otherwise.

Hidden layouts (``--layouts``): ``replicated`` (every rank holds all N tokens; the op all-reduces
``d_hidden``); ``gather-allreduce`` (each rank holds its N / P tokens, as Megatron's sequence
parallelism, gathers them by hand before a replicated call and keeps its slice of the all-reduced
gradient: what a sequence-parallel caller pays without the option); ``sequence-parallel`` (the op's
``sequence_parallel=True``: the gather inside, ``d_hidden`` reduce-scattered). Each row also reports
the backward's median time and its ``d_hidden`` bytes sent per rank by the ring algorithm
(``bwd_bytes_per_rank``, below), and the forward's gather bytes (``fwd_bytes_per_rank``).

Variants (``--variants``, ``python -m benchmarks op``'s grammar): besides the plain call's rows,
rows whose calls are given a sampler's support (``support=K<k>-shared`` / ``-disjoint``,
replicated on every rank; the row's ``support_union``) or its parameters (``top_k=`` /
``top_p=`` / ``min_p=``; ``logit_std=S`` scales the replicated hidden states so the logits over
the shards have standard deviation ``S``): one row per case, layout and degree (one launch per
degree runs every case and layout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch

from . import runner, supports, variants

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


LAYOUTS = ("replicated", "gather-allreduce", "sequence-parallel")


def collective_bytes(layout: str, n: int, d: int, p: int, itemsize: int) -> tuple[int, int]:
    """``(forward, backward)`` bytes one rank sends for the hidden states and their gradient with a
    ring over ``p`` ranks (the vocab stats' small all_gather left out): an all_gather of ``[N, D]``
    in the input dtype sends ``(p - 1) / p * N D itemsize``; the fp32 ``d_hidden`` all-reduce ``2 (p
    - 1) / p * 4 N D`` (reduce-scatter then all-gather), its reduce-scatter alone half that."""
    if p == 1:
        return 0, 0
    gather = (p - 1) * n * d * itemsize // p
    reduce_scatter = (p - 1) * n * d * 4 // p
    if layout == "replicated":
        return 0, 2 * reduce_scatter
    if layout == "gather-allreduce":
        return gather, 2 * reduce_scatter
    return gather, reduce_scatter


# what a TP row's variant may set: the sampler's support, given or computed, and its logits' spread
TP_VARIANT_KEYS = ("support", "top_k", "top_p", "min_p", "logit_std")


def parse_variants(text: str) -> tuple[variants.Variant, ...]:
    """``--variants``: comma-separated variants of ``python -m benchmarks op``'s grammar
    (benchmarks/variants.py) that set only :data:`TP_VARIANT_KEYS`, e.g.
    ``support=K64-shared,top_p=0.9+logit_std=4``."""
    try:
        found = variants.parse_variants(text)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    for variant in found:
        other = [item.partition("=")[0] for item in variant.label.split("+")
                 if item.partition("=")[0] not in TP_VARIANT_KEYS]
        if other:
            raise SystemExit(f"--variants: a TP row takes {', '.join(TP_VARIANT_KEYS)}, got "
                             f"{other} in {variant.label!r}")
    return tuple(found)


def bench(shape: tuple[int, int, int], degrees: list[int], source: str, dtype: str, steps: int,
          warmup: int, layouts: tuple[str, ...] = ("replicated",),
          variant_list: tuple[variants.Variant, ...] = ()) -> list[dict]:
    """One ``torchrun`` per degree, which measures every case in turn: the plain call, then each
    of ``variant_list`` (:func:`parse_variants`': a sampler's support or parameters given to every
    call), in every layout (rows case-major, then layout, degrees ascending)."""
    labels = [None] + [v.label for v in variant_list]  # (the plain call first)
    extra = ["--variants", ",".join(v.label for v in variant_list)] if variant_list else []
    by_case: dict = {(label, layout): [] for label in labels for layout in layouts}
    for p in degrees:
        with tempfile.TemporaryDirectory(prefix="tplogp-tp-") as tmp:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={p}",
                   "-m", "benchmarks.tp", "--shape", runner.shape_label(shape), "--source", source,
                   "--dtype", dtype, "--steps", str(steps), "--warmup", str(warmup), "--row-dir",
                   tmp,
                   "--layouts", ",".join(layouts), *extra]
            out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
            for i, label in enumerate(labels):
                for layout in layouts:
                    row_file = os.path.join(tmp, f"{i}-{layout}.json")
                    row = _row(shape, p, source, dtype, layout, out, row_file)
                    if label is not None:
                        row["impl"] += f" {label}"
                        row["variant"] = label
                    by_case[label, layout].append(row)
    rows = []
    for case_rows in by_case.values():
        base = next((r["step_ms"] for r in case_rows if r["tp"] == 1 and "step_ms" in r), None)
        for r in case_rows:
            if base and "step_ms" in r:
                r["efficiency"] = round(base / (r["tp"] * r["step_ms"]), 3)
        rows += case_rows
    return rows


def _row(shape, p: int, source: str, dtype: str, layout: str, out: subprocess.CompletedProcess,
         row_file: str) -> dict:
    """A layout's row at degree ``p``: the bytes it sends, and what rank 0 wrote, or the launch's
    last error line."""
    impl = f"tplogp-{source}" + ("" if layout == "replicated" else f" {layout}")
    fwd_bytes, bwd_bytes = collective_bytes(layout, shape[0], shape[1], p,
                                            runner.DTYPES[dtype].itemsize)
    row = {"suite": "tp", "shape": runner.shape_label(shape), "impl": impl, "dtype": dtype, "tp": p,
           "layout": layout, "fwd_bytes_per_rank": fwd_bytes, "bwd_bytes_per_rank": bwd_bytes}
    if not os.path.exists(row_file):
        lines = (out.stderr or out.stdout).strip().splitlines()
        row["error"] = lines[-1] if lines else f"exit status {out.returncode}"
    else:
        with open(row_file) as f:
            row.update(json.load(f))
    return row


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['shape']:>18} TP={r['tp']} | {r['error']}"
    peak = ("" if r.get("peak_gib_per_rank") is None
            else f" | peak {r['peak_gib_per_rank']:.3f} GiB/rank")
    eff = f" | efficiency {r['efficiency']:.1%}" if "efficiency" in r else ""
    host = (f" | host {r['host_step_us']:.0f} / {r['host_step_all_us']:.0f} us (thread / all)"
            if "host_step_us" in r else "")
    layout = f" {r['layout']}" if r.get("layout", "replicated") != "replicated" else ""
    if "variant" in r:
        layout += f" {r['variant']}"
    if "support_union" in r:
        layout += f" (union {r['support_union']} ids)"
    bwd = (f" | bwd {r['bwd_ms']:.3f} ms, {r['bwd_bytes_per_rank'] / 2**20:.2f} MiB/rank"
           if "bwd_ms" in r else "")
    return (f"{r['shape']:>18} TP={r['tp']}{layout} {r['backend']} | step {r['step_ms']:.3f} ms "
            f"(slowest rank) | {r['tflops_per_gpu']:.1f} TFLOP/s/GPU{peak}{eff}{host}{bwd}")


def _scaled(hidden: torch.Tensor, shard: torch.Tensor, std: float, group,
            comm_device: torch.device, tokens: int = 256) -> torch.Tensor:
    """``hidden`` (replicated) scaled so the logits over every rank's shard have standard deviation
    ``std``: the shards' variances of the first ``tokens`` rows' fp32 logits averaged over the ranks
    (every rank the same factor)."""
    from tplogp.support.comm import all_gather_flat

    var = (hidden[:tokens].float() @ shard.detach().float().T).var().reshape(1)
    if group is not None:
        var = all_gather_flat(var.to(comm_device), group).mean()
    return (hidden.float() * (std / float(var.sqrt()))).to(hidden.dtype)


def _worker(argv: list[str]) -> None:
    """One rank of a torchrun launch: every layout in turn on one group; rank 0 writes a row file
    per layout."""
    import torch.distributed as dist

    from tplogp import get_op
    from tplogp.support.comm import all_gather_flat
    from tplogp.runbook.launch import init_group, launch_env, max_over_ranks, pick_device
    from tplogp.support.shards import shard_boundaries, shard_range

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True)
    ap.add_argument("--source", default="registry")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--row-dir", required=True)
    ap.add_argument("--layouts", default="replicated")
    ap.add_argument("--variants", default="")
    args = ap.parse_args(argv)
    env = launch_env()
    rank, world = env.rank, env.world_size
    # the runbook's rule: NCCL with one GPU per rank, else gloo
    device, backend = pick_device("auto", env)
    init_group(device, backend, timeout_s=600)
    n, d, v = (int(x) for x in args.shape.split("x"))
    dt = runner.DTYPES[args.dtype]
    start, end = shard_range(shard_boundaries(v, world), rank)
    g = torch.Generator(device="cpu").manual_seed(0)
    full = (torch.randn(n, d, generator=g) * 0.5).to(dt).to(device)
    target = torch.randint(0, v, (n,), generator=g).to(device)
    upstream = torch.randn(n, generator=g).to(device)
    wg = torch.Generator(device="cpu").manual_seed(100 + rank)
    weight = (torch.randn(end - start, d, generator=wg) / d**0.5).to(dt).to(device).requires_grad_()
    op = get_op("linear_logp", source=None if args.source == "registry" else args.source)
    group = dist.group.WORLD if world > 1 else None  # TP=1: the op without a group (its plain path)
    comm_device = device if backend == "nccl" else torch.device("cpu")
    base_kw = dict(tp_group=group, vocab_start_index=start, global_vocab_size=v)
    # this rank's tokens under sequence parallelism
    mine = slice(rank * n // world, (rank + 1) * n // world)

    def measure(layout: str, variant: Optional[variants.Variant]) -> dict:
        support_ids, rows_in = None, full
        if variant is not None and variant.support is not None:  # replicated: one seed everywhere
            support_ids = supports.make_support(target.cpu(), v, variant.support_k,
                                                variant.support_kind).to(device)
        if variant is not None and variant.logit_std is not None:
            rows_in = _scaled(full, weight, variant.logit_std, group, comm_device)
        kw = dict(base_kw, support=support_ids,
                  **({} if variant is None else variant.call_options()))
        # this rank's tokens
        hidden = (rows_in if layout == "replicated" else rows_in[mine]).clone().requires_grad_()

        def forward():
            hidden.grad = weight.grad = None
            if layout == "sequence-parallel":
                return op(hidden, weight, target, sequence_parallel=True, **kw), None
            # the caller's gather, the op replicated
            if layout == "gather-allreduce" and group is not None:
                rows = all_gather_flat(hidden.detach().to(comm_device), group).to(
                    device).requires_grad_()
                return op(rows, weight, target, **kw), rows
            return op(hidden, weight, target, **kw), None

        def backward(out, rows) -> None:
            out.backward(upstream)
            if rows is not None:  # the caller keeps its slice of the complete gradient
                hidden.grad = rows.grad[mine]
                rows.grad = None

        def fwd_bwd() -> None:
            backward(*forward())

        def backward_ms() -> float:
            outputs = forward()
            dist.barrier()
            runner.synchronize(device)
            t0 = time.perf_counter()
            backward(*outputs)
            runner.synchronize(device)
            return (time.perf_counter() - t0) * 1e3

        def step() -> float:
            dist.barrier()
            runner.synchronize(device)
            t0 = time.perf_counter()
            fwd_bwd()
            runner.synchronize(device)
            return (time.perf_counter() - t0) * 1e3

        for _ in range(args.warmup):
            step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        med = statistics.median(step() for _ in range(args.steps))
        bwd_med = statistics.median(backward_ms() for _ in range(args.steps))
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else -1.0
        # every rank starts each timed call together, as in a step
        host_thread, host_all = runner.host_us_threads(fwd_bwd, device, max(args.steps, 3),
                                                       before=dist.barrier)
        slowest_ms, peak_gib, host_thread, host_all, bwd_ms = max_over_ranks(
            [med, peak, host_thread, host_all, bwd_med], device, backend)
        return {"backend": backend, "steps": args.steps, "step_ms": round(slowest_ms, 3),
                "tflops_per_gpu": round(4 * 2 * n * d * v / world / (slowest_ms * 1e-3) / 1e12, 2),
                "peak_gib_per_rank": None if peak_gib < 0 else round(peak_gib, 3),
                "host_step_us": round(host_thread, 1), "host_step_all_us": round(host_all, 1),
                "bwd_ms": round(bwd_ms, 3),
                **({} if support_ids is None else
                   {"support_union": supports.union_size(support_ids)})}

    for i, variant in enumerate((None, *parse_variants(args.variants))):  # (the plain call first)
        for layout in args.layouts.split(","):
            row = measure(layout, variant)
            if rank == 0:
                with open(os.path.join(args.row_dir, f"{i}-{layout}.json"), "w") as f:
                    json.dump(row, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
