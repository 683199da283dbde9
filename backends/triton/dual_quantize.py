"""Two fp8 quantisations of one tensor from a single read (the blockwise training step's layouts).

A blockwise fp8 training step quantises each operand twice, once per GEMM that reads it:

* an activation or gradient ``x[T, C]`` in 1 x B runs along C (the forward or dgrad, which reduce
  over C) and in B x 1 runs along the tokens T (the wgrad, which reduces over T), the latter
  stored transposed ``[C, T]`` so that the tokens are contiguous for the K-major fp8 MMA;
* a weight ``w[G, R, C]`` in B x B tiles, stored as is for the forward and transposed
  ``[G, C, R]`` for the dgrad (fp8 wgmma reads both operands K-major, and the dgrad's K is the
  forward's N). Both copies share the tiles' scales.

Quantising twice reads the high-precision tensor twice (the bf16 read is two thirds of the
traffic); here one program loads a B x B tile once and writes both results. Every value is
computed as ``grouped_quantize.quantize_cells`` computes it (that is, as TORCH's
``turbo_dispatch.low_precision.quantize`` does), so the results are bit-identical to two separate
quantisations: ``scale = amax / FP8_MAX`` clamped to the smallest normal float32, 1 for an
all-zero cell, a NaN amax kept; ``data = clamp(x / scale, -FP8_MAX, FP8_MAX)``. Token runs are
aligned to the global token index, as quantize_cells aligns them.

Rows of every fp8 output are padded in memory to 16 bytes (the row stride TMA descriptors need);
the padding is never read.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from turbo_dispatch.low_precision.dual_quantize import (DUAL_BLOCK_SIZES, empty_padded_rows,
                                                       quantize_both_tensors_like)
from .interpret import interpreting as _interpreting
from .grouped_quantize import _MANT_BITS, _MIN_EXP, _TINY, FP8_MAX, _round_to_fp8_grid


@triton.jit
def _scale_of(amax, FP8_MAX: tl.constexpr, TINY: tl.constexpr):
    # div_rn: correctly rounded like torch's division (plain '/' may be approximate on GPUs).
    # The constant operand is built with where(), not tl.full, so that the Gluon kernel
    # (dual_quantize_gluon) can share this function: Gluon's full needs a layout.
    scale = tl.math.div_rn(amax, tl.where(amax == amax, FP8_MAX, FP8_MAX))
    scale = tl.maximum(scale, TINY, propagate_nan=tl.PropagateNan.ALL)
    return tl.where(amax == 0.0, 1.0, scale)


@triton.jit
def _quotient(v, scale):
    """``v / scale`` rounded exactly as ``div_rn`` rounds it, for ``scale`` of shape [n, 1], [1, n]
    or a scalar (one reciprocal each): q0 = v * RN(1/s) is within an ulp of the quotient, and one
    FMA step, q0 + RN(v - s * q0) * RN(1/s), is then correctly rounded (Markstein), as long as
    nothing underflows. Scales below 2**-60 (amaxes of subnormal-sized data) are first multiplied,
    with the values, by 2**64, which changes no quotient and keeps the residual normal. Division
    is most of this kernel's arithmetic: div_rn per element left it below the memory bandwidth.

    The step is written without a per-element select. The residual is formed negated,
    t = q0 * s - x, and added back as q0 - t * r: for x = +-0 both FMAs then end in a sum of two
    zeros of x's sign, so the quotient keeps the division's sign. A non-finite scale enters the
    residual as 0 (``s_res``): for s = inf, r = 0 and q0 = x * 0, and the step adds x * 0 to it,
    a zero of the same sign (NaN for x = inf, as inf / inf); for s = NaN, r is NaN and so is
    everything. Negations are products by -1.0: Triton's unary minus is 0 - x, which turns -0
    into +0 and costs an instruction, where x * -1.0 is exact and folds into the FMA.
    Both this and div_rn give the same bits; the CPU interpreter takes div_rn (``FAST_DIV``
    off), since its FMA is not fused."""
    k = tl.where(scale < 1.0e-18, 18446744073709551616.0, 1.0)
    r, s_res = _step_operands(scale * k)
    return _corrected_quotient(v * k, r, s_res)


@triton.jit
def _step_operands(s):
    """Per-scale operands of ``_corrected_quotient``: RN(1/s), and s with inf and NaN as 0."""
    r = tl.math.div_rn(tl.where(s == s, 1.0, 1.0), s)  # where(): see _scale_of
    return r, tl.where(s < float("inf"), s, 0.0)


@triton.jit
def _corrected_quotient(x, r, s_res):
    """x * r corrected by one FMA step to x / s rounded as div_rn rounds it (``_quotient``
    explains the step, its signs and its non-finite cases; the Gluon quantiser calls it on
    unscaled values where no scale is tiny)."""
    q0 = x * r
    return tl.fma(tl.fma(q0, s_res, x * -1.0) * -1.0, r, q0)


@triton.jit
def _to_fp8(v, scale, FP8_MAX: tl.constexpr, ROUND_FIRST: tl.constexpr, MANT_BITS: tl.constexpr,
            MIN_EXP: tl.constexpr, FAST_DIV: tl.constexpr):
    if FAST_DIV:
        q = _quotient(v, scale)
    else:
        q = tl.math.div_rn(v, scale)
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    if ROUND_FIRST:
        q = _round_to_fp8_grid(q, MANT_BITS, MIN_EXP)
    return q


@triton.jit
def _dual_quantize_kernel(
    x_ptr, q_ptr, qt_ptr, s_ptr, st_ptr,
    R, C, n_rb,
    sxg, sxr, sxc, sqg, sqr, sqtg, sqtc, ssg, ssr, ssc, stg, str_, stc,
    TILE_2D: tl.constexpr, B: tl.constexpr, CH: tl.constexpr, FP8_MAX: tl.constexpr, TINY: tl.constexpr,
    ROUND_FIRST: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, FAST_DIV: tl.constexpr,
    STORE_T: tl.constexpr = True,
):
    # One program owns one B x B tile and walks it in CH-row chunks twice: first for the amax of
    # each column (and of the tile), then to quantise, reloading each chunk (from L2: the tile was
    # just read). A whole tile held in registers needs ~200 per thread and one program per SM,
    # which left the kernel at a quarter of the memory bandwidth (H100, 8 warps).
    pid = tl.program_id(0)
    cb = tl.program_id(1)
    g = (pid // n_rb).to(tl.int64)
    rb = pid % n_rb
    cc = cb * B + tl.arange(0, B)
    c_ok = cc < C
    c64 = cc.to(tl.int64)
    x_base = x_ptr + g * sxg + c64[None, :] * sxc
    # amax on the float bits (abs clears the sign): integer order is float order for non-negative
    # floats, and NaN sorts above inf, so a NaN anywhere gives its cell a NaN scale.
    col_bits = tl.zeros((B,), dtype=tl.int32)
    for i in range(B // CH):
        rr = rb * B + i * CH + tl.arange(0, CH)
        ok = (rr < R)[:, None] & c_ok[None, :]
        v = tl.load(x_base + rr.to(tl.int64)[:, None] * sxr, mask=ok, other=0.0).to(tl.float32)
        col_bits = tl.maximum(col_bits, tl.max(tl.abs(v).to(tl.int32, bitcast=True), axis=0))
    if TILE_2D:
        scale = _scale_of(tl.max(col_bits, axis=0).to(tl.float32, bitcast=True), FP8_MAX, TINY)
        tl.store(s_ptr + g * ssg + rb * ssr + cb * ssc, scale)
    else:
        col_scale = _scale_of(col_bits.to(tl.float32, bitcast=True), FP8_MAX, TINY)  # [B] columns
        tl.store(st_ptr + g * stg + rb * str_ + c64 * stc, col_scale, mask=c_ok)
    for i in range(B // CH):
        rr = rb * B + i * CH + tl.arange(0, CH)
        r_ok = rr < R
        r64 = rr.to(tl.int64)
        ok = r_ok[:, None] & c_ok[None, :]
        v = tl.load(x_base + r64[:, None] * sxr, mask=ok, other=0.0).to(tl.float32)
        if TILE_2D:
            q = _to_fp8(v, scale, FP8_MAX, ROUND_FIRST, MANT_BITS, MIN_EXP, FAST_DIV)
            qt = q
        else:
            row_bits = tl.max(tl.abs(v).to(tl.int32, bitcast=True), axis=1)
            row_scale = _scale_of(row_bits.to(tl.float32, bitcast=True), FP8_MAX, TINY)  # [CH] rows
            tl.store(s_ptr + g * ssg + r64 * ssr + cb * ssc, row_scale, mask=r_ok)
            q = _to_fp8(v, row_scale[:, None], FP8_MAX, ROUND_FIRST, MANT_BITS, MIN_EXP, FAST_DIV)
            qt = _to_fp8(v, col_scale[None, :], FP8_MAX, ROUND_FIRST, MANT_BITS, MIN_EXP, FAST_DIV)
        tl.store(q_ptr + g * sqg + r64[:, None] * sqr + c64[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)
        if STORE_T:
            tl.store(qt_ptr + g * sqtg + c64[None, :] * sqtc + r64[:, None], qt.to(qt_ptr.dtype.element_ty),
                     mask=ok)


#: (rows per chunk, warps) of the one-read kernel for token runs (False) and 2-D tiles (True):
#: the fastest launch of an H100 sweep (docs/kernels.md).
LAUNCH = {False: (64, 4), True: (64, 4)}


def kernel_args(x, data, data_t, scale, scale_t, block: int) -> tuple:
    """The runtime arguments every dual-quantiser kernel takes (this module's and
    dual_quantize_gluon's), in their order: pointers, ``R, C``, row blocks, then the strides."""
    g, r, c = x.shape
    return (x, data, data_t, scale, scale_t, r, c, -(-r // block),
            *x.stride(), data.stride(0), data.stride(1), data_t.stride(0), data_t.stride(1),
            *scale.stride(), *scale_t.stride())


def prepare_dual_quantize(x: torch.Tensor, dtype: torch.dtype, block: int, tile_2d: bool):
    """``(dual_quantize(x, dtype, block, tile_2d), quantize)``: this call's result, and a function
    ``quantize(x)`` that gives ``dual_quantize``'s result for a later ``x`` with the same dtype,
    shape, strides, device and 16-byte alignment as this one (the caller's key holds them), with
    this call's launch resolved: outputs allocated as here, the kernel launched through its
    pre-bound plan. Where the environment switches the launch paths read (``launch_env``) have
    changed, or this call's kernel has no pre-bound plan, ``quantize`` is ``dual_quantize``."""
    outs, relaunch, env = _prepared(x, dtype, block, tile_2d)

    def unplanned(x):
        return dual_quantize(x, dtype, block, tile_2d)

    if relaunch is None:
        return outs, unplanned
    return outs, _relaunching(relaunch, env, lambda x: _dual_outputs(x, dtype, block, tile_2d), unplanned)


def prepare_runs_2d(x: torch.Tensor, dtype: torch.dtype, block: int):
    """``prepare_dual_quantize`` of a 2-D ``x[T, C]``'s token runs, as one group, with 2-D results
    ``(data [T, C], scale [T, n_c], data_t [C, T], scale_t [n_r, C])``: the 3-D results' only
    group, in the same storage. A later ``quantize(x)`` allocates them in that form and launches
    with the 2-D tensors (a launch reads their data pointers; its strides and the descriptor's
    shape are the plan's), so no call adds a dimension or selects one."""
    outs, relaunch, env = _prepared(x.unsqueeze(0), dtype, block, False)

    def unplanned(x):
        data, scale, data_t, scale_t = dual_quantize(x.unsqueeze(0), dtype, block, False)
        return data[0], scale[0], data_t[0], scale_t[0]

    first = tuple(t[0] for t in outs)
    if relaunch is None:
        return first, unplanned
    return first, _relaunching(relaunch, env, lambda x: quantize_both_tensors_like(x, dtype, block, False), unplanned)


def _relaunching(relaunch: Callable, env, outputs: Callable, unplanned: Callable) -> Callable:
    """``quantize(x)``: ``outputs(x)`` (data, scale, data_t, scale_t) filled through the pre-bound
    ``relaunch``, or ``unplanned(x)`` once the launch environment is no longer ``env``."""
    from .fp8_blockwise_gluon import launch_env

    def quantize(x):
        if launch_env() != env:
            return unplanned(x)
        outs = outputs(x)
        data, scale, data_t, scale_t = outs
        relaunch(x, data, data_t, scale, scale_t)
        return outs

    return quantize


def _prepared(x: torch.Tensor, dtype: torch.dtype, block: int, tile_2d: bool):
    """(``dual_quantize``'s result for ``x`` now, the pre-bound ``relaunch(x, data, data_t, scale,
    scale_t)`` or None, the ``launch_env`` it was made under)."""
    from .fp8_blockwise_gluon import launch_env

    _check_arguments(x, dtype, block)
    env = launch_env()
    g, r, c = x.shape
    if g * r * c and not _interpreting():
        from . import dual_quantize_gluon

        if dual_quantize_gluon.available(x, block) is None:
            outs = _dual_outputs(x, dtype, block, tile_2d)
            data, scale, data_t, scale_t = outs  # the kernels take them in another order
            relaunch = dual_quantize_gluon.prepare(x, data, data_t, scale, scale_t, FP8_MAX[dtype], _TINY, tile_2d)
            if relaunch is not None:
                return outs, relaunch, env
            return outs, None, env  # launched above, through the unprepared path
    return dual_quantize(x, dtype, block, tile_2d), None, env


def _check_arguments(x: torch.Tensor, dtype: torch.dtype, block: int) -> None:
    if x.dim() != 3:
        raise ValueError(f"dual_quantize: x must be 3-D [G, R, C]; got shape {tuple(x.shape)}")
    if dtype not in FP8_MAX:
        raise ValueError(f"dual_quantize: dtype must be float8_e4m3fn or float8_e5m2; got {dtype}")
    if block not in DUAL_BLOCK_SIZES:
        raise ValueError(f"dual_quantize: block must be one of {DUAL_BLOCK_SIZES}; got {block}")


def _dual_outputs(x: torch.Tensor, dtype: torch.dtype, block: int, tile_2d: bool):
    """``dual_quantize``'s uninitialised outputs (data, scale, data_t, scale_t) for ``x``."""
    g, r, c = x.shape
    n_r, n_c = -(-r // block), -(-c // block)
    data = empty_padded_rows(x, (g, r, c), dtype)
    data_t = empty_padded_rows(x, (g, c, r), dtype)
    if tile_2d:
        scale = torch.empty((g, n_r, n_c), dtype=torch.float32, device=x.device)
        return data, scale, data_t, scale.transpose(1, 2)
    # Row scales' rows padded to 16 floats: the Gluon runs kernel writes a strip of them per
    # row as one aligned vector store, padding included (never read).
    return (data, empty_padded_rows(x, (g, r, n_c), torch.float32), data_t,
            torch.empty((g, n_r, c), dtype=torch.float32, device=x.device))


def dual_quantize(x: torch.Tensor, dtype: torch.dtype, block: int, tile_2d: bool, *, gluon: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise ``x[G, R, C]`` (any strides) both ways in one pass; see the module docstring.

    The Gluon kernels (``dual_quantize_gluon``) serve the call where they can run (block 128,
    16-bit input, sm_90), since they are faster there; elsewhere, and with ``gluon=False`` (the
    GPU tests' comparison), this module's Triton kernel does.

    Returns ``(data, scale, data_t, scale_t)``:

    * ``data`` ``[G, R, C]`` fp8 (rows padded to 16 bytes);
    * ``data_t`` ``[G, C, R]`` fp8, the same values transposed (``tile_2d``) or quantised along R
      (rows padded to 16 bytes);
    * ``tile_2d``: ``scale`` is ``[G, nR, nC]``, one per tile, and ``scale_t`` is its
      ``[G, nC, nR]`` transposed view;
    * else ``scale`` ``[G, R, nC]`` (1 x block runs along C; rows padded in memory to 16
      floats) and ``scale_t`` ``[G, nR, C]`` (block x 1 runs along R, contiguous).

    >>> d, s, dt, st = dual_quantize(torch.randn(1, 300, 256), torch.float8_e4m3fn, 128, False)  # doctest: +SKIP
    >>> tuple(d.shape), tuple(s.shape), tuple(dt.shape), tuple(st.shape)  # doctest: +SKIP
    ((1, 300, 256), (1, 300, 2), (1, 256, 300), (1, 3, 256))
    """
    _check_arguments(x, dtype, block)
    g, r, c = x.shape
    n_r, n_c = -(-r // block), -(-c // block)
    data, scale, data_t, scale_t = _dual_outputs(x, dtype, block, tile_2d)
    if g * r * c == 0:
        return data, scale, data_t, scale_t
    interpreting = _interpreting()
    if gluon:
        from . import dual_quantize_gluon  # its available() also says no under the interpreter

        if dual_quantize_gluon.available(x, block) is None:
            dual_quantize_gluon.launch(x, data, data_t, scale, scale_t, FP8_MAX[dtype], _TINY, tile_2d)
            return data, scale, data_t, scale_t
    chunk, warps = LAUNCH[tile_2d]
    # A float32 weight's 2-D tiles get their transposed copy from the row copy by torch: on an
    # H100 (triton 3.6) the kernel's own transposed store of a float32 tile left every fourth row
    # of it wrong (rows 1 mod 4), whether stored through transposed pointers or from the tile
    # transposed first. The tiles share their values and scale, so the copy is exact. (16-bit
    # inputs and float32 token runs were right.)
    transpose_after = tile_2d and x.dtype == torch.float32 and x.is_cuda and not interpreting
    _dual_quantize_kernel[(g * n_r, n_c)](
        *kernel_args(x, data, data_t, scale, scale_t, block),
        TILE_2D=tile_2d, B=block, CH=min(chunk, block), FP8_MAX=FP8_MAX[dtype], TINY=_TINY,
        ROUND_FIRST=interpreting, MANT_BITS=_MANT_BITS[dtype], MIN_EXP=_MIN_EXP[dtype],
        FAST_DIV=not interpreting, STORE_T=not transpose_after, num_warps=warps,
    )
    if transpose_after:
        data_t.copy_(data.transpose(1, 2))
    return data, scale, data_t, scale_t
