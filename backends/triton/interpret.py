"""Whether Triton's CPU interpreter runs the kernels (``TRITON_INTERPRET``).

Asked on the launch paths of every call, and tests switch the variable inside one process, so it
is read each time, through ``turbo_dispatch.env.env_reader`` (a dict lookup, not three frames of
``os.environ.get``)."""
from __future__ import annotations

from turbo_dispatch.env import env_reader

_READ = env_reader("TRITON_INTERPRET")
_OFF = ("", "0", b"", b"0")


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` is set to anything but empty or ``0``."""
    raw = _READ()
    return raw is not None and raw not in _OFF
