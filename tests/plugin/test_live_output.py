"""``-s``: every rank's output is printed as it comes (``[rank N] ...``), also while a peer
hangs."""

from __future__ import annotations

import subprocess
import sys


import pytest

pytest_plugins = ["pytester"]

BODY = '''
import os, time
import pytest
import torch.distributed as dist

@pytest.mark.tp
def test_prints_waits_prints(tp):
    print(f"first line of rank {tp.rank}")
    for _ in range(600):  # the pytest process creates the file once it has seen the first line
        if os.path.exists("go"):
            break
        time.sleep(0.1)
    print(f"rank {tp.rank} saw the file: {os.path.exists('go')}")

@pytest.mark.tp(timeout=3)
def test_hangs(tp):
    print(f"rank {tp.rank} before the barrier")
    if tp.rank == 0:
        dist.barrier()                   # rank 1 never comes: the deadline passes
'''


@pytest.mark.slow
def test_live_output(pytester: pytest.Pytester, tag: str) -> None:
    pytester.makepyfile(test_body=BODY)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "pytest_tplogp", "-s", "-p",
                             "no:cacheprovider",
                             "test_body.py"], cwd=pytester.path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "[rank 1] first line of rank 1" in line:
                # the body is still running: its first line came live
                (pytester.path / "go").touch()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out = "\n".join(lines)
    assert ("[rank 0] rank 0 saw the file: True" in out
            and "[rank 1] rank 1 saw the file: True" in out), out
    # the hang's output shows as it comes, before the failure report
    before = next(i for i, line in enumerate(lines) if "[rank 0] rank 0 before the barrier" in line)
    assert before < next(i for i, line in enumerate(lines) if "FAILURES" in line), out
    assert "deadline of 3 s exceeded: rank 0 still running" in out
    # printed once, as it came: the report does not repeat the ranks' output
    assert (out.count("rank 0 before the barrier") == 1
            and out.count("rank 1 saw the file") == 1), out
    assert "Captured stdout rank" not in out, out

