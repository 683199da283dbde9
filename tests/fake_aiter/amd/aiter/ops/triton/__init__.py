"""Stand-in for ``aiter.ops.triton``."""
