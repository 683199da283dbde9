"""nn.Module drop-ins built on the ops."""
from .attention import TurboAttention
from .fused import RMSNormLinear, SwiGLUMLP
from .grouped_linear import GroupedLinear
from .linear import Linear

__all__ = ["GroupedLinear", "Linear", "RMSNormLinear", "SwiGLUMLP", "TurboAttention"]
