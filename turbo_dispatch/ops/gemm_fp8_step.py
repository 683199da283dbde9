"""What gemm_fp8's training step keeps for its backward: the activation, saved quantised.

The forward saves op(a)^T [K, M] quantised along M (the wgrad's reduction dim; 1-D runs under
BLOCKWISE) instead of ``a``, its data stored [K, M] contiguous, so both the Triton kernel (K-major
operands) and cuBLASLt read it without a copy. The wgrad's backend would quantise the
high-precision ``a`` exactly so, hence saving this changes no bit of the gradient and halves
(bf16) or quarters (fp32) what is kept alive until backward. The saved pair (data, scale) goes
through ``save_for_backward``; ``saved_as_quantized`` rebuilds it.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..low_precision import Float8QuantConfig, QuantizedTensor, ScalingGranularity
from ..low_precision.fast_quantize import quantize_rows
from .gemm_problem import GemmFp8Problem


def wgrad_operand(a: torch.Tensor, trans_a: bool, cfg: Float8QuantConfig) -> QuantizedTensor:
    """The activation as the wgrad GEMM consumes it: op(a)^T [K, M] quantised along M. Through the
    fused Triton quantiser on a GPU: one read of ``a`` and no float32 temporaries, which would
    raise the peak memory this saving exists to lower."""
    return quantize_rows(a if trans_a else a.t(), cfg.format.fwd_dtype(), cfg.granularity, cfg.block_size)


def quantize_rows_like(x: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity,
                       block_size: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (data, scale) shaped as ``quantize(x, axis=1)`` gives them; works on ``meta``."""
    rows, cols = x.shape
    if granularity is ScalingGranularity.TENSORWISE:
        scale_shape: tuple[int, ...] = ()
    elif granularity is ScalingGranularity.ROWWISE:
        scale_shape = (rows, 1)
    else:
        scale_shape = (rows, -(-cols // block_size))
    return x.new_empty((rows, cols), dtype=dtype), x.new_empty(scale_shape, dtype=torch.float32)


def saved_as_quantized(data: torch.Tensor, scale: torch.Tensor, cfg: Float8QuantConfig) -> QuantizedTensor:
    """Rebuilds ``wgrad_operand``'s result from its two saved tensors."""
    return QuantizedTensor(data=data, scale=scale, granularity=cfg.granularity, axis=1, block_size=cfg.block_size,
                           block_2d=False)


def wgrad_operand_like(a: torch.Tensor, trans_a: bool, cfg: Float8QuantConfig) -> QuantizedTensor:
    """``wgrad_operand``'s result, shapes and dtypes only (uninitialised; works on ``meta``): for
    building the wgrad's key without quantising anything (``tuning.keys``)."""
    at = a if trans_a else a.t()
    return saved_as_quantized(*quantize_rows_like(at, cfg.format.fwd_dtype(), cfg.granularity, cfg.block_size), cfg)


def with_prequantized_a(p: GemmFp8Problem) -> GemmFp8Problem:
    """The forward's key once ``op(a)`` arrives quantised along K as ``[M, K]`` (no trans flag)."""
    return p._replace(trans_a=False, a_dtype=p.a_fp8)
