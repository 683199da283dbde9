"""The gradient formulas of grouped_gemm and grouped_gemm_fp8, shared by the eager and the
compiled path.

dgrad is again a grouped GEMM: ``grad_a = grouped_gemm(grad, b, trans_b=not trans_b)``; wgrad is a
variable-K grouped GEMM: ``grad_b[i] = a_i^T @ grad_i`` ([G, K, N]) or ``grad_i^T @ a_i`` ([G, N, K],
trans_b), a reduction over each group's tokens; an empty group gets an exactly-zero weight
gradient. Each formula takes the GEMMs to run as callables (``mm``/``mm_k``, ``mm8``/``mm8_k``), so
the eager path passes ones that resolve and run, the custom ops' backward ones that call custom
ops, and ``tuning.keys`` ones that only record the keys.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..low_precision import ScalingGranularity
from ..low_precision.side_streams import overlappable, side_by_side


def grouped_grads(mm: Callable, mm_k: Callable, a, b, grad, group_lens, group_offs, trans_b: bool,
                  need_a: bool, need_b: bool):
    """dA is a grouped GEMM against b with trans_b flipped; dB a variable-K grouped GEMM whose
    operand order yields b's own layout ([G, K, N], or [G, N, K] with trans_b).

    ``mm(x, y, lens, offs, trans_b)`` runs one fixed-K grouped GEMM, ``mm_k(x, y, lens, offs)`` one
    variable-K grouped GEMM."""
    g = grad if grad.dtype == a.dtype else grad.to(a.dtype)
    grad_a = grad_b = None
    if need_a:
        grad_a = mm(g, b, group_lens, group_offs, not trans_b)
    if need_b:
        grad_b = mm_k(g, a, group_lens, group_offs) if trans_b else mm_k(a, g, group_lens, group_offs)
    return grad_a, grad_b


def grouped_fp8_grads(mm8: Callable, mm8_k: Callable, a, b, grad, group_lens, group_offs, trans_b: bool,
                      fwd: torch.dtype, bwd: torch.dtype, granularity: ScalingGranularity, need_a: bool,
                      need_b: bool, a_dtype: Optional[torch.dtype] = None, b_dtype: Optional[torch.dtype] = None,
                      runs_both: Optional[Callable] = None, block_size: Optional[int] = None):
    """Like ``grouped_grads`` with the recipe's roles (as ``gemm_grads.fp8_grads``): the gradient
    is quantised as ``bwd`` (E5M2 under HYBRID); under BLOCKWISE the weight keeps its 2-D tiles in
    dgrad, and both wgrad operands use 1-D runs along the tokens, that GEMM's reduction dimension.

    ``mm8(x, y, lens, offs, trans_b, out_dtype, x_fp8, y_fp8, y_2d)`` and
    ``mm8_k(x, y, lens, offs, out_dtype, x_fp8, y_fp8)`` run one fp8 grouped GEMM each.

    In a step that reuses its quantisations (``grouped_gemm_fp8_step``), ``a`` and ``b`` are what
    the forward saved: a's token runs and b's tiles stored for the dgrad, both QuantizedTensors,
    and ``a_dtype``/``b_dtype`` name the gradients' dtypes. Then ``runs_both``
    (``quantize_runs_both`` or its custom op) quantises the gradient for both GEMMs from one read
    when both gradients are needed; otherwise each GEMM's backend quantises it.

    Where both gradients are needed on real eager CUDA tensors (``overlappable``), the dgrad runs
    on a side stream beside the wgrad, so that each kernel's last wave shares the GPU with the
    other's programs; the results are bit-identical to running them in turn.
    """
    a_dtype = a.dtype if a_dtype is None else a_dtype
    b_dtype = b.dtype if b_dtype is None else b_dtype
    w2d = granularity is ScalingGranularity.BLOCKWISE
    g_rows = g_cols = grad
    if runs_both is not None and need_a and need_b:
        g_rows, g_cols = runs_both(grad, bwd, block_size)

    def dgrad():
        return mm8(g_rows, b, group_lens, group_offs, not trans_b, a_dtype, bwd, fwd, w2d)

    def wgrad():
        if trans_b:
            return mm8_k(g_cols, a, group_lens, group_offs, b_dtype, bwd, fwd)
        return mm8_k(a, g_cols, group_lens, group_offs, b_dtype, fwd, bwd)

    if need_a and need_b and overlappable(grad):
        # The dgrad goes on the side stream, launched first; the wgrad's programs take SMs as
        # the dgrad's finish (its work items come from a counter), and the other way round.
        grad_b, grad_a = side_by_side(wgrad, dgrad, grad.device)
        return grad_a, grad_b
    return dgrad() if need_a else None, wgrad() if need_b else None
