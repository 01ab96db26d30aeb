"""Tensor-parallel scaling of linear_logp: forward+backward of one shape at TP = 1, 2, 4, ... (strong scaling).

Launch once per TP degree with torchrun; every run appends one JSON line to ``--out``; ``--summarize`` prints the
table with the efficiency of each degree against the TP=1 line of the same file:

    for p in 1 2 4; do
      torchrun --standalone --nproc_per_node=$p benchmarks/bench_tp_scaling.py --shape 8192x4096x128256 --out results/tp_scaling.jsonl
    done
    python benchmarks/bench_tp_scaling.py --summarize results/tp_scaling.jsonl

Each rank holds the shard ``[start, end)`` of a ``V``-row bf16 LM head (even shards; ``--uneven`` for the runbook's
uneven layout) and the replicated ``[N, D]`` hidden states; a step is the op's forward and backward with a
per-token upstream gradient (``TPLOGP_CHECKS=fast`` unless ``--checks full``). Reported per degree: the median step
time of the slowest rank (ms), effective TFLOP/s per GPU (4 GEMMs of ``2 N D V / P`` FLOP each per rank), peak
allocator memory per rank (GiB), and efficiency ``T(1) / (P * T(P))``. NCCL with one GPU per rank when there are
enough GPUs, gloo on CPU otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import runner  # benchmarks/runner.py: shared commit helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def run(args) -> None:
    from tplogp import get_op
    from tplogp.shards import shard_boundaries, shard_range

    os.environ.setdefault("TPLOGP_CHECKS", args.checks)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus >= int(os.environ.get("LOCAL_WORLD_SIZE", world)) and gpus > 0 else "gloo"
    device = torch.device("cuda", local_rank) if backend == "nccl" else (
        torch.device("cuda", local_rank % gpus) if gpus else torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
    n, d, v = (int(x) for x in args.shape.split("x"))
    dt = DTYPES[args.dtype]
    start, end = shard_range(shard_boundaries(v, world, uneven=args.uneven), rank)
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(n, d, generator=g) * 0.5).to(dt).to(device).requires_grad_()
    target = torch.randint(0, v, (n,), generator=g).to(device)
    upstream = torch.randn(n, generator=g).to(device)
    wg = torch.Generator(device="cpu").manual_seed(100 + rank)
    weight = (torch.randn(end - start, d, generator=wg) / d ** 0.5).to(dt).to(device).requires_grad_()
    op = get_op("linear_logp", source=None if args.source == "registry" else args.source)
    group = dist.group.WORLD

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step() -> float:
        hidden.grad = weight.grad = None
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        out = op(hidden, weight, target, tp_group=group, vocab_start_index=start, global_vocab_size=v)
        (out * upstream).sum().backward()
        sync()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [step() for _ in range(args.steps)]
    med = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    comm = torch.device("cpu") if backend == "gloo" else device
    stats = torch.tensor([med, peak], dtype=torch.float64, device=comm)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if rank == 0:
        slowest_ms, peak_gib = stats.tolist()
        flop_per_rank = 4 * 2 * n * d * v / world
        row = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": runner.git_commit(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "backend": backend, "tp": world, "shape": args.shape, "dtype": args.dtype, "source": args.source,
            "uneven": args.uneven, "checks": os.environ["TPLOGP_CHECKS"], "steps": args.steps,
            "step_ms_slowest_rank": round(slowest_ms, 3),
            "tflops_per_gpu": round(flop_per_rank / (slowest_ms * 1e-3) / 1e12, 1),
            "peak_gib_per_rank": None if peak_gib != peak_gib else round(peak_gib, 3),  # None on CPU
        }
        print(json.dumps(row), flush=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


def summarize(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    base = {}
    for r in rows:
        if r["tp"] == 1:
            base[(r["shape"], r["dtype"], r["source"], r["device"])] = r["step_ms_slowest_rank"]
    print(f"{'shape':>18} {'dtype':>5} {'source':>8} {'TP':>3} {'step ms':>9} {'TFLOP/s/GPU':>12} "
          f"{'peak GiB':>9} {'efficiency':>10}")
    for r in rows:
        t1 = base.get((r["shape"], r["dtype"], r["source"], r["device"]))
        eff = f"{t1 / (r['tp'] * r['step_ms_slowest_rank']):.1%}" if t1 else "n/a"
        print(f"{r['shape']:>18} {r['dtype']:>5} {r['source']:>8} {r['tp']:>3} {r['step_ms_slowest_rank']:9.3f} "
              f"{r['tflops_per_gpu']:12.1f} {r['peak_gib_per_rank'] or float('nan'):9.3f} {eff:>10}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8192x4096x128256", help="N x D x V")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--source", choices=["registry", "native", "triton", "sm90"], default="registry")
    ap.add_argument("--uneven", action="store_true")
    ap.add_argument("--checks", choices=["full", "fast"], default="fast")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "tp_scaling.jsonl"))
    ap.add_argument("--summarize", metavar="JSONL", help="print the table of a results file and exit")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun (see the module docstring), or use --summarize")
    run(args)


if __name__ == "__main__":
    main()
