"""The backward's programs and entry point: :func:`backward` (check shapes, plan the d_logits
chunks within the budget, launch the d_logits kernel per chunk, from kept terms or recomputed, then
the cuBLAS ``d_hidden`` / ``d_W`` GEMMs), and :class:`KeptBackward`, the per-layout program of a
backward that consumes every kept term in place (the op's consuming backwards run the one their
source holds for the layout). Shared with the forward's programs (:mod:`.forward_programs`): the
launches of :mod:`.launches` and :func:`~.launch.cached`; with the invariant level's
(:mod:`.grid_programs`): the d_hidden GEMM, the d_logits launch and the per-token gradients.

No host syncs: every size used for planning is a Python int taken from tensor shapes. Each entry
point checks its tensors (:func:`.entry_checks.check_inputs`, :func:`.entry_checks.check_kept`)
unless its caller passes ``checked=True``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..support import fp32_gemm
from ..support.tensors import f32_contiguous
from . import support_bits
from .entry_checks import KernelInputError, check_inputs, check_kept
from .kept import KeptTerms
from .launch import cached
from .launches import (LogitTransform, dh_launch, dlogits_kept_launch, dlogits_launch,
                       ensure_context, tma_ok)
from .tiles import TileConfig, cdiv, dot_precision
from .workspace import plan_chunk


# ---------------------------------------------------------------------------------------------- backward


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b`` (fp32 accumulation inside the GEMM, output rounded once to ``out.dtype``)."""
    if a.is_cuda or a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    else:  # CPU low-precision GEMMs have no fp32-accumulating path into a low-precision output
        out.copy_(fp32_gemm.mm(a, b))


def backward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
             local_target: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor,
             grad_logp: torch.Tensor, grad_entropy: Optional[torch.Tensor],
             grad_lse: Optional[torch.Tensor], mean_rel: Optional[torch.Tensor],
             transform: LogitTransform, deterministic: bool, workspace_bytes: int,
             needs: tuple[bool, bool, bool], cfg: TileConfig, tma: bool = False,
             kept: Optional[KeptTerms] = None,
             d_hidden_ready: Optional[Callable[[torch.Tensor], None]] = None,
             accumulate: Optional[tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = None,
             overwrite_kept: bool = False, d_hidden_in_input_dtype: bool = False,
             checked: bool = False, grad_sum_z: Optional[torch.Tensor] = None,
             support: Optional[torch.Tensor] = None):
    """(d_hidden fp32 | None, d_weight | None, d_bias | None) for one vocab shard (``transform``:
    the forward's logit transform; ``grad_sum_z``: d loss / d sum_v z per token, or None).

    ``support``: the rows' sampler's support, shard-local ids int64 ``[N, K]`` (``-1``: none): each
    recomputed chunk masks the columns outside it (``dz = 0`` there), through the bitmask of the
    chunk's columns (:class:`.support_bits.ColumnChunks`: the ids sorted by column once, each
    chunk's bits from its own ids), which the chunk's width leaves room for in
    ``workspace_bytes``. The kept terms need none: the forward kept 0 for those columns.

    ``d_hidden_in_input_dtype`` (d_hidden is the call's whole gradient): when the shard's d_hidden
    is one GEMM (one chunk, not ``deterministic``, on CUDA), it is returned in the input dtype,
    rounded once as the GEMM stores it (fp32 accumulation inside), with no fp32 buffer and no cast;
    otherwise fp32 as usual.

    The vocab is walked in chunks whose ``[N, chunk]`` d_logits workspace fits ``workspace_bytes``
    (the transient part of the budget): first the columns ``[0, v_keep)`` whose softmax terms the
    forward kept in ``kept`` (their d_logits kernel forms p from them: no recompute GEMM), then the
    rest (recomputed; ``tma``: the Hopper kernel where legal). ``d_hidden_ready(d_hidden)`` is
    called after the last chunk's d_hidden GEMM, before its d_W GEMM. ``accumulate``: fp32
    ``(d_weight [V, D] | None, d_bias [V] | None)`` buffers that this shard's d_W / d_b are added
    to, unrounded (several token chunks of one loss), returned in their place; otherwise
    d_weight / d_bias are in the weight / bias dtype.

    ``overwrite_kept`` (the caller runs one backward per forward) with every column kept and terms
    of the weight's element size: :class:`KeptBackward` (one d_logits launch in place of the terms,
    then one full-size GEMM each).
    """
    if not checked:
        check_inputs(hidden, weight, bias, local_target)
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    need_dh, need_dw, need_db = needs
    need_db = need_db and bias is not None
    dw_acc, db_acc = accumulate if accumulate is not None else (None, None)
    if n == 0 or v == 0:
        return empty_call_grads(hidden, weight, bias, needs, accumulate, d_hidden_ready)
    if not (need_dh or need_dw or need_db):
        return None, None, None
    if not checked:
        check_kept(kept, n, v, cfg.block_v)

    # one pass over the kept terms, in their memory
    if KeptBackward.covers(kept, weight, overwrite_kept):
        program = cached(KeptBackward, n, v, hidden.dtype, None if bias is None else bias.dtype,
                         tuple(needs), grad_entropy is not None, transform, cfg,
                         dot_precision(hidden.dtype), kept.values.dtype, kept.scales.stride(0),
                         deterministic, d_hidden_in_input_dtype, hidden.is_cuda,
                         grad_sum_z is not None)
        return program(hidden, weight, bias, local_target, row_max, log_sum, grad_logp,
                       grad_entropy, grad_lse, mean_rel, kept, d_hidden_ready, accumulate,
                       grad_sum_z)
    f32 = torch.float32
    if not local_target.is_contiguous():
        local_target = local_target.contiguous()
    row_max = f32_contiguous(row_max)
    log_sum = f32_contiguous(log_sum)
    with_entropy = grad_entropy is not None
    g, gmg, ge, mean_rel = per_token_grads(grad_logp, grad_entropy, grad_lse, mean_rel)
    # the d_logits launchers' gradient of the logits' sum (None: none)
    gsz = None if grad_sum_z is None else f32_contiguous(grad_sum_z)
    v_keep = 0 if kept is None else kept.values.shape[1]
    if support is not None:  # each chunk's bitmask shares the transient budget with it
        workspace_bytes = support_bits.chunk_itemsize_budget(workspace_bytes, weight.element_size())
    chunk = plan_chunk(n, v, weight.element_size(), workspace_bytes)
    bounds = [(lo, min(lo + chunk, v_keep), True) for lo in range(0, v_keep, chunk)]
    bounds += [(lo, min(lo + chunk, v), False) for lo in range(v_keep, v, chunk)]
    num_nb = cdiv(n, cfg.bwd_block_n)
    dbp = torch.empty((num_nb, v), device=dev, dtype=f32) if need_db else g
    precision = dot_precision(hidden.dtype)
    args = (hidden, weight, bias, local_target, row_max, log_sum, g, gmg, ge, mean_rel)
    # one chunk (small shapes): no slicing; otherwise one workspace reused chunk after chunk
    ws = None if len(bounds) == 1 else torch.empty(n * chunk, device=dev, dtype=weight.dtype)
    # the recomputed chunks' bitmasks, from the support's ids sorted by column once
    recomputed = [lo for lo, _, from_kept in bounds if not from_kept]
    chunk_bits = (None if support is None or not recomputed
                  else support_bits.ColumnChunks(support, recomputed + [v]))
    d_hidden = d_weight = None
    for i_chunk, (v_lo, v_hi, from_kept) in enumerate(bounds):
        if ws is None:
            dz = torch.empty((n, v), device=dev, dtype=weight.dtype)
        else:
            dz = ws[: n * (v_hi - v_lo)].view(n, v_hi - v_lo)
        if from_kept:
            launch_dlogits_kept(kept, *args[3:], dz, dbp, v_lo, v_hi, transform, with_entropy,
                                need_db, cfg, precision, gsz=gsz)
            # the last pass that reads the scales: nothing here holds them any longer
            if v_hi == v_keep:
                kept.release_scales()
        else:
            # (the recomputed chunks come last, in order)
            bits = None if chunk_bits is None else chunk_bits.bits(
                i_chunk - len(bounds) + len(recomputed))
            launch_dlogits(*args, dz, dbp, v_lo, v_hi, transform, with_entropy, need_db, cfg,
                           precision, tma, gsz=gsz, bits=bits)
            del bits
        if i_chunk == 0:
            # Allocated after the first d_logits launch: the GPU starts sooner (host latency at
            # small shapes; the allocations themselves do no GPU work).
            dh_dtype = (hidden.dtype if d_hidden_in_input_dtype and len(bounds) == 1
                        and not deterministic
                        # (a CPU GEMM would round through an fp32 temporary)
                        and hidden.is_cuda else f32)
            d_hidden = torch.empty((n, d), device=dev, dtype=dh_dtype) if need_dh else None
            d_weight = (dw_acc if dw_acc is not None else torch.empty_like(weight)) if need_dw else None
        whole = ws is None
        w_chunk = weight if whole else weight[v_lo:v_hi]
        if d_hidden is not None:
            dh_gemm(dz, w_chunk, d_hidden, i_chunk, deterministic, cfg, precision)
            if i_chunk == len(bounds) - 1 and d_hidden_ready is not None:
                # complete: the caller may start its all-reduce under the d_W GEMM
                d_hidden_ready(d_hidden)
        if d_weight is not None:
            _dw_gemm(d_weight if whole else d_weight[v_lo:v_hi], dz, hidden, dw_acc is not None)
    return d_hidden, d_weight, _bias_grad(dbp, bias, db_acc) if need_db else None


def _dw_gemm(dw_chunk: torch.Tensor, dz: torch.Tensor, hidden: torch.Tensor,
             accumulate: bool) -> None:
    """``d_W[chunk] (+)= dz^T @ hidden``: added unrounded to an fp32 accumulator, else written in
    its dtype."""
    if accumulate:
        fp32_gemm.addmm_(dw_chunk, dz.t(), hidden)
    else:
        mm_into(dw_chunk, dz.t(), hidden)


def _bias_grad(dbp: torch.Tensor, bias: torch.Tensor,
               db_acc: Optional[torch.Tensor]) -> torch.Tensor:
    """``d_b`` from the fp32 per-token-block partial column sums: added to ``db_acc``, else in the
    bias dtype."""
    return db_acc.add_(dbp.sum(0)) if db_acc is not None else dbp.sum(0).to(bias.dtype)


def empty_call_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     needs: tuple[bool, bool, bool], accumulate: Optional[tuple],
                     d_hidden_ready: Optional[Callable]):
    """The gradients of a call with no rows or no columns: zeros where wanted (the ``accumulate``
    buffers as given), ``d_hidden`` handed to ``d_hidden_ready`` as the non-empty path does."""
    need_dh, need_dw, need_db = needs
    need_db = need_db and bias is not None
    dw_acc, db_acc = accumulate if accumulate is not None else (None, None)
    d_hidden = torch.zeros(hidden.shape, device=hidden.device,
                           dtype=torch.float32) if need_dh else None
    if d_hidden is not None and d_hidden_ready is not None:
        d_hidden_ready(d_hidden)
    return (d_hidden,
            dw_acc if dw_acc is not None else (torch.zeros_like(weight) if need_dw else None),
            db_acc if db_acc is not None else (torch.zeros_like(bias) if need_db else None))


def per_token_grads(grad_logp: torch.Tensor, grad_entropy: Optional[torch.Tensor],
                    grad_lse: Optional[torch.Tensor],
                    mean_rel: Optional[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The d_logits kernels' per-token inputs ``(g, g - g_lse, g_entropy, mean_rel)``, contiguous
    fp32 (``g`` in place of the terms a call does not have: the kernels do not read them then)."""
    g = f32_contiguous(grad_logp)
    gmg = g if grad_lse is None else (g - grad_lse.to(torch.float32)).contiguous()
    if grad_entropy is None:
        return g, gmg, g, g
    if mean_rel is None:
        raise KernelInputError("grad_entropy was given without mean_rel; the entropy gradient needs E_p[z] - M")
    return g, gmg, f32_contiguous(grad_entropy), f32_contiguous(mean_rel)


def dh_gemm(dz, w_chunk, d_hidden, i_chunk: int, deterministic: bool, cfg: TileConfig,
            precision) -> None:
    """``d_hidden (+)= dz @ W[chunk]`` (fp32) for one chunk."""
    if deterministic:
        n, k = dz.shape
        cached(dh_launch, n, k, w_chunk.shape[1], dz.stride(0), w_chunk.stride(0),
               d_hidden.stride(0), i_chunk > 0, cfg, precision)(dz, w_chunk, d_hidden)
    # the one chunk, rounded once to the input dtype (d_hidden_in_input_dtype)
    elif d_hidden.dtype != torch.float32:
        mm_into(d_hidden, dz, w_chunk)
    elif i_chunk == 0:
        fp32_gemm.mm_into(d_hidden, dz, w_chunk)
    else:
        fp32_gemm.addmm_(d_hidden, dz, w_chunk)


def launch_dlogits_kept(kept: KeptTerms, local_target, row_max, log_sum, g, gmg, ge, mean_rel, dz,
                        dbp, v_lo, v_hi, transform: LogitTransform, with_entropy, need_db,
                        cfg: TileConfig, precision: Optional[str],
                        launch: Optional[Callable] = None,
                        gsz: Optional[torch.Tensor] = None) -> None:
    """One chunk's d_logits from the softmax terms the forward kept (an elementwise kernel: no GEMM;
    the forward's tile width, one scale per row and tile). ``launch``: this launch as the caller's
    program holds it (:class:`KeptBackward`), else the layout's from :func:`~.launch.cached`.
    ``transform``: the forward's logit transform; ``gsz``: the per-token gradient of the logits' sum
    (label smoothing), or None."""
    values, scales = kept
    if launch is None:
        launch = cached(dlogits_kept_launch, values.shape[0], v_lo, v_hi, values.stride(0),
                        scales.stride(0), dz.stride(0), dbp.stride(0) if need_db else 0,
                        transform, with_entropy, need_db, cfg, precision, gsz is not None)
    launch(values, scales, local_target, row_max, log_sum, g, gmg, ge, mean_rel,
           g if gsz is None else gsz, dz, dbp)


def launch_dlogits(hidden, weight, bias, local_target, row_max, log_sum, g, gmg, ge, mean_rel, dz,
                   dbp, v_lo, v_hi, transform: LogitTransform, with_entropy, need_db,
                   cfg: TileConfig, precision: Optional[str], tma: bool = False,
                   gsz: Optional[torch.Tensor] = None,
                   bits: Optional[torch.Tensor] = None) -> None:
    """One chunk's d_logits, the logits tiles recomputed (``tma``: the Hopper kernel where legal;
    ``transform``, ``gsz``: as in :func:`launch_dlogits_kept`; ``bits``: the support's bitmask of
    the chunk's columns, int32 ``[N, cdiv(v_hi - v_lo, 32)]``, or None)."""
    n, d = hidden.shape
    tma = tma and tma_ok(hidden, weight)
    if tma:
        ensure_context(hidden.device)
    launch = cached(dlogits_launch, n, weight.shape[0], d, v_lo, v_hi, hidden.stride(0),
                    weight.stride(0), dz.stride(0), dbp.stride(0) if need_db else 0,
                    bias is not None, need_db, with_entropy, transform, cfg, precision, tma,
                    gsz is not None, bits is not None)
    launch(hidden, weight, hidden if bias is None else bias, local_target, row_max, log_sum, g, gmg,
           ge, mean_rel, g if gsz is None else gsz, dz, dbp, dz if bits is None else bits)


class KeptBackward:
    """:func:`backward` when the forward kept every column's terms at the weight's element size and
    the backward consumes them (``overwrite_kept``): one d_logits launch writes d_logits in place of
    the terms (each element is read, then written, by the same program), the scales are dropped,
    then one full-size GEMM each gives ``d_hidden`` (in the input dtype when it is the call's whole
    gradient, one GEMM and not ``deterministic``, on CUDA; else fp32) and ``d_W`` (all tokens, the
    whole shard: fp32 accumulation inside it; added to an ``accumulate`` buffer when given), with
    every size and the launch made once. The sources keep one per layout, after :meth:`matches`;
    :func:`backward` takes its layout's from :func:`~.launch.cached`."""

    def __init__(self, n: int, v: int, dtype: torch.dtype, bias_dtype: Optional[torch.dtype],
                 needs: tuple[bool, bool, bool], with_entropy: bool, transform: LogitTransform,
                 cfg: TileConfig, precision: Optional[str], kept_dtype: torch.dtype,
                 scales_stride: int, deterministic: bool, d_hidden_in_input_dtype: bool,
                 on_cuda: bool, with_sum_z: bool = False) -> None:
        self.needs = (needs[0], needs[1], needs[2] and bias_dtype is not None)
        self.layout = (n, v, dtype, bias_dtype, kept_dtype, scales_stride)
        self.with_entropy = with_entropy
        self.with_sum_z = with_sum_z
        self.deterministic = deterministic
        self.dbp_shape = (cdiv(n, cfg.bwd_block_n), v) if self.needs[2] else None
        self.dh_dtype = (dtype if d_hidden_in_input_dtype and not deterministic and on_cuda
                         else torch.float32)  # (a CPU GEMM would round through an fp32 temporary)
        self.cfg, self.precision = cfg, precision
        self.transform = transform
        self.dlogits = dlogits_kept_launch(n, 0, v, v, scales_stride, v, v if self.needs[2] else 0,
                                           transform, with_entropy, self.needs[2], cfg,
                                           self.precision, with_sum_z)

    @staticmethod
    def covers(kept: Optional[KeptTerms], weight: torch.Tensor, overwrite_kept: bool) -> bool:
        """Whether a backward of these arguments is one this class runs (class docstring)."""
        return (overwrite_kept and kept is not None and kept.scales is not None
                and kept.values.shape[0] > 0
                and kept.values.shape[1] == weight.shape[0]
                and kept.values.element_size() == weight.element_size()
                and kept.values.is_contiguous())

    def matches(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                kept: KeptTerms, needs: tuple[bool, bool, bool], with_entropy: bool,
                with_sum_z: bool = False) -> bool:
        """Whether a call of the source's (checked tensors, every term kept) is of this program's
        layout."""
        n, v = hidden.shape[0], weight.shape[0]
        return ((n, v, hidden.dtype, None if bias is None else bias.dtype, kept.values.dtype,
                 kept.scales.stride(0))
                == self.layout and kept.values.shape == (n, v) and with_entropy == self.with_entropy
                and with_sum_z == self.with_sum_z
                and (needs[0], needs[1], needs[2] and bias is not None) == self.needs)

    def __call__(self, hidden, weight, bias, local_target, row_max, log_sum, grad_logp,
                 grad_entropy, grad_lse, mean_rel, kept: KeptTerms,
                 d_hidden_ready: Optional[Callable[[torch.Tensor], None]] = None,
                 accumulate: Optional[tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = None,
                 grad_sum_z: Optional[torch.Tensor] = None):
        """``(d_hidden | None, d_weight | None, d_bias | None)``, the per-token tensors as
        :func:`backward` takes them (``grad_sum_z`` given iff the program was made
        ``with_sum_z``)."""
        need_dh, need_dw, need_db = self.needs
        dw_acc, db_acc = accumulate if accumulate is not None else (None, None)
        g, gmg, ge, mean_rel = per_token_grads(grad_logp, grad_entropy, grad_lse, mean_rel)
        device = hidden.device
        dbp = torch.empty(self.dbp_shape, device=device, dtype=torch.float32) if need_db else g
        dz = kept.values if kept.values.dtype == weight.dtype else kept.values.view(weight.dtype)
        if not local_target.is_contiguous():
            local_target = local_target.contiguous()
        launch_dlogits_kept(kept, local_target, f32_contiguous(row_max), f32_contiguous(log_sum), g,
                            gmg, ge, mean_rel, dz, dbp, 0, dz.shape[1], self.transform,
                            self.with_entropy, need_db, self.cfg, self.precision, self.dlogits,
                            **({} if grad_sum_z is None else {"gsz": f32_contiguous(grad_sum_z)}))
        kept.release_scales()  # (the last pass that reads them)
        # allocated after the d_logits launch: the GPU starts sooner (the allocations do no GPU
        # work)
        d_hidden = torch.empty(hidden.shape, device=device,
                               dtype=self.dh_dtype) if need_dh else None
        d_weight = (dw_acc if dw_acc is not None else torch.empty_like(weight)) if need_dw else None
        if d_hidden is not None:
            dh_gemm(dz, weight, d_hidden, 0, self.deterministic, self.cfg, self.precision)
            if d_hidden_ready is not None:
                # complete: the caller may start its all-reduce under the d_W GEMM
                d_hidden_ready(d_hidden)
        if d_weight is not None:
            _dw_gemm(d_weight, dz, hidden, dw_acc is not None)
        return d_hidden, d_weight, _bias_grad(dbp, bias, db_acc) if need_db else None
