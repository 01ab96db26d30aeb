"""Triton kernels behind the ``triton`` and ``sm90`` sources.

Importing this package imports Triton and defines the kernels; it does no CUDA work. Set ``TRITON_INTERPRET=1``
before the first import to run them on the CPU through Triton's interpreter (small shapes only).

* :mod:`.configs`          fixed tile configs per GPU architecture (a capability table), no autotuning.
* :mod:`.triton_forward`   fused GEMM + online-softmax statistics per vocab split, the split merge, and the
                           one-shard finalize (merge + logp / lse / entropy in one pass).
* :mod:`.triton_backward`  fused GEMM recompute + ``d_logits`` tiles into a bounded workspace, and a
                           fixed-tiling ``d_hidden`` GEMM for deterministic mode.
* :mod:`.sm90`             the Hopper variants (tensor-memory-accelerator descriptors, warp specialization).
* :mod:`.launch`           the launchers shared by both sources: shape checks, workspace planning, cuBLAS steps.
"""
