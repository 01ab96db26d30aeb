"""The source registry: names, automatic choice, explicit requests that cannot run, lazy imports."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from tplogp import SourceUnavailableError, get_op, linear_logp
from tplogp.backends import kernel_registry as reg


def test_unknown_op_and_source_list_what_exists():
    with pytest.raises(KeyError, match="unknown op 'linear_log'; available ops: linear_logp"):
        get_op("linear_log")
    with pytest.raises(KeyError, match="unknown source 'cuda'.*native, triton, sm90"):
        get_op("linear_logp", source="cuda")


def test_status_reports_every_source():
    status = reg.source_status("linear_logp", torch.device("cpu"))
    assert set(status) == {"native", "triton", "sm90"}
    assert status["native"] is None
    assert isinstance(status["sm90"], str) and status["sm90"], "sm90 cannot run on a CPU: a reason is expected"


def test_explicit_unavailable_source_raises_with_reason():
    with pytest.raises(SourceUnavailableError, match=r"fused_linear_logp_sm90 is unavailable: .+"):
        get_op("linear_logp", source="sm90")


def test_automatic_choice_on_cpu_is_native_and_logged(caplog):
    reg._logged_choice.clear()
    with caplog.at_level(logging.INFO, logger="tplogp"):
        assert reg.select_source(torch.device("cpu")) == "native"
    assert any("uses source 'native'" in r.getMessage() for r in caplog.records)


def test_registry_op_equals_public_op_and_native():
    h, w = torch.randn(6, 5), torch.randn(11, 5)
    t = torch.randint(0, 11, (6,))
    a = get_op("linear_logp")(h, w, t)
    b = linear_logp(h, w, t)
    c = get_op("linear_logp", source="native")(h, w, t)
    assert torch.equal(a, b) and torch.equal(a, c)


def test_import_does_no_device_work_and_needs_no_triton():
    """Importing tplogp must not import triton, initialise CUDA, or touch a device."""
    code = (
        "import sys, tplogp, tplogp.backends.kernel_registry;"
        "import torch;"
        "assert 'triton' not in sys.modules, 'triton imported at import time';"
        "assert not torch.cuda.is_initialized();"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
