"""The gemm and gemm_fp8 OpSpecs (what the resolver and the autotuner know of each op) and the
call that runs a problem on the backend the resolver picks for it."""
from __future__ import annotations

import torch

from ..backend_type import PrecisionType
from ..low_precision import quantize
from ..op_spec import OpSpec, precision_of_dtype, register_op
from ..resolver import resolve
from ._common import check_rel
from .gemm_operands import FP8_DTYPES, HIGH_PRECISION_SET, Fp8Operand, dequantized, fp8_check
from .gemm_problem import GemmFp8Problem, GemmProblem, explain_gemm, explain_gemm_fp8


def _operands(p, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn((p.k, p.m) if p.trans_a else (p.m, p.k), device=device, dtype=p.a_dtype)
    b = torch.randn((p.n, p.k) if p.trans_b else (p.k, p.n), device=device, dtype=p.b_dtype)
    return a, b


def _reference(p, inputs) -> torch.Tensor:
    a, b = (x.double() if x.device.type == "cpu" else x.float() for x in inputs)
    return (a.t() if p.trans_a else a) @ (b.t() if p.trans_b else b)


def _fp8_operands(p: GemmFp8Problem, device: torch.device) -> tuple[Fp8Operand, Fp8Operand]:
    """Inputs for a gemm_fp8 key; an operand whose key dtype is fp8 is made pre-quantised along
    this GEMM's K, as the backward's wgrad receives it."""
    hp = p._replace(a_dtype=torch.float32 if p.a_dtype in FP8_DTYPES else p.a_dtype,
                    b_dtype=torch.float32 if p.b_dtype in FP8_DTYPES else p.b_dtype)
    a, b = _operands(hp, device)
    if p.a_dtype in FP8_DTYPES:
        a = quantize(a, p.a_fp8, p.granularity, axis=0 if p.trans_a else 1, block_size=p.block_size, block_2d=p.a_2d)
    if p.b_dtype in FP8_DTYPES:
        b = quantize(b, p.b_fp8, p.granularity, axis=1 if p.trans_b else 0, block_size=p.block_size, block_2d=p.b_2d)
    return a, b


def _gemm_peer(p: GemmFp8Problem, sets):
    """gemm_fp8's high-precision counterpart: ``gemm`` on the same operands, where both arrive in
    one high-precision dtype (a pre-quantised operand has no high-precision call to compare with)."""
    if p.a_dtype is not p.b_dtype or p.a_dtype not in HIGH_PRECISION_SET or p.out_dtype not in HIGH_PRECISION_SET:
        return None
    peer = GemmProblem(p.m, p.n, p.k, p.trans_a, p.trans_b, p.a_dtype, p.b_dtype, p.out_dtype, p.platform)
    return "gemm", peer, [tuple(inputs) for inputs in sets]


def _flops(p) -> float:
    return 2.0 * p.m * p.n * p.k


GEMM = register_op(OpSpec(
    name="gemm", problem_type=GemmProblem,
    precision_of=lambda p: precision_of_dtype(p.a_dtype),
    make_inputs=_operands, reference=_reference,
    check=lambda p, out, ref: check_rel(out, ref),
    flops=_flops,
    problem_from_call=lambda *args, **kwargs: explain_gemm(*args, **kwargs),
))

GEMM_FP8 = register_op(OpSpec(
    name="gemm_fp8", problem_type=GemmFp8Problem,
    precision_of=lambda p: PrecisionType.FP8,
    make_inputs=_fp8_operands,
    reference=lambda p, inputs: _reference(p, dequantized(inputs)),
    check=fp8_check, flops=_flops,
    problem_from_call=lambda *args, **kwargs: explain_gemm_fp8(*args, **kwargs),
    high_precision_peer=_gemm_peer,
))


def run_gemm(p: GemmProblem, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``p`` on the backend the resolver picks for it."""
    decision = resolve(GEMM, p)
    return decision.entry.adapter.run(p, a, b, config=decision.config)


def run_gemm_fp8(p: GemmFp8Problem, a: Fp8Operand, b: Fp8Operand) -> torch.Tensor:
    """``p`` on the backend the resolver picks for it."""
    decision = resolve(GEMM_FP8, p)
    return decision.entry.adapter.run(p, a, b, config=decision.config)
