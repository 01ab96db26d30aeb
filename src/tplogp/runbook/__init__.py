"""Runbook validation of the tensor-parallel linear_logp path, launched with torchrun.

    torchrun --standalone --nproc_per_node=4 -m tplogp.runbook --dtype fp32 --tokens 128 \\
        --hidden-size 256 --vocab-size 4096 --uneven-shards

(``tests/linear_logp_tp.py`` is the same program, the entry the runbook's command lines use.)

Phase ``correctness`` builds the full weight on every rank (same seed), gives each rank its shard
``weight[start:end]``, runs the op with a random per-token upstream gradient and compares the
output, ``hidden.grad`` and the local ``weight.grad`` / ``bias.grad`` against a materialized
full-vocab reference (``--reference-mode``). Phase ``stress`` (``--run-stress``) runs a larger shape
where each rank only ever holds its shard, and reports finiteness, the first step and the warmed
median step time (max over ranks), and peak memory (GPU: allocator peak; CPU: resident growth),
printing each step's time as it goes. Exit status is non-zero on any FAIL or error.

Modules, one role each: ``flags`` (command line), ``launch`` (process group, rank-0 output),
``inputs`` (random problem data and op keyword arguments), ``report`` (comparisons and metric
lines), ``correctness`` and ``stress`` (the two phases), ``cli`` (``main``).
"""

from .cli import main

__all__ = ["main"]
