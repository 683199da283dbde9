"""Fused float8 quantisation in Triton: amax, scale, saturating cast (and an optional transposed
copy) in one pass over ``x`` wherever the granularity allows.

Semantics are those of ``turbo_dispatch.low_precision.quantize`` for 2-D inputs: the dequant scale
is ``amax / FP8_MAX`` in float32, clamped below to the smallest normal float32, and 1 for all-zero
groups; values are ``x / scale`` (correctly rounded division, ``div_rn``), saturated to
``±FP8_MAX`` and cast round-to-nearest-even. Every step is the IEEE operation the torch reference
does on the same device, in the same order, so data and scales match it bit for bit
(tests/test_triton_gemm.py checks equality, not closeness). One device difference is copied on
purpose: torch on a GPU computes ``amax / FP8_MAX`` (a Python scalar) as ``amax * fl32(1/FP8_MAX)``,
which can differ from the division by one ulp (seen on an H100: 1-ulp scale differences and the
fp8 values they move), so the GPU kernels multiply by that reciprocal and the interpreter (whose
reference is torch on the CPU) divides. A NaN in a group makes that group's scale NaN, as in
the reference.

Passes over ``x``:

* ROWWISE along a dim of length <= ``_ROW_SINGLE_MAX``, 1-D BLOCKWISE, 2-D tiles: one kernel,
  one read (each program holds its whole scaling group in registers).
* TENSORWISE, and ROWWISE along longer rows: an amax kernel (float atomic max into a zeroed
  buffer, so the reduction can be split across programs) and then the cast kernel that reads the
  amax from device memory: two reads, no host sync, so CUDA graphs can capture it.

``x`` may have any strides: quantising a transposed view (``x.t()``) writes the fp8 data
contiguous in the view's layout, i.e. cast + scale + transpose in one pass. That is how the GEMM
adapter gets K-major operands from any trans flag. ``quantize_fp8_with_transpose`` writes both
layouts from one read.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from turbo_dispatch.low_precision.dual_quantize import empty_padded_rows
from turbo_dispatch.low_precision import FP8_MAX, QuantizedTensor, ScalingGranularity
from turbo_dispatch.low_precision.config import _coerce_enum

from .interpret import interpreting as _interpreting
from .prebound import MAX_PLANS, BoundedCache, PreboundKernel

try:  # Triton stays optional: this module imports without it; available() says why.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["available", "quantize_fp8", "quantize_fp8_both", "quantize_fp8_in_turn", "quantize_fp8_with_transpose",
           "quantize_kmajor"]

#: Rows up to this length are held whole in registers (one pass); longer ones take two kernels.
_ROW_SINGLE_MAX = 8192
#: The split amax kernel (two-kernel path): the programs it aims for (a streaming kernel of 4
#: warps needs several per SM), and its (BLOCK_P, BLOCK_Q) tiles, wide along whichever dim is
#: contiguous (q for rows, p along a strided dim); the fastest of an H100 sweep (docs/kernels.md).
AMAX_PROGRAMS = 4096
AMAX_TILE = (16, 256)
AMAX_TILE_STRIDED = (64, 64)
_FP32_TINY = torch.finfo(torch.float32).tiny

# Modes of the cast kernel (which group an amax covers, and where it comes from).
_MODE_ROW = 0  # amax of the tile's rows (the tile spans the whole row)
_MODE_BLOCK1D = 1  # amax of each tile row (the tile spans one 1-D block along the reduction dim)
_MODE_TILE2D = 2  # amax of the whole tile
_MODE_LOADED = 3  # amax read from a buffer, one per row (stride 0: one for the tensor)


@functools.lru_cache(maxsize=None)
def available() -> str | None:
    """None when the Triton kernels can run here (a CUDA/ROCm GPU, or TRITON_INTERPRET=1 on the
    CPU), else the reason they cannot."""
    if triton is None:
        return "triton is not installed"
    if _interpreting():
        return None
    if not torch.cuda.is_available():
        return "no GPU (torch.cuda.is_available() is False) and TRITON_INTERPRET is not set"
    return None


if triton is not None:

    @triton.jit
    def _flagged_max(values, flags, AXIS: tl.constexpr):
        """Max of ``values`` along ``AXIS``, NaN where the reduced ``flags`` (int32, nonzero for a
        NaN) hold one: ``tl.max`` drops NaN, and a NaN amax must reach the scale (as torch's
        amax does)."""
        return tl.where(tl.max(flags, axis=AXIS) > 0, float("nan"), tl.max(values, axis=AXIS))

    @triton.jit
    def _nan_max(a, AXIS: tl.constexpr):
        """``_flagged_max`` of ``a`` (abs values) with its own NaNs as the flags."""
        return _flagged_max(a, (a != a).to(tl.int32), AXIS)

    @triton.jit
    def _amax_kernel(x_ptr, amax_ptr, P, Q, sx_p, sx_q, s_amax,
                     BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, Q_PER_PROG: tl.constexpr,
                     ONE_AMAX: tl.constexpr):
        """Per-row abs-max of x[P, Q] over q, split across programs along q and combined with a
        float atomic max (|x| >= 0, so the max of the bit patterns orders the same way; a NaN
        is carried explicitly because tl.max drops it). ``ONE_AMAX`` gives one global amax,
        one atomic per program: atomics on one address serialise, one per row would cost
        milliseconds on a large weight."""
        pid_p = tl.program_id(0)
        pid_q = tl.program_id(1)
        offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        mask_p = offs_p < P
        run = tl.zeros((BLOCK_P,), dtype=tl.float32)
        nan = tl.zeros((BLOCK_P,), dtype=tl.int32)
        q0 = pid_q * Q_PER_PROG
        for dq in range(0, Q_PER_PROG, BLOCK_Q):
            offs_q = q0 + dq + tl.arange(0, BLOCK_Q)
            mask = mask_p[:, None] & (offs_q[None, :] < Q)
            x = tl.load(x_ptr + offs_p[:, None] * sx_p + offs_q[None, :] * sx_q, mask=mask, other=0.0)
            a = tl.abs(x.to(tl.float32))
            run = tl.maximum(run, tl.max(a, axis=1))
            nan = tl.maximum(nan, tl.max((a != a).to(tl.int32), axis=1))
        if ONE_AMAX:
            tl.atomic_max(amax_ptr, _flagged_max(run, nan, 0))
        else:
            tl.atomic_max(amax_ptr + offs_p * s_amax, tl.where(nan > 0, float("nan"), run), mask=mask_p)

    @triton.jit
    def _scale_of(amax, FP8_MAX_: tl.constexpr, TINY: tl.constexpr, RECIP: tl.constexpr):
        # Same IEEE steps as low_precision._fp_scale: amax / FP8_MAX, clamp_min (keeps NaN), 1
        # for zero. torch on CUDA/ROCm divides by a Python scalar as a multiply by its float32
        # reciprocal (RECIP != 0), torch on the CPU divides (RECIP == 0: the interpreter's case).
        if RECIP != 0.0:
            scale = amax * tl.full(amax.shape, RECIP, tl.float32)
        else:
            scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX_, tl.float32))
        scale = tl.where(scale < TINY, TINY, scale)
        return tl.where(amax == 0.0, 1.0, scale)

    @triton.jit
    def _round_to_fp8_grid(y, MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
        """y (float32, already saturated) rounded to the nearest fp8 value, ties to even, in
        float32 bits. Only used under TRITON_INTERPRET: the interpreter's float32 -> fp8 cast
        mis-rounds values whose rounding carries into the exponent (124.1 -> 64 in e4m3, seen
        with triton 3.9); after this the cast is exact. GPUs use their cvt instruction."""
        bits = y.to(tl.int32, bitcast=True)
        sign = bits & (-2147483648)
        mag = bits & 0x7FFFFFFF
        exp = ((mag >> 23) & 0xFF) - 127
        shift = 23 - MAN_BITS
        one = tl.full(mag.shape, 1, tl.int32)
        lsb = (mag >> shift) & 1
        rounded = (mag + ((one << (shift - 1)) - 1) + lsb) & ~((one << shift) - 1)
        # Below the fp8 normal range the grid step stays 2**(MIN_EXP - MAN_BITS) whatever the
        # exponent, which masking mantissa bits cannot express: add and subtract a constant whose
        # float32 ulp is that step, so float32 addition rounds to the grid (ties to even).
        magic = tl.full(mag.shape, 2.0 ** (MIN_EXP - MAN_BITS + 23), tl.float32)
        tiny = ((mag.to(tl.float32, bitcast=True) + magic) - magic).to(tl.int32, bitcast=True)
        rounded = tl.where(exp < MIN_EXP, tiny, rounded)
        return (sign | rounded).to(tl.float32, bitcast=True)

    @triton.jit
    def _to_fp8(y, out_ptr, FP8_MAX_: tl.constexpr, EMULATE_CAST: tl.constexpr, MAN_BITS: tl.constexpr,
                MIN_EXP: tl.constexpr):
        """y (float32) saturated to +-FP8_MAX (NaN-preserving, like torch.clamp) and cast
        round-to-nearest-even to ``out_ptr``'s fp8 dtype."""
        y = tl.minimum(tl.maximum(y, -FP8_MAX_, propagate_nan=tl.PropagateNan.ALL), FP8_MAX_,
                       propagate_nan=tl.PropagateNan.ALL)
        if EMULATE_CAST:
            y = _round_to_fp8_grid(y, MAN_BITS, MIN_EXP)
        return y.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")

    @triton.jit
    def _quant_kernel(x_ptr, data_ptr, data_t_ptr, scale_ptr, amax_ptr,
                      P, Q, sx_p, sx_q, sd_p, sd_q, st_p, st_q, ss_p, ss_q, s_amax,
                      BS, MODE: tl.constexpr, WRITE_T: tl.constexpr, FP8_MAX_: tl.constexpr,
                      TINY: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
                      EMULATE_CAST: tl.constexpr, MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                      RECIP: tl.constexpr):
        """Quantises x[P, Q] (q = reduction dim) tile by tile into data[P, Q] (and data_t[Q, P]).

        A program owns a BLOCK_P x BLOCK_Q tile. For _MODE_BLOCK1D / _MODE_TILE2D the tile is
        one scaling block along q (``BS`` columns used of BLOCK_Q = next power of two); for
        _MODE_ROW it is the whole row; for _MODE_LOADED any tile, with the amax loaded.
        """
        pid_p = tl.program_id(0)
        pid_q = tl.program_id(1)
        offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        if MODE == 0 or MODE == 3:
            offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
            mask_q = offs_q < Q
        else:
            r = tl.arange(0, BLOCK_Q)
            offs_q = pid_q * BS + r
            mask_q = (r < BS) & (offs_q < Q)
        if MODE == 2:
            r_p = tl.arange(0, BLOCK_P)
            offs_p = pid_p * BS + r_p
            mask_p = (r_p < BS) & (offs_p < P)
        else:
            mask_p = offs_p < P
        mask = mask_p[:, None] & mask_q[None, :]
        x = tl.load(x_ptr + offs_p[:, None] * sx_p + offs_q[None, :] * sx_q, mask=mask, other=0.0).to(tl.float32)

        if MODE == 3:
            amax = tl.load(amax_ptr + offs_p * s_amax, mask=mask_p, other=0.0)
            scale = _scale_of(amax, FP8_MAX_, TINY, RECIP)
            if pid_q == 0:
                # Per-row amax: each row's scale; one amax (stride 0): only lane p == 0 writes.
                tl.store(scale_ptr + offs_p * ss_p, scale, mask=mask_p & ((offs_p == 0) | (offs_p * ss_p > 0)))
            y = tl.math.div_rn(x, scale[:, None])
        elif MODE == 2:
            amax = _nan_max(_nan_max(tl.abs(x), 1), 0)
            scale = _scale_of(amax, FP8_MAX_, TINY, RECIP)
            tl.store(scale_ptr + pid_p * ss_p + pid_q * ss_q, scale)
            y = tl.math.div_rn(x, tl.full(x.shape, 1.0, tl.float32) * scale)
        else:
            amax = _nan_max(tl.abs(x), 1)
            scale = _scale_of(amax, FP8_MAX_, TINY, RECIP)
            tl.store(scale_ptr + offs_p * ss_p + pid_q * ss_q, scale, mask=mask_p)
            y = tl.math.div_rn(x, scale[:, None])

        q = _to_fp8(y, data_ptr, FP8_MAX_, EMULATE_CAST, MAN_BITS, MIN_EXP)
        tl.store(data_ptr + offs_p[:, None] * sd_p + offs_q[None, :] * sd_q, q, mask=mask)
        if WRITE_T:
            tl.store(data_t_ptr + offs_q[None, :] * st_q + offs_p[:, None] * st_p, q, mask=mask)

    @triton.jit
    def _amax_both_kernel(x_ptr, row_ptr, col_ptr, P, Q, sx_p, sx_q, PER_ROW: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, P_STEPS: tl.constexpr):
        """Abs-max of x[P, Q] per row (into row_ptr[P]) and per column (into col_ptr[Q]) from one
        read, or with PER_ROW False the tensor's one amax (into row_ptr[0]). A program walks
        P_STEPS tiles down one column strip, so a column's maximum leaves it once; the float
        atomic max (see _amax_kernel) combines programs, with NaN carried explicitly."""
        pid_p = tl.program_id(0)
        pid_q = tl.program_id(1)
        offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
        mask_q = offs_q < Q
        col = tl.zeros((BLOCK_Q,), dtype=tl.float32)
        col_nan = tl.zeros((BLOCK_Q,), dtype=tl.int32)
        for step in range(P_STEPS):
            offs_p = (pid_p * P_STEPS + step) * BLOCK_P + tl.arange(0, BLOCK_P)
            mask_p = offs_p < P
            x = tl.load(x_ptr + offs_p[:, None] * sx_p + offs_q[None, :] * sx_q,
                        mask=mask_p[:, None] & mask_q[None, :], other=0.0)
            a = tl.abs(x.to(tl.float32))
            is_nan = (a != a).to(tl.int32)
            col = tl.maximum(col, tl.max(a, axis=0))
            col_nan = tl.maximum(col_nan, tl.max(is_nan, axis=0))
            if PER_ROW:
                tl.atomic_max(row_ptr + offs_p, _nan_max(a, 1), mask=mask_p)
        if PER_ROW:
            tl.atomic_max(col_ptr + offs_q, tl.where(col_nan > 0, float("nan"), col), mask=mask_q)
        else:
            tl.atomic_max(row_ptr, _flagged_max(col, col_nan, 0))

    @triton.jit
    def _cast_both_kernel(x_ptr, data_ptr, data_t_ptr, row_amax_ptr, col_amax_ptr, scale_ptr, scale_t_ptr,
                          P, Q, sx_p, sx_q, ld, ld_t, PER_ROW: tl.constexpr, FP8_MAX_: tl.constexpr,
                          TINY: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
                          EMULATE_CAST: tl.constexpr, MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                          RECIP: tl.constexpr):
        """Casts a tile of x[P, Q] twice: into data[P, Q] scaled per row and into data_t[Q, P]
        scaled per column (PER_ROW), or once with the tensor's scale into both. Writes the
        scales from the amaxes _amax_both_kernel left (the first tile row/column of programs)."""
        pid_p = tl.program_id(0)
        pid_q = tl.program_id(1)
        offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
        mask_p = offs_p < P
        mask_q = offs_q < Q
        mask = mask_p[:, None] & mask_q[None, :]
        x = tl.load(x_ptr + offs_p[:, None] * sx_p + offs_q[None, :] * sx_q, mask=mask, other=0.0).to(tl.float32)
        if PER_ROW:
            row_scale = _scale_of(tl.load(row_amax_ptr + offs_p, mask=mask_p, other=0.0), FP8_MAX_, TINY, RECIP)
            col_scale = _scale_of(tl.load(col_amax_ptr + offs_q, mask=mask_q, other=0.0), FP8_MAX_, TINY, RECIP)
            if pid_q == 0:
                tl.store(scale_ptr + offs_p, row_scale, mask=mask_p)
            if pid_p == 0:
                tl.store(scale_t_ptr + offs_q, col_scale, mask=mask_q)
            q = _to_fp8(tl.math.div_rn(x, row_scale[:, None]), data_ptr, FP8_MAX_, EMULATE_CAST, MAN_BITS, MIN_EXP)
            q_t = _to_fp8(tl.math.div_rn(x, col_scale[None, :]), data_ptr, FP8_MAX_, EMULATE_CAST, MAN_BITS,
                          MIN_EXP)
        else:
            # One amax, loaded by every lane (stride 0) so the scale is a vector like the rows'.
            scale = _scale_of(tl.load(row_amax_ptr + offs_p * 0), FP8_MAX_, TINY, RECIP)
            if pid_p == 0 and pid_q == 0:
                tl.store(scale_ptr + offs_p * 0, scale, mask=offs_p == 0)
            q = _to_fp8(tl.math.div_rn(x, scale[:, None]), data_ptr, FP8_MAX_, EMULATE_CAST, MAN_BITS, MIN_EXP)
            # The transposed copy is cast again, from the scale broadcast along the other dim,
            # not stored from q: on an H100 (triton 3.6) storing q twice wrote wrong bytes into
            # data_t for float32 inputs (bf16 was right).
            scale_t = _scale_of(tl.load(row_amax_ptr + offs_q * 0), FP8_MAX_, TINY, RECIP)
            q_t = _to_fp8(tl.math.div_rn(x, scale_t[None, :]), data_ptr, FP8_MAX_, EMULATE_CAST, MAN_BITS, MIN_EXP)
        tl.store(data_ptr + offs_p[:, None] * ld + offs_q[None, :], q, mask=mask)
        tl.store(data_t_ptr + offs_q[None, :] * ld_t + offs_p[:, None], q_t, mask=mask)


def _f32_recip(v: float) -> float:
    """float32(1) / float32(v), rounded to float32: the reciprocal torch's CUDA division by a
    Python scalar multiplies with (aten div_true_kernel_cuda, opmath float)."""
    return torch.tensor(1.0, dtype=torch.float32).div(torch.tensor(v, dtype=torch.float32)).item()


#: How the kernels form amax / FP8_MAX: None = as torch does on this device (divide under the
#: interpreter, multiply by the float32 reciprocal on a GPU); True/False force it (tests).
SCALE_BY_DIVISION: bool | None = None


def _cast_constants(dtype: torch.dtype) -> dict:
    """The cast's constexprs for an fp8 ``dtype``: its range, the emulated cast under the
    interpreter, its mantissa bits and smallest normal exponent, and how the scale is formed.
    Callers unpack it (``**``) and must not change it: it is shared per (dtype, interpreter, scale form)."""
    emulate = _interpreting()
    return _cast_constants_for(dtype, emulate, emulate if SCALE_BY_DIVISION is None else SCALE_BY_DIVISION)


@functools.lru_cache(maxsize=None)
def _cast_constants_for(dtype: torch.dtype, emulate: bool, divide: bool) -> dict:
    """``_cast_constants`` once per argument set: the float32 reciprocal costs two tensor
    constructions and a host read, the same for every call."""
    fmax = FP8_MAX[dtype]
    man_bits, min_exp = (3, -6) if dtype == torch.float8_e4m3fn else (2, -14)
    return dict(FP8_MAX_=fmax, TINY=_FP32_TINY, EMULATE_CAST=emulate, MAN_BITS=man_bits, MIN_EXP=min_exp,
                RECIP=0.0 if divide else _f32_recip(fmax))


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _check(x: torch.Tensor, dtype: torch.dtype, granularity, axis: int, block_size, block_2d: bool):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"quantize_fp8: x must be a 2-D tensor; got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quantize_fp8: x must be bf16, fp16 or fp32; got {x.dtype}")
    if dtype not in FP8_MAX:
        raise ValueError(f"quantize_fp8: dtype must be torch.float8_e4m3fn or torch.float8_e5m2; got {dtype}")
    gran = _coerce_enum(ScalingGranularity, granularity, "granularity", "quantize_fp8")
    if gran is ScalingGranularity.MX_BLOCKWISE:
        raise ValueError("quantize_fp8: MX_BLOCKWISE (power-of-two scales) is not implemented in the Triton "
                         "quantiser; use turbo_dispatch.low_precision.quantize")
    if not -2 <= axis < 2:
        raise ValueError(f"quantize_fp8: axis must be in [-2, 1] for a 2-D x; got {axis}")
    if gran is ScalingGranularity.BLOCKWISE:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"quantize_fp8: BLOCKWISE needs a positive int block_size; got {block_size!r}")
        if block_size > 256:
            raise ValueError(f"quantize_fp8: block_size <= 256 supported (a block is held in registers); got {block_size}")
    elif block_size is not None:
        raise ValueError(f"quantize_fp8: granularity={gran.name} takes no block_size; got {block_size!r}")
    if block_2d and gran is not ScalingGranularity.BLOCKWISE:
        raise ValueError(f"quantize_fp8: block_2d=True needs BLOCKWISE; got {gran.name}")
    if available() is not None:
        raise RuntimeError(f"quantize_fp8: Triton kernels unavailable: {available()}")
    if not x.is_cuda and not _interpreting():
        raise ValueError("quantize_fp8: x must be on a GPU (or run with TRITON_INTERPRET=1 on the CPU)")
    return gran, axis % 2


def _scale_strides(scale: torch.Tensor, axis: int) -> tuple[int, int]:
    """(stride along p, stride along q) of a 2-D scale tensor in kernel coordinates."""
    return (scale.stride(0), scale.stride(1)) if axis == 1 else (scale.stride(1), scale.stride(0))


def _empty_scale(shape: tuple[int, int], mn_major: bool, device) -> torch.Tensor:
    """A scale buffer of ``shape``; ``mn_major`` stores it transposed (dim 0 contiguous), the
    layout the GEMM kernels read a K-block's column of scales from in one coalesced load."""
    if mn_major:
        return torch.empty(shape[::-1], dtype=torch.float32, device=device).t()
    return torch.empty(shape, dtype=torch.float32, device=device)


class _Layout(NamedTuple):
    """What one ``_run`` key fixes besides its launches: the scale buffer (shape, and whether it
    is stored transposed) and, where the split amax kernel runs, its buffer's length."""

    scale_shape: tuple
    scale_mn_major: bool
    amax_len: int | None


#: ``_run``'s layouts per key; its launches' plans live in the launchers below, under the same key.
_LAYOUTS = BoundedCache(MAX_PLANS)


def _run(x, dtype, gran, axis, block_size, block_2d, want_t, row_pad: int = 1, scale_mn_major: bool = False,
         amax: torch.Tensor | None = None):
    """Launches the kernels; returns (data, data_t or None, scale) in the reference's shapes.

    ``row_pad`` > 1 (internal use, axis=1 only) pads data's row stride to a multiple of it, so
    TMA (16-byte strides) can read any K; ``scale_mn_major`` stores 2-D scales transposed.
    ``amax`` (TENSORWISE / ROWWISE) is the groups' amax already taken (``_amax_both``): only
    the two-kernel path's cast runs.

    Everything but the buffers is resolved once per key (``_run_key``): the layout, and each
    kernel's launch, pre-bound (prebound.py). The buffers this allocates are fresh, hence 16-byte
    aligned, so only ``x``'s and a given ``amax``'s alignment enter the key.
    """
    key = _run_key(x, dtype, gran, axis, block_size, block_2d, want_t, row_pad, scale_mn_major, amax)
    layout = _LAYOUTS.get(key)
    rows, cols = x.shape
    if layout is None:
        if rows == 0 or cols == 0:
            raise ValueError(f"quantize_fp8: x must be non-empty; got shape {tuple(x.shape)}")
        layout = _LAYOUTS.put(key, _layout_of(gran, axis, rows, cols, block_size, block_2d, scale_mn_major,
                                              amax is not None, _along_strided(x, axis)))
    data = empty_padded_rows(x, (rows, cols), dtype, pad=row_pad)
    data_t = torch.empty((cols, rows), dtype=dtype, device=x.device) if want_t else None
    dt = data_t if want_t else data
    scale = _empty_scale(layout.scale_shape, layout.scale_mn_major, x.device)
    if layout.amax_len is not None:
        amax = torch.zeros(layout.amax_len, dtype=torch.float32, device=x.device)
        _AMAX_LAUNCHER.launch_keyed(key, (x, amax), lambda: _amax_launch(x, gran, axis))
    _QUANT_LAUNCHER.launch_keyed(key, (x, data, dt, scale, scale if amax is None else amax),
                                 lambda: _cast_launch(x, data, dtype, gran, axis, block_size, block_2d, want_t, scale,
                                                      amax is not None))
    return data, data_t, scale


def _run_key(x, dtype, gran, axis, block_size, block_2d, want_t, row_pad, scale_mn_major, amax) -> tuple:
    """What fixes ``_run``'s layout and launches: ``x``'s shape, strides, dtype, device and 16-byte
    alignment, the recipe and output layout, whether (and how aligned) an amax is given, and the
    scale form (``SCALE_BY_DIVISION``; whether the interpreter runs is fixed per process)."""
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0, dtype, gran, axis, block_size, block_2d,
            want_t, row_pad, scale_mn_major, None if amax is None else amax.data_ptr() % 16 == 0, SCALE_BY_DIVISION)


def _coords(x: torch.Tensor, axis: int, ld: int, rows: int) -> tuple[int, ...]:
    """(P, Q, sx_p, sx_q, sd_p, sd_q, st_p, st_q): sizes and strides in kernel coordinates, p the
    other dim and q the reduction dim (``axis``); ``ld`` is the data's row stride."""
    r, c = x.shape
    if axis == 1:
        return r, c, x.stride(0), x.stride(1), ld, 1, 1, rows
    return c, r, x.stride(1), x.stride(0), 1, ld, rows, 1


def _along_strided(x: torch.Tensor, axis: int) -> bool:
    """Whether ``x``'s reduction dim is strided while the other is contiguous."""
    sx_p, sx_q = (x.stride(0), x.stride(1)) if axis == 1 else (x.stride(1), x.stride(0))
    return sx_q != 1 and sx_p == 1


def _row_path(gran, q: int, along_strided: bool, amax_given: bool) -> bool:
    """Whether ROWWISE takes the one-pass row kernel. A program of it reads its whole group; along
    a strided dim (a column of a row-major x, the transposed view a K-major copy is made from)
    that is one element per 32-byte sector, so such groups take the two-kernel path, whose tiles
    read along p. A given amax (``quantize_fp8_in_turn``) is used as is: the one-pass kernel would
    take it again."""
    return gran is ScalingGranularity.ROWWISE and q <= _ROW_SINGLE_MAX and not along_strided and not amax_given


def _layout_of(gran, axis: int, rows: int, cols: int, block_size, block_2d: bool, scale_mn_major: bool,
               amax_given: bool, along_strided: bool) -> _Layout:
    """``_run``'s scale and amax buffers for one key."""
    q = cols if axis == 1 else rows
    if gran is ScalingGranularity.BLOCKWISE and block_2d:
        return _Layout((-(-rows // block_size), -(-cols // block_size)), scale_mn_major, None)
    if gran is ScalingGranularity.BLOCKWISE:
        nb = -(-q // block_size)
        return _Layout((rows, nb) if axis == 1 else (nb, cols), scale_mn_major, None)
    per_row = gran is ScalingGranularity.ROWWISE
    shape = ((rows, 1) if axis == 1 else (1, cols)) if per_row else ()
    if _row_path(gran, q, along_strided, amax_given):
        return _Layout(shape, False, None)
    # Two kernels: a split amax (atomic max into a zeroed buffer), then the cast.
    return _Layout(shape, False, None if amax_given else ((rows if axis == 1 else cols) if per_row else 1))


def _amax_launch(x: torch.Tensor, gran, axis: int) -> tuple[tuple, dict, dict]:
    """(grid, fixed arguments, options) of the split amax kernel for ``x``."""
    P, Q, sx_p, sx_q = _coords(x, axis, 0, 0)[:4]
    per_row = gran is ScalingGranularity.ROWWISE
    # Tiles wide along the contiguous dim; q split so that about AMAX_PROGRAMS programs run.
    bp_a, bq_a = AMAX_TILE_STRIDED if _along_strided(x, axis) else AMAX_TILE
    q_per_prog = max(bq_a, _next_pow2(-(-Q // max(1, AMAX_PROGRAMS // triton.cdiv(P, bp_a)))))
    q_per_prog = min(q_per_prog, 16384)
    fixed = dict(P=P, Q=Q, sx_p=sx_p, sx_q=sx_q, s_amax=1 if per_row else 0, BLOCK_P=bp_a, BLOCK_Q=bq_a,
                 Q_PER_PROG=q_per_prog, ONE_AMAX=not per_row)
    return (triton.cdiv(P, bp_a), triton.cdiv(Q, q_per_prog)), fixed, dict(num_warps=4)


def _cast_launch(x: torch.Tensor, data: torch.Tensor, dtype, gran, axis: int, block_size, block_2d: bool,
                 want_t: bool, scale: torch.Tensor, amax_given: bool) -> tuple[tuple, dict, dict]:
    """(grid, fixed arguments, options) of the quantise (cast) kernel for one ``_run`` key."""
    rows, cols = x.shape
    P, Q, sx_p, sx_q, sd_p, sd_q, st_p, st_q = _coords(x, axis, data.stride(0), rows)
    fixed = dict(P=P, Q=Q, sx_p=sx_p, sx_q=sx_q, sd_p=sd_p, sd_q=sd_q, st_p=st_p, st_q=st_q, WRITE_T=want_t,
                 **_cast_constants(dtype))
    if gran is ScalingGranularity.BLOCKWISE:
        ss_p, ss_q = _scale_strides(scale, axis)
        bq = _next_pow2(block_size)
        if block_2d:
            nr, nc = -(-rows // block_size), -(-cols // block_size)
            grid, mode, bp, warps = ((nr, nc) if axis == 1 else (nc, nr)), _MODE_TILE2D, bq, 8 if bq >= 128 else 4
        else:
            mode, bp, warps = _MODE_BLOCK1D, max(1, min(64, 8192 // bq)), 4
            grid = (triton.cdiv(P, bp), -(-Q // block_size))
        fixed.update(ss_p=ss_p, ss_q=ss_q, s_amax=0, BS=block_size, MODE=mode, BLOCK_P=bp, BLOCK_Q=bq)
        return grid, fixed, dict(num_warps=warps)
    if _row_path(gran, Q, _along_strided(x, axis), amax_given):
        bq = _next_pow2(Q)
        bp = max(1, min(64, 4096 // bq))
        fixed.update(ss_p=1, ss_q=0, s_amax=0, BS=Q, MODE=_MODE_ROW, BLOCK_P=bp, BLOCK_Q=bq)
        return (triton.cdiv(P, bp), 1), fixed, dict(num_warps=8 if bq >= 4096 else 4)
    s_amax = 1 if gran is ScalingGranularity.ROWWISE else 0
    bp, bq = 64, 64
    fixed.update(ss_p=s_amax, ss_q=0, s_amax=s_amax, BS=0, MODE=_MODE_LOADED, BLOCK_P=bp, BLOCK_Q=bq)
    return (triton.cdiv(P, bp), triton.cdiv(Q, bq)), fixed, dict(num_warps=4)


#: The quantiser's kernels, launched through one plan per key (the per-call arguments are the
#: input and the buffers each call allocates).
_QUANT_LAUNCHER = (PreboundKernel(_quant_kernel, per_call=("x_ptr", "data_ptr", "data_t_ptr", "scale_ptr", "amax_ptr"))
                   if triton is not None else None)
_AMAX_LAUNCHER = PreboundKernel(_amax_kernel, per_call=("x_ptr", "amax_ptr")) if triton is not None else None


#: Launch shapes of ``quantize_fp8_both``: the amax kernel's (BLOCK_P, BLOCK_Q, P_STEPS,
#: num_warps) and the cast kernel's (BLOCK_P, BLOCK_Q, num_warps); the fastest of an H100 sweep
#: (docs/kernels.md).
BOTH_AMAX_LAUNCH = (8, 1024, 32, 4)
BOTH_CAST_LAUNCH = (32, 64, 4)


def quantize_fp8_both(x: torch.Tensor, dtype: torch.dtype,
                      granularity: ScalingGranularity) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``(quantize(x, axis=1), quantize(x, axis=0))`` for TENSORWISE or ROWWISE, bit-identical
    to the reference, from two reads of ``x`` (one kernel takes every amax, one writes both casts).

    These are the two quantisations a training step needs of an activation or a gradient: along
    its features for one GEMM and along its tokens for the wgrad. The second one's data is
    stored ``[Q, P]`` contiguous and shown as a ``[P, Q]`` view (``axis=0``), the K-major layout
    the wgrad reads; both have rows padded to 16 bytes (TMA).

    >>> rows, cols = quantize_fp8_both(x, torch.float8_e4m3fn, ScalingGranularity.ROWWISE)  # doctest: +SKIP
    >>> tuple(rows.scale.shape), tuple(cols.scale.shape), cols.data.stride()  # doctest: +SKIP
    ((300, 1), (1, 256), (1, 304))
    """
    gran = _check_both(x, dtype, granularity, "quantize_fp8_both")
    rows, cols = x.shape
    per_row = gran is ScalingGranularity.ROWWISE
    data = empty_padded_rows(x, (rows, cols), dtype)
    data_t = empty_padded_rows(x, (cols, rows), dtype)
    row_amax, col_amax = _amax_both(x, per_row)
    if per_row:
        scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
        scale_t = torch.empty((1, cols), dtype=torch.float32, device=x.device)
    else:
        scale = scale_t = torch.empty((), dtype=torch.float32, device=x.device)
    _CAST_BOTH_LAUNCHER.launch_keyed((*_both_key(x, per_row), dtype, SCALE_BY_DIVISION),
                                     (x, data, data_t, row_amax, col_amax, scale, scale_t),
                                     lambda: _cast_both_launch(x, data, data_t, dtype, per_row))
    make = dict(granularity=gran, block_size=None, block_2d=False)
    return (QuantizedTensor(data=data, scale=scale, axis=1, **make),
            QuantizedTensor(data=data_t.t(), scale=scale_t, axis=0, **make))


def _check_both(x: torch.Tensor, dtype: torch.dtype, granularity, who: str) -> ScalingGranularity:
    gran, _ = _check(x, dtype, granularity, 1, None, False)
    if gran not in (ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE):
        raise ValueError(f"{who}: TENSORWISE or ROWWISE only; got {gran.name}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{who}: x must be non-empty; got shape {tuple(x.shape)}")
    return gran


def _amax_both(x: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(row amax [P], column amax [Q]) of x[P, Q] from one read; without ``per_row`` the tensor's
    amax, one buffer returned twice."""
    rows, cols = x.shape
    row_amax = torch.zeros(rows if per_row else 1, dtype=torch.float32, device=x.device)
    col_amax = torch.zeros(cols, dtype=torch.float32, device=x.device) if per_row else row_amax
    _AMAX_BOTH_LAUNCHER.launch_keyed(_both_key(x, per_row), (x, row_amax, col_amax),
                                     lambda: _amax_both_launch(x, per_row))
    return row_amax, col_amax


def _both_key(x: torch.Tensor, per_row: bool) -> tuple:
    """What fixes the launches of ``_amax_both`` (and, with the fp8 dtype and the scale form, of
    ``quantize_fp8_both``'s cast): ``x``'s shape, strides, dtype, device and 16-byte alignment and
    the recipe. Their other buffers are fresh allocations, hence aligned."""
    return x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0, per_row


def _amax_both_launch(x: torch.Tensor, per_row: bool) -> tuple[tuple, dict, dict]:
    rows, cols = x.shape
    bp, bq, steps, warps = BOTH_AMAX_LAUNCH
    fixed = dict(P=rows, Q=cols, sx_p=x.stride(0), sx_q=x.stride(1), PER_ROW=per_row, BLOCK_P=bp, BLOCK_Q=bq,
                 P_STEPS=steps)
    return (triton.cdiv(rows, bp * steps), triton.cdiv(cols, bq)), fixed, dict(num_warps=warps)


def _cast_both_launch(x: torch.Tensor, data: torch.Tensor, data_t: torch.Tensor, dtype: torch.dtype,
                      per_row: bool) -> tuple[tuple, dict, dict]:
    rows, cols = x.shape
    bp, bq, warps = BOTH_CAST_LAUNCH
    fixed = dict(P=rows, Q=cols, sx_p=x.stride(0), sx_q=x.stride(1), ld=data.stride(0), ld_t=data_t.stride(0),
                 PER_ROW=per_row, BLOCK_P=bp, BLOCK_Q=bq, **_cast_constants(dtype))
    return (triton.cdiv(rows, bp), triton.cdiv(cols, bq)), fixed, dict(num_warps=warps)


_AMAX_BOTH_LAUNCHER = (PreboundKernel(_amax_both_kernel, per_call=("x_ptr", "row_ptr", "col_ptr"))
                       if triton is not None else None)
_CAST_BOTH_LAUNCHER = (PreboundKernel(_cast_both_kernel, per_call=(
    "x_ptr", "data_ptr", "data_t_ptr", "row_amax_ptr", "col_amax_ptr", "scale_ptr", "scale_t_ptr"))
    if triton is not None else None)


def quantize_fp8_in_turn(x: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity
                         ) -> tuple[Callable[[], QuantizedTensor], Callable[[], QuantizedTensor]]:
    """``quantize_fp8_both``'s pair, made one at a time: every amax from one read now, each cast
    (one read) when its callable is called. For the backward, where holding both copies of the
    gradient at once would lift the step's peak memory above the bf16 step's. Same bits and
    layouts as ``quantize_fp8_both``.
    """
    gran = _check_both(x, dtype, granularity, "quantize_fp8_in_turn")
    row_amax, col_amax = _amax_both(x, gran is ScalingGranularity.ROWWISE)
    make = dict(granularity=gran, block_size=None, block_2d=False)

    def along_rows() -> QuantizedTensor:
        data, _, scale = _run(x, dtype, gran, 1, None, False, want_t=False, row_pad=16, amax=row_amax)
        return QuantizedTensor(data=data, scale=scale, axis=1, **make)

    def along_cols() -> QuantizedTensor:
        data, _, scale = _run(x.t(), dtype, gran, 1, None, False, want_t=False, row_pad=16, amax=col_amax)
        return QuantizedTensor(data=data, scale=scale, axis=1, **make).t()

    return along_rows, along_cols


def quantize_kmajor(x: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity,
                    block_size: int | None, block_2d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """For the GEMM kernels: quantise the logical operand ``x`` [R, K] (any strides) along K and
    return ``(data, scale)`` with data [R, K] K-major, its row stride padded to 16 bytes (TMA),
    and the scale as the kernels read it: 0-d (tensorwise), [R, 1] (rowwise), [R, K/bs] stored
    R-major (1-D blocks), [R/bs, K/bs] (2-D tiles)."""
    gran, _ = _check(x, dtype, granularity, 1, block_size, block_2d)
    data, _, scale = _run(x, dtype, gran, 1, block_size, block_2d, want_t=False, row_pad=16,
                          scale_mn_major=gran is ScalingGranularity.BLOCKWISE and not block_2d)
    return data, scale


def _transposed_scale(scale: torch.Tensor) -> torch.Tensor:
    return scale if scale.dim() == 0 else scale.t().contiguous()


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity, *, axis: int,
                 block_size: int | None = None, block_2d: bool = False) -> QuantizedTensor:
    """Triton version of ``turbo_dispatch.low_precision.quantize`` for a 2-D GPU tensor.

    Same arguments, result shapes and scale convention (``x ≈ data * scale``); the data and
    scales are bit-identical to the torch reference. ``x`` may be any strided view: the data is
    written contiguous in ``x``'s logical shape, so ``quantize_fp8(w.t(), ...)`` is a fused
    cast + scale + transpose. MX_BLOCKWISE is not implemented here (ValueError).

    >>> q = quantize_fp8(x, torch.float8_e4m3fn, ScalingGranularity.BLOCKWISE, axis=1, block_size=128)  # doctest: +SKIP
    """
    gran, axis = _check(x, dtype, granularity, axis, block_size, block_2d)
    data, _, scale = _run(x, dtype, gran, axis, block_size, block_2d, want_t=False)
    return QuantizedTensor(data=data, scale=scale, granularity=gran, axis=axis,
                           block_size=block_size, block_2d=block_2d)


def quantize_fp8_with_transpose(x: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity, *,
                                axis: int, block_size: int | None = None,
                                block_2d: bool = False) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``(quantize_fp8(x, ...), quantize of x.t() with the same scales)`` from one read of ``x``.

    The second tensor equals ``quantize(x.t(), dtype, granularity, axis=1 - axis, ...)``: its data
    is ``x``'s fp8 data transposed and stored contiguous (so the other GEMM that consumes the
    same quantised operand, e.g. a wgrad after a forward, gets its K-major copy without a second
    pass), its scale the first one's transposed.
    """
    gran, axis = _check(x, dtype, granularity, axis, block_size, block_2d)
    data, data_t, scale = _run(x, dtype, gran, axis, block_size, block_2d, want_t=True)
    q = QuantizedTensor(data=data, scale=scale, granularity=gran, axis=axis, block_size=block_size,
                        block_2d=block_2d)
    q_t = QuantizedTensor(data=data_t, scale=_transposed_scale(scale), granularity=gran, axis=1 - axis,
                          block_size=block_size, block_2d=block_2d)
    return q, q_t
