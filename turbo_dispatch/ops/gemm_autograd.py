"""The eager path's autograd for gemm and gemm_fp8: torch.autograd.Functions whose forward runs
the resolved backend and whose backward resolves each gradient GEMM on its own."""
from __future__ import annotations

import functools

import torch

from ..low_precision.fast_quantize import SHARED_AMAX_GRANULARITIES, quantize_both_axes, quantize_both_axes_in_turn
from .gemm_fp8_step import saved_as_quantized, wgrad_operand, with_prequantized_a
from .gemm_grad_accum import add_to_main_grad
from .gemm_grads import fp8_grads, gemm_grads
from .gemm_problem import gemm_fp8_problem, gemm_problem
from .gemm_spec import run_gemm, run_gemm_fp8


def _eager_mm(x, y, trans_a, trans_b, out_dtype):
    return run_gemm(gemm_problem(x, y, trans_a, trans_b, out_dtype), x, y)


class GemmFunction(torch.autograd.Function):
    """``apply(a, b, problem, main_grad=None)``: gemm with its backward's dgrad and wgrad resolved
    per problem; with ``main_grad`` the wgrad is added into it (``gemm_grad_accum``)."""

    @staticmethod
    def forward(ctx, a, b, problem, main_grad=None):
        ctx.save_for_backward(a, b)
        ctx.problem, ctx.main_grad = problem, main_grad
        return run_gemm(problem, a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        p = ctx.problem
        grad_a, grad_b = gemm_grads(_eager_mm, a, b, grad, p.trans_a, p.trans_b, *ctx.needs_input_grad[:2])
        return grad_a, add_to_main_grad(ctx.main_grad, grad_b), None, None


class Fp8GemmFunction(torch.autograd.Function):
    """``apply(a, b, problem, config, main_grad=None)``: gemm_fp8 that saves ``a`` only quantised,
    for the wgrad (``gemm_fp8_step``), and ``b`` only for the dgrad; with ``main_grad`` the wgrad
    is added into it."""

    @staticmethod
    def forward(ctx, a, b, problem, config, main_grad=None):
        need_a, need_b = ctx.needs_input_grad[:2]
        # dgrad reads b and the gradient; only wgrad reads a, and only in quantised form: op(a)
        # along M, which the same quantiser makes with the forward's op(a) along K where the
        # recipe's groups need an amax pass (one shared pass saves a read). 1-D BLOCKWISE runs take
        # one read each anyway, so that forward keeps the backend's own quantisation (and its key).
        if need_b and isinstance(a, torch.Tensor) and config.granularity in SHARED_AMAX_GRANULARITIES:
            qa_k, qa_m = quantize_both_axes(a.t() if problem.trans_a else a, problem.a_fp8, config.granularity,
                                            config.block_size)
            out = run_gemm_fp8(with_prequantized_a(problem), qa_k, b)
            qa = qa_m.t()
        else:
            out = run_gemm_fp8(problem, a, b)
            qa = wgrad_operand(a, problem.trans_a, config) if need_b else None
        ctx.save_for_backward(None if qa is None else qa.data, None if qa is None else qa.scale,
                              b if need_a else None)
        ctx.problem, ctx.config, ctx.main_grad = problem, config, main_grad
        return out

    @staticmethod
    def backward(ctx, grad):
        a_data, a_scale, b = ctx.saved_tensors
        cfg = ctx.config
        qa = None if a_data is None else saved_as_quantized(a_data, a_scale, cfg)
        grad_a, grad_b = fp8_gemm_backward(ctx.problem, cfg, qa, b, grad, *ctx.needs_input_grad[:2])
        return grad_a, add_to_main_grad(ctx.main_grad, grad_b), None, None, None


def fp8_gemm_backward(p, cfg, qa, b, grad: torch.Tensor, need_a: bool, need_b: bool):
    """(grad_a, grad_b) of the fp8 GEMM ``p`` run with recipe ``cfg``, from what its forward kept:
    ``qa`` (``a`` quantised along M, for the wgrad) and ``b`` (for the dgrad). Shared by
    ``Fp8GemmFunction`` and the fused producers of ``modules.fused``, whose forward feeds the GEMM
    a pre-quantised activation but whose backward is this GEMM's."""

    def mm8(x, y, ta, tb, od, xf, yf, x2d, y2d):
        q = gemm_fp8_problem(x, y, ta, tb, od, xf, yf, cfg.granularity, cfg.block_size, x2d, y2d)
        return run_gemm_fp8(q, x, y)

    grads = functools.partial(fp8_grads, mm8, qa, b, trans_a=p.trans_a, trans_b=p.trans_b,
                              fwd=cfg.format.fwd_dtype(), bwd=cfg.format.bwd_dtype(), granularity=cfg.granularity,
                              a_dtype=p.a_dtype, b_dtype=p.b_dtype)
    if not (need_a and need_b):
        return grads(grad, need_a=need_a, need_b=need_b)
    # dgrad reads the gradient along N, wgrad along M: both amaxes come from one read, and
    # each copy is made just before its GEMM and dropped after it, so that no more than one
    # fp8 copy of the gradient is alive (both at once would lift the Linear's peak above bf16's).
    for_dgrad, for_wgrad = quantize_both_axes_in_turn(grad, cfg.format.bwd_dtype(), cfg.granularity)
    grad_a, _ = grads(for_dgrad(), need_a=True, need_b=False)
    _, grad_b = grads(for_wgrad(), need_a=False, need_b=True)
    return grad_a, grad_b
