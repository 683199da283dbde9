"""The gradient formulas of gemm and gemm_fp8, shared by the eager and the compiled path.

Each takes the GEMM to run as a callable (``mm`` or ``mm8``), so the eager autograd Functions
pass one that resolves and runs, the custom ops' backward one that calls a custom op, and
``tuning.keys`` one that only records the problem keys.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..low_precision import QuantizedTensor, ScalingGranularity


def gemm_grads(mm: Callable, a, b, grad, trans_a: bool, trans_b: bool, need_a: bool, need_b: bool):
    """dA and dB of C = op(A) @ op(B), each itself a gemm with the layout flags that avoid copies.

    ``mm(x, y, trans_x, trans_y, out_dtype)`` runs one gemm."""
    g = grad if grad.dtype == a.dtype else grad.to(a.dtype)
    grad_a = grad_b = None
    if need_a:
        grad_a = mm(b, g, trans_b, True, a.dtype) if trans_a else mm(g, b, False, not trans_b, a.dtype)
    if need_b:
        grad_b = mm(g, a, True, trans_a, b.dtype) if trans_b else mm(a, g, not trans_a, False, b.dtype)
    return grad_a, grad_b


def fp8_grads(mm8: Callable, a, b, grad, trans_a: bool, trans_b: bool, fwd: torch.dtype, bwd: torch.dtype,
              granularity: ScalingGranularity, need_a: bool, need_b: bool,
              a_dtype: Optional[torch.dtype] = None, b_dtype: Optional[torch.dtype] = None):
    """Like ``gemm_grads``, with the recipe's roles: the gradient is quantised as ``bwd`` (E5M2
    under HYBRID); under BLOCKWISE the weight keeps its 2-D tiles and the wgrad operands use 1-D
    runs along the token dimension, which is that GEMM's reduction dimension.

    ``mm8(x, y, trans_x, trans_y, out_dtype, x_fp8, y_fp8, x_2d, y_2d)`` runs one fp8 GEMM.

    ``a`` is either the forward's high-precision ``a`` or what ``gemm_fp8_step.wgrad_operand``
    saved from it: op(a)^T [K, M] quantised along M. The latter enters the wgrad as is, with the
    layout flags that read it as stored. ``a_dtype``/``b_dtype`` (the gradients' dtypes) default
    to the operands' own, and must be given for a quantised ``a`` (and for ``b=None`` when not
    need_a).

    ``grad`` may arrive quantised: along N (the dgrad's K) for need_a alone, along M (the wgrad's
    K) for need_b alone, as ``gemm_fp8_step.gradient_in_turn`` makes them.
    """
    a_dtype = a.dtype if a_dtype is None else a_dtype
    b_dtype = b.dtype if b_dtype is None else b_dtype
    w2d = granularity is ScalingGranularity.BLOCKWISE
    grad_a = grad_b = None
    if need_a:
        if trans_a:
            grad_a = mm8(b, grad, trans_b, True, a_dtype, fwd, bwd, w2d, False)
        else:
            grad_a = mm8(grad, b, False, not trans_b, a_dtype, bwd, fwd, False, w2d)
    if need_b:
        if isinstance(a, QuantizedTensor):  # a^T stored [K, M]: dB = a^T @ grad, or dB^T = grad^T @ a
            if trans_b:
                grad_b = mm8(grad, a, True, True, b_dtype, bwd, fwd, False, False)
            else:
                grad_b = mm8(a, grad, False, False, b_dtype, fwd, bwd, False, False)
        elif trans_b:
            grad_b = mm8(grad, a, True, trans_a, b_dtype, bwd, fwd, False, False)
        else:
            grad_b = mm8(a, grad, not trans_a, False, b_dtype, fwd, bwd, False, False)
    return grad_a, grad_b
