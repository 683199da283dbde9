"""The op API: one call per hot operator; each picks its backend per problem."""
from .attention import flash_attn_func, flash_attn_varlen_func
from .attention_fp8 import flash_attn_fp8_func
from .gemm import gemm, gemm_fp8
from .grouped_gemm import grouped_gemm, grouped_gemm_fp8
from .moe import moe_combine, moe_dispatch
from .rotary import apply_rotary_emb, split_qkv_rotary_emb
from .activation import swiglu

__all__ = [
    "apply_rotary_emb",
    "flash_attn_fp8_func",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "gemm",
    "gemm_fp8",
    "grouped_gemm",
    "grouped_gemm_fp8",
    "moe_combine",
    "moe_dispatch",
    "split_qkv_rotary_emb",
    "swiglu",
]
