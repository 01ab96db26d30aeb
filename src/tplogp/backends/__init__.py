"""The per-shard compute sources behind one contract, the registry that picks one, and the budget
table.

Each source (:mod:`.native`, torch ops; :mod:`.triton_backend`, with its layouts' plan in
:mod:`.triton_layouts`; :mod:`.sm90_backend`, TMA loads on Hopper) implements the two local primitives of :mod:`.base` (a shard's forward statistics and its
backward); every collective lives in the tensor-parallel layer above (:mod:`tplogp.op.tp`).
:mod:`.kernel_registry` says which source runs a call and why another is unavailable;
:mod:`.memory_budget` is the table of how a call's memory budget splits into transient and kept
parts, for every source.
"""
