"""Stand-in for ``aiter.ops`` (its presence marks AMD's package)."""
