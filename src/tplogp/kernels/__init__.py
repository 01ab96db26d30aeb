"""Triton kernels behind the ``triton`` and ``sm90`` sources (and, on a GPU, the sampler's tile
steps and the support pairs' ``d_W``).

Importing this package does nothing; importing a kernel module imports Triton and defines its
kernels (no CUDA work). Set ``TRITON_INTERPRET=1`` before the first import to run them on the CPU
through Triton's interpreter (small shapes only). Modules, lowest layer first (each imports only the
ones above it in this list):

* :mod:`.tiles`             tile configs per GPU architecture, fitted to the device's shared memory
                            per element size; the dot precision. No Triton import.
* :mod:`.kept`              layout of the softmax terms the forward keeps for the backward. No
  Triton import.
* :mod:`.workspace`         how a budget splits into the d_logits workspace and kept terms; the
                            backward's chunks. No Triton import.
* :mod:`.support_bits`      a sampler's support as the kernels read it: a per-row bitmask of a
                            range of the shard's columns, and the token chunks of the forward
                            whose bitmask fits the budget. No Triton import.
* :mod:`.launch`            :class:`~.launch.Launch`, the one way a kernel is launched: made once
                            per (kernel, layout), the compiled kernel looked up by the tensors'
                            alignment; :func:`~.launch.cached`, the one bounded cache of the
                            per-call paths' launches and programs.
* :mod:`.fp32_ops`          fp32 elementwise primitives (exp2, tanh, an unfused multiply, 16-bit
                            rounding) and their PTX forms on a GPU.
* :mod:`.tile_ops`          the ``@triton.jit`` tile operations every kernel shares: launch order,
                            dot, the pointer K loop, the softcap, the target's column, a support's
                            bitmask, the kept terms' pointers.
* :mod:`.forward_epilogue`  the forward's online-softmax epilogue on a logits tile, its stats'
                            storage and the kept terms' stores.
* :mod:`.backward_epilogue` the backward's d_logits epilogue (recomputed or from kept terms).
* :mod:`.forward_kernels`   forward statistics per vocab split (pointer loads), the split merge, the
  one-shard finalize.
* :mod:`.backward_kernels`  the d_logits recompute (pointer loads), d_logits from kept terms,
  deterministic ``d_hidden``.
* :mod:`.hopper_kernels`    the forward-statistics and d_logits kernels with TMA tensor-descriptor
  loads (sm_90).
* :mod:`.scale_kernels`     the fused loss's backward: a gradient times the upstream scalar, rounded
  once.
* :mod:`.sampler_kernels`   the sampler's counting pass and collecting round on one logits tile
                            (bins of a row's logits with their mass; the ids at least a threshold).
* :mod:`.pairs_kernels`     a sampler's support's (token, id) pairs: each id's ``d_W`` row from its
                            run of pairs.
* :mod:`.launches`          a call's options as the kernels take them (one bundle); each shard
                            kernel's launch for a layout, from sizes; when the TMA
  kernels may run.
* :mod:`.entry_checks`      what the entry points accept (shapes, dtypes, devices, strides), checked
  before a launch.
* :mod:`.forward_programs`  the forward's per-layout programs and the entry points that run them:
                            outputs, per-split stats, the stats and merge / finalize launches.
* :mod:`.backward_programs` the backward's entry point (the d_logits chunks, their launches and the
                            cuBLAS steps) and the per-layout program of a consuming kept backward.
* :mod:`.grid_programs`     the tensor-parallel-invariant level's entry points: per-block forward
                            stats, the grid-block backward (fixed-shape d_W GEMMs).
* :mod:`.scale_launch`      the fused loss's scaling launch and its checks.
* :mod:`.sampler_launch`    the sampler's tile launches and their checks.
* :mod:`.pairs_launch`      the pairs' ``d_W`` launch and its checks.
"""
