"""Costs of the pytest_tplogp rank pool (one question per section; numbers printed and saved as JSON).

1. dispatch  per-test wall time of 50 trivial TP tests at world size 4 (gloo, CPU), measured around pytest's whole
             runtest protocol (setup + call + teardown + reporting), median over tests 2..50 (test 1 pays the pool
             start); minus the same median for 50 plain (non-TP) tests in the same session = dispatch overhead.
2. start     pool start in a fresh process (start 4 ranks, import torch, FileStore rendezvous, init_process_group,
             ready) and the respawn after it, for the forkserver (default) and spawn start methods, vs a bare
             ``torch.multiprocessing.spawn`` of 4 processes that import torch; medians of alternating repeats.
3. skip      per-test wall time of 50 ``@pytest.mark.gpu @pytest.mark.tp`` tests with no GPU visible, and whether
             any pool was created (it must not be).
4. recovery  a warm pool, a test that hangs past its 2 s deadline, then the next test: the hang test's wall time
             (deadline + stack dump + kill) and the next test's (respawn + run), against deadline + one pool start.

Run: ``python benchmarks/bench_plugin_dispatch.py [--quick]``. Writes ``results/plugin_dispatch.json`` (machine,
versions, commit, raw samples, ratios against the targets).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

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
    from pytest_tplogp.session import STATE
    state = session.config.stash[STATE]
    manager = state._manager
    pools = [] if manager is None else [dict(key=list(k), start_s=p.start_s, starts=p.starts)
                                        for k, p in manager.pools.items()]
    with open(os.environ["BENCH_OUT"], "w") as f:
        json.dump({"tests": _TIMES, "spawned": manager is not None, "pools": pools,
                   "respawns": 0 if manager is None else manager.respawns}, f)
'''


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "src"), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _run_pytest(files: dict[str, str], args: list[str], **env: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-tplogp-") as tmp:
        for name, body in {**files, "conftest.py": RECORDER}.items():
            Path(tmp, name).write_text(textwrap.dedent(body))
        out = Path(tmp, "bench.json")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "pytest_tplogp", "-q", "-p", "no:cacheprovider",
                               *args], cwd=tmp, env=_env(BENCH_OUT=str(out), **env), capture_output=True, text=True,
                              timeout=600)
        wall = time.perf_counter() - t0
        if not out.exists():
            raise RuntimeError(f"pytest run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        data = json.loads(out.read_text())
        data["wall_s"] = wall
        data["summary"] = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        return data


def bench_dispatch(n_tests: int) -> dict[str, Any]:
    tp_body = "import pytest\n" + "".join(
        f"\n@pytest.mark.tp(world_size=4)\ndef test_tp_{i}(tp):\n    pass\n" for i in range(n_tests))
    plain_body = "".join(f"\ndef test_plain_{i}():\n    pass\n" for i in range(n_tests))
    data = _run_pytest({"test_a_tp.py": tp_body, "test_b_plain.py": plain_body}, ["--tp-backend=gloo"])
    tp_times = [t for nid, t in data["tests"] if "test_tp_" in nid]
    plain = [t for nid, t in data["tests"] if "test_plain_" in nid]
    warm = tp_times[1:]
    med_tp = statistics.median(warm)
    med_plain = statistics.median(plain)
    return {
        "n_tests": n_tests, "world_size": 4, "backend": "gloo",
        "first_test_s": tp_times[0], "median_tp_test_ms": med_tp * 1e3, "median_plain_test_ms": med_plain * 1e3,
        "dispatch_overhead_ms": (med_tp - med_plain) * 1e3, "p90_tp_test_ms": sorted(warm)[int(0.9 * len(warm))] * 1e3,
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
    proc = subprocess.run([sys.executable, "-c", _COLD_START, method], env=_env(), capture_output=True, text=True,
                          timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_start(repeats: int) -> dict[str, Any]:
    """Pool start in a fresh process (cold: with forkserver this includes starting the fork server, which imports
    torch once) and the respawn right after it (warm), for both start methods, vs a bare mp.spawn."""
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
        f"\n@pytest.mark.gpu\n@pytest.mark.tp(world_size=4)\ndef test_gpu_{i}(tp):\n    pass\n" for i in range(n_tests))
    data = _run_pytest({"test_gpu.py": body}, ["-rs"], CUDA_VISIBLE_DEVICES="")
    times = [t for _, t in data["tests"]]
    return {"n_tests": n_tests, "median_skip_ms": statistics.median(times) * 1e3, "max_skip_ms": max(times) * 1e3,
            "spawned_anything": data["spawned"], "target_ms": 50.0, "summary": data["summary"]}


def bench_recovery(deadline_s: float) -> dict[str, Any]:
    body = f'''
import pytest
import torch.distributed as dist

@pytest.mark.tp(world_size=4)
def test_1_warm(tp):
    pass

@pytest.mark.tp(world_size=4, timeout={deadline_s})
def test_2_hang(tp):
    if tp.rank == 0:
        dist.barrier()

@pytest.mark.tp(world_size=4)
def test_3_next(tp):
    dist.barrier()
'''
    data = _run_pytest({"test_hang.py": body}, [])
    t = {nid.split("::")[1].split("[")[0]: s for nid, s in data["tests"]}
    pool_start = data["pools"][0]["start_s"] if data["pools"] else float("nan")
    # The next test's ranks are ready (its body starts) after the hang test's wall time plus the respawn.
    next_start = t["test_2_hang"] + pool_start
    return {"deadline_s": deadline_s, "warm_start_test_s": t["test_1_warm"], "hang_test_s": t["test_2_hang"],
            "dump_and_kill_s": t["test_2_hang"] - deadline_s, "next_test_s": t["test_3_next"],
            "respawn_pool_start_s": pool_start, "respawns": data["respawns"],
            "next_body_starts_after_s": next_start, "bound_s": deadline_s + pool_start + 1.0,
            "within_bound": next_start <= deadline_s + pool_start + 1.0, "summary": data["summary"]}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except Exception:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tests and repeats")
    parser.add_argument("--out", default=str(REPO / "results" / "plugin_dispatch.json"))
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "src")]
    import pytest
    import torch

    n = 20 if args.quick else 50
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": _commit(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "pytest": pytest.__version__},
    }
    print(f"pytest_tplogp dispatch benchmark, {res['machine']['cpus']} CPUs, torch {torch.__version__}, "
          f"commit {res['commit']}")
    res["dispatch"] = d = bench_dispatch(n)
    print(f"[dispatch] {n} trivial TP tests, world size 4 gloo: median {d['median_tp_test_ms']:.1f} ms/test "
          f"(plain test {d['median_plain_test_ms']:.1f} ms) -> overhead {d['dispatch_overhead_ms']:.1f} ms "
          f"(target <= 20 ms); first test incl. pool start {d['first_test_s']:.2f} s")
    res["start"] = s = bench_start(2 if args.quick else 3)
    for method in ("forkserver", "spawn"):
        m = s[method]
        print(f"[start] {method}: pool start {m['median_cold_start_s']:.2f} s (respawn {m['median_respawn_s']:.2f} s) "
              f"vs bare mp.spawn(4 x import torch) {s['median_bare_spawn_s']:.2f} s -> "
              f"{m['ratio_cold_vs_bare']:.2f}x (target <= 1.3x)")
    res["skip"] = k = bench_skip(n)
    print(f"[skip] missing-GPU TP test: median {k['median_skip_ms']:.2f} ms, max {k['max_skip_ms']:.2f} ms "
          f"(target <= 50 ms); spawned anything: {k['spawned_anything']}")
    res["recovery"] = r = bench_recovery(2.0)
    print(f"[recovery] deadline {r['deadline_s']:g} s: hang test {r['hang_test_s']:.2f} s (dump + kill "
          f"{r['dump_and_kill_s']:.2f} s past the deadline), respawn {r['respawn_pool_start_s']:.2f} s -> next body "
          f"starts {r['next_body_starts_after_s']:.2f} s after the hang began (deadline + one pool start); next "
          f"test total {r['next_test_s']:.2f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
