"""How a budget splits, for every source (:mod:`tplogp.backends.memory_budget`): the call's
``workspace_bytes``, else ``TPLOGP_WORKSPACE_MB``, else the source's row of the table; a budget's
transient part is at most the source's transient size and the rest is kept, the same on every
source; docs/operator.md states the table's rows."""

from __future__ import annotations

import pathlib

import pytest
import torch

from tplogp.backends import memory_budget

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # (a device object only: nothing runs on it)
MIB = 1 << 20
SOURCES = ("native", "triton", "sm90")


# every row on both kinds of device: the native row differs between them, the triton / sm90 rows do
# not
@pytest.mark.parametrize("source, device, transient, keep_whole", [
    pytest.param("native", CPU, 64 * MIB, 0, id="native-cpu"),
    pytest.param("native", CUDA, 1024 * MIB, 0, id="native-cuda"),
    pytest.param("triton", CPU, 128 * MIB, 128 * MIB, id="triton-cpu"),
    pytest.param("triton", CUDA, 128 * MIB, 128 * MIB, id="triton-cuda"),
    pytest.param("sm90", CUDA, 128 * MIB, 128 * MIB, id="sm90-cuda"),
])
def test_no_budget_is_the_sources_row(monkeypatch, source, device, transient, keep_whole):
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    assert memory_budget.transient_bytes(source, device) == transient
    assert memory_budget.split(source, None, device) == (transient, 0, keep_whole)
    assert memory_budget.split(source, None, device, deterministic=True) == (transient, 0, 0)


@pytest.mark.parametrize("source", SOURCES)
def test_a_budget_splits_alike_on_every_source(monkeypatch, source):
    """Up to the transient size all of it is transient (so a budget of that size keeps nothing), the
    rest is kept; the variable is a budget like the call's, and the call's wins over it."""
    monkeypatch.delenv("TPLOGP_WORKSPACE_MB", raising=False)
    t = memory_budget.transient_bytes(source, CPU)
    assert memory_budget.split(source, 0, CPU) == (0, 0, 0)
    assert memory_budget.split(source, t // 2, CPU) == (t // 2, 0, 0)
    assert memory_budget.split(source, t, CPU) == (t, 0, 0)
    assert memory_budget.split(source, t + 5, CPU, deterministic=True) == (t, 5, 0)
    monkeypatch.setenv("TPLOGP_WORKSPACE_MB", "300")
    assert memory_budget.call_budget(None) == 300 * MIB
    assert memory_budget.split(source, None, CPU) == (t, 300 * MIB - t, 0)
    assert memory_budget.split(source, t + 1, CPU) == (t, 1, 0)


def _size(n_bytes: int) -> str:
    return f"{n_bytes >> 30} GiB" if n_bytes % (1 << 30) == 0 else f"{n_bytes // MIB} MiB"


def test_the_operator_manual_states_the_table():
    """docs/operator.md, "Memory budget": each source's row gives its transient sizes and whether a
    call without a budget keeps anything."""
    text = (pathlib.Path(__file__).parents[2] / "docs" / "operator.md").read_text()
    section = text.split("## Memory budget", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    for source, row in memory_budget.SOURCE_BUDGETS.items():
        (line,) = [r for r in rows if f"`{source}`" in r.split("|")[1]]
        transient, kept = (cell.strip() for cell in line.split("|")[2:4])
        if row.transient_cuda == row.transient_elsewhere:
            assert transient.endswith(f": {_size(row.transient_cuda)}"), (source, transient)
        else:
            assert transient.endswith(f": {_size(row.transient_cuda)} on CUDA, {_size(row.transient_elsewhere)} "
                                      f"elsewhere"), (source, transient)
        assert kept.startswith("the whole shard when") == row.keeps_whole, (source, kept)
        assert (kept == "nothing") == (not row.keeps_whole), (source, kept)
