"""The runbook script (tests/linear_logp_tp.py, the entry of tplogp.runbook) under torchrun: output, status.

Each launch is a few seconds on gloo with small shapes. Under torchrun, rank 0 alone reports and carries the
verdict in its exit status, so torchrun's failure report lists one rank and no Python traceback comes from
this program for a user error (torchrun's own ChildFailedError traceback is the only one).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import tplogp
from tplogp.runbook.flags import UsageError, build_parser, parse_args

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "linear_logp_tp.py")
SMALL = ("--dtype", "fp32", "--tokens", "16", "--hidden-size", "16", "--vocab-size", "64")
# a traceback frame in tplogp's package or the runbook script, named by their directories (a checkout
# named tplogp holds torch's files too, below its virtual environment)
OUR_FRAME = re.compile('File "(' + "|".join(re.escape(os.path.realpath(p)) for p in (
    os.path.dirname(tplogp.__file__), SCRIPT)) + ")")


def torchrun(*args: str, nproc: int = 2, entry: tuple = (SCRIPT,)) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *entry,
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def assert_one_failed_rank_quietly(out: subprocess.CompletedProcess) -> None:
    """Non-zero status; torchrun's report names rank 0 only (no signalled peers); no traceback from our code."""
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert not OUR_FRAME.search(text), text
    assert text.count("Traceback (most recent call last)") <= 1, text  # torchrun's own, when present
    assert "<NO_OTHER_FAILURES>" in out.stderr and "SIGTERM" not in text, text


@pytest.mark.slow
def test_pass_output_format_progress_and_status():
    out = torchrun("--dtype", "fp32", "--tokens", "32", "--hidden-size", "48", "--vocab-size", "301",
                   "--uneven-shards", "--run-stress", "--stress-tokens", "64", "--stress-hidden-size", "32",
                   "--stress-vocab-size", "512", "--stress-steps", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "[correctness]\n  dtype=torch.float32, reference_mode=fp32, atol=1e-05, rtol=1e-05\n" in text
    assert "  tokens=32, hidden=48, vocab=301\n" in text
    bounds = [int(x) for x in re.search(r"shard_boundaries=\[(.*)\]", text).group(1).split(",")]
    sizes = [end - start for start, end in zip(bounds, bounds[1:])]
    assert bounds[0] == 0 and bounds[-1] == 301 and len(set(sizes)) > 1, f"not an uneven partition: {bounds}"
    for metric in ("output", "hidden_grad", "weight_grad", "bias_grad"):
        assert re.search(rf"  PASS {metric}: max_abs=\S+, max_rel=\S+\n", text), metric
    # progress: one line per step, in order, printed once (rank 0), with the time left until the last
    steps = re.findall(r"^  step (0 \(warm-up\)|\d+/2): [\d.]+ ms(, about [\d.]+ (s|min) left)?$", text, re.M)
    assert [s[0] for s in steps] == ["0 (warm-up)", "1/2", "2/2"], text
    assert [bool(s[1]) for s in steps] == [True, True, False], text
    assert "[stress]" in text and "  finite=PASS\n" in text
    assert re.search(r"  max_rank_elapsed_ms=[\d.]+ ", text)
    assert re.search(r"  max_rank_peak_memory_gb=[\d.]+ ", text)
    assert text.rstrip().endswith("[result]\n  PASS")


@pytest.mark.slow
def test_module_entry_with_sequence_parallel_passes_with_the_same_output():
    """``-m tplogp.runbook`` runs the same program as the script; --sequence-parallel: each rank passes its slice of
    the tokens; the same checks and result lines."""
    out = torchrun("--dtype", "fp32", "--tokens", "32", "--hidden-size", "48", "--vocab-size", "301", "--uneven-shards",
                   "--ignore-fraction", "0.2", "--sequence-parallel", "--run-stress", "--stress-tokens", "64",
                   "--stress-hidden-size", "32", "--stress-vocab-size", "512", "--stress-steps", "1",
                   entry=("-m", "tplogp.runbook"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "  sequence_parallel=True\n" in out.stdout
    for metric in ("output", "hidden_grad", "weight_grad", "bias_grad"):
        assert re.search(rf"  PASS {metric}: max_abs=\S+, max_rel=\S+\n", out.stdout), metric
    assert "  finite=PASS\n" in out.stdout and out.stdout.rstrip().endswith("[result]\n  PASS")


@pytest.mark.slow
def test_fail_is_reported_once_and_exits_nonzero():
    out = torchrun("--dtype", "bf16", "--tokens", "32", "--hidden-size", "48", "--vocab-size", "301",
                   "--no-bias", "--atol", "0", "--rtol", "0")
    assert re.search(r"  FAIL (output|weight_grad|hidden_grad): max_abs=", out.stdout), out.stdout
    assert "bias_grad" not in out.stdout
    assert out.stdout.count("[result]") == 1 and out.stdout.rstrip().endswith("[result]\n  FAIL")
    assert_one_failed_rank_quietly(out)


@pytest.mark.slow
def test_bad_size_is_one_line_from_rank_0_and_never_passes():
    """A usage error (a value out of range here; an unparsable one takes the same path, a type function of the
    parser: test_every_size_and_tolerance_flag_is_checked) is one line from rank 0, without argparse's usage."""
    out = torchrun(*SMALL, "--tokens", "0")
    message = "linear_logp_tp.py: error: argument --tokens: must be a positive int, got 0\n"
    assert out.stderr.count("error: argument") == 1 and message in out.stderr, out.stderr
    assert "usage:" not in out.stderr and "PASS" not in out.stdout and "[correctness]" not in out.stdout
    assert_one_failed_rank_quietly(out)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="sm90 is unavailable only without a Hopper GPU")
def test_unavailable_source_is_one_error_line():
    out = torchrun(*SMALL, "--op-source", "sm90")
    errors = [line for line in out.stdout.splitlines() if "ERROR" in line]
    expected = "  ERROR SourceUnavailableError: fused_linear_logp_sm90 is unavailable"
    assert len(errors) == 1 and errors[0].startswith(expected), out.stdout
    assert out.stdout.rstrip().endswith("[result]\n  FAIL")
    assert_one_failed_rank_quietly(out)


@pytest.mark.parametrize("flags, message", [
    (["--tokens", "0"], "argument --tokens: must be a positive int, got 0"),
    (["--hidden-size", "-3"], "argument --hidden-size: must be a positive int, got -3"),
    (["--stress-tokens", "-1"], "argument --stress-tokens: must be a positive int, got -1"),
    (["--vocab-size", "x"], "argument --vocab-size: must be an int, got 'x'"),
    (["--stress-steps", "0"], "argument --stress-steps: must be a positive int, got 0"),
    (["--atol", "-0.1"], "argument --atol: must be a non-negative finite number, got -0.1"),
    (["--atol", "abc"], "argument --atol: must be a number, got 'abc'"),
    (["--rtol", "inf"], "argument --rtol: must be a non-negative finite number, got inf"),
    (["--rtol", "nan"], "argument --rtol: must be a non-negative finite number, got nan"),
    (["--temperature", "0"], "argument --temperature: must be a positive finite number, got 0"),
    (["--timeout-s", "-5"], "argument --timeout-s: must be a positive finite number, got -5"),
    (["--ignore-fraction", "1.5"], r"argument --ignore-fraction: must be a number in \[0, 1\], got 1.5"),
    (["--seed", "-1"], r"argument --seed: must be an int in \[0, 2\*\*62\], got -1"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
])
def test_every_size_and_tolerance_flag_is_checked(flags, message):
    with pytest.raises(UsageError, match=f"^{message}"):
        parse_args(flags)


def test_vocab_needs_one_id_per_rank(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(UsageError, match=r"^argument --vocab-size: must be at least the world size 4 .* 3$"):
        parse_args(["--vocab-size", "3"])
    parse_args(["--stress-vocab-size", "3"])  # not checked without --run-stress
    with pytest.raises(UsageError, match=r"^argument --stress-vocab-size: must be at least the world size 4"):
        parse_args(["--stress-vocab-size", "3", "--run-stress"])


def test_help_shows_every_flag_with_its_default():
    parser = build_parser()
    text = parser.format_help()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            help_text = parser._get_formatter()._get_help_string(action)
            assert "default" in help_text, action.option_strings
            assert action.option_strings[0] in text


@pytest.mark.tp(world_size=2, timeout=120)
def test_support_k_correctness_phase_on_two_ranks(tp):
    """``--support-k K``: a random support of K ids per token (its target among them) passed as
    ``support=``, the reference renormalized over it; the header names it and the support's lse is
    one more check line, in the other lines' format, all passing (the phase in-process on the
    plugin's ranks: no torchrun)."""
    _check_support_phase(tp, ["--support-k", "5"], "  support_k=5\n")


@pytest.mark.tp(world_size=2, timeout=120)
def test_sampler_correctness_phase_on_two_ranks(tp):
    """``--top-k K --top-p P --min-p M``: the op computes the sampler's support, the targets are
    drawn from the float64 definition's kept ids and the reference is renormalized over them; the
    header names the parameters and the support's lse is one more check line, all passing."""
    _check_support_phase(tp, ["--top-k", "7", "--top-p", "0.8", "--min-p", "0.01"],
                         "  sampler: top_k=7, top_p=0.8, min_p=0.01, kept ids per token")


def _check_support_phase(tp, flags: list[str], header: str) -> None:
    """The correctness phase in-process on the plugin's ranks (no torchrun) with ``flags`` (a
    support, given or from the sampler's parameters): it passes, rank 0's output holds ``header``
    and a PASS line, in the other lines' format, for every metric and the support's lse."""
    import contextlib
    import io

    from tplogp import get_op
    from tplogp.runbook.correctness import correctness

    args = parse_args([*SMALL, "--vocab-size", "61", "--uneven-shards", "--entropy",
                       "--ignore-fraction", "0.25", *flags])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ok = correctness(args, tp.rank, tp.world_size, torch.device("cpu"), "gloo",
                         get_op("linear_logp"))
    text = printed.getvalue()
    lines_ok = tp.rank != 0 or (
        header in text
        and all(re.search(rf"  PASS {metric}: max_abs=\S+, max_rel=\S+\n", text)
                for metric in ("output", "entropy", "hidden_grad", "weight_grad", "bias_grad",
                               "support_lse")))
    tp.assert_all(ok and lines_ok, text)


def test_sampler_flags_are_checked():
    for flags, message in ((["--top-k", "0"], "argument --top-k: must be a positive int, got 0"),
                           (["--top-p", "0"], r"argument --top-p: must be a number in \(0, 1\], "
                                              r"got 0"),
                           (["--min-p", "2"], r"argument --min-p: must be a number in \[0, 1\]"),
                           (["--top-k", "5", "--support-k", "5"],
                            "argument --top-k: not with --support-k"),
                           (["--top-p", "0.9", "--deterministic", "tp_invariant"],
                            "argument --top-p: not with --deterministic tp_invariant")):
        with pytest.raises(UsageError, match=f"^{message}"):
            parse_args(flags)


def test_support_k_is_at_most_the_vocabulary():
    with pytest.raises(UsageError, match=r"^argument --support-k: must be at most --vocab-size 64, "
                                         r"got 65$"):
        parse_args([*SMALL, "--support-k", "65"])
    with pytest.raises(UsageError, match="^argument --support-k: must be a positive int, got 0"):
        parse_args(["--support-k", "0"])
