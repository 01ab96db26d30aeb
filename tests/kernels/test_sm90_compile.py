"""The sm90 kernels compiled for sm_90 on a machine without a GPU (Triton's bundled ptxas and
cuobjdump).

The CPU interpreter runs the kernels' arithmetic but never compiles them; these tests compile them
for Hopper and check properties of the machine code that the epilogue work of docs/kernels.md
("Epilogue instruction counts") bought, so a change that brings back the slow forms fails here
rather than only in a GPU benchmark:

* the exponentials are single MUFU ops (``ex2.approx.ftz``): no per-element FSETP of the non-ftz
  denormal fix-up;
* the d_logits workspace is written with 16-byte vector stores (not one 2-byte store per logit);
* the K loops use wgmma and TMA loads; the forward that keeps softmax terms stores them with TMA
  stores.

And the shared-memory model that fits the tile configs to a device is checked against the compiled
kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.session_once import once_per_session
from tplogp.kernels import tiles

triton = pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _needs_nvidia_toolchain():
    if not all(os.access(os.path.join(_BIN, tool), os.X_OK) for tool in ("ptxas", "cuobjdump")):
        pytest.skip(f"no executable ptxas / cuobjdump in {_BIN}")


def _env():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compile for real
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _compiled_kernels(*args: str) -> str:
    _needs_nvidia_toolchain()
    run = subprocess.run([sys.executable, "-m", "tests.support.compiled_kernels", *args],
                         capture_output=True, text=True, env=_env(), timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


# The kernel kinds of tests.support.compiled_kernels.CASES whose shared-memory rows the slow tests
# check: four compilations, in the process that compiles the sass-counts kernels.
SLOW_KINDS = ("fwd_tma", "bwd_tma", "fwd", "bwd")


@pytest.fixture(scope="module")
def sass(request):
    """SASS instruction counts per opcode of the sm90 kernels and the shared-memory rows of
    ``SLOW_KINDS`` (one process compiles them all for the tests of this module, once per session
    however xdist spreads them)."""
    return once_per_session(request, "sm90_sass_counts", lambda: json.loads(
        _compiled_kernels("sass-counts", *SLOW_KINDS).strip().splitlines()[-1]))


@pytest.mark.slow
def test_sm90_kernels_machine_code(sass):
    counts = sass
    for name in ("fwd_stats", "bwd_dlogits"):
        ops = counts[name]
        assert ops.get("HGMMA", 0) > 0 and ops.get("UTMALDG", 0) > 0, (name, ops)
        assert ops.get("MUFU", 0) >= 128, (name, ops)  # one ex2 per logit of a thread's 128
        # tl.exp2's non-ftz form adds an FSETP (and two FMULs) around every ex2: 128+ per epilogue
        assert ops.get("FSETP", 0) <= 8, (name, ops)
    # two epilogue copies (interior, edge) x 16 vector stores; per-logit 2-byte stores would be 128
    # per copy
    assert counts["bwd_dlogits"].get("STG", 0) <= 64, counts["bwd_dlogits"]
    # the default forward stores no logits (the KEEP variant is a separate compilation)
    assert counts["fwd_stats"].get("STG", 0) <= 8, counts["fwd_stats"]


@pytest.mark.slow
def test_products_next_to_the_row_max_are_rounded(sass):
    """``z / T - M`` in the d_logits recompute and ``softcap * t - m`` in the softcapped forward are
    exactly 0 at the row max only if the product is rounded before the subtraction; left to the code
    generator, the pair becomes one FMA, the max's term misses 1 by the product's rounding error,
    and a peaked row's ``1 - p`` is that error (the fp32 d_weight of the softcap tests then fails
    its three-way bound). The kernels carry PTX ``mul.rn.f32``, which is never fused; the plain
    forward has no such product and so none."""
    counts = sass
    assert counts["bwd_dlogits"]["ptx_mul_rn"] > 0, counts["bwd_dlogits"]
    assert counts["fwd_stats_softcap"]["ptx_mul_rn"] > 0, counts["fwd_stats_softcap"]
    assert counts["fwd_stats"]["ptx_mul_rn"] == 0, counts["fwd_stats"]


@pytest.mark.slow
def test_softcap_d_logits_epilogue_fits_the_registers(sass):
    """The softcapped d_logits recompute runs its epilogue on the tile's two column halves one after
    the other (:func:`tplogp.kernels.backward_epilogue.dlogits_epilogue`): over the whole 128 x 256 tile the
    tanh and its slope beside the accumulator did not fit the registers: this compilation held 719
    local-memory load and store instructions (spills; the plain kernel 16), by halves none (Triton
    3.9)."""
    plain, capped = sass["bwd_dlogits"], sass["bwd_dlogits_softcap"]
    spills = capped.get("LDL", 0) + capped.get("STL", 0)
    assert spills <= plain.get("LDL", 0) + plain.get("STL", 0) + 64, (capped, plain)
    assert capped.get("HGMMA", 0) == plain.get("HGMMA", 0), capped


@pytest.mark.slow
def test_softcap_adds_a_short_tanh_per_logit(sass):
    """The softcap's tanh (:func:`tplogp.kernels.fp32_ops.tanh`) is two MUFU operations and a few
    ALU ones per logit, in the forward and in the d_logits recompute. libdevice's ``tanhf``
    evaluates a polynomial and an exponential branch per element: about 20 more instructions per
    logit over the plain kernel (Triton 3.9), which this bound fails; the short form is about 9."""
    logits = 2 * 128  # two epilogue copies (interior, edge) of a thread's 128 logits
    # the opcodes (upper case), not the other keys of an entry
    def instructions(counts: dict) -> int:
        return sum(n for op, n in counts.items() if op.isupper())

    for name in ("fwd_stats", "bwd_dlogits"):
        plain, capped = sass[name], sass[name + "_softcap"]
        assert instructions(capped) - instructions(plain) <= 12 * logits, (name, capped, plain)
        assert capped.get("MUFU", 0) - plain.get("MUFU", 0) <= 2 * logits + 8, (name, capped, plain)


@pytest.mark.slow
def test_kept_terms_variants_machine_code(sass):
    """The forward that keeps softmax terms (``KEEP``) still runs wgmma/TMA with single-MUFU
    exponentials (the terms are the epilogue's own exponentials: no second one) and stores each bf16
    tile with one TMA store per epilogue copy (interior, edge): a plain-store variant's per-element
    pointers take registers that the 128x256 accumulator tile does not leave, and it spilled twice
    as much (:func:`tplogp.kernels.forward_epilogue.keep_tile`); the plain stores left are the row stats and
    scales. The d_logits kernel on kept terms runs no GEMM and no per-element exponential (one ex2
    per row), stores with vectors and spills nothing."""
    counts = sass
    keep = counts["fwd_stats_keep"]
    assert keep.get("HGMMA", 0) > 0 and keep.get("UTMALDG", 0) > 0, keep
    assert keep.get("MUFU", 0) == counts["fwd_stats"].get("MUFU", 0) and keep.get("FSETP",
                                                                                  0) <= 8, keep
    assert keep.get("UTMASTG", 0) == 2 and keep.get("STG", 0) <= 8, keep
    kept = counts["bwd_dlogits_kept"]
    assert kept.get("HGMMA", 0) == 0 and kept.get("MUFU", 0) <= 40 and kept.get("FSETP",
                                                                                0) <= 8, kept
    assert kept.get("STG", 0) <= 64 and kept.get("STL", 0) == 0, kept


@pytest.mark.slow
def test_kept_softcap_slope_takes_one_mufu_log_per_term(sass):
    """With a softcap the kept d_logits pass rebuilds each term's tanh from ``ln(e)``: for 16-bit
    terms one MUFU ``lg2`` per element (:func:`tplogp.kernels.fp32_ops.log2`), not libdevice's
    log2f, a polynomial of about 25 instructions (14 FFMA) per element that made this memory-bound
    pass compute-bound (2864 instructions against 1704 on sm_90). 16 x 256 terms over 128 threads:
    32 per thread, in two epilogue copies."""
    kept = sass["bwd_dlogits_kept_softcap"]
    assert kept.get("MUFU", 0) >= 64, kept
    assert kept.get("FFMA", 0) <= 300 and kept.get("STL", 0) == 0, kept


def _check_shared_memory_rows(rows: list[dict]) -> None:
    for row in rows:
        assert row["model"] >= row["compiled"], row
        if row["tma"]:
            assert row["model"] == row["compiled"], row


def test_shared_memory_model_covers_the_d_hidden_kernel():
    """The inner loop's case of the model check below: the d_hidden kernel (the cheapest
    compilation)."""
    rows = [json.loads(line) for line in _compiled_kernels("shared-memory", "dh").splitlines() if line.startswith("{")]
    assert len(rows) == 1, rows
    _check_shared_memory_rows(rows)


@pytest.mark.slow
def test_shared_memory_model_covers_compiled_kernels(sass):
    """The shared-memory model behind the config fitting (tplogp.kernels.tiles.gemm_shared_bytes) is
    never below what Triton allots the compiled kernels (sm_90 and sm_80; 16-bit, tf32 and ieee fp32
    dots) and is exact for the TMA kernels, whose fp32 forward the H200 refused at 262160 bytes: the
    bf16 sm90 forward and d_logits kernels compiled above and one case per kind of
    ``SLOW_KINDS``."""
    rows = sass["shared_memory"]
    assert sorted({row["case"].split()[0] for row in rows}) == sorted(SLOW_KINDS), rows
    _check_shared_memory_rows(rows + [dict(case=name, tma=True, compiled=sass[name]["shared"],
                                           model=sass[name]["model"])
                                      for name in ("fwd_stats", "bwd_dlogits")])
    # The KEEP forward stages one bf16 tile of terms for its TMA store on top of the K loop's
    # buffers: still within sm_90's 227 KiB per block
    keep, cfg = sass["fwd_stats_keep"], tiles.SM90
    assert keep["shared"] == keep["model"] + cfg.block_n * cfg.block_v * 2 <= 227 * 1024, keep


@pytest.mark.slow
def test_support_mask_costs_a_few_instructions_per_logit(sass):
    """A sampler's support (``SUPPORT``, :func:`tplogp.kernels.tile_ops.support_masked`): the tile's
    bitmask words are loaded once per row and expanded over a reshaped view of the accumulator's
    registers, so the forward and the d_logits recompute keep their GEMM, exponentials and shared
    memory, spill no more than the plain kernels (a per-element word load took 7293 spill
    instructions in the forward), and add a shift, an ``and`` and a select per logit and
    little else (Triton 3.9: +616 in each, of 3216 and 3208)."""
    logits = 2 * 128  # two epilogue copies (interior, edge) of a thread's 128 logits
    for name in ("fwd_stats", "bwd_dlogits"):
        plain, masked = sass[name], sass[name + "_support"]
        for op in ("HGMMA", "MUFU"):
            assert masked.get(op, 0) == plain.get(op, 0), (name, op, masked, plain)
        assert masked["shared"] == plain["shared"], (name, masked, plain)
        spills = masked.get("LDL", 0) + masked.get("STL", 0)
        assert spills <= plain.get("LDL", 0) + plain.get("STL", 0) + 16, (name, masked, plain)
        extra = (sum(n for op, n in masked.items() if op.isupper())
                 - sum(n for op, n in plain.items() if op.isupper()))
        assert extra <= 3 * logits, (name, extra)


def test_sampler_kernels_compile_for_sm90():
    """The sampler's tile kernels, which the CPU tests run in the interpreter only, compile for
    sm_90 in each variant their launches use; the counting kernel's bins take no tensor-core
    product (a one-hot of the bins through shared memory was 5x slower); the chunk's last move
    computes the last bin in float64 (more float64 adds than the move alone)."""
    found = json.loads(_compiled_kernels("sampler").strip().splitlines()[-1])
    assert set(found) == {"bin_counts", "bin_counts_mass", "grid_move", "grid_move_last",
                          "collect", "collect_by_bin"}, found
    for name, ops in found.items():
        assert ops.get("EXIT", 0) > 0, (name, ops)
        assert not any(op.startswith("HMMA") or op.startswith("HGMMA") for op in ops), (name, ops)
    assert found["grid_move_last"].get("DADD", 0) > found["grid_move"].get("DADD", 0) + 8
