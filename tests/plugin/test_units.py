"""In-process unit tests of the pure parts: rank ranges, GPU blocks under xdist, outcome merging,
settings."""

from __future__ import annotations

import pytest

from pytest_tplogp import devices
from pytest_tplogp.pool import PoolRun, StuckRank
from pytest_tplogp.protocol import RankOutcome, format_ranks
from pytest_tplogp.report import merge, where_waiting


def test_format_ranks() -> None:
    assert format_ranks([1]) == "rank 1"
    assert format_ranks([3, 0, 1, 2]) == "ranks 0-3"
    assert format_ranks([0, 2, 3, 5]) == "ranks 0, 2-3, 5"


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    def set_env(visible: str, worker: str | None = None, count: int | None = None) -> None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        if worker is None:
            monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
            monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
        else:
            monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
            monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
        devices.visible_gpus.cache_clear()

    yield set_env
    devices.visible_gpus.cache_clear()


def test_xdist_workers_get_disjoint_gpu_blocks(gpus, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "nccl_available", lambda: True)
    blocks = []
    for w in range(3):
        # honours the outer CUDA_VISIBLE_DEVICES, leftover GPU unused
        gpus("4,5,6,7,0,1,2", f"gw{w}", 3)
        blocks.append(devices.gpu_block())
    assert blocks == [("4", "5"), ("6", "7"), ("0", "1")]
    gpus("4,5,6,7,0,1,2", "gw1", 3)
    assert devices.place(2, "auto") == devices.Placement("nccl", ("6", "7"))
    # one device: the block's first
    assert devices.place(1, "nccl") == devices.Placement("nccl", ("6",))
    assert devices.one_gpu_index() == 2  # "6" is cuda:2 of this process
    too_big = devices.place(4, "nccl")
    assert too_big.skip_reason == (
        "GPU placement: needs 4 distinct GPU(s) for NCCL (one per rank); xdist worker gw1 of 3 "
        "owns 2 of 7 visible GPU(s): run with -n 1 or fewer (-n <= GPUs // world size), or "
        "--tp-backend=gloo (ranks on CPU)")
    gpu_test = devices.place(4, "auto", needs_gpu=True)  # not sharing: the fix is -n, or sharing
    assert gpu_test.skip_reason is not None and gpu_test.skip_reason.endswith(
        "(-n <= GPUs // world size), or --tp-gpu-share=on and backend auto (ranks share the GPUs "
        "over gloo)")
    # auto: gloo on CPU, no skip
    assert devices.place(4, "auto") == devices.Placement("gloo", ("cpu",))
    gpus("")
    assert devices.place(2, "auto") == devices.Placement("gloo", ("cpu",))
    assert devices.one_gpu() is None


@pytest.mark.parametrize("visible, workers, one_device", [
    ("0", 4, ["0", "0", "0", "0"]),              # one GPU, -n 4: every worker shares it
    ("0,1", 3, ["0", "1", "0"]),                 # more workers than GPUs: worker I uses GPU I mod n
    ("0,1,2,3,4,5,6,7", 3, ["0", "2", "4"]),     # a block each: its first GPU
], ids=["1gpu-n4", "2gpu-n3", "8gpu-n3"])
def test_one_device_tests_run_on_every_worker(gpus, monkeypatch: pytest.MonkeyPatch, visible: str,
                                              workers: int,
                                               one_device: list[str]) -> None:
    monkeypatch.setattr(devices, "nccl_available", lambda: True)
    got = []
    for w in range(workers):
        gpus(visible, f"gw{w}", workers)
        got.append(devices.one_gpu())
        assert devices.place(1, "auto", needs_gpu=True) == devices.Placement("nccl", (got[-1],))
    assert got == one_device


def test_multi_gpu_pools_skip_with_the_fix_or_fall_back(gpus,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "nccl_available", lambda: True)
    gpus("0,1", "gw2", 4)  # 2 GPUs, 4 workers: no worker owns 2
    assert devices.gpu_block() == ()
    assert (devices.block_note() == "xdist worker gw2 of 4 owns 0 of 2 visible GPU(s), shares GPU "
                                    "0 for one-device tests")
    skip = devices.place(2, "nccl").skip_reason
    assert (skip is not None and skip.startswith(devices.PLACEMENT_SKIP_PREFIX)
            and "run with -n 1 or fewer" in skip)
    assert devices.place(2, "auto") == devices.Placement("gloo", ("cpu",))
    gpus("0,1", "gw1", 2)  # 2 workers: one GPU each, still not 2 distinct ones
    assert devices.place(2, "nccl").skip_reason.startswith(devices.PLACEMENT_SKIP_PREFIX)
    gpus("0,1", "gw0", 1)  # one worker owns both
    assert devices.place(2, "nccl") == devices.Placement("nccl", ("0", "1"))
    # fewer GPUs than ranks: not a placement skip (no -n helps); the gloo fix where it applies
    gpus("0")
    assert devices.place(2, "nccl").skip_reason == ("needs 2 distinct GPU(s) for NCCL (one per "
                                                    "rank); 1 visible GPU(s): run it with "
                                                    "--tp-backend=gloo (ranks on CPU)")
    assert devices.place(2, "auto", needs_gpu=True).skip_reason == (
        "needs 2 distinct GPU(s) for NCCL (one per rank); 1 visible GPU(s): run it with "
        "--tp-gpu-share=on and backend auto (ranks share the GPUs over gloo)")


def _out(rank: int, outcome: str, summary: str = "", longrepr: str = "") -> RankOutcome:
    return RankOutcome(rank, outcome, summary=summary, longrepr=longrepr)


def test_merge_groups_identical_failures() -> None:
    run = PoolRun(outcomes={r: _out(r, "failed", "ValueError: x", "tb") for r in range(4)})
    v = merge(run, 4, timeout_s=1, test_file=None, pool_desc="p")
    assert v.outcome == "failed" and v.headline == "ranks 0-3: ValueError: x"
    assert v.text.count("tb") == 1


def test_merge_skips_and_deaths() -> None:
    agreed = PoolRun(outcomes={r: _out(r, "skipped", "why") for r in range(2)})
    assert merge(agreed, 2, timeout_s=1, test_file=None, pool_desc="p").outcome == "skipped"
    partial = PoolRun(outcomes={0: _out(0, "skipped", "why"), 1: _out(1, "passed")})
    assert ("skip not agreed" in merge(partial, 2, timeout_s=1, test_file=None,
                                       pool_desc="p").headline)
    dead = PoolRun(outcomes={0: _out(0, "passed")}, deaths={1: "was killed by SIGKILL (signal 9)"},
                   killed="ranks died")
    v = merge(dead, 2, timeout_s=1, test_file=None, pool_desc="p")
    assert v.outcome == "failed"
    assert v.headline.startswith("rank 1 was killed by SIGKILL (signal 9)")
    gloo = ("RuntimeError: [/w/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:13214: "
            "Connection reset by peer. This is typically caused by a remote worker hanging. GLHF!")
    peers = {0: _out(0, "failed", gloo, "tb0"), 2: _out(2, "failed", gloo, "tb2")}
    collateral = PoolRun(outcomes=peers, deaths={1: "was killed by SIGSEGV (signal 11)"},
                         killed="ranks died")
    v = merge(collateral, 3, timeout_s=1, test_file=None, pool_desc="p")
    assert v.headline == ("rank 1 was killed by SIGSEGV (signal 11); then on its peers: ranks 0, "
                          "2: RuntimeError: Read error [127.0.0.1]:13214: Connection reset by peer")
    assert v.text.index("rank 1 was killed") < v.text.index("ranks 0, 2 failed")
    assert "GLHF" in v.text  # the full error in the report
    incomplete = PoolRun(outcomes={0: _out(0, "passed")})  # a missing rank never counts as a pass
    assert merge(incomplete, 2, timeout_s=1, test_file=None, pool_desc="p").outcome == "failed"


def test_where_waiting_reads_faulthandler_dump() -> None:
    dump = (
        'Thread 0x0003 (most recent call first):\n  File "/w/pytest_tplogp/rank.py", line 73 in '
        '_watch_parent\n\nThread 0x0001 (most recent call first):\n  File "/x/threading.py", line '
        '1 in wait\n\nCurrent thread 0x0002 (most recent call first):\n'
        '  File "/s/site-packages/torch/distributed/distributed_c10d.py", line 5 in barrier\n'
        '  File "/t/test_a.py", line 9 in test_hang\n'
        '  File "/w/pytest_tplogp/rank.py", line 3 in run_test\n'
    )
    stuck = PoolRun(stuck={0: StuckRank(0, 11, dump)}, timed_out=True)
    assert where_waiting(dump, "/t/test_a.py") == ("barrier "
                                                   "(torch/distributed/distributed_c10d.py:5) "
                                                   "called from test_hang (t/test_a.py:9)")
    v = merge(stuck, 1, timeout_s=3, test_file="/t/test_a.py", pool_desc="p")
    assert v.headline.startswith("deadline of 3 s exceeded: rank 0 still running")


def test_merge_groups_headlines_and_names_the_ranks_that_passed() -> None:
    """Ranks whose failures share a headline but not a traceback get one headline; each traceback is
    shown once with its ranks; the ranks that passed are named."""
    run = PoolRun(outcomes={0: _out(0, "passed"),
                            1: _out(1, "failed", "AssertionError: bad", "tb-one"),
                            2: _out(2, "failed", "AssertionError: bad", "tb-two"),
                            3: _out(3, "failed", "AssertionError: bad", "tb-two")})
    v = merge(run, 4, timeout_s=1, test_file=None, pool_desc="p")
    assert v.headline == "ranks 1-3: AssertionError: bad"
    assert (v.text.count("tb-two") == 1 and "  ranks 2-3:\n      tb-two" in v.text
            and "  rank 1:\n      tb-one" in v.text)
    assert "rank 0 passed." in v.text


def _dump(thread: str, pid_frames: str) -> str:
    return (f'Thread 0x{thread}1 (most recent call first):\n  File "/w/pytest_tplogp/rank.py", '
            'line 73 in _watch_parent\n  File "/usr/lib/python3.11/threading.py", line 975 in '
            f'run\n\nCurrent thread 0x{thread}2 (most recent call first):\n{pid_frames}'
            '  File "/w/pytest_tplogp/rank.py", line 249 in run_test\n'
            '  File "/w/pytest_tplogp/rank.py", line 400 in serve\n'
            '  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run\n'
            '  File "/s/site-packages/_pytest/runner.py", line 184 in pytest_runtest_call\n'
            '  File "/s/site-packages/pluggy/_callers.py", line 103 in _multicall\n')


def test_hang_report_groups_identical_stacks_and_hides_the_harness() -> None:
    barrier = ('  File "/s/site-packages/torch/distributed/distributed_c10d.py", line 5 in '
               'barrier\n  File "/t/test_a.py", line 9 in test_hang\n')
    gather = ('  File "/s/site-packages/torch/distributed/distributed_c10d.py", line 7 in '
              'all_gather\n  File "/w/pytest_tplogp/context.py", line 120 in all_gather_object\n'
              '  File "/t/test_a.py", line 12 in test_hang\n')
    stuck = {0: StuckRank(0, 10, _dump("a", barrier)), 1: StuckRank(1, 11, _dump("b", barrier)),
             3: StuckRank(3, 13, _dump("c", gather))}
    v = merge(PoolRun(outcomes={2: _out(2, "passed")}, stuck=stuck, timed_out=True), 4, timeout_s=3,
              test_file="/t/test_a.py", pool_desc="p")
    lines = v.text.splitlines()
    assert ("  ranks 0-1 (pids 10, 11) waiting in barrier (torch/distributed/distributed_c10d.py:5)"
            " called from test_hang (t/test_a.py:9)") in lines
    assert ("  rank 3 (pid 13) waiting in all_gather (torch/distributed/distributed_c10d.py:7) "
            "called from test_hang (t/test_a.py:12)") in lines
    assert lines.count("--- ranks 0-1 stack (faulthandler, SIGUSR1) ---") == 1
    assert lines.count("--- rank 3 stack (faulthandler, SIGUSR1) ---") == 1
    assert "rank 2 passed." in lines
    # the test's frames and the plugin's collective helper stay; the rank loop, multiprocessing,
    # pytest, pluggy and the plugin's watchdog thread go, and the report says so
    assert '  File "/w/pytest_tplogp/context.py", line 120 in all_gather_object' in lines
    assert lines.count('  File "/t/test_a.py", line 9 in test_hang') == 1
    for gone in (" in run_test", " in serve", "/multiprocessing/", "/_pytest/", "/pluggy/",
                 "_watch_parent", "0x"):
        assert gone not in v.text, gone
    assert lines.count("  (5 frame(s) of pytest_tplogp, pytest and pluggy below the test and 1 "
                       "thread(s) of pytest_tplogp not shown)") == 2


def test_torchrun_grace_is_held_while_the_debugged_rank_is_in_pdb() -> None:
    """Under torchrun the --tp-pdb rank's flag in the job's store (raised by debug.body while it
    serves pdb) is what holds the straggler grace: down before pdb, up in it, down after."""
    import types

    import torch.distributed as dist

    from pytest_tplogp import debug
    from pytest_tplogp.external import _Exchange

    store = dist.HashStore()
    mode = types.SimpleNamespace(ctx=types.SimpleNamespace(rank=0, world_size=2), pdb_rank=0,
                                 store=lambda: store)
    # no "failed" key: the watcher never expires
    exchange = _Exchange(mode, 7, timeout_s=3600.0, on_hang=None)
    seen = []
    try:
        assert not exchange.debugging()
        with debug.body(0, 0, exchange.in_pdb):
            exchange.in_pdb(True)  # as debug._serve does before it waits for the debugger
            seen.append(exchange.debugging())
        assert seen == [True] and not exchange.debugging()  # the body's end lowers it
    finally:
        exchange.done.set()
        exchange.thread.join(5)



def test_unmatched_collectives_need_a_surplus_of_unwaited_work_ahead() -> None:
    from pytest_tplogp.collectives import CollectiveCounts, unmatched

    world = (0, 1, 2, 3)

    def counts(seqs, unwaited, sub=None):
        def groups(r):
            return {"0": (world, seqs[r]), **({"5": ((0, 1), sub[r])} if sub and r in sub else {})}
        return {r: CollectiveCounts(groups(r), unwaited[r]) for r in world}

    assert unmatched(counts([3, 3, 3, 3], [0, 0, 0, 0]), 4) == ""
    assert unmatched(counts([4, 4, 3, 3], [0, 0, 0, 0]), 4) == ""   # a send from rank 0 to rank 1
    assert unmatched(counts([4, 4, 4, 4], [1, 1, 1, 1]), 4) == ""   # everywhere, never waited for
    assert unmatched(counts([5, 5, 4, 4], [1, 1, 1, 1]), 4) == ""   # both of the above
    one = unmatched(counts([3, 4, 3, 3], [0, 1, 0, 0]), 4)
    assert one.startswith("rank 1 left 1 collective(s) never waited for and unmatched on the "
                          "default group (sequence numbers rank 1: 4; rank 0: 3, rank 2: 3, "
                          "rank 3: 3)")
    sub = unmatched(counts([3, 3, 3, 3], [2, 0, 0, 0], sub={0: 2, 1: 0}), 4)
    assert sub.startswith("rank 0 left 2 collective(s) never waited for and unmatched on group 5 "
                          "(ranks 0-1)")
    unknown = {r: CollectiveCounts({"0": (world, r)}, None) for r in world}  # no work registry
    assert unmatched(unknown, 4) == ""


def test_cuda_memory_check_tells_a_leak_from_a_cache() -> None:
    from pytest_tplogp.cuda_memory import CACHE_GROWTH_LIMIT, MemoryCheck

    MiB = 1 << 20
    device = {"allocated": 10 * MiB, "tensors": 2 * MiB, "cycles": 0}

    def collect():
        device["allocated"] -= device["cycles"]
        device["cycles"] = 0

    released = []
    check = MemoryCheck(lambda: device["allocated"], lambda: device["tensors"], collect,
                        release=lambda: released.append(device["allocated"]))
    assert check.after_test() == ""                  # nothing changed
    device["cycles"] = 8 * MiB                       # garbage in a reference cycle: freed by gc
    device["allocated"] += 8 * MiB
    assert check.after_test() == ""
    device["allocated"] += 64 * MiB                  # a library's workspace, held by no tensor
    assert check.after_test() == "" and check.base == 74 * MiB     # the new baseline
    assert check.after_test() == ""
    device["allocated"] += 16 * MiB                  # a tensor kept in a global
    device["tensors"] += 16 * MiB
    assert check.after_test() == ("CUDA memory 16.0 MiB above the pool's baseline, 16.0 MiB of it "
                                  "in live tensors (kept in a global, a cache or a module "
                                  "attribute?)")
    assert len(released) == 5                        # the cache released after every test, leak or not

    grows = MemoryCheck(lambda: device["allocated"], lambda: device["tensors"], collect)
    verdicts = []
    for _ in range(CACHE_GROWTH_LIMIT):              # growth outside tensors after every test
        device["allocated"] += 4 * MiB
        verdicts.append(grows.after_test())
    assert verdicts[:-1] == [""] * (CACHE_GROWTH_LIMIT - 1)
    assert verdicts[-1].endswith(f"held outside live tensors and grown after each of the last "
                                 f"{CACHE_GROWTH_LIMIT} tests (not a cache that fills once)")


def test_recycle_summary_groups_reasons_without_their_numbers() -> None:
    from pytest_tplogp.hooks import recycle_summary

    assert recycle_summary([]) == ""
    reasons = ["fresh-state check failed: CUDA memory 64.0 MiB above the pool's baseline",
               "ranks died",
               "fresh-state check failed: CUDA memory 32.5 MiB above the pool's baseline"]
    assert recycle_summary(reasons) == ("tplogp: 3 pool recycle(s): 2 x fresh-state check failed: "
                                        "CUDA memory N MiB above the pool's baseline; 1 x ranks "
                                        "died")


def test_stack_reset_sets_a_grown_stack_back(monkeypatch) -> None:
    """The driver's per-thread stack, grown by a launch (a kernel that spills), goes back to its
    starting size; an unchanged or smaller one is left alone; no driver library: a no-op."""
    import ctypes

    from pytest_tplogp import cuda_memory

    class Driver:  # the two driver entry points, on a fake context
        def __init__(self):
            self.stack, self.sets = 1024, []

        def get(self, out, which):
            assert which == 0  # CU_LIMIT_STACK_SIZE
            ctypes.cast(out, ctypes.POINTER(ctypes.c_size_t))[0] = self.stack
            return 0

        def set(self, which, size):
            self.sets.append((which, size))
            self.stack = size
            return 0

    class Entry:  # a ctypes function: argtypes settable, calls through
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, *args):
            return self.fn(*args)

    driver = Driver()
    driver.cuCtxGetLimit, driver.cuCtxSetLimit = Entry(driver.get), Entry(driver.set)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver)
    reset = cuda_memory.stack_reset()
    reset()
    assert driver.sets == []                         # not grown: nothing set
    driver.stack = 6144                              # a spilling kernel's frame
    reset()
    assert driver.sets == [(0, 1024)] and driver.stack == 1024
    driver.stack = 512
    reset()
    assert driver.sets == [(0, 1024)]                # smaller than at the start: left alone

    def missing(name):
        raise OSError(name)

    monkeypatch.setattr(ctypes, "CDLL", missing)
    cuda_memory.stack_reset()()                      # no driver: nothing to do, no error
