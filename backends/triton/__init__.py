"""TRITON backends: our own Triton kernels (portable to ROCm Triton) and their adapters."""
