"""Which elementwise ops run a registry kernel module on a given call."""
from __future__ import annotations

from types import ModuleType
from typing import Callable, Optional

import torch

from ..env import parse_bool
from ..registry import kernel_module
from ..tracing import tracing


def eager_kernel_module(name: str, x: torch.Tensor, read_switch: Callable[[], Optional[str]],
                        switch_env: str) -> Optional[ModuleType]:
    """The kernel module registered as ``name`` (registry.yaml ``kernels``) when a call on ``x``
    runs it, else None (the caller takes its torch path): not traced (torch.compile fuses torch ops
    itself; fake and proxy tensors have no data to launch on), the switch ``switch_env`` (its text
    from ``read_switch``, read on every call) not set to a false value, and the module importable,
    able to run here (``available()``) and serving ``x`` (``serves(x)``). A malformed switch raises
    ConfigError naming it.

    >>> from turbo_dispatch.env import env_text_reader
    >>> eager_kernel_module("no_such_kernel", torch.zeros(1), env_text_reader("UNSET_SWITCH"), "UNSET_SWITCH")
    """
    if tracing() or parse_bool(read_switch(), switch_env) is False:
        return None
    module, _ = kernel_module(name)
    if module is None or module.available() is not None or not module.serves(x):
        return None
    return module
