"""Stand-in for PyPI's unrelated ``aiter`` package (asyncio iterator helpers): same import name as
AMD's AITER, none of its entry points."""

__version__ = "0.13.20191203"

from .map_aiter import map_aiter  # noqa: E402,F401
