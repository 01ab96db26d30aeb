"""tplogp's benchmark suite: one entry point (``python -m benchmarks``, :mod:`benchmarks.cli`) over
one runner.

Modules, one role each: :mod:`~benchmarks.runner` (timing, memory, run info, the results file),
:mod:`~benchmarks.impls` (the implementations compared), :mod:`~benchmarks.variants` and
:mod:`~benchmarks.supports` (option variants, the sampler's supports they pass),
:mod:`~benchmarks.op` (the op benchmark),
:mod:`~benchmarks.memory`, :mod:`~benchmarks.plugin`, :mod:`~benchmarks.tp` (CPU memory, plugin
dispatch, TP scaling), :mod:`~benchmarks.ab` (A/B against another commit), :mod:`~benchmarks.plots`
and :mod:`~benchmarks.report` (Pareto plots, docs/performance.md). Importing the package does no
device work.
"""
