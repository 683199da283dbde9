"""explain(): the decision an op call would get, without running it."""
from __future__ import annotations

from typing import Any

from .decision import Decision
from .op_spec import get_op_spec
from .resolver import resolve


def explain(op: str, *args: Any, **kwargs: Any) -> Decision:
    """Returns the Decision the op call ``op(*args, **kwargs)`` gets; prints readably.

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> d = turbo.explain("gemm", torch.randn(8, 16), torch.randn(16, 4))
        >>> print(d.backend, d.source)
        TORCH default
    """
    from .ops.gemm import PROBLEM_BUILDERS

    spec = get_op_spec(op)
    builder = PROBLEM_BUILDERS.get(op)
    if builder is None:
        raise ValueError(f"explain: op {op!r} has no argument parser; explainable ops: {', '.join(PROBLEM_BUILDERS)}")
    return resolve(spec, builder(*args, **kwargs))
