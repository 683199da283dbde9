"""grouped_gemm and grouped_gemm_fp8: the public calls.

A grouped GEMM multiplies G row blocks of ``a`` (the tokens routed to each expert, laid out one
group after another) by G weight matrices: ``out[s_i:e_i] = a[s_i:e_i] @ op(b[i])``, with
``e_i - s_i = group_lens[i]``. Its backward (``grouped_gemm_grads``) is a grouped GEMM for dgrad and
a variable-K grouped GEMM for wgrad, both problems of the ``grouped_gemm`` op, so the resolver
picks a backend for each GEMM of the step separately.

Like gemm: eager calls take a fast path (resolve + run, or a torch.autograd.Function from
``grouped_gemm_autograd`` when gradients are needed); under torch.compile the work goes through the
custom ops of ``grouped_gemm_custom_ops``. Both paths share the problem builders
(``grouped_gemm_problem``) and the gradient formulas. The problem types, problem builders and
OpSpecs are re-exported here, where callers look for them.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..low_precision import Float8QuantConfig, ScalingGranularity
from . import grouped_gemm_custom_ops  # noqa: F401  (registers torch.ops.turbo_dispatch.grouped_gemm*)
from .gemm_operands import needs_grad
from .grouped_gemm_routing import VALIDATE_ENV, check_group_lens_values, offsets_or
from .grouped_gemm_autograd import GroupedFp8Function, GroupedGemmFunction
from .grouped_gemm_fp8_step import step_reuses_quantization
from .grouped_gemm_problem import (MX_REFUSED, GroupedGemmFp8Problem, GroupedGemmProblem, forward_fp8_problem,
                                   grouped_gemm_fp8_problem, grouped_gemm_problem, variable_k_problem)
from .grouped_gemm_spec import GROUPED_GEMM, GROUPED_GEMM_FP8, run, run_fp8

__all__ = ["GROUPED_GEMM", "GROUPED_GEMM_FP8", "GroupedGemmFp8Problem", "GroupedGemmProblem", "VALIDATE_ENV",
           "check_group_lens_values", "grouped_gemm", "grouped_gemm_fp8", "grouped_gemm_fp8_problem",
           "grouped_gemm_problem", "variable_k_problem"]

_DEFAULT_FP8 = Float8QuantConfig()


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor,
                 group_offs: Optional[torch.Tensor] = None, trans_b: bool = False) -> torch.Tensor:
    """Grouped GEMM: ``out[s_i:e_i] = a[s_i:e_i] @ op(b[i])`` for each group i; forward and backward.

    ``a`` is [M_total, K]; ``b`` is [G, K, N] ([G, N, K] with ``trans_b=True``), same dtype as ``a``
    (bf16/fp16/fp32); ``group_lens`` is int64 [G] on a's device, the tokens of each group in
    order (zeros allowed), summing to M_total; ``group_offs`` (optional) is its exclusive prefix
    sum [G + 1] (int32 or int64; int32 saves the TORCH backend a conversion per GEMM), computed on
    the device when None: pass it when several GEMMs share one routing. Returns [M_total, N] in
    a's dtype. The backward gives ``a`` a grouped GEMM with b transposed and ``b`` a variable-K
    grouped GEMM (zero for empty groups), each resolved to a backend of its own.

    Checks and host syncs: everything about shapes, dtypes and devices is checked from host-side
    facts. That group_lens is non-negative and sums to M_total (and that a given group_offs
    matches it) needs a device read: eager CPU calls do it for free; on a GPU it would cost a
    device->host sync, so it runs only with PRIMUS_TURBO_VALIDATE_GROUP_LENS=1. It is skipped
    while torch.compile traces and while a CUDA graph is captured; without the check, wrong
    lengths are the caller's responsibility. The problem key never reads group_lens values,
    so routings with the same G and M_total share one decision. Whether the chosen backend
    itself reads group_lens on the host is shown by ``turbo_dispatch.explain`` (TORCH: no with
    torch._grouped_mm on sm_90/sm_100 bf16, yes with its per-group loop).

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> a, b = torch.randn(7, 8), torch.randn(3, 8, 5)
        >>> turbo.ops.grouped_gemm(a, b, torch.tensor([2, 0, 5])).shape
        torch.Size([7, 5])
    """
    if torch.compiler.is_compiling():
        offs = offsets_or(group_offs, group_lens, a.shape[0])
        return torch.ops.turbo_dispatch.grouped_gemm(a, b, group_lens, offs, trans_b)
    problem = grouped_gemm_problem(a, b, group_lens, group_offs, trans_b)
    check_group_lens_values("grouped_gemm", group_lens, group_offs, problem.m)
    offs = offsets_or(group_offs, group_lens, a.shape[0])
    if needs_grad(a, b):
        return GroupedGemmFunction.apply(a, b, group_lens, offs, problem)
    return run(problem, a, b, group_lens, offs)


def grouped_gemm_fp8(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor,
                     group_offs: Optional[torch.Tensor] = None, trans_b: bool = True,
                     out_dtype: Optional[torch.dtype] = None,
                     config: Optional[Float8QuantConfig] = None) -> torch.Tensor:
    """FP8 grouped GEMM from high-precision inputs: quantise per ``config`` (default E4M3
    TENSORWISE), multiply per group, return ``out_dtype`` (default: a's dtype).

    Shapes and group arguments as in ``grouped_gemm`` (note ``trans_b`` defaults to True here: b is
    [G, N, K]). Recipe roles: TENSORWISE has one scale per tensor (for b: one for all groups);
    ROWWISE one per row of ``a`` and per (group, output column) of ``b``; BLOCKWISE 1 x block_size
    runs of ``a`` along K and block_size x block_size tiles per group of ``b``. The backward
    quantises the gradient too (as E5M2 under Format.HYBRID); the weight keeps its tiles in dgrad,
    and wgrad quantises both operands in runs along the tokens (a run may straddle two groups;
    its one scale serves both). MX_BLOCKWISE is not supported for grouped GEMMs (ValueError).
    With gradients, a BLOCKWISE step (block 32, 64 or 128) quantises each operand once for both
    GEMMs that read it and saves fp8 ``a`` and ``b`` for the backward instead of the inputs; the
    results are bit-identical to quantising per GEMM (``grouped_gemm_fp8_step``).
    The group_lens value check and its host sync behave as in ``grouped_gemm``.

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> from turbo_dispatch.low_precision import Float8QuantConfig
        >>> a, w = torch.randn(12, 32), torch.randn(2, 16, 32)
        >>> cfg = Float8QuantConfig(granularity="rowwise")
        >>> turbo.ops.grouped_gemm_fp8(a, w, torch.tensor([5, 7]), config=cfg).shape
        torch.Size([12, 16])
    """
    cfg = _DEFAULT_FP8 if config is None else config
    if not isinstance(cfg, Float8QuantConfig):
        raise TypeError(f"grouped_gemm_fp8: config must be a Float8QuantConfig or None; got {type(config).__name__}")
    if cfg.granularity is ScalingGranularity.MX_BLOCKWISE:
        raise ValueError(MX_REFUSED)
    if torch.compiler.is_compiling():
        offs = offsets_or(group_offs, group_lens, a.shape[0])
        if needs_grad(a, b) and step_reuses_quantization(cfg):
            return torch.ops.turbo_dispatch.grouped_gemm_fp8_step(
                a, b, group_lens, offs, trans_b, out_dtype, cfg.format.value, cfg.block_size, cfg.scale_dtype.value,
                a.requires_grad, b.requires_grad)[0]
        return torch.ops.turbo_dispatch.grouped_gemm_fp8(a, b, group_lens, offs, trans_b, out_dtype, cfg.format.value,
                                                         cfg.granularity.value, cfg.block_size, cfg.scale_dtype.value)
    problem = forward_fp8_problem(a, b, group_lens, group_offs, trans_b, out_dtype, cfg)
    check_group_lens_values("grouped_gemm_fp8", group_lens, group_offs, problem.m)
    if 0 in (problem.m, problem.n, problem.k):
        # A rank that received no tokens (or an empty weight): nothing to quantise, and the
        # high-precision op gives the defined empty/zero result and gradients.
        return grouped_gemm(a, b, group_lens, group_offs, trans_b).to(problem.out_dtype)
    offs = offsets_or(group_offs, group_lens, a.shape[0])
    if needs_grad(a, b):
        return GroupedFp8Function.apply(a, b, group_lens, offs, problem, cfg)
    return run_fp8(problem, a, b, group_lens, offs)
