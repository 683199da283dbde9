"""CK backends: AMD's Composable Kernel reached through torch on ROCm builds (the CK BLAS and
flash-attention preferences, Inductor's CK GEMM template). None of them has run on AMD hardware
yet (docs/rocm.md)."""
