"""The contract between the tensor-parallel layer and a compute backend.

A backend ("source") only ever sees one rank's vocab shard. It supplies two local primitives:

``forward_stats``
    For every token t of the shard-local logits ``z[t, v] = cap(hidden[t] @
    weight[v] + bias[v]) * inv_temperature`` with ``cap(y) = softcap * tanh(y / softcap)`` when
    ``ShardCall.softcap`` is set and ``cap(y) = y`` otherwise (fp32 accumulation, never materialized
    as a whole) return

    * ``row_max[t]``      = max_v z[t, v]                       (``-inf`` for an empty shard)
    * ``sum_exp[t]``      = sum_v exp(z[t, v] - row_max[t])
    * ``target_logit[t]`` = z[t, local_target[t]]  read from the fp32 accumulator, 0 where
      ``local_target < 0``
    * ``sum_exp_z[t]``    = sum_v exp(z[t, v] - row_max[t]) * (z[t, v] - row_max[t])   (only with
      ``with_entropy``)
    * ``sum_z[t]``        = sum_v z[t, v]                       (only with ``with_sum_z``; 0 for an
      empty shard)
    * ``argmax[t]``       = the lowest shard-local v with z[t, v] = row_max[t]   (only with
                            ``with_argmax``; an exact integer in fp32, 0 for an empty shard)

    all fp32 of shape ``[N]``.

``backward``
    Given the merged (global) per-token softmax normalizer as two parts, ``row_max[t]`` (the global
    max ``M``) and ``log_sum[t] = log sum_v exp(z - M)`` (so ``lse = M + log_sum``; kept apart so
    that ``z - M`` is exact at the max and ``1 - p`` at a peaked target does not cancel), for
    entropy the global mean logit relative to the max ``mean_rel[t] = E_p[z] - M``, and the upstream
    gradients ``grad_logp[t]`` / ``grad_entropy[t]`` / ``grad_lse[t]`` (``grad_entropy``,
    ``grad_lse`` and ``grad_sum_z`` may be None, meaning zero), compute

        zr       = z - row_max
        p        = exp(zr - log_sum)
        dz       = grad_logp * onehot(local_target)
                   - p * (grad_logp - grad_lse + grad_entropy * (zr - mean_rel))
                   + grad_sum_z                                   (the same for every v of the row)
        d_logits = dz * inv_temperature * (1 - tanh^2(y / softcap))   (the last factor only with a
        softcap) d_hidden = d_logits @ weight          (partial over this shard, fp32, all-reduced
        by the TP layer) d_weight = d_logits^T @ hidden        (fp32 accumulation, returned in
        weight.dtype) d_bias   = sum_t d_logits             (fp32 accumulation, returned in
        bias.dtype)

    computing ``d_hidden`` before the ``d_weight`` work. ``d_hidden_ready`` (optional) is called
    with the finished ``d_hidden`` as soon as it is complete, before the remaining ``d_weight``
    work; the caller may start an async collective on it, so the backend must not touch that tensor
    afterwards (it returns it as ``ShardGrads.d_hidden``). ``kept`` is what this backend's forward
    kept (``ShardStats.kept``), read, never modified (a repeated backward reads it again), unless
    ``ShardCall.consume_kept`` says no later backward reads it. ``accumulate`` (optional): fp32
    ``(d_weight [V_local, D] | None, d_bias [V_local] | None)`` buffers to which
    ``d_weight`` / ``d_bias`` are added without rounding (a loss summed over several token chunks);
    the returned ``ShardGrads`` then holds these buffers.

``forward_blocks`` and ``grid_columns`` (the tensor-parallel-invariant level,
:mod:`tplogp.support.invariant`)
    ``grid_columns(device, dtype)`` is the width ``B`` of the source's global column grid (a
    constant of the source, device and dtype). ``forward_blocks`` takes a shard whose first column
    starts a grid block (only the last block may be cut, by the vocabulary's end) and returns
    :class:`BlockStats`, one column per block, each
    computed by the same arithmetic wherever the block sits: tiles aligned to the grid, a tile
    config that does not depend on the shard's size, no split-K (the softcap applied; with
    ``with_sum_z`` / ``with_argmax`` also each block's sum of z and the lowest column of its max).
    Nothing is kept for the backward; ``backward`` with ``ShardCall.grid_columns`` set runs
    fixed-shape GEMMs for ``d_W`` and fixed-order sums for ``d_b``.

``forward_single`` (optional)
    When one shard holds the whole vocab (no group, or a group of one), a backend may finish the
    per-token outputs itself and save the TP layer's merge ops (host time at small shapes): return
    :class:`SingleShardOutputs`. The layer then passes ``target`` ids as given, to this method and
    to ``backward``: an id outside ``[0, V)`` is owned by nobody (its logp is NaN; full checks
    reject such ids first). A backend whose ``checks_targets_in_kernel`` is True also takes
    ``target_flag=``: a zeroed int64 ``[1]`` tensor (pinned host memory on a GPU) that its kernels
    set to an id outside ``[0, V)`` when a target is one: the call's default target check then costs
    no launch and no copy (:class:`tplogp.op.verdicts.KernelTargetCheck`).

``kept_out=`` (``forward_stats`` and ``forward_single``, optional)
    A flat fp32 buffer of exactly ``kept_shape`` words for the call's rows, into which a forward
    that keeps (``for_backward``, ``scales_apart`` off) writes instead of allocating its own: the
    op's kept output, a prefix of its ``kept_capacity`` under ``ignore_index``
    (:func:`tplogp.op.packed_op.forward_packed`). None: the forward allocates.

Everything that needs a collective (merging stats across ranks, the coverage check, the d_hidden
all-reduce) lives in :mod:`tplogp.op.tp`, once, for every backend. ``local_target`` is the target id
minus the shard's ``vocab_start_index`` where the shard owns it, and ``-1`` elsewhere (ignored rows
are ``-1`` too).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Protocol, Union

import torch

from . import memory_budget

if TYPE_CHECKING:
    from ..kernels.launches import KernelOptions


class KeptBuffers:
    """What a source's forward kept for its backward in two allocations
    (``ShardCall.scales_apart``): ``values``, the terms ``[N, keep_cols]`` in the kept dtype (what
    the autograd context saves, and what a consuming backward overwrites with d_logits), and
    ``scales``, the per-row, per-tile fp32 scales. The call path holds the scales where it can drop
    them (``tplogp.op.local_call.TPContext.kept_scales``) and hands both to the backward in one of
    these; the source's backward takes the scales out (:meth:`take_scales`), and its d_logits
    launcher drops them once read, so that a consuming backward frees them before its d_hidden / d_W
    GEMMs allocate their outputs (a peak lower by the scales)."""

    __slots__ = ("values", "scales")

    def __init__(self, values: torch.Tensor, scales: Optional[torch.Tensor]) -> None:
        self.values = values
        self.scales = scales

    def take_scales(self) -> Optional[torch.Tensor]:
        """The scales, which this holder no longer references."""
        scales, self.scales = self.scales, None
        return scales


class BlockStats(NamedTuple):
    """Per-token statistics of each grid block of a grid-aligned shard (``forward_blocks``; the
    tensor-parallel-invariant level, :mod:`tplogp.support.invariant`). fp32; ``[blocks, N]`` unless
    noted."""

    block_max: torch.Tensor  # max of the block's logits
    block_sum: torch.Tensor  # sum exp(z - block_max)
    # [N] z[local_target] from the fp32 accumulator, 0 where no block holds it
    target_logit: torch.Tensor
    block_sez: Optional[torch.Tensor]  # sum exp(z - block_max)(z - block_max) (only with_entropy)
    # sum of the block's z, in a fixed order within the block (with_sum_z)
    block_sum_z: Optional[torch.Tensor] = None
    # the lowest column of the block's max, relative to the shard's first column (with_argmax; exact
    # in fp32)
    block_argmax: Optional[torch.Tensor] = None


class ShardStats(NamedTuple):
    """Per-token statistics of one vocab shard (all fp32 ``[N]``)."""

    row_max: torch.Tensor
    sum_exp: torch.Tensor
    target_logit: torch.Tensor
    sum_exp_z: Optional[torch.Tensor]
    # what the forward kept for the backward within the workspace budget (backend-specific layout;
    # KeptBuffers when ShardCall.scales_apart), or None
    kept: Optional[Union[torch.Tensor, KeptBuffers]] = None
    sum_z: Optional[torch.Tensor] = None  # sum_v z[t, v] over the shard (only with_sum_z)
    # fp32: the lowest shard-local id v with z[t, v] = row_max[t] (with_argmax)
    argmax: Optional[torch.Tensor] = None


class SingleShardOutputs(NamedTuple):
    """What ``forward_single`` returns (all fp32 ``[N]``): the outputs, and what the backward
    needs."""

    logp: torch.Tensor
    lse: torch.Tensor
    row_max: torch.Tensor  # M
    log_sum: torch.Tensor  # log sum exp(z - M)
    mean_rel: Optional[torch.Tensor]  # E_p[z] - M (entropy only)
    entropy: Optional[torch.Tensor]  # log_sum - mean_rel (entropy only)
    # what the forward kept for the backward within the workspace budget (backend-specific layout;
    # KeptBuffers when ShardCall.scales_apart), or None
    kept: Optional[Union[torch.Tensor, KeptBuffers]] = None
    sum_z: Optional[torch.Tensor] = None  # sum_v z (only with_sum_z)
    argmax: Optional[torch.Tensor] = None  # fp32 lowest id of the max (only with_argmax)


class ShardGrads(NamedTuple):
    """Gradients of one vocab shard. ``d_hidden`` is fp32 and partial (to be all-reduced)."""

    d_hidden: Optional[torch.Tensor]
    d_weight: Optional[torch.Tensor]
    d_bias: Optional[torch.Tensor]


@dataclass(frozen=True)
class ShardCall:
    """Non-tensor settings of one call, shared by forward and backward."""

    inv_temperature: float = 1.0
    with_entropy: bool = False
    # final-logit softcap c (None: none): z = c * tanh(y / c) * inv_temperature with y = hidden @
    # weight^T + bias
    softcap: Optional[float] = None
    # the forward also returns sum_v z per token (ShardStats.sum_z), and the backward may get
    # grad_sum_z
    with_sum_z: bool = False
    # the forward also returns the lowest shard-local id of the row max per token
    # (ShardStats.argmax)
    with_argmax: bool = False
    deterministic: bool = False
    # The most bytes the op may hold beyond inputs, outputs and gradients: transient tiles plus what
    # the forward keeps for the backward, split per source by tplogp.backends.memory_budget.split
    # (docs/operator.md, "Memory budget").
    # None: TPLOGP_WORKSPACE_MB, else the source's default (the table in
    # tplogp.backends.memory_budget).
    workspace_bytes: Optional[int] = None
    # the forward's results will be differentiated: a backend may keep logits for the backward
    # within the budget
    for_backward: bool = False
    # no later backward reads what the forward kept (the fused loss; linear_logp when the graph is
    # not retained, tp.consumes_kept): the backend may overwrite it (the triton / sm90 sources write
    # d_logits in place of the kept terms and run full-size GEMMs; native reads it either way)
    consume_kept: bool = False
    # d_hidden is the call's whole gradient (one shard: no all-reduce; no later scaling): a source
    # may return it in the input dtype, rounded once as its GEMM stores it, instead of fp32 (no fp32
    # buffer, no cast)
    d_hidden_in_input_dtype: bool = False
    # the op's checks passed and the call path made the tensors what the sources take
    # (tplogp.op.plan, local_call.localize: 2-D, contiguous, one device, int64 targets): a source
    # may skip its per-launch checks
    inputs_checked: bool = False
    # the forward keeps its scales apart from its terms (KeptBuffers), so that a consuming backward
    # can free them
    # early: the eager paths; the op's forward (torch.compile) returns one flat buffer
    scales_apart: bool = False
    # the layout's token count (tplogp.op.plan), or None (any): a call of another count (rows that
    # ignore_index compacted away, a fused loss's chunk) runs no launch program, since such counts
    # vary from call to call
    rows: Optional[int] = None
    # the tensor-parallel-invariant level (tplogp.support.invariant): the width of the global grid's
    # blocks (0: off). The shard is grid-aligned (its first column starts a block), the forward runs
    # ``forward_blocks`` and the backward runs GEMMs whose shapes do not depend on the shard's size,
    # so a column's d_W / d_b rows do not either
    grid_columns: int = 0
    # the settings that shape a layout's plan as tplogp.op.plan read them once for the call
    # (tplogp.support.settings.layout_settings), or None (a ShardCall made elsewhere: a source's
    # plan reads them itself); part of the sources' per-layout keys
    env: Optional[tuple] = None
    # the sampler's support of the call's rows (docs/operator.md, "Sampler's support"): int64
    # [rows, K], this shard's ids shard-local, -1 elsewhere; the logits outside a row's ids are
    # -inf (the masked-vocabulary rule). Set per call (tplogp.op.local_call), sliced with the rows
    # (:meth:`for_rows`); a source that cannot mask names it in ``missing_features``
    support: Optional[torch.Tensor] = field(default=None, compare=False, hash=False, repr=False)
    # the sorted union of the support's ids where the caller computed it (token chunks compute
    # every chunk's at once, one host read: tplogp.backends.native_support.chunk_unions), else None
    support_union: Optional[torch.Tensor] = field(default=None, compare=False, hash=False,
                                                  repr=False)
    # the support's ids are positions among gathered weight rows that are the union itself
    # (native_support.gathered): the source masks them, with no smaller union to look for
    support_narrowed: bool = False
    # whether some row of the support keeps every id (a first entry ``KEEP_ALL``: a computed
    # support's tokens whose filters are all off) where the caller knows it (a given support: never,
    # tplogp.op.local_call); None: unknown, the sources read it from the support (a host read)
    support_keeps_all: Optional[bool] = field(default=None, compare=False, hash=False)
    # a support computed from the sampler's parameters, in 16-bit calls: its ids' logits as the
    # sampler's passes computed them (fp32 [rows, K], -inf where ``support`` is -1), from which
    # the forward takes its statistics with no pass over the vocabulary
    # (tplogp.backends.support_pairs.given_stats, from tplogp.op.tp.shard_forward); None: the
    # forward computes them. The backward's call holds them too (its forward ran on it): half
    # the bytes of the support's int64 ids, until the backward
    support_logits: Optional[torch.Tensor] = field(default=None, compare=False, hash=False,
                                                   repr=False)

    def for_rows(self, t0: int, t1: int) -> "ShardCall":
        """This call for its rows ``[t0, t1)`` (a chunk): the support sliced with them (its union
        is no longer known)."""
        if self.support is None or (t0 == 0 and t1 == self.support.shape[0]):
            return self
        logits = self.support_logits
        return replace(self, support=self.support[t0:t1], support_union=None,
                       support_logits=None if logits is None else logits[t0:t1])

    @functools.cached_property
    def key(self) -> tuple:
        """Every setting of this call but its support's (``support``, ``support_union``,
        ``support_narrowed``, ``support_keeps_all``, ``support_logits``: support calls run no
        launch program), as one hashable tuple (made once per ShardCall): what a source's
        per-layout state is keyed by with the shard's shapes (the triton / sm90 sources' launch
        programs, ``TritonBackend._program``). Equal calls (the calls of one layout, eager or
        compiled, share one ShardCall: tplogp.op.plan) find the same programs; a call that
        differs in any setting finds its own."""
        return (self.inv_temperature, self.with_entropy, self.softcap, self.with_sum_z,
                self.with_argmax, self.deterministic, self.workspace_bytes, self.for_backward,
                self.consume_kept, self.d_hidden_in_input_dtype, self.inputs_checked,
                self.scales_apart, self.rows, self.grid_columns, self.env)

    @functools.cached_property
    def kernel_options(self) -> "KernelOptions":
        """The options as the Triton kernels' launch builders take them, one bundle
        (:class:`tplogp.kernels.launches.KernelOptions`), made once per ShardCall (imported here:
        only the sources that launch kernels read it, and importing tplogp needs no Triton)."""
        from ..kernels.launches import KernelOptions, LogitTransform

        transform = LogitTransform(float(self.inv_temperature),
                                   None if self.softcap is None else float(self.softcap))
        return KernelOptions(transform, self.with_entropy, self.with_sum_z, self.with_argmax)

    @functools.cached_property
    def consuming(self) -> "ShardCall":
        """This call with ``consume_kept`` (made once per ShardCall: the calls of a layout share
        one)."""
        return self if self.consume_kept else replace(self, consume_kept=True)

    @functools.cached_property
    def precomputing(self) -> "ShardCall":
        """This call as the fused loss's chunk loop runs it (made once per ShardCall): each chunk's
        backward runs right after its forward (``for_backward``, ``consume_kept``), and ``d_hidden``
        stays fp32 (scaled by the upstream scalar later, rounded once then)."""
        return replace(self, for_backward=True, consume_kept=True, d_hidden_in_input_dtype=False,
                       scales_apart=True)

    @functools.cached_property
    def flat_kept(self) -> "ShardCall":
        """This call keeping one flat buffer (``scales_apart`` off; made once per ShardCall): the
        op's forward."""
        return replace(self, scales_apart=False) if self.scales_apart else self


class BudgetParts:
    """A source's two budget parts, read from the one table (:mod:`tplogp.backends.memory_budget`)
    by its ``name``."""

    name: str

    @classmethod
    def transient_bytes(cls, device: torch.device) -> int:
        """The budget's part that goes to transient work (tiles, d_logits workspace) before anything
        is kept (:func:`tplogp.backends.memory_budget.transient_bytes`)."""
        return memory_budget.transient_bytes(cls.name, device)

    @classmethod
    def keep_bytes(cls, workspace_bytes: Optional[int], device: torch.device) -> int:
        """The part of the budget that holds what the forward keeps for the backward
        (:func:`tplogp.backends.memory_budget.split`)."""
        return memory_budget.split(cls.name, workspace_bytes, device).keep


class ShardBackend(Protocol):
    """What a source implements. ``name`` is the registry name (``native``, ``triton``,
    ``sm90``)."""

    name: str

    def unavailable_reason(self, device: Optional[torch.device] = None) -> Optional[str]:
        """``None`` if this backend can run on ``device`` (default: the current CUDA device or
        CPU)."""
        ...

    def forward_stats(
        self,
        hidden: torch.Tensor,  # [N, D] contiguous
        weight: torch.Tensor,  # [V_local, D] contiguous
        bias: Optional[torch.Tensor],  # [V_local] or None
        local_target: torch.Tensor,  # [N] int64, -1 where this shard does not own the target
        call: ShardCall,
        # flat fp32 [kept_shape] buffer the forward keeps into, or None
        kept_out: Optional[torch.Tensor] = None,
    ) -> ShardStats: ...

    def backward(
        self,
        hidden: torch.Tensor,  # [N, D]
        weight: torch.Tensor,  # [V_local, D]
        bias: Optional[torch.Tensor],  # [V_local] or None
        local_target: torch.Tensor,  # [N] int64
        row_max: torch.Tensor,  # [N] fp32, global max of z
        log_sum: torch.Tensor,  # [N] fp32, log sum exp(z - row_max) over the global vocab
        grad_logp: torch.Tensor,  # [N] fp32
        grad_entropy: Optional[torch.Tensor],  # [N] fp32 or None
        grad_lse: Optional[torch.Tensor],  # [N] fp32 or None (d loss / d lse, e.g. a z-loss)
        mean_rel: Optional[torch.Tensor],  # [N] fp32 E_p[z] - row_max (global) or None
        call: ShardCall,
        needs: tuple[bool, bool, bool],  # (d_hidden, d_weight, d_bias)
        d_hidden_ready: Optional[Callable[[torch.Tensor], None]] = None,
        kept: Optional[torch.Tensor] = None,  # ShardStats.kept of the forward
        accumulate: Optional[tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = None,
        # [N] fp32 or None (d loss / d sum_v z, label smoothing)
        grad_sum_z: Optional[torch.Tensor] = None,
    ) -> ShardGrads: ...

    def layout_fingerprint(self, device: torch.device, dtype: torch.dtype) -> str:
        """What decides :meth:`kept_shape` on ``device`` for ``dtype`` besides the call's arguments
        and the workspace setting (a tile config): a compiled graph carries it
        (:func:`tplogp.op.ops.layout_key`)."""
        ...

    def kept_shape(self, n: int, d: int, v: int, dtype: torch.dtype, device: torch.device,
                   call: ShardCall) -> tuple[int, ...]:
        """Shape of the fp32 ``ShardStats.kept`` buffer that ``forward_stats`` / ``forward_single``
        allocate for an ``[n, d] x [v, d]`` call (``(0,)``: none); known before the call, for the
        op's fake implementation."""
        ...

    def kept_capacity(self, n: int, d: int, v: int, dtype: torch.dtype, device: torch.device,
                      call: ShardCall) -> tuple[int, ...]:
        """Shape of a flat fp32 buffer whose prefix holds what the forward of ANY call of at most
        ``n`` rows of this layout keeps (its :meth:`kept_shape`): the op's kept output under
        ``ignore_index``, whose compaction leaves a row count that depends on the data. At most the
        kept part of the budget. ``(0,)``: none."""
        ...
