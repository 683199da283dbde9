"""``num_cu``: a cap on how many compute units (SMs on NVIDIA, CUs on AMD) a grouped GEMM occupies,
so that communication kernels can run beside it on the rest.

The ops set the cap around every GEMM of the call (forward, dgrad, wgrad) with
``compute_unit_limit``; a backend whose kernel is persistent reads ``current_compute_unit_limit``
and launches at most that many programs, each occupying one SM. A backend without such a knob
(torch's grouped kernels, a one-program-per-tile grid) runs as always: the cap is a request about
sharing the GPU, never about the result, so ignoring it where it cannot apply is safe, and refusing
would make the backend choice depend on it. The cap is not part of any problem key.
"""
from __future__ import annotations

import contextvars
from typing import Optional

_LIMIT: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("turbo_dispatch_num_cu", default=None)


def check_num_cu(op: str, num_cu: object) -> Optional[int]:
    """``num_cu`` validated: None (no cap) or a positive int."""
    if num_cu is None:
        return None
    if isinstance(num_cu, bool) or not isinstance(num_cu, int) or num_cu <= 0:
        raise ValueError(f"{op}: num_cu must be None or a positive int (compute units to occupy); got {num_cu!r}")
    return num_cu


class compute_unit_limit:
    """Caps the persistent grouped kernels launched inside ``with compute_unit_limit(num_cu):`` at
    ``num_cu`` programs (None: no cap). A class, not a generator context manager: it wraps every
    eager grouped GEMM step twice (forward and backward), where contextlib's frames are host time."""

    __slots__ = ("_num_cu", "_token")

    def __init__(self, num_cu: Optional[int]) -> None:
        self._num_cu = num_cu
        self._token = None

    def __enter__(self) -> None:
        self._token = _LIMIT.set(self._num_cu)

    def __exit__(self, *exc: object) -> None:
        _LIMIT.reset(self._token)


def current_compute_unit_limit() -> Optional[int]:
    """The cap in force for a launch here, or None."""
    return _LIMIT.get()
