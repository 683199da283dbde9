"""The op API: one call per hot operator; each picks its backend per problem."""
from .gemm import gemm, gemm_fp8

__all__ = ["gemm", "gemm_fp8"]
