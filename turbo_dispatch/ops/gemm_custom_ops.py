"""gemm and gemm_fp8 as torch.library custom ops: the path torch.compile traces.

Registers ``turbo_dispatch::gemm``, ``::gemm_fp8``, ``::gemm_fp8_raw`` (one fp8 GEMM of the
backward, optionally on a pre-quantised operand) and ``::fp8_quantize_rows`` (how the compiled
forward saves its activation), each with a fake implementation and, for the two public ops,
registered autograd. The names are part of compiled graphs and tuned DBs: they do not change.
Eager calls do not come here, since a custom op costs host time on every call.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..low_precision import Float8QuantConfig, ScalingGranularity
from ..low_precision.fast_quantize import quantize_rows
from .gemm_fp8_step import quantize_rows_like, saved_as_quantized
from .gemm_grad_accum import add_to_main_grad_compiled
from .gemm_grads import fp8_grads, gemm_grads
from .gemm_operands import data_of, rebuild_quantized, scale_of
from .gemm_problem import forward_fp8_problem, gemm_fp8_problem, gemm_problem, mnk
from .gemm_spec import run_gemm, run_gemm_fp8


@torch.library.custom_op("turbo_dispatch::gemm", mutates_args=())
def _gemm_op(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool,
             out_dtype: Optional[torch.dtype], main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``main_grad`` (never read here): the buffer the backward adds b's gradient into."""
    return run_gemm(gemm_problem(a, b, trans_a, trans_b, out_dtype), a, b)


@_gemm_op.register_fake
def _gemm_fake(a, b, trans_a, trans_b, out_dtype, main_grad=None):
    p = gemm_problem(a, b, trans_a, trans_b, out_dtype)
    return a.new_empty((p.m, p.n), dtype=p.out_dtype)


def _gemm_setup(ctx, inputs, output):
    a, b, trans_a, trans_b, _, main_grad = inputs
    ctx.save_for_backward(a, b, main_grad)
    ctx.flags = (trans_a, trans_b)


def _gemm_backward(ctx, grad):
    a, b, main_grad = ctx.saved_tensors
    grad_a, grad_b = gemm_grads(torch.ops.turbo_dispatch.gemm, a, b, grad, *ctx.flags, *ctx.needs_input_grad[:2])
    return grad_a, add_to_main_grad_compiled(main_grad, grad_b), None, None, None, None


_gemm_op.register_autograd(_gemm_backward, setup_context=_gemm_setup)


@torch.library.custom_op("turbo_dispatch::gemm_fp8_raw", mutates_args=())
def _gemm_fp8_raw_op(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool, out_dtype: torch.dtype,
                     a_fp8: torch.dtype, b_fp8: torch.dtype, granularity: str, block_size: Optional[int],
                     a_2d: bool, b_2d: bool, a_scale: Optional[torch.Tensor] = None,
                     b_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One fp8 GEMM of the backward. With ``a_scale`` (``b_scale``), ``a`` (``b``) is fp8 data
    already quantised along this GEMM's K, with that scale."""
    g = ScalingGranularity(granularity)
    a = rebuild_quantized(a, a_scale, g, block_size, 0 if trans_a else 1, a_2d)
    b = rebuild_quantized(b, b_scale, g, block_size, 1 if trans_b else 0, b_2d)
    p = gemm_fp8_problem(a, b, trans_a, trans_b, out_dtype, a_fp8, b_fp8, g, block_size, a_2d, b_2d)
    return run_gemm_fp8(p, a, b)


@_gemm_fp8_raw_op.register_fake
def _gemm_fp8_raw_fake(a, b, trans_a, trans_b, out_dtype, a_fp8, b_fp8, granularity, block_size, a_2d, b_2d,
                       a_scale=None, b_scale=None):
    m, n, _ = mnk("gemm_fp8", a, b, trans_a, trans_b)
    return a.new_empty((m, n), dtype=out_dtype)


def raw_mm8(cfg: Float8QuantConfig) -> Callable:
    """One fp8 GEMM through ``turbo_dispatch::gemm_fp8_raw``, unpacking a QuantizedTensor operand:
    the ``mm8`` of ``gemm_grads.fp8_grads``."""
    def mm8(x, y, ta, tb, od, xf, yf, x2d, y2d):
        return torch.ops.turbo_dispatch.gemm_fp8_raw(data_of(x), data_of(y), ta, tb, od, xf, yf,
                                                     cfg.granularity.value, cfg.block_size, x2d, y2d, scale_of(x),
                                                     scale_of(y))
    return mm8


@torch.library.custom_op("turbo_dispatch::fp8_quantize_rows", mutates_args=())
def _fp8_quantize_rows_op(x: torch.Tensor, dtype: torch.dtype, granularity: str,
                          block_size: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(x, axis=1)`` as (data, scale): how the compiled forward saves its activation."""
    q = quantize_rows(x, dtype, ScalingGranularity(granularity), block_size)
    return q.data, q.scale


@_fp8_quantize_rows_op.register_fake
def _fp8_quantize_rows_fake(x, dtype, granularity, block_size):
    return quantize_rows_like(x, dtype, ScalingGranularity(granularity), block_size)


@torch.library.custom_op("turbo_dispatch::gemm_fp8", mutates_args=())
def _gemm_fp8_op(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool, out_dtype: Optional[torch.dtype],
                 format: str, granularity: str, block_size: Optional[int], scale_dtype: str,
                 main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    cfg = Float8QuantConfig(format, granularity, scale_dtype, block_size)
    return run_gemm_fp8(forward_fp8_problem(a, b, trans_a, trans_b, out_dtype, cfg), a, b)


@_gemm_fp8_op.register_fake
def _gemm_fp8_fake(a, b, trans_a, trans_b, out_dtype, format, granularity, block_size, scale_dtype, main_grad=None):
    m, n, _ = mnk("gemm_fp8", a, b, trans_a, trans_b)
    return a.new_empty((m, n), dtype=a.dtype if out_dtype is None else out_dtype)


def _gemm_fp8_setup(ctx, inputs, output):
    a, b, trans_a, trans_b, _, fmt, gran, block_size, scale_dtype, main_grad = inputs
    cfg = Float8QuantConfig(fmt, gran, scale_dtype, block_size)
    need_a, need_b = ctx.needs_input_grad[:2]
    # As the eager path: a only in the quantised form the wgrad reads (gemm_fp8_step), b only for
    # dgrad. A custom op so that torch.compile traces it as one opaque node.
    a_data = a_scale = None
    if need_b:
        a_data, a_scale = torch.ops.turbo_dispatch.fp8_quantize_rows(
            a if trans_a else a.t(), cfg.format.fwd_dtype(), cfg.granularity.value, cfg.block_size)
    ctx.save_for_backward(a_data, a_scale, b if need_a else None, main_grad)
    ctx.flags = (trans_a, trans_b)
    ctx.dtypes = (a.dtype, b.dtype)
    ctx.config = cfg


def _gemm_fp8_backward(ctx, grad):
    a_data, a_scale, b, main_grad = ctx.saved_tensors
    cfg = ctx.config
    qa = None if a_data is None else saved_as_quantized(a_data, a_scale, cfg)
    grad_a, grad_b = fp8_grads(raw_mm8(cfg), qa, b, grad, *ctx.flags, cfg.format.fwd_dtype(),
                               cfg.format.bwd_dtype(), cfg.granularity, *ctx.needs_input_grad[:2],
                               a_dtype=ctx.dtypes[0], b_dtype=ctx.dtypes[1])
    return grad_a, add_to_main_grad_compiled(main_grad, grad_b), None, None, None, None, None, None, None, None


_gemm_fp8_op.register_autograd(_gemm_fp8_backward, setup_context=_gemm_fp8_setup)
