"""Triton kernels behind the ``triton`` and ``sm90`` sources.

Importing this package does nothing; importing a kernel module imports Triton and defines its kernels (no CUDA
work). Set ``TRITON_INTERPRET=1`` before the first import to run them on the CPU through Triton's interpreter (small
shapes only). Modules, lowest layer first (each imports only the ones above it in this list):

* :mod:`.tiles`            tile configs per GPU architecture, fitted to the device's shared memory per element
                           size; the dot precision; the backward's workspace chunking. No Triton import.
* :mod:`.direct_launch`    launching compiled kernels without Triton's per-call front end.
* :mod:`.bound_launch`     a launch described once from sizes, and bound to its compiled kernel for one call
                           layout: the tensors alone change from call to call.
* :mod:`.common`           the ``@triton.jit`` helpers both paths share: launch order, dot, exp2, the forward's
                           online-softmax epilogue, the backward's d_logits epilogue.
* :mod:`.generic_kernels`  pointer-based kernels: forward statistics per vocab split, the split merge, the one-shard
                           finalize, the d_logits recompute, the deterministic ``d_hidden`` GEMM.
* :mod:`.hopper_kernels`   the forward-statistics and d_logits kernels with TMA tensor-descriptor loads (sm_90).
* :mod:`.scale_kernels`    the fused loss's backward: a gradient times the upstream scalar, rounded once.
* :mod:`.generic_launch`   input checks, buffers, launches and the cuBLAS steps (both sources), and the per-layout
                           programs of the single-shard forward and the consuming kept backward.
* :mod:`.hopper_launch`    tensor descriptors and the TMA kernels' launches (the sm90 source's hooks).
* :mod:`.scale_launch`     the scaling kernel's checks and launch.
"""
