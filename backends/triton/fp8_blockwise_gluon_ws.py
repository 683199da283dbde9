"""Warp-specialised blockwise fp8 GEMM for Hopper in Gluon: one TMA warp, two math warpgroups.

Same contract as ``fp8_blockwise_gluon.fp8_blockwise_gemm`` (K-major fp8 ``a`` [M, K] and ``b``
[N, K], one fp32 scale per (row group, K block) of each operand, BLOCK_K equal to the quantisation
block, ``acc += (a_blk @ b_blk^T) * sa * sb`` in fp32 after every K block).

Why a third kernel: the promotion of a K block's partial product must wait for that block's
wgmma. The Triton kernel waits with every warp of the program, so the tensor cores idle during
each promotion. The single-program Gluon kernel overlaps a promotion with the next wgmma of the
same warps, but pays for it in registers and waits. Here the 128-row tile is split between two
math warpgroups that run as separate partitions (``gl.warp_specialize``), each owning 64 rows
and its own accumulator. The partitions synchronise only through mbarriers, never with each
other, so one warpgroup's promotion runs on the CUDA cores while the other's wgmma runs on the
tensor cores; the warp scheduler does the interleaving. A third partition of one warp only
issues TMA loads into a ring of ``STAGES`` shared-memory slots. Each slot has a ``ready``
barrier (TMA bytes) and an ``empty`` barrier that both math warpgroups arrive on once their
wgmma has read the slot. All partitions walk the same persistent tile sequence, so the loader
runs ahead across tile boundaries while the math warpgroups store a finished tile.

A 256-column tile is two 128-column accumulators per math warpgroup, each K block two wgmmas
in turn (one partial in flight), so that the fp32 state is 192 registers, not 256.

Where ``a``'s scales lie row-contiguous (``scales_in_smem``), the loader also copies each slot's
scales into shared memory (cp.async, whose completion holds the slot's ``ready`` phase open), so
the math warpgroups read them there rather than from global memory.

Epilogue: each math warpgroup stages its 64-row half of the tile in shared memory and starts a
TMA store without waiting for it, so the store drains while the next tile's wgmmas run
(``tma_store_ok`` says where c allows it; masked pointer stores serve the rest).

Registers: the math warpgroups ask for 232 per thread (the accumulators plus the in-flight
partial), the loader for 40; the kernel launches with ``maxnreg`` so that the three
warpgroups fit in one SM's register file.

Needs triton >= 3.6 with Gluon and an sm_90 GPU; ``fp8_blockwise_gluon.available`` says why not.
"""
from __future__ import annotations

import functools

import torch

from .fp8_blockwise_gluon import (available, checked_output, device_error, gluon, make_descriptor, operands_error,
                                  shared_layout)
from .gemm_kernels import bind_cuda_context, num_programs
from .prebound import CallKeyedKernel, rebaser

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    from .fp8_blockwise_gluon import GluonDescriptor, _cta_barrier, _promote, _scales, _tile_coords, _tma_load

    # triton 3.6 names the TMA store async_copy_shared_to_global; later ones async_store.
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

    # triton 3.6 names the cp.async copy async_copy_global_to_shared; later ones async_load.
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

#: Bumped whenever a change to the kernel can change what tuning measured of it (its tiles' math,
#: loads, pipeline or stores), so stored tuning results are invalidated. Not bumped when the padded
#: tail's zeroing moved into the kernel from a launch of its own that the timed op made beside it.
KERNEL_REVISION = "gluon-ws-r8"
#: Registers per thread requested for the math warpgroups and the loader, and the kernel-wide
#: cap: three warpgroups (default math, worker math, loader padded to a warpgroup) share 64K
#: registers, and the default partition gets what the cap leaves after the workers' requests
#: (3 * 168 - 232 - 40 = 232).
MATH_REGS, LOAD_REGS, MAXNREG = 232, 40, 168
#: Dynamic shared memory one sm_90 CTA may use (227 KiB).
SMEM_PER_CTA = 232448


def smem_bytes(cfg, out_bytes: int, tma_store: bool) -> int:
    """Shared memory the kernel allocates for ``cfg`` (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages,
    ...): the fp8 ring, a's scales per slot, two mbarriers per slot and, with TMA stores, one
    [64, 128-column half] staging buffer of ``out_bytes`` elements per math warpgroup. Each
    allocation is rounded up to the 1 KiB a 128-byte swizzle needs."""
    bm, bn, bk, _, stages = cfg[:5]
    half = bn // 2 if bn > 128 else bn
    parts = [stages * bm * bk, stages * bn * bk, stages * bm * 4, 2 * stages * 8]
    parts.append(2 * (bm // 2) * half * out_bytes if tma_store else 8)
    return sum(-(-p // 1024) * 1024 for p in parts)


def tma_store_ok(c: torch.Tensor, cfg) -> bool:
    """Whether the epilogue can store ``c`` by TMA: row-major with 16-byte aligned rows and base
    (TMA's rule), at least 16 bytes per row, and room for the staging buffers next to ``cfg``'s
    ring (``smem_bytes``). Else the kernel stores through masked pointers.

    Why: the pointer stores hold both math warpgroups, so the tensor cores idle while a tile is
    written; a TMA store drains while the next tile's wgmmas run."""
    return tma_storable(c) and smem_bytes(cfg, c.element_size(), True) <= SMEM_PER_CTA


def tma_storable(c: torch.Tensor) -> bool:
    """TMA's rule for a 2-D output: row-major, 16-byte aligned rows and base, at least 16 bytes
    per row."""
    size = c.element_size()
    return (c.dim() == 2 and c.stride(1) == 1 and (c.stride(0) * size) % 16 == 0 and c.data_ptr() % 16 == 0
            and c.shape[1] * size >= 16)


def scales_in_smem(sa_row_stride: int, a_group: int) -> bool:
    """Whether the loader warp copies a's K-block scales into each ring slot (cp.async, completed on
    the slot's ``ready`` barrier) for the math warpgroups to read from shared memory, rather than
    each math warpgroup loading them from global memory every K block.

    Only where the copy is one contiguous read: one scale per row (``a_group`` 1) stored row-
    contiguous (``sa_row_stride`` 1, as ``quantize_kmajor`` stores them). With the grouped
    quantiser's K-inner scales a slot's copy is 128 scattered 4-byte reads, slower than the global
    loads (docs/kernels.md)."""
    return sa_row_stride == 1 and a_group == 1

if gluon is not None:

    @gluon.jit
    def _group_rows(offs_ptr, g, M, GROUPED: gl.constexpr):
        """First row and row count of group ``g``: read on the device (grouped), or all of ``a``."""
        if GROUPED:
            # int32 whatever the offsets' dtype: loop-carried tile counters must keep one type.
            start = gl.load(offs_ptr + g).to(gl.int32)
            return start, gl.load(offs_ptr + g + 1).to(gl.int32) - start
        else:
            return M * 0, M

    @gluon.jit
    def _split_tail(count, NUM_PROGS, SPLIT_TAIL: gl.constexpr):
        """How many of the last ``count`` tiles are worked as two 128-column halves.

        A dense launch whose last wave holds at most half of the programs splits that wave's
        256-column tiles in two (4096 x 3584: 448 tiles on 132 SMs, a last wave of 52), aiming
        at half a tile's time for that wave. A fuller last wave would give some programs two
        halves, no faster than one whole tile, so it is left whole. Grouped launches do not split
        (their tile count depends on the routing): ``SPLIT_TAIL`` is false for them and for
        128-column tiles."""
        tail = count % NUM_PROGS
        if not SPLIT_TAIL:
            tail = tail * 0
        else:
            tail = gl.where(tail * 2 <= NUM_PROGS, tail, 0)
        return tail

    @gluon.jit
    def _tile_at(t, full, num_pid_m, num_pid_n, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
        """Row tile, first column and whether it is a 128-column half of linear work item ``t``:
        items below ``full`` are whole tiles, the rest two halves of each remaining tile."""
        narrow = t >= full
        u = gl.maximum(t - full, 0)
        tile_id = gl.where(narrow, full + u // 2, t)
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        return pid_m, pid_n * BLOCK_N + gl.where(narrow, (u % 2) * (BLOCK_N // 2), 0), narrow

    @gluon.jit
    def _ws_load(a_desc, b_desc, c, sa_ptr, sb_ptr, offs_ptr, a_bufs, b_bufs, sa_bufs,
                 c_desc, c_smem, ready, empty, G, M, N, K, sc_m,
                 sc_n, ssa_r, ssa_k, ssb_g, ssb_r, ssb_k, NUM_PROGS, GROUPED: gl.constexpr, A_GROUP: gl.constexpr,
                 B_GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 GROUP_M: gl.constexpr, STAGES: gl.constexpr, SA_SMEM: gl.constexpr,
                 TMA_STORE: gl.constexpr, SPLIT_TAIL: gl.constexpr):
        """The loader: fills slot ``step % STAGES`` once both math warpgroups released it."""
        pid = gl.program_id(0)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        step = 0
        tile = pid
        base = 0
        sa_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
        for g in range(G):
            start, rows = _group_rows(offs_ptr, g, M, GROUPED)
            num_pid_m = gl.cdiv(rows, BLOCK_M)
            count = num_pid_m * num_pid_n
            tail = _split_tail(count, NUM_PROGS, SPLIT_TAIL)
            while tile < base + count + tail:
                pid_m, off_n, narrow = _tile_at(tile - base, count - tail, num_pid_m, num_pid_n, BLOCK_N, GROUP_M)
                for kt in range(k_tiles):
                    slot = step % STAGES
                    # A fresh mbarrier counts as having completed the phase before phase 0, so the
                    # first pass over the ring does not wait.
                    mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
                    bar = ready.index(slot)
                    if SA_SMEM:
                        # Every thread's copies hold the slot's phase open until they land (the
                        # arrive adds one pending arrival and completes it), so they go before the
                        # TMA bytes are expected.
                        offs_m = start + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=sa_layout)
                        _cp_async(sa_bufs.index(slot), sa_ptr + (offs_m // A_GROUP) * ssa_r + kt * ssa_k,
                                  mask=offs_m < start + rows)
                        async_copy.mbarrier_arrive(bar, increment_count=True)
                    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                    # Rows past the group's end come from the next group (or TMA's zero fill) and
                    # are never stored; b is [G * N, K], so its rows past N are the next expert's.
                    _tma_load(a_desc, [start + pid_m * BLOCK_M, kt * BLOCK_K], bar, a_bufs.index(slot))
                    # A half tile still loads BLOCK_N rows (the descriptor's box); the math reads
                    # only the first half.
                    _tma_load(b_desc, [g * N + off_n, kt * BLOCK_K], bar, b_bufs.index(slot))
                    step += 1
                tile += NUM_PROGS
            base += count + tail

    @gluon.jit
    def _ws_math(a_desc, b_desc, c, sa_ptr, sb_ptr, offs_ptr, a_bufs, b_bufs, sa_bufs,
                 c_desc, c_smem, ready, empty, G, M, N, K, sc_m,
                 sc_n, ssa_r, ssa_k, ssb_g, ssb_r, ssb_k, NUM_PROGS, GROUPED: gl.constexpr, A_GROUP: gl.constexpr,
                 B_GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 GROUP_M: gl.constexpr, STAGES: gl.constexpr, SA_SMEM: gl.constexpr,
                 TMA_STORE: gl.constexpr, SPLIT_TAIL: gl.constexpr, WG: gl.constexpr):
        """Math warpgroup ``WG``: rows ``WG * 64`` to ``WG * 64 + 63`` of every tile.

        A 256-column tile is worked as two 128-column halves, each with its own accumulator and one
        shared in-flight partial: two 64 x 256 fp32 tensors (accumulator and partial) would need
        256 registers per thread, the halves need 192. The wide tile loads a quarter fewer bytes
        per FLOP than the 128 x 128 one (each ``a`` tile serves twice the columns)."""
        ROWS: gl.constexpr = BLOCK_M // 2
        SPLIT: gl.constexpr = (BLOCK_N + 127) // 128  # 128 columns per accumulator at most
        HALF: gl.constexpr = BLOCK_N // SPLIT

        pid = gl.program_id(0)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        step = 0
        tile = pid
        base = 0
        for g in range(G):
            start, rows = _group_rows(offs_ptr, g, M, GROUPED)
            end = start + rows
            num_pid_m = gl.cdiv(rows, BLOCK_M)
            count = num_pid_m * num_pid_n
            sbg_ptr = sb_ptr + g * ssb_g
            tail = _split_tail(count, NUM_PROGS, SPLIT_TAIL)
            while tile < base + count + tail:
                pid_m, off_n, narrow = _tile_at(tile - base, count - tail, num_pid_m, num_pid_n, BLOCK_N, GROUP_M)
                off_m = start + pid_m * BLOCK_M + WG * ROWS
                # A half tile runs its own copy of the K loop: a branch on ``narrow`` inside the
                # loop made the second accumulator a branch result, which spilled ~100 registers
                # inside the loop (sm_90, triton 3.6).
                if SPLIT_TAIL:
                    if narrow:
                        step = _ws_tile(a_bufs, b_bufs, sa_bufs, c, c_desc, c_smem, ready, empty, sa_ptr, sbg_ptr,
                                        step, k_tiles, off_m, off_n, end, N, sc_m, sc_n, ssa_r, ssa_k, ssb_r, ssb_k,
                                        A_GROUP, B_GROUP, ROWS, HALF, 1, STAGES, SA_SMEM, TMA_STORE, WG)
                    else:
                        step = _ws_tile(a_bufs, b_bufs, sa_bufs, c, c_desc, c_smem, ready, empty, sa_ptr, sbg_ptr,
                                        step, k_tiles, off_m, off_n, end, N, sc_m, sc_n, ssa_r, ssa_k, ssb_r, ssb_k,
                                        A_GROUP, B_GROUP, ROWS, HALF, 2, STAGES, SA_SMEM, TMA_STORE, WG)
                else:
                    step = _ws_tile(a_bufs, b_bufs, sa_bufs, c, c_desc, c_smem, ready, empty, sa_ptr, sbg_ptr,
                                    step, k_tiles, off_m, off_n, end, N, sc_m, sc_n, ssa_r, ssa_k, ssb_r, ssb_k,
                                    A_GROUP, B_GROUP, ROWS, HALF, SPLIT, STAGES, SA_SMEM, TMA_STORE, WG)
                tile += NUM_PROGS
            base += count + tail
        if GROUPED:
            _zero_tail(c, offs_ptr, G, M, N, sc_m, sc_n, pid, NUM_PROGS, ROWS, HALF, WG)
        if TMA_STORE:
            # The staging buffer must stay valid until the last store has read it.
            tma.store_wait(0)

    @gluon.jit
    def _zero_tail(c, offs_ptr, G, M, N, sc_m, sc_n, pid, NUM_PROGS, ROWS: gl.constexpr, COLS: gl.constexpr,
                   WG: gl.constexpr):
        """Zeroes the rows of ``c`` past the last group (``offs[G]`` to ``M``: a padded receive
        buffer's tail) in ``[ROWS, COLS]`` blocks, block ``q`` by math warpgroup ``q`` modulo the
        launch's ``2 * NUM_PROGS``: the grouped GEMM's padded-tail contract kept inside the launch
        instead of by a launch of its own. The rows are disjoint from every group's, so these
        stores need no ordering against the tiles' TMA stores."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        start = gl.load(offs_ptr + G).to(gl.int32)
        blocks_n = gl.cdiv(N, COLS)
        count = gl.cdiv(gl.maximum(M - start, 0), ROWS) * blocks_n
        zeros = gl.zeros((ROWS, COLS), dtype=c.dtype.element_ty, layout=layout)
        for q in range(pid * 2 + WG, count, NUM_PROGS * 2):
            _masked_store_tile(c, zeros, start + (q // blocks_n) * ROWS, (q % blocks_n) * COLS, M, N, sc_m, sc_n)

    @gluon.jit
    def _ws_tile(a_bufs, b_bufs, sa_bufs, c, c_desc, c_smem, ready, empty, sa_ptr, sbg_ptr, step, k_tiles, off_m,
                 off_n, end, N, sc_m, sc_n, ssa_r, ssa_k, ssb_r, ssb_k, A_GROUP: gl.constexpr, B_GROUP: gl.constexpr,
                 ROWS: gl.constexpr, HALF: gl.constexpr, PARTS: gl.constexpr, STAGES: gl.constexpr,
                 SA_SMEM: gl.constexpr, TMA_STORE: gl.constexpr, WG: gl.constexpr):
        """One math warpgroup's ``ROWS`` rows of one tile: ``PARTS`` (1 or 2) accumulators of
        ``HALF`` columns from ``off_n``, over every K block from flattened step ``step``, then
        stored. Returns the step after the tile's last."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HALF, 32])
        rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        A_SCALAR: gl.constexpr = A_GROUP >= ROWS and A_GROUP % ROWS == 0 and not SA_SMEM
        B_SCALAR: gl.constexpr = B_GROUP >= HALF and B_GROUP % HALF == 0
        zero = gl.zeros((ROWS, HALF), dtype=gl.float32, layout=mma_layout)
        # Each half's first column for its scalar scale load, clamped to stay inside sb where the
        # half lies wholly past N (its columns are never stored): the second half of a tile, or
        # the second of a split tile's halves.
        off_n0 = gl.minimum(off_n, N - 1)
        off_n1 = gl.minimum(off_n + HALF, N - 1)
        offs_m = off_m + gl.arange(0, ROWS, layout=rows_layout)
        acc = zero
        acc1 = zero
        for kt in range(k_tiles):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            a_rows = a_bufs.index(slot).slice(WG * ROWS, ROWS)
            b_tile = b_bufs.index(slot)
            part = warpgroup_mma(a_rows, b_tile.slice(0, HALF).permute((1, 0)), zero, use_acc=False, is_async=True)
            # The scale loads go out while the wgmma runs.
            if SA_SMEM:
                sa = sa_bufs.index(slot).slice(WG * ROWS, ROWS).load(rows_layout)
            else:
                sa = _scales(sa_ptr, offs_m, off_m, kt, ssa_r, ssa_k, end, A_GROUP, ROWS)
            # Column indices are made here, not kept from before the loop: held across it they
            # would cost a register per column.
            offs_n = off_n + gl.arange(0, HALF, layout=cols_layout)
            sb = _scales(sbg_ptr, offs_n, off_n0, kt, ssb_r, ssb_k, N, B_GROUP, HALF)
            if PARTS == 2:
                sb1 = _scales(sbg_ptr, offs_n + HALF, off_n1, kt, ssb_r, ssb_k, N, B_GROUP, HALF)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            if PARTS == 1:
                # The slot is read: hand it back before promoting, so the next load starts now.
                mbarrier.arrive(empty.index(slot), count=1)
            acc = _promote(acc, part, sa, sb, A_SCALAR, B_SCALAR)
            if PARTS == 2:
                part = warpgroup_mma(a_rows, b_tile.slice(HALF, HALF).permute((1, 0)), zero, use_acc=False,
                                     is_async=True)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                mbarrier.arrive(empty.index(slot), count=1)
                acc1 = _promote(acc1, part, sa, sb1, A_SCALAR, B_SCALAR)
            step += 1
        # Both halves are narrowed before either is stored: two fp32 halves plus one half's
        # addresses would not fit in the registers.
        out0 = acc.to(c.dtype.element_ty)
        if PARTS == 2:
            out1 = acc1.to(c.dtype.element_ty)
        _store_tile(c, c_desc, c_smem.index(WG), out0, off_m, off_n, end, N, sc_m, sc_n, TMA_STORE)
        if PARTS == 2:
            _store_tile(c, c_desc, c_smem.index(WG), out1, off_m, off_n + HALF, end, N, sc_m, sc_n, TMA_STORE)
        return step

    @gluon.jit
    def _store_tile(c, c_desc, c_buf, vals, off_m, off_n, end, N, sc_m, sc_n, TMA_STORE: gl.constexpr):
        """Store ``vals`` with its first element at (``off_m``, ``off_n``), rows below ``end`` and
        columns below ``N``: through the warpgroup's staging buffer and a TMA store where c allows
        one (the store drains while the next tile's wgmmas run), else masked pointer stores.

        A tile whose rows run past ``end`` takes the pointer stores: TMA clips only at the tensor's
        edge, so in a grouped launch it would write the next group's rows. (The branch also keeps
        LLVM from hoisting the staging buffer's addresses out of the tile loop: hoisted, they
        stayed live across the K loop and spilled 58-70 registers inside it, sm_90, triton 3.6.)"""
        if TMA_STORE:
            if off_m + vals.shape[0] <= end:
                _tma_store_tile(c_desc, c_buf, vals, off_m, off_n)
            else:
                _masked_store_tile(c, vals, off_m, off_n, end, N, sc_m, sc_n)
        else:
            _masked_store_tile(c, vals, off_m, off_n, end, N, sc_m, sc_n)

    @gluon.jit
    def _tma_store_tile(c_desc, c_buf, vals, off_m, off_n):
        """Stage ``vals`` in ``c_buf`` and start its TMA store, without waiting for it."""
        # The buffer's previous store must have read it (only the issuing thread has one pending;
        # the barrier tells the others) before any thread overwrites it.
        tma.store_wait(0)
        _cta_barrier()
        c_buf.store(vals)
        # Every thread's generic-proxy writes must be visible to the async proxy before the copy.
        fence_async_shared()
        _cta_barrier()
        _tma_store(c_desc, [off_m, off_n], c_buf)

    @gluon.jit
    def _masked_store_tile(c, vals, off_m, off_n, end, N, sc_m, sc_n):
        """Masked store of ``vals``: 32-bit offsets from one 64-bit base, half the registers of
        64-bit pointers."""
        rows = gl.arange(0, vals.shape[0], layout=gl.SliceLayout(1, vals.type.layout))
        cols = gl.arange(0, vals.shape[1], layout=gl.SliceLayout(0, vals.type.layout))
        mask = (off_m + rows[:, None] < end) & (off_n + cols[None, :] < N)
        base = c + off_m.to(gl.int64) * sc_m + off_n * sc_n
        gl.store(base + (rows[:, None] * sc_m + cols[None, :] * sc_n), vals, mask=mask)

    # One wrapper per math warpgroup: a worker partition takes the same argument list as the
    # loader, so the warpgroup index is fixed here rather than passed.
    @gluon.jit
    def _ws_math0(a_desc, b_desc, c, sa_ptr, sb_ptr, offs_ptr, a_bufs, b_bufs, sa_bufs,
                  c_desc, c_smem, ready, empty, G, M, N, K, sc_m,
                  sc_n, ssa_r, ssa_k, ssb_g, ssb_r, ssb_k, NUM_PROGS, GROUPED: gl.constexpr, A_GROUP: gl.constexpr,
                  B_GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr, SA_SMEM: gl.constexpr,
                  TMA_STORE: gl.constexpr, SPLIT_TAIL: gl.constexpr):
        _ws_math(a_desc, b_desc, c, sa_ptr, sb_ptr, offs_ptr, a_bufs, b_bufs, sa_bufs,
                 c_desc, c_smem, ready, empty, G, M, N, K,
                 sc_m, sc_n, ssa_r, ssa_k, ssb_g, ssb_r, ssb_k, NUM_PROGS, GROUPED, A_GROUP, B_GROUP, BLOCK_M, BLOCK_N,
                 BLOCK_K, GROUP_M, STAGES, SA_SMEM, TMA_STORE, SPLIT_TAIL, 0)

    @gluon.jit
    def _ws_math1(a_desc, b_desc, c, sa_ptr, sb_ptr, offs_ptr, a_bufs, b_bufs, sa_bufs,
                  c_desc, c_smem, ready, empty, G, M, N, K, sc_m,
                  sc_n, ssa_r, ssa_k, ssb_g, ssb_r, ssb_k, NUM_PROGS, GROUPED: gl.constexpr, A_GROUP: gl.constexpr,
                  B_GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr, SA_SMEM: gl.constexpr,
                  TMA_STORE: gl.constexpr, SPLIT_TAIL: gl.constexpr):
        _ws_math(a_desc, b_desc, c, sa_ptr, sb_ptr, offs_ptr, a_bufs, b_bufs, sa_bufs,
                 c_desc, c_smem, ready, empty, G, M, N, K,
                 sc_m, sc_n, ssa_r, ssa_k, ssb_g, ssb_r, ssb_k, NUM_PROGS, GROUPED, A_GROUP, B_GROUP, BLOCK_M, BLOCK_N,
                 BLOCK_K, GROUP_M, STAGES, SA_SMEM, TMA_STORE, SPLIT_TAIL, 1)

    @gluon.jit
    def _fp8_blockwise_ws_kernel(a_desc, b_desc, c, c_desc, sa_ptr, sb_ptr, offs_ptr, G, M, N, K, sc_m, sc_n,
                                 ssa_r, ssa_k, ssb_g, ssb_r, ssb_k, NUM_PROGS, GROUPED: gl.constexpr,
                                 A_GROUP: gl.constexpr, B_GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                                 BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                                 STAGES: gl.constexpr, SA_SMEM: gl.constexpr, TMA_STORE: gl.constexpr,
                                 SPLIT_TAIL: gl.constexpr, MATH_REGS: gl.constexpr, LOAD_REGS: gl.constexpr):
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        # a's K-block scales of each slot's rows (SA_SMEM); unused, and 2 KiB at most, otherwise.
        sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M],
                                            gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        if TMA_STORE:
            # One staging buffer per math warpgroup for its output half-tile ([64, HALF], the TMA
            # store's block); c_desc is then a descriptor over c.
            c_shape: gl.constexpr = [2, c_desc.block_type.shape[0], c_desc.block_type.shape[1]]
            c_smem = gl.allocate_shared_memory(c_desc.dtype, c_shape, c_desc.layout)
        else:
            # Pointer stores: c_desc is a placeholder and the buffer is never touched.
            c_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            # One arrival per math warpgroup.
            mbarrier.init(empty.index(s), count=2)
        # The argument tuple is spelled out at each use: assigned to a variable, its constexpr
        # entries would become tensors (triton 3.6).
        gl.warp_specialize([
            (_ws_math0, (a_desc, b_desc, c, sa_ptr, sb_ptr, offs_ptr, a_bufs, b_bufs, sa_bufs,
                          c_desc, c_smem, ready, empty, G, M, N, K,
                          sc_m, sc_n, ssa_r, ssa_k, ssb_g, ssb_r, ssb_k, NUM_PROGS, GROUPED, A_GROUP, B_GROUP, BLOCK_M,
                          BLOCK_N, BLOCK_K, GROUP_M, STAGES, SA_SMEM, TMA_STORE, SPLIT_TAIL)),
            (_ws_math1, (a_desc, b_desc, c, sa_ptr, sb_ptr, offs_ptr, a_bufs, b_bufs, sa_bufs,
                          c_desc, c_smem, ready, empty, G, M, N, K,
                          sc_m, sc_n, ssa_r, ssa_k, ssb_g, ssb_r, ssb_k, NUM_PROGS, GROUPED, A_GROUP, B_GROUP, BLOCK_M,
                          BLOCK_N, BLOCK_K, GROUP_M, STAGES, SA_SMEM, TMA_STORE, SPLIT_TAIL)),
            (_ws_load, (a_desc, b_desc, c, sa_ptr, sb_ptr, offs_ptr, a_bufs, b_bufs, sa_bufs,
                         c_desc, c_smem, ready, empty, G, M, N, K,
                         sc_m, sc_n, ssa_r, ssa_k, ssb_g, ssb_r, ssb_k, NUM_PROGS, GROUPED, A_GROUP, B_GROUP, BLOCK_M,
                         BLOCK_N, BLOCK_K, GROUP_M, STAGES, SA_SMEM, TMA_STORE, SPLIT_TAIL)),
        ], [4, 1], [MATH_REGS, LOAD_REGS])


def config_error(cfg, b_group: int) -> str | None:
    """Why ``cfg`` (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps[, ...]) cannot run this
    kernel with ``b``'s scales shared by ``b_group`` rows, or None.

    The tile is two 64-row math warpgroups (BLOCK_M 128, 8 math warps), at most 128 columns per
    accumulator: BLOCK_N up to 128, or 256 as two 128-column accumulators. ``b``'s scale must be
    one value per accumulator, as in the single-program Gluon kernel: a per-column scale vector
    per thread does not fit next to the accumulators and the in-flight partial."""
    bm, bn, bk, _, stages, warps = cfg[:6]
    occupancy = cfg[6] if len(cfg) > 6 else 1
    if bm != 128 or warps != 8:
        return (f"the tile must be 128 rows in two math warpgroups (BLOCK_M 128, 8 warps), got {bm} rows, "
                f"{warps} warps")
    if bn != 256 and (bn % 8 or not 8 <= bn <= 128):
        return (f"BLOCK_N must be a multiple of 8 in [8, 128], or 256 (two 128-column halves), got {bn}: "
                f"the accumulator and the in-flight partial must fit in a math thread's registers")
    if bk % 32:
        return f"BLOCK_K must be a multiple of 32 (the fp8 wgmma K), got {bk}"
    if stages < 2:
        return f"num_stages must be >= 2, got {stages}"
    if occupancy != 1:
        return f"occupancy must be 1 (the three warpgroups use the whole register file), got {occupancy}"
    half = bn // 2 if bn == 256 else bn
    if b_group < half or b_group % half:
        return (f"b's scales must be one per tile: b_group={b_group} is not a multiple of {half}, the columns "
                f"one accumulator covers (per-column scales do not fit in registers)")
    return None


def fp8_blockwise_gemm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                       out_dtype: torch.dtype, cfg, a_group: int = 1, b_group: int = 1) -> torch.Tensor:
    """``C = dequant(a) @ dequant(b)^T`` with blockwise scales, on the warp-specialised kernel.

    Arguments as ``fp8_blockwise_gluon.fp8_blockwise_gemm``. Raises ValueError naming the reason
    when the kernel cannot run here or ``cfg`` does not suit it.

    >>> y = fp8_blockwise_gemm(qa, qw, sa, sw, torch.bfloat16, (128, 128, 128, 8, 6, 8), b_group=128)  # doctest: +SKIP
    """
    c = checked_output(a, b, out_dtype, config_error(cfg, b_group), "fp8_blockwise_gemm (warp-specialised)",
                       sa=sa, sb=sb)
    if c.numel() == 0:
        return c
    _launch(a, b, c, None, 1, b.shape[0], sa, (sa.stride(0), sa.stride(1)), sb, (0, sb.stride(0), sb.stride(1)), cfg,
            a_group, b_group)
    return c


def grouped_operands_error(a: torch.Tensor, b_gnk: torch.Tensor) -> str | None:
    """Why ``a`` [M, K] and ``b_gnk`` [G, N, K] cannot feed this kernel's TMA loads, or None: both
    K-contiguous with 16-byte aligned rows and base, the groups of ``b_gnk`` stacked row after row
    (its rows may be padded: it is read as a strided [G * N, K] view, not copied)."""
    G, N, K = b_gnk.shape
    if b_gnk.stride(2) != 1 or b_gnk.stride(0) != N * b_gnk.stride(1):
        return f"b_gnk must be K-major with its groups stacked row after row (strides {tuple(b_gnk.stride())})"
    return operands_error(a, b_gnk.as_strided((G * N, K), (b_gnk.stride(1), 1)))


def fp8_blockwise_grouped_gemm(a: torch.Tensor, b_gnk: torch.Tensor, out: torch.Tensor, offs: torch.Tensor,
                               sa: torch.Tensor, sa_strides, sb: torch.Tensor, sb_strides, cfg,
                               b_group: int = 128) -> torch.Tensor:
    """``out[s_g:e_g] = dequant(a[s_g:e_g]) @ dequant(b_gnk[g])^T`` for every group, the group
    boundaries ``offs`` (int32/int64, G + 1 entries) read on the device (no host sync).

    ``a`` is K-major fp8 [M_total, K] with one scale per row and K block (``sa_strides``: row,
    K-block strides of ``sa``); ``b_gnk`` is K-major fp8 [G, N, K], contiguous per group, with one
    scale per ``b_group`` x K-block tile (``sb_strides``: group, row-block, K-block). Rows of
    ``out`` are written group by group (an empty group has no tiles), and its rows past the last
    group (``offs[G]`` to M_total, padding) are set to zero by the same launch. Raises ValueError naming
    the reason when the kernel cannot run here or ``cfg`` does not suit it.

    >>> fp8_blockwise_grouped_gemm(qa, qw, out, offs, sa, (sa.stride(0), sa.stride(1)),
    ...                            sw, sw.stride(), (128, 128, 128, 8, 6, 8))  # doctest: +SKIP
    """
    M, K = a.shape
    G, N, Kb = b_gnk.shape
    if Kb != K or out.shape != (M, N):
        raise ValueError(f"fp8_blockwise_grouped_gemm: a is {tuple(a.shape)}, b_gnk {tuple(b_gnk.shape)}, out "
                         f"{tuple(out.shape)}; need a [M, K], b_gnk [G, N, K], out [M, N]")
    if offs.numel() != G + 1:
        raise ValueError(f"fp8_blockwise_grouped_gemm: offs must have G + 1 = {G + 1} entries, got {offs.numel()}")
    why = (available(a.device.index) or device_error(a=a, b_gnk=b_gnk, out=out, offs=offs, sa=sa, sb=sb)
           or config_error(cfg, b_group) or grouped_operands_error(a, b_gnk))
    if why:
        raise ValueError(f"fp8_blockwise_grouped_gemm: {why}")
    return launch_grouped(a, b_gnk, out, offs, sa, sa_strides, sb, sb_strides, cfg, b_group)


def launch_grouped(a: torch.Tensor, b_gnk: torch.Tensor, out: torch.Tensor, offs: torch.Tensor, sa: torch.Tensor,
                   sa_strides, sb: torch.Tensor, sb_strides, cfg, b_group: int = 128) -> torch.Tensor:
    """``fp8_blockwise_grouped_gemm`` without its checks of the machine, ``cfg`` and the operands'
    layout: for a caller that made them already in the same call (the TRITON adapter, whose
    default config comes from a list built where this kernel runs and whose operand check picks
    that config): each check is host time on every call."""
    M, K = a.shape
    G, N, _ = b_gnk.shape
    if M == 0 or N == 0:
        return out
    b_rows = b_gnk.as_strided((G * N, K), (b_gnk.stride(1), 1))  # rows may be padded: a view, not a copy
    _launch(a, b_rows, out, offs, G, N, sa, sa_strides, sb, sb_strides, cfg, 1, b_group)
    return out


def prepare_grouped(a: torch.Tensor, b_gnk: torch.Tensor, out: torch.Tensor, offs: torch.Tensor, sa: torch.Tensor,
                    sa_strides, sb: torch.Tensor, sb_strides, cfg, b_group: int = 128):
    """``launch_grouped`` now, and a launcher ``relaunch(a, b_gnk, out, offs, sa, sb)`` for later
    calls whose tensors match these in dtype, shape, strides, device and 16-byte alignment (the
    caller's key holds them; fresh allocations are aligned): it rebuilds the TMA descriptors over
    the new tensors from this call's (no validation) and launches through this call's pre-bound
    plan, skipping the per-call key."""
    M, K = a.shape
    G, N, _ = b_gnk.shape
    if M == 0 or N == 0:
        return lambda *tensors: None
    rows = ((G * N, K), (b_gnk.stride(1), 1))
    plan, args = _launch(a, b_gnk.as_strided(*rows), out, offs, G, N, sa, sa_strides, sb, sb_strides, cfg, 1,
                         b_group)
    a_desc, b_desc, c_desc = (rebaser(d) for d in (args[0], args[1], args[3]))
    c_is_a = args[3] is args[0]  # no TMA store: a's descriptor stands in for c's

    def relaunch(a, b_gnk, out, offs, sa, sb) -> None:
        bind_cuda_context(a)
        ad = a_desc(a)
        # A descriptor's launch reads its base's data pointer only (its shape and strides are the
        # template's): b_gnk serves for its row view, which starts at the same address.
        plan(ad, b_desc(b_gnk), out, ad if c_is_a else c_desc(out), sa, sb, offs)

    return relaunch


def _launch(a, b_rows, c, offs, G: int, N: int, sa, sa_strides, sb, sb_strides, cfg, a_group: int,
            b_group: int):
    """One launch over ``G`` groups (``offs`` None: one group of all rows, the dense GEMM); returns
    its pre-bound plan and positional arguments."""
    bm, bn = cfg[:2]
    bound = (-(-a.shape[0] // bm) + (G if offs is not None else 0)) * -(-N // bn)  # most tiles any routing gives
    progs = max(1, min(bound, num_programs(a.device.index)))
    args, kwargs = launch_args(a, b_rows, c, offs, G, N, sa, sa_strides, sb, sb_strides, cfg, a_group, b_group,
                               progs)
    return _launcher().launch_and_plan((progs,), args, kwargs), args


@functools.lru_cache(maxsize=None)
def _launcher() -> CallKeyedKernel:
    """The kernel's pre-bound launcher: Triton's per-call argument binding is a large share of an
    fp8 step's host time (prebound.py)."""
    return CallKeyedKernel(_fp8_blockwise_ws_kernel, ("a_desc", "b_desc", "c", "c_desc", "sa_ptr", "sb_ptr",
                                                      "offs_ptr"))


def launch_args(a, b_rows, c, offs, G: int, N: int, sa, sa_strides, sb, sb_strides, cfg, a_group: int,
                b_group: int, progs: int) -> tuple[tuple, dict]:
    """The positional and keyword arguments of a launch of ``progs`` persistent programs, as
    ``_launch`` passes them (arguments as ``_launch``); tools/compile_sm90.py compiles with them."""
    M, K = a.shape
    bm, bn, bk, group_m, stages = cfg[:5]
    a_desc = make_descriptor(a, [bm, bk])
    b_desc = make_descriptor(b_rows, [bn, bk])
    tma_store = tma_store_ok(c, cfg)
    # Without TMA stores the kernel never reads c_desc: a's descriptor stands in for it.
    c_desc = output_descriptor(c, bm // 2, bn // 2 if bn > 128 else bn) if tma_store else a_desc
    args = (a_desc, b_desc, c, c_desc, sa, sb, sa if offs is None else offs, G, M, N, K, c.stride(0), c.stride(1),
            *sa_strides, *sb_strides, progs)
    kwargs = dict(GROUPED=offs is not None, A_GROUP=a_group, B_GROUP=b_group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                  GROUP_M=group_m, STAGES=stages, SA_SMEM=scales_in_smem(sa_strides[0], a_group),
                  TMA_STORE=tma_store, SPLIT_TAIL=offs is None and bn > 128, MATH_REGS=MATH_REGS,
                  LOAD_REGS=LOAD_REGS, num_warps=4, maxnreg=MAXNREG)
    return args, kwargs


def output_descriptor(c: torch.Tensor, rows: int, cols: int):
    """A Gluon TMA descriptor over the 2-D output ``c`` whose block is one math warpgroup's
    [``rows``, ``cols``] store."""
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[c.dtype]
    return GluonDescriptor(c, list(c.shape), list(c.stride()), [rows, cols], shared_layout((rows, cols), dtype))


__all__ = ["KERNEL_REVISION", "available", "config_error", "fp8_blockwise_gemm", "fp8_blockwise_grouped_gemm",
           "launch_grouped", "prepare_grouped"]
