"""Shared helpers every layer uses: plain data, settings, small tensor and collective utilities.

:mod:`.settings` reads the environment (checks mode, workspace, launcher), :mod:`.shards` the
vocabulary shard layouts, :mod:`.tensors` row helpers and stream/capture queries, :mod:`.fp32_gemm`
the exact fp32 GEMMs, :mod:`.masked_rows` the masked-vocabulary row arithmetic, :mod:`.sequences`
the sequences of a loss's tokens, :mod:`.comm` the collectives (host groups, flat all-gathers,
overlapped reductions) and :mod:`.invariant` the tensor-parallel-invariant level's grid, exact merge
and re-shard on top of them. None imports anything of tplogp above this package, and none does
device work at import time.
"""
