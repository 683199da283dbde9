"""gemm and gemm_fp8: the public calls.

Eager calls take a fast path: build the problem key, resolve and run, or a
torch.autograd.Function (``gemm_autograd``) when gradients are needed. Under torch.compile the same
work goes through the registered custom ops (``gemm_custom_ops``: fake impls + autograd), so
fullgraph tracing never breaks; a custom op is not used eagerly because it costs host time on every
call. Both paths share the problem builders (``gemm_problem``) and the gradient formulas
(``gemm_grads``). The problem types and OpSpecs are re-exported here, where callers look for them.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..low_precision import Float8QuantConfig, QuantizedTensor, ScalingGranularity
from ..resolver import resolve
from . import gemm_custom_ops  # noqa: F401  (registers torch.ops.turbo_dispatch.gemm*)
from .gemm_autograd import Fp8GemmFunction, GemmFunction
from .gemm_grad_accum import main_grad_for
from .gemm_operands import Fp8Operand, needs_grad
from .gemm_problem import GemmFp8Problem, GemmProblem, forward_fp8_problem, gemm_fp8_problem, gemm_problem
from .gemm_spec import GEMM, GEMM_FP8, run_gemm, run_gemm_fp8

__all__ = ["GEMM", "GEMM_FP8", "Fp8Operand", "GemmFp8Problem", "GemmProblem", "gemm", "gemm_fp8",
           "gemm_fp8_problem", "gemm_problem"]

_DEFAULT_FP8 = Float8QuantConfig()
#: Decision sources that pick the same backend for the backward GEMMs as for the forward when
#: that backend serves every problem (autotune may pick per key, so it is not listed).
_SAME_BACKEND_FOR_GRADS = frozenset(("code", "env", "default"))


def gemm(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False, trans_b: bool = False,
         out_dtype: Optional[torch.dtype] = None, fuse_bgrad_accum_pattern: Optional[str] = None) -> torch.Tensor:
    """C = op(a) @ op(b) on the backend the resolver picks; forward and backward.

    ``a`` is [M, K] ([K, M] with ``trans_a``), ``b`` is [K, N] ([N, K] with ``trans_b``), both
    bf16/fp16/fp32 of one dtype; ``out_dtype`` defaults to theirs.

    ``fuse_bgrad_accum_pattern="megatron"``: ``b`` (the weight) carries ``main_grad``; the backward
    adds b's gradient into it and returns zeros for b, and the forward sets
    ``b.grad_added_to_main_grad`` (``gemm_grad_accum``).

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> a, b = torch.randn(4, 8), torch.randn(3, 8)
        >>> turbo.ops.gemm(a, b, trans_b=True).shape
        torch.Size([4, 3])
    """
    main_grad = None if fuse_bgrad_accum_pattern is None else main_grad_for("gemm", b, fuse_bgrad_accum_pattern)
    if torch.compiler.is_compiling():
        return torch.ops.turbo_dispatch.gemm(a, b, trans_a, trans_b, out_dtype, main_grad)
    problem = gemm_problem(a, b, trans_a, trans_b, out_dtype)
    if needs_grad(a, b):
        if main_grad is not None:
            return GemmFunction.apply(a, b, problem, main_grad)
        decision = resolve(GEMM, problem)
        if (decision.entry.adapter.differentiable and decision.source in _SAME_BACKEND_FOR_GRADS
                and problem.out_dtype is problem.a_dtype):
            # The dgrad/wgrad problems would resolve to this same adapter (it serves every
            # problem, and a pinned or default choice does not depend on the layout), so torch's
            # own autograd can record it, without the cost of a torch.autograd.Function. Only
            # when out_dtype is the input dtype: otherwise our backward casts the gradient first.
            return decision.entry.adapter.run(problem, a, b, config=decision.config)
        return GemmFunction.apply(a, b, problem)
    return run_gemm(problem, a, b)


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
        return gemm_custom_ops.raw_mm8(cfg)(a, b, trans_a, trans_b, a.dtype if out_dtype is None else out_dtype,
                                            fwd, fwd, False, cfg.granularity is ScalingGranularity.BLOCKWISE)
    return run_gemm_fp8(forward_fp8_problem(a, b, trans_a, trans_b, out_dtype, cfg), a, b)


def gemm_fp8(a: Fp8Operand, b: Fp8Operand, trans_a: bool = False, trans_b: bool = False,
             out_dtype: Optional[torch.dtype] = None, config: Optional[Float8QuantConfig] = None,
             fuse_bgrad_accum_pattern: Optional[str] = None) -> torch.Tensor:
    """FP8 GEMM from high-precision inputs: quantise both operands per ``config``, multiply, and
    return ``out_dtype`` (default: a's dtype). The backward quantises the gradient too (as E5M2
    under Format.HYBRID). Under BLOCKWISE, ``a`` takes 1 x block_size scales and ``b`` (the
    weight) block_size x block_size scales.

    Either operand may instead arrive quantised already, as a ``QuantizedTensor`` made by
    ``low_precision.quantize`` with ``config``'s recipe along this GEMM's K (a weight quantised
    once and reused over micro-batches, say). That call is the GEMM alone, without a backward,
    and needs ``out_dtype`` when ``a`` is the quantised one; a recipe or axis other than the one
    this GEMM would use raises a ValueError that names the operand.

    ``fuse_bgrad_accum_pattern="megatron"`` adds b's gradient into ``b.main_grad`` as ``gemm`` does.

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
    main_grad = (None if fuse_bgrad_accum_pattern is None
                 else main_grad_for("gemm_fp8", b, fuse_bgrad_accum_pattern))
    if isinstance(a, QuantizedTensor) or isinstance(b, QuantizedTensor):
        return _prequantized_gemm_fp8(a, b, trans_a, trans_b, out_dtype, cfg)
    if torch.compiler.is_compiling():
        return torch.ops.turbo_dispatch.gemm_fp8(a, b, trans_a, trans_b, out_dtype, cfg.format.value,
                                                 cfg.granularity.value, cfg.block_size, cfg.scale_dtype.value,
                                                 main_grad)
    problem = forward_fp8_problem(a, b, trans_a, trans_b, out_dtype, cfg)
    if 0 in (problem.m, problem.n, problem.k):
        # Nothing to quantise (an amax over no elements is undefined): the product of an empty
        # operand is defined all the same, an empty result or, for K = 0, zeros; so are its grads.
        return torch.matmul(a.t() if trans_a else a, b.t() if trans_b else b).to(problem.out_dtype)
    if needs_grad(a, b):
        return Fp8GemmFunction.apply(a, b, problem, cfg, main_grad)
    return run_gemm_fp8(problem, a, b)
