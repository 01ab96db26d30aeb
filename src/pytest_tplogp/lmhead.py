"""The LM-head fixtures of tplogp's own tests, a plugin of their own: ``-p pytest_tplogp.lmhead``.

Fixtures: ``vocab_shards``, ``reference``, ``op_source``, ``dtype``, ``bias`` (and
``vocab_shards_size``, ``vocab_shards_mesh_dim`` to override). Options: ``--tp-op-source``,
``--tp-dtype``, ``--tp-bias``, ``--tp-shards`` (env ``TPLOGP_OP_SOURCE``, ``TPLOGP_TP_DTYPE``,
``TPLOGP_TP_BIAS``, ``TPLOGP_TP_SHARDS``; ini ``tp_op_source``, ...). They exist only where a run
asks for this module (``-p pytest_tplogp.lmhead``, or ``pytest_plugins`` in a conftest.py, as
tplogp's own conftest.py does): the generic plugin (``pytest_tplogp``) has none of them, so a
downstream test's own ``dtype`` or ``bias`` is never parametrized by tplogp. Asking for this module
asks for the generic plugin too.

In a test with ``mesh=``, ``vocab_shards`` shards over the mesh dim ``vocab_shards_mesh_dim`` ("tp")
and ``reference`` takes DTensors (used as their full tensors).

The parametrizing ones (``op_source``, ``dtype``, ``bias``, ``vocab_shards``) are built at configure
time by :func:`make_grid_fixtures`, so their grids follow the settings. An op source that cannot run
here is skipped with the kernel registry's reason, in the parent, before any rank is involved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from . import devices, options
from .fixtures import MESH_SHAPE, plan_of
from .lmhead_values import (BIASES, DEFAULT_VOCAB_SIZE, DTYPES, OP_SOURCES, SHARD_KINDS, OpSource,
                            Reference, VocabShards)
from .options import Spec, subset
from .session import STATE

#: Asking for this module asks for the generic plugin (its hooks, the ``tp`` marker, the pools).
pytest_plugins = ["pytest_tplogp"]


@dataclass(frozen=True)
class LMHeadSettings:
    """The grids of the parametrizing fixtures."""

    op_sources: tuple[str, ...] = OP_SOURCES
    dtypes: tuple[str, ...] = tuple(DTYPES)
    biases: tuple[str, ...] = tuple(BIASES)
    shards: tuple[str, ...] = SHARD_KINDS


SPECS: tuple[Spec, ...] = (
    Spec("op_sources", "--tp-op-source", "TPLOGP_OP_SOURCE", "tp_op_source", subset(OP_SOURCES),
         "op_source grid, comma-separated subset of registry,native,triton,sm90 "
         "(pytest_tplogp.lmhead)", "LIST"),
    Spec("dtypes", "--tp-dtype", "TPLOGP_TP_DTYPE", "tp_dtype", subset(tuple(DTYPES)),
         "dtype grid, comma-separated subset of fp32,bf16,fp16 (pytest_tplogp.lmhead)", "LIST"),
    Spec("biases", "--tp-bias", "TPLOGP_TP_BIAS", "tp_bias", subset(tuple(BIASES)),
         "bias grid, comma-separated subset of nobias,bias (pytest_tplogp.lmhead)", "LIST"),
    Spec("shards", "--tp-shards", "TPLOGP_TP_SHARDS", "tp_shards", subset(SHARD_KINDS),
         "vocab_shards grid, comma-separated subset of even,uneven (pytest_tplogp.lmhead)", "LIST"),
)


def pytest_addoption(parser: pytest.Parser) -> None:
    options.addoption(parser, SPECS)


def pytest_configure(config: pytest.Config) -> None:
    """Register the grid fixtures for this session's settings."""
    settings = LMHeadSettings(**options.resolve_values(config, SPECS))
    config.pluginmanager.register(make_grid_fixtures(settings), "tplogp-lmhead-grid-fixtures")


@pytest.fixture
def reference() -> Reference:
    """Full-vocab references from ``tplogp.reference``: ``reference(h, w, t, b,
    mode="fp32"|"matching"|"float64")``, or ``reference.fp32(...)`` / ``.matching(...)`` /
    ``.float64(...)`` / ``.outputs(...)``."""
    return Reference()


@pytest.fixture
def vocab_shards_size() -> int | None:
    """Override to change the default vocabulary of ``vocab_shards`` (None:
    :data:`values.DEFAULT_VOCAB_SIZE`)."""
    return None


@pytest.fixture
def vocab_shards_mesh_dim() -> str:
    """Override to shard ``vocab_shards`` over another dim of the test's ``mesh=`` (default
    "tp")."""
    return "tp"


_SOURCE_CACHE: dict[tuple[str, str], str | None] = {}


def source_unavailable(name: str, device_type: str) -> str | None:
    """The kernel registry's reason why op source ``name`` cannot run on ``device_type`` (None: it
    can)."""
    if name == "registry":
        return None
    key = (name, device_type)
    if key not in _SOURCE_CACHE:
        try:
            from tplogp.backends import kernel_registry
        except ImportError as exc:
            return f"tplogp.backends.kernel_registry is not importable: {exc}"
        import torch

        if device_type == "cuda":
            block = devices.gpu_block()
            index = devices.visible_gpus().index(block[0]) if block else 0
            dev = torch.device("cuda", index)
        else:
            dev = torch.device("cpu")
        _SOURCE_CACHE[key] = kernel_registry.source_status("linear_logp", device=dev).get(
            name, "unknown source")
    return _SOURCE_CACHE[key]


def make_grid_fixtures(settings: LMHeadSettings) -> Any:
    """The parametrizing fixtures, with grids restricted by the settings (--tp-op-source,
    --tp-dtype, ...)."""

    class GridFixtures:
        @pytest.fixture(params=list(settings.op_sources), ids=list(settings.op_sources))
        def op_source(self, request: pytest.FixtureRequest) -> OpSource:
            """Op source (registry, native, triton, sm90); unavailable ones skip with the registry's
            reason."""
            plan = plan_of(request)
            device_type = plan.device_type if plan is not None and not plan.external else "cpu"
            if plan is not None and plan.external:
                state = request.config.stash[STATE]
                device_type = state.external.ctx.device.type
            why = source_unavailable(request.param, device_type)
            if why is not None:
                pytest.skip(f"op source {request.param} unavailable on {device_type}: {why}")
            return OpSource(request.param)

        @pytest.fixture(params=list(settings.dtypes), ids=list(settings.dtypes))
        def dtype(self, request: pytest.FixtureRequest) -> Any:
            """torch dtype: fp32, bf16, fp16."""
            import torch

            return getattr(torch, DTYPES[request.param])

        @pytest.fixture(params=list(settings.biases), ids=list(settings.biases))
        def bias(self, request: pytest.FixtureRequest) -> bool:
            """Whether the LM head has a bias (ids nobias / bias)."""
            return BIASES[request.param]

        @pytest.fixture(params=list(settings.shards), ids=list(settings.shards))
        def vocab_shards(self, request: pytest.FixtureRequest, vocab_shards_size: int | None,
                         vocab_shards_mesh_dim: str) -> VocabShards:
            """Even and uneven vocab layouts (ids even / uneven); on a rank, bound to that rank's
            range. In a test with ``mesh=``, the vocabulary is sharded over the mesh dim
            ``vocab_shards_mesh_dim`` ("tp")."""
            plan = plan_of(request)
            ws = (plan.world_size if plan is not None
                  else request.config.stash[STATE].settings.world_size)
            vocab = DEFAULT_VOCAB_SIZE if vocab_shards_size is None else int(vocab_shards_size)
            shape = request.node.stash.get(MESH_SHAPE, None) if plan is not None else None
            if shape is None:
                return VocabShards(request.param, ws, vocab_size=vocab)
            if vocab_shards_mesh_dim not in shape.names:
                pytest.fail(f"{request.node.nodeid}: vocab_shards shards the vocabulary over mesh "
                            f"dim {vocab_shards_mesh_dim!r}, which {shape.describe()} does not "
                            f"have; name one of {', '.join(shape.names)} by overriding the "
                            "vocab_shards_mesh_dim fixture", pytrace=False)
            size = shape.sizes[shape.names.index(vocab_shards_mesh_dim)]
            return VocabShards(request.param, size, vocab_size=vocab, mesh=shape,
                               mesh_dim=vocab_shards_mesh_dim)

    return GridFixtures()
