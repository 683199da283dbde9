"""gemm and gemm_fp8: validation, problem keys, custom ops and autograd.

Eager calls take a fast path (resolve + run, or a torch.autograd.Function when gradients are
needed) because a torch.library custom op costs ~15-40 us of host time per call. Under
torch.compile the same work goes through the registered custom ops (fake impls + autograd), so
fullgraph tracing never breaks. Both paths share the problem builders and the gradient formulas.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Union

import torch

from ..backend_type import PrecisionType
from ..low_precision import Float8QuantConfig, QuantizedTensor, ScalingGranularity, dequantize, quantize
from ..op_spec import OpSpec, precision_of_dtype, register_op
from ..device_platform import platform_of
from ..resolver import resolve
from ._common import check_rel, check_snr, require_bool, require_dtype, require_tensor


class GemmProblem(NamedTuple):
    """Key of one gemm call: C[m, n] = op(A)[m, k] @ op(B)[k, n]."""

    m: int
    n: int
    k: int
    trans_a: bool
    trans_b: bool
    a_dtype: torch.dtype
    b_dtype: torch.dtype
    out_dtype: torch.dtype
    platform: str


class GemmFp8Problem(NamedTuple):
    """Key of one fp8 GEMM: both operands quantised per the recipe, then multiplied.

    ``a_fp8``/``b_fp8`` are the float8 dtypes of each operand (HYBRID backward mixes them);
    ``a_2d``/``b_2d`` mark an operand quantised in block_size x block_size tiles (the weight
    role of the blockwise recipe) rather than 1 x block_size runs along K.

    ``a_dtype``/``b_dtype`` are the dtypes the operands arrive in. An fp8 dtype there (equal to
    ``a_fp8``/``b_fp8``) means the operand arrives already quantised, as a ``QuantizedTensor``
    along this GEMM's K: the wgrad of the op's backward gets the activation the forward saved
    that way. Encoding it in the existing field keeps the key schema (and stored keys) unchanged.
    """

    m: int
    n: int
    k: int
    trans_a: bool
    trans_b: bool
    a_dtype: torch.dtype
    b_dtype: torch.dtype
    out_dtype: torch.dtype
    a_fp8: torch.dtype
    b_fp8: torch.dtype
    granularity: ScalingGranularity
    block_size: Optional[int]
    a_2d: bool
    b_2d: bool
    platform: str


_A_HINT = "[M, K] (or [K, M] with trans_a=True)"
_B_HINT = "[K, N] (or [N, K] with trans_b=True)"
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
#: An fp8 GEMM operand: high precision (quantised by the backend) or already quantised.
Fp8Operand = Union[torch.Tensor, QuantizedTensor]


def _data(x: object) -> object:
    """The tensor whose shape and device an operand has (a QuantizedTensor's fp8 data)."""
    return x.data if isinstance(x, QuantizedTensor) else x


def _mnk(op: str, a, b, trans_a: bool, trans_b: bool) -> tuple[int, int, int]:
    a, b = _data(a), _data(b)
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
    m, n, k = _mnk("gemm", a, b, trans_a, trans_b)
    require_dtype("gemm", "a.dtype", a.dtype)
    if b.dtype != a.dtype:
        raise TypeError(f"gemm: a and b must have the same dtype; got a={a.dtype}, b={b.dtype}")
    out_dtype = a.dtype if out_dtype is None else out_dtype
    require_dtype("gemm", "out_dtype", out_dtype)
    return GemmProblem(m, n, k, trans_a, trans_b, a.dtype, b.dtype, out_dtype, platform_of(a.device.type))


_HP = frozenset((torch.bfloat16, torch.float16, torch.float32))
_GPU_PLATFORM = platform_of("cuda")
_new = tuple.__new__


def _platform(x: torch.Tensor) -> str:
    # x.device.type builds a device object (~0.5 us); is_cuda / is_cpu are plain flags.
    return _GPU_PLATFORM if x.is_cuda else ("cpu" if x.is_cpu else platform_of(x.device.type))


def _same_device(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Cheap same-device test for the fast path; anything but cpu/cpu or one GPU takes the slow path
    (get_device() is -1 for every non-CUDA device, so it alone cannot tell cpu from meta)."""
    if a.is_cuda:
        return b.is_cuda and a.get_device() == b.get_device()
    return a.is_cpu and b.is_cpu


def gemm_problem(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False, trans_b: bool = False,
                 out_dtype: Optional[torch.dtype] = None) -> GemmProblem:
    """Validates gemm's arguments and returns its problem key.

    This runs on every eager call, so the common case takes one combined check (about 1 us);
    anything unusual goes through ``_validated_gemm_problem``, which names what is wrong.
    """
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2 and b.dim() == 2:
        dtype = a.dtype
        if (b.dtype is dtype and dtype in _HP and (out_dtype is None or out_dtype in _HP)
                and trans_a.__class__ is bool and trans_b.__class__ is bool and _same_device(a, b)):
            a0, a1 = a.shape
            b0, b1 = b.shape
            m, k = (a1, a0) if trans_a else (a0, a1)
            n, k_b = (b0, b1) if trans_b else (b1, b0)
            if k == k_b:
                return _new(GemmProblem, (m, n, k, trans_a, trans_b, dtype, dtype,
                                          dtype if out_dtype is None else out_dtype, _platform(a)))
    return _validated_gemm_problem(a, b, trans_a, trans_b, out_dtype)


def _check_prequantized(name: str, q: QuantizedTensor, fp8: torch.dtype, granularity: ScalingGranularity,
                        block_size: Optional[int], is_2d: bool, k_axis: int, op: str = "gemm_fp8") -> None:
    """A pre-quantised operand must be exactly what the backend would have made of it: same
    recipe, scales along this GEMM's K. Anything else is a caller bug, named here."""
    want = (fp8, granularity, block_size, is_2d)
    got = (q.data.dtype, q.granularity, q.block_size, q.block_2d)
    if got != want:
        raise ValueError(f"{op}: pre-quantised {name} is (dtype, granularity, block_size, block_2d)={got}, "
                         f"but this GEMM quantises {name} as {want}")
    if not is_2d and granularity is not ScalingGranularity.TENSORWISE and q.axis != k_axis:
        raise ValueError(f"{op}: pre-quantised {name} has its scales along dim {q.axis}, but this GEMM's "
                         f"reduction dim of {name} is dim {k_axis}")


def _operand_dtype(name: str, x, fp8: torch.dtype, granularity: ScalingGranularity, block_size: Optional[int],
                   is_2d: bool, k_axis: int) -> torch.dtype:
    """The dtype an operand arrives in: high precision, or fp8 (== ``fp8``) when pre-quantised."""
    if isinstance(x, QuantizedTensor):
        _check_prequantized(name, x, fp8, granularity, block_size, is_2d, k_axis)
        return x.data.dtype
    require_dtype("gemm_fp8", f"{name}.dtype (high-precision input, or a QuantizedTensor)", x.dtype)
    return x.dtype


def gemm_fp8_problem(a: Fp8Operand, b: Fp8Operand, trans_a: bool, trans_b: bool, out_dtype: Optional[torch.dtype],
                     a_fp8: torch.dtype, b_fp8: torch.dtype, granularity: ScalingGranularity,
                     block_size: Optional[int], a_2d: bool, b_2d: bool) -> GemmFp8Problem:
    """Validates one fp8 GEMM's arguments and returns its problem key. Either operand may be a
    ``QuantizedTensor`` quantised along this GEMM's K (its key then carries the fp8 dtype)."""
    m, n, k = _mnk("gemm_fp8", a, b, trans_a, trans_b)
    require_dtype("gemm_fp8", "a_fp8", a_fp8, _FP8)
    require_dtype("gemm_fp8", "b_fp8", b_fp8, _FP8)
    a_dtype = _operand_dtype("a", a, a_fp8, granularity, block_size, a_2d, 0 if trans_a else 1)
    b_dtype = _operand_dtype("b", b, b_fp8, granularity, block_size, b_2d, 1 if trans_b else 0)
    if out_dtype is None:
        if a_dtype in _FP8:
            raise TypeError("gemm_fp8: out_dtype is required when a arrives pre-quantised")
        out_dtype = a_dtype
    require_dtype("gemm_fp8", "out_dtype", out_dtype)
    return GemmFp8Problem(m, n, k, trans_a, trans_b, a_dtype, b_dtype, out_dtype, a_fp8, b_fp8,
                          granularity, block_size, a_2d, b_2d, platform_of(_data(a).device.type))


# -- op specs (what the resolver and autotuner know) ---------------------------------------------
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
    hp = p._replace(a_dtype=torch.float32 if p.a_dtype in _FP8 else p.a_dtype,
                    b_dtype=torch.float32 if p.b_dtype in _FP8 else p.b_dtype)
    a, b = _operands(hp, device)
    if p.a_dtype in _FP8:
        a = quantize(a, p.a_fp8, p.granularity, axis=0 if p.trans_a else 1, block_size=p.block_size, block_2d=p.a_2d)
    if p.b_dtype in _FP8:
        b = quantize(b, p.b_fp8, p.granularity, axis=1 if p.trans_b else 0, block_size=p.block_size, block_2d=p.b_2d)
    return a, b


def _fp8_reference(p: GemmFp8Problem, inputs) -> torch.Tensor:
    # A pre-quantised operand's exact value is its dequantisation (its rounding already happened).
    return _reference(p, [dequantize(x) if isinstance(x, QuantizedTensor) else x for x in inputs])


def _fp8_check(p: GemmFp8Problem, out, ref):
    # E5M2 operands keep two fewer mantissa bits, hence the lower gate.
    return check_snr(20.0 if torch.float8_e5m2 in (p.a_fp8, p.b_fp8) else 25.0)(out, ref)


GEMM = register_op(OpSpec(
    name="gemm",
    problem_type=GemmProblem,
    precision_of=lambda p: precision_of_dtype(p.a_dtype),
    make_inputs=_operands,
    reference=_reference,
    check=lambda p, out, ref: check_rel(out, ref),
    flops=lambda p: 2.0 * p.m * p.n * p.k,
    problem_from_call=lambda *args, **kwargs: gemm_problem(*args, **kwargs),
))

GEMM_FP8 = register_op(OpSpec(
    name="gemm_fp8",
    problem_type=GemmFp8Problem,
    precision_of=lambda p: PrecisionType.FP8,
    make_inputs=_fp8_operands,
    reference=_fp8_reference,
    check=_fp8_check,
    flops=lambda p: 2.0 * p.m * p.n * p.k,
    problem_from_call=lambda *args, **kwargs: _explain_gemm_fp8(*args, **kwargs),
))


def _run_gemm(p: GemmProblem, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    decision = resolve(GEMM, p)
    return decision.entry.adapter.run(p, a, b, config=decision.config)


def _run_gemm_fp8(p: GemmFp8Problem, a: Fp8Operand, b: Fp8Operand) -> torch.Tensor:
    decision = resolve(GEMM_FP8, p)
    return decision.entry.adapter.run(p, a, b, config=decision.config)


# -- gradient formulas, shared by the eager and the compiled path ---------------------------------
def _gemm_grads(mm: Callable, a, b, grad, trans_a: bool, trans_b: bool, need_a: bool, need_b: bool):
    """dA and dB of C = op(A) @ op(B), each itself a gemm with the layout flags that avoid copies."""
    g = grad if grad.dtype == a.dtype else grad.to(a.dtype)
    grad_a = grad_b = None
    if need_a:
        grad_a = mm(b, g, trans_b, True, a.dtype) if trans_a else mm(g, b, False, not trans_b, a.dtype)
    if need_b:
        grad_b = mm(g, a, True, trans_a, b.dtype) if trans_b else mm(a, g, not trans_a, False, b.dtype)
    return grad_a, grad_b


def _fp8_grads(mm8: Callable, a, b, grad, trans_a: bool, trans_b: bool, fwd: torch.dtype, bwd: torch.dtype,
               granularity: ScalingGranularity, need_a: bool, need_b: bool,
               a_dtype: Optional[torch.dtype] = None, b_dtype: Optional[torch.dtype] = None):
    """Like _gemm_grads, with the recipe's roles: the gradient is quantised as ``bwd`` (E5M2 under
    HYBRID); under BLOCKWISE the weight keeps its 2-D tiles and the wgrad operands use 1-D runs
    along the token dimension, which is that GEMM's reduction dimension.

    ``a`` is either the forward's high-precision ``a`` or what ``_wgrad_operand`` saved from it:
    op(a)^T [K, M] quantised along M. The latter enters the wgrad as is, with the layout flags
    that read it as stored. ``a_dtype``/``b_dtype`` (the gradients' dtypes) default to the
    operands' own, and must be given for a quantised ``a`` (and for ``b=None`` when not need_a).

    ``grad`` may arrive quantised: along N (the dgrad's K) for need_a alone, along M (the wgrad's
    K) for need_b alone, as ``_gradient_in_turn`` makes them.
    """
    a_dtype = a.dtype if a_dtype is None else a_dtype
    b_dtype = b.dtype if b_dtype is None else b_dtype
    w2d = granularity is ScalingGranularity.BLOCKWISE
    grad_a = grad_b = None
    if need_a:
        if trans_a:
            grad_a = mm8(b, grad, trans_b, True, a_dtype, fwd, bwd, w2d, False)
        else:
            grad_a = mm8(grad, b, False, not trans_b, a_dtype, bwd, fwd, False, w2d)
    if need_b:
        if isinstance(a, QuantizedTensor):  # a^T stored [K, M]: dB = a^T @ grad, or dB^T = grad^T @ a
            if trans_b:
                grad_b = mm8(grad, a, True, True, b_dtype, bwd, fwd, False, False)
            else:
                grad_b = mm8(a, grad, False, False, b_dtype, fwd, bwd, False, False)
        elif trans_b:
            grad_b = mm8(grad, a, True, trans_a, b_dtype, bwd, fwd, False, False)
        else:
            grad_b = mm8(a, grad, not trans_a, False, b_dtype, fwd, bwd, False, False)
    return grad_a, grad_b


# -- what the forward saves for the backward --------------------------------------------------------
def _quantize_fast(x: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity,
                   block_size: Optional[int]) -> QuantizedTensor:
    """``quantize(x, axis=1)``, through the fused Triton quantiser on a GPU (one read of x, no
    float32 temporaries: those would raise the peak memory this saving exists to lower), else
    the reference. Both give bit-identical data and scales (tests/test_triton_gemm.py)."""
    if x.is_cuda:
        from turbo_dispatch.backends.quantizer import quantize_operand

        return quantize_operand(x, dtype, granularity, 1, block_size, False)
    return quantize(x, dtype, granularity, axis=1, block_size=block_size)


def _wgrad_operand(a: torch.Tensor, trans_a: bool, cfg: Float8QuantConfig) -> QuantizedTensor:
    """The activation as the wgrad GEMM consumes it: op(a)^T [K, M] quantised along M (its
    reduction dim; 1-D runs under BLOCKWISE), data stored [K, M] contiguous, so both the Triton
    kernel (K-major operands) and cuBLASLt read it without a copy. The wgrad's backend would
    quantise the high-precision ``a`` exactly so, hence saving this instead of ``a`` changes no
    bit of the gradient, and halves (bf16) or quarters (fp32) what is kept alive until backward."""
    return _quantize_fast(a if trans_a else a.t(), cfg.format.fwd_dtype(), cfg.granularity, cfg.block_size)


def _quantize_both(x: torch.Tensor, dtype: torch.dtype, cfg: Float8QuantConfig
                   ) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``x[P, Q]`` quantised along Q and along P (a ``[P, Q]`` view stored ``[Q, P]``), the pair
    the forward needs of the activation (its GEMM and the wgrad): on a GPU from one fused
    quantiser that reads ``x`` twice instead of up to four times; the same bits as two
    ``quantize`` calls (``backends.quantizer.quantize_both_axes``)."""
    from turbo_dispatch.backends.quantizer import quantize_both_axes

    return quantize_both_axes(x, dtype, cfg.granularity, cfg.block_size)


def _gradient_in_turn(grad: torch.Tensor, dtype: torch.dtype, cfg: Float8QuantConfig):
    """Callables giving the gradient for dgrad (along N) and then for wgrad (along M), quantised
    from one shared amax pass where the recipe allows (``backends.quantizer.quantize_both_axes_in_turn``),
    else the gradient itself for the GEMM's backend to quantise."""
    from turbo_dispatch.backends.quantizer import quantize_both_axes_in_turn

    return quantize_both_axes_in_turn(grad, dtype, cfg.granularity)


def _with_prequantized_a(p: GemmFp8Problem) -> GemmFp8Problem:
    """The forward's key once ``op(a)`` arrives quantised along K as ``[M, K]`` (no trans flag)."""
    return p._replace(trans_a=False, a_dtype=p.a_fp8)


def _wgrad_operand_like(a: torch.Tensor, trans_a: bool, cfg: Float8QuantConfig) -> QuantizedTensor:
    """``_wgrad_operand``'s result, shapes and dtypes only (uninitialised; works on ``meta``):
    for building the wgrad's key without quantising anything (tuning.keys)."""
    at = a if trans_a else a.t()
    data, scale = _fp8_quantize_rows_fake(at, cfg.format.fwd_dtype(), cfg.granularity.value, cfg.block_size)
    return _saved_as_quantized(data, scale, cfg)


def _saved_as_quantized(data: torch.Tensor, scale: torch.Tensor, cfg: Float8QuantConfig) -> QuantizedTensor:
    """Rebuilds ``_wgrad_operand``'s result from its two saved tensors."""
    return QuantizedTensor(data=data, scale=scale, granularity=cfg.granularity, axis=1, block_size=cfg.block_size,
                           block_2d=False)


# -- eager path ------------------------------------------------------------------------------------
def _eager_mm(x, y, trans_a, trans_b, out_dtype):
    return _run_gemm(gemm_problem(x, y, trans_a, trans_b, out_dtype), x, y)


class _GemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, problem):
        ctx.save_for_backward(a, b)
        ctx.problem = problem
        return _run_gemm(problem, a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        p = ctx.problem
        grad_a, grad_b = _gemm_grads(_eager_mm, a, b, grad, p.trans_a, p.trans_b, *ctx.needs_input_grad[:2])
        return grad_a, grad_b, None


class _Fp8GemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, problem, config):
        need_a, need_b = ctx.needs_input_grad[:2]
        from turbo_dispatch.backends.quantizer import SHARED_AMAX_GRANULARITIES

        # dgrad reads b and the gradient; only wgrad reads a, and only in quantised form: op(a)
        # along M, which the same quantiser makes with the forward's op(a) along K where the
        # recipe's groups need an amax pass (one shared pass saves a read). 1-D BLOCKWISE runs take
        # one read each anyway, so that forward keeps the backend's own quantisation (and its key).
        if need_b and isinstance(a, torch.Tensor) and config.granularity in SHARED_AMAX_GRANULARITIES:
            qa_k, qa_m = _quantize_both(a.t() if problem.trans_a else a, problem.a_fp8, config)
            out = _run_gemm_fp8(_with_prequantized_a(problem), qa_k, b)
            qa = qa_m.t()
        else:
            out = _run_gemm_fp8(problem, a, b)
            qa = _wgrad_operand(a, problem.trans_a, config) if need_b else None
        ctx.save_for_backward(None if qa is None else qa.data, None if qa is None else qa.scale,
                              b if need_a else None)
        ctx.problem, ctx.config = problem, config
        return out

    @staticmethod
    def backward(ctx, grad):
        a_data, a_scale, b = ctx.saved_tensors
        p, cfg = ctx.problem, ctx.config
        need_a, need_b = ctx.needs_input_grad[:2]
        qa = None if a_data is None else _saved_as_quantized(a_data, a_scale, cfg)

        def mm8(x, y, ta, tb, od, xf, yf, x2d, y2d):
            q = gemm_fp8_problem(x, y, ta, tb, od, xf, yf, cfg.granularity, cfg.block_size, x2d, y2d)
            return _run_gemm_fp8(q, x, y)

        grads = functools.partial(_fp8_grads, mm8, qa, b, trans_a=p.trans_a, trans_b=p.trans_b,
                                  fwd=cfg.format.fwd_dtype(), bwd=cfg.format.bwd_dtype(), granularity=cfg.granularity,
                                  a_dtype=p.a_dtype, b_dtype=p.b_dtype)
        if not (need_a and need_b):
            return (*grads(grad, need_a=need_a, need_b=need_b), None, None)
        # dgrad reads the gradient along N, wgrad along M: both amaxes come from one read, and
        # each copy is made just before its GEMM and dropped after it, so that no more than one
        # fp8 copy of the gradient is alive (both at once lifted the Linear's peak above bf16's).
        for_dgrad, for_wgrad = _gradient_in_turn(grad, cfg.format.bwd_dtype(), cfg)
        grad_a, _ = grads(for_dgrad(), need_a=True, need_b=False)
        _, grad_b = grads(for_wgrad(), need_a=False, need_b=True)
        return grad_a, grad_b, None, None


# -- custom ops (the torch.compile path) ------------------------------------------------------------
@torch.library.custom_op("turbo_dispatch::gemm", mutates_args=())
def _gemm_op(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool,
             out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    return _run_gemm(gemm_problem(a, b, trans_a, trans_b, out_dtype), a, b)


@_gemm_op.register_fake
def _gemm_fake(a, b, trans_a, trans_b, out_dtype):
    p = gemm_problem(a, b, trans_a, trans_b, out_dtype)
    return a.new_empty((p.m, p.n), dtype=p.out_dtype)


def _gemm_setup(ctx, inputs, output):
    a, b, trans_a, trans_b, _ = inputs
    ctx.save_for_backward(a, b)
    ctx.flags = (trans_a, trans_b)


def _gemm_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad_a, grad_b = _gemm_grads(torch.ops.turbo_dispatch.gemm, a, b, grad, *ctx.flags, *ctx.needs_input_grad[:2])
    return grad_a, grad_b, None, None, None


_gemm_op.register_autograd(_gemm_backward, setup_context=_gemm_setup)


def _maybe_quantized(x: torch.Tensor, scale: Optional[torch.Tensor], granularity: ScalingGranularity,
                     block_size: Optional[int], is_2d: bool, k_axis: int) -> Fp8Operand:
    """A custom op cannot take a QuantizedTensor: it gets (fp8 data, scale) and rebuilds it."""
    if scale is None:
        return x
    return QuantizedTensor(data=x, scale=scale, granularity=granularity, axis=k_axis, block_size=block_size,
                           block_2d=is_2d)


@torch.library.custom_op("turbo_dispatch::gemm_fp8_raw", mutates_args=())
def _gemm_fp8_raw_op(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool, out_dtype: torch.dtype,
                     a_fp8: torch.dtype, b_fp8: torch.dtype, granularity: str, block_size: Optional[int],
                     a_2d: bool, b_2d: bool, a_scale: Optional[torch.Tensor] = None,
                     b_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One fp8 GEMM of the backward. With ``a_scale`` (``b_scale``), ``a`` (``b``) is fp8 data
    already quantised along this GEMM's K, with that scale."""
    g = ScalingGranularity(granularity)
    a = _maybe_quantized(a, a_scale, g, block_size, a_2d, 0 if trans_a else 1)
    b = _maybe_quantized(b, b_scale, g, block_size, b_2d, 1 if trans_b else 0)
    p = gemm_fp8_problem(a, b, trans_a, trans_b, out_dtype, a_fp8, b_fp8, g, block_size, a_2d, b_2d)
    return _run_gemm_fp8(p, a, b)


@_gemm_fp8_raw_op.register_fake
def _gemm_fp8_raw_fake(a, b, trans_a, trans_b, out_dtype, a_fp8, b_fp8, granularity, block_size, a_2d, b_2d,
                       a_scale=None, b_scale=None):
    m, n, _ = _mnk("gemm_fp8", a, b, trans_a, trans_b)
    return a.new_empty((m, n), dtype=out_dtype)


def _raw_mm8(cfg: Float8QuantConfig) -> Callable:
    """The backward's fp8 GEMM through the custom op, unpacking a QuantizedTensor operand."""
    def mm8(x, y, ta, tb, od, xf, yf, x2d, y2d):
        xs = x.scale if isinstance(x, QuantizedTensor) else None
        ys = y.scale if isinstance(y, QuantizedTensor) else None
        return torch.ops.turbo_dispatch.gemm_fp8_raw(_data(x), _data(y), ta, tb, od, xf, yf, cfg.granularity.value,
                                                     cfg.block_size, x2d, y2d, xs, ys)
    return mm8


@torch.library.custom_op("turbo_dispatch::fp8_quantize_rows", mutates_args=())
def _fp8_quantize_rows_op(x: torch.Tensor, dtype: torch.dtype, granularity: str,
                          block_size: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(x, axis=1)`` as (data, scale): how the compiled forward saves its activation."""
    q = _quantize_fast(x, dtype, ScalingGranularity(granularity), block_size)
    return q.data, q.scale


@_fp8_quantize_rows_op.register_fake
def _fp8_quantize_rows_fake(x, dtype, granularity, block_size):
    rows, cols = x.shape
    g = ScalingGranularity(granularity)
    if g is ScalingGranularity.TENSORWISE:
        scale_shape: tuple[int, ...] = ()
    elif g is ScalingGranularity.ROWWISE:
        scale_shape = (rows, 1)
    else:
        scale_shape = (rows, -(-cols // block_size))
    return x.new_empty((rows, cols), dtype=dtype), x.new_empty(scale_shape, dtype=torch.float32)


@torch.library.custom_op("turbo_dispatch::gemm_fp8", mutates_args=())
def _gemm_fp8_op(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool, out_dtype: Optional[torch.dtype],
                 format: str, granularity: str, block_size: Optional[int], scale_dtype: str) -> torch.Tensor:
    cfg = Float8QuantConfig(format, granularity, scale_dtype, block_size)
    return _run_gemm_fp8(_forward_fp8_problem(a, b, trans_a, trans_b, out_dtype, cfg), a, b)


@_gemm_fp8_op.register_fake
def _gemm_fp8_fake(a, b, trans_a, trans_b, out_dtype, format, granularity, block_size, scale_dtype):
    m, n, _ = _mnk("gemm_fp8", a, b, trans_a, trans_b)
    return a.new_empty((m, n), dtype=a.dtype if out_dtype is None else out_dtype)


def _gemm_fp8_setup(ctx, inputs, output):
    a, b, trans_a, trans_b, _, fmt, gran, block_size, scale_dtype = inputs
    cfg = Float8QuantConfig(fmt, gran, scale_dtype, block_size)
    need_a, need_b = ctx.needs_input_grad[:2]
    # As the eager path: a only in the quantised form the wgrad reads (see _wgrad_operand), b only
    # for dgrad. A custom op so that torch.compile traces it as one opaque node.
    a_data = a_scale = None
    if need_b:
        a_data, a_scale = torch.ops.turbo_dispatch.fp8_quantize_rows(
            a if trans_a else a.t(), cfg.format.fwd_dtype(), cfg.granularity.value, cfg.block_size)
    ctx.save_for_backward(a_data, a_scale, b if need_a else None)
    ctx.flags = (trans_a, trans_b)
    ctx.dtypes = (a.dtype, b.dtype)
    ctx.config = cfg


def _gemm_fp8_backward(ctx, grad):
    a_data, a_scale, b = ctx.saved_tensors
    cfg = ctx.config
    qa = None if a_data is None else _saved_as_quantized(a_data, a_scale, cfg)
    grad_a, grad_b = _fp8_grads(_raw_mm8(cfg), qa, b, grad, *ctx.flags, cfg.format.fwd_dtype(),
                                cfg.format.bwd_dtype(), cfg.granularity, *ctx.needs_input_grad[:2],
                                a_dtype=ctx.dtypes[0], b_dtype=ctx.dtypes[1])
    return grad_a, grad_b, None, None, None, None, None, None, None


_gemm_fp8_op.register_autograd(_gemm_fp8_backward, setup_context=_gemm_fp8_setup)


def _forward_fp8_problem(a, b, trans_a, trans_b, out_dtype, cfg: Float8QuantConfig) -> GemmFp8Problem:
    """The forward GEMM's problem; reuses gemm's fast checks where the dtypes allow."""
    fwd = cfg.format.fwd_dtype()
    granularity = cfg.granularity
    w2d = granularity is ScalingGranularity.BLOCKWISE
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and b.dtype is a.dtype:
        try:
            p = gemm_problem(a, b, trans_a, trans_b, out_dtype)
        except (TypeError, ValueError):
            pass  # the full fp8 checks below give the fp8-specific message
        else:
            return _new(GemmFp8Problem, (p.m, p.n, p.k, trans_a, trans_b, p.a_dtype, p.b_dtype, p.out_dtype, fwd,
                                         fwd, granularity, cfg.block_size, False, w2d, p.platform))
    return gemm_fp8_problem(a, b, trans_a, trans_b, out_dtype, fwd, fwd, granularity, cfg.block_size, False, w2d)


_DEFAULT_FP8 = Float8QuantConfig()
#: Decision sources that pick the same backend for the backward GEMMs as for the forward when
#: that backend serves every problem (autotune may pick per key, so it is not listed).
_SAME_BACKEND_FOR_GRADS = frozenset(("code", "env", "default"))


def _needs_grad(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.requires_grad or b.requires_grad) and torch.is_grad_enabled()


def _prequantized_gemm_fp8(a: Fp8Operand, b: Fp8Operand, trans_a: bool, trans_b: bool,
                           out_dtype: Optional[torch.dtype], cfg: Float8QuantConfig) -> torch.Tensor:
    """``gemm_fp8`` where an operand arrives as a QuantizedTensor: the GEMM alone, forward only.

    Why no backward: the dgrad needs the weight quantised along N and the wgrad the activation
    along M; a copy quantised along K cannot give either bit-exactly, so a gradient request is
    refused rather than served from re-quantised data."""
    for name, x in (("a", a), ("b", b)):
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"gemm_fp8: {name} requires grad, but the other operand is a pre-quantised "
                             "QuantizedTensor, which has no gradient path; pass both operands in high "
                             "precision to train, or call under torch.no_grad()")
    if torch.compiler.is_compiling():
        # The custom op validates when it runs; the problem key is not built while tracing (its
        # platform lookup is an lru_cache, which dynamo warns about).
        if out_dtype is None and isinstance(a, QuantizedTensor):
            raise TypeError("gemm_fp8: out_dtype is required when a arrives pre-quantised")
        fwd = cfg.format.fwd_dtype()
        return _raw_mm8(cfg)(a, b, trans_a, trans_b, a.dtype if out_dtype is None else out_dtype, fwd, fwd, False,
                             cfg.granularity is ScalingGranularity.BLOCKWISE)
    return _run_gemm_fp8(_forward_fp8_problem(a, b, trans_a, trans_b, out_dtype, cfg), a, b)


# -- public API --------------------------------------------------------------------------------------
def gemm(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False, trans_b: bool = False,
         out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """C = op(a) @ op(b) on the backend the resolver picks; forward and backward.

    ``a`` is [M, K] ([K, M] with ``trans_a``), ``b`` is [K, N] ([N, K] with ``trans_b``), both
    bf16/fp16/fp32 of one dtype; ``out_dtype`` defaults to theirs.

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> a, b = torch.randn(4, 8), torch.randn(3, 8)
        >>> turbo.ops.gemm(a, b, trans_b=True).shape
        torch.Size([4, 3])
    """
    if torch.compiler.is_compiling():
        return torch.ops.turbo_dispatch.gemm(a, b, trans_a, trans_b, out_dtype)
    problem = gemm_problem(a, b, trans_a, trans_b, out_dtype)
    if _needs_grad(a, b):
        decision = resolve(GEMM, problem)
        if (decision.entry.adapter.differentiable and decision.source in _SAME_BACKEND_FOR_GRADS
                and problem.out_dtype is problem.a_dtype):
            # The dgrad/wgrad problems would resolve to this same adapter (it serves every
            # problem, and a pinned or default choice does not depend on the layout), so torch's
            # own autograd can record it; torch.autograd.Function alone costs ~9 us per call. Only
            # when out_dtype is the input dtype: otherwise our backward casts the gradient first.
            return decision.entry.adapter.run(problem, a, b, config=decision.config)
        return _GemmFunction.apply(a, b, problem)
    return _run_gemm(problem, a, b)


def gemm_fp8(a: Fp8Operand, b: Fp8Operand, trans_a: bool = False, trans_b: bool = False,
             out_dtype: Optional[torch.dtype] = None, config: Optional[Float8QuantConfig] = None) -> torch.Tensor:
    """FP8 GEMM from high-precision inputs: quantise both operands per ``config``, multiply, and
    return ``out_dtype`` (default: a's dtype). The backward quantises the gradient too (as E5M2
    under Format.HYBRID). Under BLOCKWISE, ``a`` takes 1 x block_size scales and ``b`` (the
    weight) block_size x block_size scales.

    Either operand may instead arrive quantised already, as a ``QuantizedTensor`` made by
    ``low_precision.quantize`` with ``config``'s recipe along this GEMM's K (a weight quantised
    once and reused over micro-batches, say). That call is the GEMM alone, without a backward,
    and needs ``out_dtype`` when ``a`` is the quantised one; a recipe or axis other than the one
    this GEMM would use raises a ValueError that names the operand.

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> from turbo_dispatch.low_precision import Float8QuantConfig, ScalingGranularity
        >>> cfg = Float8QuantConfig(granularity=ScalingGranularity.ROWWISE)
        >>> a, b = torch.randn(16, 32), torch.randn(8, 32)
        >>> turbo.ops.gemm_fp8(a, b, trans_b=True, config=cfg).shape
        torch.Size([16, 8])
        >>> from turbo_dispatch.low_precision import quantize
        >>> qb = quantize(b, torch.float8_e4m3fn, ScalingGranularity.ROWWISE, axis=1)
        >>> turbo.ops.gemm_fp8(a, qb, trans_b=True, config=cfg).shape
        torch.Size([16, 8])
    """
    cfg = _DEFAULT_FP8 if config is None else config
    if not isinstance(cfg, Float8QuantConfig):
        raise TypeError(f"gemm_fp8: config must be a Float8QuantConfig or None; got {type(config).__name__}")
    if isinstance(a, QuantizedTensor) or isinstance(b, QuantizedTensor):
        return _prequantized_gemm_fp8(a, b, trans_a, trans_b, out_dtype, cfg)
    if torch.compiler.is_compiling():
        return torch.ops.turbo_dispatch.gemm_fp8(a, b, trans_a, trans_b, out_dtype, cfg.format.value,
                                                 cfg.granularity.value, cfg.block_size, cfg.scale_dtype.value)
    problem = _forward_fp8_problem(a, b, trans_a, trans_b, out_dtype, cfg)
    if _needs_grad(a, b):
        return _Fp8GemmFunction.apply(a, b, problem, cfg)
    return _run_gemm_fp8(problem, a, b)


def _explain_gemm_fp8(a, b, trans_a=False, trans_b=False, out_dtype=None, config=None) -> GemmFp8Problem:
    return _forward_fp8_problem(a, b, trans_a, trans_b, out_dtype, Float8QuantConfig() if config is None else config)

