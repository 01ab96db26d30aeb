"""The test suite, one folder per part of the project:

* ``op``: ``linear_logp`` and what one call goes through (options, checks, plan, registry, budgets, workspace,
  DTensor, autocast, torch.compile, the TP path on gloo ranks);
* ``kernels``: the Triton kernels through Triton's CPU interpreter, tile configs, launches, sm90 compilations;
* ``loss``: ``linear_logp_loss`` and the per-token losses;
* ``integrations``: Hugging Face, verl, and the examples of docs/integrations.md and docs/training.md;
* ``plugin``: pytest_tplogp, mostly through pytester subprocesses;
* ``gpu``: tests that need a CUDA device (marker ``gpu``);
* ``meta``: the repository itself: import layers, the suite's own import rule, the benchmarks, the runbook script;
* ``support``: what test modules share (problems and references, doc examples, the bounds table, process helpers).
  A test module imports nothing from another test module (``meta/test_suite_imports.py``).

``linear_logp_tp.py`` is the runbook's script (``torchrun ... tests/linear_logp_tp.py``), not a test module.
``python -m pytest -m "not slow" -n 2`` is the inner loop; ``slow`` marks expensive cases covered in kind by faster
ones.
"""
