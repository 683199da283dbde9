"""Low-precision (float8 / MX) quantization recipes and reference quantize/dequantize.

The ops' own quantisation policy lives in submodules that are not re-exported here:
``fast_quantize`` (the fused Triton quantiser where it runs, else the reference),
``dual_quantize`` (both blockwise quantisations of one tensor from one read) and
``side_streams`` (two kernels side by side on two CUDA streams).
"""

from .config import Float8QuantConfig, Format, ScaleDtype, ScalingGranularity, ScalingRecipe
from .quantize import (FP8_MAX, QuantizedTensor, dequantize, dequantize_fp8, float8_e4m3, float8_e5m2, quantize,
                       quantize_fp8, quantize_with_config)
from .weight_reuse import WeightReuseScope, reuse_quantized_weights

__all__ = [
    "FP8_MAX",
    "Float8QuantConfig",
    "Format",
    "QuantizedTensor",
    "ScaleDtype",
    "ScalingGranularity",
    "ScalingRecipe",
    "WeightReuseScope",
    "dequantize",
    "dequantize_fp8",
    "float8_e4m3",
    "float8_e5m2",
    "quantize",
    "quantize_fp8",
    "quantize_with_config",
    "reuse_quantized_weights",
]
