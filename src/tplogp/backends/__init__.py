"""Compute sources for linear_logp. Each implements the per-shard contract of :mod:`tplogp.backends.base`."""
