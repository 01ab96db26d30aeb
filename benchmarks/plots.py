"""Pareto plots of the op benchmark: per shape and dtype, forward+backward time against extra
memory.

One point per implementation and budget (the latest row of each in the results file; the option
variants' rows, ``--variants``, stay in the tables): x = extra peak GiB (log scale), y =
forward+backward in GEMM-times, synced (filled) and back to back (hollow). Floors: 4 GEMMs from the
gradients' size on (nothing ``[T, V]`` kept), 3 GEMMs from gradients + one copy of the logits in the
input dtype on (logits kept, or a scalar loss known in the forward); the vertical line is the
gradients' size.
"""

from __future__ import annotations

import os
from typing import Iterable

from . import runner


def latest_op_rows(rows: Iterable[dict]) -> dict[tuple[str, str], list[dict]]:
    """``{(shape, dtype): [latest row per (device, impl, budget)]}`` over op rows of full
    (non-smoke, non-A/B) runs: a run on one GPU model does not hide another model's rows."""
    out: dict[tuple[str, str], list[dict]] = {}
    for r in runner.latest_rows(rows, "op", ("shape", "dtype", "device", "impl", "budget")):
        out.setdefault((r["shape"], r["dtype"]), []).append(r)
    return out


def plot_path(out_dir: str, shape: str, dtype: str) -> str:
    return os.path.join(out_dir, f"pareto_{shape}_{dtype}.png")


def plot_points(rows: list[dict]) -> list[dict]:
    """The rows a shape's plot draws: timed and measured, no variant, of one device (one point per
    implementation and budget): the device with the most such rows (the widest comparison), the
    newest on a tie."""
    pts = [r for r in rows if r.get("fwd_bwd_gemms") is not None
           and r.get("extra_peak_gib") is not None
           and r.get("variant") is None]
    by_device: dict[str, list[dict]] = {}
    for r in pts:
        by_device.setdefault(r.get("device"), []).append(r)
    return max(by_device.values(), key=lambda sel: (len(sel), max(r["date"] for r in sel)),
               default=[])


def pareto(rows: list[dict], path: str) -> bool:
    """Write the plot of one shape's rows to ``path`` (:func:`plot_points`); False (nothing written)
    without timed, measured rows."""
    pts = plot_points(rows)
    if not pts:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = pts[0]
    grads, logits = first["grads_gib"], first["logits_gib"]
    fig, ax = plt.subplots(figsize=(8, 5))
    xmax = max(max(r["extra_peak_gib"] for r in pts), grads + logits) * 1.6
    xmin = min(min(r["extra_peak_gib"] for r in pts), grads) / 1.6
    ax.hlines(4.0, grads, xmax, colors="k", linestyles="--", lw=0.9,
              label="floor: 4 GEMMs, nothing [T,V] kept")
    ax.hlines(3.0, grads + logits, xmax, colors="k", linestyles=":", lw=0.9,
              label="floor: 3 GEMMs, logits kept")
    ax.axvline(grads, color="0.6", lw=0.8, label="d_W + d_hidden")
    cmap = plt.get_cmap("tab10")
    names = sorted({r["impl"] for r in pts})
    labels: dict[tuple, list[str]] = {}  # points that coincide on the plot share one label
    for r in pts:
        color = cmap(names.index(r["impl"]) % 10)
        ax.plot(r["extra_peak_gib"], r["fwd_bwd_gemms"], "o", color=color)
        if r.get("fwd_bwd_gemms_b2b") is not None:
            ax.plot(r["extra_peak_gib"], r["fwd_bwd_gemms_b2b"], "o", mfc="none", color=color)
        spot = (r["impl"], round(r["extra_peak_gib"], 2), round(r["fwd_bwd_gemms"], 1))
        labels.setdefault(spot, []).append(r["budget"])
    for (impl, x, y), budgets in labels.items():
        text = impl if budgets == ["default"] else f"{impl} @ {', '.join(budgets)}"
        ax.annotate(text, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlim(xmin, xmax)
    ymax = max(max(r["fwd_bwd_gemms"] for r in pts), 4.5)
    ax.set_ylim(0, min(ymax * 1.1, 20))
    ax.set_xlabel("extra peak memory during forward+backward, GiB (inputs excluded, gradients "
                  "included)")
    ax.set_ylabel("fwd+bwd, GEMM-times (filled: synced, hollow: b2b)")
    ax.set_title(f"{first['shape']} (T x D x V), {first['dtype']}, {first.get('device', '')}",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_all(rows: list[dict], out_dir: str) -> list[str]:
    """Plots of every (shape, dtype) with measured rows, from the latest rows; returns the paths
    written."""
    written = []
    for (shape, dtype), sel in sorted(latest_op_rows(rows).items()):
        path = plot_path(out_dir, shape, dtype)
        if pareto(sel, path):
            written.append(path)
    return written
