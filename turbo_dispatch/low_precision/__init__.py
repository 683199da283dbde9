"""Low-precision (float8 / MX) quantization recipes and reference quantize/dequantize."""

from .config import Float8QuantConfig, Format, ScaleDtype, ScalingGranularity
from .quantize import FP8_MAX, QuantizedTensor, dequantize, quantize, quantize_with_config

__all__ = [
    "FP8_MAX",
    "Float8QuantConfig",
    "Format",
    "QuantizedTensor",
    "ScaleDtype",
    "ScalingGranularity",
    "dequantize",
    "quantize",
    "quantize_with_config",
]
