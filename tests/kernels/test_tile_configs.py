"""Tile configs fit the device's shared memory for every dtype, and a source that cannot fit refuses
with a reason.

No GPU: a fake CUDA device (capability and shared-memory limit of an A100-class sm_80, an sm_86 and
an H200-class sm_90) stands in for ``torch.cuda``'s queries, and the configs come from the sources'
own selection path. The shared-memory model itself is checked against Triton's compiled kernels in
``tests/kernels/test_sm90_compile.py``.
"""

from __future__ import annotations

import types

import pytest
import torch

from tplogp.backends import kernel_registry
from tplogp.backends.sm90_backend import SM90Backend
from tplogp.backends.triton_backend import TritonBackend
from tplogp.kernels import tiles, workspace

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (capability, shared memory per block opt-in) as the devices report them
DEVICES = {"sm_80": ((8, 0), 166912), "sm_86": ((8, 6), 101376), "sm_90": ((9, 0), 232448)}
CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def fake_cuda(monkeypatch):
    """``fake_cuda(capability, smem_limit or None)``: torch.cuda answers as that device (None: no
    optin field)."""

    def install(cap, limit):
        # config selection as on the GPU (read at call time)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        props = types.SimpleNamespace(major=cap[0], minor=cap[1], name="fake")
        if limit is not None:
            props.shared_memory_per_block_optin = limit
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(kernel_registry, "_resolved_on_cuda", {})

    return install


def test_model_matches_the_failing_h200_config():
    """The H200 refused the sm90 forward for fp32 (128x256x64 tiles, 3 stages, ieee dots) with
    "Required: 262160"; the model reproduces it, and the 16-bit form (tensor cores) of the same
    tiles."""
    assert tiles.gemm_shared_bytes(128, 256, 64, 3, 4, tensor_cores=False) == 262160
    assert tiles.gemm_shared_bytes(128, 256, 64, 3, 2, tensor_cores=True) == 147480
    needs = tiles.shared_bytes(tiles.SM90, 4, "ieee")
    assert max(needs.values()) == 262160 > DEVICES["sm_90"][1]


@pytest.mark.parametrize("precision", ["highest", "high"])
@pytest.mark.parametrize("device_name", sorted(DEVICES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chosen_configs_fit(fake_cuda, monkeypatch, dtype, device_name, precision):
    """Every config a source chooses fits the device's shared memory (both sources, every dtype,
    fp32 with ieee and tf32 dots), keeps the invariants the kernels rely on, and changes only what
    had to shrink."""
    cap, limit = DEVICES[device_name]
    fake_cuda(cap, limit)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: precision)
    chosen = {"triton": TritonBackend()._cfg(CUDA0, dtype)}
    if cap == (9, 0):
        chosen["sm90"] = SM90Backend()._cfg(CUDA0, dtype)
    for source, cfg in chosen.items():
        base = tiles.SM90 if source == "sm90" else tiles.base_config(CUDA0)
        assert cfg.split_v == base.split_v  # the split layout stays a function of V
        precision_used = tiles.dot_precision(dtype)
        for kernel, need in tiles.shared_bytes(cfg, dtype.itemsize, precision_used).items():
            assert need <= limit, (source, kernel, need, limit, cfg)
        for name in ("block_n", "block_v", "block_d", "bwd_block_n", "bwd_block_v", "bwd_block_d",
                     "dh_block_n", "dh_block_d", "dh_block_k"):
            value = getattr(cfg, name)
            # tl.dot: powers of two >= 16
            assert value >= 16 and value & (value - 1) == 0, (name, value)
        assert workspace.CHUNK_ALIGN % cfg.bwd_block_v == 0 and workspace.CHUNK_ALIGN % cfg.dh_block_k == 0
        if (precision_used != "ieee" or dtype != torch.float32) and \
                max(tiles.shared_bytes(base, dtype.itemsize, precision_used).values()) <= limit:
            assert cfg == base  # nothing shrinks where the table's entry fits
    if dtype != torch.float32 and cap == (9, 0):
        assert chosen["sm90"] == tiles.SM90  # the measured bf16/fp16 config is kept on the H200


def test_fp32_on_h200(fake_cuda, monkeypatch):
    """fp32 with ieee dots (torch's default) gets CUDA-core sized tiles; with tf32 dots the table's
    tiles with one stage less."""
    fake_cuda(*DEVICES["sm_90"])
    cfg = SM90Backend()._cfg(CUDA0, torch.float32)
    assert (cfg.block_n, cfg.block_v, cfg.block_d, cfg.num_stages) == (128, 128, 32, 3)
    assert (cfg.bwd_block_v, cfg.dh_block_d, cfg.dh_block_k) == (128, 128, 32)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    cfg = SM90Backend()._cfg(CUDA0, torch.float32)
    assert (cfg.block_n, cfg.block_v, cfg.block_d, cfg.num_stages) == (128, 256, 64, 2)
    assert (cfg.bwd_num_stages, cfg.dh_num_stages) == (2, 2)


def test_limit_falls_back_to_the_capability_table(fake_cuda):
    fake_cuda((8, 6), None)  # properties without shared_memory_per_block_optin
    assert tiles.shared_memory_limit(CUDA0) == 101376
    fake_cuda((9, 0), None)
    assert tiles.shared_memory_limit(CUDA0) == 232448
    fake_cuda((12, 7), None)  # unknown: the smallest table entry
    assert tiles.shared_memory_limit(CUDA0) == min(tiles.SMEM_LIMIT_BY_CAPABILITY.values())


def test_fit_shrinks_in_order_and_refuses_when_nothing_fits():
    cfg = tiles.SM90
    fitted = tiles.fit_shared_memory(cfg, 4, "ieee", 60000)
    for need in tiles.shared_bytes(fitted, 4, "ieee").values():
        assert need <= 60000
    assert fitted.split_v == cfg.split_v and fitted.split_tiles * fitted.block_v == cfg.split_v
    with pytest.raises(tiles.TilesDoNotFitError,
                       match=r"forward statistics kernel needs \d+ bytes .* allows 1000"):
        tiles.fit_shared_memory(cfg, 4, "ieee", 1000)
    with pytest.raises(tiles.TilesDoNotFitError,
                       match="given tile config's forward statistics kernel"):
        tiles.check_shared_memory(cfg, 4, "ieee", 232447)


def test_registry_refuses_a_case_that_does_not_fit(fake_cuda, monkeypatch):
    """A device whose shared memory fits no fp32 config: the fused sources refuse fp32 with the
    reason, automatic selection falls back to native, an explicit request raises
    SourceUnavailableError; bf16 still runs fused."""
    fake_cuda((9, 0), 232448)
    # fits 16-bit 16x16 tiles, not fp32
    monkeypatch.setattr(tiles, "shared_memory_limit", lambda device: 3000)
    status = kernel_registry.source_status(device=CUDA0, dtype=torch.float32)
    assert status["native"] is None
    for source in ("triton", "sm90"):
        assert "no tile configuration" in status[source] and "torch.float32" in status[source], status
        assert "allows 3000" in status[source]
    assert kernel_registry.select_source(CUDA0, torch.float32) == "native"
    with pytest.raises(kernel_registry.SourceUnavailableError,
                       match="fused_linear_logp_sm90 is unavailable: no tile"):
        kernel_registry.backend_for_call("sm90", CUDA0, torch.float32)
    assert kernel_registry.source_status(device=CUDA0, dtype=torch.bfloat16)["sm90"] is None
    # no dtype: device-level status
    assert kernel_registry.source_status(device=CUDA0)["sm90"] is None


def test_explicit_config_that_does_not_fit_is_refused(fake_cuda):
    fake_cuda(*DEVICES["sm_86"])
    backend = TritonBackend(config=tiles.SM90)
    reason = backend.unsupported_reason(CUDA0, torch.bfloat16)
    assert reason is not None and "given tile config" in reason and "allows 101376" in reason
    # the table entry is fitted instead
    assert TritonBackend().unsupported_reason(CUDA0, torch.float32) is None


# ------------------------------------------------------------------------------------ TMA or
# pointer kernels by size


def _uses_tma(backend, n, d, v, deterministic=False, dtype=torch.bfloat16):
    """Whether the backend launches the TMA kernels for an ``[n, d] x [v, d]`` call (meta tensors:
    only the shapes and the dtype are read; False: the pointer kernels)."""
    from tplogp.backends.base import ShardCall

    hidden = torch.empty(n, d, device="meta", dtype=dtype)
    weight = torch.empty(v, d, device="meta", dtype=dtype)
    return backend._uses_tma(hidden, weight, ShardCall(deterministic=deterministic))


def test_sm90_launches_pointer_kernels_at_or_below_the_size_and_tma_above():
    from tplogp.backends import sm90_backend

    be = SM90Backend()
    at = sm90_backend.TMA_MIN_MACS
    assert not _uses_tma(be, 4096, 2048, 8192)  # 2^36: the limit itself
    assert 4096 * 2048 * 8192 == at
    assert _uses_tma(be, 4097, 2048, 8192)
    assert _uses_tma(be, 8192, 4096, 128256)
    # deterministic calls launch the TMA kernels at every size (a row's bits do not depend on its
    # batch)
    assert _uses_tma(be, 16, 32, 64, deterministic=True)
    # the size is the backend's: 0 sends every call to the TMA kernels (the interpreter tests of
    # those kernels)
    assert _uses_tma(SM90Backend(tma_min_macs=0), 16, 32, 64)
    # the portable source never takes them
    assert not _uses_tma(TritonBackend(), 8192, 4096, 128256)
    assert not _uses_tma(TritonBackend(), 16, 32, 64, deterministic=True)


def test_sm90_runs_fp32_fma_dots_on_the_pointer_kernels(monkeypatch):
    """fp32 at "highest" precision (CUDA-core FMA dots) takes the pointer kernels at every size and
    when deterministic (ptxas spills the TMA kernels' FMA loop: sm90_backend.uses_tma); at "high"
    (tf32 on the tensor cores) the size rule holds; the interpreter, which compiles nothing, keeps
    the TMA kernels for its tests."""
    monkeypatch.setattr(tiles, "interpreting", lambda: False)
    be, fp32 = SM90Backend(), torch.float32
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert not _uses_tma(be, 8192, 4096, 128256, dtype=fp32)
        assert not _uses_tma(be, 16, 32, 64, deterministic=True, dtype=fp32)
        assert _uses_tma(be, 16, 32, 64, deterministic=True, dtype=torch.float16)
        torch.set_float32_matmul_precision("high")
        assert _uses_tma(be, 8192, 4096, 128256, dtype=fp32)
        assert _uses_tma(be, 16, 32, 64, deterministic=True, dtype=fp32)
        torch.set_float32_matmul_precision("highest")
        monkeypatch.setattr(tiles, "interpreting", lambda: True)
        assert _uses_tma(be, 16, 32, 64, deterministic=True, dtype=fp32)
    finally:
        torch.set_float32_matmul_precision(before)
