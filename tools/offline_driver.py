"""A stand-in Triton driver for compiling on a machine without the target GPU.

``triton.runtime.driver.set_active(OfflineDriver(target))`` makes ``JITFunction.warmup`` (and a
launch switched to warm-up mode) specialise and compile for ``target`` with CPU tensors as
arguments; only loading and launching need the real device. Used by tools/compile_sm90.py and
tools/compile_rocm.py, which restore the previous driver afterwards.
"""
from __future__ import annotations

import torch


class OfflineDriver:
    """Just enough of a Triton driver for a warm-up compile: a target, a device index and a stream."""

    def __init__(self, target):
        self.target = target

    def is_active(self) -> bool:
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")
