"""The benchmark suite's CPU parts in smoke mode: each subcommand runs end to end and writes the rows it promises.

These run ``python -m benchmarks ... --smoke`` on tiny problems (in a subprocess as a user would, or, for the
single-process suites, through the same entry point in this process), then read the results file back. They check what
the rows say (the float64 errors, the gradients' size, the pool's behaviour), never how fast anything was.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import tplogp

from benchmarks import cli, impls, plots, report, runner
from tests.support import tolerances as tol
from tplogp.reference import reference_logits
from tplogp.tolerances import rel_error, slack_bound

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def _bench_here(capsys, *args: str) -> str:
    """``python -m benchmarks ARGS`` through the same entry point (:func:`benchmarks.cli.main`) in this process: the
    single-process suites, without another interpreter's imports. Returns what it printed."""
    capsys.readouterr()
    assert cli.main(list(args)) == 0
    return capsys.readouterr().out


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / runner.RESULTS_FILE).read_text().splitlines() if line.strip()]


def _no_worse(row: dict, eager: dict, keys=("err_d_hidden", "err_d_weight")) -> None:
    """The project's three-way rule: error vs float64 within tplogp.tolerances' slack of the same-dtype (bf16)
    eager baseline's, for the same contract."""
    for key in keys:
        assert row[key] <= slack_bound(eager[key], torch.bfloat16), (key, row, eager)


@pytest.mark.slow
def test_op_smoke_rows(tmp_path, capsys):
    # the native source and its fused loss at two budgets, the eager baseline, two peers that cannot run on CPU
    _bench_here(capsys, "op", "--smoke", "--impls",
                "tplogp-native,tplogp-loss-native,torch-eager,torch-eager-loss,liger-flce,quack-chunked",
                "--out", str(tmp_path))
    rows = {(r["impl"], r["budget"]): r for r in _rows(tmp_path)}
    budgets = ("default", "16KiB", "keep 100%", "chunk 16")
    assert set(rows) == {(impl, b) for impl in ("tplogp-native", "tplogp-loss-native") for b in budgets} | {
        ("torch-eager", "default"), ("torch-eager-loss", "default"), ("liger-flce", "default"),
        ("quack-chunked", "default")}
    eager, eager_loss = rows["torch-eager", "default"], rows["torch-eager-loss", "default"]
    for key in (("tplogp-native", b) for b in budgets):
        r = rows[key]
        assert r["contract"] == impls.PER_TOKEN and r["smoke"] and r["suite"] == "op" and "error" not in r, r
        for field in ("fwd_ms", "fwd_bwd_ms", "fwd_gemms", "fwd_bwd_gemms", "fwd_bwd_gemms_b2b", "gemm_ms",
                      "host_fwd_us", "host_fwd_bwd_us", "host_fwd_bwd_all_us"):
            assert r[field] > 0, (field, r)
        # the process's CPU time over the same calls counts the calling thread's (and any other thread's)
        assert r["host_fwd_bwd_all_us"] >= r["host_fwd_bwd_us"], r
        assert r["checks"] == "full", r
        # three-way: tplogp's fp32 log-softmax is no worse than the bf16-logits eager baseline against float64
        _no_worse(r, eager, ("err_logp", "err_d_hidden", "err_d_weight"))
    for budget in budgets:  # the scalar-loss contract: mean CE and its gradients vs float64, beside eager's
        r = rows["tplogp-loss-native", budget]
        assert r["contract"] == impls.SCALAR_LOSS and "error" not in r and "err_logp" not in r, r
        assert r["fwd_bwd_ms"] > 0, r
        _no_worse(r, eager_loss, ("err_loss", "err_d_hidden", "err_d_weight"))
    assert rows["tplogp-native", "16KiB"]["budget_bytes"] == 16 * 2**10
    # keep:F and chunk:C resolve per source and shape (64 x 32 x 320) through tplogp's budget helpers
    assert rows["tplogp-native", "keep 100%"]["budget_bytes"] == tplogp.keep_logits_budget(
        64, 320, source="native", device="cpu", dtype=torch.bfloat16)  # the smoke run's dtype
    for impl in ("tplogp-native", "tplogp-loss-native"):
        assert rows[impl, "chunk 16"]["budget_bytes"] == tplogp.loss_chunk_budget(
            16, 32, 320, dtype=torch.bfloat16, source="native", device="cpu")  # the smoke run's dtype, no bias
    assert rows["quack-chunked", "default"]["contract"] == impls.SCALAR_LOSS
    for key in (("liger-flce", "default"), ("quack-chunked", "default")):
        assert rows[key]["error"].startswith("unavailable: "), rows[key]
    first = rows["tplogp-native", "default"]
    for field in ("date", "device", "driver", "commit", "torch", "triton", "peers", "shape", "dtype"):
        assert field in first, field
    assert first["shape"] == "64x32x320" and first["dtype"] == "bf16"
    assert first["grads_gib"] == pytest.approx((320 * 32 + 64 * 32) * 2 / 2**30, rel=1e-3)


@pytest.mark.slow
def test_op_host_cost_column_per_checks_mode(tmp_path):
    """``--checks full,fast``: tplogp's rows once per mode (the label names a mode other than full), each with its
    host CPU microseconds per call; the eager baseline once, labelled ``full``. Every row has both host columns,
    positive and finite (their sizes are measurements, compared in benchmarks, never in tests). In process, each
    row's calls really run under its mode: a stub implementation records ``tplogp.op.validation.checks_mode()``."""
    proc = _bench("op", "--smoke", "--impls", "tplogp-native,torch-eager", "--budgets", "default", "--checks",
                  "full,fast", "--no-check", "--out", str(tmp_path))
    rows = {(r["impl"], r["budget"]): r for r in _rows(tmp_path)}
    assert set(rows) == {("tplogp-native", "default"), ("tplogp-native", "default, checks fast"),
                         ("torch-eager", "default")}, rows
    assert [rows["tplogp-native", b]["checks"] for b in ("default", "default, checks fast")] == ["full", "fast"]
    assert rows["torch-eager", "default"]["checks"] == "full"
    for r in rows.values():
        assert "error" not in r, r
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("host_fwd_us", "host_fwd_bwd_us",
                                                                "host_fwd_bwd_all_us")), r
    assert " host " in proc.stdout and "(all threads " in proc.stdout

    # In process: each row's implementation sees its row's mode in every call (check, timing, host cost, memory)
    from benchmarks import op
    from tplogp.op.validation import checks_mode

    seen: list[list[str]] = []  # the modes seen by each built function, in build order (= row order)

    def build(device, budget):
        modes: list[str] = []
        seen.append(modes)

        def logp(h, w, y):
            modes.append(checks_mode())
            return (h @ w.T).float().log_softmax(-1).gather(1, y[:, None]).squeeze(1)
        return logp

    stubs = [impls.Impl("budgeted", impls.PER_TOKEN, True, build, "reads the mode"),
             impls.Impl("peer", impls.PER_TOKEN, False, build, "ignores the mode")]
    op_rows = op.bench_shape((4, 8, 16), stubs, [runner.BudgetSpec("default")], "fp32", torch.device("cpu"),
                             reps=1, rounds=1, warm_ms=0.0, check=True, checks=("full", "fast"))
    assert [(r["impl"], r["budget"], r["checks"]) for r in op_rows] == [
        ("budgeted", "default", "full"), ("budgeted", "default, checks fast", "fast"), ("peer", "default", "full")]
    assert all("error" not in r for r in op_rows), op_rows
    assert len(seen) == 3 and all(modes and set(modes) == {r["checks"]} for modes, r in zip(seen, op_rows)), seen


def test_policy_loss_rows():
    """The GSPO and DAPO steps beside the plain fused cross-entropy, in process on the smallest problem (8 sequences
    of 4 tokens) at two budgets (one chunk; chunks of 8 tokens, the sequence-level loss's two phases): each row's
    loss and gradients against the float64 definition of its own loss, no worse than the same loss composed on the
    bf16 logits in eager PyTorch; each tplogp row's time over the cross-entropy row's of its budget."""
    from benchmarks import op

    chosen = impls.select("tplogp-loss-native,tplogp-gspo-native,tplogp-dapo-native,torch-eager-gspo,"
                          "torch-eager-dapo")
    budgets = [runner.BudgetSpec("default"), runner.parse_budget_spec("chunk:8")]
    rows = op.bench_shape((32, 16, 96), chosen, budgets, "bf16", torch.device("cpu"), reps=1, rounds=1,
                          warm_ms=0.0, check=True)
    by = {(r["impl"], r["budget"]): r for r in rows}
    assert set(by) == {(i, b) for i in ("tplogp-loss-native", "tplogp-gspo-native", "tplogp-dapo-native")
                       for b in ("default", "chunk 8")} | {("torch-eager-gspo", "default"),
                                                           ("torch-eager-dapo", "default")}, set(by)
    assert all("error" not in r for r in rows), [r.get("error") for r in rows]
    for name in ("gspo", "dapo"):
        eager = by[f"torch-eager-{name}", "default"]
        assert eager["contract"] == impls.POLICY_LOSS and "vs_cross_entropy" not in eager, eager
        for budget in ("default", "chunk 8"):
            r, ce = by[f"tplogp-{name}-native", budget], by["tplogp-loss-native", budget]
            assert r["contract"] == impls.POLICY_LOSS and "err_logp" not in r, r
            assert r["budget_bytes"] == ce["budget_bytes"], (r, ce)  # the same budget as the row it is compared to
            _no_worse(r, eager, ("err_loss", "err_d_hidden", "err_d_weight"))
            for key in ("", "_b2b"):
                assert r["vs_cross_entropy" + key] == round(r["fwd_bwd_ms" + key] / ce["fwd_bwd_ms" + key], 4), r
            assert "x CE" in op.format_row(r) and "x CE" in report._contract_cell(r)
            # scored against its own loss's definition (the fp32 GRPO bound; against another loss it would be O(1))
            assert r["err_loss"] <= tol.REL_FP32_GRPO, r


def test_policy_loss_definitions():
    """benchmarks.policy's eager losses are TRL's GSPO and DAPO: tplogp's losses.grpo of the same recipe gives the
    same value on the same log-probs (fp32 inputs, the eager loss on their float64 log-probs)."""
    from benchmarks import policy

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(32, 16, generator=g), torch.randn(96, 16, generator=g) / 4
    y = torch.randint(0, 96, (32,), generator=g)
    inputs = policy.make_inputs(h, w, y)
    assert inputs.layout == (8, 4) and policy.layout(30) == (1, 30)
    logp = torch.log_softmax(h.double() @ w.double().T, -1).gather(1, y[:, None])[:, 0]
    for name in policy.LOSSES:
        ours = tplogp.linear_logp_loss(h.view(8, 4, 16), w, y.view(8, 4), loss=tplogp.losses.grpo(
            **policy.LOSSES[name][0]), per_token=(inputs.advantages, inputs.old_logp), source="native")
        eager = policy.eager_loss(name, logp.view(8, 4), inputs.advantages, inputs.old_logp)
        assert abs(ours.item() - eager.item()) <= tol.GRPO_LOSS.atol + tol.GRPO_LOSS.rtol * abs(eager.item()), (
            name, ours, eager)
    sequence, token = (policy.eager_loss(name, logp.view(8, 4), inputs.advantages, inputs.old_logp)
                       for name in ("gspo", "dapo"))
    assert sequence.item() != token.item()
    # a mask: positions that do not count change nothing (their log-probs set to anything)
    mask = torch.ones(8, 4)
    mask[::3, 2:] = 0
    moved = torch.where(mask > 0, logp.view(8, 4), logp.view(8, 4) - 5.0)
    for name in policy.LOSSES:
        assert torch.equal(policy.eager_loss(name, logp.view(8, 4), inputs.advantages, inputs.old_logp, mask),
                           policy.eager_loss(name, moved, inputs.advantages, inputs.old_logp, mask)), name


def _eager_errors(h, w, y, gy, truth: dict, key: str = None, *, softcap=None, label_smoothing=0.0, z_loss=0.0):
    """The same-dtype eager reference's errors against ``truth`` (:func:`benchmarks.op.float64_truth`) for the same
    math: logits in the input dtype, capped and log-softmaxed in fp32; the per-token logp (``key`` None) or the
    mean ``F.cross_entropy(label_smoothing=...)`` plus z-loss (``key``: the truth's loss)."""
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    z = reference_logits(hg, wg, mode="matching", softcap=softcap)
    if key is None:
        out = z.log_softmax(-1).gather(1, y[:, None])[:, 0]
        out.backward(gy)
        names = ("logp", "dh", "dw")
    else:
        out = torch.nn.functional.cross_entropy(z, y, label_smoothing=label_smoothing) + z_loss * z.logsumexp(
            -1).square().mean()
        out.backward()
        names = ("loss:" + key, "dh:" + key, "dw:" + key)
    errs = [rel_error(x, truth[n]) for x, n in zip((out, hg.grad, wg.grad), names)]
    return dict(zip(("err_logp" if key is None else "err_loss", "err_d_hidden", "err_d_weight"), errs))


# A cap of 1 near these logits' scale (std ~0.5): the capped math is far from the plain one (a cap of 30 moves them
# by less than the bf16 reference's own error, so a row scored against the plain truth would pass too). Sharper
# caps saturate, where a keep-all call's slope, rebuilt from the bf16 kept terms, loses to the eager reference
# (cap 0.5: d_hidden 5.4e-3 against eager's 3.0e-3 at this shape).
VARIANTS = "softcap=1,deterministic=true,deterministic=tp_invariant,label_smoothing=0.1+z_loss=1e-4"


def test_variant_rows(tmp_path):
    """``--variants`` on the smoke shape in process, keep-all: each tplogp row (linear_logp, the fused cross-entropy)
    gets one row per variant that applies to it, scored against the float64 truth of its own math within the
    three-way slack of the same-dtype eager reference of that math (the deterministic levels: of the plain math),
    with its time over the plain row's of the same budget."""
    from benchmarks import op, variants

    shape, cpu = runner.parse_shapes(cli.OP_SMOKE_SHAPES)[0], torch.device("cpu")
    chosen = impls.select("tplogp-native,tplogp-loss-native,torch-eager,torch-eager-loss")
    rows = op.bench_shape(shape, chosen, [runner.parse_budget_spec("keep:1")], "bf16", cpu, reps=1, rounds=1,
                          warm_ms=0.0, check=True, variants=tuple(variants.parse_variants(VARIANTS)))
    assert all("error" not in r for r in rows), [(r["budget"], r.get("error")) for r in rows]
    by = {(r["impl"], r["budget"]): r for r in rows}
    labels = {"tplogp-native": ("softcap=1", "deterministic=true", "deterministic=tp_invariant"),
              "tplogp-loss-native": ("softcap=1", "deterministic=true", "deterministic=tp_invariant",
                                     "label_smoothing=0.1+z_loss=0.0001")}
    assert set(by) == {(impl, "keep 100%" + suffix) for impl, own in labels.items()
                       for suffix in ("", *(", " + v for v in own))} | {("torch-eager", "default"),
                                                                        ("torch-eager-loss", "default")}, set(by)

    h, w, y, gy = op.make_problem(*shape, torch.bfloat16, cpu)
    capped = op.float64_truth(h, w, y, gy, {"ce": lambda s: variants.float64_cross_entropy(s)}, softcap=1.0)
    smoothed = op.float64_truth(h, w, y, gy, {"s": lambda s: variants.float64_cross_entropy(s, 0.1, 1e-4)},
                                per_token=False)
    eager = {(impl, v): by["torch-eager" + ("-loss" if "loss" in impl else ""), "default"]
             for impl, own in labels.items() for v in own[1:3]}  # the deterministic levels: the plain math's
    eager["tplogp-native", "softcap=1"] = _eager_errors(h, w, y, gy, capped, softcap=1.0)
    eager["tplogp-loss-native", "softcap=1"] = _eager_errors(h, w, y, gy, capped, "ce", softcap=1.0)
    eager["tplogp-loss-native", labels["tplogp-loss-native"][3]] = _eager_errors(
        h, w, y, gy, smoothed, "s", label_smoothing=0.1, z_loss=1e-4)
    for impl, own in labels.items():
        plain = by[impl, "keep 100%"]
        assert "variant" not in plain and "vs_plain" not in plain, plain
        for label in own:
            r = by[impl, f"keep 100%, {label}"]
            assert r["variant"] == label and r["budget_bytes"] == plain["budget_bytes"], (r, plain)
            for key in ("", "_b2b"):
                assert r["vs_plain" + key] == round(r["fwd_bwd_ms" + key] / plain["fwd_bwd_ms" + key], 4), r
            errors = [k for k in ("err_logp", "err_loss", "err_d_hidden", "err_d_weight") if k in r]
            assert len(errors) == 3 and all(math.isfinite(r[k]) for k in errors), r
            _no_worse(r, eager[impl, label], errors)
            assert "x plain" in op.format_row(r) and "x plain" in report._contract_cell(r)
    # the check can fail: the capped and the smoothed truths are far from the plain ones, beyond the bounds above
    # (the smoothed loss's value is not: near-uniform rows' smoothing moves the mean loss by ~1e-5 of itself)
    plain_truth = op.float64_truth(h, w, y, gy, {"ce": lambda s: variants.float64_cross_entropy(s)})
    smoothing = eager["tplogp-loss-native", labels["tplogp-loss-native"][3]]
    for ours, theirs, error in ((capped["logp"], plain_truth["logp"], eager["tplogp-native", "softcap=1"]["err_logp"]),
                                (capped["dw"], plain_truth["dw"], eager["tplogp-native", "softcap=1"]["err_d_weight"]),
                                (smoothed["dw:s"], plain_truth["dw:ce"], smoothing["err_d_weight"])):
        assert rel_error(theirs, ours) > 10 * slack_bound(error, torch.bfloat16)
    # the Pareto plot leaves them out (a point per implementation and budget; they are in the shape's table)
    variant_rows = [dict(r, extra_peak_gib=0.1) for r in rows if "variant" in r]  # as if measured on a GPU
    assert len(variant_rows) == 7 and plots.pareto(variant_rows, str(tmp_path / "pareto.png")) is False


@pytest.mark.slow
def test_variants_flag_smoke(tmp_path, capsys):
    """``op --smoke --variants``: the variant rows reach the results file and the printed table."""
    printed = _bench_here(capsys, "op", "--smoke", "--impls", "tplogp-native,tplogp-loss-native", "--budgets",
                          "keep:1", "--reps", "1", "--variants", "softcap=1,label_smoothing=0.1+z_loss=1e-4", "--out",
                          str(tmp_path))
    rows = {(r["impl"], r["budget"]): r for r in _rows(tmp_path)}
    assert set(rows) == {("tplogp-native", "keep 100%"), ("tplogp-native", "keep 100%, softcap=1"),
                         ("tplogp-loss-native", "keep 100%"), ("tplogp-loss-native", "keep 100%, softcap=1"),
                         ("tplogp-loss-native", "keep 100%, label_smoothing=0.1+z_loss=0.0001")}, set(rows)
    for r in rows.values():
        assert r["smoke"] and "error" not in r, r
        assert ("variant" in r) == (", " in r["budget"]) == ("vs_plain_b2b" in r), r
        assert all(math.isfinite(r[k]) for k in ("err_d_hidden", "err_d_weight")), r
    assert printed.count(" | x plain ") == 3, printed


def test_variant_ratios_pair_rows_of_one_budget():
    """``vs_plain`` pairs a variant row with the same implementation, budget and checks mode without the variant;
    a policy row's variant has its ``vs_cross_entropy`` over the fused cross-entropy's row of the same variant."""
    from benchmarks import op

    def row(impl, budget, ms, variant=None, contract=impls.SCALAR_LOSS, checks="full"):
        r = dict(impl=impl, budget=budget, checks=checks, contract=contract, fwd_bwd_ms=ms, fwd_bwd_ms_b2b=ms / 2)
        return r if variant is None else dict(r, variant=variant)

    rows = [row("tplogp-loss-sm90", "keep 100%", 2.0), row("tplogp-loss-sm90", "keep 100%, softcap=30", 2.2, "softcap=30"),
            row("tplogp-loss-sm90", "default", 4.0), row("tplogp-loss-sm90", "default, checks fast", 3.0, checks="fast"),
            row("tplogp-loss-sm90", "default, checks fast, softcap=30", 3.3, "softcap=30", checks="fast"),
            row("tplogp-gspo-sm90", "keep 100%", 2.5, contract=impls.POLICY_LOSS),
            row("tplogp-gspo-sm90", "keep 100%, softcap=30", 2.75, "softcap=30", contract=impls.POLICY_LOSS)]
    op._ratios(rows)
    ratios = [(r.get("vs_plain"), r.get("vs_plain_b2b"), r.get("vs_cross_entropy")) for r in rows]
    assert ratios == [(None, None, None), (1.1, 1.1, None), (None, None, None), (None, None, None), (1.1, 1.1, None),
                      (None, None, 1.25), (1.1, 1.1, 1.25)], ratios
    assert "x CE 1.250 / 1.250, x plain 1.100 / 1.100" in report._contract_cell(rows[-1])


def test_variant_parsing_and_float64_loss(tmp_path):
    """``--variants`` syntax: options joined by ``+``, canonical labels, typed errors; which rows a variant applies
    to; the float64 smoothed cross-entropy plus z-loss of the statistics is ``F.cross_entropy``'s of the logits."""
    from benchmarks import op, variants

    parsed = variants.parse_variants(" softcap=30, deterministic=TRUE ,deterministic=tp_invariant,"
                                     "label_smoothing=0.10+z_loss=1e-4")
    assert [v.label for v in parsed] == ["softcap=30", "deterministic=true", "deterministic=tp_invariant",
                                         "label_smoothing=0.1+z_loss=0.0001"]
    assert [v.call_options() for v in parsed] == [{"softcap": 30.0}, {"deterministic": True},
                                                  {"deterministic": "tp_invariant"}, {}]
    assert variants.parse_variants(None) == [] and variants.parse_variants("") == []
    for bad, match in (("softcap=0", "softcap takes"), ("softcap=inf", "softcap takes"), ("label_smoothing=1.5",
                       "label_smoothing takes"), ("deterministic=off", "deterministic takes"), ("softcap", "key=value"),
                       ("temperature=2", "unknown option"), ("softcap=1+softcap=2", "twice"),
                       ("softcap=1,softcap=1.0", "twice")):
        with pytest.raises(ValueError, match=match):
            variants.parse_variants(bad)
    with pytest.raises(ValueError, match="unknown option 'temperature'"):  # the flag, before anything runs
        cli.main(["op", "--smoke", "--variants", "temperature=2", "--out", str(tmp_path)])
    assert not tmp_path.joinpath(runner.RESULTS_FILE).exists()
    softcap, _, _, smoothing = parsed
    applies = {name: (softcap.applies_to(impls.BY_NAME[name]), smoothing.applies_to(impls.BY_NAME[name]))
               for name in ("tplogp-sm90", "tplogp-loss-triton", "tplogp-dapo-native", "torch-eager", "verl")}
    assert applies == {"tplogp-sm90": (True, False), "tplogp-loss-triton": (True, True),
                       "tplogp-dapo-native": (True, False), "torch-eager": (False, False), "verl": (False, False)}
    g = torch.Generator().manual_seed(0)
    h, w, y = torch.randn(16, 8, generator=g), torch.randn(40, 8, generator=g), torch.randint(0, 40, (16,), generator=g)
    truth = op.float64_truth(h, w, y, torch.zeros(16), {"s": lambda s: variants.float64_cross_entropy(s, 0.1, 1e-4)},
                             softcap=3.0, per_token=False)
    z = 3.0 * torch.tanh(h.double() @ w.double().T / 3.0)
    expected = torch.nn.functional.cross_entropy(z, y, label_smoothing=0.1) + 1e-4 * z.logsumexp(-1).square().mean()
    assert truth["loss:s"].item() == pytest.approx(expected.item(), rel=1e-13)


def test_support_variant_rows(tmp_path, capsys):
    """``op --smoke --variants support=...``: the plain call and one row per support, each with its support's width
    and union size (printed too; shared supports a smaller union than disjoint ones), scored against the float64
    truth renormalized over the support (the library's support reference's), within the three-way slack of the
    same-dtype reference of that math; its time over the plain call's."""
    from benchmarks import op, supports, variants
    from tplogp.testing.reference import reference_support_outputs

    labels = ("support=K4-shared", "support=K4-disjoint")
    printed = _bench_here(capsys, "op", "--smoke", "--impls", "tplogp-native,tplogp-loss-native", "--budgets",
                          "default", "--reps", "1", "--variants", ",".join(labels), "--out", str(tmp_path))
    rows = {(r["impl"], r["budget"]): r for r in _rows(tmp_path)}
    assert set(rows) == {(impl, "default" + suffix) for impl in ("tplogp-native", "tplogp-loss-native")
                         for suffix in ("", *(", " + label for label in labels))}, set(rows)
    shape = runner.parse_shapes(cli.OP_SMOKE_SHAPES)[0]
    T, _, V = shape
    h, w, y, gy = op.make_problem(*shape, torch.bfloat16, torch.device("cpu"))
    plain_truth = op.float64_truth(h, w, y, gy, {})
    unions = {}
    for label in labels:
        variant = variants.parse_variant(label)
        support = supports.make_support(y, V, variant.support_k, variant.support_kind)
        truth = op.float64_truth(h, w, y, gy, {"ce": lambda s: variants.float64_cross_entropy(s)}, support=support)
        # the harness's truth is the library's definition of the renormalized logp, and far from the plain one
        defined = reference_support_outputs(h, w, y, support, mode="float64").logp
        assert torch.allclose(truth["logp"], defined, rtol=1e-12, atol=1e-12)
        eager = {}  # the same-dtype reference (bf16 logits, fp32 renormalized log-softmax), per contract
        for impl, key in (("tplogp-native", None), ("tplogp-loss-native", "ce")):
            hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
            out = reference_support_outputs(hg, wg, y, support, mode="matching").logp
            out = out if key is None else -out.mean()
            out.backward(gy if key is None else None)
            names = ("logp", "dh", "dw") if key is None else ("loss:ce", "dh:ce", "dw:ce")
            eager[impl] = {k: rel_error(x, truth[n]) for k, x, n in zip(
                ("err_logp" if key is None else "err_loss", "err_d_hidden", "err_d_weight"),
                (out, hg.grad, wg.grad), names)}
        bound = 10 * slack_bound(eager["tplogp-native"]["err_logp"], torch.bfloat16)
        assert rel_error(plain_truth["logp"], truth["logp"]) > bound
        for impl in ("tplogp-native", "tplogp-loss-native"):
            plain, r = rows[impl, "default"], rows[impl, f"default, {label}"]
            assert "support_union" not in plain and "error" not in r and r["smoke"], r
            assert r["variant"] == label and r["support"] == label.split("=")[1] and r["support_k"] == 4, r
            assert r["support_union"] == supports.union_size(support), r
            unions[variant.support_kind] = r["support_union"]
            assert f"| union {r['support_union']} |" in op.format_row(r)
            for key in ("", "_b2b"):
                assert r["vs_plain" + key] == round(r["fwd_bwd_ms" + key] / plain["fwd_bwd_ms" + key], 4), r
            assert r["extra_peak_gib"] is None or r["extra_peak_gib"] >= 0, r  # (no allocator peak on CPU)
            _no_worse(r, eager[impl], tuple(eager[impl]))
    # shared: 8 sequences' pools of 16 ids plus the targets; disjoint: 4 ids per token, 256 of the 320 ids
    distinct_targets = y.unique().numel()
    assert distinct_targets <= unions["shared"] <= 8 * supports.POOL_FACTOR * 4 + distinct_targets, unions
    assert 0.75 * T * 4 <= unions["disjoint"] <= V and unions["shared"] < unions["disjoint"], unions
    assert printed.count(" | union ") == 4 and printed.count(" | x plain ") == 4, printed


def test_supports_and_their_unavailable_sources(tmp_path):
    """The supports the variants pass: ``K`` distinct ids per token in range, holding its target; a shared
    support's union bounded by its pools, a disjoint one's as large as the vocabulary allows. A source that cannot
    run a call with a support is unavailable for it (its row says why), and the parser refuses what the op
    refuses."""
    from benchmarks import supports, variants

    g = torch.Generator().manual_seed(3)
    T, V = 256, 5000
    y = torch.randint(0, V, (T,), generator=g)
    for kind in supports.KINDS:
        for k in (1, 8, 64):
            ids = supports.make_support(y, V, k, kind)
            assert ids.shape == (T, k) and ids.dtype == torch.int64 and 0 <= int(ids.min()) <= int(ids.max()) < V
            assert (ids == y[:, None]).any(1).all(), (kind, k)
            assert (ids.sort(1).values.diff(dim=1) > 0).all(), (kind, k)  # each id once per token
            union = supports.union_size(ids)
            if kind == "shared":
                assert union <= 8 * supports.POOL_FACTOR * k + y.unique().numel(), (k, union)
            else:
                assert union >= 0.9 * min(T * k, V), (k, union)
    assert supports.make_support(y[:8], 6, 64, "disjoint").shape == (8, 6)  # K past V: the whole vocabulary
    with pytest.raises(ValueError, match="kind must be one of"):
        supports.make_support(y, V, 4, "nested")

    support = supports.make_support(y[:8], V, 4, "shared")
    with pytest.raises(impls.ImplUnavailable):  # (no Hopper device here)
        impls.BY_NAME["tplogp-loss-sm90"].build(torch.device("cpu"), None,
                                                variant=variants.parse_variant("support=K4-shared"),
                                                support=support)
    from tplogp.backends.kernel_registry import get_backend

    with pytest.MonkeyPatch.context() as mp:  # where the triton source runs, it runs a support
        mp.setattr(get_backend("triton"), "unavailable_reason", lambda device: None)
        triton_row = impls.BY_NAME["tplogp-triton"]
        assert triton_row.build(torch.device("cpu"), None, support=support) is not None
        # a source that named the feature missing would be unavailable for it, with its reason
        mp.setattr(get_backend("triton"), "missing_features", {"support": "no support= here"},
                   raising=False)
        with pytest.raises(impls.ImplUnavailable, match="support"):
            impls.BY_NAME["tplogp-triton"].build(torch.device("cpu"), None, support=support)
        assert impls.BY_NAME["tplogp-triton"].build(torch.device("cpu"), None) is not None
    parsed = variants.parse_variants("support=k64-Shared,support=K512-disjoint+softcap=30")
    assert [(v.label, v.support_k, v.support_kind) for v in parsed] == [
        ("support=K64-shared", 64, "shared"), ("support=K512-disjoint+softcap=30", 512, "disjoint")]
    assert parsed[1].call_options() == {"softcap": 30.0}  # (the support is the builders' argument)
    # (with the tensor-parallel-invariant level the native source runs it)
    invariant = variants.parse_variant("support=K8-shared+deterministic=tp_invariant")
    assert invariant.call_options() == {"deterministic": "tp_invariant"}
    for bad, match in (("support=64", "support takes"), ("support=K0-shared", "support takes"),
                       ("support=K8-nested", "support takes"), ("support=K8-shared+label_smoothing=0.1", "refuses")):
        with pytest.raises(ValueError, match=match):
            variants.parse_variants(bad)


def test_sampler_variants():
    """``top_k=`` / ``top_p=`` / ``min_p=`` variants: parsed to the call's keywords, refused with what
    the op refuses, unavailable on the sources that cannot mask, and timed (not scored) on the smoke shape
    beside the plain rows."""
    from benchmarks import op, variants

    labels = ["top_k=50+top_p=0.9", "min_p=0.05", "top_p=0.9", "top_p=0.9+logit_std=4"]
    parsed = variants.parse_variants(",".join(labels).replace("0.9+", "0.90+", 1))
    assert [v.label for v in parsed] == labels
    assert [v.call_options() for v in parsed] == [{"top_k": 50, "top_p": 0.9}, {"min_p": 0.05},
                                                  {"top_p": 0.9}, {"top_p": 0.9}]
    assert all(v.samples for v in parsed) and parsed[3].logit_std == 4.0
    for bad, match in (("top_k=0", "top_k takes"), ("top_k=2.5", "top_k takes"), ("top_p=0", "top_p takes"),
                       ("min_p=1.5", "min_p takes"), ("top_k=5+support=K4-shared", "do not run"),
                       ("top_p=0.9+deterministic=tp_invariant", "do not run"),
                       ("logit_std=4", "goes with top_k"),
                       ("top_p=0.9+logit_std=0", "logit_std takes")):
        with pytest.raises(ValueError, match=match):
            variants.parse_variants(bad)
    from tplogp.backends.kernel_registry import get_backend

    with pytest.MonkeyPatch.context() as mp:  # where the triton source runs, it runs them (a support)
        mp.setattr(get_backend("triton"), "unavailable_reason", lambda device: None)
        assert impls.BY_NAME["tplogp-triton"].build(torch.device("cpu"), None,
                                                    variant=parsed[0]) is not None
    shape, cpu = runner.parse_shapes(cli.OP_SMOKE_SHAPES)[0], torch.device("cpu")
    chosen = impls.select("tplogp-native,tplogp-loss-native")
    rows = op.bench_shape(shape, chosen, [runner.parse_budget_spec("default")], "fp32", cpu, reps=1, rounds=1,
                          warm_ms=0.0, check=True, variants=tuple(parsed))
    assert all("error" not in r for r in rows), [(r["budget"], r.get("error")) for r in rows]
    sampled = [r for r in rows if r.get("variant")]
    assert len(sampled) == 8 and all(r["errors"].startswith("not measured") and r["vs_plain"] > 0
                                     for r in sampled), sampled
    # the supports' sizes, from the rows' own logits: top-k keeps k (no ties in random fp32
    # logits); a wider spread narrows top-p's set
    size = {r["variant"]: (r["support_mean"], r["support_max"], r["logit_std"]) for r in sampled}
    assert size["top_k=50+top_p=0.9"][1] <= 50 and size["top_p=0.9"][2] is None, size
    assert size["top_p=0.9+logit_std=4"][0] < size["top_p=0.9"][0] / 4, size
    h, w, *_ = op.make_problem(64, 32, 320, torch.float32, cpu)
    assert (op.scaled_hidden(h, w, 4.0) @ w.T).std().item() == pytest.approx(4.0, rel=1e-5)
    assert all("err_logp" in r or "err_loss" in r for r in rows if not r.get("variant"))


@pytest.mark.slow
def test_memory_smoke_rows(tmp_path, capsys):
    _bench_here(capsys, "memory", "--smoke", "--out", str(tmp_path))  # (its probes are processes of their own)
    rows = {r["impl"]: r for r in _rows(tmp_path)}
    assert set(rows) == {"native", "eager"}
    for r in rows.values():
        assert "error" not in r and r["finite"] and r["growth_mib"] >= 0 and r["elapsed_s"] > 0, r
        assert r["grads_mib"] == pytest.approx((256 * 64 + 2048 * 64) * 4 / 2**20, abs=0.1)
        assert r["logits_mib"] == pytest.approx(256 * 2048 * 4 / 2**20, abs=0.1)


@pytest.mark.slow
def test_plugin_smoke_rows(tmp_path):
    _bench("plugin", "--smoke", "--out", str(tmp_path))
    rows = {r["section"]: r for r in _rows(tmp_path)}
    assert set(rows) == {"dispatch", "skip"}
    assert "error" not in rows["dispatch"] and rows["dispatch"]["n_tests"] == 6, rows["dispatch"]
    assert len(rows["dispatch"]["samples_ms"]) == 6
    assert rows["skip"]["spawned_anything"] is False, rows["skip"]


def test_base_revision_is_a_temporary_worktree():
    """``--base REV``: the revision checked out into a temporary git worktree for the run (its commit, its source
    tree), gone afterwards, also when the run fails; an unknown revision is one clear error. (The runs on both sides
    and the printed ratios: the source-folder test below, which takes the same path after this step.)"""
    from benchmarks import ab

    if shutil.which("git") is None or subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                                     capture_output=True).returncode != 0:
        pytest.skip("--base needs a git checkout")

    def worktrees() -> str:
        return subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout

    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    with pytest.raises(KeyError):
        with ab.base_tree("HEAD") as (tree, tmp):
            assert os.path.isfile(os.path.join(tree, "src", "tplogp", "__init__.py")) and os.path.isdir(tmp)
            assert tree in worktrees() and runner.source_commit(tree).startswith(head)
            raise KeyError("the run fails")
    assert not os.path.exists(tree) and not os.path.exists(tmp) and "tplogp-base-" not in worktrees()
    with pytest.raises(RuntimeError, match="git worktree add no-such-revision failed"):
        with ab.base_tree("no-such-revision"):
            pass
    assert "tplogp-base-" not in worktrees()


@pytest.mark.slow
def test_base_takes_a_source_folder_runs_both_sides_and_prints_ratios(tmp_path):
    """A machine whose copy of the repository has no git history compares against an exported tree: both sides
    run, every row is tagged with its side, and the ratios are printed."""
    base = tmp_path / "base"
    shutil.copytree(os.path.join(ROOT, "src"), base / "src", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    proc = _bench("op", "--smoke", "--impls", "tplogp-native", "--budgets", "default", "--no-check", "--base",
                  str(base), "--out", str(out))
    rows = _rows(out)
    assert sorted(r["ab"]["side"] for r in rows) == ["base", "this"]
    assert all(r["impl"] == "tplogp-native" and r["fwd_bwd_ms"] > 0 for r in rows), rows
    assert "fwd_bwd_ms" in proc.stdout and "= " in proc.stdout.split("# A/B:")[-1]
    assert "(spread 0% / 0%)" in proc.stdout.split("# A/B:")[-1]  # one round per side: no spread
    assert base.joinpath("src", "tplogp", "__init__.py").is_file()  # the given folder is left alone


def _op_row(impl, budget="default", **extra):
    row = dict(suite="op", shape="64x32x320", dtype="bf16", impl=impl, budget=budget, contract=impls.PER_TOKEN,
               date="2026-01-02T00:00:00+00:00", device="GPU X", driver="1.0", torch="2", triton="3", commit="abc",
               checks="full", peers={"liger-kernel": "0.8.5"}, grads_gib=0.5, logits_gib=1.0)
    row.update(extra)
    return row


def test_a_newer_run_on_another_device_keeps_each_devices_latest_rows(tmp_path):
    """Op rows are the latest per device too: an H100 run after an H200 run shows both runs' tables (each under its
    provenance line), and the shape's plot takes one device's rows: the one with most rows, the newest on a tie."""
    timed = dict(fwd_ms=1.0, fwd_bwd_ms=4.0, fwd_gemms=1.1, fwd_bwd_gemms=4.2, fwd_bwd_gemms_b2b=4.1, gemm_ms=1.0,
                 extra_peak_gib=0.7)
    older = _op_row("tplogp-sm90", **dict(timed, device="GPU Y", fwd_bwd_ms=6.0, date="2026-01-01T00:00:00+00:00"))
    newer = _op_row("tplogp-sm90", **timed)
    assert plots.latest_op_rows([older, newer]) == {("64x32x320", "bf16"): [older, newer]}
    runner.append_rows(str(tmp_path), [older, newer])
    doc = tmp_path / "docs" / "performance.md"
    report.write(str(tmp_path), str(doc))
    lines = doc.read_text().splitlines()
    assert [line.split(" (driver")[0] for line in lines if line.startswith("Measured ")] == [
        "Measured 2026-01-02 on GPU X", "Measured 2026-01-01 on GPU Y"], lines
    table = [line for line in lines if line.startswith("| tplogp-sm90 |")]
    assert len(table) == 2 and "/ 4.000 |" in table[0] and "/ 6.000 |" in table[1], table
    assert plots.plot_points([older, newer]) == [newer]
    wider = [older, _op_row("torch-eager", **dict(timed, device="GPU Y", date="2026-01-01T00:00:00+00:00")), newer]
    assert plots.plot_points(wider) == wider[:2]


def test_report_shows_the_newest_ab_run_as_ratios(tmp_path):
    """A/B rows stay out of the op tables; the newest A/B run on each device is a table of its own: per row the
    medians of each side over the rounds, this / base, and their ratio, the rounds per side and their spread (an
    older A/B run on the same device is not shown)."""
    def ab_row(side, rnd, gemms, host, this="new", base="old", date="2026-01-03T00:00:00+00:00", **extra):
        return _op_row("tplogp-sm90", **dict(fwd_ms=1.0, fwd_bwd_ms=4.0, fwd_gemms=1.0, fwd_bwd_gemms=gemms,
                                             fwd_bwd_gemms_b2b=gemms - 0.1, host_fwd_bwd_us=100.0,
                                             host_fwd_bwd_all_us=host, gemm_ms=1.0, extra_peak_gib=0.5, date=date,
                                             ab=dict(side=side, round=rnd, this=this, base=base), **extra))

    older = dict(this="older", date="2026-01-01T00:00:00+00:00")
    rows = [ab_row("this", 0, 4.0, 300.0), ab_row("base", 0, 3.0, 200.0), ab_row("base", 1, 5.0, 400.0),
            ab_row("this", 1, 4.4, 500.0),
            ab_row("this", 0, 9.0, 900.0, **older), ab_row("base", 0, 9.0, 900.0, **older),
            ab_row("this", 0, 7.0, 700.0, device="GPU Y", **older),
            ab_row("base", 0, 3.5, 350.0, device="GPU Y", **older)]
    runner.append_rows(str(tmp_path), rows)
    doc = tmp_path / "docs" / "performance.md"
    report.write(str(tmp_path), str(doc))
    text = doc.read_text()
    assert "`python -m benchmarks op --base REV`" in text and "round by round" in text, text
    assert "on GPU X, torch 2, Triton 3: tplogp `new` against `old`." in text, text
    assert "on GPU Y, torch 2, Triton 3: tplogp `older` against `old`." in text, text
    assert text.index("on GPU X,") < text.index("on GPU Y,"), text  # the newest run's device first
    table = [line for line in text.splitlines() if line.startswith("| 64x32x320 | tplogp-sm90 |")]
    # medians: synced 4.2 / 4.0, b2b 4.1 / 3.9, host (all threads) 400 / 300; synced spread 0.4 / 4.2, 2 / 4
    assert table == ["| 64x32x320 | tplogp-sm90 | default | 4.200 / 4.000 (1.050) | 2: 10% / 50% | 4.100 / 3.900 (1.051) | "
                     "400 / 300 (1.333) | 0.500 / 0.500 (1.000) |",
                     "| 64x32x320 | tplogp-sm90 | default | 7.000 / 3.500 (2.000) | 1: 0% / 0% | 6.900 / 3.400 (2.029) | "
                     "700 / 350 (2.000) | 0.500 / 0.500 (1.000) |"], table
    assert "No op rows in the results file yet" in text, text  # A/B rows make no op table


def test_report_takes_the_latest_row_per_impl_and_budget(tmp_path):
    timed = dict(fwd_ms=1.0, fwd_bwd_ms=4.0, fwd_gemms=1.1, fwd_bwd_gemms=4.2, fwd_bwd_gemms_b2b=4.1, gemm_ms=1.0,
                 extra_peak_gib=0.7, err_logp=1e-7, err_d_hidden=2e-3, err_d_weight=2e-3)
    rows = [_op_row("tplogp-sm90", **dict(timed, fwd_bwd_ms=9.0, date="2026-01-01T00:00:00+00:00")),
            _op_row("tplogp-sm90", **timed),
            _op_row("tplogp-sm90", "1GiB", **dict(timed, fwd_bwd_gemms=3.1, extra_peak_gib=1.9)),
            _op_row("tplogp-sm90", **dict(timed, fwd_bwd_ms=7.0, smoke=True, date="2026-02-01T00:00:00+00:00")),
            _op_row("quack-chunked", contract=impls.SCALAR_LOSS, error="unavailable: quack is not installed"),
            _op_row("torch-eager", **dict(timed, gemm_ms=2.0, fwd_bwd_ms=5.0, commit="def", peers={},
                                          date="2025-12-01T00:00:00+00:00")),
            dict(suite="memory", shape="256x64x2048", impl="native", date="2026-01-02T00:00:00+00:00",
                 elapsed_s=0.5, growth_mib=3.0, grads_mib=0.6, logits_mib=2.0, finite=True)]
    runner.append_rows(str(tmp_path), rows)
    doc = tmp_path / "docs" / "performance.md"
    report.write(str(tmp_path), str(doc))
    text = doc.read_text()
    lines = text.splitlines()
    table = [line for line in lines if line.startswith("| tplogp-sm90 |")]
    assert len(table) == 2 and any("| 1.000 / 4.000 |" in line for line in table), table  # the latest full run's
    assert not any("/ 9.000 |" in line or "/ 7.000 |" in line for line in table)
    # one table per run, newest first, each under its one provenance line; at most 8 columns
    runs = [i for i, line in enumerate(lines) if line.startswith("Measured ")]
    assert [lines[i] for i in runs[:2]] == [
        "Measured 2026-01-02 on GPU X (driver 1.0), torch 2, Triton 3, tplogp `abc`; peers: liger-kernel 0.8.5. "
        "One GEMM: 1.000 ms.",
        "Measured 2025-12-01 on GPU X (driver 1.0), torch 2, Triton 3, tplogp `def`; no peer packages installed. "
        "One GEMM: 2.000 ms."], runs
    headers = [i for i, line in enumerate(lines) if line.startswith("| impl |")]
    assert [i - 2 for i in headers] == runs[:2], (headers, runs)
    assert lines[headers[1] + 2].startswith("| torch-eager | default |") and "| 1.000 / 5.000 |" in lines[
        headers[1] + 2], lines[headers[1] + 2]
    assert all(line.count("|") <= 9 for line in lines if line.startswith("|")), text
    assert "`quack-chunked`: unavailable: quack is not installed" in text
    assert "| 256x64x2048 | native | 0.50 | 3 |" in text
    if (tmp_path / "pareto_64x32x320_bf16.png").exists():
        assert "](../pareto_64x32x320_bf16.png)" in text


def test_budget_and_shape_parsing():
    assert runner.parse_budget("default") is None
    assert runner.parse_budget("4GiB") == 4 * 2**30 and runner.parse_budget("512MiB") == 512 * 2**20
    assert runner.budget_label(runner.parse_budget("1GiB")) == "1GiB"
    assert runner.parse_shapes("8192x4096x128256,64x32x320") == [(8192, 4096, 128256), (64, 32, 320)]
    with pytest.raises(ValueError, match="TxDxV"):
        runner.parse_shapes("8192x4096")
    with pytest.raises(ValueError, match="budget"):
        runner.parse_budget("lots")
    assert runner.parse_budget_spec("keep:0.5") == runner.BudgetSpec("keep 50%", keep=0.5)
    assert runner.parse_budget_spec("chunk:4096") == runner.BudgetSpec("chunk 4096", chunk=4096)
    assert runner.parse_budget_spec("2GiB") == runner.BudgetSpec("2GiB", nbytes=2 * 2**30)
    assert runner.parse_budget_spec("default") == runner.BudgetSpec("default")
    for bad in ("keep:2", "keep:", "chunk:0", "chunk:x", "lots"):
        with pytest.raises(ValueError, match="'keep:F'"):
            runner.parse_budget_spec(bad)
    spec = runner.parse_budget_spec("keep:1")
    # bf16 terms (2 bytes per logit) and fp32 scales (counted for 64-wide tiles when planning without the GPU)
    assert spec.resolve("triton", (8192, 4096, 128256), torch.bfloat16, torch.device("cuda")) == (
        128 * 2**20 + 8192 * 128256 * 2 + 8192 * -(-128256 // 64) * 4)
    with pytest.raises(ValueError, match="unknown implementation 'nope'"):
        impls.select("tplogp-sm90,nope")


@pytest.mark.slow
def test_tp_smoke_rows(tmp_path):
    """``tp --smoke --variants support=K8-shared,top_p=0.9+logit_std=2``: one torchrun launch per
    degree (1 and 2 gloo ranks) measures the plain call and each variant in every hidden layout,
    one row each with the slowest rank's step, its backward and host CPU time (the calling
    thread's, within the process's: same calls), and the hidden states' collective bytes per rank
    (the reduce-scatter half the all-reduce); a variant's calls are given the sampler's support
    (replicated on every rank, its union size in the row) or its parameters (the logits scaled to
    their spread); a variant that sets anything else, or a malformed one, is refused before any
    launch."""
    proc = _bench("tp", "--smoke", "--variants", "support=K8-shared,top_p=0.9+logit_std=2",
                  "--out", str(tmp_path))
    every = _rows(tmp_path)
    cases = {(r.get("variant"), r["layout"], r["tp"]): r for r in every}
    assert sorted(cases, key=str) == sorted(
        ((case, layout, p) for case in (None, "support=K8-shared", "top_p=0.9+logit_std=2")
         for layout in ("replicated", "gather-allreduce", "sequence-parallel") for p in (1, 2)),
        key=str), every
    for r in every:
        assert r["suite"] == "tp" and r["smoke"] and r["backend"] == "gloo" and "error" not in r, r
        assert r["step_ms"] > 0 and r["bwd_ms"] > 0 and r["shape"] == "64x32x320" and r["steps"] == 2, r
        assert 0 < r["host_step_us"] <= r["host_step_all_us"], r
        assert ("support_union" in r) == (r.get("variant") == "support=K8-shared"), r
        assert "variant" not in r or r["impl"].endswith(" " + r["variant"]), r
    assert all(8 <= r["support_union"] < 320 for r in every if "support_union" in r), every
    layouts = {(r["layout"], r["tp"]): r for r in every if "variant" not in r}
    # the d_hidden bytes per rank at TP=2 (64 x 32 fp32): all-reduce 2 (P - 1) / P * 4 N D, reduce-scatter half
    assert layouts["gather-allreduce", 2]["bwd_bytes_per_rank"] == 2 * 64 * 32 * 4 // 2
    assert layouts["sequence-parallel", 2]["bwd_bytes_per_rank"] == 64 * 32 * 4 // 2
    assert layouts["sequence-parallel", 2]["fwd_bytes_per_rank"] == layouts["gather-allreduce", 2]["fwd_bytes_per_rank"]
    rows = [r for r in every if r["layout"] == "replicated" and "variant" not in r]
    assert proc.stdout.count("(thread / all)") == 18, proc.stdout
    assert proc.stdout.count("support=K8-shared (union") == 6, proc.stdout
    from benchmarks import report, tp  # the report's TP table carries the host column (as a full run's rows)

    table = "\n".join(report.tp_section([dict(r, smoke=False) for r in rows]))
    assert "host µs (thread / all)" in table, table
    for r in rows:
        assert f"| {r['host_step_us']:.0f} / {r['host_step_all_us']:.0f} |" in table, table
    assert [v.label for v in tp.parse_variants("support=K64-disjoint,min_p=0.05")] == [
        "support=K64-disjoint", "min_p=0.05"]
    for text, message in (("softcap=30", "a TP row takes support, top_k"),
                          ("support=K0-shared", "support takes K<ids per token>"),
                          ("top_k=50+support=K8-shared", "do not run with support=")):
        with pytest.raises(SystemExit, match=message):
            tp.parse_variants(text)


@pytest.mark.slow
def test_floors_smoke_rows(tmp_path, capsys):
    """``floors --smoke``: one GEMM-floor row (the floor is the unit plus the two backward GEMMs, every keep-all
    timing positive) and, on the CPU, one host row per implementation with autograd's threads on; the report's
    section shows both tables with the rows' numbers."""
    printed = _bench_here(capsys, "floors", "--smoke", "--out", str(tmp_path))
    rows = _rows(tmp_path)
    gemm = [r for r in rows if r["kind"] == "gemm"]
    host = [r for r in rows if r["kind"] == "host"]
    assert len(gemm) == 1 and gemm[0]["shape"] == "64x32x320", rows
    (g,) = gemm
    assert g["suite"] == "floors" and g["smoke"] and g["unit_ms"] > 0, g
    assert g["floor_gemms"] == round(1 + g["d_hidden_gemms"] + g["d_weight_gemms"], 4), g
    for key in ("keep_all_gemms", "keep_all_gemms_b2b", "loss_keep_all_gemms", "loss_keep_all_gemms_b2b"):
        assert g[key] > 0, (key, g)
    assert sorted(r["impl"] for r in host) == ["autograd-floor", "torch-eager", "tplogp", "tplogp-loss"], host
    for r in host:
        assert r["autograd_threads"] is True and r["shape"] == "16x32x256" and r["dtype"] == "fp32", r
        assert 0 < r["host_us"] <= r["host_all_us"], r
    assert printed.count("3-GEMM floor") == 1 and printed.count("(thread / all)") == 4, printed
    section = "\n".join(report.floors_section([dict(r, smoke=False) for r in rows]))
    assert "## Floors" in section and f"| {g['floor_gemms']:.3f} |" in section, section
    for r in host:
        assert f"| {r['impl']} | on | {r['host_us']:.0f} / {r['host_all_us']:.0f} |" in section, section


def test_host_stages_smoke(capsys):
    """The stage stamps on CPU (no-op launches): every row's table lists the forward's launch program and its
    launches, the backward node, the kept d_logits launch and the markers in call order; the stamped functions and
    the real launchers are back afterwards."""
    from benchmarks import host_stages
    from tplogp.op import local_call
    from tplogp.kernels.launch import Launch

    before = (local_call.localize, Launch._through_jit, Launch.__call__)
    assert host_stages.main(["--shape", "16x32x256", "--dtype", "fp32", "--calls", "5", "--warmup", "2"]) == 0
    out = capsys.readouterr().out
    tables = out.split("== ")[1:]
    assert [t.split(":")[0] for t in tables] == ["default", "loss", "eager", "eager-loss"]
    for table in tables[2:]:  # the eager baselines: the markers alone
        assert [line.split(None, 3)[3] for line in table.splitlines()[2:]] == [
            "(forward returned)", "(backward returned)", "(synced)"]
    for table, node in zip(tables, ("linear_logp backward", "loss backward")):
        stages = [line.split(None, 3)[3] for line in table.splitlines()[2:]]
        for needed in ("program: forward", "Launch (alignment + launch)",
                       f"autograd node: {node}", "launch: d_logits (kept)"):
            assert needed in stages, (needed, stages)
        order = [stages.index(m) for m in ("(forward returned)", "(backward returned)", "(synced)")]
        assert order == sorted(order) and stages.index("program: forward") < order[0]
    assert (local_call.localize, Launch._through_jit, Launch.__call__) == before


def test_host_stages_budget(capsys):
    """``--budget`` reaches both tplogp rows: ``keep:0`` keeps nothing (the backward recomputes its logits), a
    keep-all one keeps every column (the backward reads what was kept)."""
    from benchmarks import host_stages

    for budget, launch, absent in (("keep:0", "launch: d_logits (recompute)", "launch: d_logits (kept)"),
                                   ("keep:1", "launch: d_logits (kept)", "launch: d_logits (recompute)")):
        assert host_stages.main(["--shape", "16x32x256", "--dtype", "fp32", "--rows", "default,loss", "--budget",
                                 budget, "--calls", "3", "--warmup", "1"]) == 0
        tables = capsys.readouterr().out.split("== ")[1:]
        assert len(tables) == 2, tables
        for table in tables:
            stages = [line.split(None, 3)[3] for line in table.splitlines()[2:]]
            assert launch in stages and absent not in stages, (budget, stages)


def test_device_profile_column(tmp_path, capsys):
    """``op --device-profile``: off CUDA the rows carry no device column (the kernels' times are
    the CUDA profiler's) and the run is otherwise the same; a row that has one prints the device's
    busy ms and its top kernels beside the wall time."""
    from benchmarks import op

    _bench_here(capsys, "op", "--smoke", "--impls", "tplogp-native", "--budgets", "default",
                "--reps", "1", "--no-check", "--device-profile", "--out", str(tmp_path))
    rows = _rows(tmp_path)
    assert rows and all("device_fwd_bwd_ms" not in r and "fwd_ms" in r for r in rows), rows
    gemm = "nvjet_sm90_tss_256x128_64x4_1x2_h_bz_coopA_TNT"
    r = dict(rows[0], device_fwd_bwd_ms=87.94,
             device_top=[[gemm, 14.1, 32], ["bwd_dlogits_tma_kernel", 12.04, 17]])
    assert f"| device 87.9 ms: {gemm[:28]} 14.1, bwd_dlogits_tma_kernel 12.0 |" in op.format_row(r)
    assert runner.device_profile(lambda: 1 / 0, torch.device("cpu")) is None  # (not called)
