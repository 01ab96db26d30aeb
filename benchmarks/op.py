"""Op benchmark: every implementation a user could pick, per shape, in one run, beside one cuBLAS
GEMM.

Per shape ``T x D x V`` (one device, seeded inputs, ``hidden * 0.5`` and ``W / sqrt(D)``) and per
implementation (:mod:`benchmarks.impls`; tplogp's sources once per ``workspace_bytes`` budget) one
row with:

* ``fwd_ms``, ``fwd_bwd_ms``: median milliseconds, synced, and ``*_b2b`` back to back
  (:mod:`benchmarks.runner`);
* ``fwd_gemms``, ``fwd_bwd_gemms`` (and ``*_b2b``): the same in *GEMM-times*, one GEMM = the ``[T,
  D] x [D, V]`` matmul in the input dtype (2 T D V FLOP), ``gemm_ms``. Each round times GEMM,
  forward, GEMM, forward+backward, every timing after a sustained warm-up of the function itself
  (``--warm-ms``), and divides each time by the GEMM timed just before it; a GEMM-time is the median
  over rounds, and the implementations are interleaved within a round in a rotating order, so clock
  and power drift fall on all of them alike. The GEMM is always timed back to back (its GPU time),
  so both columns share one unit and differ only by the op's own host overhead: a synced GEMM would
  add one launch latency to the unit (0.24-0.28 against 0.20-0.21 ms at 4096x2048x8192 on an H200)
  and so shrink the synced column at small shapes;
* ``host_fwd_us``, ``host_fwd_bwd_us``: host CPU microseconds per call
  (:func:`benchmarks.runner.host_us`: the calling thread's CPU time, synced before and after each
  call), on CPU and GPU alike: what a call costs the host (Python, dispatch, launches), which bounds
  the op at small shapes where the GPU work is shorter; on a GPU the backward's functions run on
  autograd's device thread and are not counted (a lower bound there); ``host_fwd_bwd_all_us``: over
  the same calls, the process's CPU time per forward+backward, every thread (autograd's device
  thread included): the whole host cost of a call on a GPU;
* ``checks``: the ``TPLOGP_CHECKS`` mode of the row; tplogp's rows are repeated per mode of
  ``--checks`` (the label of a mode other than ``full`` ends with ``checks <mode>``); the other
  implementations do not read the mode: one row each, labelled with the default (``full``);
* ``extra_peak_gib``: allocator peak during one forward+backward above the inputs (gradients
  included);
* ``err_logp`` (per-token contract) or ``err_loss`` (scalar and policy losses), ``err_d_hidden``,
  ``err_d_weight``: ``||x - x_fp64|| / ||x_fp64||`` against a float64 autograd reference, with the
  same upstream gradient (a random ``[T]`` vector, or 1 for a loss): the float64 logp, the mean
  cross-entropy, or the policy loss's own definition (:func:`benchmarks.policy.eager_loss` of the
  float64 logp);
* ``vs_cross_entropy`` (and ``_b2b``), tplogp's policy-loss rows (:mod:`benchmarks.policy`: a GSPO
  and a DAPO step): forward+backward milliseconds over those of the plain fused cross-entropy
  (``tplogp-loss-<source>``) at the same budget, timed in the same rounds; present when both rows
  ran;
* ``variant`` and ``vs_plain`` (and ``_b2b``), the rows ``--variants`` adds
  (:mod:`benchmarks.variants`: softcap, a deterministic level, label smoothing and z-loss): one per
  tplogp row and variant that applies to it, its budget label ending with the variant's; its errors
  against the float64 truth of its own math; its forward+backward milliseconds over the same call's
  without the variant (same implementation, budget and checks mode), timed in the same rounds, next
  to it in the rotating order;
* ``logit_std``, ``support_mean``, ``support_max``, a sampler variant's rows (``top_k=`` /
  ``top_p=`` / ``min_p=``): the spread its logits were scaled to (None: the problem's own), and
  the mean and largest size of its supports over the first 256 tokens (printed as ``support N (max
  M)``);
* ``support``, ``support_k``, ``support_union``, a ``support=`` variant's rows: the support's label,
  its ids per token and the number of distinct ids of all tokens' supports together (printed as
  ``union N``); the supports are built once per shape before any timing
  (:mod:`benchmarks.supports`), the errors measured against the float64 truth renormalized over
  them;
* ``contract``; ``error`` instead of numbers when the implementation could not be built or run.

Floors for the plots (one GEMM is 2TDV FLOP): a per-token op keeping O(T) state needs 4 GEMMs
forward+backward (forward, recompute, d_hidden, d_W); 3 when the ``[T, V]`` logits (``logits_gib``)
are kept from the forward or the loss is a scalar known in the forward. ``grads_gib`` (d_W +
d_hidden) is the memory no implementation avoids.

Peers are optional imports pinned in benchmarks/requirements-peers.txt. nvidia-cutlass-dsl (Liger's
CuTe kernel, QuACK) is a ``.pth``-based package: installed with ``pip install --target DIR``, its
``.pth`` file is not read, so put both ``DIR`` and ``DIR/nvidia_cutlass_dsl/dsl_packages`` on
``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
from typing import Callable, NamedTuple, Optional

import torch

from . import policy, runner, supports
from .impls import PER_TOKEN, POLICY_LOSS, SCALAR_LOSS, Impl, ImplUnavailable
from .variants import Variant, float64_cross_entropy

DTYPES = runner.DTYPES
MODES = (("", False), ("_b2b", True))


def make_problem(T: int, D: int, V: int, dtype: torch.dtype, device: torch.device):
    """Seeded (hidden, weight, targets, upstream gradient) on ``device``."""
    g = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(T, D, device=device, generator=g) * 0.5).to(dtype)
    w = (torch.randn(V, D, device=device, generator=g) / D**0.5).to(dtype)
    y = torch.randint(0, V, (T,), device=device, generator=g)
    gy = torch.randn(T, device=device, generator=g)
    return h, w, y, gy


def scaled_hidden(h: torch.Tensor, w: torch.Tensor, std: float, tokens: int = 256) -> torch.Tensor:
    """``h`` scaled so the logits ``h w^T`` have standard deviation ``std`` (measured over the first
    ``tokens`` rows, fp32)."""
    from tplogp.testing.reference import reference_logits

    now = reference_logits(h[:tokens], w).std()
    return (h.float() * (std / now)).to(h.dtype)


def support_sizes(h: torch.Tensor, w: torch.Tensor, variant: Variant,
                  tokens: int = 256) -> tuple[float, int]:
    """The mean and the largest number of ids a sampler variant's support keeps, over the first
    ``tokens`` rows of ``h`` (their whole fp32 logits with the variant's softcap, the float64
    definition of ``tplogp.testing.reference.sampler_mask``)."""
    from tplogp.testing.reference import reference_logits, sampler_mask

    logits = reference_logits(h[:tokens], w, softcap=variant.softcap)
    kept = sampler_mask(logits, top_k=variant.top_k, top_p=variant.top_p,
                        min_p=variant.min_p).sum(-1)
    return float(kept.double().mean()), int(kept.max())


class Float64Stats(NamedTuple):
    """A problem's float64 per-token statistics ``[T]`` (differentiable) and its vocabulary size."""

    logp: torch.Tensor
    lse: torch.Tensor
    sum_z: torch.Tensor
    vocab: int


def float64_truth(h, w, y, gy, scalars: dict[str, Callable[[Float64Stats], torch.Tensor]], *,
                  softcap: Optional[float] = None, per_token: bool = True,
                  support: Optional[torch.Tensor] = None) -> dict:
    """The float64 truth of the problem with logits ``cap(h @ w.T)`` (``softcap``; None: no cap):
    with ``per_token``, the logp and its d_hidden / d_W for the per-token upstream ``gy``; per entry
    of ``scalars`` (a name and its loss as a function of the float64 statistics,
    :class:`Float64Stats`) the loss ``loss:<name>`` and its ``dh:<name>`` / ``dw:<name>``. With a
    padded ``support`` ``[T, K]`` the distribution is renormalized over each token's ids (the
    definition of ``tplogp.testing.reference.reference_support_outputs``: ``lse`` over the support's
    logits, the others masked by its ``support_mask``; ``sum_z`` stays the whole vocabulary's)."""
    from tplogp.reference import reference_logits

    hd = h.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    logits = reference_logits(hd, wd, mode="float64", softcap=softcap)
    if support is None:
        lse = torch.logsumexp(logits, -1)
    else:
        from tplogp.testing.reference import support_mask

        lse = torch.logsumexp(logits.masked_fill(~support_mask(support, w.shape[0]), -math.inf), -1)
    stats = (logits.gather(1, y[:, None])[:, 0] - lse, lse, logits.sum(-1))
    del logits
    truth = {}
    if per_token:
        truth["logp"] = stats[0].detach()
        truth["dh"], truth["dw"] = torch.autograd.grad(stats[0], (hd, wd), gy.double(),
                                                       retain_graph=bool(scalars))
    for i, (name, loss_of) in enumerate(scalars.items()):
        leaves = [x.detach().requires_grad_() for x in stats]
        with torch.enable_grad():
            value = loss_of(Float64Stats(*leaves, vocab=w.shape[0]))
            grads = torch.autograd.grad(value, leaves, allow_unused=True)
        used = [(x, g) for x, g in zip(stats, grads) if g is not None]
        truth["loss:" + name] = value.detach()
        truth["dh:" + name], truth["dw:" + name] = torch.autograd.grad(
            [x for x, _ in used], (hd, wd), [g for _, g in used], retain_graph=i + 1 < len(scalars))
    return truth


def truth_key(impl: Impl, variant: Optional[Variant] = None) -> Optional[str]:
    """The :func:`float64_truth` loss an implementation (with a variant's options) is measured
    against (None: the per-token logp)."""
    if impl.contract == PER_TOKEN:
        return None
    if impl.contract == SCALAR_LOSS:
        return ("ce" if variant is None or not variant.loss_terms
                else f"ce:{variant.label_smoothing}:{variant.z_loss}")
    return impl.policy


def math_key(variant: Optional[Variant]) -> tuple:
    """The options of a variant that change the per-token statistics: (softcap, support)."""
    return (None, None) if variant is None else (variant.softcap, variant.support)


def _truths(h, w, y, gy, plans, inputs, support_ids: dict) -> dict:
    """``{math_key: float64_truth}`` of every math the planned ``(impl, variant)`` rows are
    measured against (``support_ids``: the padded support of each support label)."""
    needs: dict[tuple, dict] = {}
    for impl, variant in plans:
        if variant is not None and variant.samples:  # (timed only: benchmarks.variants)
            continue
        need = needs.setdefault(math_key(variant), {"per_token": False, "scalars": {}})
        key = truth_key(impl, variant)
        if key is None:
            need["per_token"] = True
        elif impl.contract == POLICY_LOSS:
            need["scalars"][key] = (lambda s, name=key: policy.eager_loss(
                name, s.logp.view(inputs.layout), inputs.advantages, inputs.old_logp))
        else:
            smoothing, z = ((0.0, 0.0) if variant is None
                            else (variant.label_smoothing, variant.z_loss))
            need["scalars"][key] = lambda s, smoothing=smoothing, z=z: float64_cross_entropy(
                s, smoothing, z)
    # kept in host memory when there are several: each holds a float64 d_W (4 GiB at 128256 x 4096)
    host = len(needs) > 1
    truths = {}
    for (cap, sup), need in needs.items():
        truth = float64_truth(h, w, y, gy, dict(sorted(need["scalars"].items())), softcap=cap,
                              per_token=need["per_token"], support=support_ids.get(sup))
        truths[cap, sup] = {k: v.cpu() for k, v in truth.items()} if host else truth
        del truth
    return truths


def cross_entropy_pair(row: dict) -> Optional[tuple]:
    """The (impl, budget, checks) of the plain fused cross-entropy row a tplogp policy-loss row is
    compared with: the same source, budget and checks mode (None for an eager policy row)."""
    if row["contract"] != POLICY_LOSS or not row["impl"].startswith("tplogp-"):
        return None
    return f"tplogp-loss-{row['impl'].rsplit('-', 1)[1]}", row["budget"], row["checks"]


def plain_pair(row: dict) -> Optional[tuple]:
    """The (impl, budget, checks) of the row a variant row is compared with: the same call without
    the variant (None for a row without one)."""
    if row.get("variant") is None:
        return None
    return row["impl"], row["budget"].removesuffix(", " + row["variant"]), row["checks"]


# the ratio columns of forward+backward milliseconds (``<name>`` synced, ``<name>_b2b``) and the row
# each is over
RATIOS = (("vs_cross_entropy", cross_entropy_pair), ("vs_plain", plain_pair))


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    # the measured tree's tplogp (imported at run time, --base)
    from tplogp.tolerances import rel_error

    return rel_error(x, ref.to(x.device))


@contextlib.contextmanager
def checks_mode(mode: str):
    """``TPLOGP_CHECKS=mode`` while the block runs (tplogp reads it at each call), then as it
    was."""
    before = os.environ.get("TPLOGP_CHECKS")
    os.environ["TPLOGP_CHECKS"] = mode
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TPLOGP_CHECKS", None)
        else:
            os.environ["TPLOGP_CHECKS"] = before


def bench_shape(shape: tuple[int, int, int], impls: list[Impl], budgets: list[runner.BudgetSpec],
                dtype: str,
                device: torch.device, *, reps: int, rounds: int, warm_ms: float, check: bool,
                checks: tuple[str, ...] = ("full",), variants: tuple[Variant, ...] = (),
                device_profile: bool = False) -> list[dict]:
    """The rows of one shape (module docstring). ``checks``: the ``TPLOGP_CHECKS`` modes of tplogp's
    (budgeted) rows; every other implementation runs once, under ``full``. ``variants``: each adds a
    row beside every tplogp row it applies to (:mod:`benchmarks.variants`). ``device_profile``:
    each timed row also gets one profiled forward+backward's device time and top kernels
    (:func:`benchmarks.runner.device_profile`; CUDA only)."""
    T, D, V = shape
    h, w, y, gy = make_problem(T, D, V, DTYPES[dtype], device)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    size = h.element_size()
    common = dict(suite="op", shape=runner.shape_label(shape), T=T, D=D, V=V, dtype=dtype,
                  grads_gib=(V * D + T * D) * size / 2**30, logits_gib=T * V * size / 2**30,
                  reps=reps, rounds=rounds, warm_ms=warm_ms)

    def gemm():
        return h @ w.T

    def timed(fn, b2b):
        return runner.median_ms(fn, device, reps=reps, warmup=3 if reps >= 3 else 1,
                                warm_ms=warm_ms, back_to_back=b2b)

    # per implementation, budget and checks mode: the plain call, then each variant that applies to
    # it
    plans = [(impl, spec, mode, variant) for impl in impls
             for spec in (budgets if impl.budgeted else [runner.BudgetSpec("default")])
             for mode in (checks if impl.budgeted else ("full",))
             for variant in (None, *(v for v in variants if v.applies_to(impl)))]
    inputs = policy.make_inputs(h, w, y) if any(i.contract == POLICY_LOSS for i in impls) else None
    # each support variant's ids, built once before any timing (benchmarks.supports)
    support_ids = {v.support: supports.make_support(y, V, v.support_k, v.support_kind)
                   for *_, v in plans if v is not None and v.support is not None}
    unions = {label: supports.union_size(ids) for label, ids in support_ids.items()}
    truths = (_truths(h, w, y, gy, {(impl, variant) for impl, _, _, variant in plans}, inputs,
                      support_ids) if check else None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows, live, truth = [], [], None
    for impl, spec, mode, variant in plans:
        label = spec.label if mode == "full" else f"{spec.label}, checks {mode}"
        row = dict(common, impl=impl.name, contract=impl.contract, budget=label,
                   budget_bytes=spec.nbytes,
                   checks=mode)
        if variant is not None:
            row.update(budget=f"{label}, {variant.label}", variant=variant.label)
        support = None if variant is None else support_ids.get(variant.support)
        if support is not None:
            row.update(support=variant.support, support_k=support.shape[1],
                       support_union=unions[variant.support])
        # a sampler variant: its logits' spread (logit_std) and its supports' sizes
        h_row, hg_row = h, hg
        if variant is not None and variant.samples:
            if variant.logit_std is not None:
                h_row = scaled_hidden(h, w, variant.logit_std)
                hg_row = h_row.clone().requires_grad_()
            mean, most = support_sizes(h_row, w, variant)
            row.update(logit_std=variant.logit_std, support_mean=round(mean, 1), support_max=most)
        rows.append(row)
        try:
            budget = row["budget_bytes"] = spec.resolve(impl.source, shape, DTYPES[dtype], device)
            fn = (impl.build(device, budget) if variant is None
                  else impl.build(device, budget, variant=variant) if support is None
                  else impl.build(device, budget, variant=variant, support=support))
            if impl.contract == POLICY_LOSS:
                fn = functools.partial(fn, inputs=inputs)
        except ImplUnavailable as exc:
            row["error"] = f"unavailable: {exc}"
            continue
        # a peer that breaks while building is a result, not a crash of the run
        except Exception as exc:
            row["error"] = f"build: {type(exc).__name__}: {str(exc)[:300]}"
            continue
        per_token = impl.contract == PER_TOKEN

        def fwd(fn=fn, h=h_row):
            with torch.no_grad():
                return fn(h, w, y)

        def fwd_bwd(fn=fn, per_token=per_token, hg=hg_row):
            out = fn(hg, wg, y)
            out.backward(gy if per_token else None)
            hg.grad = wg.grad = None

        try:
            with checks_mode(mode):
                if variant is not None and variant.samples:
                    row["errors"] = ("not measured: the sampler's support holds few of the random "
                                     "targets (tests/op/test_sampler_support.py checks it)")
                elif truths is not None:
                    truth = truths[math_key(variant)]
                    out = fn(hg, wg, y)
                    out.backward(gy if per_token else None)
                    key = truth_key(impl, variant)
                    if key is None:
                        row["err_logp"] = _rel(out.float(), truth["logp"])
                    else:
                        row["err_loss"] = _rel(out.float().reshape(()), truth["loss:" + key])
                    row["err_d_hidden"] = _rel(hg.grad, truth["dh" if key is None else "dh:" + key])
                    row["err_d_weight"] = _rel(wg.grad, truth["dw" if key is None else "dw:" + key])
                    hg.grad = wg.grad = None
                    del out
            live.append((row, fwd, fwd_bwd, {}))
        except Exception as exc:
            hg.grad = wg.grad = None
            row["error"] = f"run: {type(exc).__name__}: {str(exc)[:300]}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del truths, truth, support_ids
    for i_round in range(rounds):
        k = i_round % len(live) if live else 0
        for row, fwd, fwd_bwd, samples in live[k:] + live[:k]:
            if "error" in row:
                continue
            try:
                with checks_mode(row["checks"]):
                    for key, b2b in MODES:
                        # the unit: the GEMM's GPU time in both modes (module docstring)
                        g1 = timed(gemm, True)
                        f_ms = timed(fwd, b2b)
                        g2 = timed(gemm, True)
                        fb_ms = timed(fwd_bwd, b2b)
                        samples.setdefault("gemm", []).extend((g1, g2))
                        for name, value in (("fwd", f_ms), ("fwd_bwd", fb_ms), ("fwd_r", f_ms / g1),
                                            ("fwd_bwd_r", fb_ms / g2)):
                            samples.setdefault(name + key, []).append(value)
                    samples.setdefault("host_fwd", []).append(runner.host_us(fwd, device, reps))
                    thread_us, all_us = runner.host_us_threads(fwd_bwd, device, reps)
                    samples.setdefault("host_fwd_bwd", []).append(thread_us)
                    samples.setdefault("host_fwd_bwd_all", []).append(all_us)
            except Exception as exc:
                hg.grad = wg.grad = None
                row["error"] = f"timing: {type(exc).__name__}: {str(exc)[:300]}"
    med = statistics.median
    for row, fwd, fwd_bwd, samples in live:
        if "error" in row or not samples:
            continue
        try:
            with checks_mode(row["checks"]):
                peak = runner.extra_peak_gib(fwd_bwd, device)
        except Exception as exc:
            row["error"] = f"memory: {type(exc).__name__}: {str(exc)[:300]}"
            continue
        row["gemm_ms"] = round(med(samples["gemm"]), 4)
        for key, _ in MODES:
            row.update({f"fwd_ms{key}": round(med(samples["fwd" + key]), 4),
                        f"fwd_bwd_ms{key}": round(med(samples["fwd_bwd" + key]), 4),
                        f"fwd_gemms{key}": round(med(samples["fwd_r" + key]), 3),
                        f"fwd_bwd_gemms{key}": round(med(samples["fwd_bwd_r" + key]), 3)})
        row["host_fwd_us"] = round(min(samples["host_fwd"]), 1)  # the least loaded round's median
        least = min(range(len(samples["host_fwd_bwd"])), key=samples["host_fwd_bwd"].__getitem__)
        row["host_fwd_bwd_us"] = round(samples["host_fwd_bwd"][least], 1)
        # (the same round's)
        row["host_fwd_bwd_all_us"] = round(samples["host_fwd_bwd_all"][least], 1)
        row["gemm_samples_ms"] = [round(x, 4) for x in samples["gemm"]]
        row["extra_peak_gib"] = None if peak is None else round(peak, 4)
        profiled = None
        if device_profile:
            with checks_mode(row["checks"]):
                profiled = runner.device_profile(fwd_bwd, device)
        if profiled is not None:
            row["device_fwd_bwd_ms"], row["device_top"] = round(profiled[0], 3), profiled[1]
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _ratios(rows)
    return rows


def _ratios(rows: list[dict]) -> None:
    """Each :data:`RATIOS` column (synced, and ``_b2b``) of each timed row that has its other row:
    the row's forward+backward milliseconds over the other's, both timed in the same rounds
    (``vs_cross_entropy``: a tplogp policy-loss row over the plain fused cross-entropy at the same
    source, budget and checks mode, :func:`cross_entropy_pair`; ``vs_plain``: a variant row over the
    same call without it, :func:`plain_pair`)."""
    by_key = {(r["impl"], r["budget"], r["checks"]): r for r in rows}
    for name, pair_of in RATIOS:
        for r in rows:
            pair = pair_of(r)
            other = None if pair is None else by_key.get(pair)
            if other is None or "fwd_bwd_ms" not in r or "fwd_bwd_ms" not in other:
                continue
            for key in ("", "_b2b"):
                r[name + key] = round(r["fwd_bwd_ms" + key] / other["fwd_bwd_ms" + key], 4)


def format_row(r: dict) -> str:
    with_budget = r.get("budget_bytes") is not None or r["impl"].startswith("tplogp")
    label = f"{r['impl']}@{r['budget']}" if with_budget else r["impl"]
    union = "" if r.get("support_union") is None else f" | union {r['support_union']}"
    if r.get("support_mean") is not None:
        union = f" | support {r['support_mean']:.0f} (max {r['support_max']})"
    if "error" in r:
        return f"{r['shape']:>18} {label:>26}{union} | {r['error']}"
    if "fwd_ms" not in r:
        return f"{r['shape']:>18} {label:>26} | not timed"
    errs = " ".join(f"{k[4:]}={r[k]:.1e}"
                    for k in ("err_logp", "err_loss", "err_d_hidden", "err_d_weight") if k in r)
    mem = "" if r.get("extra_peak_gib") is None else f" | {r['extra_peak_gib']:.3f} GiB"
    host = "" if r.get("host_fwd_bwd_us") is None else f" | host {r['host_fwd_bwd_us']:7.1f} us"
    if r.get("host_fwd_bwd_all_us") is not None:
        host += f" (all threads {r['host_fwd_bwd_all_us']:.1f})"
    vs = "".join(f" | x {what} {r[name]:.3f} (b2b {r[name + '_b2b']:.3f})"
                 for name, what in (("vs_cross_entropy", "CE"), ("vs_plain", "plain"))
                 if r.get(name) is not None)
    busy = ""
    if r.get("device_fwd_bwd_ms") is not None:  # (--device-profile)
        busy = (f" | device {r['device_fwd_bwd_ms']:.1f} ms: "
                + ", ".join(f"{name[:28]} {ms:.1f}" for name, ms, _ in r["device_top"][:4]))
    return (f"{r['shape']:>18} {label:>26}{union} | fwd {r['fwd_ms']:9.3f} ms "
            f"{r['fwd_gemms']:5.2f} G | "
            f"fwd+bwd {r['fwd_bwd_ms']:9.3f} ms {r['fwd_bwd_gemms']:5.2f} G (b2b "
            f"{r['fwd_bwd_gemms_b2b']:5.2f} G){host}{mem}{vs}{busy} | {errs}")
