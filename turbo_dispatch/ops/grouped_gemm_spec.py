"""The grouped_gemm and grouped_gemm_fp8 OpSpecs (what the resolver and the autotuner know of each
op) and the call that runs a problem on the backend the resolver picks for it.

Both ops share decisions across token counts (``tuning.buckets``), and the autotuner times them on
near-balanced routings (``grouped_gemm_routing.near_balanced_lens``) while checking accuracy on random ones.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..backend_type import PrecisionType
from ..low_precision import QuantizedTensor, quantize
from ..low_precision.dual_quantize import padded_rows
from ..op_spec import OpSpec, precision_of_dtype, register_op
from ..resolver import resolve
from ._common import check_rel
from .gemm_operands import FP8_DTYPES, HIGH_PRECISION_SET, dequantized, fp8_check
from .grouped_gemm_routing import near_balanced_lens, offsets, random_lens
from .grouped_gemm_problem import (GroupedGemmFp8Problem, GroupedGemmProblem, explain_grouped_gemm,
                                   explain_grouped_gemm_fp8)


def _make_inputs(p, device, split: Callable[[int, int], torch.Tensor] = random_lens) -> tuple[torch.Tensor, ...]:
    a_dtype = getattr(p, "a_dtype", None) or p.dtype
    b_dtype = getattr(p, "b_dtype", None) or p.dtype
    if p.variable_k:
        x = torch.randn((p.k, p.m), device=device, dtype=a_dtype)
        y = torch.randn((p.k, p.n), device=device, dtype=b_dtype)
        lens = split(p.k, p.g).to(device)
    else:
        x = torch.randn((p.m, p.k), device=device, dtype=a_dtype)
        y = torch.randn((p.g, p.n, p.k) if p.trans_b else (p.g, p.k, p.n), device=device, dtype=b_dtype)
        lens = split(p.m, p.g).to(device)
    return x, y, lens, offsets(lens, x.shape[0])


def grouped_reference(p, inputs) -> torch.Tensor:
    """The same math per group in float64 on the CPU (float32 on the device for GPU inputs)."""
    x, y, lens = inputs[:3]
    wide = torch.float64 if x.device.type == "cpu" else torch.float32
    x, y = x.to(wide), y.to(wide)
    outs, start = [], 0
    for i, length in enumerate(lens.tolist()):
        end = start + length
        if p.variable_k:
            outs.append(x[start:end].t() @ y[start:end])
        else:
            outs.append(x[start:end] @ (y[i].t() if p.trans_b else y[i]))
        start = end
    if p.variable_k:
        return torch.stack(outs) if outs else x.new_zeros((0, p.m, p.n))
    return torch.cat(outs) if outs else x.new_zeros((0, p.n))


def _kmajor(data: torch.Tensor, k_dim: int) -> torch.Tensor:
    """``data`` with the same shape and values, stored with dim ``k_dim`` contiguous and its rows
    padded to 16 elements, as the step's quantisers store their outputs (``padded_rows``): the
    TMA kernels need that row stride, so inputs laid out otherwise would time a refusal that the
    step never meets."""
    last = data.dim() - 1
    return padded_rows(data.transpose(k_dim, last)).transpose(k_dim, last)


def _quantized_kmajor(t: torch.Tensor, dtype: torch.dtype, p: GroupedGemmFp8Problem, k_dim: int,
                      block_2d: bool) -> QuantizedTensor:
    """``t`` quantised for ``p`` along ``k_dim`` (or in 2-D tiles), its data stored K-major."""
    q = quantize(t, dtype, p.granularity, axis=k_dim, block_size=p.block_size, block_2d=block_2d)
    return dataclasses.replace(q, data=_kmajor(q.data, k_dim))


def _fp8_make_inputs(p: GroupedGemmFp8Problem, device,
                     split: Callable[[int, int], torch.Tensor] = random_lens) -> tuple:
    """Inputs for a grouped_gemm_fp8 key. An operand whose key dtype is fp8 arrives pre-quantised
    as the training step passes it (``grouped_gemm_fp8_step``): K-major data, token runs for the
    wgrad, 2-D tiles for a ``b_2d`` weight."""
    hp = p._replace(a_dtype=torch.float32 if p.a_dtype in FP8_DTYPES else p.a_dtype,
                    b_dtype=torch.float32 if p.b_dtype in FP8_DTYPES else p.b_dtype)
    x, y, lens, offs = _make_inputs(hp, device, split)
    k_a, k_b = (0, 0) if p.variable_k else (1, 2 if p.trans_b else 1)
    if p.a_dtype in FP8_DTYPES:
        x = _quantized_kmajor(x, p.a_fp8, p, k_a, False)
    if p.b_dtype in FP8_DTYPES:
        y = _quantized_kmajor(y, p.b_fp8, p, k_b, p.b_2d and not p.variable_k)
    return x, y, lens, offs


def _token_bucketed(p):
    """The problem whose decision ``p`` shares: its token count (M_total, or the K of a variable-K
    weight gradient) rounded up to its bucket (``tuning.buckets``), since routing moves it every
    step. No adapter's ``supports`` reads that count; the resolver checks the shared choice
    against ``p`` anyway."""
    from turbo_dispatch.tuning.buckets import token_bucket

    return p._replace(k=token_bucket(p.k)) if p.variable_k else p._replace(m=token_bucket(p.m))


def _grouped_peer(p: GroupedGemmFp8Problem, sets):
    """grouped_gemm_fp8's high-precision counterpart: ``grouped_gemm`` on the same operands and
    routing, where both operands arrive in the output's high-precision dtype (grouped_gemm returns
    its inputs' dtype; a pre-quantised operand has no high-precision call to compare with)."""
    if not (p.a_dtype is p.b_dtype is p.out_dtype and p.a_dtype in HIGH_PRECISION_SET):
        return None
    peer = GroupedGemmProblem(p.g, p.m, p.n, p.k, p.trans_b, p.variable_k, p.a_dtype, p.platform)
    return "grouped_gemm", peer, [tuple(inputs) for inputs in sets]


def _flops(p) -> float:
    return 2.0 * p.m * p.n * p.k


GROUPED_GEMM = register_op(OpSpec(
    name="grouped_gemm",
    keys_vary_across_ranks=True,
    problem_type=GroupedGemmProblem,
    precision_of=lambda p: precision_of_dtype(p.dtype),
    make_inputs=_make_inputs,
    make_timing_inputs=lambda p, device: _make_inputs(p, device, near_balanced_lens),
    reference=grouped_reference,
    check=lambda p, out, ref: check_rel(out, ref),
    flops=_flops,
    problem_from_call=lambda *args, **kwargs: explain_grouped_gemm(*args, **kwargs),
    shared_problem=_token_bucketed,
))

GROUPED_GEMM_FP8 = register_op(OpSpec(
    name="grouped_gemm_fp8", keys_vary_across_ranks=True, problem_type=GroupedGemmFp8Problem,
    precision_of=lambda p: PrecisionType.FP8,
    make_inputs=_fp8_make_inputs,
    make_timing_inputs=lambda p, device: _fp8_make_inputs(p, device, near_balanced_lens),
    reference=lambda p, inputs: grouped_reference(p, (*dequantized(inputs[:2]), *inputs[2:])),
    check=fp8_check, flops=_flops,
    problem_from_call=lambda *args, **kwargs: explain_grouped_gemm_fp8(*args, **kwargs),
    shared_problem=_token_bucketed,
    high_precision_peer=_grouped_peer,
))


def run(p: GroupedGemmProblem, x, y, group_lens, group_offs) -> torch.Tensor:
    """``p`` on the backend the resolver picks for it."""
    decision = resolve(GROUPED_GEMM, p)
    return decision.entry.adapter.run(p, x, y, group_lens, group_offs, config=decision.config)


def run_fp8(p: GroupedGemmFp8Problem, x, y, group_lens, group_offs) -> torch.Tensor:
    """``p`` on the backend the resolver picks for it."""
    decision = resolve(GROUPED_GEMM_FP8, p)
    return decision.entry.adapter.run(p, x, y, group_lens, group_offs, config=decision.config)


def prepare_fp8(p: GroupedGemmFp8Problem, x, y, group_lens, group_offs):
    """``(run_fp8(p, ...), again)``: ``again(x, y, group_lens, group_offs)`` repeats the call on
    operands laid out as these (``Adapter.prepare`` of the decision's backend and config); None
    where the decision is provisional (autotuning not finished), which must be resolved again."""
    decision = resolve(GROUPED_GEMM_FP8, p)
    adapter = decision.entry.adapter
    if decision.provisional:
        return adapter.run(p, x, y, group_lens, group_offs, config=decision.config), None
    return adapter.prepare(p, x, y, group_lens, group_offs, config=decision.config)
