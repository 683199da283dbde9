"""CUDNN backend: cuDNN kernels reached through PyTorch (SDPA's cuDNN attention for now)."""
