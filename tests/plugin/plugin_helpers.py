"""Helpers for the pytester tests of pytest_tplogp (process checks)."""

from __future__ import annotations

import os
import pathlib
import time


def tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment carries ``TPLOGP_TEST_TAG=tag`` (zombies included)."""
    needle = f"TPLOGP_TEST_TAG={tag}".encode()
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def leftover_processes(tag: str, wait_s: float = 5.0) -> list[int]:
    """Tagged processes still present after ``wait_s`` (multiprocessing's resource tracker exits a moment after
    its parent, so give it a bounded while)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = tagged_pids(tag)
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.1)
