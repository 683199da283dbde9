"""The dual blockwise fp8 quantiser (``dual_quantize``) in Gluon, block 128, Hopper: two kernels.

``_dual_quantize_regs_kernel`` (2-D tiles, the default there; token runs as an option) keeps the
whole 128 x 128 tile in registers, each thread holding 16 consecutive rows x 8 columns: the
16-byte row pieces load coalesced and each of its columns leaves the transposed copy as one
16-byte store, so no shared-memory tile at all. Moving the values to the rows-first register
order is a renaming (a linear layout with the same lanes and warps, ``register_layouts``); the
float32 values are renamed and the fp8 bytes packed after it, because renaming the packed fp8
bytes gave a wrong transposed copy under triton 3.6 at contiguous, 16-row-aligned operands
(round 67; the GPU test now covers that case). Its quotient is ``_quotient``'s without a branch
on tiny scales (``_g_quotient_of``). H100 (rounds 66-67, with the fp8 bytes renamed, i.e. before
that fix; the fixed kernel has not been timed alone): 2-D tiles 0.097 ms geomean against 0.119 for
the Triton kernel (DeepSeek-V3's weight 0.351 vs 0.464 ms, 2.67 TB/s). For token runs
it needs the row and column scales of the tile in every thread and more registers (157-255,
one or two programs per SM); its best runs launch, two 64-column pieces at (8, 4), measured 0.205
against 0.212 ms for the shared-memory kernel in the same run (round 67), inside run-to-run
noise, so runs stay on the shared-memory kernel below.

``_dual_quantize_gluon_kernel``, the token-run default:

Same contract and the same bits as ``dual_quantize._dual_quantize_kernel`` with ``TILE_2D`` off;
what differs is the transpose. The transposed copy ``[C, R]`` needs each thread to hold consecutive *rows* of the
tile while the coalesced load gives it consecutive *columns*. In plain Triton that exchange is a
layout conversion the compiler places on the fp8 bytes (byte-wide shared-memory stores, 255
registers, 2 programs per SM: 1.3-1.5 TB/s on an H100) or, given a second load laid out
``[columns, rows]``, a third read of the tile that made L1/L2 the bound instead.

Here each program reads its 128 x 128 bf16 tile from global memory once, in row chunks, and
keeps it in shared memory (32 KiB, unswizzled: a warp stores whole 16-byte row segments and, for
the transposed pass, reads 32 consecutive columns of one row per instruction, so neither side has
bank conflicts). Row runs are quantised straight from registers as the chunks arrive; the column
runs are quantised from the shared copy, read column-major, each thread holding 16 consecutive
rows of one column so the fp8 copy leaves in 16-byte stores, two threads filling each 32-byte
sector.

Measured (H100, tools/gpu_round43.sh, median of 20, host issue time covered): DeepSeek-V3 x
[32768, 7168] 0.515 ms against 0.615 ms for the Triton kernel in the same run (1.83 TB/s of bf16
read + fp8 written); Qwen3 down gradient [65536, 2048] 0.300 vs 0.359 ms; geomean over four
operands 0.213 vs 0.255 ms. For 2-D tiles this design was slower than the Triton kernel (round
36), so ``dual_quantize`` keeps tiles there.

The quotient is ``_quotient``'s, in a lean form where no scale of the row or column block is
below its rescaling threshold (``_g_to_fp8``): no per-element rescaling, and no upper clamp, which
sm_90's saturating fp8 conversion already applies.

Where the time goes (ncu, H100, DeepSeek-V3 x, round 42): 1.84 TB/s of DRAM traffic (55% of
peak; torch's clone of the same tensor ran at 3.0 TB/s in round 41), L1/shared memory 80% busy,
0.42 instructions issued per scheduler per cycle at 20 warps per SM. Tried and not adopted (rounds 39-43, same
GPU, the code is in commit b12bb73): a persistent kernel that keeps the next tiles in flight by
cp.async (0.210-0.215 ms geomean against 0.212-0.214 for this one), this kernel with its whole
tile brought in by cp.async (0.212), the transposed pass reading 2, 4 or 8 columns per
shared-memory load (0.233-0.297: fewer, wider loads, but more registers and fewer programs per
SM), and launching column blocks fastest (0.208-0.211, within noise). Round 47: 8 threads of a
warp along the columns of the transposed pass, which the compiler turns into ldmatrix.trans
reads (16 per thread instead of 128 two-byte loads) and full 32-byte fp8 sectors, ran at 0.246
ms against 0.213 (128 registers, 4 programs per SM), and the EP8 whole op fell from 1.086x to
1.067x bf16 with it; 32 threads along the columns (conflict-free two-byte reads) 0.237.

Needs Gluon (triton >= 3.6) and an sm_90 GPU; the interpreter does not run Gluon, so
``dual_quantize`` falls back to the Triton kernel there (``available``).
"""
from __future__ import annotations

import functools

import torch

from .dual_quantize import kernel_args
from .fp8_blockwise_gluon import available as _gluon_available

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - triton without Gluon
    gluon = None

#: The quantisation block this kernel is laid out for (its layouts cover 128 columns).
BLOCK = 128
#: (rows per chunk of the global read, rows per chunk of the transposed pass, warps): the best
#: geomean of the sweep (tools/probe_grouped_step.py --sweep, H100, lean quotient, rounds 40-43:
#: 0.212-0.214 ms against 0.229-0.231 for (64, 32, 4); 96 registers, 5 programs per SM). Round
#: 36, before the lean quotient, had preferred (64, 32, 4).
LAUNCH = (32, 32, 4)
#: Which kernel quantises token runs: "smem" (``_dual_quantize_gluon_kernel``, the tile staged in
#: shared memory) or "regs" (``_dual_quantize_regs_kernel``, transposed in registers).
KERNEL = "staged"
#: (rows per thread, warps, maxnreg or 0, column pieces) of ``_dual_quantize_regs_kernel`` for
#: runs (False) and 2-D tiles (True, always one piece); see ``register_layouts`` for which fit.
REGS_LAUNCH = {False: (8, 8, 0, 1), True: (16, 4, 0, 1)}
#: (rows per read chunk, rows per transposed chunk, warps, maxnreg or 0, prefetch, fast scale) of
#: ``_dual_quantize_staged_kernel`` (``KERNEL="staged"``).
STAGED_LAUNCH = (32, 32, 4, 96, False, True, False)
#: (rows per chunk, rows per transposed chunk, warps, maxnreg or 0, fast reciprocal) of
#: ``_dual_quantize_three_pass_kernel`` (``KERNEL="three_pass"``).
THREE_PASS_LAUNCH = (32, 32, 4, 0, True)
#: Whether ``dual_quantize`` sends 2-D tiles here (the register kernel) rather than to Triton.
SERVES_TILES = True

if gluon is not None:
    from .dual_quantize import _corrected_quotient, _quotient, _scale_of, _scale_of_16bit, _step_operands

    _g_scale_of = gluon.jit(_scale_of.fn)
    _g_scale_of_16bit = gluon.jit(_scale_of_16bit.fn)
    _g_quotient = gluon.jit(_quotient.fn)
    _g_step_operands = gluon.jit(_step_operands.fn)
    _g_corrected_quotient = gluon.jit(_corrected_quotient.fn)

    @gluon.jit
    def _g_to_fp8_exact(v, scale, FP8_MAX: gl.constexpr):
        q = _g_quotient(v, scale)
        return gl.minimum(gl.maximum(q, -FP8_MAX), FP8_MAX)

    @gluon.jit
    def _g_to_fp8_lean(v, r, s_res, FP8_MAX: gl.constexpr):
        # _quotient's correction step without its rescaling (no scale here is tiny); the upper
        # clamp is the conversion's: sm_90's cvt.rn.satfinite saturates at the format's largest
        # finite value; max.f32 maps a NaN quotient to -FP8_MAX, as the two-sided clamp does
        return gl.maximum(_g_corrected_quotient(v, r, s_res), -FP8_MAX)

    @gluon.jit
    def _g_to_fp8(v, scale, FP8_MAX: gl.constexpr):
        """``clamp(v / scale[:, None])`` rounded as ``_quotient`` rounds it, ``scale`` one per row
        of ``v``: the lean form unless a scale here is below _quotient's rescaling threshold
        (amaxes of subnormal-sized data; a NaN scale is ignored by the min and takes the lean
        form, which gives what the exact one gives)."""
        if gl.min(scale, axis=0) < 1.0e-18:
            q = _g_to_fp8_exact(v, scale[:, None], FP8_MAX)
        else:
            r, s_res = _g_step_operands(scale)
            q = _g_to_fp8_lean(v, r[:, None], s_res[:, None], FP8_MAX)
        return q

    @gluon.jit
    def _dual_quantize_gluon_kernel(
        x_ptr, q_ptr, qt_ptr, s_ptr, st_ptr,
        R, C, n_rb,
        sxg, sxr, sxc, sqg, sqr, sqtg, sqtc, ssg, ssr, ssc, stg, str_, stc,
        B: gl.constexpr, CH: gl.constexpr, TCH: gl.constexpr, FP8_MAX: gl.constexpr,
        TINY: gl.constexpr, WARPS: gl.constexpr,
    ):
        # rows: 8 bf16 (16 bytes) per thread along the columns, a warp spans 2 rows of 128
        ROW: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
        # transposed view [columns, rows]: 16 consecutive rows of one column per thread
        COL: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [WARPS, 1], [1, 0])
        SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        pid = gl.program_id(0)
        cb = gl.program_id(1)
        g = (pid // n_rb).to(gl.int64)
        rb = pid % n_rb
        tile = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [B, B], SMEM)

        cc = cb * B + gl.arange(0, B, layout=gl.SliceLayout(0, ROW))
        c_ok = cc < C
        c64 = cc.to(gl.int64)
        col_bits = gl.zeros([B], gl.int32, layout=gl.SliceLayout(0, ROW))
        for i in gl.static_range(B // CH):
            rr = rb * B + i * CH + gl.arange(0, CH, layout=gl.SliceLayout(1, ROW))
            r_ok = rr < R
            r64 = rr.to(gl.int64)
            ok = r_ok[:, None] & c_ok[None, :]
            xv = gl.load(x_ptr + g * sxg + r64[:, None] * sxr + c64[None, :] * sxc, mask=ok, other=0.0)
            tile.slice(i * CH, CH, dim=0).store(xv)
            v = xv.to(gl.float32)
            # amax on the float bits (abs clears the sign): integer order is float order for
            # non-negative floats, and NaN sorts above inf, so a NaN gives its cell a NaN scale
            bits = gl.abs(v).to(gl.int32, bitcast=True)
            col_bits = gl.maximum(col_bits, gl.max(bits, axis=0))
            row_scale = _g_scale_of(gl.max(bits, axis=1).to(gl.float32, bitcast=True), FP8_MAX, TINY)
            gl.store(s_ptr + g * ssg + r64 * ssr + cb * ssc, row_scale, mask=r_ok)
            q = _g_to_fp8(v, row_scale, FP8_MAX)
            gl.store(q_ptr + g * sqg + r64[:, None] * sqr + c64[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)
        col_scale = _g_scale_of(col_bits.to(gl.float32, bitcast=True), FP8_MAX, TINY)
        gl.store(st_ptr + g * stg + rb * str_ + c64 * stc, col_scale, mask=c_ok)
        col_scale_t = gl.convert_layout(col_scale, gl.SliceLayout(1, COL))
        gl.thread_barrier()  # the whole tile is in shared memory before any warp reads it across

        ct = cb * B + gl.arange(0, B, layout=gl.SliceLayout(1, COL))
        ct_ok = ct < C
        ct64 = ct.to(gl.int64)
        for j in gl.static_range(B // TCH):
            rt = rb * B + j * TCH + gl.arange(0, TCH, layout=gl.SliceLayout(0, COL))
            rt_ok = rt < R
            okt = ct_ok[:, None] & rt_ok[None, :]
            vt = tile.slice(j * TCH, TCH, dim=0).permute([1, 0]).load(COL).to(gl.float32)
            qt = _g_to_fp8(vt, col_scale_t, FP8_MAX)
            gl.store(qt_ptr + g * sqtg + ct64[:, None] * sqtc + rt.to(gl.int64)[None, :],
                     qt.to(qt_ptr.dtype.element_ty), mask=okt)

    @gluon.jit
    def _dual_quantize_staged_kernel(
        x_ptr, q_ptr, qt_ptr, s_ptr, st_ptr,
        R, C, n_rb,
        sxg, sxr, sxc, sqg, sqr, sqtg, sqtc, ssg, ssr, ssc, stg, str_, stc,
        B: gl.constexpr, CH: gl.constexpr, TCH: gl.constexpr, FP8_MAX: gl.constexpr,
        TINY: gl.constexpr, WARPS: gl.constexpr, PREFETCH: gl.constexpr, FAST_SCALE: gl.constexpr,
        FAST_RCP: gl.constexpr,
    ):
        # The shared-memory kernel's data path with two cross-warp exchanges per tile instead of
        # 28 barriers (its SASS under triton 3.6): a chunk is [REPS, WR, B] with a thread's
        # rows of the chunk along the first axis, so the column amax accumulates inside each
        # thread across the chunks and crosses warps once, after the last; the row quotient has
        # no branch on tiny scales (_g_quotient_of; the branch's min crossed warps each chunk);
        # the column pass decides its branch once per tile from scales every warp holds.
        WR: gl.constexpr = 2 * WARPS  # rows one load instruction of the program covers
        REPS: gl.constexpr = CH // WR
        L3: gl.constexpr = gl.BlockedLayout([REPS, 1, 8], [1, 2, 16], [1, WARPS, 1], [2, 1, 0])
        RS: gl.constexpr = gl.SliceLayout(2, L3)
        CS: gl.constexpr = gl.SliceLayout(0, L3)
        COL: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [WARPS, 1], [1, 0])
        pid = gl.program_id(0)
        cb = gl.program_id(1)
        g = (pid // n_rb).to(gl.int64)
        rb = pid % n_rb
        tile = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [B // CH, REPS, WR, B],
                                         gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))

        cc = cb * B + gl.arange(0, B, layout=gl.SliceLayout(0, CS))
        c_ok = cc < C
        c3 = gl.expand_dims(gl.expand_dims(cc.to(gl.int64), 0), 0)
        c_ok3 = gl.expand_dims(gl.expand_dims(c_ok, 0), 0)
        rows = (gl.arange(0, REPS, layout=gl.SliceLayout(1, RS))[:, None] * WR
                + gl.arange(0, WR, layout=gl.SliceLayout(0, RS))[None, :])
        col_acc = gl.zeros([WR, B], gl.int32, layout=CS)
        x_cols = x_ptr + g * sxg + c3 * sxc
        if PREFETCH:
            xn = gl.load(x_cols + (rb * B + rows).to(gl.int64)[:, :, None] * sxr,
                         mask=(rb * B + rows < R)[:, :, None] & c_ok3, other=0.0)
        for i in range(B // CH):
            rr = rb * B + i * CH + rows
            r_ok = rr < R
            r64 = rr.to(gl.int64)
            ok = r_ok[:, :, None] & c_ok3
            if PREFETCH:
                xv = xn
                rn = rr + CH
                xn = gl.load(x_cols + rn.to(gl.int64)[:, :, None] * sxr,
                             mask=((rn < R) & (i + 1 < B // CH))[:, :, None] & c_ok3, other=0.0)
            else:
                xv = gl.load(x_cols + r64[:, :, None] * sxr, mask=ok, other=0.0)
            tile.index(i).store(xv)
            v = xv.to(gl.float32)
            bits = gl.abs(v).to(gl.int32, bitcast=True)  # amax on the bits: see the kernel above
            col_acc = gl.maximum(col_acc, gl.max(bits, axis=0))
            if FAST_SCALE:
                row_scale = _g_scale_of_16bit(gl.max(bits, axis=2).to(gl.float32, bitcast=True), FP8_MAX, TINY)
            else:
                row_scale = _g_scale_of(gl.max(bits, axis=2).to(gl.float32, bitcast=True), FP8_MAX, TINY)
            gl.store(s_ptr + g * ssg + r64 * ssr + cb * ssc, row_scale, mask=r_ok)
            if FAST_RCP:
                neg_k, kr, r, s_res = _g_step_with(row_scale, _g_scale_reciprocal(row_scale * _g_rescale(row_scale)))
            else:
                neg_k, kr, r, s_res = _g_step_of(row_scale)
            q = _g_quotient_of(v, neg_k[:, :, None], kr[:, :, None], r[:, :, None], s_res[:, :, None], FP8_MAX)
            gl.store(q_ptr + g * sqg + r64[:, :, None] * sqr + c3, q.to(q_ptr.dtype.element_ty), mask=ok)
        if FAST_SCALE:
            col_scale = _g_scale_of_16bit(gl.max(col_acc, axis=0).to(gl.float32, bitcast=True), FP8_MAX, TINY)
        else:
            col_scale = _g_scale_of(gl.max(col_acc, axis=0).to(gl.float32, bitcast=True), FP8_MAX, TINY)
        gl.store(st_ptr + g * stg + rb * str_ + cc.to(gl.int64) * stc, col_scale, mask=c_ok)
        tiny = gl.min(col_scale, axis=0) < 1.0e-18
        col_scale_t = gl.convert_layout(col_scale, gl.SliceLayout(1, COL))
        gl.thread_barrier()  # the whole tile is in shared memory before any warp reads it across

        flat = tile._reinterpret(x_ptr.dtype.element_ty, [B // TCH, TCH, B], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        ct = cb * B + gl.arange(0, B, layout=gl.SliceLayout(1, COL))
        ct_ok = ct < C
        qt_cols = qt_ptr + g * sqtg + ct.to(gl.int64)[:, None] * sqtc
        if tiny:
            for j in range(B // TCH):
                rt = rb * B + j * TCH + gl.arange(0, TCH, layout=gl.SliceLayout(0, COL))
                vt = flat.index(j).permute([1, 0]).load(COL).to(gl.float32)
                qt = _g_to_fp8_exact(vt, col_scale_t[:, None], FP8_MAX)
                gl.store(qt_cols + rt.to(gl.int64)[None, :], qt.to(qt_ptr.dtype.element_ty),
                         mask=ct_ok[:, None] & (rt < R)[None, :])
        else:
            r_t, s_res_t = _g_step_operands(col_scale_t)
            if FAST_RCP:
                r_t = _g_scale_reciprocal(col_scale_t)
            for j in range(B // TCH):
                rt = rb * B + j * TCH + gl.arange(0, TCH, layout=gl.SliceLayout(0, COL))
                vt = flat.index(j).permute([1, 0]).load(COL).to(gl.float32)
                qt = _g_to_fp8_lean(vt, r_t[:, None], s_res_t[:, None], FP8_MAX)
                gl.store(qt_cols + rt.to(gl.int64)[None, :], qt.to(qt_ptr.dtype.element_ty),
                         mask=ct_ok[:, None] & (rt < R)[None, :])

    @gluon.jit
    def _g_lean_operands(scale, FAST_RCP: gl.constexpr):
        """``_g_to_fp8_lean``'s (r, s_res) for scales none of which is below the rescaling
        threshold: RN(1 / scale) by ``_g_scale_reciprocal`` (FAST_RCP) or div_rn."""
        r, s_res = _g_step_operands(scale)
        if FAST_RCP:
            r = _g_scale_reciprocal(scale)
        return r, s_res

    @gluon.jit
    def _dual_quantize_three_pass_kernel(
        x_ptr, q_ptr, qt_ptr, s_ptr, st_ptr,
        R, C, n_rb,
        sxg, sxr, sxc, sqg, sqr, sqtg, sqtc, ssg, ssr, ssc, stg, str_, stc,
        B: gl.constexpr, CH: gl.constexpr, TCH: gl.constexpr, FP8_MAX: gl.constexpr,
        TINY: gl.constexpr, WARPS: gl.constexpr, FAST_RCP: gl.constexpr,
    ):
        # The staged kernel with the row copy moved out of the read pass: the read pass keeps the
        # tile and its row scales in shared memory and only takes amaxes; the row pass reads the
        # tile back in the read pass's layout and, like the column pass, picks its quotient once
        # per tile (no per-element rescaling in the common case).
        WR: gl.constexpr = 2 * WARPS
        REPS: gl.constexpr = CH // WR
        L3: gl.constexpr = gl.BlockedLayout([REPS, 1, 8], [1, 2, 16], [1, WARPS, 1], [2, 1, 0])
        RS: gl.constexpr = gl.SliceLayout(2, L3)
        CS: gl.constexpr = gl.SliceLayout(0, L3)
        COL: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [WARPS, 1], [1, 0])
        pid = gl.program_id(0)
        cb = gl.program_id(1)
        g = (pid // n_rb).to(gl.int64)
        rb = pid % n_rb
        tile = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [B // CH, REPS, WR, B],
                                         gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        row_scales = gl.allocate_shared_memory(gl.float32, [B // CH, REPS, WR], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

        cc = cb * B + gl.arange(0, B, layout=gl.SliceLayout(0, CS))
        c_ok = cc < C
        c3 = gl.expand_dims(gl.expand_dims(cc.to(gl.int64), 0), 0)
        c_ok3 = gl.expand_dims(gl.expand_dims(c_ok, 0), 0)
        rows = (gl.arange(0, REPS, layout=gl.SliceLayout(1, RS))[:, None] * WR
                + gl.arange(0, WR, layout=gl.SliceLayout(0, RS))[None, :])
        col_acc = gl.zeros([WR, B], gl.int32, layout=CS)
        row_min = gl.full([REPS, WR], float("inf"), gl.float32, layout=RS)
        x_cols = x_ptr + g * sxg + c3 * sxc
        for i in range(B // CH):
            rr = rb * B + i * CH + rows
            r_ok = rr < R
            xv = gl.load(x_cols + rr.to(gl.int64)[:, :, None] * sxr, mask=r_ok[:, :, None] & c_ok3, other=0.0)
            tile.index(i).store(xv)
            bits = gl.abs(xv.to(gl.float32)).to(gl.int32, bitcast=True)
            col_acc = gl.maximum(col_acc, gl.max(bits, axis=0))
            row_scale = _g_scale_of_16bit(gl.max(bits, axis=2).to(gl.float32, bitcast=True), FP8_MAX, TINY)
            gl.store(s_ptr + g * ssg + rr.to(gl.int64) * ssr + cb * ssc, row_scale, mask=r_ok)
            row_scales.index(i).store(row_scale)
            row_min = gl.minimum(row_min, row_scale)
        col_scale = _g_scale_of_16bit(gl.max(col_acc, axis=0).to(gl.float32, bitcast=True), FP8_MAX, TINY)
        gl.store(st_ptr + g * stg + rb * str_ + cc.to(gl.int64) * stc, col_scale, mask=c_ok)
        # a NaN scale is ignored by the mins and takes the lean form, which gives what the exact one gives
        tiny_rows = gl.min(gl.min(row_min, axis=1), axis=0) < 1.0e-18
        tiny_cols = gl.min(col_scale, axis=0) < 1.0e-18
        col_scale_t = gl.convert_layout(col_scale, gl.SliceLayout(1, COL))
        gl.thread_barrier()  # the whole tile and its row scales are in shared memory

        q_cols = q_ptr + g * sqg + c3
        if tiny_rows:
            for i in range(B // CH):
                rr = rb * B + i * CH + rows
                v = tile.index(i).load(L3).to(gl.float32)
                neg_k, kr, r, s_res = _g_step_of(row_scales.index(i).load(RS))
                q = _g_quotient_of(v, neg_k[:, :, None], kr[:, :, None], r[:, :, None], s_res[:, :, None], FP8_MAX)
                gl.store(q_cols + rr.to(gl.int64)[:, :, None] * sqr, q.to(q_ptr.dtype.element_ty),
                         mask=(rr < R)[:, :, None] & c_ok3)
        else:
            for i in range(B // CH):
                rr = rb * B + i * CH + rows
                v = tile.index(i).load(L3).to(gl.float32)
                r, s_res = _g_lean_operands(row_scales.index(i).load(RS), FAST_RCP)
                q = _g_to_fp8_lean(v, r[:, :, None], s_res[:, :, None], FP8_MAX)
                gl.store(q_cols + rr.to(gl.int64)[:, :, None] * sqr, q.to(q_ptr.dtype.element_ty),
                         mask=(rr < R)[:, :, None] & c_ok3)

        flat = tile._reinterpret(x_ptr.dtype.element_ty, [B // TCH, TCH, B], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        ct = cb * B + gl.arange(0, B, layout=gl.SliceLayout(1, COL))
        ct_ok = ct < C
        qt_cols = qt_ptr + g * sqtg + ct.to(gl.int64)[:, None] * sqtc
        if tiny_cols:
            for j in range(B // TCH):
                rt = rb * B + j * TCH + gl.arange(0, TCH, layout=gl.SliceLayout(0, COL))
                vt = flat.index(j).permute([1, 0]).load(COL).to(gl.float32)
                qt = _g_to_fp8_exact(vt, col_scale_t[:, None], FP8_MAX)
                gl.store(qt_cols + rt.to(gl.int64)[None, :], qt.to(qt_ptr.dtype.element_ty),
                         mask=ct_ok[:, None] & (rt < R)[None, :])
        else:
            r_t, s_res_t = _g_lean_operands(col_scale_t, FAST_RCP)
            for j in range(B // TCH):
                rt = rb * B + j * TCH + gl.arange(0, TCH, layout=gl.SliceLayout(0, COL))
                vt = flat.index(j).permute([1, 0]).load(COL).to(gl.float32)
                qt = _g_to_fp8_lean(vt, r_t[:, None], s_res_t[:, None], FP8_MAX)
                gl.store(qt_cols + rt.to(gl.int64)[None, :], qt.to(qt_ptr.dtype.element_ty),
                         mask=ct_ok[:, None] & (rt < R)[None, :])

    @gluon.jit
    def _g_magnitude_bits(x):
        """The magnitudes of 16-bit floats ``x`` as int32 bit patterns: integer order is magnitude
        order, and a NaN sorts above inf, so the max of these names a NaN. Read off the 16-bit
        bits, the amax needs no float32 copy of the tile next to the one the quotients use."""
        return x.to(gl.int16, bitcast=True).to(gl.int32) & 0x7FFF

    @gluon.jit
    def _g_amax_of_bits(bits, like):
        """The float32 value of ``_g_magnitude_bits`` patterns of ``like``'s 16-bit format."""
        return bits.to(gl.int16).to(like.dtype, bitcast=True).to(gl.float32)

    @gluon.jit
    def _g_rescale(scale):
        """``_quotient``'s k: 2**64 for a scale below its rescaling threshold, else 1."""
        return gl.where(scale < 1.0e-18, 18446744073709551616.0, 1.0)

    @gluon.jit
    def _g_reciprocal(scale):
        """RN(1 / (scale * k)), the one division ``_g_step_with`` needs per scale."""
        r, _ = _g_step_operands(scale * _g_rescale(scale))
        return r

    @gluon.jit
    def _g_scale_reciprocal(s):
        """RN(1 / s) for a quantisation scale (``_scale_of_16bit`` of a 16-bit amax, or one
        times 2**64 below the rescaling threshold) without div_rn's checks and slow path:
        rcp.approx and one Newton step with fused multiply-adds, which gives RN(1 / s) for every
        such scale from any start within 2 ulp of it (exhaustive, exact arithmetic:
        tests/test_dual_quantize_scale.py). inf gives rcp's 0 (the step would make NaN), NaN
        stays NaN."""
        y = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [s], dtype=gl.float32,
                                      is_pure=True, pack=1)
        r = gl.fma(gl.fma(s * -1.0, y, 1.0), y, y)
        return gl.where(s < float("inf"), r, y)

    @gluon.jit
    def _g_step_with(scale, r):
        """``_quotient``'s per-scale operands, formed once per row or column before any value is
        touched, given ``r = _g_reciprocal(scale)`` (which a caller may form in another layout):
        (-k, k r, r, scale * k with inf and NaN as 0). The products by k are exact (powers of
        two, far from the range's ends), which ``_g_quotient_of`` relies on. The division of
        ``_g_step_operands`` is unused here, and the compiler drops it."""
        k = _g_rescale(scale)
        _, s_res = _g_step_operands(scale * k)
        return k * -1.0, r * k, r, s_res

    @gluon.jit
    def _g_step_of(scale):
        """``_g_step_with`` of ``scale`` and its reciprocal."""
        return _g_step_with(scale, _g_reciprocal(scale))

    @gluon.jit
    def _g_quotient_of(v, neg_k, kr, r, s_res, FP8_MAX: gl.constexpr):
        """``max(v / scale, -FP8_MAX)`` rounded as ``_quotient`` rounds it, from
        ``_g_step_of(scale)`` (broadcast to ``v``), without a branch on tiny scales.
        ``_quotient`` forms q0 = (v k) r, the residual t = q0 (s k) - v k and q0 - t r; here
        q0 = v (k r), the same product since both scalings are exact, and v k is one more
        multiply, which for k = 1 leaves the lean form's arithmetic. The upper clamp is the
        conversion's (sm_90's cvt.rn.satfinite), and max maps a NaN quotient to -FP8_MAX, as the
        two-sided clamp does."""
        q0 = v * kr
        q = gl.fma(gl.fma(q0, s_res, v * neg_k) * -1.0, r, q0)
        return gl.maximum(q, -FP8_MAX)

    @gluon.jit
    def _g_runs_step(amax_bits, like, s_base, idx, s_stride, n, S: gl.constexpr, V: gl.constexpr,
                     FP8_MAX: gl.constexpr, TINY: gl.constexpr):
        """Scales of one side's runs from their amax bits (layout ``S``), formed and stored in the
        compact layout ``V`` (``idx``: their row or column indices, below ``n``): their smallest,
        and ``_g_step_of`` of them back in ``S``."""
        amax = _g_amax_of_bits(gl.convert_layout(amax_bits, V), like)
        scale = _g_scale_of(amax, FP8_MAX, TINY)
        gl.store(s_base + idx.to(gl.int64) * s_stride, scale, mask=idx < n)
        # only the scale and the division's result cross back; the rest is a select or a product
        r = gl.convert_layout(_g_reciprocal(scale), S)
        return gl.min(scale, axis=0), _g_step_with(gl.convert_layout(scale, S), r)

    @gluon.jit
    def _g_store_t(qt8, base, r0, c0, R, C, sqtc, ROWS_: gl.constexpr, COLS_: gl.constexpr, LT: gl.constexpr):
        """Stores ``qt8`` (layout LT; rows r0.. x columns c0.. of the tile) transposed at ``base``."""
        rt = r0 + gl.arange(0, ROWS_, layout=gl.SliceLayout(1, LT))
        ct = c0 + gl.arange(0, COLS_, layout=gl.SliceLayout(0, LT))
        okt = (rt < R)[:, None] & (ct < C)[None, :]
        gl.store(base + ct.to(gl.int64)[None, :] * sqtc + rt.to(gl.int64)[:, None], qt8, mask=okt)

    @gluon.jit
    def _g_store_piece(xv, rows, cols, c0, q_rows, qt_base, r0, R, C, sqtc, r_ok,
                       B: gl.constexpr, W: gl.constexpr, L: gl.constexpr, LT: gl.constexpr, LEAN: gl.constexpr,
                       FP8_MAX: gl.constexpr):
        """Both copies of one column piece ``xv`` (columns c0 .. c0 + W of a runs tile) quantised
        and stored; ``rows``, ``cols``: ``_g_step_of`` of its row and column scales. LEAN: no
        scale of the tile is below the rescaling threshold (every k is 1), so the quotient takes
        ``_g_to_fp8_lean``'s arithmetic, one multiply less per value and copy."""
        neg_k, kr, r, s_res = rows
        neg_k_t, kr_t, r_t, s_res_t = cols
        v = xv.to(gl.float32)
        if LEAN:
            q = _g_to_fp8_lean(v, r[:, None], s_res[:, None], FP8_MAX)
        else:
            q = _g_quotient_of(v, neg_k[:, None], kr[:, None], r[:, None], s_res[:, None], FP8_MAX)
        cc = c0 + gl.arange(0, W, layout=gl.SliceLayout(0, L))
        gl.store(q_rows + cc.to(gl.int64)[None, :], q.to(q_rows.dtype.element_ty),
                 mask=r_ok[:, None] & (cc < C)[None, :])
        if LEAN:
            qt = _g_to_fp8_lean(v, r_t[None, :], s_res_t[None, :], FP8_MAX)
        else:
            qt = _g_quotient_of(v, neg_k_t[None, :], kr_t[None, :], r_t[None, :], s_res_t[None, :], FP8_MAX)
        _g_store_t(gl.convert_layout(qt, LT).to(qt_base.dtype.element_ty), qt_base, r0, c0, R, C, sqtc, B, W, LT)

    @gluon.jit
    def _dual_quantize_regs_kernel(
        x_ptr, q_ptr, qt_ptr, s_ptr, st_ptr,
        R, C, n_rb,
        sxg, sxr, sxc, sqg, sqr, sqtg, sqtc, ssg, ssr, ssc, stg, str_, stc,
        TILE_2D: gl.constexpr, B: gl.constexpr, PIECES: gl.constexpr, L: gl.constexpr, LT: gl.constexpr,
        V: gl.constexpr, FP8_MAX: gl.constexpr, TINY: gl.constexpr,
    ):
        # L and LT (register_layouts) cover B rows x B // PIECES columns: each thread holds a few
        # consecutive rows x 8 consecutive columns. Its 16-byte row pieces load coalesced, and each
        # of its columns is one vector store of the transposed copy. LT names the same elements
        # with the rows fastest in the registers, so moving there renames registers; nothing
        # crosses threads. V spreads a side's scales over the program's threads: they are formed
        # there, once each, where L would have every thread divide for each of its rows and
        # columns. Token runs may come in two column pieces (PIECES), each quantised and stored
        # in turn.
        W: gl.constexpr = B // PIECES
        pid = gl.program_id(0)
        cb = gl.program_id(1)
        g = (pid // n_rb).to(gl.int64)
        rb = pid % n_rb
        rr = rb * B + gl.arange(0, B, layout=gl.SliceLayout(1, L))
        cc = cb * B + gl.arange(0, W, layout=gl.SliceLayout(0, L))
        r_ok = rr < R
        r64 = rr.to(gl.int64)
        x_rows = x_ptr + g * sxg + r64[:, None] * sxr
        ok = r_ok[:, None] & (cc < C)[None, :]
        xv = gl.load(x_rows + cc.to(gl.int64)[None, :] * sxc, mask=ok, other=0.0)
        bits = _g_magnitude_bits(xv)
        if TILE_2D:
            scale = _g_scale_of(_g_amax_of_bits(gl.max(gl.max(bits, axis=1), axis=0), xv), FP8_MAX, TINY)
            gl.store(s_ptr + g * ssg + rb * ssr + cb * ssc, scale)
            neg_k, kr, r, s_res = _g_step_of(scale)
            v = xv.to(gl.float32)  # after the divisions: not held across their slow-path branches
            q = _g_quotient_of(v, neg_k, kr, r, s_res, FP8_MAX)
            gl.store(q_ptr + g * sqg + r64[:, None] * sqr + cc.to(gl.int64)[None, :], q.to(q_ptr.dtype.element_ty),
                     mask=ok)
            # the renaming moves the float32 values; the fp8 bytes are packed after it
            qt8 = gl.convert_layout(q, LT).to(qt_ptr.dtype.element_ty)
            _g_store_t(qt8, qt_ptr + g * sqtg, rb * B, cb * B, R, C, sqtc, B, B, LT)
        else:
            row_bits = gl.max(bits, axis=1)
            cc1 = cc + W
            ok1 = r_ok[:, None] & (cc1 < C)[None, :]
            if PIECES == 2:
                xv1 = gl.load(x_rows + cc1.to(gl.int64)[None, :] * sxc, mask=ok1, other=0.0)
                bits1 = _g_magnitude_bits(xv1)
                row_bits = gl.maximum(row_bits, gl.max(bits1, axis=1))
            idx = gl.arange(0, W, layout=V)
            st_base = st_ptr + g * stg + rb * str_
            least, rows = _g_runs_step(row_bits, xv, s_ptr + g * ssg + cb * ssc, rb * B + gl.arange(0, B, layout=V),
                                       ssr, R, gl.SliceLayout(1, L), V, FP8_MAX, TINY)
            least_c, cols = _g_runs_step(gl.max(bits, axis=0), xv, st_base, cb * B + idx, stc, C,
                                         gl.SliceLayout(0, L), V, FP8_MAX, TINY)
            least = gl.minimum(least, least_c)
            if PIECES == 2:
                least_c, cols1 = _g_runs_step(gl.max(bits1, axis=0), xv, st_base, cb * B + W + idx, stc, C,
                                              gl.SliceLayout(0, L), V, FP8_MAX, TINY)
                least = gl.minimum(least, least_c)
            q_rows = q_ptr + g * sqg + r64[:, None] * sqr
            qt_base = qt_ptr + g * sqtg
            # One branch per tile. The rare arm (a scale below the rescaling threshold somewhere in
            # the tile) reads the tile again rather than sharing the registers' copy: with the same
            # first operations in both arms, the compiler hoists the float32 conversion above the
            # branch and holds the whole tile's float32 values. A NaN scale is ignored by the min
            # and takes the lean form, which gives what the exact one gives.
            if least < 1.0e-18:
                xe = gl.load(x_rows + cc.to(gl.int64)[None, :] * sxc, mask=ok, other=0.0)
                _g_store_piece(xe, rows, cols, cb * B, q_rows, qt_base, rb * B, R, C, sqtc, r_ok,
                               B, W, L, LT, False, FP8_MAX)
                if PIECES == 2:
                    xe1 = gl.load(x_rows + cc1.to(gl.int64)[None, :] * sxc, mask=ok1, other=0.0)
                    _g_store_piece(xe1, rows, cols1, cb * B + W, q_rows, qt_base, rb * B, R, C, sqtc, r_ok,
                                   B, W, L, LT, False, FP8_MAX)
            else:
                _g_store_piece(xv, rows, cols, cb * B, q_rows, qt_base, rb * B, R, C, sqtc, r_ok,
                               B, W, L, LT, True, FP8_MAX)
                if PIECES == 2:
                    _g_store_piece(xv1, rows, cols1, cb * B + W, q_rows, qt_base, rb * B, R, C, sqtc, r_ok,
                                   B, W, L, LT, True, FP8_MAX)

def register_layouts(rows: int, warps: int, cols: int = BLOCK, block: int = BLOCK):
    """The three layouts of ``_dual_quantize_regs_kernel`` over a ``block`` x ``cols`` piece of a
    tile, each thread holding ``rows`` consecutive rows x 8 consecutive columns: ``L`` with the
    columns fastest in its registers (the load and the row copy's store), and ``LT``, the same
    elements on the same threads with the rows fastest (the transposed copy's store). A blocked
    layout with the rows fastest would also lay the lanes along the rows, and the conversion
    would cross threads. ``V`` spreads a side's scales over the program's threads."""
    lanes_c = cols // 8
    lanes_r = 32 // max(lanes_c, 1)
    if (rows * lanes_r * warps != block or lanes_c * lanes_r != 32
            or any(n & (n - 1) for n in (rows, warps, cols))):
        raise ValueError(f"register_layouts: rows x lanes along rows x warps must be {block} with 8-column "
                         f"pieces, powers of two (got rows {rows}, warps {warps}, cols {cols})")
    lay = gl.BlockedLayout([rows, 8], [lanes_r, lanes_c], [warps, 1], [1, 0])
    regs = [[1 << i, 0] for i in range(rows.bit_length() - 1)] + [[0, 1], [0, 2], [0, 4]]
    lanes = [[0, 8 << i] for i in range(lanes_c.bit_length() - 1)]
    lanes += [[rows << i, 0] for i in range(lanes_r.bit_length() - 1)]
    warp_bases = [[rows * lanes_r << i, 0] for i in range(warps.bit_length() - 1)]
    compact = gl.BlockedLayout([1], [32], [warps], [0])
    return lay, gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [block, cols]), compact


def available(x: torch.Tensor, block: int) -> str | None:
    """None when this kernel can quantise ``x`` with ``block``, else why not."""
    if block != BLOCK:
        return f"the Gluon dual quantiser is laid out for block {BLOCK} (got {block})"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"the Gluon dual quantiser reads bfloat16 or float16 (got {x.dtype})"
    if x.device.type != "cuda":
        return "the Gluon dual quantiser needs a CUDA tensor"
    return _gluon_available(x.device.index)


@functools.lru_cache(maxsize=None)
def _layouts(rows: int, warps: int, cols: int):
    return register_layouts(rows, warps, cols)


def launch(x, data, data_t, scale, scale_t, fp8_max: float, tiny: float, tile_2d: bool = False) -> None:
    """Fill ``data``, ``scale``, ``data_t``, ``scale_t`` (laid out by ``dual_quantize``) from ``x``:
    token runs (``tile_2d`` False) by the kernel ``KERNEL`` names, 2-D tiles by the register kernel."""
    g, r, c = x.shape
    n_r, n_c = -(-r // BLOCK), -(-c // BLOCK)
    args = kernel_args(x, data, data_t, scale, scale_t, BLOCK)
    if tile_2d or KERNEL == "regs":
        rows, warps, maxnreg, pieces = REGS_LAUNCH[tile_2d]
        pieces = 1 if tile_2d else pieces
        lay, lay_t, compact = _layouts(rows, warps, BLOCK // pieces)
        extra = {"maxnreg": maxnreg} if maxnreg else {}
        _dual_quantize_regs_kernel[(g * n_r, n_c)](
            *args, TILE_2D=tile_2d, B=BLOCK, PIECES=pieces, L=lay, LT=lay_t, V=compact, FP8_MAX=fp8_max,
            TINY=tiny, num_warps=warps, **extra)
        return
    if KERNEL == "three_pass":
        chunk, t_chunk, warps, maxnreg, fast_rcp = THREE_PASS_LAUNCH
        extra = {"maxnreg": maxnreg} if maxnreg else {}
        _dual_quantize_three_pass_kernel[(g * n_r, n_c)](
            *args, B=BLOCK, CH=chunk, TCH=t_chunk, FP8_MAX=fp8_max, TINY=tiny, WARPS=warps, num_warps=warps,
            FAST_RCP=fast_rcp, **extra)
        return
    if KERNEL == "staged":
        chunk, t_chunk, warps, maxnreg, prefetch, fast_scale, fast_rcp = STAGED_LAUNCH
        extra = {"maxnreg": maxnreg} if maxnreg else {}
        _dual_quantize_staged_kernel[(g * n_r, n_c)](
            *args, B=BLOCK, CH=chunk, TCH=t_chunk, FP8_MAX=fp8_max, TINY=tiny, WARPS=warps, num_warps=warps,
            PREFETCH=prefetch, FAST_SCALE=fast_scale, FAST_RCP=fast_rcp, **extra)
        return
    chunk, t_chunk, warps = LAUNCH
    _dual_quantize_gluon_kernel[(g * n_r, n_c)](
        *args, B=BLOCK, CH=chunk, TCH=t_chunk, FP8_MAX=fp8_max, TINY=tiny, WARPS=warps, num_warps=warps)
