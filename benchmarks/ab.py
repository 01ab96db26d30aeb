"""A/B against another commit: the same measurement on this tree and on ``REV``, interleaved, with
per-row ratios.

``REV`` is checked out into a temporary git worktree (removed afterwards), or is a folder that holds
a source tree. The measurement runs as one child process per side and round, ``python -m benchmarks
<same arguments>`` from this tree (so both sides use this tree's harness), with ``PYTHONPATH``
putting that side's ``src/`` first so that the child imports that side's tplogp. Rounds alternate
the order (this, base; base, this; ...) on the same machine state, so clock, power and cache drift
fall on both sides alike. Separate processes rather than two copies of tplogp in one process: the
package registers kernels, custom ops and caches under fixed names, and a second import under
another name would share or clash with them. Ratios are this / base of the per-side medians over
rounds; each row is also appended to the results file, tagged ``ab`` (the report leaves such rows
out).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Iterator

from . import runner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS = {
    "op": ("fwd_ms", "fwd_bwd_ms", "fwd_gemms", "fwd_bwd_gemms", "fwd_gemms_b2b",
           "fwd_bwd_gemms_b2b",
           "host_fwd_bwd_us", "host_fwd_bwd_all_us", "extra_peak_gib"),
    "memory": ("elapsed_s", "growth_mib"),
    "plugin": ("dispatch_overhead_ms", "median_tp_test_ms", "median_skip_ms", "hang_test_s",
               "ratio"),
    "tp": ("step_ms", "peak_gib_per_rank"),
}
KEY_FIELDS = ("suite", "shape", "dtype", "impl", "budget", "section", "tp")


def _src_root(tree: str) -> str:
    src = os.path.join(tree, "src")
    return src if os.path.isdir(os.path.join(src, "tplogp")) else tree


def _row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in KEY_FIELDS)


def _child(argv: list[str], src_root: str, out_dir: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH", "")) if p)
    env.pop("TPLOGP_COMMIT", None)
    cmd = [sys.executable, "-m", "benchmarks", *argv, "--out", out_dir]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")


def spread(values: list[float]) -> float:
    """``(max - min) / median`` of one side's rounds: how far apart its rounds are, beside the ratio
    they give."""
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else 0.0


def ratios(rows: list[dict]) -> list[dict]:
    """Per row key and metric: medians per side over rounds, ``this / base``, the rounds per side
    and their :func:`spread`."""
    by_key: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        by_key.setdefault(_row_key(r), {}).setdefault(r["ab"]["side"], []).append(r)
    out = []
    for key, sides in by_key.items():
        entry = dict(zip(KEY_FIELDS, key))
        for metric in METRICS.get(key[0], ()):
            vals = {s: [r[metric] for r in sides.get(s, [])
                        if isinstance(r.get(metric), (int, float))]
                    for s in ("this", "base")}
            if vals["this"] and vals["base"]:
                this, base = statistics.median(vals["this"]), statistics.median(vals["base"])
                entry[metric] = {"this": this, "base": base, "ratio": this / base if base else None,
                                 "rounds": min(len(vals["this"]), len(vals["base"])),
                                 "spread": {s: spread(v) for s, v in vals.items()}}
        errors = {s: rs[-1]["error"] for s, rs in sides.items() if rs and "error" in rs[-1]}
        if errors:
            entry["errors"] = errors
        out.append(entry)
    return out


def format_ratio(entry: dict) -> str:
    label = " ".join(str(entry[k]) for k in KEY_FIELDS[1:] if entry.get(k) not in (None, "default"))
    parts = [f"{m} {v['this']:.4g} / {v['base']:.4g} = {v['ratio']:.3f} (spread "
             f"{v['spread']['this']:.0%} / {v['spread']['base']:.0%})" for m, v in entry.items()
             if isinstance(v, dict) and "ratio" in v and v["ratio"] is not None]
    if "errors" in entry:
        parts.append(f"errors: {entry['errors']}")
    return f"{label}: " + ("; ".join(parts) if parts else "no common numbers")


@contextlib.contextmanager
def base_tree(base_rev: str) -> Iterator[tuple[str, str]]:
    """``(the base's source tree, a scratch folder)`` for the block: ``base_rev`` itself when it is
    a folder (an exported revision: no git history needed), else a temporary git worktree of that
    revision. The worktree and the scratch folder are gone after the block."""
    tmp = tempfile.mkdtemp(prefix="tplogp-base-")
    worktree = not os.path.isdir(base_rev)
    tree = os.path.join(tmp, "tree") if worktree else os.path.abspath(base_rev)
    try:
        if worktree:
            top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=REPO,
                                 capture_output=True, text=True)
            if top.returncode != 0:
                raise RuntimeError(f"--base REV needs a git checkout ({REPO} is not one: "
                                   f"{top.stderr.strip()}); pass the base as a folder holding its "
                                   "source tree instead")
            add = subprocess.run(["git", "worktree", "add", "--detach", tree, base_rev], cwd=REPO,
                                 capture_output=True, text=True)
            if add.returncode != 0:
                raise RuntimeError(f"git worktree add {base_rev} failed: {add.stderr.strip()}")
        yield tree, tmp
    finally:
        if worktree and os.path.isdir(tree):
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO,
                           capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def run(argv: list[str], base_rev: str, rounds: int, out_dir: str,
        later_rounds: tuple[str, ...] = ()) -> tuple[list[dict], list[dict]]:
    """Run ``python -m benchmarks <argv>`` on this tree and on ``base_rev``, ``rounds`` times each,
    interleaved.

    ``base_rev``: a git revision (checked out into a temporary worktree) or a folder holding a
    source tree (an exported revision, for machines where the checkout has no git history):
    :func:`base_tree`.

    ``later_rounds`` are extra arguments for rounds after the first (e.g. ``--no-check``). Returns
    (rows, ratios); the rows are appended to ``<out_dir>/results.jsonl``."""
    rows: list[dict] = []
    with base_tree(base_rev) as (tree, tmp):
        sides = {"this": _src_root(REPO), "base": _src_root(tree)}
        commits = {"this": runner.source_commit(REPO), "base": runner.source_commit(tree)}
        for i in range(rounds):
            order = ("this", "base") if i % 2 == 0 else ("base", "this")
            for side in order:
                child_out = os.path.join(tmp, f"{side}-{i}")
                extra = list(later_rounds) if i else []
                print(f"# A/B round {i + 1}/{rounds}: {side} ({commits[side]})", flush=True)
                _child([*argv, *extra], sides[side], child_out)
                for r in runner.read_rows(child_out):
                    r["ab"] = {"side": side, "round": i, "this": commits["this"],
                               "base": commits["base"]}
                    rows.append(r)
    runner.append_rows(out_dir, rows)
    result = ratios(rows)
    print(f"# A/B: this tree ({commits['this']}) / {base_rev} ({commits['base']}), medians over "
          f"{rounds} round(s)")
    for entry in result:
        print(format_ratio(entry))
    return rows, result
