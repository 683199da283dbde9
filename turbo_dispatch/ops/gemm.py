"""gemm and gemm_fp8: validation, problem keys, custom ops and autograd.

Eager calls take a fast path (resolve + run, or a torch.autograd.Function when gradients are
needed) because a torch.library custom op costs ~15-40 us of host time per call. Under
torch.compile the same work goes through the registered custom ops (fake impls + autograd), so
fullgraph tracing never breaks. Both paths share the problem builders and the gradient formulas.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from ..backend_type import PrecisionType
from ..low_precision import Float8QuantConfig, ScalingGranularity
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


def _mnk(op: str, a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool) -> tuple[int, int, int]:
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


def gemm_fp8_problem(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool, out_dtype: Optional[torch.dtype],
                     a_fp8: torch.dtype, b_fp8: torch.dtype, granularity: ScalingGranularity,
                     block_size: Optional[int], a_2d: bool, b_2d: bool) -> GemmFp8Problem:
    """Validates one fp8 GEMM's arguments and returns its problem key."""
    m, n, k = _mnk("gemm_fp8", a, b, trans_a, trans_b)
    require_dtype("gemm_fp8", "a.dtype (high-precision input; it is quantised inside)", a.dtype)
    require_dtype("gemm_fp8", "b.dtype (high-precision input; it is quantised inside)", b.dtype)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    require_dtype("gemm_fp8", "out_dtype", out_dtype)
    require_dtype("gemm_fp8", "a_fp8", a_fp8, _FP8)
    require_dtype("gemm_fp8", "b_fp8", b_fp8, _FP8)
    return GemmFp8Problem(m, n, k, trans_a, trans_b, a.dtype, b.dtype, out_dtype, a_fp8, b_fp8,
                          granularity, block_size, a_2d, b_2d, platform_of(a.device.type))


# -- op specs (what the resolver and autotuner know) ---------------------------------------------
def _operands(p, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn((p.k, p.m) if p.trans_a else (p.m, p.k), device=device, dtype=p.a_dtype)
    b = torch.randn((p.n, p.k) if p.trans_b else (p.k, p.n), device=device, dtype=p.b_dtype)
    return a, b


def _reference(p, inputs) -> torch.Tensor:
    a, b = (x.double() if x.device.type == "cpu" else x.float() for x in inputs)
    return (a.t() if p.trans_a else a) @ (b.t() if p.trans_b else b)


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
    make_inputs=_operands,
    reference=_reference,
    check=_fp8_check,
    flops=lambda p: 2.0 * p.m * p.n * p.k,
    problem_from_call=lambda *args, **kwargs: _explain_gemm_fp8(*args, **kwargs),
))


def _run_gemm(p: GemmProblem, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    decision = resolve(GEMM, p)
    return decision.entry.adapter.run(p, a, b, config=decision.config)


def _run_gemm_fp8(p: GemmFp8Problem, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
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
               granularity: ScalingGranularity, need_a: bool, need_b: bool):
    """Like _gemm_grads, with the recipe's roles: the gradient is quantised as ``bwd`` (E5M2 under
    HYBRID); under BLOCKWISE the weight keeps its 2-D tiles and the wgrad operands use 1-D runs
    along the token dimension, which is that GEMM's reduction dimension."""
    w2d = granularity is ScalingGranularity.BLOCKWISE
    grad_a = grad_b = None
    if need_a:
        if trans_a:
            grad_a = mm8(b, grad, trans_b, True, a.dtype, fwd, bwd, w2d, False)
        else:
            grad_a = mm8(grad, b, False, not trans_b, a.dtype, bwd, fwd, False, w2d)
    if need_b:
        if trans_b:
            grad_b = mm8(grad, a, True, trans_a, b.dtype, bwd, fwd, False, False)
        else:
            grad_b = mm8(a, grad, not trans_a, False, b.dtype, fwd, bwd, False, False)
    return grad_a, grad_b


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
        ctx.save_for_backward(a, b)
        ctx.problem, ctx.config = problem, config
        return _run_gemm_fp8(problem, a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        p, cfg = ctx.problem, ctx.config

        def mm8(x, y, ta, tb, od, xf, yf, x2d, y2d):
            q = gemm_fp8_problem(x, y, ta, tb, od, xf, yf, cfg.granularity, cfg.block_size, x2d, y2d)
            return _run_gemm_fp8(q, x, y)

        grad_a, grad_b = _fp8_grads(mm8, a, b, grad, p.trans_a, p.trans_b, cfg.format.fwd_dtype(),
                                    cfg.format.bwd_dtype(), cfg.granularity, *ctx.needs_input_grad[:2])
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


@torch.library.custom_op("turbo_dispatch::gemm_fp8_raw", mutates_args=())
def _gemm_fp8_raw_op(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool, out_dtype: torch.dtype,
                     a_fp8: torch.dtype, b_fp8: torch.dtype, granularity: str, block_size: Optional[int],
                     a_2d: bool, b_2d: bool) -> torch.Tensor:
    p = gemm_fp8_problem(a, b, trans_a, trans_b, out_dtype, a_fp8, b_fp8, ScalingGranularity(granularity),
                         block_size, a_2d, b_2d)
    return _run_gemm_fp8(p, a, b)


@_gemm_fp8_raw_op.register_fake
def _gemm_fp8_raw_fake(a, b, trans_a, trans_b, out_dtype, a_fp8, b_fp8, granularity, block_size, a_2d, b_2d):
    m, n, _ = _mnk("gemm_fp8", a, b, trans_a, trans_b)
    return a.new_empty((m, n), dtype=out_dtype)


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
    ctx.save_for_backward(a, b)
    ctx.flags = (trans_a, trans_b)
    ctx.config = Float8QuantConfig(fmt, gran, scale_dtype, block_size)


def _gemm_fp8_backward(ctx, grad):
    a, b = ctx.saved_tensors
    cfg = ctx.config

    def mm8(x, y, ta, tb, od, xf, yf, x2d, y2d):
        return torch.ops.turbo_dispatch.gemm_fp8_raw(x, y, ta, tb, od, xf, yf, cfg.granularity.value,
                                                    cfg.block_size, x2d, y2d)

    grad_a, grad_b = _fp8_grads(mm8, a, b, grad, *ctx.flags, cfg.format.fwd_dtype(), cfg.format.bwd_dtype(),
                                cfg.granularity, *ctx.needs_input_grad[:2])
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


def gemm_fp8(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False, trans_b: bool = False,
             out_dtype: Optional[torch.dtype] = None, config: Optional[Float8QuantConfig] = None) -> torch.Tensor:
    """FP8 GEMM from high-precision inputs: quantise both operands per ``config``, multiply, and
    return ``out_dtype`` (default: a's dtype). The backward quantises the gradient too (as E5M2
    under Format.HYBRID). Under BLOCKWISE, ``a`` takes 1 x block_size scales and ``b`` (the
    weight) block_size x block_size scales.

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> from turbo_dispatch.low_precision import Float8QuantConfig, ScalingGranularity
        >>> cfg = Float8QuantConfig(granularity=ScalingGranularity.ROWWISE)
        >>> a, b = torch.randn(16, 32), torch.randn(8, 32)
        >>> turbo.ops.gemm_fp8(a, b, trans_b=True, config=cfg).shape
        torch.Size([16, 8])
    """
    cfg = _DEFAULT_FP8 if config is None else config
    if not isinstance(cfg, Float8QuantConfig):
        raise TypeError(f"gemm_fp8: config must be a Float8QuantConfig or None; got {type(config).__name__}")
    if torch.compiler.is_compiling():
        return torch.ops.turbo_dispatch.gemm_fp8(a, b, trans_a, trans_b, out_dtype, cfg.format.value,
                                                 cfg.granularity.value, cfg.block_size, cfg.scale_dtype.value)
    problem = _forward_fp8_problem(a, b, trans_a, trans_b, out_dtype, cfg)
    if _needs_grad(a, b):
        return _Fp8GemmFunction.apply(a, b, problem, cfg)
    return _run_gemm_fp8(problem, a, b)


def _explain_gemm_fp8(a, b, trans_a=False, trans_b=False, out_dtype=None, config=None) -> GemmFp8Problem:
    return _forward_fp8_problem(a, b, trans_a, trans_b, out_dtype, Float8QuantConfig() if config is None else config)

