"""Helpers for the pytester tests of pytest_tplogp (process checks)."""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


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


def wait_for(probe: Callable[[], T], timeout_s: float, what: str) -> T:
    """Poll ``probe`` until it returns something truthy (returned), or fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.01)


def children_of(pid: int) -> list[int]:
    """Live child processes of ``pid`` (from ``/proc/*/stat``)."""
    kids = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if int(fields[1]) == pid:
            kids.append(int(entry.name))
    return kids


def forkserver_importing_torch(pytest_pid: int) -> int | None:
    """The pid of ``pytest_pid``'s multiprocessing fork server once it has loaded torch's library (so it runs its
    preload, past tplogp's guard module, and is importing torch), else None."""
    for pid in children_of(pytest_pid):
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
            maps = pathlib.Path(f"/proc/{pid}/maps").read_text() if b"forkserver" in cmdline else ""
        except OSError:
            continue
        if "libtorch" in maps:
            return pid
    return None


def process_states(pids: list[int]) -> str:
    """One line per process: pid, parent, state, wait channel, blocked / ignored / caught signal masks and command
    line (from /proc), for the report of a process that would not exit."""
    lines = []
    for pid in pids:
        proc = pathlib.Path("/proc") / str(pid)
        try:
            status = dict(line.split(":\t", 1) for line in (proc / "status").read_text().splitlines()
                          if ":\t" in line)
            wchan = (proc / "wchan").read_text()
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError as e:
            lines.append(f"{pid}: gone ({e})")
            continue
        lines.append(f"{pid} ppid {status.get('PPid', '?').strip()} {status.get('State', '?').strip()} "
                     f"wchan {wchan} SigBlk {status.get('SigBlk', '?').strip()} SigIgn "
                     f"{status.get('SigIgn', '?').strip()} SigCgt {status.get('SigCgt', '?').strip()} "
                     f"threads {status.get('Threads', '?').strip()}: {cmd}")
    return "\n".join(lines)
