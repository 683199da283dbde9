"""Fused producers of fp8 activations in Triton: RMSNorm + quantise and SwiGLU + quantise.

Each kernel computes its op in float32, rounds the result to the activation dtype (what the
unfused op would hand the GEMM), and quantises that rounded value in the same pass with the
scale rules of ``turbo_dispatch.low_precision.quantize``: so the fp8 data and scales equal
``quantize(out, ...)`` of the kernel's own high-precision output bit for bit, and differ from the
unfused pair only through the rounding of the op itself (a few ulps of the activation dtype).
The quantiser steps (``_scale_of``, ``_to_fp8``, ``_nan_max``) are the ones of the fused
quantiser, shared rather than restated so that the two cannot drift apart.

One program owns whole rows (the hidden or FFN dim, up to ``MAX_ROW``), so ROWWISE and 1-D
BLOCKWISE (1 x block along the last dim) scales come from registers: one read of the inputs,
one write of the fp8 data (and of the high-precision output when asked). TENSORWISE needs the
amax of the whole tensor before any cast: the kernel writes the high-precision output and the
fused quantiser casts it (two more reads of it).

Backwards are plain torch: ``rms_norm_backward`` and ``swiglu_backward``.
"""
from __future__ import annotations

from typing import Optional

import torch

from turbo_dispatch.low_precision import FP8_MAX, QuantizedTensor, ScalingGranularity
from turbo_dispatch.low_precision.config import _coerce_enum

from .quantize import _cast_constants, _interpreting, _next_pow2, available, quantize_fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["MAX_ROW", "available", "serves", "rms_norm_quantize", "swiglu_quantize", "rms_norm_backward",
           "swiglu_backward"]

#: The longest row one program holds in registers.
MAX_ROW = 16384

_MODE_ROW = 0
_MODE_BLOCK = 1
_MODE_HP_ONLY = 2  # write the high-precision output only (TENSORWISE casts it afterwards)
_OP_RMS_NORM = 0
_OP_SWIGLU = 1

if triton is not None:
    from .quantize import _nan_max, _scale_of, _to_fp8

    @triton.jit
    def _quantize_row(y, data_ptr, scale_ptr, d_off, s_off, offs, N, MODE: tl.constexpr, BLOCK_N: tl.constexpr,
                      BS: tl.constexpr, FP8_MAX_: tl.constexpr, TINY: tl.constexpr, EMULATE_CAST: tl.constexpr,
                      MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr, RECIP: tl.constexpr):
        """Quantises one row ``y`` (float32 values of the rounded output, zero past N) into
        data[d_off + offs] with one scale (ROW) or one per BS-wide block (BLOCK)."""
        if MODE == 0:
            scale = _scale_of(_nan_max(tl.abs(y)[None, :], 1), FP8_MAX_, TINY, RECIP)  # [1]
            tl.store(scale_ptr + s_off + tl.arange(0, 1), scale)
            q = _to_fp8(tl.math.div_rn(y[None, :], scale[:, None]), data_ptr, FP8_MAX_, EMULATE_CAST, MAN_BITS,
                        MIN_EXP)
            tl.store(data_ptr + d_off + offs[None, :], q, mask=(offs < N)[None, :])
        else:
            NB: tl.constexpr = BLOCK_N // BS
            y2 = tl.reshape(y, (NB, BS))
            scale = _scale_of(_nan_max(tl.abs(y2), 1), FP8_MAX_, TINY, RECIP)  # [NB]
            offs_b = tl.arange(0, NB)
            tl.store(scale_ptr + s_off + offs_b, scale, mask=offs_b * BS < N)
            q = _to_fp8(tl.math.div_rn(y2, scale[:, None]), data_ptr, FP8_MAX_, EMULATE_CAST, MAN_BITS, MIN_EXP)
            offs2 = offs_b[:, None] * BS + tl.arange(0, BS)[None, :]
            tl.store(data_ptr + d_off + offs2, q, mask=offs2 < N)

    @triton.jit
    def _producer_kernel(a_ptr, b_ptr, out_ptr, data_ptr, scale_ptr, N, sa, sb, so, sd, ss, eps,
                         OP: tl.constexpr, MODE: tl.constexpr, WRITE_OUT: tl.constexpr, BLOCK_N: tl.constexpr,
                         BS: tl.constexpr, FP8_MAX_: tl.constexpr, TINY: tl.constexpr,
                         EMULATE_CAST: tl.constexpr, MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                         RECIP: tl.constexpr):
        """Row ``pid`` of the op, rounded to out's dtype, and its fp8.

        OP == _OP_RMS_NORM: a = x, b = the norm weight (``sb`` = 0), out = x * rsqrt(mean(x^2) + eps) * w.
        OP == _OP_SWIGLU: a = gate, b = up, out = silu(gate) * up, with silu rounded to out's dtype
        before the product, as ``F.silu(gate) * up`` rounds it (so out differs from torch's only
        through exp)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_N)
        mask = offs < N
        a = tl.load(a_ptr + row * sa + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * sb + offs, mask=mask, other=0.0).to(tl.float32)
        if OP == 0:
            rstd = 1.0 / tl.sqrt_rn(tl.sum(a * a, axis=0) / N + eps)
            y = (a * rstd * b).to(out_ptr.dtype.element_ty)
        else:
            s = tl.math.div_rn(a, 1.0 + tl.exp(-a)).to(out_ptr.dtype.element_ty).to(tl.float32)
            y = (s * b).to(out_ptr.dtype.element_ty)
        if WRITE_OUT:
            tl.store(out_ptr + row * so + offs, y, mask=mask)
        if MODE != 2:
            _quantize_row(y.to(tl.float32), data_ptr, scale_ptr, row * sd, row * ss, offs, N, MODE, BLOCK_N, BS,
                          FP8_MAX_, TINY, EMULATE_CAST, MAN_BITS, MIN_EXP, RECIP)


def serves(x: torch.Tensor) -> bool:
    """Whether the kernels can run on ``x``'s device here (a GPU tensor, or any under the
    interpreter); ``available()`` must also be None."""
    return x.is_cuda or _interpreting()


def _plan(n: int, dtype: torch.dtype, granularity, block_size: Optional[int], who: str):
    """(granularity, mode, BLOCK_N, BS) for rows of length ``n``; ValueError for a recipe or
    shape these kernels do not serve (the caller then takes the unfused path)."""
    gran = _coerce_enum(ScalingGranularity, granularity, "granularity", who)
    if dtype not in FP8_MAX:
        raise ValueError(f"{who}: dtype must be torch.float8_e4m3fn or torch.float8_e5m2; got {dtype}")
    if not 0 < n <= MAX_ROW:
        raise ValueError(f"{who}: rows must hold 1 to {MAX_ROW} elements; got {n}")
    if gran is ScalingGranularity.BLOCKWISE:
        if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"{who}: BLOCKWISE needs a power-of-two block_size; got {block_size!r}")
        return gran, _MODE_BLOCK, max(_next_pow2(n), block_size), block_size
    if gran is ScalingGranularity.ROWWISE:
        return gran, _MODE_ROW, _next_pow2(n), 1
    if gran is ScalingGranularity.TENSORWISE:
        return gran, _MODE_HP_ONLY, _next_pow2(n), 1
    raise ValueError(f"{who}: granularity {gran.name} is not served (TENSORWISE, ROWWISE, BLOCKWISE are)")


def _launch(op: int, a: torch.Tensor, b: torch.Tensor, sb: int, eps: float, dtype: torch.dtype, gran, mode: int,
            block_n: int, bs: int, block_size: Optional[int], return_out: bool
            ) -> tuple[QuantizedTensor, Optional[torch.Tensor]]:
    """Runs the producer kernel over ``a``'s rows; the QuantizedTensor (cast from ``out`` by the
    fused quantiser under TENSORWISE) and ``out`` if asked."""
    m, n = a.shape
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    data = torch.empty(m, n, dtype=dtype, device=a.device)
    scale = torch.empty(m, 1 if mode != _MODE_BLOCK else -(-n // bs), dtype=torch.float32, device=a.device)
    if m:
        _producer_kernel[(m,)](a, b, out, data, scale, n, a.stride(0), sb, out.stride(0), data.stride(0),
                               scale.stride(0), eps, OP=op, MODE=mode, WRITE_OUT=return_out or mode == _MODE_HP_ONLY,
                               BLOCK_N=block_n, BS=bs, num_warps=_warps(block_n), **_cast_constants(dtype))
    if gran is ScalingGranularity.TENSORWISE:
        q = quantize_fp8(out, dtype, gran, axis=1)
    else:
        q = QuantizedTensor(data=data, scale=scale, granularity=gran, axis=1,
                            block_size=block_size if mode == _MODE_BLOCK else None, block_2d=False,
                            orig_dtype=a.dtype)
    return q, (out if return_out else None)


def _check_2d(who: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dim() != 2 or t.stride(1) != 1 or t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{who}: {name} must be a 2-D bf16/fp16/fp32 tensor with a unit last stride; got "
                             f"{t.dtype} shape {tuple(t.shape)} strides {t.stride()}")


def rms_norm_quantize(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype,
                      granularity: ScalingGranularity | str, block_size: Optional[int] = None,
                      return_out: bool = False) -> tuple[QuantizedTensor, Optional[torch.Tensor]]:
    """RMSNorm of ``x[M, N]`` over N, quantised to fp8 ``dtype`` along N (``axis=1``).

    Returns ``(q, out)``: ``q`` equals ``low_precision.quantize(out, dtype, granularity, axis=1,
    block_size=block_size)`` bit for bit, where ``out`` (x's dtype) is the kernel's normalised
    output; ``out`` is returned when ``return_out`` (it is always computed, for TENSORWISE
    written too). Raises ValueError for recipes or shapes it does not serve.
    """
    _check_2d("rms_norm_quantize", x=x)
    gran, mode, block_n, bs = _plan(x.shape[1], dtype, granularity, block_size, "rms_norm_quantize")
    if weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"rms_norm_quantize: weight must be contiguous of shape ({x.shape[1]},); got "
                         f"{tuple(weight.shape)}")
    return _launch(_OP_RMS_NORM, x, weight, 0, float(eps), dtype, gran, mode, block_n, bs, block_size, return_out)


def swiglu_quantize(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity | str,
                    block_size: Optional[int] = None, return_out: bool = False
                    ) -> tuple[QuantizedTensor, Optional[torch.Tensor]]:
    """``h = silu(gate) * up`` for ``gate, up [M, F]`` (views of one ``[M, 2F]`` projection are
    fine: only the last stride must be 1), quantised along F. Same contract as
    ``rms_norm_quantize``: ``q`` equals ``quantize(h, ...)`` of the returned ``h`` bit for bit."""
    _check_2d("swiglu_quantize", gate=gate, up=up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu_quantize: gate and up must match; got {gate.dtype}{tuple(gate.shape)} and "
                         f"{up.dtype}{tuple(up.shape)}")
    gran, mode, block_n, bs = _plan(gate.shape[1], dtype, granularity, block_size, "swiglu_quantize")
    return _launch(_OP_SWIGLU, gate, up, up.stride(0), 0.0, dtype, gran, mode, block_n, bs, block_size, return_out)


def _warps(block_n: int) -> int:
    """Enough warps that a row's registers stay under ~16 float32 values per thread per tensor."""
    return max(1, min(16, block_n // 512))


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, eps: float, dy: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of ``y = x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, in plain
    torch with float32 math; dx in x's dtype, dweight (summed over rows) in weight's."""
    xf, wf, dyf = x.float(), weight.float(), dy.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    dxhat = dyf * wf
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of ``h = silu(gate) * up``, in plain torch with float32 math, in gate's dtype."""
    g, u, d = gate.float(), up.float(), dh.float()
    sig = torch.sigmoid(g)
    dgate = d * u * sig * (1.0 + g * (1.0 - sig))
    dup = d * g * sig
    return dgate.to(gate.dtype), dup.to(up.dtype)
