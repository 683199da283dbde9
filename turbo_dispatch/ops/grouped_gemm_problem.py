"""grouped_gemm and grouped_gemm_fp8: their problem keys and the host-side validation that
builds them.

A grouped GEMM multiplies G row blocks of ``a`` (the tokens routed to each expert, one group after
another) by G weight matrices. Its backward has two shapes, both problems of the same op, told
apart by ``variable_k``: dgrad is again a grouped GEMM; wgrad is a variable-K grouped GEMM, a
reduction over each group's tokens.

A key holds host-side facts only (G, M_total, N, K, dtypes, trans_b, fp8 recipe, platform), never
the group lengths: calls with different routings share one key and one decision, and building the
key works under CUDA graph capture and torch.compile. The tuning DB stores a key's fields in
order, so the field lists below are a schema.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..device_platform import platform_of
from ..low_precision import Float8QuantConfig, ScalingGranularity
from ._common import require_bool, require_dtype, require_tensor
from .gemm_operands import (DTYPE_FIELDS, FP8_DTYPES, FP8_RECIPE_FIELDS, HIGH_PRECISION_SET, data_of, new_key,
                            operand_dtype, same_device, tensor_platform)
from .grouped_gemm_routing import OFFS_DTYPES

_SHAPE_FIELDS = (("g", int), ("m", int), ("n", int), ("k", int), ("trans_b", bool), ("variable_k", bool))

GroupedGemmProblem = NamedTuple("GroupedGemmProblem", [*_SHAPE_FIELDS, ("dtype", torch.dtype), ("platform", str)])
GroupedGemmProblem.__doc__ = """Key of one grouped GEMM (bf16/fp16/fp32). Two kinds, told apart by ``variable_k``:

* ``variable_k=False`` (forward, dgrad): ``a[m, k]`` with its m rows split into g groups,
  ``b[g, k, n]`` (``[g, n, k]`` with trans_b); out ``[m, n]``. m is M_total.
* ``variable_k=True`` (wgrad): ``a[k, m]`` and ``b[k, n]``, both token-major with the k tokens
  split into g groups; out ``[g, m, n]``, ``out[i] = a_i^T @ b_i``. k is M_total; trans_b False.

In both, 2*m*n*k is the FLOP count. Group lengths are not part of the key.
Fields: g, m, n, k, trans_b, variable_k, dtype, platform."""

GroupedGemmFp8Problem = NamedTuple("GroupedGemmFp8Problem", [*_SHAPE_FIELDS, *DTYPE_FIELDS, *FP8_RECIPE_FIELDS,
                                                             ("b_2d", bool), ("platform", str)])
GroupedGemmFp8Problem.__doc__ = """Key of one fp8 grouped GEMM; shapes as in GroupedGemmProblem.

Fields: g, m, n, k, trans_b, variable_k, a_dtype, b_dtype, out_dtype, a_fp8, b_fp8, granularity,
block_size, b_2d, platform.

``a_dtype``/``b_dtype`` are the dtypes the operands arrive in: high precision (quantised inside), or
their fp8 dtype when pre-quantised; ``a_fp8``/``b_fp8`` their float8 dtypes (HYBRID backward mixes
them). ``b_2d`` marks the weight quantised in block_size x block_size tiles per group (BLOCKWISE
forward and dgrad); ``a`` is always quantised in 1 x block_size runs along the reduction dimension
(K, or the tokens for variable_k)."""

MX_REFUSED = ("grouped_gemm_fp8: config.granularity=MX_BLOCKWISE is not supported for grouped GEMMs; "
              "use TENSORWISE, ROWWISE or BLOCKWISE")
_I64 = torch.int64
_A_HINT = "[M_total, K]"
_B_HINT = "[G, K, N] (or [G, N, K] with trans_b=True)"
_LENS_HINT = "[G] of int64 (tokens per group)"


def _check_group_tensors(op: str, group_lens, group_offs, ref: torch.Tensor, ref_name: str) -> int:
    """Host-side checks of group_lens / group_offs (type, rank, dtype, device, length); returns G."""
    require_tensor(op, "group_lens", group_lens, 1, _LENS_HINT)
    if group_lens.dtype != _I64:
        raise TypeError(f"{op}: group_lens must be an int64 tensor {_LENS_HINT}; got {group_lens.dtype}")
    if group_lens.device != ref.device:
        raise ValueError(f"{op}: group_lens must be on {ref_name}'s device ({ref.device}); got {group_lens.device}")
    g = group_lens.shape[0]
    if group_offs is not None:
        hint = f"[G + 1] = [{g + 1}] of int32 or int64 (exclusive prefix sums of group_lens)"
        require_tensor(op, "group_offs", group_offs, 1, hint)
        if group_offs.dtype not in OFFS_DTYPES:
            raise TypeError(f"{op}: group_offs must be an int32 or int64 tensor {hint}; got {group_offs.dtype}")
        if group_offs.shape[0] != g + 1:
            raise ValueError(f"{op}: group_offs must have G + 1 = {g + 1} entries; got shape {tuple(group_offs.shape)}")
        if group_offs.device != ref.device:
            raise ValueError(f"{op}: group_offs must be on {ref_name}'s device ({ref.device}); got {group_offs.device}")
    return g


def fixed_shapes(op: str, a, b, group_lens, group_offs, trans_b) -> tuple[int, int, int, int]:
    """(g, m, n, k) of a fixed-K grouped GEMM, with every shape/type check that needs no tensor data."""
    require_tensor(op, "a", a, 2, _A_HINT)
    require_tensor(op, "b", b, 3, _B_HINT)
    require_bool(op, "trans_b", trans_b)
    if a.device != b.device:
        raise ValueError(f"{op}: a and b must be on the same device; got a on {a.device}, b on {b.device}")
    g = _check_group_tensors(op, group_lens, group_offs, a, "a")
    if b.shape[0] != g:
        raise ValueError(f"{op}: b has G={b.shape[0]} groups (b.shape[0]) but group_lens has {g} entries")
    n, k_b = (b.shape[1], b.shape[2]) if trans_b else (b.shape[2], b.shape[1])
    if a.shape[1] != k_b:
        raise ValueError(f"{op}: inner dimensions differ: a{tuple(a.shape)} gives K={a.shape[1]}, "
                         f"b{tuple(b.shape)} with trans_b={trans_b} gives K={k_b}")
    return g, a.shape[0], n, a.shape[1]


def variable_shapes(op: str, x, y, group_lens, group_offs) -> tuple[int, int, int, int]:
    """(g, m, n, k) of a variable-K grouped GEMM: x[k, m], y[k, n] token-major, out [g, m, n]."""
    require_tensor(op, "a", x, 2, "[M_total, P] (token-major)")
    require_tensor(op, "b", y, 2, "[M_total, Q] (token-major)")
    if x.device != y.device:
        raise ValueError(f"{op}: a and b must be on the same device; got a on {x.device}, b on {y.device}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{op}: a{tuple(x.shape)} and b{tuple(y.shape)} must have the same number of tokens (dim 0)")
    g = _check_group_tensors(op, group_lens, group_offs, x, "a")
    return g, x.shape[1], y.shape[1], x.shape[0]


def _validated_problem(a, b, group_lens, group_offs, trans_b) -> GroupedGemmProblem:
    """The full checks, each with its own message; the slow path of grouped_gemm_problem."""
    g, m, n, k = fixed_shapes("grouped_gemm", a, b, group_lens, group_offs, trans_b)
    require_dtype("grouped_gemm", "a.dtype", a.dtype)
    if b.dtype != a.dtype:
        raise TypeError(f"grouped_gemm: a and b must have the same dtype; got a={a.dtype}, b={b.dtype}")
    return GroupedGemmProblem(g, m, n, k, trans_b, False, a.dtype, platform_of(a.device.type))


def grouped_gemm_problem(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor,
                         group_offs: Optional[torch.Tensor] = None, trans_b: bool = False) -> GroupedGemmProblem:
    """Validates grouped_gemm's arguments (host-side facts only) and returns its problem key.

    The common case is one combined check; anything unusual goes through ``_validated_problem``,
    which names what is wrong. The *values* of group_lens are not read here
    (``grouped_gemm_routing.check_group_lens_values`` does that).
    """
    if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(group_lens, torch.Tensor)
            and a.dim() == 2 and b.dim() == 3 and group_lens.dim() == 1):
        dtype = a.dtype
        g = b.shape[0]
        if (b.dtype is dtype and dtype in HIGH_PRECISION_SET and group_lens.dtype is _I64
                and trans_b.__class__ is bool and group_lens.shape[0] == g and same_device(a, b)
                and same_device(a, group_lens)
                and (group_offs is None or (isinstance(group_offs, torch.Tensor) and group_offs.dim() == 1
                                            and group_offs.dtype in OFFS_DTYPES and group_offs.shape[0] == g + 1
                                            and same_device(a, group_offs)))):
            m, k = a.shape
            _, b1, b2 = b.shape
            n, k_b = (b1, b2) if trans_b else (b2, b1)
            if k == k_b:
                return new_key(GroupedGemmProblem, (g, m, n, k, trans_b, False, dtype, tensor_platform(a)))
    return _validated_problem(a, b, group_lens, group_offs, trans_b)


def variable_k_problem(x: torch.Tensor, y: torch.Tensor, group_lens: torch.Tensor,
                       group_offs: Optional[torch.Tensor] = None) -> GroupedGemmProblem:
    """Problem of the wgrad GEMM ``out[i] = x_i^T @ y_i`` (x [M_total, P], y [M_total, Q])."""
    g, m, n, k = variable_shapes("grouped_gemm", x, y, group_lens, group_offs)
    require_dtype("grouped_gemm", "a.dtype", x.dtype)
    if y.dtype != x.dtype:
        raise TypeError(f"grouped_gemm: a and b must have the same dtype; got a={x.dtype}, b={y.dtype}")
    return GroupedGemmProblem(g, m, n, k, False, True, x.dtype, tensor_platform(x))


def grouped_gemm_fp8_problem(x, y, group_lens, group_offs, trans_b: bool, variable_k: bool,
                             out_dtype: Optional[torch.dtype], a_fp8: torch.dtype, b_fp8: torch.dtype,
                             granularity: ScalingGranularity, block_size: Optional[int],
                             b_2d: bool) -> GroupedGemmFp8Problem:
    """Validates one fp8 grouped GEMM's arguments and returns its problem key.

    Either operand may be a ``QuantizedTensor`` already quantised for this GEMM (the training
    step's reuse, see ``grouped_gemm_fp8_step``): along the tokens for the wgrad (``axis=0``),
    along K for the forward's ``a`` (``axis=1``), in 2-D tiles for a ``b_2d`` weight. Its key dtype
    is then the fp8 dtype, so pre-quantised and high-precision calls keep separate decisions."""
    op = "grouped_gemm_fp8"
    if variable_k:
        g, m, n, k = variable_shapes(op, data_of(x), data_of(y), group_lens, group_offs)
        a_axis = b_axis = 0
    else:
        g, m, n, k = fixed_shapes(op, data_of(x), data_of(y), group_lens, group_offs, trans_b)
        a_axis, b_axis = 1, 2 if trans_b else 1
    require_dtype(op, "a_fp8", a_fp8, FP8_DTYPES)
    require_dtype(op, "b_fp8", b_fp8, FP8_DTYPES)
    if granularity is ScalingGranularity.MX_BLOCKWISE:
        raise ValueError(MX_REFUSED)
    a_dtype = operand_dtype(op, "a", x, a_fp8, granularity, block_size, False, a_axis)
    b_dtype = operand_dtype(op, "b", y, b_fp8, granularity, block_size, b_2d and not variable_k, b_axis)
    if out_dtype is None:
        if a_dtype in FP8_DTYPES:
            raise TypeError(f"{op}: out_dtype is required when a arrives pre-quantised")
        out_dtype = a_dtype
    require_dtype(op, "out_dtype", out_dtype)
    return GroupedGemmFp8Problem(g, m, n, k, trans_b and not variable_k, variable_k, a_dtype, b_dtype, out_dtype,
                                 a_fp8, b_fp8, granularity, block_size, b_2d, tensor_platform(data_of(x)))


def forward_fp8_problem(a, b, group_lens, group_offs, trans_b, out_dtype,
                        cfg: Float8QuantConfig) -> GroupedGemmFp8Problem:
    """The key of grouped_gemm_fp8's forward GEMM under ``cfg``; reuses grouped_gemm's fast checks
    where the dtypes allow. Under BLOCKWISE the weight takes 2-D tiles."""
    fwd = cfg.format.fwd_dtype()
    granularity = cfg.granularity
    if granularity is ScalingGranularity.MX_BLOCKWISE:
        raise ValueError(MX_REFUSED)
    w2d = granularity is ScalingGranularity.BLOCKWISE
    if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and b.dtype is a.dtype
            and (out_dtype is None or out_dtype in HIGH_PRECISION_SET)):
        try:
            p = grouped_gemm_problem(a, b, group_lens, group_offs, trans_b)
        except (TypeError, ValueError):
            pass  # the full fp8 checks below give the fp8-specific message
        else:
            return new_key(GroupedGemmFp8Problem, (p.g, p.m, p.n, p.k, trans_b, False, p.dtype, p.dtype,
                                                   p.dtype if out_dtype is None else out_dtype, fwd, fwd, granularity,
                                                   cfg.block_size, w2d, p.platform))
    return grouped_gemm_fp8_problem(a, b, group_lens, group_offs, trans_b, False, out_dtype, fwd, fwd, granularity,
                                    cfg.block_size, w2d)


def explain_grouped_gemm(a, b, group_lens, group_offs=None, trans_b=False, num_cu=None, schedule="static",
                         fuse_bgrad_accum_pattern=None) -> GroupedGemmProblem:
    """The key of ``grouped_gemm`` called with these arguments (``explain``'s view; ``num_cu``,
    ``schedule`` and the accumulation pattern are never part of a key)."""
    return grouped_gemm_problem(a, b, group_lens, group_offs, trans_b)


def explain_grouped_gemm_fp8(a, b, group_lens, group_offs=None, trans_b=True, out_dtype=None,
                             config: Optional[Float8QuantConfig] = None, num_cu=None,
                             fuse_bgrad_accum_pattern=None) -> GroupedGemmFp8Problem:
    """The forward key of ``grouped_gemm_fp8`` called with these arguments (``explain``'s view)."""
    return forward_fp8_problem(a, b, group_lens, group_offs, trans_b, out_dtype,
                               Float8QuantConfig() if config is None else config)
