"""Warp-specialised blockwise fp8 wgrad (variable K) for Hopper in Gluon.

``out[g] = dequant(x_g)^T @ dequant(y_g)``: the reduction runs over group ``g``'s tokens
``[offs[g], offs[g + 1])``, read on the device. Both operands are token-contiguous fp8 (``x``
stored ``[M, T]``, ``y`` ``[N, T]``: K-major, as the fp8 wgmma reads them) with one fp32 scale per
column and ``QBLOCK``-token run, the runs aligned to the *global* token index as TORCH's
``quantize(t, axis=0)`` defines them (so one run may straddle two groups, and its scale serves
both). The output ``[G, M, N]`` is written whole: an empty group gets exact zeros.

Why a second warp-specialised kernel: the Triton variable-K kernel waits for every K step's
wgmma with all of its warps before it promotes, so the tensor cores idle during each promotion,
and the wgrad's promotion is twice the forward's work (both scales are vectors:
``acc += part * sx[:, None] * sy[None, :]``), so it ran at little more than half the
warp-specialised forward's rate (docs/kernels.md). This kernel reuses the forward's design
(``fp8_blockwise_gluon_ws``): one loader warp fills a ring of shared-memory slots by TMA, two math
warpgroups own 64 rows of the 128-row tile each and synchronise only through mbarriers, so one
warpgroup's promotion runs on the CUDA cores while the other's wgmma runs.

What differs from the forward:

* Work items are (group, row tile, column tile) of the output, a static count. Persistent
  programs take them in order from a device counter as they free up (the loader takes one and
  hands its id to the math warpgroups through a small ring in shared memory): a work item's cost
  is its group's token count, so a fixed share per program (every NUM_PROGS-th item) would follow
  the routing. Each tile's K loop covers its group's tokens on the global ``BLOCK_K`` grid
  (``BLOCK_K`` divides ``QBLOCK``, so a step lies in one scale run).
* Edge steps, the partial first and last step of a group, hold tokens of the neighbouring groups.
  Before their wgmma the two math warpgroups zero those tokens in shared memory (a 32-bit word at
  a time), each its own 64 rows of ``x`` and half of ``y``'s rows, and meet on an mbarrier
  (``edge``) so neither reads the other's half before it is zeroed. Both operands are zeroed,
  not one: with one, a non-finite value in a neighbouring group's tokens would leak in as
  ``0 * inf = NaN``. Interior steps, all but at most two per tile, pay nothing.
* Scales are per column on both sides, so the promotion needs a row-scale and a column-scale
  vector every K step: the loader copies both into the step's ring slot (cp.async, completed on
  the slot's ``ready`` barrier) and the math warpgroups read them from shared memory while their
  wgmma runs, rather than each loading them from global memory every step.

Needs triton >= 3.6 with Gluon and an sm_90 GPU; ``fp8_blockwise_gluon.available`` says why not.
"""
from __future__ import annotations

import functools

import torch

from .fp8_blockwise_gluon import available, device_error, gluon, make_descriptor
from .fp8_blockwise_gluon_ws import LOAD_REGS, MATH_REGS, MAXNREG, SMEM_PER_CTA, output_descriptor, tma_storable
from .gemm_kernels import bind_cuda_context, num_programs, tma_ok
from .prebound import CallKeyedKernel, rebaser
from .work_counters import zeroed_counter

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    from .fp8_blockwise_gluon import _cta_barrier, _promote, _tile_coords, _tma_load
    from .fp8_blockwise_gluon_ws import _cp_async, _store_tile

    # triton 3.6 names the shared-memory view cast _reinterpret; later ones reinterpret.
    _PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

#: Bumped whenever the kernel's code changes, so stored tuning results are invalidated.
KERNEL_REVISION = "gluon-wgrad-r6"
#: Slots of the ring of work-item ids the loader hands the math warpgroups: enough for the loader
#: to take the next items while both math warpgroups finish the current one.
TILE_SLOTS = 4


def smem_bytes(cfg, out_bytes: int, tma_store: bool) -> int:
    """Shared memory the kernel allocates for ``cfg`` (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages,
    ...): the fp8 ring, each slot's fp32 row and column scales, two mbarriers per slot plus the edge
    barrier and, with TMA stores, one [64, BLOCK_N] staging buffer of ``out_bytes`` elements per
    math warpgroup, each allocation rounded up to 1 KiB (a 128-byte swizzle's alignment)."""
    bm, bn, bk, _, stages = cfg[:5]
    parts = [stages * bm * bk, stages * bn * bk, stages * bm * 4, stages * bn * 4, 2 * stages * 8 + 8,
             TILE_SLOTS * 4, 2 * TILE_SLOTS * 8]
    parts.append(2 * (bm // 2) * bn * out_bytes if tma_store else 8)
    return sum(-(-p // 1024) * 1024 for p in parts)


def config_error(cfg, qblock: int) -> str | None:
    """Why ``cfg`` (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps[, ...]) cannot run this kernel
    for token runs of ``qblock``, or None.

    The tile is two math warpgroups (8 math warps) of 64 or 128 rows each (BLOCK_M 128 or 256; a
    128-row warpgroup keeps two 64-row accumulators), at most 128 columns; a K step must lie in
    one scale run. No 256-column tile (two accumulators along N, as the forward has): with a
    column-scale vector per thread next to them it spilled 146 loads/stores inside the wgmma loop
    (sm_90, triton 3.6, tools/compile_sm90.py). The 256-row tile shares one column-scale vector
    between its accumulators."""
    bm, bn, bk, _, stages, warps = cfg[:6]
    occupancy = cfg[6] if len(cfg) > 6 and cfg[6] is not None else 1
    if bm not in (128, 256) or warps != 8:
        return (f"the tile must be 128 or 256 rows in two math warpgroups (8 warps), got {bm} rows, "
                f"{warps} warps")
    if bn % 32 or not 32 <= bn <= 128:
        return f"BLOCK_N must be a multiple of 32 in [32, 128] (one accumulator wide), got {bn}"
    if bk % 32 or bk < 32 or qblock % bk:
        return f"BLOCK_K must be a multiple of 32 (the fp8 wgmma K) dividing the scale block {qblock}, got {bk}"
    if stages < 2:
        return f"num_stages must be >= 2, got {stages}"
    if occupancy != 1:
        return f"occupancy must be 1 (the three warpgroups use the whole register file), got {occupancy}"
    if smem_bytes(cfg, 4, False) > SMEM_PER_CTA:
        return f"{stages} stages of a {bm} x {bn} x {bk} tile need more than {SMEM_PER_CTA} bytes of shared memory"
    return None


if gluon is not None:

    @gluon.jit
    def _token_steps(offs_ptr, g, BLOCK_K: gl.constexpr):
        """Group ``g``'s first and last token and its K steps ``[kb0, kb1)`` on the global grid
        (none for an empty group, whatever its offset)."""
        start = gl.load(offs_ptr + g).to(gl.int32)
        end = gl.load(offs_ptr + g + 1).to(gl.int32)
        kb0 = start // BLOCK_K
        kb1 = gl.where(end > start, gl.cdiv(end, BLOCK_K), kb0)
        return start, end, kb0, kb1

    @gluon.jit
    def _work_item(t, num_m, num_n, GROUP_M: gl.constexpr):
        """Group, row tile and column tile of work item ``t`` (groups in order, each grouped by
        ``GROUP_M`` row tiles so that neighbouring programs share operand tiles in L2)."""
        per_group = num_m * num_n
        g = t // per_group
        pid_m, pid_n = _tile_coords(t % per_group, num_m, num_n, GROUP_M)
        return g, pid_m, pid_n

    @gluon.jit
    def _put_tile(tiles, tready, tfree, i, t):
        """The loader hands work item ``t`` to the math warpgroups in slot ``i`` of the id ring."""
        one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        NT: gl.constexpr = tiles.shape[0]
        slot = i % NT
        mbarrier.wait(tfree.index(slot), ((i // NT) & 1) ^ 1)
        tiles.index(slot).store(gl.full([1], t, gl.int32, one))
        mbarrier.arrive(tready.index(slot), count=1)

    @gluon.jit
    def _take_tile(tiles, tready, tfree, i):
        """A math warpgroup's ``i``-th work item from the id ring (its slot freed once read)."""
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        NT: gl.constexpr = tiles.shape[0]
        slot = i % NT
        mbarrier.wait(tready.index(slot), (i // NT) & 1)
        t = gl.max(tiles.index(slot).load(one), 0)
        mbarrier.arrive(tfree.index(slot), count=1)
        return t

    @gluon.jit
    def _wg_load(x_desc, y_desc, c, c_desc, sx_ptr, sy_ptr, offs_ptr, x_bufs, y_bufs, sx_bufs, sy_bufs, c_smem,
                 ready, empty, edge, tiles, tready, tfree, counter_ptr, G, M, N, sc_m, sc_n, ssx_k, ssx_m,
                 ssy_k, ssy_n,
                 QBLOCK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 GROUP_M: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr):
        """The loader: fills slot ``step % STAGES`` once both math warpgroups released it. Boxes
        past the operand's end (rows past M or N, tokens past T) are zero-filled by TMA; the
        step's scales follow (zeros past M and N)."""
        num_m = gl.cdiv(M, BLOCK_M)
        num_n = gl.cdiv(N, BLOCK_N)
        total = G * num_m * num_n
        step = 0
        # Work items in order, each taken by whichever program is free first (the counter is zero
        # at launch), so that concurrent programs still share operand tiles in L2 while a program's
        # share of the tokens no longer follows the routing; then one id past the end tells the
        # math warpgroups to stop.
        i = 0
        t = gl.atomic_add(counter_ptr, 1, sem="relaxed")
        while t < total:
            _put_tile(tiles, tready, tfree, i, t)
            step = _load_tile(x_desc, y_desc, sx_ptr, sy_ptr, offs_ptr, x_bufs, y_bufs, sx_bufs, sy_bufs, ready, empty,
                              t, step, M, N, num_m, num_n, ssx_k, ssx_m, ssy_k, ssy_n, QBLOCK, BLOCK_M, BLOCK_N,
                              BLOCK_K, GROUP_M, STAGES)
            i += 1
            t = gl.atomic_add(counter_ptr, 1, sem="relaxed")
        _put_tile(tiles, tready, tfree, i, total)

    @gluon.jit
    def _load_tile(x_desc, y_desc, sx_ptr, sy_ptr, offs_ptr, x_bufs, y_bufs, sx_bufs, sy_bufs, ready, empty, t, step,
                   M, N, num_m, num_n, ssx_k, ssx_m, ssy_k, ssy_n, QBLOCK: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """The loader's K steps of work item ``t``, from the flattened step ``step``; returns the
        step after them."""
        sx_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
        sy_layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
        g, pid_m, pid_n = _work_item(t, num_m, num_n, GROUP_M)
        start, end, kb0, kb1 = _token_steps(offs_ptr, g, BLOCK_K)
        for kb in range(kb0, kb1):
            slot = step % STAGES
            # A fresh mbarrier counts as having completed the phase before phase 0, so the
            # first pass over the ring does not wait.
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            # Every thread's copies hold the slot's phase open until they land (the arrive adds
            # one pending arrival and completes it), so they go before the TMA bytes.
            kq = (kb * BLOCK_K) // QBLOCK
            rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=sx_layout)
            _cp_async(sx_bufs.index(slot), sx_ptr + kq * ssx_k + rows * ssx_m, mask=rows < M)
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=sy_layout)
            _cp_async(sy_bufs.index(slot), sy_ptr + kq * ssy_k + cols * ssy_n, mask=cols < N)
            async_copy.mbarrier_arrive(bar, increment_count=True)
            mbarrier.expect(bar, x_desc.block_type.nbytes + y_desc.block_type.nbytes)
            _tma_load(x_desc, [pid_m * BLOCK_M, kb * BLOCK_K], bar, x_bufs.index(slot))
            _tma_load(y_desc, [pid_n * BLOCK_N, kb * BLOCK_K], bar, y_bufs.index(slot))
            step += 1
        return step

    @gluon.jit
    def _as_words(bufs, BLOCK_K: gl.constexpr):
        """The fp8 ring ``bufs`` ([STAGES, rows, BLOCK_K] in shared memory) viewed as 32-bit words
        ([STAGES, rows, BLOCK_K // 4]: the same bytes under the same swizzle). The whole ring is
        reinterpreted, not a slot of it: newer Triton refuses to reinterpret a subview."""
        words_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=bufs.layout.swizzle_byte_width,
                                                        element_bitwidth=32, rank=2)
        shape: gl.constexpr = [bufs.shape[0], bufs.shape[1], BLOCK_K // 4]
        if _PUBLIC_REINTERPRET:
            return bufs.reinterpret(gl.int32, shape, words_smem)
        else:
            return bufs._reinterpret(gl.int32, shape, words_smem)

    @gluon.jit
    def _zero_outside(words, k0, start, end, BLOCK_K: gl.constexpr):
        """Zero the tokens of ``words`` (a [rows, BLOCK_K] fp8 tile in shared memory seen as
        [rows, BLOCK_K // 4] 32-bit words, tokens ``k0`` on) outside ``[start, end)``, on the bits,
        so that no float conversion is involved.

        Each word is ANDed with a byte mask of its four tokens in range: selecting byte by byte
        costs a SEL and two PRMTs per byte (sm_90 SASS), about three interior steps' worth."""
        WORDS: gl.constexpr = BLOCK_K // 4
        # 16 bytes per thread, a row's words across BLOCK_K // 16 lanes.
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (BLOCK_K // 16), BLOCK_K // 16], [4, 1], [1, 0])
        vals = words.load(layout)
        tok = k0 + 4 * gl.arange(0, WORDS, layout=gl.SliceLayout(0, layout))
        # Little-endian: byte j of a word is token tok + j; bits [lo, hi) are kept. Shifts stay
        # below 32 (a 32-bit shift by 32 is undefined).
        lo = gl.minimum(gl.maximum(start - tok, 0), 4) * 8
        hi = gl.minimum(gl.maximum(end - tok, 0), 4) * 8
        ones = gl.full_like(tok, -1)
        keep_lo = gl.where(lo >= 32, gl.zeros_like(tok), ones << gl.minimum(lo, 24))
        keep_hi = gl.where(hi >= 32, ones, (gl.full_like(tok, 1) << gl.minimum(hi, 24)) - 1)
        words.store(vals & (keep_lo & keep_hi)[None, :])

    @gluon.jit
    def _wg_math(x_desc, y_desc, c, c_desc, sx_ptr, sy_ptr, offs_ptr, x_bufs, y_bufs, sx_bufs, sy_bufs, c_smem,
                 ready, empty, edge, tiles, tready, tfree, counter_ptr, G, M, N, sc_m, sc_n, ssx_k, ssx_m,
                 ssy_k, ssy_n,
                 QBLOCK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 GROUP_M: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr, WG: gl.constexpr):
        """Math warpgroup ``WG``: rows ``WG * BLOCK_M / 2`` on of every tile, BLOCK_M / 2 of them."""
        ROWS: gl.constexpr = BLOCK_M // 2
        num_m = gl.cdiv(M, BLOCK_M)
        num_n = gl.cdiv(N, BLOCK_N)
        total = G * num_m * num_n
        step = 0
        edges = 0
        i = 0
        t = _take_tile(tiles, tready, tfree, i)
        while t < total:
            g, pid_m, pid_n = _work_item(t, num_m, num_n, GROUP_M)
            start, end, kb0, kb1 = _token_steps(offs_ptr, g, BLOCK_K)
            step, edges = _wg_tile(x_bufs, y_bufs, sx_bufs, sy_bufs, ready, empty, edge, c, c_desc, c_smem.index(WG),
                                   sx_ptr, sy_ptr, step, edges, kb0, kb1, start, end, g, pid_m * BLOCK_M + WG * ROWS,
                                   pid_n * BLOCK_N, M, N, sc_m, sc_n, ssx_k, ssx_m, ssy_k, ssy_n, QBLOCK, ROWS,
                                   BLOCK_N, BLOCK_K, STAGES, TMA_STORE, WG)
            i += 1
            t = _take_tile(tiles, tready, tfree, i)
        if TMA_STORE:
            # The staging buffer must stay valid until the last store has read it.
            tma.store_wait(0)

    @gluon.jit
    def _wg_tile(x_bufs, y_bufs, sx_bufs, sy_bufs, ready, empty, edge, c, c_desc, c_buf, sx_ptr, sy_ptr, step, edges,
                 kb0, kb1, start, end, g, off_m, off_n, M, N, sc_m, sc_n, ssx_k, ssx_m, ssy_k, ssy_n,
                 QBLOCK: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 STAGES: gl.constexpr, TMA_STORE: gl.constexpr, WG: gl.constexpr):
        """One math warpgroup's ``ROWS`` rows (64, or 128 as two 64-row accumulators) of one output
        tile (columns ``off_n`` on) over K steps ``[kb0, kb1)``, then stored. Returns the flattened
        step and edge count after the tile."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        PARTS: gl.constexpr = ROWS // 64
        zero = gl.zeros((64, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        acc = zero
        acc1 = zero
        x_words = _as_words(x_bufs, BLOCK_K)
        y_words = _as_words(y_bufs, BLOCK_K)
        for kb in range(kb0, kb1):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            x_rows = x_bufs.index(slot).slice(WG * ROWS, ROWS)
            y_tile = y_bufs.index(slot)
            k0 = kb * BLOCK_K
            if (k0 < start) | (k0 + BLOCK_K > end):
                _zero_outside(x_words.index(slot).slice(WG * ROWS, ROWS), k0, start, end, BLOCK_K)
                _zero_outside(y_words.index(slot).slice(WG * (BLOCK_N // 2), BLOCK_N // 2), k0, start, end, BLOCK_K)
                # Every thread's generic-proxy writes must reach the async proxy (the wgmma) and
                # the other warpgroup, which reads this warpgroup's half of y.
                fence_async_shared()
                _cta_barrier()
                mbarrier.arrive(edge, count=1)
                mbarrier.wait(edge, edges & 1)
                edges += 1
            part = warpgroup_mma(x_rows.slice(0, 64), y_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
            # The scales are read while the wgmma runs.
            sx = _slot_scales(sx_bufs, slot, WG * ROWS, 64, rows_layout)
            sy = _slot_scales(sy_bufs, slot, 0, BLOCK_N, cols_layout)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            if PARTS == 1:
                # The slot is read: hand it back before promoting, so the next load starts now.
                mbarrier.arrive(empty.index(slot), count=1)
            acc = _promote(acc, part, sx, sy, False, False)
            if PARTS == 2:
                part = warpgroup_mma(x_rows.slice(64, 64), y_tile.permute((1, 0)), zero, use_acc=False,
                                     is_async=True)
                sx = _slot_scales(sx_bufs, slot, WG * ROWS + 64, 64, rows_layout)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                mbarrier.arrive(empty.index(slot), count=1)
                acc1 = _promote(acc1, part, sx, sy, False, False)
            step += 1
        # The output is viewed [G * M, N]: this group's rows end at (g + 1) * M. Both halves are
        # narrowed before either is stored (two fp32 halves plus addresses would not fit).
        out0 = acc.to(c.dtype.element_ty)
        if PARTS == 2:
            out1 = acc1.to(c.dtype.element_ty)
        _store_tile(c, c_desc, c_buf, out0, g * M + off_m, off_n, g * M + M, N, sc_m, sc_n, TMA_STORE)
        if PARTS == 2:
            _store_tile(c, c_desc, c_buf, out1, g * M + off_m + 64, off_n, g * M + M, N, sc_m, sc_n, TMA_STORE)
        return step, edges

    @gluon.jit
    def _slot_scales(bufs, slot, first, COUNT: gl.constexpr, layout: gl.constexpr):
        """The step's ``COUNT`` row (or column) scales from entry ``first`` of the copy the loader
        made in ring slot ``slot`` (zeros past M or N)."""
        return bufs.index(slot).slice(first, COUNT).load(layout)

    # One wrapper per math warpgroup: a worker partition takes the loader's argument list, so the
    # warpgroup index is fixed here rather than passed.
    @gluon.jit
    def _wg_math0(x_desc, y_desc, c, c_desc, sx_ptr, sy_ptr, offs_ptr, x_bufs, y_bufs, sx_bufs, sy_bufs, c_smem,
                  ready, empty, edge, tiles, tready, tfree, counter_ptr, G, M, N, sc_m, sc_n, ssx_k, ssx_m,
                 ssy_k, ssy_n,
                  QBLOCK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr):
        _wg_math(x_desc, y_desc, c, c_desc, sx_ptr, sy_ptr, offs_ptr, x_bufs, y_bufs, sx_bufs, sy_bufs, c_smem,
                 ready, empty, edge, tiles, tready, tfree, counter_ptr, G, M, N, sc_m, sc_n, ssx_k, ssx_m, ssy_k, ssy_n,
                 QBLOCK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TMA_STORE, 0)

    @gluon.jit
    def _wg_math1(x_desc, y_desc, c, c_desc, sx_ptr, sy_ptr, offs_ptr, x_bufs, y_bufs, sx_bufs, sy_bufs, c_smem,
                  ready, empty, edge, tiles, tready, tfree, counter_ptr, G, M, N, sc_m, sc_n, ssx_k, ssx_m,
                 ssy_k, ssy_n,
                  QBLOCK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr):
        _wg_math(x_desc, y_desc, c, c_desc, sx_ptr, sy_ptr, offs_ptr, x_bufs, y_bufs, sx_bufs, sy_bufs, c_smem,
                 ready, empty, edge, tiles, tready, tfree, counter_ptr, G, M, N, sc_m, sc_n, ssx_k, ssx_m, ssy_k, ssy_n,
                 QBLOCK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TMA_STORE, 1)

    @gluon.jit
    def _fp8_blockwise_wgrad_kernel(x_desc, y_desc, c, c_desc, sx_ptr, sy_ptr, offs_ptr, counter_ptr, G, M, N, sc_m,
                                    sc_n, ssx_k, ssx_m, ssy_k, ssy_n, QBLOCK: gl.constexpr,
                                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                                    GROUP_M: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr,
                                    TILE_SLOTS: gl.constexpr, MATH_REGS: gl.constexpr, LOAD_REGS: gl.constexpr):
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        y_bufs = gl.allocate_shared_memory(y_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], y_desc.layout)
        # Each slot's row and column scales.
        sx_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        sy_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        if TMA_STORE:
            c_shape: gl.constexpr = [2, c_desc.block_type.shape[0], c_desc.block_type.shape[1]]
            c_smem = gl.allocate_shared_memory(c_desc.dtype, c_shape, c_desc.layout)
        else:
            # Pointer stores: c_desc is a placeholder and the buffer is never touched.
            c_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        edge = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        # The ring of work-item ids the loader hands the math warpgroups.
        tiles = gl.allocate_shared_memory(gl.int32, [TILE_SLOTS, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        tready = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
        tfree = gl.allocate_shared_memory(gl.int64, [TILE_SLOTS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            # One arrival per math warpgroup.
            mbarrier.init(empty.index(s), count=2)
        mbarrier.init(edge, count=2)
        for s in gl.static_range(TILE_SLOTS):
            mbarrier.init(tready.index(s), count=1)
            mbarrier.init(tfree.index(s), count=2)
        # The argument tuple is spelled out at each use: assigned to a variable, its constexpr
        # entries would become tensors (triton 3.6).
        gl.warp_specialize([
            (_wg_math0, (x_desc, y_desc, c, c_desc, sx_ptr, sy_ptr, offs_ptr, x_bufs, y_bufs, sx_bufs, sy_bufs,
                         c_smem, ready, empty, edge, tiles, tready, tfree, counter_ptr, G, M, N, sc_m, sc_n, ssx_k,
                         ssx_m, ssy_k, ssy_n, QBLOCK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TMA_STORE)),
            (_wg_math1, (x_desc, y_desc, c, c_desc, sx_ptr, sy_ptr, offs_ptr, x_bufs, y_bufs, sx_bufs, sy_bufs,
                         c_smem, ready, empty, edge, tiles, tready, tfree, counter_ptr, G, M, N, sc_m, sc_n, ssx_k,
                         ssx_m, ssy_k, ssy_n, QBLOCK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TMA_STORE)),
            (_wg_load, (x_desc, y_desc, c, c_desc, sx_ptr, sy_ptr, offs_ptr, x_bufs, y_bufs, sx_bufs, sy_bufs,
                        c_smem, ready, empty, edge, tiles, tready, tfree, counter_ptr, G, M, N, sc_m, sc_n, ssx_k,
                        ssx_m, ssy_k, ssy_n, QBLOCK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, TMA_STORE)),
        ], [4, 1], [MATH_REGS, LOAD_REGS])


def tma_store_ok(c2: torch.Tensor, cfg) -> bool:
    """Whether the epilogue can store the output ``c2`` (``out`` viewed [G * M, N]) by TMA: the
    forward's layout rule (``fp8_blockwise_gluon_ws.tma_storable``) and room for the staging
    buffers next to this kernel's ring."""
    return tma_storable(c2) and smem_bytes(cfg, c2.element_size(), True) <= SMEM_PER_CTA


def fp8_blockwise_wgrad(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, offs: torch.Tensor,
                        sx: torch.Tensor, sx_strides, sy: torch.Tensor, sy_strides, cfg,
                        qblock: int = 128) -> torch.Tensor:
    """``out[g] = dequant(x[s_g:e_g])^T @ dequant(y[s_g:e_g])`` for every group, the boundaries
    ``offs`` (int32/int64, G + 1 entries) read on the device (no host sync).

    ``x`` [T, M] and ``y`` [T, N] are token-contiguous fp8 views (token stride 1, the other stride
    16-byte aligned: the dual quantiser's transposed runs); ``sx``/``sy`` hold one scale per
    ``qblock``-token run and column, at (run, column) strides ``sx_strides``/``sy_strides``.
    ``out`` is [G, M, N], contiguous; every element is written. Raises ValueError naming the reason
    when the kernel cannot run here or ``cfg`` does not suit it.

    >>> fp8_blockwise_wgrad(qx, qy, out, offs, sx, sx.stride(), sy, sy.stride(),
    ...                     (128, 128, 128, 8, 5, 8))  # doctest: +SKIP
    """
    T, M = x.shape
    G, Mo, N = out.shape
    if y.shape[0] != T or (Mo, N) != (M, y.shape[1]):
        raise ValueError(f"fp8_blockwise_wgrad: x is {tuple(x.shape)}, y {tuple(y.shape)}, out {tuple(out.shape)}; "
                         "need x [T, M], y [T, N], out [G, M, N]")
    if offs.numel() != G + 1:
        raise ValueError(f"fp8_blockwise_wgrad: offs must have G + 1 = {G + 1} entries, got {offs.numel()}")
    if not out.is_contiguous():
        raise ValueError("fp8_blockwise_wgrad: out must be contiguous")
    why = (available(x.device.index) or device_error(x=x, y=y, out=out, offs=offs, sx=sx, sy=sy)
           or config_error(cfg, qblock) or operands_error(x, y))
    if why:
        raise ValueError(f"fp8_blockwise_wgrad: {why}")
    return launch_wgrad(x, y, out, offs, sx, sx_strides, sy, sy_strides, cfg, qblock)


def launch_wgrad(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, offs: torch.Tensor, sx: torch.Tensor,
                 sx_strides, sy: torch.Tensor, sy_strides, cfg, qblock: int = 128) -> torch.Tensor:
    """``fp8_blockwise_wgrad`` without its checks of the machine, ``cfg`` and the operands: for a
    caller that made them already in the same call (the TRITON adapter's default config, as
    ``fp8_blockwise_gluon_ws.launch_grouped``)."""
    if out.numel():
        _launch(x, y, out, offs, sx, sx_strides, sy, sy_strides, cfg, qblock)
    return out


def prepare_wgrad(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, offs: torch.Tensor, sx: torch.Tensor,
                  sx_strides, sy: torch.Tensor, sy_strides, cfg, qblock: int = 128):
    """``launch_wgrad`` now, and a launcher ``relaunch(x, y, out, offs, sx, sy)`` for later calls
    whose tensors match these in dtype, shape, strides, device and 16-byte alignment (as
    ``fp8_blockwise_gluon_ws.prepare_grouped``: descriptors rebuilt without validation, this
    call's pre-bound plan)."""
    if out.numel() == 0:
        return lambda *tensors: None
    plan, args = _launch(x, y, out, offs, sx, sx_strides, sy, sy_strides, cfg, qblock)
    x_desc, y_desc, c_desc = (rebaser(d) for d in (args[0], args[1], args[3]))
    c_is_x = args[3] is args[0]  # no TMA store: x's descriptor stands in for c's
    device = out.device

    def relaunch(x, y, out, offs, sx, sy) -> None:
        bind_cuda_context(x)
        # Launches read only the data pointers of the descriptors' bases and of ``c``, which the
        # views the first launch took (x.t(), y.t(), out as [G * M, N]) share with the tensors.
        xd = x_desc(x)
        plan(xd, y_desc(y), out, xd if c_is_x else c_desc(out), sx, sy, offs, zeroed_counter(device))

    return relaunch


def _launch(x, y, out, offs, sx, sx_strides, sy, sy_strides, cfg, qblock: int):
    """One launch over ``out``'s tiles, at most ``num_programs`` persistent programs (arguments as
    ``launch_wgrad``); returns its pre-bound plan and positional arguments."""
    G, M, N = out.shape
    bm, bn = cfg[:2]
    tiles = G * -(-M // bm) * -(-N // bn)
    progs = max(1, min(tiles, num_programs(x.device.index)))
    args, kwargs = launch_args(x, y, out, offs, sx, sx_strides, sy, sy_strides, cfg, qblock)
    return _launcher().launch_and_plan((progs,), args, kwargs), args


@functools.lru_cache(maxsize=None)
def _launcher() -> CallKeyedKernel:
    """The kernel's pre-bound launcher (prebound.py): no per-call argument binding."""
    return CallKeyedKernel(_fp8_blockwise_wgrad_kernel, ("x_desc", "y_desc", "c", "c_desc", "sx_ptr", "sy_ptr",
                                                         "offs_ptr", "counter_ptr"))


def operands_error(x: torch.Tensor, y: torch.Tensor) -> str | None:
    """Why the wgrad operands ``x`` [T, M] and ``y`` [T, N] cannot feed this kernel, or None: fp8,
    token-contiguous, 16-byte aligned column stride and base (TMA)."""
    for name, t in (("x", x), ("y", y)):
        if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return f"{name} must be fp8 (e4m3fn or e5m2), got {t.dtype}"
        if t.shape[0] and not tma_ok(t.t()):
            return f"{name} must be token-contiguous with 16-byte aligned column stride and base for TMA"
    return None


def launch_args(x, y, out, offs, sx, sx_strides, sy, sy_strides, cfg, qblock: int) -> tuple[tuple, dict]:
    """The positional and keyword arguments of a launch (arguments as ``fp8_blockwise_wgrad``; any
    number of persistent programs); tools/compile_sm90.py compiles with them."""
    G, M, N = out.shape
    bm, bn, bk, group_m, stages = cfg[:5]
    x_desc = make_descriptor(x.t(), [bm, bk])
    y_desc = make_descriptor(y.t(), [bn, bk])
    c2 = out.view(G * M, N)
    tma_store = tma_store_ok(c2, cfg)
    # Without TMA stores the kernel never reads c_desc: x's descriptor stands in for it.
    c_desc = output_descriptor(c2, 64, bn) if tma_store else x_desc
    # The work-item counter starts at zero on every launch: a fresh buffer, so that launches on
    # other streams never share one (a CUDA graph captures its zeroing with the launch).
    counter = torch.zeros(1, dtype=torch.int32, device=out.device)
    args = (x_desc, y_desc, c2, c_desc, sx, sy, offs, counter, G, M, N, c2.stride(0), c2.stride(1), *sx_strides,
            *sy_strides)
    kwargs = dict(QBLOCK=qblock, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, STAGES=stages,
                  TMA_STORE=tma_store, TILE_SLOTS=TILE_SLOTS, MATH_REGS=MATH_REGS, LOAD_REGS=LOAD_REGS, num_warps=4, maxnreg=MAXNREG)
    return args, kwargs


__all__ = ["KERNEL_REVISION", "config_error", "fp8_blockwise_wgrad", "launch_wgrad", "prepare_wgrad", "smem_bytes"]
