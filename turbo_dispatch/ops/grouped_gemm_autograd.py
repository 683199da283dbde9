"""The eager path's autograd for grouped_gemm and grouped_gemm_fp8: torch.autograd.Functions whose
forward runs the resolved backend and whose backward resolves each gradient GEMM on its own."""
from __future__ import annotations

from typing import Callable

import torch

from ..low_precision import Float8QuantConfig
from ..low_precision.dual_quantize import quantize_runs_both, quantize_tiles_both
from .gemm_grad_accum import add_to_main_grad
from .grouped_gemm_compute_units import compute_unit_limit
from .grouped_gemm_fp8_step import (layout, quantize_for_step, repack, step_forward_problem,
                                    step_reuses_quantization, unpack)
from .grouped_gemm_grads import grouped_fp8_grads, grouped_grads
from .grouped_gemm_problem import grouped_gemm_fp8_problem, grouped_gemm_problem, variable_k_problem
from .grouped_gemm_spec import run, run_fp8


def _eager_mm(x, y, group_lens, group_offs, trans_b):
    return run(grouped_gemm_problem(x, y, group_lens, group_offs, trans_b), x, y, group_lens, group_offs)


def _eager_mm_k(x, y, group_lens, group_offs):
    return run(variable_k_problem(x, y, group_lens, group_offs), x, y, group_lens, group_offs)


class GroupedGemmFunction(torch.autograd.Function):
    """``apply(a, b, group_lens, group_offs, problem, num_cu=None, main_grad=None)``: grouped_gemm
    with its backward's dgrad and wgrad resolved per problem, every GEMM under the ``num_cu`` cap;
    with ``main_grad`` the wgrad is added into it (``gemm_grad_accum``)."""

    @staticmethod
    def forward(ctx, a, b, group_lens, group_offs, problem, num_cu=None, main_grad=None):
        ctx.save_for_backward(a, b, group_lens, group_offs)
        ctx.problem, ctx.num_cu, ctx.main_grad = problem, num_cu, main_grad
        with compute_unit_limit(num_cu):
            return run(problem, a, b, group_lens, group_offs)

    @staticmethod
    def backward(ctx, grad):
        a, b, group_lens, group_offs = ctx.saved_tensors
        with compute_unit_limit(ctx.num_cu):
            grad_a, grad_b = grouped_grads(_eager_mm, _eager_mm_k, a, b, grad, group_lens, group_offs,
                                           ctx.problem.trans_b, *ctx.needs_input_grad[:2])
        return grad_a, add_to_main_grad(ctx.main_grad, grad_b), None, None, None, None, None


def eager_fp8_mms(cfg: Float8QuantConfig) -> tuple[Callable, Callable]:
    """The ``mm8``/``mm8_k`` of ``grouped_fp8_grads`` that resolve and run each GEMM."""
    def mm8(x, y, lens, offs, trans_b, out_dtype, x_fp8, y_fp8, y_2d):
        q = grouped_gemm_fp8_problem(x, y, lens, offs, trans_b, False, out_dtype, x_fp8, y_fp8, cfg.granularity,
                                     cfg.block_size, y_2d)
        return run_fp8(q, x, y, lens, offs)

    def mm8_k(x, y, lens, offs, out_dtype, x_fp8, y_fp8):
        q = grouped_gemm_fp8_problem(x, y, lens, offs, False, True, out_dtype, x_fp8, y_fp8, cfg.granularity,
                                     cfg.block_size, False)
        return run_fp8(q, x, y, lens, offs)

    return mm8, mm8_k


class GroupedFp8Function(torch.autograd.Function):
    """``apply(a, b, group_lens, group_offs, problem, config, num_cu=None, main_grad=None,
    plan=None)``: grouped_gemm_fp8; a blockwise step quantises each operand once and saves them
    fp8 (``grouped_gemm_fp8_step``), any other saves the inputs. ``num_cu`` and ``main_grad`` as
    in GroupedGemmFunction. A blockwise step with a ``plan`` (``grouped_gemm_plan.StepPlan`` of the
    call's key) runs its prepared quantisers and GEMMs, forward and backward; same results."""

    @staticmethod
    def forward(ctx, a, b, group_lens, group_offs, problem, config, num_cu=None, main_grad=None, plan=None):
        with compute_unit_limit(num_cu):
            return GroupedFp8Function._forward_body(ctx, a, b, group_lens, group_offs, problem, config, num_cu,
                                                    main_grad, plan)

    @staticmethod
    def _forward_body(ctx, a, b, group_lens, group_offs, problem, config, num_cu, main_grad, plan):
        ctx.problem, ctx.config, ctx.num_cu, ctx.main_grad = problem, config, num_cu, main_grad
        ctx.dtypes = (a.dtype, b.dtype)
        ctx.reuse = step_reuses_quantization(config)
        if not ctx.reuse:
            ctx.save_for_backward(a, b, group_lens, group_offs)
            return run_fp8(problem, a, b, group_lens, group_offs)
        ctx.plan = plan
        need_a, need_b = ctx.needs_input_grad[:2]
        runs, tiles = (quantize_runs_both, quantize_tiles_both) if plan is None else (plan.runs_both, plan.tiles_both)
        qa, qb, a_saved, b_saved = quantize_for_step(a, b, config, need_a, need_b, runs, tiles, reuse=True)
        ctx.quantized = (layout(a_saved), layout(b_saved))  # their tensors go through save_for_backward
        ctx.save_for_backward(*unpack(a_saved), *unpack(b_saved), group_lens, group_offs)
        if plan is not None:
            return plan.forward(qa, qb, group_lens, group_offs)
        return run_fp8(step_forward_problem(problem, qa, qb), qa, qb, group_lens, group_offs)

    @staticmethod
    def backward(ctx, grad):
        with compute_unit_limit(ctx.num_cu):
            grad_a, grad_b = GroupedFp8Function._gradients(ctx, grad)
        return grad_a, add_to_main_grad(ctx.main_grad, grad_b), None, None, None, None, None, None, None

    @staticmethod
    def _gradients(ctx, grad):
        cfg = ctx.config
        flags = (ctx.problem.trans_b, cfg.format.fwd_dtype(), cfg.format.bwd_dtype(), cfg.granularity,
                 *ctx.needs_input_grad[:2])
        if not ctx.reuse:
            a, b, group_lens, group_offs = ctx.saved_tensors
            return grouped_fp8_grads(*eager_fp8_mms(cfg), a, b, grad, group_lens, group_offs, *flags)
        a_data, a_scale, b_data, b_scale, group_lens, group_offs = ctx.saved_tensors
        a_saved, b_saved = (repack(q, d, s) for q, d, s in zip(ctx.quantized, (a_data, b_data), (a_scale, b_scale)))
        planned = None if ctx.plan is None else ctx.plan.backward_plan(grad)
        if planned is None:
            mm8, mm8_k, runs = *eager_fp8_mms(cfg), quantize_runs_both
        else:
            mm8, mm8_k, runs = planned.mm8, planned.mm8_k, planned.runs_both
        return grouped_fp8_grads(mm8, mm8_k, a_saved, b_saved, grad, group_lens, group_offs,
                                 *flags, a_dtype=ctx.dtypes[0], b_dtype=ctx.dtypes[1],
                                 runs_both=runs, block_size=cfg.block_size)
