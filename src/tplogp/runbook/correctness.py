"""Phase ``correctness``: the TP op on this rank's shard against a materialized full-vocabulary
reference."""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from ..testing.reference import (padded_support, reference_logits, reference_outputs,
                                 reference_support_outputs, sampler_mask)
from ..support.shards import shard_boundaries, shard_range
from .flags import DTYPES, IGNORE_INDEX
from .inputs import (make_support, make_targets, op_kwargs, sampler_kwargs, targets_in,
                     token_rows)
from .launch import log0, max_over_ranks
from .report import report_checks


def correctness(args: argparse.Namespace, rank: int, world: int, device: torch.device, backend: str,
                op: Callable) -> bool:
    dtype = DTYPES[args.dtype]
    T, D, V = args.tokens, args.hidden_size, args.vocab_size
    bounds = shard_boundaries(V, world, uneven=args.uneven_shards)
    start, end = shard_range(bounds, rank)
    gen = torch.Generator().manual_seed(args.seed)
    hidden_full = (torch.randn(T, D, generator=gen) * 0.5).to(dtype)
    weight_full = (torch.randn(V, D, generator=gen) / D ** 0.5).to(dtype)
    bias_full = None if args.no_bias else (torch.randn(V, generator=gen) * 0.1).to(dtype)
    target = make_targets(gen, T, V, args.ignore_fraction, device)
    g_logp = torch.randn(T, generator=gen).to(device)
    g_ent = torch.randn(T, generator=gen).to(device)
    support = None if args.support_k is None else make_support(gen, target, V, args.support_k)
    sampler = sampler_kwargs(args)
    if sampler:  # the float64 definition's kept ids: the targets among them, the reference's
        z = reference_logits(hidden_full, weight_full, bias_full, mode="float64",
                             temperature=args.temperature)
        mask = sampler_mask(z, **sampler)
        target = targets_in(gen, target, mask)
        support = padded_support(mask).to(device)
        del z, mask
    given = None if sampler else support  # (the op computes a sampler's support itself)

    log0(rank, "[correctness]",
         f"  dtype={dtype}, reference_mode={args.reference_mode}, atol={args.atol:g}, rtol={args.rtol:g}",
         f"  tokens={T}, hidden={D}, vocab={V}",
         f"  shard_boundaries={bounds}",
         f"  source={args.op_source}, backend={backend}, device={device.type}, world_size={world}",
         *([f"  temperature={args.temperature:g}"] if args.temperature != 1.0 else []),
         *([f"  ignore_fraction={args.ignore_fraction:g}"] if args.ignore_fraction > 0 else []),
         *(["  sequence_parallel=True"] if args.sequence_parallel else []),
         *([f"  deterministic={args.deterministic}"] if args.deterministic != "off" else []),
         *([f"  support_k={args.support_k}"] if args.support_k is not None else []),
         *([f"  sampler: {', '.join(f'{k}={v:g}' for k, v in sampler.items())}, kept ids per "
            f"token {int((support >= 0).sum(1).min())}..{int((support >= 0).sum(1).max())}"]
           if sampler else []))

    # ours: this rank's shard only (and with --sequence-parallel this rank's slice of the tokens)
    rows = token_rows(args, rank, world, T)
    h = hidden_full[rows].to(device).clone().requires_grad_()
    w = weight_full[start:end].to(device).clone().requires_grad_()
    b = None if bias_full is None else bias_full[start:end].to(device).clone().requires_grad_()
    kw = op_kwargs(args, start, V)
    out = op(h, w, target, b, **kw) if given is None else op(h, w, target, b, support=given, **kw)
    logp, ent = (out.logp, out.entropy) if args.entropy else (out.logp if support is not None
                                                              else out, None)
    loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if ent is not None else 0.0)
    loss.backward()
    invariance_ok = True
    if args.tp_invariance:
        invariance_ok = tp_invariance(args, rank, device, backend, op,
                                      (hidden_full, weight_full, bias_full), target,
                                      (g_logp, g_ent), (start, end, rows), (logp, ent, h, w, b),
                                      given, support is not None)

    # reference: the full vocabulary, materialized
    hr = hidden_full.to(device).clone().requires_grad_()
    wr = weight_full.to(device).clone().requires_grad_()
    br = None if bias_full is None else bias_full.to(device).clone().requires_grad_()
    ignore_index = IGNORE_INDEX if args.ignore_fraction > 0 else None
    if support is None:
        ref = reference_outputs(hr, wr, target, br, mode=args.reference_mode,
                                temperature=args.temperature, ignore_index=ignore_index)
    else:  # renormalized over the support
        ref = reference_support_outputs(hr, wr, target, support, br, mode=args.reference_mode,
                                        temperature=args.temperature, ignore_index=ignore_index)
    ref_loss = (ref.logp * g_logp).sum() + ((ref.entropy * g_ent).sum() if ent is not None else 0.0)
    ref_loss.backward()

    checks = [("output", logp.detach(), ref.logp.detach())]
    if ent is not None:
        checks.append(("entropy", ent.detach(), ref.entropy.detach()))
    checks += [("hidden_grad", h.grad, hr.grad[rows]), ("weight_grad", w.grad, wr.grad[start:end])]
    if b is not None:
        checks.append(("bias_grad", b.grad, br.grad[start:end]))
    if support is not None:  # the lse over each token's support (tokens not ignored)
        counted = target != IGNORE_INDEX
        checks.append(("support_lse", out.lse.detach()[counted], ref.lse.detach()[counted]))
    return report_checks(checks, args.atol, args.rtol, rank, device, backend) and invariance_ok


def tp_invariance(args: argparse.Namespace, rank: int, device: torch.device, backend: str,
                  op: Callable, full, target, grads, shard, ours, support=None,
                  renormalized: bool = False) -> bool:
    """The same call on the whole vocabulary in this process, without a group (TP=1; ``shard``: this
    rank's vocabulary rows and token rows; ``support``: the call's, or None; ``renormalized``: the
    call returns a named tuple, with a support or the sampler's parameters), and the count of
    values of this rank's outputs and gradient rows that are not bitwise equal to it (summed over
    ranks); rank 0 prints ``PASS tp_invariance: bitwise equal to TP=1`` or what differs."""
    (hidden_full, weight_full, bias_full), (g_logp, g_ent), (start, end, rows) = full, grads, shard
    logp, ent, h, w, b = ours
    h1 = hidden_full.to(device).clone().requires_grad_()
    w1 = weight_full.to(device).clone().requires_grad_()
    b1 = None if bias_full is None else bias_full.to(device).clone().requires_grad_()
    kw = op_kwargs(args, 0, args.vocab_size, group=False)
    out = op(h1, w1, target, b1, **kw) if support is None else op(h1, w1, target, b1,
                                                                  support=support, **kw)
    logp1 = out.logp if args.entropy or support is not None or renormalized else out
    ent1 = out.entropy if args.entropy else None
    ((logp1 * g_logp).sum() + ((ent1 * g_ent).sum() if ent1 is not None else 0.0)).backward()
    pairs = [("logp", logp.detach(), logp1.detach()), ("weight_grad", w.grad, w1.grad[start:end])]
    if ent is not None:
        pairs.append(("entropy", ent.detach(), ent1.detach()))
    if b is not None:
        pairs.append(("bias_grad", b.grad, b1.grad[start:end]))
    differ = [float((ours_ != one).sum()) if ours_.shape == one.shape else float(one.numel())
              for _, ours_, one in pairs]
    merged = max_over_ranks(differ + [float((h.grad - h1.grad[rows]).abs().max())], device, backend)
    bad = [f"{name} {int(n)} values" for (name, _, _), n in zip(pairs, merged) if n]
    if bad:
        log0(rank,
             f"  FAIL tp_invariance: differs from TP=1 in {', '.join(bad)} (the most of any one rank)")
    else:
        log0(rank, "  PASS tp_invariance: bitwise equal to TP=1"
                   f" (hidden_grad, an fp32 all-reduce: max_abs={merged[-1]:.3g} from TP=1)")
    return not bad
