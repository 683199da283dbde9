"""Fused producers of fp8 activations in Triton: RMSNorm + quantise and SwiGLU + quantise.

Each kernel computes its op in float32, rounds the result to the activation dtype (what the
unfused op would hand the GEMM), and quantises that rounded value with the scale rules of
``turbo_dispatch.low_precision.quantize``: so the fp8 data and scales equal ``quantize(out, ...)``
of the kernel's own high-precision output bit for bit, and differ from the unfused pair only
through the rounding of the op itself (a few ulps of the activation dtype). The quantiser steps
(``_scale_of``, ``_to_fp8``) are the ones of the fused quantiser, shared rather than restated so
that the two cannot drift apart; the amax is its NaN-propagating maximum (a NaN in a group makes
that group's scale NaN, as in the reference).

How a program walks its rows (``_plan``; docs/kernels.md has the byte counts):

* A recipe that needs a whole-row statistic before its first cast (RMSNorm's sum of squares,
  ROWWISE's amax) holds the row in registers when its power-of-two width fits ``SINGLE_MAX``
  elements (several rows per program for short ones): one read of the inputs, one write.
* Longer such rows take ``LONG_ROW_WARPS`` warps per row and walk it in ``LONG_ROW_CHUNK``-wide
  chunks, once per statistic and once to cast; every pass after the first re-reads the row,
  which the previous pass read moments before (from L2: each pass runs the opposite way to the
  one before, so the chunks read last are re-read first).
* A recipe with no row statistic (SwiGLU with 1-D BLOCKWISE scales, which finish chunk by
  chunk, or a cast with a known scale) streams: one pass, ``TILE`` elements per step.

Rows need not be powers of two: the walk takes whole chunks and then at most two power-of-two
tail pieces (18944 = 4 x 4096 + 2048 + 512), so no lanes idle beyond the last partial piece.

TENSORWISE needs the amax of the whole tensor before any cast: a first kernel computes the op
and max-reduces its amax into one float (an atomic per program); a second casts with that
amax's scale, reading the high-precision output when the caller asked for it (it was written
anyway) or recomputing the op from the inputs (fewer bytes than writing and re-reading a scratch
output: the inputs of RMSNorm are as wide as its output, SwiGLU's twice, against a write plus a
read).

The backwards ``rms_norm_backward`` and ``swiglu_backward`` are fused_producers_bwd's (Triton
kernels, one read of each input).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from turbo_dispatch.low_precision import FP8_MAX, QuantizedTensor, ScalingGranularity
from turbo_dispatch.low_precision.config import _coerce_enum

from .prebound import PreboundKernel
from .fused_producers_bwd import rms_norm_backward, serves, swiglu_backward
from .quantize import _cast_constants, _next_pow2, available

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["MAX_ROW", "available", "serves", "rms_norm_quantize", "swiglu_quantize", "rms_norm_backward",
           "swiglu_backward", "swiglu", "launches"]

#: The longest row served: column offsets are int32 inside the kernels.
MAX_ROW = 1 << 30
#: Elements of one input a streaming program (or a row-resident one with short rows) holds per
#: step, and how many of them each thread holds: 16 bf16 values are two 16-byte accesses per
#: tensor per thread, enough bytes in flight per SM for the copy rate with a few programs each.
TILE = 4096
ELEMS_PER_THREAD = 16
#: The widest (power-of-two padded) row held in registers: 8192 float32 values over 16 warps
#: are 16 per thread per live tensor, which fits without spills (tools/compile_sm90.py
#: ``fused_producers``).
SINGLE_MAX = 8192
#: Rows longer than SINGLE_MAX that need a row statistic: one program of LONG_ROW_WARPS warps per
#: row walks LONG_ROW_CHUNK columns per step. Many warps per row keep few rows resident per SM (at
#: most 64 / 16 = 4), so the rows that passes re-read stay few enough for L2 (528 rows of
#: SwiGLU's 2 x 2 x 18944 bytes = 40 MB on 132 SMs, H200 L2 50 MB).
LONG_ROW_CHUNK = 4096
LONG_ROW_WARPS = 16

_MODE_ROW = 0
_MODE_BLOCK = 1
_MODE_TENSOR_AMAX = 2  # TENSORWISE pass 1: max-reduce |out| into amax_ptr[0] (and write out if asked)
_MODE_TENSOR_CAST = 3  # TENSORWISE pass 2: cast with the scale of amax_ptr[0]
_OP_RMS_NORM = 0
_OP_SWIGLU = 1

if triton is not None:
    from .quantize import _scale_of, _to_fp8

    @triton.jit
    def _max_nan(a, b):
        """Elementwise max that keeps a NaN of either side (the amax's combination)."""
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _amax_along(v, AXIS: tl.constexpr):
        """Max of ``v`` (abs values: >= 0 or a NaN with its sign bit clear) along AXIS, NaN if any
        is NaN: the quantiser's ``_nan_max`` in one integer max per element instead of a flag per
        element. As int32 such floats order as their values do, and every NaN above +inf."""
        return tl.max(v.to(tl.int32, bitcast=True), AXIS).to(tl.float32, bitcast=True)

    @triton.jit
    def _piece_cols(c0, P: tl.constexpr, BS: tl.constexpr, BLOCKED: tl.constexpr):
        """Columns c0 .. c0 + P of a row as a [1, P // BS, BS] tile (BLOCKED: one scaling block per
        middle index) or [1, 1, P]."""
        if BLOCKED:
            cols = c0 + tl.arange(0, P // BS)[:, None] * BS + tl.arange(0, BS)[None, :]
        else:
            cols = c0 + tl.arange(0, P)[None, :]
        return cols[None, :, :]

    @triton.jit
    def _load_op_inputs(a_ptr, b_ptr, r64, cols, mask, sa, sb, N, OP: tl.constexpr, EVICT: tl.constexpr):
        """The op's two inputs on a tile, float32, zero outside ``mask``: (x, norm weight
        [1, K, B]) for RMSNorm, (gate, up) for SwiGLU."""
        a = tl.load(a_ptr + r64[:, None, None] * sa + cols, mask=mask, other=0.0, eviction_policy=EVICT)
        if OP == 0:
            b = tl.load(b_ptr + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
        else:
            b = tl.load(b_ptr + r64[:, None, None] * sb + cols, mask=mask, other=0.0, eviction_policy=EVICT)
        return a.to(tl.float32), b.to(tl.float32)

    @triton.jit
    def _op_out(a, b, rstd, out_ty, OP: tl.constexpr):
        """The op on float32 inputs, rounded to ``out_ty``.

        RMSNorm: x * rstd * w. SwiGLU: silu(gate) * up with silu rounded to out's dtype before the
        product, as ``F.silu(gate) * up`` rounds it; silu's division is the fast one (2 ulp of
        float32 before that rounding): a correctly rounded one costs more instructions than the
        whole rest of the element's work at the copy rate."""
        if OP == 0:
            return (a * rstd[:, None, None] * b).to(out_ty)
        s = tl.fdiv(a, 1.0 + tl.exp(-a)).to(out_ty).to(tl.float32)
        return (s * b).to(out_ty)

    @triton.jit
    def _rstd_of(sumsq, rmask, N, eps):
        """1 / sqrt(mean(x^2) + eps) per row; 0 for rows past M (an eps of 0 would make them inf
        and their zeros NaN, which the TENSORWISE amax would take)."""
        return tl.where(rmask, 1.0 / tl.sqrt_rn(sumsq / N + eps), 0.0)

    @triton.jit
    def _sumsq_piece(a_ptr, r64, rmask, c0, N, sa, P: tl.constexpr, BS: tl.constexpr, BLOCKED: tl.constexpr):
        cols = _piece_cols(c0, P, BS, BLOCKED)
        a = tl.load(a_ptr + r64[:, None, None] * sa + cols, mask=rmask[:, None, None] & (cols < N), other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
        return tl.sum(tl.sum(a * a, 2), 1)

    @triton.jit
    def _out_piece(a_ptr, b_ptr, out_ptr, r64, cols, mask, N, sa, sb, so, rstd, OP: tl.constexpr,
                   FROM_OUT: tl.constexpr, WRITE_OUT: tl.constexpr, EVICT: tl.constexpr):
        """The op's rounded output on a tile: read back from ``out_ptr`` (FROM_OUT) or computed
        from the inputs (and written to ``out_ptr`` if WRITE_OUT)."""
        if FROM_OUT:
            y = tl.load(out_ptr + r64[:, None, None] * so + cols, mask=mask, other=0.0, eviction_policy=EVICT)
        else:
            a, b = _load_op_inputs(a_ptr, b_ptr, r64, cols, mask, sa, sb, N, OP, EVICT)
            y = _op_out(a, b, rstd, out_ptr.dtype.element_ty, OP)
            if WRITE_OUT:
                tl.store(out_ptr + r64[:, None, None] * so + cols, y, mask=mask)
        return y

    @triton.jit
    def _amax_piece(a_ptr, b_ptr, out_ptr, r64, rmask, c0, N, sa, sb, so, rstd, OP: tl.constexpr,
                    WRITE_OUT: tl.constexpr, P: tl.constexpr):
        """Row amax of the op's output on columns c0 .. c0 + P (written to out if WRITE_OUT)."""
        cols = _piece_cols(c0, P, 1, False)
        mask = rmask[:, None, None] & (cols < N)
        y = _out_piece(a_ptr, b_ptr, out_ptr, r64, cols, mask, N, sa, sb, so, rstd, OP, False, WRITE_OUT,
                       "evict_last")
        return _amax_along(_amax_along(tl.abs(y.to(tl.float32)), 2), 1)

    @triton.jit
    def _quantize_tile(y, data_ptr, scale_ptr, r64, rmask, cols, mask, c0, N, sd, ss, scale,
                       MODE: tl.constexpr, BS: tl.constexpr, FP8_MAX_: tl.constexpr, TINY: tl.constexpr,
                       EMULATE_CAST: tl.constexpr, MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                       RECIP: tl.constexpr):
        """Casts the tile ``y`` [R, K, B] into data with ``scale`` [R] (ROW, TENSOR_CAST) or, for
        BLOCK, one scale per [r, k] block (B = BS columns), which it also stores."""
        yf = y.to(tl.float32)
        if MODE == 1:
            block_scale = _scale_of(_amax_along(tl.abs(yf), 2), FP8_MAX_, TINY, RECIP)  # [R, K]
            kb = c0 // BS + tl.arange(0, yf.shape[1])
            tl.store(scale_ptr + r64[:, None] * ss + kb[None, :], block_scale,
                     mask=rmask[:, None] & (kb * BS < N)[None, :])
            q = _to_fp8(tl.math.div_rn(yf, block_scale[:, :, None]), data_ptr, FP8_MAX_, EMULATE_CAST, MAN_BITS,
                        MIN_EXP)
        else:
            q = _to_fp8(tl.math.div_rn(yf, scale[:, None, None]), data_ptr, FP8_MAX_, EMULATE_CAST, MAN_BITS,
                        MIN_EXP)
        tl.store(data_ptr + r64[:, None, None] * sd + cols, q, mask=mask)

    @triton.jit
    def _rows_amax_taken(amax, amax_ptr, scale_ptr, r64, rmask, ss, MODE: tl.constexpr, FP8_MAX_: tl.constexpr,
                         TINY: tl.constexpr, RECIP: tl.constexpr):
        """The rows' amax [ROWS] is complete: TENSOR_AMAX max-reduces it into amax_ptr[0] (an
        atomic per program), ROW stores the rows' scales and returns them."""
        scale = amax
        if MODE == 2:
            tl.atomic_max(amax_ptr, _amax_along(amax, 0))
        else:
            scale = _scale_of(amax, FP8_MAX_, TINY, RECIP)
            tl.store(scale_ptr + r64 * ss, scale, mask=rmask)
        return scale

    @triton.jit
    def _cast_piece(a_ptr, b_ptr, out_ptr, data_ptr, scale_ptr, r64, rmask, c0, N, sa, sb, so, sd, ss, rstd, scale,
                    OP: tl.constexpr, MODE: tl.constexpr, FROM_OUT: tl.constexpr, WRITE_OUT: tl.constexpr,
                    P: tl.constexpr, BS: tl.constexpr, FP8_MAX_: tl.constexpr, TINY: tl.constexpr,
                    EMULATE_CAST: tl.constexpr, MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                    RECIP: tl.constexpr):
        """The op's output on columns c0 .. c0 + P, cast to fp8 (the last pass over them)."""
        cols = _piece_cols(c0, P, BS, MODE == 1)
        mask = rmask[:, None, None] & (cols < N)
        y = _out_piece(a_ptr, b_ptr, out_ptr, r64, cols, mask, N, sa, sb, so, rstd, OP, FROM_OUT, WRITE_OUT,
                       "evict_first")
        _quantize_tile(y, data_ptr, scale_ptr, r64, rmask, cols, mask, c0, N, sd, ss, scale, MODE, BS, FP8_MAX_,
                       TINY, EMULATE_CAST, MAN_BITS, MIN_EXP, RECIP)

    @triton.jit
    def _producer_kernel(a_ptr, b_ptr, out_ptr, data_ptr, scale_ptr, amax_ptr, M, N, n_full, sa, sb, so, sd, ss,
                         eps, OP: tl.constexpr, MODE: tl.constexpr, WRITE_OUT: tl.constexpr,
                         FROM_OUT: tl.constexpr, SINGLE: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
                         TAIL1: tl.constexpr, TAIL2: tl.constexpr, BS: tl.constexpr, FP8_MAX_: tl.constexpr,
                         TINY: tl.constexpr, EMULATE_CAST: tl.constexpr, MAN_BITS: tl.constexpr,
                         MIN_EXP: tl.constexpr, RECIP: tl.constexpr):
        """Rows ``pid * ROWS ..`` of the op, rounded to out's dtype, and their fp8.

        OP == _OP_RMS_NORM: a = x, b = the norm weight, out = x * rsqrt(mean(x^2) + eps) * w.
        OP == _OP_SWIGLU: a = gate, b = up, out = silu(gate) * up.
        SINGLE: one [ROWS, CHUNK] tile holds the rows (CHUNK >= N). Otherwise the row is walked as
        ``n_full`` chunks of CHUNK columns and tail pieces of TAIL1 and TAIL2 (0: none), once
        for the sum of squares (RMSNorm, unless FROM_OUT), once for the amax (ROW, TENSOR_AMAX)
        and once to cast (all modes but TENSOR_AMAX). FROM_OUT reads the op's output back from
        out instead of recomputing it (the caller or an earlier pass wrote it)."""
        pid = tl.program_id(0)
        rows = pid * ROWS + tl.arange(0, ROWS)
        rmask = rows < M
        r64 = rows.to(tl.int64)
        rstd = tl.zeros([ROWS], dtype=tl.float32)
        scale = tl.zeros([ROWS], dtype=tl.float32)
        if MODE == 3:
            # One amax for the tensor, loaded by every row lane so the scale is a vector like ROW's.
            scale = _scale_of(tl.load(amax_ptr + rows * 0), FP8_MAX_, TINY, RECIP)
            if pid == 0:
                tl.store(scale_ptr + rows * 0, scale, mask=rows == 0)
        if SINGLE:
            cols = _piece_cols(0, CHUNK, BS, MODE == 1)
            mask = rmask[:, None, None] & (cols < N)
            if FROM_OUT:
                y = tl.load(out_ptr + r64[:, None, None] * so + cols, mask=mask, other=0.0,
                            eviction_policy="evict_first")
            else:
                a, b = _load_op_inputs(a_ptr, b_ptr, r64, cols, mask, sa, sb, N, OP, "evict_first")
                if OP == 0:
                    rstd = _rstd_of(tl.sum(tl.sum(a * a, 2), 1), rmask, N, eps)
                y = _op_out(a, b, rstd, out_ptr.dtype.element_ty, OP)
                if WRITE_OUT:
                    tl.store(out_ptr + r64[:, None, None] * so + cols, y, mask=mask)
            if MODE == 0 or MODE == 2:
                amax = _amax_along(_amax_along(tl.abs(y.to(tl.float32)), 2), 1)
                scale = _rows_amax_taken(amax, amax_ptr, scale_ptr, r64, rmask, ss, MODE, FP8_MAX_, TINY, RECIP)
            if MODE != 2:
                _quantize_tile(y, data_ptr, scale_ptr, r64, rmask, cols, mask, 0, N, sd, ss, scale, MODE, BS,
                               FP8_MAX_, TINY, EMULATE_CAST, MAN_BITS, MIN_EXP, RECIP)
        else:
            tail0 = n_full * CHUNK
            if OP == 0 and not FROM_OUT:
                # Forwards, keeping the row in L2 for the passes after it.
                acc = tl.zeros([ROWS], dtype=tl.float32)
                for i in range(n_full):
                    acc += _sumsq_piece(a_ptr, r64, rmask, i * CHUNK, N, sa, CHUNK, 1, False)
                if TAIL1 > 0:
                    acc += _sumsq_piece(a_ptr, r64, rmask, tail0, N, sa, TAIL1, 1, False)
                if TAIL2 > 0:
                    acc += _sumsq_piece(a_ptr, r64, rmask, tail0 + TAIL1, N, sa, TAIL2, 1, False)
                rstd = _rstd_of(acc, rmask, N, eps)
            if MODE == 0 or MODE == 2:
                # Backwards: the chunks the pass before read last are still in L2.
                amax = tl.zeros([ROWS], dtype=tl.float32)
                if TAIL2 > 0:
                    amax = _max_nan(amax, _amax_piece(a_ptr, b_ptr, out_ptr, r64, rmask, tail0 + TAIL1, N, sa, sb, so,
                                                      rstd, OP, WRITE_OUT, TAIL2))
                if TAIL1 > 0:
                    amax = _max_nan(amax, _amax_piece(a_ptr, b_ptr, out_ptr, r64, rmask, tail0, N, sa, sb, so, rstd,
                                                      OP, WRITE_OUT, TAIL1))
                for j in range(n_full):
                    amax = _max_nan(amax, _amax_piece(a_ptr, b_ptr, out_ptr, r64, rmask, (n_full - 1 - j) * CHUNK, N,
                                                      sa, sb, so, rstd, OP, WRITE_OUT, CHUNK))
                scale = _rows_amax_taken(amax, amax_ptr, scale_ptr, r64, rmask, ss, MODE, FP8_MAX_, TINY, RECIP)
            if MODE != 2:
                # ROW wrote out in its amax pass (if asked): read it back rather than recompute.
                from_out: tl.constexpr = FROM_OUT or (MODE == 0 and WRITE_OUT)
                write_out: tl.constexpr = WRITE_OUT and not from_out
                if from_out:
                    tl.debug_barrier()  # out was written by other threads of this program
                for i in range(n_full):
                    _cast_piece(a_ptr, b_ptr, out_ptr, data_ptr, scale_ptr, r64, rmask, i * CHUNK, N, sa, sb, so, sd,
                                ss, rstd, scale, OP, MODE, from_out, write_out, CHUNK, BS, FP8_MAX_, TINY,
                                EMULATE_CAST, MAN_BITS, MIN_EXP, RECIP)
                if TAIL1 > 0:
                    _cast_piece(a_ptr, b_ptr, out_ptr, data_ptr, scale_ptr, r64, rmask, tail0, N, sa, sb, so, sd, ss,
                                rstd, scale, OP, MODE, from_out, write_out, TAIL1, BS, FP8_MAX_, TINY, EMULATE_CAST,
                                MAN_BITS, MIN_EXP, RECIP)
                if TAIL2 > 0:
                    _cast_piece(a_ptr, b_ptr, out_ptr, data_ptr, scale_ptr, r64, rmask, tail0 + TAIL1, N, sa, sb, so,
                                sd, ss, rstd, scale, OP, MODE, from_out, write_out, TAIL2, BS, FP8_MAX_, TINY,
                                EMULATE_CAST, MAN_BITS, MIN_EXP, RECIP)


_LAUNCHER = (PreboundKernel(_producer_kernel, per_call=("a_ptr", "b_ptr", "out_ptr", "data_ptr", "scale_ptr",
                                                         "amax_ptr")) if triton is not None else None)

#: Columns per program of the unquantised SwiGLU: 8 warps of 16-byte bf16 vectors, twice over.
SWIGLU_BLOCK = 2048

if triton is not None:

    @triton.jit
    def _swiglu_kernel(g_ptr, u_ptr, h_ptr, F, sg, su, sh, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        g = tl.load(g_ptr + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * sh + cols, _op_out(g, u, 0.0, h_ptr.dtype.element_ty, 1), mask=mask)

    _SWIGLU_LAUNCHER = PreboundKernel(_swiglu_kernel, per_call=("g_ptr", "u_ptr", "h_ptr"))


class Plan(NamedTuple):
    """How one launch walks a row (see the module docstring): ``single`` (the row in registers,
    ``chunk`` = its padded width), ``rows`` per program, ``chunk`` columns per step, ``n_full``
    whole chunks then tail pieces ``tail1``, ``tail2`` (0: none), ``warps`` per program."""
    single: bool
    rows: int
    chunk: int
    n_full: int
    tail1: int
    tail2: int
    warps: int


def _prev_pow2(v: int) -> int:
    return 1 << (v.bit_length() - 1)


def _warps_for(elems: int) -> int:
    """Warps that give each thread ELEMS_PER_THREAD of ``elems`` (1 to 16)."""
    return max(1, min(16, elems // (32 * ELEMS_PER_THREAD)))


def _plan(n: int, unit: int, row_statistic: bool) -> Plan:
    """The walk over rows of ``n`` elements whose pieces are multiples of ``unit`` (the 1-D block,
    or 1); ``row_statistic``: the launch needs a whole-row statistic before it writes (then the
    row is held in registers up to SINGLE_MAX, else walked by one program per row); otherwise it
    streams, in chunks of the largest power of two dividing ``n`` (up to TILE, from 512: no
    idle lanes for 3584 = 7 x 512 or 14336 = 7 x 2048) and as many rows as fill TILE."""
    if row_statistic:
        width = max(_next_pow2(n), unit)
        if width <= SINGLE_MAX:
            rows = max(1, TILE // width)
            return Plan(True, rows, width, 0, 0, 0, _warps_for(rows * width))
        rows, chunk, warps = 1, max(LONG_ROW_CHUNK, unit), LONG_ROW_WARPS
    else:
        divisor = n & -n
        chunk = max(min(TILE, divisor if divisor >= 512 else _prev_pow2(n)), unit)
        rows = max(1, TILE // chunk)
        warps = _warps_for(rows * chunk)
    n_full, rem = divmod(n, chunk)
    tail1 = tail2 = 0
    if rem:
        tail1 = max(_prev_pow2(rem), unit)
        if rem > tail1:
            tail2 = max(_next_pow2(rem - tail1), unit)
    return Plan(False, rows, chunk, n_full, tail1, tail2, warps)


class Launch(NamedTuple):
    """One kernel launch: its grid, the per-call tensors (``_LAUNCHER.per_call`` order), the
    fixed arguments and the options (``num_warps``). tools/compile_sm90.py compiles these."""
    grid: tuple
    tensors: tuple
    fixed: dict
    options: dict


def _check_recipe(n: int, dtype: torch.dtype, granularity, block_size: Optional[int], who: str) -> ScalingGranularity:
    gran = _coerce_enum(ScalingGranularity, granularity, "granularity", who)
    if dtype not in FP8_MAX:
        raise ValueError(f"{who}: dtype must be torch.float8_e4m3fn or torch.float8_e5m2; got {dtype}")
    if not 0 < n <= MAX_ROW:
        raise ValueError(f"{who}: rows must hold 1 to {MAX_ROW} elements; got {n}")
    if gran is ScalingGranularity.BLOCKWISE:
        if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"{who}: BLOCKWISE needs a power-of-two block_size; got {block_size!r}")
    elif gran not in (ScalingGranularity.ROWWISE, ScalingGranularity.TENSORWISE):
        raise ValueError(f"{who}: granularity {gran.name} is not served (TENSORWISE, ROWWISE, BLOCKWISE are)")
    return gran


def launches(op: int, a: torch.Tensor, b: torch.Tensor, sb: int, eps: float, out: torch.Tensor, data: torch.Tensor,
             scale: torch.Tensor, amax: torch.Tensor, gran: ScalingGranularity, block_size: Optional[int],
             write_out: bool) -> list[Launch]:
    """The launches that produce ``data``/``scale`` (and ``out`` if ``write_out``) from ``a``, ``b``
    (``amax``: a zeroed float32 [1] under TENSORWISE). ``out`` must be a tensor of a's dtype even
    when not written (the kernel rounds to its dtype)."""
    m, n = a.shape
    common = dict(M=m, N=n, sa=a.stride(0), sb=sb, so=out.stride(0) if out.dim() == 2 else 0, sd=data.stride(0),
                  ss=scale.stride(0) if scale.dim() else 0, eps=eps, OP=op, **_cast_constants(data.dtype))
    tensors = (a, b, out, data, scale, amax)
    rms = op == _OP_RMS_NORM

    def one(mode: int, plan: Plan, write: bool, from_out: bool, bs: int) -> Launch:
        fixed = dict(common, n_full=plan.n_full, MODE=mode, WRITE_OUT=write, FROM_OUT=from_out, SINGLE=plan.single,
                     ROWS=plan.rows, CHUNK=plan.chunk, TAIL1=plan.tail1, TAIL2=plan.tail2, BS=bs)
        return Launch((triton.cdiv(m, plan.rows),), tensors, fixed, dict(num_warps=plan.warps))

    if gran is ScalingGranularity.BLOCKWISE:
        return [one(_MODE_BLOCK, _plan(n, block_size, rms), write_out, False, block_size)]
    if gran is ScalingGranularity.ROWWISE:
        return [one(_MODE_ROW, _plan(n, 1, True), write_out, False, 1)]
    # TENSORWISE: the amax pass, then the cast from out (written anyway) or from the inputs again
    # under the same plan (so that RMSNorm's row sums, hence its output, repeat bit for bit).
    first = _plan(n, 1, rms)
    cast = one(_MODE_TENSOR_CAST, _plan(n, 1, False), False, True, 1) if write_out else \
        one(_MODE_TENSOR_CAST, first, False, False, 1)
    return [one(_MODE_TENSOR_AMAX, first, write_out, False, 1), cast]


def _produce(op: int, a: torch.Tensor, b: torch.Tensor, sb: int, eps: float, dtype: torch.dtype,
             gran: ScalingGranularity, block_size: Optional[int], return_out: bool
             ) -> tuple[QuantizedTensor, Optional[torch.Tensor]]:
    """Runs the producer over ``a``'s rows; the QuantizedTensor and ``out`` if asked."""
    m, n = a.shape
    dev = a.device
    out = torch.empty(m, n, dtype=a.dtype, device=dev) if return_out else torch.empty(1, dtype=a.dtype, device=dev)
    data = torch.empty(m, n, dtype=dtype, device=dev)
    tensorwise = gran is ScalingGranularity.TENSORWISE
    if tensorwise:
        scale = torch.empty((), dtype=torch.float32, device=dev)
        amax = torch.zeros(1, dtype=torch.float32, device=dev)
    else:
        cols = -(-n // block_size) if gran is ScalingGranularity.BLOCKWISE else 1
        scale = torch.empty(m, cols, dtype=torch.float32, device=dev)
        amax = scale
    if m:
        for launch in launches(op, a, b, sb, eps, out, data, scale, amax, gran, block_size, return_out):
            _LAUNCHER.launch(launch.grid, launch.tensors, launch.fixed, launch.options)
    elif tensorwise:
        scale.fill_(1.0)  # the scale of an all-zero (here: empty) tensor
    q = QuantizedTensor(data=data, scale=scale, granularity=gran, axis=1,
                        block_size=block_size if gran is ScalingGranularity.BLOCKWISE else None, block_2d=False,
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
    output; ``out`` is written and returned only when ``return_out`` (without it ``q`` is what
    it would have been). For M = 0 the TENSORWISE scale is 1. Raises ValueError for recipes or
    shapes it does not serve.
    """
    _check_2d("rms_norm_quantize", x=x)
    gran = _check_recipe(x.shape[1], dtype, granularity, block_size, "rms_norm_quantize")
    if weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"rms_norm_quantize: weight must be contiguous of shape ({x.shape[1]},); got "
                         f"{tuple(weight.shape)}")
    return _produce(_OP_RMS_NORM, x, weight, 0, float(eps), dtype, gran, block_size, return_out)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``h = silu(gate) * up`` for ``gate, up [M, F]`` of one dtype (views of one ``[M, 2F]``
    projection are fine: only the last stride must be 1), unquantised: one read of each input and
    one write, silu rounded to the dtype before the product as ``F.silu(gate) * up`` rounds it
    (its division the fast one, as in ``swiglu_quantize``). A fresh contiguous ``[M, F]`` tensor;
    its backward is ``swiglu_backward``."""
    _check_2d("swiglu", gate=gate, up=up)
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"swiglu: gate and up must match; got {gate.dtype}{tuple(gate.shape)} on {gate.device} "
                         f"and {up.dtype}{tuple(up.shape)} on {up.device}")
    gate, up = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate, up))
    m, f = gate.shape
    h = torch.empty((m, f), dtype=gate.dtype, device=gate.device)
    if m and f:
        _SWIGLU_LAUNCHER.launch((m, triton.cdiv(f, SWIGLU_BLOCK)), (gate, up, h),
                                dict(F=f, sg=gate.stride(0), su=up.stride(0), sh=f, BLOCK=SWIGLU_BLOCK),
                                dict(num_warps=8))
    return h


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
    gran = _check_recipe(gate.shape[1], dtype, granularity, block_size, "swiglu_quantize")
    return _produce(_OP_SWIGLU, gate, up, up.stride(0), 0.0, dtype, gran, block_size, return_out)
