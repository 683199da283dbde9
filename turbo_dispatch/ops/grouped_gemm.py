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

from ..low_precision import Float8QuantConfig, QuantizedTensor, ScalingGranularity
from . import grouped_gemm_custom_ops  # noqa: F401  (registers torch.ops.turbo_dispatch.grouped_gemm*)
from . import grouped_gemm_plan
from .gemm_grad_accum import main_grad_for
from .gemm_operands import data_of, needs_grad, scale_of
from .grouped_gemm_routing import VALIDATE_ENV, check_group_lens_values, offsets_or
from .grouped_gemm_autograd import GroupedFp8Function, GroupedGemmFunction
from .grouped_gemm_compute_units import check_num_cu, compute_unit_limit
from .grouped_gemm_fp8_step import step_reuses_quantization
from .grouped_gemm_problem import (MX_REFUSED, GroupedGemmFp8Problem, GroupedGemmProblem, forward_fp8_problem,
                                   grouped_gemm_fp8_problem, grouped_gemm_problem, variable_k_problem)
from .grouped_gemm_spec import GROUPED_GEMM, GROUPED_GEMM_FP8, run, run_fp8

__all__ = ["GROUPED_GEMM", "GROUPED_GEMM_FP8", "GroupedGemmFp8Problem", "GroupedGemmProblem", "VALIDATE_ENV",
           "check_group_lens_values", "grouped_gemm", "grouped_gemm_fp8", "grouped_gemm_fp8_problem",
           "grouped_gemm_problem", "variable_k_problem"]

_DEFAULT_FP8 = Float8QuantConfig()
#: The persistent-loop schedules ``grouped_gemm(schedule=...)`` accepts: the kernels here walk their
#: tiles in a static stride (a work-stealing loop is not implemented).
SCHEDULES = ("static",)


def _run_capped(num_cu: Optional[int], fn, *args):
    """``fn(*args)`` with the persistent kernels capped at ``num_cu`` programs (None: no cap)."""
    if num_cu is None:
        return fn(*args)
    with compute_unit_limit(num_cu):
        return fn(*args)


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor,
                 group_offs: Optional[torch.Tensor] = None, trans_b: bool = False, num_cu: Optional[int] = None,
                 schedule: str = "static", fuse_bgrad_accum_pattern: Optional[str] = None) -> torch.Tensor:
    """Grouped GEMM: ``out[s_i:e_i] = a[s_i:e_i] @ op(b[i])`` for each group i; forward and backward.

    ``a`` is [M_total, K]; ``b`` is [G, K, N] ([G, N, K] with ``trans_b=True``), same dtype as ``a``
    (bf16/fp16/fp32); ``group_lens`` is int64 [G] on a's device, the tokens of each group in
    order (zeros allowed), summing to at most M_total: rows past the last group are padding (a
    padded receive buffer), which get zeros in the output and zero gradients, and take no part in
    the weight gradient. ``group_offs`` (optional) is its exclusive prefix
    sum [G + 1] (int32 or int64; int32 saves the TORCH backend a conversion per GEMM), computed on
    the device when None: pass it when several GEMMs share one routing. Returns [M_total, N] in
    a's dtype. The backward gives ``a`` a grouped GEMM with b transposed and ``b`` a variable-K
    grouped GEMM (zero for empty groups), each resolved to a backend of its own.

    ``num_cu`` caps the compute units (SMs) that every GEMM of the call occupies, leaving the rest
    to communication kernels; backends without a persistent kernel ignore it
    (``grouped_gemm_compute_units``). ``schedule`` is "static", the only schedule here.
    ``fuse_bgrad_accum_pattern="megatron"`` adds b's gradient into ``b.main_grad`` and returns
    zeros for b (``gemm_grad_accum``).

    Checks and host syncs: everything about shapes, dtypes and devices is checked from host-side
    facts. That group_lens is non-negative and sums to at most M_total (and that a given group_offs
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
    if schedule not in SCHEDULES:
        raise ValueError(f"grouped_gemm: schedule must be one of {SCHEDULES} (the kernels here walk their tiles in a "
                         f"static stride; there is no work-stealing loop); got {schedule!r}")
    if num_cu is not None:
        check_num_cu("grouped_gemm", num_cu)
    main_grad = (None if fuse_bgrad_accum_pattern is None
                 else main_grad_for("grouped_gemm", b, fuse_bgrad_accum_pattern))
    if torch.compiler.is_compiling():
        offs = offsets_or(group_offs, group_lens, a.shape[0])
        return torch.ops.turbo_dispatch.grouped_gemm(a, b, group_lens, offs, trans_b, num_cu, main_grad)
    problem = grouped_gemm_problem(a, b, group_lens, group_offs, trans_b)
    check_group_lens_values("grouped_gemm", group_lens, group_offs, problem.m)
    offs = offsets_or(group_offs, group_lens, a.shape[0])
    if needs_grad(a, b):
        return GroupedGemmFunction.apply(a, b, group_lens, offs, problem, num_cu, main_grad)
    return _run_capped(num_cu, run, problem, a, b, group_lens, offs)


def _prequantized_grouped_fp8(a, b, group_lens, group_offs, trans_b, out_dtype, cfg: Float8QuantConfig,
                              num_cu: Optional[int]) -> torch.Tensor:
    """``grouped_gemm_fp8`` where an operand arrives as a QuantizedTensor: the GEMM alone, forward
    only, as ``gemm.gemm_fp8`` serves one (the dgrad and wgrad need the operands quantised along
    other dimensions, which a copy quantised along K cannot give)."""
    for name, x in (("a", a), ("b", b)):
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"grouped_gemm_fp8: {name} requires grad, but the other operand is a pre-quantised "
                             "QuantizedTensor, which has no gradient path; pass both operands in high precision "
                             "to train, or call under torch.no_grad()")
    offs = offsets_or(group_offs, group_lens, data_of(a).shape[0])
    blockwise = cfg.granularity is ScalingGranularity.BLOCKWISE
    if torch.compiler.is_compiling():
        if out_dtype is None and isinstance(a, QuantizedTensor):
            raise TypeError("grouped_gemm_fp8: out_dtype is required when a arrives pre-quantised")
        fwd = cfg.format.fwd_dtype()
        return torch.ops.turbo_dispatch.grouped_gemm_fp8_raw(
            data_of(a), data_of(b), group_lens, offs, trans_b, False, a.dtype if out_dtype is None else out_dtype,
            fwd, fwd, cfg.granularity.value, cfg.block_size, blockwise, scale_of(a), scale_of(b), num_cu)
    problem = forward_fp8_problem(a, b, group_lens, group_offs, trans_b, out_dtype, cfg)
    check_group_lens_values("grouped_gemm_fp8", group_lens, group_offs, problem.m)
    return _run_capped(num_cu, run_fp8, problem, a, b, group_lens, offs)


def grouped_gemm_fp8(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor,
                     group_offs: Optional[torch.Tensor] = None, trans_b: bool = True,
                     out_dtype: Optional[torch.dtype] = None,
                     config: Optional[Float8QuantConfig] = None, num_cu: Optional[int] = None,
                     fuse_bgrad_accum_pattern: Optional[str] = None) -> torch.Tensor:
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
    The group_lens value check and its host sync, padded inputs (sum(group_lens) < M_total),
    ``num_cu`` and ``fuse_bgrad_accum_pattern`` behave as in ``grouped_gemm``. Padding rows are
    never multiplied, but a recipe whose scaling groups span tokens (TENSORWISE; the wgrad's
    token runs) includes them in its amax: keep them finite (a receive buffer's zeros are fine).

    Either operand may arrive pre-quantised, a ``QuantizedTensor`` made with ``config``'s recipe
    along this GEMM's K (2-D tiles for a BLOCKWISE weight): then the call is the forward GEMM
    alone (no gradient path) and needs ``out_dtype`` when ``a`` is the quantised one.

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
    if num_cu is not None:
        check_num_cu("grouped_gemm_fp8", num_cu)
    main_grad = (None if fuse_bgrad_accum_pattern is None
                 else main_grad_for("grouped_gemm_fp8", b, fuse_bgrad_accum_pattern))
    if isinstance(a, QuantizedTensor) or isinstance(b, QuantizedTensor):
        return _prequantized_grouped_fp8(a, b, group_lens, group_offs, trans_b, out_dtype, cfg, num_cu)
    if torch.compiler.is_compiling():
        offs = offsets_or(group_offs, group_lens, a.shape[0])
        if needs_grad(a, b) and step_reuses_quantization(cfg):
            return torch.ops.turbo_dispatch.grouped_gemm_fp8_step(
                a, b, group_lens, offs, trans_b, out_dtype, cfg.format.value, cfg.block_size, cfg.scale_dtype.value,
                a.requires_grad, b.requires_grad, num_cu, main_grad)[0]
        return torch.ops.turbo_dispatch.grouped_gemm_fp8(a, b, group_lens, offs, trans_b, out_dtype, cfg.format.value,
                                                         cfg.granularity.value, cfg.block_size, cfg.scale_dtype.value,
                                                         num_cu, main_grad)
    key = None
    if needs_grad(a, b) and step_reuses_quantization(cfg):
        key = grouped_gemm_plan.step_key(a, b, group_lens, group_offs, trans_b, out_dtype, cfg)
        plan = None if key is None else grouped_gemm_plan.lookup(key)
        if plan is not None:  # a call with this key passed every check below before
            check_group_lens_values("grouped_gemm_fp8", group_lens, group_offs, plan.problem.m)
            offs = offsets_or(group_offs, group_lens, a.shape[0])
            return GroupedFp8Function.apply(a, b, group_lens, offs, plan.problem, cfg, num_cu, main_grad, plan)
    problem = forward_fp8_problem(a, b, group_lens, group_offs, trans_b, out_dtype, cfg)
    check_group_lens_values("grouped_gemm_fp8", group_lens, group_offs, problem.m)
    if 0 in (problem.m, problem.n, problem.k):
        # A rank that received no tokens (or an empty weight): nothing to quantise, and the
        # high-precision op gives the defined empty/zero result and gradients.
        return grouped_gemm(a, b, group_lens, group_offs, trans_b, num_cu, "static",
                            fuse_bgrad_accum_pattern).to(problem.out_dtype)
    offs = offsets_or(group_offs, group_lens, a.shape[0])
    if needs_grad(a, b):
        plan = None if key is None else grouped_gemm_plan.keep(key, problem, cfg)
        return GroupedFp8Function.apply(a, b, group_lens, offs, problem, cfg, num_cu, main_grad, plan)
    return _run_capped(num_cu, run_fp8, problem, a, b, group_lens, offs)
