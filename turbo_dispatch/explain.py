"""explain(): the decision an op call would get, without running it."""
from __future__ import annotations

from typing import Any

from .decision import Decision
from .op_spec import get_op_spec
from .resolver import resolve


def explain(op: str, *args: Any, **kwargs: Any) -> Decision:
    """Returns the Decision the op call ``op(*args, **kwargs)`` gets; prints readably.

    Where a tuned result is the reason (``source`` ``tuned-db`` or ``autotune``) and the tuner
    measured the winner's split, a note reads ``gpu X us, host Y us per call``: the tuner ranks
    candidates by the larger of the two, so the note tells whether the choice was bound by the
    device or by the host's issue path.

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> d = turbo.explain("gemm", torch.randn(8, 16), torch.randn(16, 4))
        >>> print(d.backend, d.source)
        TORCH default
    """
    from . import ops  # noqa: F401  (registers the op specs)

    spec = get_op_spec(op)
    if spec.problem_from_call is None:
        raise ValueError(f"explain: op {op!r} cannot build a problem from call arguments")
    return resolve(spec, spec.problem_from_call(*args, **kwargs))
