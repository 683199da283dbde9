"""The dual blockwise fp8 quantiser (``dual_quantize``) for token runs, in Gluon, block 128, Hopper.

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

Measured (H100, tools/gpu_round36.sh, median of 20): DeepSeek-V3 x [32768, 7168] 0.592 ms against
0.814 ms for the Triton kernel in the same run (1.59 TB/s of bf16 read + fp8 written); Qwen3 down
gradient [65536, 2048] 0.404 vs 0.490 ms; geomean over four operands 0.320 vs 0.397 ms. For 2-D
tiles this design was slower than the Triton kernel, so ``dual_quantize`` keeps tiles there.

Needs Gluon (triton >= 3.6) and an sm_90 GPU; the interpreter does not run Gluon, so
``dual_quantize`` falls back to the Triton kernel there (``available``).
"""
from __future__ import annotations

import functools

import torch
import triton.language as tl

from .fp8_blockwise_gluon import available as _gluon_available

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # pragma: no cover - triton without Gluon
    gluon = None

#: The quantisation block this kernel is laid out for (its layouts cover 128 columns).
BLOCK = 128
#: (rows per chunk of the global read, rows per chunk of the transposed pass, warps): the best
#: geomean of five in round 40 (tools/probe_grouped_step.py --sweep, H100, lean quotient: 0.214
#: ms against 0.221-0.250; 96 registers, 5 programs per SM). Round 36 (before the lean quotient)
#: had preferred (64, 32, 4).
LAUNCH = (32, 32, 4)
#: Launch order of the one-tile kernel's programs: column blocks fastest (neighbours read one
#: band of rows) or row blocks fastest (neighbours write one band of the transposed copy).
COLUMN_BLOCKS_FASTEST = False
#: The one-tile kernel's transposed pass: (columns, rows) per thread, threads of a warp along the
#: columns, warps along the columns; None: one column of 16 rows per thread, 16 threads along the
#: columns, all warps along the columns (2-byte shared-memory reads).
COLUMN_LAYOUT: tuple[int, int, int, int] | None = None
#: The one-tile kernel brings its tile into shared memory by cp.async, all of it in flight at
#: once, where ``pipe_error`` allows (False: chunk by chunk through registers).
ASYNC_LOAD = False
#: Quantise through the pipelined kernel (``_dual_quantize_pipe_kernel``) where its operand
#: conditions hold (``pipe_error``); False keeps the one-tile-per-program kernel (probes compare).
PIPELINE = False
#: The pipelined kernel's launch: rows per chunk of the row pass; the column pass's per-thread
#: block (columns, rows), threads of a warp along the columns, warps along the columns; warps;
#: tiles in flight per program (shared-memory stages); programs per SM; the register cap per
#: thread (None: ptxas's choice).
PIPE_LAUNCH = dict(CH=8, TC=2, RPT=16, TPW_C=32, WPC_C=2, WARPS=4, STAGES=2, PER_SM=3, MAXNREG=None)

if gluon is not None:
    from .dual_quantize import _quotient, _scale_of

    _g_scale_of = gluon.jit(_scale_of.fn)
    _g_quotient = gluon.jit(_quotient.fn)

    @gluon.jit
    def _g_to_fp8_exact(v, scale, FP8_MAX: gl.constexpr):
        q = _g_quotient(v, scale)
        return gl.minimum(gl.maximum(q, -FP8_MAX), FP8_MAX)

    @gluon.jit
    def _g_to_fp8_lean(v, r, s_res, FP8_MAX: gl.constexpr):
        # _quotient's correction step for scales >= 2**-60 (no rescaling), written so that it
        # needs no per-element select: the residual is negated (q0 * s - v), which keeps a zero
        # quotient's sign through the FMA, and an infinite scale enters the residual as 0
        # (s_res), which leaves q0 = v * 0 as is. Same bits as _quotient (see there).
        # (x * -1.0, not -x: Triton's unary minus is 0 - x, which loses a zero's sign and so
        # costs an FADD; a product by -1 is an exact negation that folds into the FMA operand)
        q0 = v * r
        t = gl.fma(q0, s_res, v * -1.0)
        q = gl.fma(t * -1.0, r, q0)
        # the upper clamp is the conversion's: sm_90's cvt.rn.satfinite saturates at the format's
        # largest finite value; max.f32 maps a NaN quotient to -FP8_MAX, as the two-sided clamp does
        return gl.maximum(q, -FP8_MAX)

    @gluon.jit
    def _g_to_fp8(v, scale, FP8_MAX: gl.constexpr):
        """``clamp(v / scale[:, None])`` rounded as ``_quotient`` rounds it, ``scale`` one per row
        of ``v``: the lean form unless a scale here is below _quotient's rescaling threshold
        (amaxes of subnormal-sized data; a NaN scale is ignored by the min and takes the lean
        form, which gives what the exact one gives)."""
        if gl.min(scale, axis=0) < 1.0e-18:
            q = _g_to_fp8_exact(v, scale[:, None], FP8_MAX)
        else:
            r = tl.math.div_rn(gl.where(scale == scale, 1.0, 1.0), scale)
            q = _g_to_fp8_lean(v, r[:, None], gl.where(scale < float("inf"), scale, 0.0)[:, None], FP8_MAX)
        return q

    @gluon.jit
    def _dual_quantize_gluon_kernel(
        x_ptr, q_ptr, qt_ptr, s_ptr, st_ptr,
        R, C, n_rb,
        sxg, sxr, sxc, sqg, sqr, sqtg, sqtc, ssg, ssr, ssc, stg, str_, stc,
        B: gl.constexpr, CH: gl.constexpr, TCH: gl.constexpr, FP8_MAX: gl.constexpr,
        TINY: gl.constexpr, WARPS: gl.constexpr, COLUMN_BLOCKS_FASTEST: gl.constexpr,
        ASYNC_LOAD: gl.constexpr, TC: gl.constexpr, RPT: gl.constexpr, TPW_C: gl.constexpr,
        WPC_C: gl.constexpr,
    ):
        # rows: 8 bf16 (16 bytes) per thread along the columns, a warp spans 2 rows of 128
        ROW: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
        # transposed view [columns, rows]: RPT consecutive rows of TC columns per thread, so that
        # each shared-memory read is TC columns wide and each fp8 store RPT bytes long
        COL: gl.constexpr = gl.BlockedLayout([TC, RPT], [TPW_C, 32 // TPW_C], [WPC_C, WARPS // WPC_C], [1, 0])
        SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        if COLUMN_BLOCKS_FASTEST:  # neighbouring programs read one band of rows, left to right
            pid = gl.program_id(1)
            cb = gl.program_id(0)
        else:  # neighbouring programs fill one band of the transposed copy's rows
            pid = gl.program_id(0)
            cb = gl.program_id(1)
        g = (pid // n_rb).to(gl.int64)
        rb = pid % n_rb
        tile = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [B, B], SMEM)

        cc = cb * B + gl.arange(0, B, layout=gl.SliceLayout(0, ROW))
        c_ok = cc < C
        c64 = cc.to(gl.int64)
        col_bits = gl.zeros([B], gl.int32, layout=gl.SliceLayout(0, ROW))
        if ASYNC_LOAD:
            # the whole tile in flight at once by cp.async (16-byte copies, ``pipe_error`` holds;
            # masked copies land as zeros), holding no registers, instead of one chunk at a time
            for i in gl.static_range(B // CH):
                rr = rb * B + i * CH + gl.arange(0, CH, layout=gl.SliceLayout(1, ROW))
                ok = (rr < R)[:, None] & c_ok[None, :]
                async_copy.async_copy_global_to_shared(
                    tile.slice(i * CH, CH, dim=0), x_ptr + g * sxg + rr.to(gl.int64)[:, None] * sxr + c64[None, :],
                    mask=ok)
            async_copy.commit_group()
            async_copy.wait_group(0)
            gl.thread_barrier()
        for i in gl.static_range(B // CH):
            rr = rb * B + i * CH + gl.arange(0, CH, layout=gl.SliceLayout(1, ROW))
            r_ok = rr < R
            r64 = rr.to(gl.int64)
            ok = r_ok[:, None] & c_ok[None, :]
            if ASYNC_LOAD:
                xv = tile.slice(i * CH, CH, dim=0).load(ROW)
            else:
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
    def _pipe_issue(x_ptr, buf, t, n_tiles, n_rb, n_cb, R, C, sxg, sxr,
                    B: gl.constexpr, LCH: gl.constexpr, WARPS: gl.constexpr):
        # cp.async the bf16 tile t into buf, 16 bytes per copy; the copies of a tile past the end
        # and of rows/columns past R/C are masked and land as zeros, which no amax sees as larger
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
        live = t < n_tiles
        cb = t % n_cb
        rb = (t // n_cb) % n_rb
        g = (t // (n_cb * n_rb)).to(gl.int64)
        cc = cb * B + gl.arange(0, B, layout=gl.SliceLayout(0, LOAD))
        c_ok = (cc < C) & live
        for i in gl.static_range(B // LCH):
            rr = rb * B + i * LCH + gl.arange(0, LCH, layout=gl.SliceLayout(1, LOAD))
            ok = (rr < R)[:, None] & c_ok[None, :]
            src = x_ptr + g * sxg + rr.to(gl.int64)[:, None] * sxr + cc[None, :]
            async_copy.async_copy_global_to_shared(buf.slice(i * LCH, LCH, dim=0), src, mask=ok)

    @gluon.jit
    def _dual_quantize_pipe_kernel(
        x_ptr, q_ptr, qt_ptr, s_ptr, st_ptr,
        R, C, n_rb, n_cb, n_tiles,
        sxg, sxr, sqg, sqr, sqtg, sqtc, ssg, ssr, ssc, stg, str_, stc,
        B: gl.constexpr, CH: gl.constexpr, TC: gl.constexpr, RPT: gl.constexpr, TPW_C: gl.constexpr,
        WPC_C: gl.constexpr, FP8_MAX: gl.constexpr, TINY: gl.constexpr, WARPS: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        # Persistent over tiles (g, row block, column block), column blocks fastest. Each tile
        # reaches shared memory by cp.async STAGES - 1 tiles ahead of its quantisation, so the
        # loads stay in flight while the program works on earlier tiles and no register holds
        # them (the one-tile kernel holds a chunk in registers until it is stored: 152
        # registers, 3 programs and at most 48 KiB of loads in flight per SM).
        ROW: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
        # transposed view [columns, rows]: RPT consecutive rows of TC columns per thread; a warp's
        # read is TPW_C * TC consecutive columns of one row (no bank conflicts)
        COL: gl.constexpr = gl.BlockedLayout([TC, RPT], [TPW_C, 32 // TPW_C], [WPC_C, WARPS // WPC_C], [1, 0])
        TCH: gl.constexpr = RPT * (32 // TPW_C) * (WARPS // WPC_C)
        SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        bufs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, B, B], SMEM)
        for s in gl.static_range(STAGES - 1):
            _pipe_issue(x_ptr, bufs.index(s), pid + s * nprog, n_tiles, n_rb, n_cb, R, C, sxg, sxr,
                        B, CH, WARPS)
            async_copy.commit_group()
        n_mine = gl.cdiv(n_tiles - pid, nprog)
        for it in range(n_mine):
            t = pid + it * nprog
            _pipe_issue(x_ptr, bufs.index((it + STAGES - 1) % STAGES), t + (STAGES - 1) * nprog, n_tiles,
                        n_rb, n_cb, R, C, sxg, sxr, B, CH, WARPS)
            async_copy.commit_group()
            async_copy.wait_group(STAGES - 1)  # this thread's copies of tile t have landed
            gl.thread_barrier()  # ... and every other thread's
            tile = bufs.index(it % STAGES)
            cb = t % n_cb
            rb = (t // n_cb) % n_rb
            g = (t // (n_cb * n_rb)).to(gl.int64)

            cc = cb * B + gl.arange(0, B, layout=gl.SliceLayout(0, ROW))
            c_ok = cc < C
            c64 = cc.to(gl.int64)
            # the columns' amax is kept per element across the chunks and reduced once: a reduction
            # per chunk crosses warps through shared memory and a barrier each time
            col_acc = gl.zeros([CH, B], gl.int32, layout=ROW)
            for i in gl.static_range(B // CH):
                rr = rb * B + i * CH + gl.arange(0, CH, layout=gl.SliceLayout(1, ROW))
                r_ok = rr < R
                r64 = rr.to(gl.int64)
                v = tile.slice(i * CH, CH, dim=0).load(ROW).to(gl.float32)
                # amax on the float bits: see _dual_quantize_gluon_kernel
                bits = gl.abs(v).to(gl.int32, bitcast=True)
                col_acc = gl.maximum(col_acc, bits)
                row_scale = _g_scale_of(gl.max(bits, axis=1).to(gl.float32, bitcast=True), FP8_MAX, TINY)
                gl.store(s_ptr + g * ssg + r64 * ssr + cb * ssc, row_scale, mask=r_ok)
                q = _g_to_fp8(v, row_scale, FP8_MAX)
                gl.store(q_ptr + g * sqg + r64[:, None] * sqr + c64[None, :], q.to(q_ptr.dtype.element_ty),
                         mask=r_ok[:, None] & c_ok[None, :])
            col_bits = gl.max(col_acc, axis=0)
            col_scale = _g_scale_of(col_bits.to(gl.float32, bitcast=True), FP8_MAX, TINY)
            gl.store(st_ptr + g * stg + rb * str_ + c64 * stc, col_scale, mask=c_ok)
            col_scale_t = gl.convert_layout(col_scale, gl.SliceLayout(1, COL))

            ct = cb * B + gl.arange(0, B, layout=gl.SliceLayout(1, COL))
            ct_ok = ct < C
            ct64 = ct.to(gl.int64)
            for j in gl.static_range(B // TCH):
                rt = rb * B + j * TCH + gl.arange(0, TCH, layout=gl.SliceLayout(0, COL))
                okt = ct_ok[:, None] & (rt < R)[None, :]
                vt = tile.slice(j * TCH, TCH, dim=0).permute([1, 0]).load(COL).to(gl.float32)
                qt = _g_to_fp8(vt, col_scale_t, FP8_MAX)
                gl.store(qt_ptr + g * sqtg + ct64[:, None] * sqtc + rt.to(gl.int64)[None, :],
                         qt.to(qt_ptr.dtype.element_ty), mask=okt)
            gl.thread_barrier()  # every warp is done with this slot before it is refilled
        async_copy.wait_group(0)


def pipe_error(x: torch.Tensor) -> str | None:
    """Why the pipelined kernel cannot read ``x`` (its copies are 16-byte cp.async), or None."""
    g, r, c = x.shape
    if x.stride(2) != 1:
        return "its columns are not contiguous"
    if c % 16 or x.stride(1) % 16 or (g > 1 and x.stride(0) % 16) or x.data_ptr() % 16:
        return "its columns, strides or start are not multiples of 16 elements (32 bytes)"
    return None


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
def _sm_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch(x, data, data_t, scale, scale_t, fp8_max: float, tiny: float) -> None:
    """Fill ``data``, ``scale``, ``data_t``, ``scale_t`` (runs, laid out by ``dual_quantize``) from ``x``."""
    g, r, c = x.shape
    n_r, n_c = -(-r // BLOCK), -(-c // BLOCK)
    if PIPELINE and pipe_error(x) is None:
        launch_args = dict(PIPE_LAUNCH)
        per_sm, warps, maxnreg = launch_args.pop("PER_SM"), launch_args["WARPS"], launch_args.pop("MAXNREG")
        if maxnreg:
            launch_args["maxnreg"] = maxnreg
        n_tiles = g * n_r * n_c
        progs = min(n_tiles, per_sm * _sm_count(x.device.index))
        _dual_quantize_pipe_kernel[(progs,)](
            x, data, data_t, scale, scale_t, r, c, n_r, n_c, n_tiles,
            x.stride(0), x.stride(1), data.stride(0), data.stride(1), data_t.stride(0), data_t.stride(1),
            *scale.stride(), *scale_t.stride(),
            B=BLOCK, FP8_MAX=fp8_max, TINY=tiny, num_warps=warps, **launch_args,
        )
        return
    chunk, t_chunk, warps = LAUNCH
    grid = (n_c, g * n_r) if COLUMN_BLOCKS_FASTEST else (g * n_r, n_c)
    _dual_quantize_gluon_kernel[grid](
        x, data, data_t, scale, scale_t, r, c, n_r,
        *x.stride(), data.stride(0), data.stride(1), data_t.stride(0), data_t.stride(1),
        *scale.stride(), *scale_t.stride(),
        B=BLOCK, CH=chunk, TCH=t_chunk, FP8_MAX=fp8_max, TINY=tiny, WARPS=warps,
        COLUMN_BLOCKS_FASTEST=COLUMN_BLOCKS_FASTEST, ASYNC_LOAD=ASYNC_LOAD and pipe_error(x) is None,
        **dict(zip(("TC", "RPT", "TPW_C", "WPC_C"), COLUMN_LAYOUT or (1, 16, 16, warps))),
        num_warps=warps,
    )
