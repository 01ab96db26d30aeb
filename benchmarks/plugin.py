"""Costs of the pytest_tplogp rank pool (one question per section; one results row per section).

1. dispatch  per-test wall time of trivial TP tests at world size 4 (gloo, CPU), measured around
             pytest's whole runtest protocol (setup + call + teardown + reporting), median over
             tests 2..n (test 1 pays the pool start); minus the same median for as many plain
             (non-TP) tests in the same session = dispatch overhead.
2. start     pool start in a fresh process (start 4 ranks, import torch, FileStore rendezvous,
             init_process_group, ready) and the respawn after it, for the forkserver (default) and
             spawn start methods, vs a bare ``torch.multiprocessing.spawn`` of 4 processes that
             import torch; medians of alternating repeats.
3. skip      per-test wall time of ``@pytest.mark.gpu @pytest.mark.tp`` tests with no GPU visible,
             and whether any pool was created (it must not be).
4. recovery  a warm pool, a test that hangs past its 2 s deadline, then the next test: the hang
             test's wall time (deadline + stack dump + kill) and the next test's (respawn + run),
             against deadline + one pool start.
5. mesh      what the ``mesh`` fixture adds to a test: trivial TP tests at world size 4 (gloo, CPU),
             in pairs run back to back, one without ``mesh`` and one with ``mesh={"dp": 2, "tp":
             2}``; the median of the per-pair differences of pytest's whole runtest protocol (pairs
             2..n: the first mesh test creates the mesh's groups, reported apart as
             ``first_mesh_test_extra_ms``).

The smoke mode runs sections 1 and 3 with 6 tests at world size 2 (section 5, with 6 pairs, when
named). ``python -m benchmarks plugin --sections mesh`` runs one section.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

RECORDER = '''
import json, os, time
import pytest

_TIMES = []

@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0 = time.perf_counter()
    try:
        return (yield)
    finally:
        _TIMES.append((item.nodeid, time.perf_counter() - t0))

def pytest_sessionfinish(session):
    pools, manager = [], None
    # the pool manager's bookkeeping (pytest_tplogp internals: absent fields leave these empty)
    try:
        from pytest_tplogp.session import STATE
        manager = session.config.stash[STATE]._manager
        pools = [] if manager is None else [dict(key=list(k), start_s=p.start_s, starts=p.starts)
                                            for k, p in manager.pools.items()]
    except Exception:
        pass
    with open(os.environ["BENCH_OUT"], "w") as f:
        json.dump({"tests": _TIMES, "spawned": manager is not None, "pools": pools,
                   "respawns": getattr(manager, "respawns", 0)}, f)
'''


def _env(**extra: str) -> dict[str, str]:
    """This process's environment with the measured packages' import root first on PYTHONPATH."""
    import pytest_tplogp

    env = dict(os.environ)
    root = str(Path(pytest_tplogp.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def _run_pytest(files: dict[str, str], args: list[str], **env: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-tplogp-") as tmp:
        for name, body in {**files, "conftest.py": RECORDER}.items():
            Path(tmp, name).write_text(textwrap.dedent(body))
        out = Path(tmp, "bench.json")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "pytest_tplogp", "-q", "-p",
                               "no:cacheprovider",
                               *args], cwd=tmp, env=_env(BENCH_OUT=str(out), **env),
                               capture_output=True, text=True,
                              timeout=600)
        wall = time.perf_counter() - t0
        if not out.exists():
            raise RuntimeError(f"pytest run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        data = json.loads(out.read_text())
        data["wall_s"] = wall
        # times stamped by the test bodies (files named by the body, holding time.time())
        data["stamps"] = {name: float(Path(tmp, name).read_text())
                          for name in ("hang_began", "next_began")
                          if Path(tmp, name).exists()}
        data["summary"] = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        return data


def bench_dispatch(n_tests: int, world_size: int = 4) -> dict[str, Any]:
    tp_body = "import pytest\n" + "".join(
        f"\n@pytest.mark.tp(world_size={world_size})\ndef test_tp_{i}(tp):\n    pass\n"
        for i in range(n_tests))
    plain_body = "".join(f"\ndef test_plain_{i}():\n    pass\n" for i in range(n_tests))
    data = _run_pytest({"test_a_tp.py": tp_body, "test_b_plain.py": plain_body},
                       ["--tp-backend=gloo"])
    tp_times = [t for nid, t in data["tests"] if "test_tp_" in nid]
    plain = [t for nid, t in data["tests"] if "test_plain_" in nid]
    warm = tp_times[1:]
    med_tp = statistics.median(warm)
    med_plain = statistics.median(plain)
    return {
        "n_tests": n_tests, "world_size": world_size, "backend": "gloo",
        "first_test_s": tp_times[0], "median_tp_test_ms": med_tp * 1e3,
        "median_plain_test_ms": med_plain * 1e3,
        "dispatch_overhead_ms": (med_tp - med_plain) * 1e3,
        "p90_tp_test_ms": sorted(warm)[int(0.9 * len(warm))] * 1e3,
        "target_ms": 20.0, "summary": data["summary"], "samples_ms": [t * 1e3 for t in tp_times],
    }


def _bare_child(rank: int) -> None:
    import torch  # noqa: F401 - the cost being measured


_COLD_START = """
import json, sys, tempfile, time
import torch.multiprocessing  # the parent of a pytest session has torch imported already
from pytest_tplogp.pool import PoolKey, RankPool
with tempfile.TemporaryDirectory() as d:
    pool = RankPool(PoolKey(4, "gloo", ("cpu",)), d, start_method=sys.argv[1])
    t0 = time.perf_counter()
    pool.start()
    cold = time.perf_counter() - t0
    pool.stop()
    t0 = time.perf_counter()
    pool.start()  # a respawn: with forkserver the server is already up
    warm = time.perf_counter() - t0
    pool.stop()
print(json.dumps({"cold": cold, "warm": warm}))
"""


def _pool_start(method: str) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", _COLD_START, method], env=_env(),
                          capture_output=True, text=True,
                          timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_start(repeats: int) -> dict[str, Any]:
    """Pool start in a fresh process (cold: with forkserver this includes starting the fork server,
    which imports torch once) and the respawn right after it (warm), for both start methods, vs a
    bare mp.spawn."""
    import torch.multiprocessing as tmp

    bare_s: list[float] = []
    runs: dict[str, list[dict[str, float]]] = {"forkserver": [], "spawn": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        tmp.spawn(_bare_child, nprocs=4, join=True, start_method="spawn")
        bare_s.append(time.perf_counter() - t0)
        for method in runs:
            runs[method].append(_pool_start(method))
    med = statistics.median
    bare = med(bare_s)
    out: dict[str, Any] = {"repeats": repeats, "bare_spawn_s": bare_s, "median_bare_spawn_s": bare,
                           "target_ratio": 1.3}
    for method, rs in runs.items():
        cold, warm = med(r["cold"] for r in rs), med(r["warm"] for r in rs)
        out[method] = {"samples": rs, "median_cold_start_s": cold, "median_respawn_s": warm,
                       "ratio_cold_vs_bare": cold / bare}
    out["ratio"] = out["forkserver"]["ratio_cold_vs_bare"]
    return out


def bench_skip(n_tests: int) -> dict[str, Any]:
    body = "import pytest\n" + "".join(
        f"\n@pytest.mark.gpu\n@pytest.mark.tp(world_size=4)\ndef test_gpu_{i}(tp):\n    pass\n"
        for i in range(n_tests))
    data = _run_pytest({"test_gpu.py": body}, ["-rs"], CUDA_VISIBLE_DEVICES="")
    times = [t for _, t in data["tests"]]
    return {"n_tests": n_tests, "median_skip_ms": statistics.median(times) * 1e3,
            "max_skip_ms": max(times) * 1e3,
            "spawned_anything": data["spawned"], "target_ms": 50.0, "summary": data["summary"]}


def bench_recovery(deadline_s: float) -> dict[str, Any]:
    body = f'''
import os
import time

import pytest
import torch.distributed as dist

def _stamp(name):
    with open(os.path.join(os.path.dirname(__file__), name), "w") as f:
        f.write(repr(time.time()))

@pytest.mark.tp(world_size=4)
def test_1_warm(tp):
    pass

@pytest.mark.tp(world_size=4, timeout={deadline_s})
def test_2_hang(tp):
    if tp.rank == 0:
        _stamp("hang_began")
        dist.barrier()

@pytest.mark.tp(world_size=4)
def test_3_next(tp):
    if tp.rank == 0:
        _stamp("next_began")
    dist.barrier()
'''
    data = _run_pytest({"test_hang.py": body}, [])
    t = {nid.split("::")[1].split("[")[0]: s for nid, s in data["tests"]}
    pool_start = data["pools"][0]["start_s"] if data["pools"] else float("nan")
    # measured: from the hanging body's start to the next test body's start (wall clock, one
    # machine)
    next_start = data["stamps"]["next_began"] - data["stamps"]["hang_began"]
    return {"deadline_s": deadline_s, "warm_start_test_s": t["test_1_warm"],
            "hang_test_s": t["test_2_hang"],
            "dump_and_kill_s": t["test_2_hang"] - deadline_s, "next_test_s": t["test_3_next"],
            "respawn_pool_start_s": pool_start, "respawns": data["respawns"],
            "next_body_starts_after_s": next_start, "bound_s": deadline_s + pool_start + 1.0,
            "within_bound": next_start <= deadline_s + pool_start + 1.0, "summary": data["summary"]}


def bench_mesh(n_pairs: int, world_size: int = 4) -> dict[str, Any]:
    """Pairs of trivial TP tests, without and with the ``mesh`` fixture, interleaved in one
    session."""
    shape = {"dp": 2, "tp": world_size // 2}
    body = "import pytest\n" + "".join(
        f"\n@pytest.mark.tp(world_size={world_size})\ndef test_{i:04d}_a_plain(tp):\n    pass\n"
        f"\n@pytest.mark.tp(world_size={world_size}, mesh={shape!r})\ndef test_{i:04d}_b_mesh(tp, "
        f"mesh):\n    assert mesh.ndim == 2\n" for i in range(n_pairs))
    data = _run_pytest({"test_mesh.py": body}, ["--tp-backend=gloo"])
    plain = [t for nid, t in data["tests"] if "_a_plain" in nid]
    with_mesh = [t for nid, t in data["tests"] if "_b_mesh" in nid]
    if len(plain) != n_pairs or len(with_mesh) != n_pairs or "failed" in data["summary"]:
        raise RuntimeError(f"mesh benchmark session did not pass: {data['summary']}")
    extra = [(m - p) * 1e3 for p, m in zip(plain[1:], with_mesh[1:])]
    med = statistics.median
    return {
        "n_pairs": n_pairs, "world_size": world_size, "backend": "gloo", "mesh": shape,
        "median_plain_tp_test_ms": med(plain[1:]) * 1e3,
        "median_mesh_tp_test_ms": med(with_mesh[1:]) * 1e3,
        "mesh_extra_ms": med(extra), "p90_mesh_extra_ms": sorted(extra)[int(0.9 * len(extra))],
        "first_mesh_test_extra_ms": (with_mesh[0] - plain[1]) * 1e3, "target_ms": 5.0,
        "summary": data["summary"], "extra_samples_ms": extra,
    }


SECTIONS = ("dispatch", "start", "skip", "recovery", "mesh")


def bench(smoke: bool, sections: list[str] | None = None) -> list[dict]:
    """One row per section (see the module docstring); ``sections``: a subset of
    :data:`SECTIONS`."""
    rows = []
    if smoke:
        runs = {"dispatch": lambda: bench_dispatch(6, world_size=2), "skip": lambda: bench_skip(6),
                "mesh": lambda: bench_mesh(6)}
        sections = sections or ["dispatch", "skip"]
    else:
        runs = {"dispatch": lambda: bench_dispatch(50), "start": lambda: bench_start(3),
                "skip": lambda: bench_skip(50), "recovery": lambda: bench_recovery(2.0),
                "mesh": lambda: bench_mesh(60)}
    unknown = sorted(set(sections or ()) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown plugin benchmark section(s) {', '.join(unknown)}; expected "
                         f"{', '.join(SECTIONS)}")
    selected = [(name, run) for name, run in runs.items() if not sections or name in sections]
    for name, run in selected:
        row: dict[str, Any] = {"suite": "plugin", "section": name, "impl": "pytest_tplogp"}
        try:
            row.update(run())
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        rows.append(row)
    return rows


def format_row(r: dict) -> str:
    if "error" in r:
        return f"[{r['section']}] {r['error']}"
    if r["section"] == "dispatch":
        return (f"[dispatch] {r['n_tests']} trivial TP tests, world size {r['world_size']} gloo: "
                f"median {r['median_tp_test_ms']:.1f} ms/test (plain test "
                f"{r['median_plain_test_ms']:.1f} ms) -> overhead {r['dispatch_overhead_ms']:.1f} "
                f"ms (target <= 20 ms); first test incl. pool start {r['first_test_s']:.2f} s")
    if r["section"] == "start":
        return "; ".join(f"[start] {m}: pool start {r[m]['median_cold_start_s']:.2f} s (respawn "
                         f"{r[m]['median_respawn_s']:.2f} s) vs bare mp.spawn "
                         f"{r['median_bare_spawn_s']:.2f} s -> {r[m]['ratio_cold_vs_bare']:.2f}x"
                         for m in ("forkserver", "spawn"))
    if r["section"] == "mesh":
        return (f"[mesh] {r['n_pairs']} pairs of trivial TP tests, world size {r['world_size']} "
                f"gloo, mesh {r['mesh']}: median {r['median_mesh_tp_test_ms']:.1f} ms/test with "
                f"mesh vs {r['median_plain_tp_test_ms']:.1f} ms without -> the mesh adds "
                f"{r['mesh_extra_ms']:.2f} ms (median of pair differences; target <= 5 ms); first "
                f"mesh test (creates the groups) +{r['first_mesh_test_extra_ms']:.1f} ms")
    if r["section"] == "skip":
        return (f"[skip] missing-GPU TP test: median {r['median_skip_ms']:.2f} ms, max "
                f"{r['max_skip_ms']:.2f} ms (target <= 50 ms); spawned anything: "
                f"{r['spawned_anything']}")
    return (f"[recovery] deadline {r['deadline_s']:g} s: hang test {r['hang_test_s']:.2f} s, "
            f"respawn {r['respawn_pool_start_s']:.2f} s -> next body starts "
            f"{r['next_body_starts_after_s']:.2f} s after the hang began")
