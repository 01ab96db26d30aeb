"""``torch.compile(fullgraph=True)`` that also hands back the graphs it captured: one dynamo trace proves both that
the function compiles without a graph break (``fullgraph=True`` raises on one) and what each graph holds, where
``torch._dynamo.explain`` followed by ``torch.compile`` traced the function twice."""

from __future__ import annotations

from typing import Any, Callable

import torch


def compile_fullgraph(fn: Callable, backend: str = "aot_eager") -> tuple[Callable, list[str]]:
    """``(compiled fn, codes)``: ``fn`` under ``torch.compile(fullgraph=True)`` with ``backend``, and the list that
    receives the Python code of every FX graph dynamo captures when the compiled function first runs."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(backend)
    codes: list[str] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        codes.append(gm.code)
        return inner(gm, example_inputs)

    return torch.compile(fn, fullgraph=True, backend=recording), codes
