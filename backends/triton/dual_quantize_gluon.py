"""The dual blockwise fp8 quantiser (``dual_quantize.dual_quantize``) in Gluon: block 128,
16-bit inputs, sm_90.

Same outputs, bit for bit, as ``dual_quantize._dual_quantize_kernel`` (and so as two
``quantize_cells`` calls), from one kernel per layout:

* token runs: ``_g_runs_tile`` reads a 128 x 128 tile once into unswizzled shared memory,
  quantises the row runs from registers as the chunks arrive and the column runs from the shared
  copy (16 consecutive rows of one column per thread, so the transposed fp8 copy leaves in
  16-byte stores). ``_dual_quantize_runs_tma_kernel`` runs it persistently on TMA-loaded tiles
  where TMA can read the operand, ``_dual_quantize_runs_kernel`` one program per tile elsewhere;
* 2-D tiles: ``_dual_quantize_tiles_kernel`` keeps the tile in registers and writes the
  transposed copy from a renamed register order (``register_layouts``), without shared memory.

Why Gluon: explicit layouts let these kernels meet across warps once per tile (runs) or never
(tiles), where the Triton kernel meets for every chunk; on an H100 they run 1.3-1.5x faster
(docs/kernels.md). Needs triton >= 3.6 with Gluon and an sm_90 GPU (``available``); elsewhere,
and under the interpreter, ``dual_quantize`` takes the Triton kernel.
"""
from __future__ import annotations

import functools

import torch

from .dual_quantize import kernel_args
from .fp8_blockwise_gluon import available as _gluon_available
from .gemm_kernels import bind_cuda_context, num_programs, tma_ok
from .prebound import CallKeyedKernel, rebaser

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - triton without Gluon
    gluon = None

#: The quantisation block these kernels are laid out for (their layouts cover 128 columns).
BLOCK = 128
#: (rows per chunk of the read, rows per chunk of the transposed pass, warps, maxnreg or 0) of
#: ``_dual_quantize_runs_kernel``: the fastest of an H100 sweep (96 registers, 5 programs per SM).
LAUNCH = (32, 32, 4, 96)
#: (ring stages, programs per SM, maxnreg or 0) of ``_dual_quantize_runs_tma_kernel``, the
#: persistent TMA form of the runs kernel: one stage leaves room for four programs per SM, which
#: beat deeper rings with fewer programs on an H100 (docs/kernels.md).
TMA_RUNS = (1, 4, 96)
#: Column blocks per work unit of the TMA runs kernel, widest first: a unit is a strip of one row
#: block whose row scales leave together, one vector store per row (``dual_quantize`` pads their
#: rows to 16 floats for it). The widest strip that still gives every program RUNS_MIN_UNITS units
#: is taken, else one tile per unit: with fewer units per program, the last units' imbalance costs
#: more than the wider stores save.
RUNS_SPANS = (8, 4, 2)
#: Units per program below which a strip width is not taken (see RUNS_SPANS).
RUNS_MIN_UNITS = 12
#: (rows per thread, warps, maxnreg or 0) of ``_dual_quantize_tiles_kernel``; see
#: ``register_layouts`` for which fit.
TILES_LAUNCH = (16, 4, 0)

if gluon is not None:
    from .dual_quantize import _corrected_quotient, _quotient, _scale_of, _step_operands

    _g_scale_of = gluon.jit(_scale_of.fn)
    _g_quotient = gluon.jit(_quotient.fn)
    _g_step_operands = gluon.jit(_step_operands.fn)
    _g_corrected_quotient = gluon.jit(_corrected_quotient.fn)
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from .fp8_blockwise_gluon import GluonDescriptor, _cta_barrier, _tma_load

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
    def _g_runs_tile(x_rows, sxr, sxc, chunks, chunk0, slices, slice0, q_ptr, qt_ptr, s_ptr, st_ptr, g, rb, cb,
                     R, C, sqg, sqr, sqtg, sqtc, ssg, ssr, ssc, stg, str_, stc,
                     B: gl.constexpr, CH: gl.constexpr, TCH: gl.constexpr, FP8_MAX: gl.constexpr,
                     TINY: gl.constexpr, WARPS: gl.constexpr, IN_SMEM: gl.constexpr, stash=None, stash0=0,
                     STASH: gl.constexpr = False):
        """Both copies and both scale sets of tile (g, rb, cb) of a token-run operand. The tile is
        read as ``chunks.index(chunk0 + i)`` ([REPS, 2 * WARPS, B] each) and, transposed, as
        ``slices.index(slice0 + j)`` ([TCH, B] each), two views of the same shared memory; it is
        already there (IN_SMEM, a TMA copy) or is read from ``x_rows`` (x at group g, strides
        ``sxr``, ``sxc``) into it here. With STASH the row scales go to ``stash.index(stash0 + i)``
        ([REPS, 2 * WARPS] each) in shared memory, for the caller to write a strip's worth at
        once, rather than to ``s_ptr``.

        A chunk is laid out ``[REPS, 2 * WARPS, B]`` with a thread's rows along the first axis,
        so the column amax accumulates inside each thread and meets the other warps once, after
        the last chunk; the row quotient has no branch on tiny scales (``_g_quotient_of``), and
        the column pass picks its quotient once per tile from scales every warp holds."""
        WR: gl.constexpr = 2 * WARPS  # rows one load instruction of the program covers
        REPS: gl.constexpr = CH // WR  # a thread's rows per chunk
        L3: gl.constexpr = gl.BlockedLayout([REPS, 1, 8], [1, 2, 16], [1, WARPS, 1], [2, 1, 0])
        RS: gl.constexpr = gl.SliceLayout(2, L3)  # one per row of a chunk
        CS: gl.constexpr = gl.SliceLayout(0, L3)  # a thread's column partials
        # transposed view [columns, rows]: 16 consecutive rows of one column per thread
        COL: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [WARPS, 1], [1, 0])
        cc = cb * B + gl.arange(0, B, layout=gl.SliceLayout(0, CS))
        c_ok = cc < C
        c3 = gl.expand_dims(gl.expand_dims(cc.to(gl.int64), 0), 0)
        c_ok3 = gl.expand_dims(gl.expand_dims(c_ok, 0), 0)
        rows = (gl.arange(0, REPS, layout=gl.SliceLayout(1, RS))[:, None] * WR
                + gl.arange(0, WR, layout=gl.SliceLayout(0, RS))[None, :])
        col_acc = gl.zeros([WR, B], gl.int32, layout=CS)
        # Both passes are real loops: unrolled, ptxas hoists the transposed pass's shared-memory
        # loads above it (210 registers, two programs per SM).
        for i in range(B // CH):
            rr = rb * B + i * CH + rows
            r_ok = rr < R
            r64 = rr.to(gl.int64)
            ok = r_ok[:, :, None] & c_ok3
            if IN_SMEM:
                xv = chunks.index(chunk0 + i).load(L3)
            else:
                xv = gl.load(x_rows + r64[:, :, None] * sxr + c3 * sxc, mask=ok, other=0.0)
                chunks.index(chunk0 + i).store(xv)
            v = xv.to(gl.float32)
            # amax on the float bits (abs clears the sign): integer order is float order for
            # non-negative floats, and NaN sorts above inf, so a NaN gives its cell a NaN scale
            bits = gl.abs(v).to(gl.int32, bitcast=True)
            col_acc = gl.maximum(col_acc, gl.max(bits, axis=0))
            row_scale = _g_scale_of(gl.max(bits, axis=2).to(gl.float32, bitcast=True), FP8_MAX, TINY)
            if STASH:
                stash.index(stash0 + i).store(row_scale)
            else:
                gl.store(s_ptr + g * ssg + r64 * ssr + cb * ssc, row_scale, mask=r_ok)
            neg_k, kr, r, s_res = _g_step_of(row_scale)
            q = _g_quotient_of(v, neg_k[:, :, None], kr[:, :, None], r[:, :, None], s_res[:, :, None], FP8_MAX)
            gl.store(q_ptr + g * sqg + r64[:, :, None] * sqr + c3, q.to(q_ptr.dtype.element_ty), mask=ok)
        col_scale = _g_scale_of(gl.max(col_acc, axis=0).to(gl.float32, bitcast=True), FP8_MAX, TINY)
        gl.store(st_ptr + g * stg + rb * str_ + cc.to(gl.int64) * stc, col_scale, mask=c_ok)
        # every warp holds all the column scales, so this min stays inside each warp; a NaN scale
        # is ignored by it and takes the lean form, which gives what the exact one gives
        tiny = gl.min(col_scale, axis=0) < 1.0e-18
        col_scale_t = gl.convert_layout(col_scale, gl.SliceLayout(1, COL))
        if not IN_SMEM:
            _cta_barrier()  # the whole tile is in shared memory before any warp reads it across

        ct = cb * B + gl.arange(0, B, layout=gl.SliceLayout(1, COL))
        ct_ok = ct < C
        qt_cols = qt_ptr + g * sqtg + ct.to(gl.int64)[:, None] * sqtc
        if tiny:
            for j in range(B // TCH):
                rt = rb * B + j * TCH + gl.arange(0, TCH, layout=gl.SliceLayout(0, COL))
                vt = slices.index(slice0 + j).permute([1, 0]).load(COL).to(gl.float32)
                qt = _g_to_fp8_exact(vt, col_scale_t[:, None], FP8_MAX)
                gl.store(qt_cols + rt.to(gl.int64)[None, :], qt.to(qt_ptr.dtype.element_ty),
                         mask=ct_ok[:, None] & (rt < R)[None, :])
        else:
            r_t, s_res_t = _g_step_operands(col_scale_t)
            for j in range(B // TCH):
                rt = rb * B + j * TCH + gl.arange(0, TCH, layout=gl.SliceLayout(0, COL))
                vt = slices.index(slice0 + j).permute([1, 0]).load(COL).to(gl.float32)
                qt = _g_to_fp8_lean(vt, r_t[:, None], s_res_t[:, None], FP8_MAX)
                gl.store(qt_cols + rt.to(gl.int64)[None, :], qt.to(qt_ptr.dtype.element_ty),
                         mask=ct_ok[:, None] & (rt < R)[None, :])

    @gluon.jit
    def _dual_quantize_runs_kernel(
        x_ptr, q_ptr, qt_ptr, s_ptr, st_ptr,
        R, C, n_rb,
        sxg, sxr, sxc, sqg, sqr, sqtg, sqtc, ssg, ssr, ssc, stg, str_, stc,
        B: gl.constexpr, CH: gl.constexpr, TCH: gl.constexpr, FP8_MAX: gl.constexpr,
        TINY: gl.constexpr, WARPS: gl.constexpr,
    ):
        # One program per tile, the tile read into shared memory by its own loads.
        pid = gl.program_id(0)
        g = (pid // n_rb).to(gl.int64)
        chunks = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [B // CH, CH // (2 * WARPS), 2 * WARPS, B],
                                           gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        slices = chunks._reinterpret(x_ptr.dtype.element_ty, [B // TCH, TCH, B],
                                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        _g_runs_tile(x_ptr + g * sxg, sxr, sxc, chunks, 0, slices, 0, q_ptr, qt_ptr, s_ptr, st_ptr, g, pid % n_rb,
                     gl.program_id(1), R, C, sqg, sqr, sqtg, sqtc, ssg, ssr, ssc, stg, str_, stc,
                     B, CH, TCH, FP8_MAX, TINY, WARPS, False)

    @gluon.jit
    def _strip_of(u, n_rb, n_strips):
        """(group, row block, strip) of work unit ``u`` of the TMA runs kernel: groups in turn,
        row blocks in turn, a row block's strips in turn (concurrent programs take consecutive
        units)."""
        per_group = n_rb * n_strips
        v = u % per_group
        return u // per_group, v // n_strips, v % n_strips

    @gluon.jit
    def _next_tile(u, c, n_rb, n_cb, n_strips, progs, SPAN: gl.constexpr):
        """The tile after tile ``c`` of unit ``u`` in a program's walk: the strip's next column
        block, else the first of the program's next unit (``progs`` on)."""
        strip = u % (n_rb * n_strips) % n_strips
        last = gl.minimum(n_cb - strip * SPAN, SPAN) - 1
        return gl.where(c < last, u, u + progs), gl.where(c < last, c + 1, 0)

    @gluon.jit
    def _flush_row_scales(stash_rows, buf, s_ptr, g, rb, strip, R, ssg, ssr,
                          B: gl.constexpr, SPAN: gl.constexpr, WARPS: gl.constexpr):
        """A strip's row scales (``stash_rows.index(buf)``, [SPAN, B]) to ``s_ptr`` ([G, R, n_cb]
        rows padded to 16 floats): each thread writes SPAN consecutive scales of one row as one
        aligned vector store, padding past n_cb included. Written one tile at a time, each scale
        would be a 4-byte store of its own, a partial 32-byte sector."""
        layout: gl.constexpr = gl.BlockedLayout([SPAN, 1], [1, 32], [1, WARPS], [0, 1])
        vals = stash_rows.index(buf).load(layout)
        rows = rb * B + gl.arange(0, B, layout=gl.SliceLayout(0, layout))
        cols = strip * SPAN + gl.arange(0, SPAN, layout=gl.SliceLayout(1, layout))
        ptrs = s_ptr + g * ssg + rows.to(gl.int64)[None, :] * ssr + cols[:, None]
        gl.store(ptrs, vals, mask=(rows < R)[None, :])

    @gluon.jit
    def _dual_quantize_runs_tma_kernel(
        x_desc, q_ptr, qt_ptr, s_ptr, st_ptr,
        R, C, n_rb, n_cb, n_tiles,
        sqg, sqr, sqtg, sqtc, ssg, ssr, ssc, stg, str_, stc,
        B: gl.constexpr, CH: gl.constexpr, TCH: gl.constexpr, FP8_MAX: gl.constexpr,
        TINY: gl.constexpr, WARPS: gl.constexpr, STAGES: gl.constexpr, SPAN: gl.constexpr = 0,
    ):
        # Persistent: a ring of STAGES tiles filled by TMA copies, so the next tiles stream in
        # while this one is quantised (the one-program-per-tile kernel waits on its own loads).
        # With SPAN, a work unit is a strip of SPAN column blocks of one row block, walked left to
        # right, its row scales kept in shared memory and written together at its end
        # (_flush_row_scales; two buffers, so the next strip's first tile need not wait for the
        # flush); without, a unit is one tile and each tile writes its own row scales.
        ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES, 1, B, B], x_desc.layout)
        chunks = ring._reinterpret(x_desc.dtype, [STAGES * (B // CH), CH // (2 * WARPS), 2 * WARPS, B],
                                   gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        slices = ring._reinterpret(x_desc.dtype, [STAGES * (B // TCH), TCH, B],
                                   gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        NSPAN: gl.constexpr = SPAN + (SPAN == 0)
        stash = gl.allocate_shared_memory(gl.float32, [2 * NSPAN * (B // CH), CH // (2 * WARPS), 2 * WARPS],
                                          gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        stash_rows = stash._reinterpret(gl.float32, [2, NSPAN, B], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        pid = gl.program_id(0)
        progs = gl.num_programs(0)
        if SPAN == 0:
            n_strips = n_cb
        else:
            n_strips = gl.cdiv(n_cb, SPAN)
        n_units = n_tiles // n_cb * n_strips
        # ua, ca: the next tile to load (unit, column block within its strip)
        ua = pid
        ca = 0
        for s in gl.static_range(STAGES):
            live = ua < n_units
            g0, rb0, strip0 = _strip_of(ua, n_rb, n_strips)
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes, pred=live)
            _tma_load(x_desc, [g0, rb0 * B, (strip0 * NSPAN + ca) * B], ready.index(s), ring.index(s), pred=live)
            ua, ca = _next_tile(ua, ca, n_rb, n_cb, n_strips, progs, NSPAN)
        u = pid
        c = 0
        it = 0
        done = 0  # units this program finished: the stash buffer alternates with it
        while u < n_units:
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            g, rb, strip = _strip_of(u, n_rb, n_strips)
            # the tile is in shared memory already (IN_SMEM), so no x pointer: q_ptr stands in
            _g_runs_tile(q_ptr, 0, 0, chunks, slot * (B // CH), slices, slot * (B // TCH), q_ptr, qt_ptr, s_ptr,
                         st_ptr, g.to(gl.int64), rb, strip * NSPAN + c, R, C, sqg, sqr, sqtg, sqtc, ssg, ssr, ssc,
                         stg, str_, stc, B, CH, TCH, FP8_MAX, TINY, WARPS, True, stash, ((done % 2) * NSPAN + c) * (B // CH), SPAN > 0)
            _cta_barrier()  # every warp is done with the slot (and the stash) before they are reused
            fence_async_shared()
            live = ua < n_units
            g1, rb1, strip1 = _strip_of(ua, n_rb, n_strips)
            mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes, pred=live)
            _tma_load(x_desc, [g1, rb1 * B, (strip1 * NSPAN + ca) * B], ready.index(slot), ring.index(slot),
                      pred=live)
            ua, ca = _next_tile(ua, ca, n_rb, n_cb, n_strips, progs, NSPAN)
            nu, c = _next_tile(u, c, n_rb, n_cb, n_strips, progs, NSPAN)
            if SPAN > 0:
                if nu != u:
                    _flush_row_scales(stash_rows, done % 2, s_ptr, g.to(gl.int64), rb, strip, R, ssg, ssr, B, SPAN,
                                      WARPS)
                    done += 1
            u = nu
            it += 1
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))

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
    def _g_step_of(scale):
        """``_quotient``'s per-scale operands, formed once per row, column or tile before any
        value is touched: (-k, k r, r, scale * k with inf and NaN as 0) for r = RN(1 / (scale k)).
        The products by k are exact (powers of two, far from the range's ends), which
        ``_g_quotient_of`` relies on."""
        k = _g_rescale(scale)
        r, s_res = _g_step_operands(scale * k)
        return k * -1.0, r * k, r, s_res

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
    def _g_store_t(qt8, base, r0, c0, R, C, sqtc, ROWS_: gl.constexpr, COLS_: gl.constexpr, LT: gl.constexpr):
        """Stores ``qt8`` (layout LT; rows r0.. x columns c0.. of the tile) transposed at ``base``."""
        rt = r0 + gl.arange(0, ROWS_, layout=gl.SliceLayout(1, LT))
        ct = c0 + gl.arange(0, COLS_, layout=gl.SliceLayout(0, LT))
        okt = (rt < R)[:, None] & (ct < C)[None, :]
        gl.store(base + ct.to(gl.int64)[None, :] * sqtc + rt.to(gl.int64)[:, None], qt8, mask=okt)

    @gluon.jit
    def _dual_quantize_tiles_kernel(
        x_ptr, q_ptr, qt_ptr, s_ptr, st_ptr,
        R, C, n_rb,
        sxg, sxr, sxc, sqg, sqr, sqtg, sqtc, ssg, ssr, ssc, stg, str_, stc,
        B: gl.constexpr, L: gl.constexpr, LT: gl.constexpr, FP8_MAX: gl.constexpr, TINY: gl.constexpr,
    ):
        # L and LT (register_layouts) cover the B x B tile: each thread holds a few consecutive
        # rows x 8 consecutive columns. Its 16-byte row pieces load coalesced, and each of its
        # columns is one vector store of the transposed copy. LT names the same elements with the
        # rows fastest in the registers, so moving there renames registers; nothing crosses
        # threads. (st_ptr and the scale_t strides are unused: the tiles' scales serve both copies.)
        pid = gl.program_id(0)
        cb = gl.program_id(1)
        g = (pid // n_rb).to(gl.int64)
        rb = pid % n_rb
        rr = rb * B + gl.arange(0, B, layout=gl.SliceLayout(1, L))
        cc = cb * B + gl.arange(0, B, layout=gl.SliceLayout(0, L))
        r64 = rr.to(gl.int64)
        ok = (rr < R)[:, None] & (cc < C)[None, :]
        xv = gl.load(x_ptr + g * sxg + r64[:, None] * sxr + cc.to(gl.int64)[None, :] * sxc, mask=ok, other=0.0)
        bits = _g_magnitude_bits(xv)
        scale = _g_scale_of(_g_amax_of_bits(gl.max(gl.max(bits, axis=1), axis=0), xv), FP8_MAX, TINY)
        gl.store(s_ptr + g * ssg + rb * ssr + cb * ssc, scale)
        neg_k, kr, r, s_res = _g_step_of(scale)
        v = xv.to(gl.float32)  # after the divisions: not held across their slow-path branches
        q = _g_quotient_of(v, neg_k, kr, r, s_res, FP8_MAX)
        gl.store(q_ptr + g * sqg + r64[:, None] * sqr + cc.to(gl.int64)[None, :], q.to(q_ptr.dtype.element_ty),
                 mask=ok)
        # the renaming moves the float32 values and the fp8 bytes are packed after it: renaming
        # the packed bytes gave a wrong transposed copy under triton 3.6
        qt8 = gl.convert_layout(q, LT).to(qt_ptr.dtype.element_ty)
        _g_store_t(qt8, qt_ptr + g * sqtg, rb * B, cb * B, R, C, sqtc, B, B, LT)


def register_layouts(rows: int, warps: int, block: int = BLOCK):
    """The two layouts of ``_dual_quantize_tiles_kernel`` over a ``block`` x ``block`` tile, each
    thread holding ``rows`` consecutive rows x 8 consecutive columns: ``L`` with the columns
    fastest in its registers (the load and the row copy's store), and ``LT``, the same elements
    on the same threads with the rows fastest (the transposed copy's store). A blocked layout
    with the rows fastest would also lay the lanes along the rows, and the conversion would cross
    threads."""
    lanes_c = block // 8
    lanes_r = 32 // max(lanes_c, 1)
    if rows * lanes_r * warps != block or lanes_c * lanes_r != 32 or any(n & (n - 1) for n in (rows, warps)):
        raise ValueError(f"register_layouts: rows x lanes along rows x warps must be {block} with 8-column "
                         f"pieces, powers of two (got rows {rows}, warps {warps})")
    lay = gl.BlockedLayout([rows, 8], [lanes_r, lanes_c], [warps, 1], [1, 0])
    regs = [[1 << i, 0] for i in range(rows.bit_length() - 1)] + [[0, 1], [0, 2], [0, 4]]
    lanes = [[0, 8 << i] for i in range(lanes_c.bit_length() - 1)]
    lanes += [[rows << i, 0] for i in range(lanes_r.bit_length() - 1)]
    warp_bases = [[rows * lanes_r << i, 0] for i in range(warps.bit_length() - 1)]
    return lay, gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [block, block])


def available(x: torch.Tensor, block: int) -> str | None:
    """None when these kernels can quantise ``x`` with ``block``, else why not."""
    if block != BLOCK:
        return f"the Gluon dual quantiser is laid out for block {BLOCK} (got {block})"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"the Gluon dual quantiser reads bfloat16 or float16 (got {x.dtype})"
    if x.device.type != "cuda":
        return "the Gluon dual quantiser needs a CUDA tensor"
    return _gluon_available(x.device.index)


def _units(row_blocks: int, n_c: int, span: int) -> int:
    """Work units of the TMA runs kernel: strips of ``span`` column blocks (one tile each at 0)."""
    return row_blocks * -(-n_c // max(span, 1))


def _span(scale: torch.Tensor, row_blocks: int, programs: int) -> int:
    """The strip width of the TMA runs kernel (RUNS_SPANS, RUNS_MIN_UNITS) for row scales
    ``scale`` ([G, R, n_c]) over ``row_blocks`` (G x row blocks) and ``programs`` programs: 0
    unless their rows have the padding the strips' vector stores write (unit column stride, a row
    stride that is a multiple of 16 floats)."""
    n_c = scale.shape[2]
    if scale.stride(2) != 1 or scale.stride(1) % 16:
        return 0
    for span in RUNS_SPANS:
        if _units(row_blocks, n_c, span) >= RUNS_MIN_UNITS * programs and scale.stride(1) >= -(-n_c // span) * span:
            return span
    return 0


@functools.lru_cache(maxsize=None)
def _layouts(rows: int, warps: int):
    return register_layouts(rows, warps)


@functools.lru_cache(maxsize=None)
def _unswizzled_layout():
    """The TMA runs kernel's shared layout for its 16-bit [1, B, B] input tiles, built once: the
    same for every call, and its construction (validated on creation) is host time per launch."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)


@functools.lru_cache(maxsize=None)
def _launchers() -> tuple[CallKeyedKernel, CallKeyedKernel]:
    """The tiles and TMA runs kernels' pre-bound launchers (prebound.py): no per-call binding."""
    pointers = ("q_ptr", "qt_ptr", "s_ptr", "st_ptr")
    return (CallKeyedKernel(_dual_quantize_tiles_kernel, ("x_ptr", *pointers)),
            CallKeyedKernel(_dual_quantize_runs_tma_kernel, ("x_desc", *pointers)))


def launch(x, data, data_t, scale, scale_t, fp8_max: float, tiny: float, tile_2d: bool = False) -> None:
    """Fill ``data``, ``scale``, ``data_t``, ``scale_t`` (laid out by ``dual_quantize``) from ``x``:
    token runs (``tile_2d`` False) by the runs kernel, 2-D tiles by the tiles kernel."""
    prepare(x, data, data_t, scale, scale_t, fp8_max, tiny, tile_2d)


def prepare(x, data, data_t, scale, scale_t, fp8_max: float, tiny: float, tile_2d: bool = False):
    """``launch`` now, and ``relaunch(x, data, data_t, scale, scale_t)`` for later calls whose
    tensors match these in dtype, shape, strides, device and 16-byte alignment (the caller's key
    holds them), launched through this call's pre-bound plan without the per-call key (the TMA
    runs kernel's descriptor rebuilt without validation); None where this launch has no
    pre-bound plan (the pointer runs kernel)."""
    g, r, c = x.shape
    n_r, n_c = -(-r // BLOCK), -(-c // BLOCK)
    args = kernel_args(x, data, data_t, scale, scale_t, BLOCK)
    if tile_2d:
        rows, warps, maxnreg = TILES_LAUNCH
        lay, lay_t = _layouts(rows, warps)
        return _launchers()[0].launch_and_plan((g * n_r, n_c), args, dict(
            B=BLOCK, L=lay, LT=lay_t, FP8_MAX=fp8_max, TINY=tiny, num_warps=warps,
            **({"maxnreg": maxnreg} if maxnreg else {})))
    chunk, t_chunk, warps, maxnreg = LAUNCH
    if tma_ok(x):
        stages, per_sm, maxnreg = TMA_RUNS  # the TMA form's own register cap
        layout = _unswizzled_layout()
        bind_cuda_context(x)
        desc = GluonDescriptor(x, list(x.shape), list(x.stride()), [1, BLOCK, BLOCK], layout)
        n_tiles = g * n_r * n_c
        programs = per_sm * num_programs(x.device.index)
        span = _span(scale, g * n_r, programs)
        grid = min(_units(g * n_r, n_c, span), programs)
        plan = _launchers()[1].launch_and_plan((grid,), (desc, *args[1:5], r, c, n_r, n_c, n_tiles, *args[11:]), dict(
            B=BLOCK, CH=chunk, TCH=t_chunk, FP8_MAX=fp8_max, TINY=tiny, WARPS=warps, STAGES=stages, SPAN=span,
            num_warps=warps, **({"maxnreg": maxnreg} if maxnreg else {})))
        x_desc = rebaser(desc)

        def relaunch(x, data, data_t, scale, scale_t) -> None:
            bind_cuda_context(x)
            plan(x_desc(x), data, data_t, scale, scale_t)

        return relaunch
    _dual_quantize_runs_kernel[(g * n_r, n_c)](
        *args, B=BLOCK, CH=chunk, TCH=t_chunk, FP8_MAX=fp8_max, TINY=tiny, WARPS=warps, num_warps=warps,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    return None

