"""Fused fp8 quantisation for the grouped-GEMM layouts (one Triton kernel, any cell shape).

The grouped GEMMs need operands quantised in layouts a plain 2-D row quantiser does not give:

* the weight ``b[G, K, N]`` (or ``[G, N, K]``) in 128 x 128 tiles *per group*, rowwise per
  (group, output column), or in 1 x 128 runs along K, written K-major as ``[G, N, K]`` whatever
  the input layout (fp8 tensor cores want both MMA operands K-major);
* the wgrad operands ``x[T, m]`` with scales along the *tokens* (1 x 128 runs aligned to the global
  token index, or one scale per column over all tokens), written transposed ``[m, T]`` so that the
  token (reduction) dimension is contiguous for the MMA.

``quantize_cells`` views its input as ``x[G, R, C]`` (any strides) and cuts every ``[R, C]`` slice
into cells of ``cell_r x cell_c`` elements aligned at 0; each cell gets one float32 scale. A cell
size of 1 along a dimension means "no reduction there" (a row- or column-vector of cells). One
program owns whole cells: a first pass over its cells takes the amax, a second quantises (the
second pass mostly hits L1/L2). There are no atomics, so the result is deterministic.

The math is TORCH's (turbo_dispatch.low_precision.quantize), so both backends quantise alike:
``scale = amax / FP8_MAX`` clamped to the smallest normal float32, 1 for an all-zero cell;
``data = clamp(x / scale, -FP8_MAX, FP8_MAX)`` cast with round-to-nearest-even. Non-finite
inputs make their cell's scale non-finite (the amax is taken on the float bits, where NaN sorts
above inf), so the cell dequantises to NaN rather than hiding the overflow.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from turbo_dispatch.low_precision.dual_quantize import empty_padded_rows

from .interpret import interpreting

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_MANT_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
_MIN_EXP = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}  # exponent of the smallest normal
_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny


@triton.jit
def _round_to_fp8_grid(q, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round float32 ``q`` (already within +-FP8_MAX) to the nearest fp8 value, ties to even.

    Only for the CPU interpreter, whose float32 -> fp8 cast drops the carry when rounding up
    crosses a power of two (e.g. 127.9 -> 64 in e4m3); the cast of an exact fp8 value is right.
    ``q / ulp`` is below 2**(MANT_BITS + 1), so adding and subtracting 1.5 * 2**23 rounds it to an
    integer with float32's own round-to-nearest-even.
    """
    exp = (tl.abs(q).to(tl.int32, bitcast=True) >> 23) - 127
    exp = tl.maximum(exp, MIN_EXP)  # subnormals share the smallest normal's spacing
    ulp = ((exp - MANT_BITS + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2**23
    return ((q / ulp + magic) - magic) * ulp


@triton.jit
def _quantize_cells_kernel(
    x_ptr, q_ptr, s_ptr, scale_in_ptr,
    R, C, cell_r, cell_c, n_pr, n_pc,
    sxg, sxr, sxc, sqg, sqr, sqc, ssg, ssr, ssc,
    FP8_MAX: tl.constexpr, TINY: tl.constexpr, RED_R: tl.constexpr, RED_C: tl.constexpr,
    PRESCALED: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    ROUND_FIRST: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
):
    pid = tl.program_id(0)
    pc = pid % n_pc
    rest = pid // n_pc
    pr = rest % n_pr
    g = (rest // n_pr).to(tl.int64)
    # The rows (columns) this program owns: one whole cell along a reduced dimension, else BR (BC)
    # independent rows (columns).
    if RED_R:
        r0 = pr * cell_r
        r_end = tl.minimum(r0 + cell_r, R)
    else:
        r0 = pr * BR
        r_end = tl.minimum(r0 + BR, R)
    if RED_C:
        c0 = pc * cell_c
        c_end = tl.minimum(c0 + cell_c, C)
    else:
        c0 = pc * BC
        c_end = tl.minimum(c0 + BC, C)
    n_r = tl.cdiv(r_end - r0, BR)
    n_c = tl.cdiv(c_end - c0, BC)
    ar = tl.arange(0, BR)
    ac = tl.arange(0, BC)
    x_base = x_ptr + g * sxg
    if PRESCALED:
        scale = tl.load(scale_in_ptr) + tl.zeros((BR, BC), dtype=tl.float32)
    else:
        # amax on the float bits (abs clears the sign): integer order is float order for
        # non-negative floats, and NaN sorts above inf, so a NaN anywhere gives a NaN scale.
        bits = tl.zeros((BR, BC), dtype=tl.int32)
        for i in range(n_r):
            rr = r0 + i * BR + ar
            for j in range(n_c):
                cc = c0 + j * BC + ac
                ok = (rr < r_end)[:, None] & (cc < c_end)[None, :]
                v = tl.load(x_base + rr[:, None].to(tl.int64) * sxr + cc[None, :].to(tl.int64) * sxc, mask=ok,
                            other=0.0).to(tl.float32)
                bits = tl.maximum(bits, tl.abs(v).to(tl.int32, bitcast=True))
        if RED_R:
            bits = tl.max(bits, axis=0, keep_dims=True)
        if RED_C:
            bits = tl.max(bits, axis=1, keep_dims=True)
        amax = bits.to(tl.float32, bitcast=True)
        # div_rn: correctly rounded like torch's division (plain '/' may be approximate on GPUs).
        scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
        scale = tl.maximum(scale, TINY, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN
        scale = tl.where(amax == 0.0, 1.0, scale)
        scale = scale + tl.zeros((BR, BC), dtype=tl.float32)
        # One writer per cell: along a reduced dimension only lane 0 stores.
        if RED_R:
            s_r = pr + ar * 0
            w_r = ar == 0
        else:
            s_r = r0 + ar
            w_r = s_r < r_end
        if RED_C:
            s_c = pc + ac * 0
            w_c = ac == 0
        else:
            s_c = c0 + ac
            w_c = s_c < c_end
        tl.store(s_ptr + g * ssg + s_r[:, None].to(tl.int64) * ssr + s_c[None, :].to(tl.int64) * ssc, scale,
                 mask=w_r[:, None] & w_c[None, :])
    for i in range(n_r):
        rr = r0 + i * BR + ar
        for j in range(n_c):
            cc = c0 + j * BC + ac
            ok = (rr < r_end)[:, None] & (cc < c_end)[None, :]
            v = tl.load(x_base + rr[:, None].to(tl.int64) * sxr + cc[None, :].to(tl.int64) * sxc, mask=ok,
                        other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FP8_MAX), FP8_MAX)
            if ROUND_FIRST:
                q = _round_to_fp8_grid(q, MANT_BITS, MIN_EXP)
            tl.store(q_ptr + g * sqg + rr[:, None].to(tl.int64) * sqr + cc[None, :].to(tl.int64) * sqc,
                     q.to(q_ptr.dtype.element_ty), mask=ok)


def _pow2_at_most(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(max(1, n))))


def quantize_cells(x: torch.Tensor, dtype: torch.dtype, cell_r: int, cell_c: int, *,
                   scale: torch.Tensor | None = None, pad_c: int = 16,
                   scale_rows_inner: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x[G, R, C]`` (any strides) to ``dtype`` in ``cell_r x cell_c`` cells.

    Returns ``(data, scale)``: ``data`` is ``[G, R, C]`` fp8 whose rows are padded in memory to a
    multiple of ``pad_c`` elements (16 bytes: the row stride TMA descriptors need; the padding is
    never read), ``scale`` is float32 ``[G, nR, nC]`` with ``nR = ceil(R / cell_r)`` and
    ``nC = ceil(C / cell_c)``, contiguous (``scale_rows_inner``: stored ``[G, nC, nR]`` and returned
    as its ``[G, nR, nC]`` transposed view, so the scales of neighbouring rows sit side by side: the
    wgrad kernel loads one cell column for BM rows per step). Pass ``cell_r=R`` / ``cell_c=C`` to
    reduce a whole dimension. With ``scale`` (a 1-element float32 tensor, e.g. a tensorwise scale computed
    elsewhere) every element uses that one scale and the returned scale is that tensor.
    """
    if x.dim() != 3:
        raise ValueError(f"quantize_cells: x must be 3-D [G, R, C]; got shape {tuple(x.shape)}")
    if dtype not in FP8_MAX:
        raise ValueError(f"quantize_cells: dtype must be float8_e4m3fn or float8_e5m2; got {dtype}")
    g, r, c = x.shape
    if cell_r < 1 or cell_c < 1:
        raise ValueError(f"quantize_cells: cell sizes must be positive; got {cell_r} x {cell_c}")
    cell_r, cell_c = min(cell_r, max(r, 1)), min(cell_c, max(c, 1))
    data = empty_padded_rows(x, (g, r, c), dtype, pad_c)
    n_r, n_c = -(-r // cell_r), -(-c // cell_c)
    prescaled = scale is not None
    if prescaled:
        out_scale = scale
    elif scale_rows_inner:
        out_scale = torch.empty((g, n_c, n_r), dtype=torch.float32, device=x.device).transpose(1, 2)
    else:
        out_scale = torch.empty((g, n_r, n_c), dtype=torch.float32, device=x.device)
    if g * r * c == 0:
        return data, out_scale
    red_r, red_c = cell_r > 1, cell_c > 1
    # Tiles: 64 x 128 elements when both dimensions are free; narrower along a reduced dimension
    # whose cells are small, so the tile does not spill past one cell.
    br = _pow2_at_most(cell_r, 64) if red_r else (32 if red_c else 64)
    bc = _pow2_at_most(cell_c, 128) if red_c else 64
    if red_r and red_c:
        br, bc = _pow2_at_most(cell_r, 64), _pow2_at_most(cell_c, 64)
    n_pr = n_r if red_r else -(-r // br)
    n_pc = n_c if red_c else -(-c // bc)
    grid = (g * n_pr * n_pc,)
    s_strides = (0, 0, 0) if prescaled else out_scale.stride()
    _quantize_cells_kernel[grid](
        x, data, out_scale, out_scale if prescaled else x,
        r, c, cell_r, cell_c, n_pr, n_pc,
        *x.stride(), *data.stride(), *s_strides,
        FP8_MAX=FP8_MAX[dtype], TINY=_TINY, RED_R=red_r, RED_C=red_c, PRESCALED=prescaled, BR=br, BC=bc,
        ROUND_FIRST=interpreting(), MANT_BITS=_MANT_BITS[dtype],
        MIN_EXP=_MIN_EXP[dtype],
        num_warps=4,
    )
    return data, out_scale


def tensorwise_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """TORCH's tensorwise dequant scale of ``x`` as a 1-element float32 tensor (no host sync)."""
    amax = x.abs().amax().float().reshape(1) if x.numel() else torch.zeros(1, device=x.device)
    s = (amax / FP8_MAX[dtype]).clamp_min(_TINY)
    return torch.where(amax == 0, torch.ones_like(s), s)
