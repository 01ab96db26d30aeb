"""Comparison against the reference, merged over ranks, and the per-metric PASS/FAIL lines."""

from __future__ import annotations

import torch

from .launch import log0, max_over_ranks


def compare(ours: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> tuple[float, float, float]:
    """(max_abs, max_rel, passed): max_rel = max |d| / max(|ref|, 1e-6); passed
    iff |d| <= atol + rtol |ref| everywhere and ``ours`` is finite."""
    d = (ours.double() - ref.double()).abs()
    r = ref.double().abs()
    max_abs = float(d.max()) if d.numel() else 0.0
    max_rel = float((d / r.clamp_min(1e-6)).max()) if d.numel() else 0.0
    ok = bool(torch.all(d <= atol + rtol * r) and torch.isfinite(ours).all())
    return max_abs, max_rel, 1.0 if ok else 0.0


def report_checks(checks: list, atol: float, rtol: float, rank: int, device: torch.device,
                  backend: str) -> bool:
    """Compare every (name, ours, ref), take the max error and the min verdict over ranks; rank 0
    prints."""
    flat = []
    for _, ours, ref in checks:
        max_abs, max_rel, passed = compare(ours, ref, atol, rtol)
        flat += [max_abs, max_rel, 1.0 - passed]  # min over ranks of the pass flag, as a max
    merged = max_over_ranks(flat, device, backend)
    ok_all = True
    for i, (name, _, _) in enumerate(checks):
        max_abs, max_rel, failed = merged[3 * i: 3 * i + 3]
        ok_all &= not failed
        log0(rank,
             f"  {'FAIL' if failed else 'PASS'} {name}: max_abs={max_abs:.6g}, max_rel={max_rel:.6g}")
    log0(rank, "")
    return ok_all
