"""gemm and gemm_fp8: their problem keys and the validation that builds them.

A key holds host-side facts only (shape, layout flags, dtypes, fp8 recipe, platform); the resolver
and the tuning DB find decisions by it, and the DB stores its fields in order, so the field lists
below are a schema. The builders run on every eager call: the common case takes one combined
check, and anything unusual goes through the full checks, each with its own message.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..device_platform import platform_of
from ..low_precision import Float8QuantConfig, ScalingGranularity
from ._common import require_bool, require_dtype, require_tensor
from .gemm_operands import (DTYPE_FIELDS, FP8_DTYPES, FP8_RECIPE_FIELDS, HIGH_PRECISION_SET, Fp8Operand, data_of,
                            new_key, operand_dtype, same_device, tensor_platform)

_LAYOUT_FIELDS = (("m", int), ("n", int), ("k", int), ("trans_a", bool), ("trans_b", bool))

GemmProblem = NamedTuple("GemmProblem", [*_LAYOUT_FIELDS, *DTYPE_FIELDS, ("platform", str)])
GemmProblem.__doc__ = """Key of one gemm call: C[m, n] = op(A)[m, k] @ op(B)[k, n].

Fields: m, n, k, trans_a, trans_b, a_dtype, b_dtype, out_dtype, platform."""

GemmFp8Problem = NamedTuple("GemmFp8Problem", [*_LAYOUT_FIELDS, *DTYPE_FIELDS, *FP8_RECIPE_FIELDS,
                                               ("a_2d", bool), ("b_2d", bool), ("platform", str)])
GemmFp8Problem.__doc__ = """Key of one fp8 GEMM: both operands quantised per the recipe, then multiplied.

Fields: m, n, k, trans_a, trans_b, a_dtype, b_dtype, out_dtype, a_fp8, b_fp8, granularity,
block_size, a_2d, b_2d, platform.

``a_fp8``/``b_fp8`` are the float8 dtypes of each operand (HYBRID backward mixes them);
``a_2d``/``b_2d`` mark an operand quantised in block_size x block_size tiles (the weight role of
the blockwise recipe) rather than 1 x block_size runs along K.

``a_dtype``/``b_dtype`` are the dtypes the operands arrive in. An fp8 dtype there (equal to
``a_fp8``/``b_fp8``) means the operand arrives already quantised, as a ``QuantizedTensor`` along
this GEMM's K: the wgrad of the op's backward gets the activation the forward saved that way.
Encoding it in the existing field keeps the key schema (and stored keys) unchanged."""

_OP = "gemm_fp8"
_A_HINT = "[M, K] (or [K, M] with trans_a=True)"
_B_HINT = "[K, N] (or [N, K] with trans_b=True)"


def mnk(op: str, a: Fp8Operand, b: Fp8Operand, trans_a: bool, trans_b: bool) -> tuple[int, int, int]:
    """(m, n, k) of ``op(a) @ op(b)``, after every check that needs no tensor data."""
    a, b = data_of(a), data_of(b)
    require_tensor(op, "a", a, 2, _A_HINT)
    require_tensor(op, "b", b, 2, _B_HINT)
    require_bool(op, "trans_a", trans_a)
    require_bool(op, "trans_b", trans_b)
    if a.device != b.device:
        raise ValueError(f"{op}: a and b must be on the same device; got a on {a.device}, b on {b.device}")
    k_a, m = (a.shape[0], a.shape[1]) if trans_a else (a.shape[1], a.shape[0])
    n, k_b = (b.shape[0], b.shape[1]) if trans_b else (b.shape[1], b.shape[0])
    if k_a != k_b:
        raise ValueError(
            f"{op}: inner dimensions differ: a{tuple(a.shape)} with trans_a={trans_a} gives K={k_a}, "
            f"b{tuple(b.shape)} with trans_b={trans_b} gives K={k_b}"
        )
    return m, n, k_a


def _validated_gemm_problem(a, b, trans_a, trans_b, out_dtype) -> GemmProblem:
    """The full checks, each with its own message; the slow path of gemm_problem."""
    m, n, k = mnk("gemm", a, b, trans_a, trans_b)
    require_dtype("gemm", "a.dtype", a.dtype)
    if b.dtype != a.dtype:
        raise TypeError(f"gemm: a and b must have the same dtype; got a={a.dtype}, b={b.dtype}")
    out_dtype = a.dtype if out_dtype is None else out_dtype
    require_dtype("gemm", "out_dtype", out_dtype)
    return GemmProblem(m, n, k, trans_a, trans_b, a.dtype, b.dtype, out_dtype, platform_of(a.device.type))


def gemm_problem(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False, trans_b: bool = False,
                 out_dtype: Optional[torch.dtype] = None) -> GemmProblem:
    """Validates gemm's arguments and returns its problem key.

    The common case is one combined check; anything unusual goes through
    ``_validated_gemm_problem``, which names what is wrong.
    """
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2 and b.dim() == 2:
        dtype = a.dtype
        if (b.dtype is dtype and dtype in HIGH_PRECISION_SET
                and (out_dtype is None or out_dtype in HIGH_PRECISION_SET)
                and trans_a.__class__ is bool and trans_b.__class__ is bool and same_device(a, b)):
            a0, a1 = a.shape
            b0, b1 = b.shape
            m, k = (a1, a0) if trans_a else (a0, a1)
            n, k_b = (b0, b1) if trans_b else (b1, b0)
            if k == k_b:
                return new_key(GemmProblem, (m, n, k, trans_a, trans_b, dtype, dtype,
                                             dtype if out_dtype is None else out_dtype, tensor_platform(a)))
    return _validated_gemm_problem(a, b, trans_a, trans_b, out_dtype)


def gemm_fp8_problem(a: Fp8Operand, b: Fp8Operand, trans_a: bool, trans_b: bool, out_dtype: Optional[torch.dtype],
                     a_fp8: torch.dtype, b_fp8: torch.dtype, granularity: ScalingGranularity,
                     block_size: Optional[int], a_2d: bool, b_2d: bool) -> GemmFp8Problem:
    """Validates one fp8 GEMM's arguments and returns its problem key. Either operand may be a
    ``QuantizedTensor`` quantised along this GEMM's K (its key then carries the fp8 dtype)."""
    m, n, k = mnk(_OP, a, b, trans_a, trans_b)
    require_dtype(_OP, "a_fp8", a_fp8, FP8_DTYPES)
    require_dtype(_OP, "b_fp8", b_fp8, FP8_DTYPES)
    a_dtype = operand_dtype(_OP, "a", a, a_fp8, granularity, block_size, a_2d, 0 if trans_a else 1)
    b_dtype = operand_dtype(_OP, "b", b, b_fp8, granularity, block_size, b_2d, 1 if trans_b else 0)
    if out_dtype is None:
        if a_dtype in FP8_DTYPES:
            raise TypeError(f"{_OP}: out_dtype is required when a arrives pre-quantised")
        out_dtype = a_dtype
    require_dtype(_OP, "out_dtype", out_dtype)
    return GemmFp8Problem(m, n, k, trans_a, trans_b, a_dtype, b_dtype, out_dtype, a_fp8, b_fp8,
                          granularity, block_size, a_2d, b_2d, platform_of(data_of(a).device.type))


def forward_fp8_problem(a: Fp8Operand, b: Fp8Operand, trans_a: bool, trans_b: bool, out_dtype: Optional[torch.dtype],
                        cfg: Float8QuantConfig) -> GemmFp8Problem:
    """The key of gemm_fp8's forward GEMM under ``cfg``; reuses gemm's fast checks where the
    dtypes allow. Under BLOCKWISE ``b`` (the weight) takes 2-D tiles."""
    fwd = cfg.format.fwd_dtype()
    granularity = cfg.granularity
    w2d = granularity is ScalingGranularity.BLOCKWISE
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and b.dtype is a.dtype:
        try:
            p = gemm_problem(a, b, trans_a, trans_b, out_dtype)
        except (TypeError, ValueError):
            pass  # the full fp8 checks below give the fp8-specific message
        else:
            return new_key(GemmFp8Problem, (p.m, p.n, p.k, trans_a, trans_b, p.a_dtype, p.b_dtype, p.out_dtype, fwd,
                                            fwd, granularity, cfg.block_size, False, w2d, p.platform))
    return gemm_fp8_problem(a, b, trans_a, trans_b, out_dtype, fwd, fwd, granularity, cfg.block_size, False, w2d)


def explain_gemm(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False, trans_b: bool = False,
                 out_dtype: Optional[torch.dtype] = None,
                 fuse_bgrad_accum_pattern: Optional[str] = None) -> GemmProblem:
    """The key of ``gemm`` called with these arguments (``explain``'s view)."""
    return gemm_problem(a, b, trans_a, trans_b, out_dtype)


def explain_gemm_fp8(a: Fp8Operand, b: Fp8Operand, trans_a: bool = False, trans_b: bool = False,
                     out_dtype: Optional[torch.dtype] = None, config: Optional[Float8QuantConfig] = None,
                     fuse_bgrad_accum_pattern: Optional[str] = None) -> GemmFp8Problem:
    """The forward key of ``gemm_fp8`` called with these arguments (``explain``'s view; the
    gradient-accumulation pattern concerns the backward only)."""
    return forward_fp8_problem(a, b, trans_a, trans_b, out_dtype, Float8QuantConfig() if config is None else config)
