"""The runbook's command line: flags, their defaults, and the checks every value passes before any
work.

Every size must be a positive int, every tolerance a non-negative finite number; a vocabulary must
have at least one id per rank. A bad value raises :class:`UsageError` with one line naming the flag,
the rule and the value; parsing never exits the process itself, so the caller decides which rank
prints it.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Optional, Sequence

import torch

from ..support.settings import SettingsError, launcher_env
from ..testing.tolerances import RUNBOOK_TOLERANCES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IGNORE_INDEX = -100
# --deterministic -> the op's option
DETERMINISTIC = {"off": False, "on": True, "tp_invariant": "tp_invariant"}
MAX_SEED = 2 ** 62  # the stress phase seeds seed + 100 + rank; torch generators take < 2**64


class UsageError(Exception):
    """A bad command line: one line, naming the flag and what it expects."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage and exit on every rank
        raise UsageError(message)


def _number(kind: Callable, rule: str, ok: Callable) -> Callable[[str], object]:
    name = "an int" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {name}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = rule  # argparse names the type in some messages
    return parse


positive_int = _number(int, "a positive int", lambda v: v > 0)
tolerance = _number(float, "a non-negative finite number", lambda v: math.isfinite(v) and v >= 0)
positive_finite = _number(float, "a positive finite number", lambda v: math.isfinite(v) and v > 0)
fraction = _number(float, "a number in [0, 1]", lambda v: 0.0 <= v <= 1.0)
seed_int = _number(int, "an int in [0, 2**62]", lambda v: 0 <= v <= MAX_SEED)
top_p_number = _number(float, "a number in (0, 1]", lambda v: 0.0 < v <= 1.0)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout and appends every flag's default to its help line."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.default is False:  # a switch
            return text + " (default: off)"
        return text if action.default is None else text + " (default: %(default)s)"


def build_parser(description: str = "", epilog: str = "",
                 prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description=description, epilog=epilog, formatter_class=_Formatter)
    add = p.add_argument
    add("--op-source", choices=["registry", "native", "triton", "sm90"], default="registry",
        help="registry: the registry's choice for this device; native / triton / sm90: that source, always "
             "through the shared TP path")
    add("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype")
    add("--reference-mode", choices=["fp32", "matching"], default="fp32",
        help="materialized reference upcast to fp32, or same-dtype F.linear (drift check)")
    add("--tokens", type=positive_int, default=256, help="correctness phase: tokens")
    add("--hidden-size", type=positive_int, default=512, help="correctness phase: hidden size D")
    add("--vocab-size", type=positive_int, default=8192,
        help="correctness phase: vocabulary (at least one id per rank)")
    add("--uneven-shards", action="store_true",
        help="unequal vocab shards (tests vocab_start_index handling)")
    add("--no-bias", action="store_true", help="no bias")
    add("--sequence-parallel", action="store_true",
        help="each rank passes its contiguous slice of the tokens as hidden (sequence_parallel=True; the token "
             "counts must divide by the world size); hidden_grad is checked against that slice of the reference's")
    add("--atol", type=tolerance, default=None,
        help="absolute bound of the correctness check (default: per dtype from tplogp.testing.tolerances: "
             + ", ".join(f"{k} {RUNBOOK_TOLERANCES[v].atol:g}" for k,
                         v in sorted(DTYPES.items())) + ")")
    add("--rtol", type=tolerance, default=None,
        help="relative bound of the correctness check (default: per dtype from tplogp.testing.tolerances: "
             + ", ".join(f"{k} {RUNBOOK_TOLERANCES[v].rtol:g}" for k,
                         v in sorted(DTYPES.items())) + ")")
    add("--run-stress", action="store_true",
        help="add the stress phase: a TP-only shape, no reference (finiteness, step time, peak memory)")
    add("--stress-tokens", type=positive_int, default=4096, help="stress phase: tokens")
    add("--stress-hidden-size", type=positive_int, default=2048, help="stress phase: hidden size D")
    add("--stress-vocab-size", type=positive_int, default=32768,
        help="stress phase: vocabulary (at least one id per rank)")
    add("--stress-steps", type=positive_int, default=10,
        help="stress phase: timed steps after the warm-up step")
    add("--seed", type=seed_int, default=1234, help="data seed")
    add("--backend", choices=["auto", "nccl", "gloo"], default="auto",
        help="auto: NCCL with one GPU per rank when there are enough GPUs, else gloo "
             "(gloo lets ranks share a GPU)")
    add("--temperature", type=positive_finite, default=1.0, help="logits are divided by it")
    add("--entropy", action="store_true", help="also check the per-token entropy and its gradient")
    add("--ignore-fraction", type=fraction, default=0.0,
        help=f"fraction of tokens whose target is ignore_index={IGNORE_INDEX}")
    add("--timeout-s", type=positive_finite, default=300.0, help="process-group timeout in seconds")
    add("--deterministic", choices=sorted(DETERMINISTIC), default="off",
        help="the op's deterministic option: off, on (True) or tp_invariant (the same bits at every TP degree)")
    add("--support-k", type=positive_int, default=None,
        help="correctness phase: a random sampler's support of K ids per token that holds its "
             "target (support=), the reference renormalized over it; also checks the support's "
             "lse (default: off)")
    add("--top-k", type=positive_int, default=None,
        help="correctness phase: the sampler's top_k= (the support computed inside the op, as "
             "vLLM's sampler keeps its ids), the targets drawn from the float64 definition's kept "
             "ids, the reference renormalized over them; also checks the support's lse (an id "
             "whose logit ties another's within rounding at a boundary may be kept differently; "
             "default: off)")
    add("--top-p", type=top_p_number, default=None,
        help="correctness phase: the sampler's top_p=, as --top-k (with it: both; default: off)")
    add("--min-p", type=fraction, default=None,
        help="correctness phase: the sampler's min_p=, as --top-k (with it: all; default: off)")
    add("--tp-invariance", action=argparse.BooleanOptionalAction, default=None,
        help="correctness phase: also run the whole vocabulary in-process without a group (TP=1) and check that "
             "logp (entropy) and this rank's weight / bias gradient rows are bitwise equal to it "
             "(default: on with --deterministic tp_invariant)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None, description: str = "", epilog: str = "",
               prog: Optional[str] = None) -> argparse.Namespace:
    """Parse and check the flags; fill the per-dtype tolerances. Raises :class:`UsageError`."""
    args = build_parser(description, epilog, prog).parse_args(argv)
    try:
        env = launcher_env()
    except SettingsError as exc:
        raise UsageError(str(exc)) from None
    world = 1 if env is None else env.world_size
    for flag, vocab in (("--vocab-size", args.vocab_size),) + (
            (("--stress-vocab-size", args.stress_vocab_size),) if args.run_stress else ()):
        if vocab < world:
            raise UsageError(f"argument {flag}: must be at least the world size {world} (one id per rank), "
                             f"got {vocab}")
    if args.support_k is not None and args.support_k > args.vocab_size:
        raise UsageError(f"argument --support-k: must be at most --vocab-size {args.vocab_size}, "
                         f"got {args.support_k}")
    sampler = [f for f, v in (("--top-k", args.top_k), ("--top-p", args.top_p),
                              ("--min-p", args.min_p)) if v is not None]
    if sampler and args.support_k is not None:
        raise UsageError(f"argument {sampler[0]}: not with --support-k (both give the sampler's "
                         f"support)")
    if sampler and args.deterministic == "tp_invariant":
        raise UsageError(f"argument {sampler[0]}: not with --deterministic tp_invariant (the op "
                         f"refuses it)")
    if args.tp_invariance is None:
        args.tp_invariance = args.deterministic == "tp_invariant"
    tol = RUNBOOK_TOLERANCES[DTYPES[args.dtype]]
    args.atol = tol.atol if args.atol is None else args.atol
    args.rtol = tol.rtol if args.rtol is None else args.rtol
    return args
