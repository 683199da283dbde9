"""nn.Module drop-ins built on the ops."""
from .grouped_linear import GroupedLinear
from .linear import Linear

__all__ = ["GroupedLinear", "Linear"]
