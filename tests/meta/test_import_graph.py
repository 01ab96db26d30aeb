"""The import graph of ``src/tplogp`` and ``src/pytest_tplogp`` has no cycles and no upward edges.

Every module is parsed (``ast``, nothing is imported) and every import inside the two packages
becomes an edge: module-level and function-level ``import`` / ``from ... import`` (relative ones
resolved), and module names given as dotted string constants (what ``importlib.import_module`` is
called with). Importing a submodule also runs its parents' ``__init__``; those implicit edges are
not counted.

``LAYERS`` is the declared order, lowest first. An entry ``"a.b"`` names one module; ``"a.b.*"``
names a package and everything under it; a module takes the layer of the longest entry that names
it, and every module must be named. An import may point to the same layer or a lower one.
pytest_tplogp sits above tplogp: the plugin may import the operator's package, never the other way
round.
"""

from __future__ import annotations

from typing import Optional

from tests.support.import_graph import import_graph, imports_of

LAYERS: list[tuple[str, ...]] = [
    # the packages' docstrings (their __init__ import nothing)
    ("tplogp.support", "tplogp.op", "tplogp.fused_loss", "tplogp.testing", "tplogp.backends"),
    # leaves: settings, plain data and math, the loss terms, the references and tolerances; no
    # package imports but each other (with the public re-exports of the terms, references and
    # tolerances)
    ("tplogp.support.settings", "tplogp.support.shards", "tplogp.support.fp32_gemm",
     "tplogp.support.tensors", "tplogp.support.masked_rows", "tplogp.outputs", "tplogp.testing.*",
     "tplogp.losses.*", "tplogp.reference", "tplogp.tolerances", "tplogp.rl_losses"),
    # how a call's memory budget splits into transient and kept parts, for every source (on the
    # settings)
    ("tplogp.backends.memory_budget",),
    # collectives; the tensor-parallel-invariant level's grid, exact merge and re-shard (on the
    # collectives); the sequences of a loss's tokens
    ("tplogp.support.comm", "tplogp.support.invariant", "tplogp.support.sequences"),
    # the options, declared once (their schema types, defaults, docs and checks)
    ("tplogp.op.options",),
    # the sampler's support of a call: its two forms made one, its checks, a shard's ids
    ("tplogp.op.support_ids", "tplogp.op.sampler_params"),
    # argument and layout validation; what the target checks read of the targets
    ("tplogp.op.validation",),
    # the group record exchange, then the deferred target verdicts (with the kernel-run target
    # check)
    ("tplogp.op.group_record",),
    ("tplogp.op.verdicts",),
    # Triton kernels, their launchers and tile planning
    ("tplogp.kernels.*",),
    # the per-shard sources (native, triton, sm90) behind one contract
    ("tplogp.backends.*",),
    # which source runs a call
    ("tplogp.backends.kernel_registry",),
    # the fused loss's gradient scaling (the scaling kernel, or torch ops without Triton)
    ("tplogp.fused_loss.grad_scaling",),
    # the sampler's support computed from its parameters (a pass over the vocabulary, one
    # collective per round)
    ("tplogp.op.sampler_passes",),
    ("tplogp.op.sampler_grid",),
    ("tplogp.op.sampler_support",),
    # a checked call brought to this shard: flattened, gathered, compacted, targets made local
    ("tplogp.op.local_call",),
    # the shared tensor-parallel path; DTensor unwrapping
    ("tplogp.op.tp", "tplogp.op.dtensor"),
    # the torch.library ops' bodies: the shared path with outputs of static shapes
    ("tplogp.op.packed_op",),
    # the call plan: every check, the per-layout state
    ("tplogp.op.plan",),
    # budgets and the fused loss's chunks
    ("tplogp.budgets",),
    # the fused loss's chunk plan and gradient assembly; the GRPO losses' chunk schedule on it
    ("tplogp.fused_loss.chunk_gradients",),
    ("tplogp.fused_loss.policy_loss",),
    # what runs the plan and the shared path: the torch.library ops (torch.compile), the fused loss
    ("tplogp.op.ops", "tplogp.fused_loss.loop"),
    # the two ops' calls under torch.compile: whether they cross the ops' schemas, the ops called
    ("tplogp.op.compiled_calls",),
    # the public operator
    ("tplogp.api",),
    # the runbook script's logic (python -m tplogp.runbook)
    ("tplogp.runbook.*",),
    # the package's public surface
    ("tplogp",),
    # optional entry points for training stacks (Hugging Face, TRL, verl), on top of the public
    # operator
    ("tplogp.integrations.*",),
    # the pytest plugin, which may use the operator
    ("pytest_tplogp.*",),
]


def layer_of(module: str, layers: list[tuple[str, ...]] = LAYERS) -> Optional[int]:
    best, best_len = None, -1
    for index, entries in enumerate(layers):
        for entry in entries:
            prefix = entry[:-2] if entry.endswith(".*") else None
            named = module == entry if prefix is None else module == prefix or module.startswith(prefix + ".")
            length = len(prefix if prefix is not None else entry)
            if named and length > best_len:
                best, best_len = index, length
    return best


def upward_edges(graph: dict[str, set[str]], layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            ls, ld = layer_of(src, layers), layer_of(dst, layers)
            if ls is not None and ld is not None and ld > ls:
                bad.append(f"{src} (layer {ls}) imports {dst} (layer {ld})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# ---- the checks ----------------------------------------------------------------------------------

def test_every_module_has_a_declared_layer():
    graph = import_graph()
    assert "tplogp.api" in graph and "pytest_tplogp.hooks" in graph  # the walk found the packages
    missing = [m for m in sorted(graph) if layer_of(m) is None]
    assert not missing, f"declare the layer of {missing} in LAYERS"


def test_import_graph_has_no_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_import_graph_has_no_upward_edges():
    bad = upward_edges(import_graph())
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_checker_sees_function_level_relative_and_string_imports(tmp_path):
    """The parser finds the kinds of import the packages use, and the checks flag a cycle and an
    upward edge."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .top import f\n")
    (pkg / "top.py").write_text("def f():\n    from .sub import low\n    return low\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "low.py").write_text("import importlib\nM = 'pkg.top'\nfrom .. import top\n")
    known = ["pkg", "pkg.top", "pkg.sub", "pkg.sub.low"]
    graph = {
        "pkg": imports_of("pkg", pkg / "__init__.py", known),
        "pkg.top": imports_of("pkg.top", pkg / "top.py", known),
        "pkg.sub.low": imports_of("pkg.sub.low", pkg / "sub" / "low.py", known),
    }
    assert graph == {"pkg": {"pkg.top"}, "pkg.top": {"pkg.sub.low"}, "pkg.sub.low": {"pkg.top"}}
    assert cycles(graph) == [["pkg.sub.low", "pkg.top"]]
    layers = [("pkg.sub.*",), ("pkg.top",), ("pkg",)]
    assert upward_edges(graph, layers) == ["pkg.sub.low (layer 0) imports pkg.top (layer 1)"]
