"""The implementations the op benchmark compares: one table entry each.

An entry names the implementation, the contract it meets and how to build its callable for a device
and a ``workspace_bytes`` budget:

* ``per-token gradient``: ``fn(hidden, weight, targets) -> logp [T]`` (fp32), differentiable for any
  upstream gradient ``[T]`` (the contract of ``tplogp.linear_logp``; the benchmark backpropagates a
  random one).
* ``scalar loss``: ``fn(hidden, weight, targets) -> mean cross-entropy`` (a 0-d tensor); its
  gradients may be computed in the forward, since the loss is known there (the benchmark
  backpropagates 1).
* ``policy loss``: ``fn(hidden, weight, targets, inputs) -> loss`` (a 0-d tensor), the RL loss
  ``policy`` names (:mod:`benchmarks.policy`: GSPO, DAPO) of the problem's per-token ``inputs``;
  backpropagated with 1, its error measured against the float64 definition of the same loss.

``budgeted`` entries are measured once per ``--budgets`` value (resolved for the entry's ``source``
and passed as ``workspace_bytes``, :class:`benchmarks.runner.BudgetSpec`); the others once. The
builders of tplogp's (budgeted) entries also take a ``variant``
(:class:`benchmarks.variants.Variant`, ``--variants``): the options it adds to the call, and a
``support`` (the padded ``[T, K]`` ids of a support variant, :mod:`benchmarks.supports`; a source
that cannot run a call with one is unavailable for it). A builder
raises :class:`ImplUnavailable` with the reason when the implementation cannot run here (package not
installed, wrong device); any other exception is recorded too: every requested implementation
becomes a row, with numbers or with the reason it has none. A new path (for example a fused loss of
tplogp) is one more entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

PER_TOKEN = "per-token gradient"
SCALAR_LOSS = "scalar loss"
POLICY_LOSS = "policy loss"

ImplFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ImplUnavailable(RuntimeError):
    """The implementation cannot run here; the message says why."""


@dataclass(frozen=True)
class Impl:
    name: str
    contract: str
    budgeted: bool
    build: Callable[[torch.device, Optional[int]], ImplFn]
    what: str
    # the tplogp source of a budgeted entry (its budgets are resolved for it)
    source: Optional[str] = None
    policy: Optional[str] = None  # a policy-loss entry's loss (a benchmarks.policy.LOSSES name)


def _import(module: str, attr: str):
    """``module.attr``, or :class:`ImplUnavailable` naming the missing package / the import
    error."""
    import importlib

    try:
        return getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as exc:
        raise ImplUnavailable(
            f"{exc.name} is not installed (benchmarks/requirements-peers.txt)") from exc
    except Exception as exc:  # a broken install is a result too (e.g. a DSL version mismatch)
        raise ImplUnavailable(f"import {module} failed: {type(exc).__name__}: {exc}") from exc


def _needs_cuda(device: torch.device, name: str) -> None:
    if device.type != "cuda":
        raise ImplUnavailable(f"{name} runs on CUDA devices only (got {device.type})")


def _options(budget: Optional[int], variant, support: Optional[torch.Tensor] = None) -> dict:
    """tplogp's keywords of a budget (None: the default), a variant's options and a support."""
    options = {} if budget is None else {"workspace_bytes": budget}
    if variant is not None:
        options.update(variant.call_options())
    if support is not None:
        options["support"] = support
    return options


def _tplogp_available(source: str, device: torch.device, support: Optional[torch.Tensor],
                      variant=None) -> None:
    """:class:`ImplUnavailable` with the registry's reason when ``source`` cannot run here, or
    cannot run a call with a support (given, or computed from a variant's sampler parameters)."""
    try:
        from tplogp.backends.kernel_registry import unavailable_reason
    except ModuleNotFoundError:  # a tree measured with --base may predate the backends package
        from tplogp.kernel_registry import unavailable_reason

    # (a tree measured with --base may predate the features argument: a plain call passes none)
    masks = support is not None or getattr(variant, "samples", False)
    why = (unavailable_reason(source, device) if not masks
           else unavailable_reason(source, device, features=("support",)))
    if why is not None:
        raise ImplUnavailable(why)


def _tplogp(source: str) -> Callable[..., ImplFn]:
    def build(device: torch.device, budget: Optional[int], variant=None,
              support: Optional[torch.Tensor] = None) -> ImplFn:
        from tplogp import get_op

        _tplogp_available(source, device, support, variant)
        op = get_op("linear_logp", source=source)
        options = _options(budget, variant, support)
        return lambda h, w, y: op(h, w, y, **options)

    return build


def _tplogp_loss(source: str) -> Callable[..., ImplFn]:
    def build(device: torch.device, budget: Optional[int], variant=None,
              support: Optional[torch.Tensor] = None) -> ImplFn:
        _tplogp_available(source, device, support, variant)
        fused, losses = _import("tplogp", "linear_logp_loss"), _import("tplogp", "losses")
        options = _options(budget, variant, support)
        # the built-in cross-entropy (-logp, closed-form derivative), comparable to the peers' mean
        # CE; it reads no entropy: the sources skip its statistics. A variant's label smoothing and
        # z-loss: the same built-ins
        if variant is None or not variant.loss_terms:
            cross_entropy = losses.cross_entropy()
        else:
            cross_entropy = losses.cross_entropy(label_smoothing=variant.label_smoothing)
            if variant.z_loss:
                cross_entropy = cross_entropy + losses.z_loss(variant.z_loss)
        return lambda h, w, y: fused(h, w, y, loss=cross_entropy, reduction="mean", source=source,
                                     with_entropy=False, **options)

    return build


def _tplogp_policy(name: str, source: str) -> Callable[..., Callable]:
    def build(device: torch.device, budget: Optional[int], variant=None,
              support: Optional[torch.Tensor] = None) -> Callable:
        from . import policy

        _tplogp_available(source, device, support, variant)
        return policy.tplogp_fn(name, source, _options(budget, variant, support))

    return build


def _torch_eager_policy(name: str) -> Callable[[torch.device, Optional[int]], Callable]:
    def build(device: torch.device, budget: Optional[int]) -> Callable:
        from . import policy

        return policy.eager_fn(name)

    return build


def _torch_eager(device: torch.device, budget: Optional[int]) -> ImplFn:
    def logp(h, w, y):
        logits = (h @ w.T).float()
        return logits.log_softmax(-1).gather(1, y[:, None]).squeeze(1)

    return logp


def _torch_eager_loss(device: torch.device, budget: Optional[int]) -> ImplFn:
    def loss(h, w, y):
        return torch.nn.functional.cross_entropy((h @ w.T).float(), y)

    return loss


def _liger_flce(device: torch.device, budget: Optional[int]) -> ImplFn:
    _needs_cuda(device, "Liger")
    fn = _import("liger_kernel.ops.fused_linear_cross_entropy",
                 "LigerFusedLinearCrossEntropyFunction")
    # apply(input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
    # reduction)
    return lambda h, w, y: -fn.apply(h, w, y, None, None, -100, 0.0, 0.0, "none")[0]


def _liger_cute_sm90(device: torch.device, budget: Optional[int]) -> ImplFn:
    _needs_cuda(device, "Liger's CuTe SM90 kernel")
    fn = _import("liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90",
                 "liger_fused_linear_cross_entropy_sm90")
    return lambda h, w, y: fn(h, w, y, -100, "mean")


def _cce(impl: Optional[str]) -> Callable[[torch.device, Optional[int]], ImplFn]:
    def build(device: torch.device, budget: Optional[int]) -> ImplFn:
        _needs_cuda(device, "Cut Cross-Entropy")
        fn = _import("cut_cross_entropy", "linear_cross_entropy")
        options = {"filter_eps": None} if impl is None else {"impl": impl}
        return lambda h, w, y: -fn(h, w, y, reduction="none", **options)

    return build


def _quack_chunked(device: torch.device, budget: Optional[int]) -> ImplFn:
    _needs_cuda(device, "QuACK")
    fn = _import("quack.linear_cross_entropy", "chunked_linear_cross_entropy")
    return lambda h, w, y: fn(h, w, y, chunk_size=4096, reduction="mean")


VERL_KERNEL_MODULES = ("kernels", "linear_cross_entropy")


def _verl_device_stub(torch_module=torch):
    """What ``verl/utils/kernel/kernels.py`` imports from ``verl.utils.device`` (verl 0.9.1), for
    CUDA: whether CUDA is available, the device's capability, the device type's name and torch's
    device module."""
    import types

    stub = types.ModuleType("verl.utils.device")
    cuda = torch_module.cuda.is_available()
    stub.is_cuda_available = cuda
    stub.get_device_capability = (
        lambda device_id=0: torch_module.cuda.get_device_capability(device_id) if cuda
        else (None, None))
    stub.get_device_name = lambda: "cuda" if cuda else "cpu"
    stub.get_torch_device = lambda: torch_module.cuda
    return stub


def load_verl_kernel():
    """verl's fused linear cross-entropy (``verl.utils.kernel.linear_cross_entropy``: per-token logp
    and entropy from NVIDIA's Triton kernels), loaded from the installed verl's files without
    importing the verl package.

    Why: ``import verl`` runs the package's ``__init__``, which imports the whole framework (ray,
    transformers, tensordict, its protocol and workers) and fails without those dependencies; ``pip
    install verl --no-deps`` installs none of them. The two kernel modules need only torch, triton
    and four helpers of ``verl.utils.device``, so this executes their files as submodules of a
    private package, with a stub for ``verl.utils.device`` present in ``sys.modules`` only while
    ``kernels.py`` runs (the helpers it imports are bound into its namespace then). Returns the
    ``linear_cross_entropy`` module."""
    import importlib.util
    import os
    import sys
    import types

    package = "_benchmarks_verl_kernel"
    if package in sys.modules:
        return sys.modules[package].linear_cross_entropy
    try:
        spec = importlib.util.find_spec("verl")  # a top-level package: located, not imported
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ImplUnavailable("verl is not installed (benchmarks/requirements-peers.txt: "
                              "pip install verl==0.9.1 --no-deps)")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "utils", "kernel")
    pkg = types.ModuleType(package)
    pkg.__path__ = [folder]
    pkg.__package__ = package
    loaded = {}
    # a real verl imported elsewhere stays as it was
    device_module = sys.modules.get("verl.utils.device")
    sys.modules["verl.utils.device"] = _verl_device_stub()
    sys.modules[package] = pkg
    try:
        for name in VERL_KERNEL_MODULES:
            path = os.path.join(folder, name + ".py")
            mod_spec = importlib.util.spec_from_file_location(f"{package}.{name}", path)
            if mod_spec is None or not os.path.exists(path):
                raise ImplUnavailable(f"verl's kernel file {path} is missing (verl 0.9.1 has it)")
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[mod_spec.name] = module
            mod_spec.loader.exec_module(module)
            setattr(pkg, name, module)
            loaded[name] = module
    except ImplUnavailable:
        _forget(package, sys)
        raise
    except Exception as exc:  # a different verl layout or a broken kernel file is a result too
        _forget(package, sys)
        raise ImplUnavailable(
            f"loading verl's kernel modules failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if device_module is None:
            sys.modules.pop("verl.utils.device", None)
        else:
            sys.modules["verl.utils.device"] = device_module
    return loaded["linear_cross_entropy"]


def _forget(package: str, sys_module) -> None:
    for name in [n for n in sys_module.modules if n == package or n.startswith(package + ".")]:
        del sys_module.modules[name]


def _verl(device: torch.device, budget: Optional[int]) -> ImplFn:
    _needs_cuda(device, "verl's fused kernel")
    fn = load_verl_kernel().linear_cross_entropy
    # (hidden, weight, labels, temperature, reduction, process group) -> (logp [T], entropy [T]),
    # fp32
    return lambda h, w, y: fn(h, w, y, 1.0, "none", None)[0]


IMPLS: tuple[Impl, ...] = (
    Impl("tplogp-sm90", PER_TOKEN, True, _tplogp("sm90"),
         "tplogp, Hopper source (the registry's choice on sm_90)", source="sm90"),
    Impl("tplogp-triton", PER_TOKEN, True, _tplogp("triton"), "tplogp, portable Triton source",
         source="triton"),
    Impl("tplogp-native", PER_TOKEN, True, _tplogp("native"), "tplogp, chunked PyTorch source",
         source="native"),
    Impl("tplogp-loss-sm90", SCALAR_LOSS, True, _tplogp_loss("sm90"),
         "tplogp linear_logp_loss (mean CE, gradients in the forward), Hopper source",
         source="sm90"),
    Impl("tplogp-loss-triton", SCALAR_LOSS, True, _tplogp_loss("triton"),
         "tplogp linear_logp_loss (mean CE, gradients in the forward), Triton source",
         source="triton"),
    Impl("tplogp-loss-native", SCALAR_LOSS, True, _tplogp_loss("native"),
         "tplogp linear_logp_loss (mean CE, gradients in the forward), PyTorch source",
         source="native"),
    *(Impl(f"tplogp-{loss}-{source}", POLICY_LOSS, True, _tplogp_policy(loss, source),
           f"tplogp linear_logp_loss with losses.grpo: {what} ({source} source)", source=source,
           policy=loss)
      for loss, what in (("gspo", "GSPO step"), ("dapo", "DAPO step"))
      for source in ("sm90", "triton", "native")),
    Impl("torch-eager", PER_TOKEN, False, _torch_eager, "bf16 logits, fp32 log_softmax, gather"),
    Impl("torch-eager-loss", SCALAR_LOSS, False, _torch_eager_loss,
         "bf16 logits, fp32 mean cross-entropy"),
    Impl("torch-eager-gspo", POLICY_LOSS, False, _torch_eager_policy("gspo"),
         "bf16 logits, fp32 log_softmax, GSPO loss in eager PyTorch", policy="gspo"),
    Impl("torch-eager-dapo", POLICY_LOSS, False, _torch_eager_policy("dapo"),
         "bf16 logits, fp32 log_softmax, DAPO loss in eager PyTorch", policy="dapo"),
    Impl("liger-flce", PER_TOKEN, False, _liger_flce,
         "Liger fused linear CE (Triton), reduction none"),
    Impl("liger-cute-sm90", SCALAR_LOSS, False, _liger_cute_sm90,
         "Liger CuTe DSL SM90 kernel, mean loss"),
    Impl("cce-exact", PER_TOKEN, False, _cce(None), "Cut Cross-Entropy, gradient filter off"),
    Impl("cce-compile", PER_TOKEN, False, _cce("torch_compile"),
         "Cut Cross-Entropy torch_compile impl"),
    Impl("quack-chunked", SCALAR_LOSS, False, _quack_chunked,
         "QuACK chunked_linear_cross_entropy, 4096-token chunks"),
    Impl("verl", PER_TOKEN, False, _verl,
         "verl linear_cross_entropy (NVIDIA Triton kernels): per-token logp and entropy, "
         "temperature 1"),
)
BY_NAME = {impl.name: impl for impl in IMPLS}


def select(names: Optional[str]) -> list[Impl]:
    """The entries named in a comma-separated list (all when None / empty), in the list's order."""
    if not names:
        return list(IMPLS)
    chosen = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name not in BY_NAME:
            raise ValueError(f"unknown implementation {name!r}; known: {', '.join(BY_NAME)}")
        chosen.append(BY_NAME[name])
    return chosen
