"""Random problem data shared by both phases, and the op's keyword arguments for one rank's
shard."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from .flags import DETERMINISTIC, IGNORE_INDEX


def make_targets(gen: torch.Generator, tokens: int, vocab: int, ignore_fraction: float,
                 device: torch.device) -> torch.Tensor:
    tgt = torch.randint(0, vocab, (tokens,), generator=gen)
    if ignore_fraction > 0:
        drop = torch.rand(tokens, generator=gen) < ignore_fraction
        tgt = torch.where(drop, torch.full_like(tgt, IGNORE_INDEX), tgt)
    return tgt.to(device)


def make_support(gen: torch.Generator, target: torch.Tensor, vocab: int, k: int) -> torch.Tensor:
    """A sampler's support per token: ``[T, k]`` distinct global ids, the target among them, in a
    random order (an ignored token's row: ``-1``), on the targets' device."""
    tokens = target.shape[0]
    scores = torch.rand(tokens, vocab, generator=gen)
    tgt = target.cpu()
    kept = tgt != IGNORE_INDEX
    rows = torch.arange(tokens)[kept]
    scores[rows, tgt[kept]] = 2.0  # (the target is always among the k largest)
    ids = scores.topk(k, dim=1).indices
    ids = ids.gather(1, torch.rand(tokens, k, generator=gen).argsort(dim=1))
    return torch.where(kept.unsqueeze(1), ids, -1).to(target.device)


def sampler_kwargs(args: argparse.Namespace) -> dict:
    """The sampler's parameters the flags give (``--top-k``, ``--top-p``, ``--min-p``)."""
    return {name: getattr(args, name) for name in ("top_k", "top_p", "min_p")
            if getattr(args, name) is not None}


def targets_in(gen: torch.Generator, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``target`` with each token that is not ignored redrawn among its ``mask`` ids (``[T, V]``
    bool, every row with at least one id), on the targets' device."""
    drawn = torch.multinomial(mask.double().cpu(), 1, generator=gen).squeeze(1)
    return torch.where(target.cpu() == IGNORE_INDEX, IGNORE_INDEX, drawn).to(target.device)


def op_kwargs(args: argparse.Namespace, start: int, vocab: int, group=True) -> dict:
    """The op's keyword arguments for the shard starting at ``start`` (``group=False``: the whole
    vocabulary without a group, TP=1)."""
    kw = dict(tp_group=dist.group.WORLD, vocab_start_index=start,
              global_vocab_size=vocab) if group else {}
    if args.deterministic != "off":
        kw["deterministic"] = DETERMINISTIC[args.deterministic]
    if args.temperature != 1.0:
        kw["temperature"] = args.temperature
    if args.entropy:
        kw["return_entropy"] = True
    if args.ignore_fraction > 0:
        kw["ignore_index"] = IGNORE_INDEX
    if args.sequence_parallel:
        kw["sequence_parallel"] = True
    if args.support_k is not None or sampler_kwargs(args):
        kw["return_lse"] = True
    kw.update(sampler_kwargs(args))
    return kw


def token_rows(args: argparse.Namespace, rank: int, world: int, tokens: int) -> slice:
    """The rows of the tokens this rank passes as hidden: all of them, or with
    ``--sequence-parallel`` its contiguous slice (rank-major; a count that does not divide is passed
    as is, for the op to refuse)."""
    if not args.sequence_parallel or tokens % world:
        return slice(0, tokens)
    n = tokens // world
    return slice(rank * n, (rank + 1) * n)
