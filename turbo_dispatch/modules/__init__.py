"""nn.Module drop-ins built on the ops."""
from .linear import Linear

__all__ = ["Linear"]
