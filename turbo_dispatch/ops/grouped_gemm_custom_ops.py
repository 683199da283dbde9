"""grouped_gemm and grouped_gemm_fp8 as torch.library custom ops: the path torch.compile traces.

Registers ``turbo_dispatch::grouped_gemm``, ``::grouped_gemm_variable_k`` (the wgrad),
``::grouped_gemm_fp8``, ``::grouped_gemm_fp8_raw`` (one fp8 GEMM of the backward, optionally on
pre-quantised operands), ``::fp8_quantize_both`` and ``::grouped_gemm_fp8_step`` (the blockwise
step that quantises each operand once), with fake implementations and registered autograd. The
names are part of compiled graphs and tuned DBs: they do not change.

The custom ops never read group_lens values themselves (the backend may, see its describe()):
their fake implementations need only shapes, so torch.compile traces them with data-dependent
routing and M_total marked dynamic. ``num_cu`` (optional, last but one or last) caps the
persistent kernels of the GEMMs an op runs (``grouped_gemm_compute_units``); ``main_grad``
(optional, last; never read by the forward) is the buffer the backward adds b's gradient into
(``gemm_grad_accum``).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from ..low_precision import Float8QuantConfig, ScalingGranularity
from ..low_precision.dual_quantize import (quantize_both_tensors, quantize_both_tensors_like, quantize_runs_both,
                                           quantize_tiles_both, runs_from_tensors)
from .gemm_grad_accum import add_to_main_grad_compiled
from .gemm_operands import data_of, rebuild_quantized, scale_of
from .grouped_gemm_compute_units import compute_unit_limit
from .grouped_gemm_routing import offsets_or
from .grouped_gemm_fp8_step import quantize_for_step, repack, step_forward_problem
from .grouped_gemm_grads import grouped_fp8_grads, grouped_grads
from .grouped_gemm_problem import (fixed_shapes, forward_fp8_problem, grouped_gemm_fp8_problem, grouped_gemm_problem,
                                   variable_k_problem, variable_shapes)
from .grouped_gemm_spec import run, run_fp8

_OP_FP8 = "grouped_gemm_fp8"


@torch.library.custom_op("turbo_dispatch::grouped_gemm", mutates_args=())
def _grouped_gemm_op(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor, group_offs: Optional[torch.Tensor],
                     trans_b: bool, num_cu: Optional[int] = None,
                     main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    offs = offsets_or(group_offs, group_lens, a.shape[0])
    with compute_unit_limit(num_cu):
        return run(grouped_gemm_problem(a, b, group_lens, offs, trans_b), a, b, group_lens, offs)


@_grouped_gemm_op.register_fake
def _grouped_gemm_fake(a, b, group_lens, group_offs, trans_b, num_cu=None, main_grad=None):
    _, m, n, _ = fixed_shapes("grouped_gemm", a, b, group_lens, group_offs, trans_b)
    return a.new_empty((m, n))


@torch.library.custom_op("turbo_dispatch::grouped_gemm_variable_k", mutates_args=())
def _grouped_gemm_variable_k_op(x: torch.Tensor, y: torch.Tensor, group_lens: torch.Tensor,
                                group_offs: Optional[torch.Tensor], num_cu: Optional[int] = None) -> torch.Tensor:
    offs = offsets_or(group_offs, group_lens, x.shape[0])
    with compute_unit_limit(num_cu):
        return run(variable_k_problem(x, y, group_lens, offs), x, y, group_lens, offs)


@_grouped_gemm_variable_k_op.register_fake
def _grouped_gemm_variable_k_fake(x, y, group_lens, group_offs, num_cu=None):
    g, m, n, _ = variable_shapes("grouped_gemm", x, y, group_lens, group_offs)
    return x.new_empty((g, m, n))


def _grouped_setup(ctx, inputs, output):
    a, b, group_lens, group_offs, trans_b, num_cu, main_grad = inputs
    ctx.save_for_backward(a, b, group_lens, group_offs, main_grad)
    ctx.trans_b, ctx.num_cu = trans_b, num_cu


def _grouped_backward(ctx, grad):
    a, b, group_lens, group_offs, main_grad = ctx.saved_tensors
    ops = torch.ops.turbo_dispatch
    mm = functools.partial(ops.grouped_gemm, num_cu=ctx.num_cu)
    mm_k = functools.partial(ops.grouped_gemm_variable_k, num_cu=ctx.num_cu)
    grad_a, grad_b = grouped_grads(mm, mm_k, a, b, grad, group_lens, group_offs, ctx.trans_b,
                                   *ctx.needs_input_grad[:2])
    return grad_a, add_to_main_grad_compiled(main_grad, grad_b), None, None, None, None, None


_grouped_gemm_op.register_autograd(_grouped_backward, setup_context=_grouped_setup)


@torch.library.custom_op("turbo_dispatch::grouped_gemm_fp8_raw", mutates_args=())
def _grouped_gemm_fp8_raw_op(x: torch.Tensor, y: torch.Tensor, group_lens: torch.Tensor,
                             group_offs: Optional[torch.Tensor], trans_b: bool, variable_k: bool,
                             out_dtype: torch.dtype, a_fp8: torch.dtype, b_fp8: torch.dtype, granularity: str,
                             block_size: Optional[int], b_2d: bool, a_scale: Optional[torch.Tensor] = None,
                             b_scale: Optional[torch.Tensor] = None, num_cu: Optional[int] = None) -> torch.Tensor:
    """One fp8 GEMM of the backward. With ``a_scale`` (``b_scale``), ``x`` (``y``) is fp8 data
    already quantised for this GEMM (as grouped_gemm_fp8_problem describes), with that scale."""
    offs = offsets_or(group_offs, group_lens, x.shape[0])
    gran = ScalingGranularity(granularity)
    x = rebuild_quantized(x, a_scale, gran, block_size, 0 if variable_k else 1, False)
    y = rebuild_quantized(y, b_scale, gran, block_size, 0 if variable_k else (2 if trans_b else 1),
                          b_2d and not variable_k)
    p = grouped_gemm_fp8_problem(x, y, group_lens, offs, trans_b, variable_k, out_dtype, a_fp8, b_fp8, gran,
                                 block_size, b_2d)
    with compute_unit_limit(num_cu):
        return run_fp8(p, x, y, group_lens, offs)


@_grouped_gemm_fp8_raw_op.register_fake
def _grouped_gemm_fp8_raw_fake(x, y, group_lens, group_offs, trans_b, variable_k, out_dtype, a_fp8, b_fp8,
                               granularity, block_size, b_2d, a_scale=None, b_scale=None, num_cu=None):
    if variable_k:
        g, m, n, _ = variable_shapes(_OP_FP8, x, y, group_lens, group_offs)
        return x.new_empty((g, m, n), dtype=out_dtype)
    _, m, n, _ = fixed_shapes(_OP_FP8, x, y, group_lens, group_offs, trans_b)
    return x.new_empty((m, n), dtype=out_dtype)


def raw_mms(cfg: Float8QuantConfig, num_cu: Optional[int] = None) -> tuple[Callable, Callable]:
    """The ``mm8``/``mm8_k`` of ``grouped_fp8_grads`` through ``turbo_dispatch::grouped_gemm_fp8_raw``,
    unpacking QuantizedTensor operands."""
    raw = torch.ops.turbo_dispatch.grouped_gemm_fp8_raw
    gran, bs = cfg.granularity.value, cfg.block_size

    def mm8(x, y, lens, offs, trans_b, out_dtype, x_fp8, y_fp8, y_2d):
        return raw(data_of(x), data_of(y), lens, offs, trans_b, False, out_dtype, x_fp8, y_fp8, gran, bs, y_2d,
                   scale_of(x), scale_of(y), num_cu)

    def mm8_k(x, y, lens, offs, out_dtype, x_fp8, y_fp8):
        return raw(data_of(x), data_of(y), lens, offs, False, True, out_dtype, x_fp8, y_fp8, gran, bs, False,
                   scale_of(x), scale_of(y), num_cu)

    return mm8, mm8_k


# -- the compiled blockwise training step (grouped_gemm_fp8_step) -------------------------------------
@torch.library.custom_op("turbo_dispatch::fp8_quantize_both", mutates_args=())
def _fp8_quantize_both_op(x: torch.Tensor, dtype: torch.dtype, block_size: int,
                          tile_2d: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_both_tensors`` of ``x`` ([T, C] runs, or [G, R, C] tiles) as (data, scale, data_t,
    scale_t), the fp8 data in storage order (rows padded to 16 bytes)."""
    out = quantize_both_tensors(x if tile_2d else x.unsqueeze(0), dtype, block_size, tile_2d)
    if tile_2d:
        return out[0], out[1], out[2], out[3].clone(memory_format=torch.contiguous_format)  # a view of out[1]
    return tuple(t[0] for t in out)


@_fp8_quantize_both_op.register_fake
def _fp8_quantize_both_fake(x, dtype, block_size, tile_2d):
    return quantize_both_tensors_like(x, dtype, block_size, tile_2d)


def _runs_both_op(x: torch.Tensor, dtype: torch.dtype, block_size: int):
    """``quantize_runs_both`` through ``turbo_dispatch::fp8_quantize_both``: the compiled backward
    quantises its gradient so, as one opaque node."""
    return runs_from_tensors(*torch.ops.turbo_dispatch.fp8_quantize_both(x, dtype, block_size, False), block_size)


def _empty_pairs(a: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Placeholders for the (data, scale) pairs of an operand no backward GEMM reads."""
    return tuple((a.new_empty(0, dtype=torch.float32), a.new_empty(0, dtype=torch.float32)) for _ in range(2))


@torch.library.custom_op("turbo_dispatch::grouped_gemm_fp8_step", mutates_args=())
def _grouped_gemm_fp8_step_op(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor, group_offs: torch.Tensor,
                              trans_b: bool, out_dtype: Optional[torch.dtype], format: str, block_size: int,
                              scale_dtype: str, need_a: bool, need_b: bool, num_cu: Optional[int] = None,
                              main_grad: Optional[torch.Tensor] = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The BLOCKWISE forward of a training step: (out, a's token-run data stored [K, T] and
    scale [nT, K], b's tiles stored for the dgrad and scale [G, nR, nC]); an unneeded pair is
    empty. As the eager GroupedFp8Function.forward."""
    cfg = Float8QuantConfig(format, ScalingGranularity.BLOCKWISE, scale_dtype, block_size)
    qa, qb, a_saved, b_saved = quantize_for_step(a, b, cfg, need_a, need_b, quantize_runs_both, quantize_tiles_both)
    problem = forward_fp8_problem(a, b, group_lens, group_offs, trans_b, out_dtype, cfg)
    with compute_unit_limit(num_cu):
        out = run_fp8(step_forward_problem(problem, qa, qb), qa, qb, group_lens, group_offs)
    a_pair, b_pair = _empty_pairs(a)
    if a_saved is not None:
        a_pair = (a_saved.data.t(), a_saved.scale)
    if b_saved is not None:
        b_pair = (b_saved.data.transpose(1, 2), b_saved.scale)
    return out, *a_pair, *b_pair


@_grouped_gemm_fp8_step_op.register_fake
def _grouped_gemm_fp8_step_fake(a, b, group_lens, group_offs, trans_b, out_dtype, format, block_size, scale_dtype,
                                need_a, need_b, num_cu=None, main_grad=None):
    _, m, n, _ = fixed_shapes(_OP_FP8, a, b, group_lens, group_offs, trans_b)
    fwd = Float8QuantConfig(format, ScalingGranularity.BLOCKWISE, scale_dtype, block_size).format.fwd_dtype()
    out = a.new_empty((m, n), dtype=a.dtype if out_dtype is None else out_dtype)
    a_pair, b_pair = _empty_pairs(a)
    # What the real op returns of fp8_quantize_both's outputs: a's (data_t, scale_t), b's (data_t, scale).
    if need_b:
        a_pair = quantize_both_tensors_like(a, fwd, block_size, False)[2:]
    if need_a:
        _, scale, data_t, _ = quantize_both_tensors_like(b, fwd, block_size, True)
        b_pair = (data_t, scale)
    return out, *a_pair, *b_pair


def _grouped_fp8_step_setup(ctx, inputs, output):
    a, b, group_lens, group_offs, trans_b, _, fmt, block_size, scale_dtype, need_a, need_b, num_cu, main_grad = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*output[1:], group_lens, group_offs, main_grad)
    ctx.trans_b, ctx.needs, ctx.num_cu = trans_b, (need_a, need_b), num_cu
    ctx.dtypes = (a.dtype, b.dtype)
    ctx.config = Float8QuantConfig(fmt, ScalingGranularity.BLOCKWISE, scale_dtype, block_size)


def _grouped_fp8_step_backward(ctx, grad, *_unused):
    a_data_t, a_scale, b_data_t, b_scale, group_lens, group_offs, main_grad = ctx.saved_tensors
    cfg = ctx.config
    need_a, need_b = ctx.needs
    a_saved = repack((cfg.granularity, 0, cfg.block_size, False), a_data_t.t(), a_scale) if need_b else None
    b_saved = repack((cfg.granularity, 2, cfg.block_size, True), b_data_t.transpose(1, 2), b_scale) if need_a else None
    grad_a, grad_b = grouped_fp8_grads(*raw_mms(cfg, ctx.num_cu), a_saved, b_saved, grad, group_lens, group_offs,
                                       ctx.trans_b, cfg.format.fwd_dtype(), cfg.format.bwd_dtype(), cfg.granularity,
                                       need_a and ctx.needs_input_grad[0], need_b and ctx.needs_input_grad[1],
                                       a_dtype=ctx.dtypes[0], b_dtype=ctx.dtypes[1], runs_both=_runs_both_op,
                                       block_size=cfg.block_size)
    return (grad_a, add_to_main_grad_compiled(main_grad, grad_b), None, None, None, None, None, None, None, None, None,
            None, None)


_grouped_gemm_fp8_step_op.register_autograd(_grouped_fp8_step_backward, setup_context=_grouped_fp8_step_setup)


@torch.library.custom_op("turbo_dispatch::grouped_gemm_fp8", mutates_args=())
def _grouped_gemm_fp8_op(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor,
                         group_offs: Optional[torch.Tensor], trans_b: bool, out_dtype: Optional[torch.dtype],
                         format: str, granularity: str, block_size: Optional[int], scale_dtype: str,
                         num_cu: Optional[int] = None, main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    cfg = Float8QuantConfig(format, granularity, scale_dtype, block_size)
    offs = offsets_or(group_offs, group_lens, a.shape[0])
    p = forward_fp8_problem(a, b, group_lens, offs, trans_b, out_dtype, cfg)
    with compute_unit_limit(num_cu):
        return run_fp8(p, a, b, group_lens, offs)


@_grouped_gemm_fp8_op.register_fake
def _grouped_gemm_fp8_fake(a, b, group_lens, group_offs, trans_b, out_dtype, format, granularity, block_size,
                           scale_dtype, num_cu=None, main_grad=None):
    _, m, n, _ = fixed_shapes(_OP_FP8, a, b, group_lens, group_offs, trans_b)
    return a.new_empty((m, n), dtype=a.dtype if out_dtype is None else out_dtype)


def _grouped_fp8_setup(ctx, inputs, output):
    a, b, group_lens, group_offs, trans_b, _, fmt, gran, block_size, scale_dtype, num_cu, main_grad = inputs
    ctx.save_for_backward(a, b, group_lens, group_offs, main_grad)
    ctx.trans_b, ctx.num_cu = trans_b, num_cu
    ctx.config = Float8QuantConfig(fmt, gran, scale_dtype, block_size)


def _grouped_fp8_backward(ctx, grad):
    a, b, group_lens, group_offs, main_grad = ctx.saved_tensors
    cfg = ctx.config
    grad_a, grad_b = grouped_fp8_grads(*raw_mms(cfg, ctx.num_cu), a, b, grad, group_lens, group_offs, ctx.trans_b,
                                       cfg.format.fwd_dtype(), cfg.format.bwd_dtype(), cfg.granularity,
                                       *ctx.needs_input_grad[:2])
    return (grad_a, add_to_main_grad_compiled(main_grad, grad_b), None, None, None, None, None, None, None, None, None,
            None)


_grouped_gemm_fp8_op.register_autograd(_grouped_fp8_backward, setup_context=_grouped_fp8_setup)
