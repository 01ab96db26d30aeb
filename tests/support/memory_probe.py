"""Run one forward+backward of linear_logp in this process and print the resident-memory growth (MiB) as JSON.

Usage: python tests/support/memory_probe.py N D V [native|eager|triton]. Used by tests/op/test_memory.py and
``python -m benchmarks memory`` in a fresh subprocess, so that nothing else in the test session inflates the
high-water mark. Resets the kernel's peak-RSS counter (/proc/self/clear_refs = 5) after the inputs exist.
"""

import json
import sys
import time

import torch


def rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def main() -> None:
    n, d, v = (int(x) for x in sys.argv[1:4])
    source = sys.argv[4] if len(sys.argv) > 4 else "native"
    from tplogp import get_op

    torch.manual_seed(0)
    h = torch.randn(n, d).requires_grad_()
    w = (torch.randn(v, d) / d ** 0.5).requires_grad_()
    t = torch.randint(0, v, (n,))
    g = torch.randn(n)
    if source == "eager":  # the materializing baseline: full fp32 logits, log_softmax, gather
        from tplogp.reference import reference_linear_logp

        def op(h, w, t):
            return reference_linear_logp(h, w, t, mode="fp32")
    else:
        op = get_op("linear_logp", source=source)
    op(h[:4], w, t[:4])  # warm up lazy imports and allocator pools outside the measurement
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = rss("VmRSS")
    t0 = time.perf_counter()
    out = op(h, w, t)
    (out * g).sum().backward()
    elapsed = time.perf_counter() - t0
    peak = rss("VmHWM")
    grads = (h.grad.numel() + w.grad.numel()) * 4
    print(json.dumps({"growth_mib": (peak - base) / 2**20, "grads_mib": grads / 2**20,
                      "logits_mib": n * v * 4 / 2**20, "elapsed_s": elapsed,
                      "finite": bool(torch.isfinite(out).all())}))


if __name__ == "__main__":
    main()
