"""Megatron's gradient-accumulation fusion: ``fuse_bgrad_accum_pattern="megatron"`` on gemm,
gemm_fp8, grouped_gemm and grouped_gemm_fp8.

Megatron keeps each weight's gradient in a buffer ``weight.main_grad`` (fp32 by default) and, after
every backward, adds ``weight.grad`` into it unless ``weight.grad_added_to_main_grad`` is set. With
the pattern, the op's forward sets that flag and its backward adds the weight gradient into
``main_grad`` itself, then hands autograd a zero stand-in of the weight's shape and dtype: Megatron
wants a tensor there (its hooks run per parameter) and ignores it because of the flag, and any
other consumer that adds ``weight.grad`` somewhere adds nothing twice.

What is added is the weight gradient the op returns without the pattern (same problem keys, same
backends, the weight's dtype), so ``main_grad`` ends bit-for-bit at ``main_grad + grad``, the sum
the unfused Megatron step computes, on every backend. A GEMM epilogue that accumulated in fp32
inside the kernel would round differently (and needs a backend capability the adapters do not
have), so the addition is its own kernel; it saves the gradient's lifetime until Megatron's hook,
not its computation.
"""
from __future__ import annotations

from typing import Optional

import torch

#: The accumulation patterns ``fuse_bgrad_accum_pattern`` accepts.
PATTERNS = ("megatron",)


def main_grad_for(op: str, weight, pattern: Optional[str]) -> Optional[torch.Tensor]:
    """The buffer the weight gradient of this call is added into: ``weight.main_grad``, or None
    when the call has no pattern or computes no weight gradient (``weight`` does not require grad
    or grad mode is off). Sets ``weight.grad_added_to_main_grad = True`` when it returns a buffer:
    the flag belongs to the parameter object, which the backward no longer sees."""
    if pattern is None:
        return None
    if pattern not in PATTERNS:
        raise ValueError(f"{op}: fuse_bgrad_accum_pattern must be None or one of {PATTERNS}; got {pattern!r}")
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{op}: fuse_bgrad_accum_pattern={pattern!r} needs the weight (b) as a tensor; a "
                         f"pre-quantised {type(weight).__name__} has no gradient to accumulate")
    if not (weight.requires_grad and torch.is_grad_enabled()):
        return None
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor):
        raise ValueError(f"{op}: fuse_bgrad_accum_pattern={pattern!r} needs weight.main_grad, a tensor of the "
                         f"weight's shape {tuple(weight.shape)} that the gradient is added into; got "
                         f"{type(main_grad).__name__}")
    if main_grad.shape != weight.shape or main_grad.device != weight.device or not main_grad.is_floating_point():
        raise ValueError(f"{op}: weight.main_grad must be a floating tensor of the weight's shape "
                         f"{tuple(weight.shape)} on {weight.device}; got {main_grad.dtype} {tuple(main_grad.shape)} "
                         f"on {main_grad.device}")
    weight.grad_added_to_main_grad = True
    return main_grad


def stand_in_grad(grad: torch.Tensor) -> torch.Tensor:
    """The weight's autograd gradient once its value went into ``main_grad``: zeros of its shape
    and dtype, one element broadcast (autograd materialises it only if it stores it)."""
    return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)


def add_to_main_grad(main_grad: Optional[torch.Tensor], grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The eager backward's last step: ``main_grad += grad`` and the stand-in, or ``grad`` itself
    when there is no buffer (or no gradient)."""
    if main_grad is None or grad is None:
        return grad
    main_grad.add_(grad)
    return stand_in_grad(grad)


@torch.library.custom_op("turbo_dispatch::add_to_main_grad", mutates_args=("main_grad",))
def _add_to_main_grad_op(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    """``main_grad += grad`` as one node that a compiled backward may run on a forward input."""
    main_grad.add_(grad)


@_add_to_main_grad_op.register_fake
def _add_to_main_grad_fake(main_grad, grad):
    return None


def add_to_main_grad_compiled(main_grad: Optional[torch.Tensor],
                              grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``add_to_main_grad`` for the custom ops' registered backward: the in-place addition goes
    through ``turbo_dispatch::add_to_main_grad``, declared as mutating ``main_grad``, so that the
    compiled backward keeps it (and orders it) although ``main_grad`` is not one of its outputs."""
    if main_grad is None or grad is None:
        return grad
    torch.ops.turbo_dispatch.add_to_main_grad(main_grad, grad)
    return stand_in_grad(grad)
