"""Where the host time of one forward+backward goes: stage stamps of ``linear_logp`` and
``linear_logp_loss``.

``python -m benchmarks.host_stages [--shape 4096x2048x8192] [--dtype bf16] [--rows default,loss]
[--source sm90] [--budget keep:1] [--calls 200] [--warmup 60]``

At small shapes a call waits on its host work: the GPU idles until the first kernel is enqueued, and
between two kernels whenever the host takes longer to enqueue the second than the GPU takes to run
the first. This tool says which part of the call path the host time goes to, without a profiler
(whose own overhead distorts exactly these microseconds).

Algorithm: for the run, each function of :data:`STAGES` is replaced by a wrapper that appends
``(stage, start, end)`` (``time.perf_counter``) to one list, on whichever thread runs it (on a GPU
autograd runs the backward on its own device thread). After ``--warmup`` calls, each of ``--calls``
calls starts from a synced device; its stamps, and the markers ``forward returned``, ``backward
returned`` and ``synced``, are taken relative to the call's start. Per stage the table gives the
median over calls of its first start and of its summed duration (a stage run twice in one call, two
launches say, sums), ordered by start. A wrapper costs about a microsecond per stage call, so the
totals read a little high. The wrappers are removed afterwards.

``default``: ``get_op("linear_logp", source=...)(h, w, y)`` then ``backward`` of a random per-token
gradient; ``loss``: ``linear_logp_loss`` with ``losses.cross_entropy()``, mean,
``with_entropy=False``, then ``backward()``; ``eager`` and ``eager-loss``: PyTorch's log_softmax +
gather and cross-entropy of the fp32 logits, for scale (their table holds the markers alone).
Without CUDA every Triton launch is a no-op that still takes the direct launcher's hot path
(:func:`benchmarks.host_noop.noop_launches`, under Triton's interpreter), so the CPU numbers are the
host path alone.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import time
from typing import Callable, Iterator, Optional

# (first: without CUDA it sets TRITON_INTERPRET before tplogp imports the kernels)
from .host_noop import noop_launches

import torch  # noqa: E402

from .op import make_problem  # noqa: E402
from .runner import DTYPES, parse_budget_spec  # noqa: E402

# (module, attribute path, stage label): functions looked up through that module attribute at call
# time, so a function imported by name into two modules is listed in both
STAGES = (
    ("tplogp.api", "_run", "api: _run"),
    ("tplogp.op.plan", "prepare", "plan.prepare"),
    ("tplogp.op.plan", "plan_call", "  plan.plan_call"),
    ("tplogp.op.plan", "check_layout", "    validation.check_layout"),
    ("tplogp.op.plan", "open_call", "  verdicts.open_call"),
    ("tplogp.op.local_call", "localize", "local_call.localize"),
    ("tplogp.op.tp", "shard_forward", "tp.shard_forward"),
    ("tplogp.op.tp", "_LinearLogpFunction.backward", "autograd node: linear_logp backward"),
    ("tplogp.op.tp", "shard_backward", "tp.shard_backward"),
    ("tplogp.fused_loss.loop", "fused_loss", "fused_loss: fused_loss"),
    ("tplogp.fused_loss.chunk_gradients", "token_loss_and_grads", "fused_loss: chunk loop"),
    ("tplogp.fused_loss.loop", "_PrecomputedGrads.backward", "autograd node: loss backward"),
    ("tplogp.fused_loss.loop", "scaled_all", "grad_scaling.scaled_all"),
    ("tplogp.backends.triton_backend", "TritonBackend.forward_single", "source: forward_single"),
    ("tplogp.backends.triton_backend", "TritonBackend.backward", "source: backward"),
    ("tplogp.backends.triton_layouts", "TritonLayouts._launch_layout", "  _launch_layout"),
    ("tplogp.backends.triton_layouts", "TritonLayouts._kept_buffer", "  _kept_buffer"),
    ("tplogp.kernels.forward_programs", "ForwardProgram.__call__", "program: forward"),
    ("tplogp.kernels.backward_programs", "launch_dlogits_kept", "launch: d_logits (kept)"),
    ("tplogp.kernels.backward_programs", "launch_dlogits", "launch: d_logits (recompute)"),
    ("tplogp.kernels.backward_programs", "mm_into", "GEMM into the input dtype"),
    ("tplogp.support.fp32_gemm", "mm_into", "GEMM into fp32"),
    ("tplogp.kernels.launch", "Launch.__call__", "  Launch (alignment + launch)"),
)


def _owner_and_name(module: str, path: str):
    owner = importlib.import_module(module)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name


@contextlib.contextmanager
def stamped(stages=STAGES, record: list = None) -> Iterator[list]:
    """Every stage wrapped so that each run appends ``(label, start, end)`` to the yielded list;
    restored after."""
    record = [] if record is None else record
    clock = time.perf_counter
    restore = []
    try:  # (a stage that cannot be found raises with every wrapper made so far removed)
        for module, path, label in stages:
            owner, name = _owner_and_name(module, path)
            raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw

            def wrapper(*args, _fn=fn, _label=label, **kwargs):
                t0 = clock()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    record.append((_label, t0, clock()))

            setattr(owner, name, staticmethod(wrapper) if isinstance(raw, staticmethod)
                    else wrapper)
            restore.append((owner, name, raw))
        yield record
    finally:
        for owner, name, raw in reversed(restore):
            setattr(owner, name, raw)


def calls(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device, source: str,
          workspace_bytes: Optional[int] = None) -> dict[str, Callable[[], tuple]]:
    """Per row, one call returning ``(output, upstream gradient or None)`` (module docstring);
    ``workspace_bytes`` goes to both tplogp rows."""
    import tplogp

    # the op suite's seeded problem
    hidden, weight, targets, upstream = make_problem(*shape, dtype, device)
    hidden.requires_grad_()
    weight.requires_grad_()
    op = tplogp.get_op("linear_logp", source=source)
    cross_entropy = tplogp.losses.cross_entropy()

    def loss():
        return tplogp.linear_logp_loss(hidden, weight, targets, loss=cross_entropy,
                                       reduction="mean",
                                       source=source, with_entropy=False,
                                       workspace_bytes=workspace_bytes), None

    def eager():
        logits = (hidden @ weight.t()).float()
        return torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1), upstream

    def eager_loss():
        return torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), targets), None

    def default():
        return op(hidden, weight, targets, workspace_bytes=workspace_bytes), upstream

    return {"default": default, "loss": loss, "eager": eager,
            "eager-loss": eager_loss, "_leaves": lambda: (hidden, weight)}


def stage_table(fn: Callable[[], tuple], leaves: tuple, device: torch.device, n_calls: int,
                warmup: int) -> list[tuple[str, float, float, int]]:
    """``[(stage, median first start µs, median summed duration µs, runs per call)]`` ordered by
    start, the markers included (module docstring)."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def one(record: list) -> dict:
        for leaf in leaves:
            leaf.grad = None
        sync()
        record.clear()
        t0 = time.perf_counter()
        out, upstream = fn()
        t1 = time.perf_counter()
        out.backward(upstream)
        t2 = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        seen: dict = {}
        for label, start, end in list(record):
            first, total, count = seen.get(label, (start, 0.0, 0))
            seen[label] = (min(first, start), total + end - start, count + 1)
        seen = {k: ((a - t0) * 1e6, b * 1e6, c) for k, (a, b, c) in seen.items()}
        for label, at in (("(forward returned)", t1), ("(backward returned)", t2),
                          ("(synced)", t3)):
            seen[label] = ((at - t0) * 1e6, 0.0, 1)
        return seen

    with stamped() as record:
        for _ in range(warmup):
            one(record)
        samples = [one(record) for _ in range(n_calls)]
    labels = {k for s in samples for k in s}
    rows = []
    for label in labels:
        got = [s[label] for s in samples if label in s]
        rows.append((label, statistics.median(g[0] for g in got),
                     statistics.median(g[1] for g in got),
                     round(statistics.median(g[2] for g in got))))
    return sorted(rows, key=lambda r: r[1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_stages",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="4096x2048x8192", help="NxDxV (default %(default)s)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--rows", default="default,loss,eager,eager-loss")
    parser.add_argument("--source", default=None, help="default: sm90 on Hopper, else triton")
    parser.add_argument("--budget", default="default",
                        help="workspace_bytes of the tplogp rows, as the suite's --budgets "
                             "entries: default, bytes, keep:F (the share F of the logits kept), "
                             "chunk:C")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=60)
    args = parser.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split("x"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    source = (args.source or ("sm90" if cuda and torch.cuda.get_device_capability() == (9, 0)
                              else "triton"))
    with contextlib.nullcontext() if cuda else noop_launches():
        budget = parse_budget_spec(args.budget)
        # type: ignore[arg-type]
        workspace_bytes = budget.resolve(source, shape, DTYPES[args.dtype], device)
        # type: ignore[arg-type]
        rows = calls(shape, DTYPES[args.dtype], device, source, workspace_bytes)
        leaves = rows.pop("_leaves")()
        for name in args.rows.split(","):
            table = stage_table(rows[name], leaves, device, args.calls, args.warmup)
            where = "" if cuda else ", kernel launches are no-ops"
            print(f"== {name}: {args.shape} {args.dtype} source={source} budget {budget.label} on "
                  f"{device}{where}; median of {args.calls} calls, µs from the call's start")
            print(f"  {'start':>8} {'duration':>9} {'runs':>4}  stage")
            for label, start, dur, runs in table:
                print(f"  {start:8.1f} {dur:9.1f} {runs:4d}  {label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
