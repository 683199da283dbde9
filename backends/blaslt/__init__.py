"""CUBLASLT / HIPBLASLT backends: the vendor BLAS-Lt libraries, driven through PyTorch's bindings
(``torch.matmul`` with cuBLASLt preferred, ``torch._scaled_mm`` / ``torch.nn.functional.scaled_mm``)."""
