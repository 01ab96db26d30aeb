"""Runbook validation of the tensor-parallel linear_logp path (launch with torchrun; not collected by pytest).

    torchrun --standalone --nproc_per_node=4 tests/linear_logp_tp.py --dtype fp32 --tokens 128 \
        --hidden-size 256 --vocab-size 4096 --uneven-shards

Phase ``correctness`` builds the full weight on every rank (same seed), gives each rank its shard
``weight[start:end]``, runs the op with a random per-token upstream gradient and compares the output, ``hidden.grad``
and the local ``weight.grad`` / ``bias.grad`` against a materialized full-vocab reference (``--reference-mode``).
Phase ``stress`` (``--run-stress``) runs a larger shape where each rank only ever holds its shard, and reports
finiteness, the first step and the warmed median step time (max over ranks), and peak memory (GPU: allocator peak;
CPU: resident growth). Exit status is non-zero on any FAIL.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

from tplogp import get_op
from tplogp.reference import reference_outputs
from tplogp.shards import shard_boundaries, shard_range
from tplogp.tolerances import RUNBOOK_TOLERANCES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IGNORE_INDEX = -100


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = p.parse_args(argv)
    tol = RUNBOOK_TOLERANCES[DTYPES[args.dtype]]
    args.atol = tol.atol if args.atol is None else args.atol
    args.rtol = tol.rtol if args.rtol is None else args.rtol
    if not 0.0 <= args.ignore_fraction <= 1.0:
        p.error("--ignore-fraction must be in [0, 1]")
    return args


def setup_distributed(args) -> tuple[int, int, torch.device, str]:
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --standalone --nproc_per_node=4 tests/linear_logp_tp.py")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if n_gpus >= local_world and n_gpus > 0 else "gloo"
    if backend == "nccl":
        if n_gpus < local_world:
            raise SystemExit(f"--backend nccl needs one GPU per rank: {local_world} local ranks, {n_gpus} GPUs "
                             f"(use --backend gloo to share GPUs)")
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cuda", local_rank % n_gpus) if n_gpus > 0 else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=args.timeout_s),
                            **({"device_id": device} if backend == "nccl" else {}))
    return rank, world, device, backend


def log0(rank: int, *lines: str) -> None:
    if rank == 0:
        for line in lines:
            print(line, flush=True)


def max_over_ranks(values: list[float], device: torch.device, backend: str) -> list[float]:
    comm = device if backend == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=comm)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def make_targets(gen: torch.Generator, tokens: int, vocab: int, ignore_fraction: float, device) -> torch.Tensor:
    tgt = torch.randint(0, vocab, (tokens,), generator=gen)
    if ignore_fraction > 0:
        drop = torch.rand(tokens, generator=gen) < ignore_fraction
        tgt = torch.where(drop, torch.full_like(tgt, IGNORE_INDEX), tgt)
    return tgt.to(device)


def op_kwargs(args, start: int, vocab: int) -> dict:
    kw = dict(tp_group=dist.group.WORLD, vocab_start_index=start, global_vocab_size=vocab)
    if args.temperature != 1.0:
        kw["temperature"] = args.temperature
    if args.entropy:
        kw["return_entropy"] = True
    if args.ignore_fraction > 0:
        kw["ignore_index"] = IGNORE_INDEX
    return kw


def compare(name, ours, ref, atol, rtol) -> tuple[float, float, float]:
    """(max_abs, max_rel, passed): max_rel = max |d| / max(|ref|, 1e-6); pass iff |d| <= atol + rtol |ref| everywhere."""
    d = (ours.double() - ref.double()).abs()
    r = ref.double().abs()
    max_abs = float(d.max()) if d.numel() else 0.0
    max_rel = float((d / r.clamp_min(1e-6)).max()) if d.numel() else 0.0
    ok = bool(torch.all(d <= atol + rtol * r) and torch.isfinite(ours).all())
    return max_abs, max_rel, 1.0 if ok else 0.0


def correctness(args, rank, world, device, backend, op) -> bool:
    dtype = DTYPES[args.dtype]
    T, D, V = args.tokens, args.hidden_size, args.vocab_size
    bounds = shard_boundaries(V, world, uneven=args.uneven_shards)
    start, end = shard_range(bounds, rank)
    gen = torch.Generator().manual_seed(args.seed)
    hidden_full = (torch.randn(T, D, generator=gen) * 0.5).to(dtype)
    weight_full = (torch.randn(V, D, generator=gen) / D ** 0.5).to(dtype)
    bias_full = None if args.no_bias else (torch.randn(V, generator=gen) * 0.1).to(dtype)
    target = make_targets(gen, T, V, args.ignore_fraction, device)
    g_logp = torch.randn(T, generator=gen).to(device)
    g_ent = torch.randn(T, generator=gen).to(device)

    log0(rank, "[correctness]",
         f"  dtype={dtype}, reference_mode={args.reference_mode}, atol={args.atol:g}, rtol={args.rtol:g}",
         f"  tokens={T}, hidden={D}, vocab={V}",
         f"  shard_boundaries={bounds}",
         *( [f"  source={args.op_source}, backend={backend}, device={device.type}, world_size={world}"]),
         *([f"  temperature={args.temperature:g}"] if args.temperature != 1.0 else []),
         *([f"  ignore_fraction={args.ignore_fraction:g}"] if args.ignore_fraction > 0 else []))

    # ours: this rank's shard only
    h = hidden_full.to(device).clone().requires_grad_()
    w = weight_full[start:end].to(device).clone().requires_grad_()
    b = None if bias_full is None else bias_full[start:end].to(device).clone().requires_grad_()
    out = op(h, w, target, b, **op_kwargs(args, start, V))
    logp, ent = (out.logp, out.entropy) if args.entropy else (out, None)
    loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if ent is not None else 0.0)
    loss.backward()

    # reference: the full vocabulary, materialized
    hr = hidden_full.to(device).clone().requires_grad_()
    wr = weight_full.to(device).clone().requires_grad_()
    br = None if bias_full is None else bias_full.to(device).clone().requires_grad_()
    ref = reference_outputs(hr, wr, target, br, mode=args.reference_mode, temperature=args.temperature,
                            ignore_index=IGNORE_INDEX if args.ignore_fraction > 0 else None)
    ref_loss = (ref.logp * g_logp).sum() + ((ref.entropy * g_ent).sum() if ent is not None else 0.0)
    ref_loss.backward()

    checks = [("output", logp.detach(), ref.logp.detach())]
    if ent is not None:
        checks.append(("entropy", ent.detach(), ref.entropy.detach()))
    checks += [("hidden_grad", h.grad, hr.grad), ("weight_grad", w.grad, wr.grad[start:end])]
    if b is not None:
        checks.append(("bias_grad", b.grad, br.grad[start:end]))
    local = []
    for name, ours, r in checks:
        local += compare(name, ours, r, args.atol, args.rtol)
    # max over ranks of errors; min over ranks of the pass flag (as max of 1 - pass)
    flat = []
    for i in range(len(checks)):
        flat += [local[3 * i], local[3 * i + 1], 1.0 - local[3 * i + 2]]
    merged = max_over_ranks(flat, device, backend)
    ok_all = True
    for i, (name, _, _) in enumerate(checks):
        max_abs, max_rel, failed = merged[3 * i: 3 * i + 3]
        verdict = "FAIL" if failed else "PASS"
        ok_all &= not failed
        log0(rank, f"  {verdict} {name}: max_abs={max_abs:.6g}, max_rel={max_rel:.6g}")
    log0(rank, "")
    return ok_all


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


def stress(args, rank, world, device, backend, op) -> bool:
    dtype = DTYPES[args.dtype]
    T, D, V = args.stress_tokens, args.stress_hidden_size, args.stress_vocab_size
    bounds = shard_boundaries(V, world, uneven=args.uneven_shards)
    start, end = shard_range(bounds, rank)
    log0(rank, "[stress]", f"  dtype={dtype}, tokens={T}, hidden={D}, vocab={V}, steps={args.stress_steps}",
         f"  shard_boundaries={bounds}")
    gen = torch.Generator().manual_seed(args.seed + 1)
    hidden = (torch.randn(T, D, generator=gen) * 0.5).to(dtype).to(device)  # replicated: same seed
    target = make_targets(gen, T, V, args.ignore_fraction, device)
    g_logp = torch.randn(T, generator=gen).to(device)
    wgen = torch.Generator().manual_seed(args.seed + 100 + rank)  # shard only, never the full weight
    weight = (torch.randn(end - start, D, generator=wgen) / D ** 0.5).to(dtype).to(device)
    bias = None if args.no_bias else (torch.randn(end - start, generator=wgen) * 0.1).to(dtype).to(device)
    h = hidden.requires_grad_()
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
        finite &= bool(torch.isfinite(logp).all() and torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
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


def main(argv=None) -> int:
    args = parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
