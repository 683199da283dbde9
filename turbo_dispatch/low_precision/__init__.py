"""Low-precision (float8 / MX) quantization recipes and reference quantize/dequantize."""

from .config import Float8QuantConfig, Format, ScaleDtype, ScalingGranularity
from .quantize import FP8_MAX, QuantizedTensor, dequantize, quantize, quantize_with_config
from .weight_reuse import WeightReuseScope, reuse_quantized_weights

__all__ = [
    "FP8_MAX",
    "Float8QuantConfig",
    "Format",
    "QuantizedTensor",
    "ScaleDtype",
    "ScalingGranularity",
    "WeightReuseScope",
    "dequantize",
    "quantize",
    "quantize_with_config",
    "reuse_quantized_weights",
]
