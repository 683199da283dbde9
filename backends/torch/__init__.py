"""TORCH backend: PyTorch's own ATen ops (torch.matmul, torch._scaled_mm, ...)."""
