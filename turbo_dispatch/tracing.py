"""Whether anything traces the current call rather than running it."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def tracing() -> bool:
    """True while torch.compile traces, or while any dispatch mode is active (fake, proxy or
    functional tensors: AOT autograd, opcheck, make_fx). Work that only makes sense on real
    tensors in eager execution (side streams, caches of real tensors)
    checks this first.

    >>> tracing()
    False
    """
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
