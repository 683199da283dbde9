"""Gated activations: SwiGLU, ``silu(gate) * up``, as one kernel each way.

``swiglu(gate, up)`` reads each input once and writes the output once (the fused producers'
``swiglu`` kernel, registry kernel ``fused_fp8_producers``); its backward reads gate, up and the
output's gradient once and writes both gradients once (``swiglu_backward``), and it keeps gate and
up for the backward, not ``silu(gate)``. In torch ops the same step is two passes forward and four
backward. silu is rounded to the inputs' dtype before the product, as ``F.silu(gate) * up`` rounds
it; the backward computes in float32.

The kernels serve bf16 / fp16 / fp32 GPU tensors whose last dimension has unit stride (halves of
one ``[..., 2F]`` projection are fine); other calls, traced calls (torch.compile fuses the torch
expression itself; fake tensors) and ``PRIMUS_TURBO_SWIGLU_TRITON=0`` (read per call) take
``F.silu(gate) * up``.

>>> import torch
>>> from turbo_dispatch.ops import swiglu
>>> gate_up = torch.randn(4, 16)
>>> swiglu(*gate_up.chunk(2, dim=-1)).shape
torch.Size([4, 8])
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..env import env_text_reader
from ._common import HIGH_PRECISION
from .eager_kernels import eager_kernel_module

__all__ = ["swiglu", "TRITON_ENV"]

#: Set to 0/false to keep ``F.silu(gate) * up`` (read on every call).
TRITON_ENV = "PRIMUS_TURBO_SWIGLU_TRITON"
_READ_SWITCH = env_text_reader(TRITON_ENV)
KERNEL = "fused_fp8_producers"


def kernels_for(gate: torch.Tensor) -> Optional[ModuleType]:
    """The kernel module when a SwiGLU of ``gate``'s kind runs it here (module docstring), else None."""
    if gate.dtype not in HIGH_PRECISION:
        return None
    return eager_kernel_module(KERNEL, gate, _READ_SWITCH, TRITON_ENV)


class _SwiGLU(torch.autograd.Function):
    """``apply(kernels, gate, up)``: ``silu(gate) * up`` of 2-D tensors through the kernel module."""

    @staticmethod
    def forward(ctx, kernels, gate, up):
        ctx.kernels = kernels
        ctx.save_for_backward(gate, up)
        return kernels.swiglu(gate, up)

    @staticmethod
    @once_differentiable
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dgate, dup = ctx.kernels.swiglu_backward(gate, up, dh.contiguous())
        return None, dgate, dup


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate`` and ``up`` of one shape, dtype and device (any leading
    dimensions), as a new tensor of that shape; differentiable in both (see the module docstring).

    >>> g, u = torch.zeros(2, 3), torch.ones(2, 3)
    >>> swiglu(g, u).tolist()   # silu(0) = 0
    [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"swiglu: {name} must be a torch.Tensor; got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"swiglu: {name} must be a floating-point tensor; got {t.dtype}")
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"swiglu: gate and up must have one shape, dtype and device; got {gate.dtype}"
                         f"{tuple(gate.shape)} on {gate.device} and {up.dtype}{tuple(up.shape)} on {up.device}")
    kernels = kernels_for(gate) if gate.dim() >= 1 and gate.numel() else None
    if kernels is None:
        return F.silu(gate) * up
    width = gate.shape[-1]
    return _SwiGLU.apply(kernels, gate.reshape(-1, width), up.reshape(-1, width)).reshape(gate.shape)
