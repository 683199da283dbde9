"""Flash attention backward for Hopper in Gluon: one TMA warp, two MMA warpgroups per kernel.

Serves the backward of the calls the Gluon forward (attention_gluon.py) serves: dense bf16/fp16
``q [B, Sq, Hq, D]``, ``k``/``v [B, Sk, Hkv, D]`` with D = 64 or 128, MHA/GQA/MQA, no mask, the
bottom-right causal mask or a sliding window (``WINDOW``, behind the forward's
``PRIMUS_TURBO_ATTN_GLUON_WINDOW``), Sq != Sk, odd lengths, any softmax scale. It starts from the forward's
out and float32 natural-log lse ``[B, Hq, Sq]`` (either forward kernel's: they mean the same) and
returns dq, dk, dv in the inputs' dtype, the gradients ``attention_kernels``' backward computes.
``gluon_backward_refusal`` names every call it leaves to those plain-Triton kernels. Varlen
calls (``VARLEN``: packed tensors, cu_seqlens read on the device, the lse ``[Hq, Tq]``) run the
same kernels per sequence, as the forward does (attention_gluon.py: one-batch descriptors, blocks
past a sequence's end idle, tiles running past it stored by masked pointer stores); in the dK/dV
kernel the query rows past a sequence's end (the next sequence's, read by TMA) get lse2 = +inf,
so they contribute nothing. Tokens past the last sequence get zero gradients.

Three launches, deterministic (no atomics; a GQA group's dK/dV are summed inside one program):

* ``attention_kernels.attn_bwd_preprocess_kernel``: ``delta = rowsum(dO * O)`` and the lse in the
  exp2 domain (``lse2``, +inf on rows that attend nothing, so their probabilities are 0);
* ``attn_bwd_dkdv_gluon_kernel``: one program per 128 keys of one kv head (``(key blocks,
  B * Hkv)`` grid). The loader warp copies each math warpgroup's 64 rows of k and v once, then
  walks the query heads of the group and, per head, the query blocks that attend the program's
  keys, copying q and dO of ``BLOCK_M`` rows into a ring of ``STAGES`` slots by TMA and the
  rows' lse2 and delta next to them by cp.async (separate q / dO ready barriers, an empty barrier
  both warpgroups arrive on). Each math warpgroup owns 64 keys
  and works transposed: S^T = K Q^T and dP^T = V dO^T (wgmma, operands in shared memory), P^T =
  exp2(S^T * scale * log2(e) - lse2), dS^T = P^T (dP^T - delta), then dV += P^T dO and dK +=
  dS^T Q with P^T and dS^T as register operands, so nothing goes back to shared memory. The
  dV product runs while dS^T is formed. The epilogue stages dK (times the scale) and dV in the
  warpgroup's own k and v buffers and stores them by TMA;
* ``attn_bwd_dq_gluon_kernel``: one program per 128 query rows of one head (the forward's grid
  and order). The loader copies each warpgroup's q and dO once, then k and v blocks through the
  ring; per key block each 64-row warpgroup computes S = Q K^T and dP = dO V^T, P, dS and dQ +=
  dS K (dS from registers), and stores dQ (times the scale) staged in its q buffer.

Masks and tails: q, k, v, dO and the gradients go through rank-3 TMA descriptors over
``[B, S, H * D]`` that clip at each sequence's end (zeros read, nothing written past it). Query
rows past Sq contribute nothing: their q and dO rows read zeros (dK/dV kernel; their lse2 and
delta are zero-filled, so P^T dO and dS^T are 0 there) or their lse2 is +inf (dQ kernel, P = 0).
Keys past Sk are masked out of P in the dQ kernel and only ever meet their own (unstored) dK/dV
rows in the other. Blocks wholly above the causal diagonal are never loaded; in the dQ kernel
the blocks that straddle it are masked and those below it are not, in the dK/dV kernel every
causal block is masked (one loop: two held more loop state than the registers allow). Windows:
the dK/dV kernel walks only the query blocks whose rows attend one of its keys
(``_window_query_span``), every one masked as the causal ones are; the dQ kernel only the key
blocks of its rows' windows (the forward's ``window_key_span``), masked at both edges.

Two variants, each off unless its switch is set to a true value (read on every call), change
when and where programs run, never what one computes or in which order it sums, so their
gradients equal the default's bit for bit:

* heavy-first (``PRIMUS_TURBO_ATTN_GLUON_BWD_HEAVY_FIRST``, causal calls): both kernels take the
  grid ``(B * H, blocks)`` instead of ``(blocks, B * H)``. The hardware starts programs in launch
  order, first dimension fastest, so the heaviest block (the first key block, the last query
  block) of every head starts before the next block of any head; in the default order the last
  heads' heaviest programs start last and run alone at the end (the longest tail when a GQA
  group's query heads make each dK/dV program long);
* overlap (``PRIMUS_TURBO_ATTN_GLUON_BWD_OVERLAP``, eager CUDA tensors): the dK/dV kernel runs on
  a side stream, launched first, and the dQ kernel on the current stream
  (``side_streams.side_by_side``: event waits, capturable in a CUDA graph), so each kernel's
  last wave shares the GPU with the other's programs.

``PRIMUS_TURBO_ATTN_GLUON_BWD=0`` (read on every call) keeps the backward on the plain-Triton
kernels; ``PRIMUS_TURBO_GLUON_KERNELS=0`` switches them off like every Gluon kernel. Needs triton
with Gluon on a release in ``GLUON_TRITON_RELEASES`` and an sm_90 GPU.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from turbo_dispatch.env import env_text_reader, parse_bool
from turbo_dispatch.low_precision.side_streams import overlappable, side_by_side

from . import attention_kernels as AK
from .attention_gluon import (block_span_host, descriptor, has_window, problem_refusal, tensor_refusal, window_bounds,
                              zero_tokens_past)
from .fp8_blockwise_gluon import available, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    from .attention_gluon import (block_span, key_mask, load_key_span, program_key_span, query_block, ring_barriers,
                                  sequence, store_rows, tma_batch)
    from .fp8_blockwise_gluon import _cta_barrier, _tma_load
    from .fp8_blockwise_gluon_ws import _cp_async, _tma_store

#: Set to 0/false to keep the TRITON adapter's dense backward on the plain-Triton kernels.
ATTN_GLUON_BWD_ENV = "PRIMUS_TURBO_ATTN_GLUON_BWD"
#: Causal programs launch heaviest block first across all heads (``HEAVY_FIRST``) unless set to 0/false.
ATTN_GLUON_BWD_HEAVY_FIRST_ENV = "PRIMUS_TURBO_ATTN_GLUON_BWD_HEAVY_FIRST"
#: The dK/dV and dQ kernels run side by side on two streams unless set to 0/false.
ATTN_GLUON_BWD_OVERLAP_ENV = "PRIMUS_TURBO_ATTN_GLUON_BWD_OVERLAP"
#: Set to 1/true to have the dQ kernel work out its rows' delta itself while the preprocess and the
#: dK/dV kernel run on the side stream (with the overlap only; off until timed on a GPU).
ATTN_GLUON_BWD_SELF_DELTA_ENV = "PRIMUS_TURBO_ATTN_GLUON_BWD_SELF_DELTA"
#: Bumped whenever a kernel's code changes.
KERNEL_REVISION = "attn-gluon-bwd-r4"
#: Rows one math warpgroup owns: keys in the dK/dV kernel, queries in the dQ kernel (one wgmma M).
ROWS = 64
#: Keys per dK/dV program and query rows per dQ program: two math warpgroups of ``ROWS``.
BLOCK = 2 * ROWS
#: Registers per thread for the math warpgroups and the loader, and the kernel-wide cap, split
#: as in the forward (attention_gluon.py: 3 * 168 - 232 - 40 = 232 for the default partition).
MATH_REGS, LOAD_REGS, MAXNREG = 232, 40, 168
#: Warps a program runs: two math warpgroups and the loader.
WARPS = 9
#: Query rows per program of the preprocess kernel.
PRE_BLOCK_M = 128
_LOG2E = 1.4426950408889634


class GluonAttnBwdConfig(NamedTuple):
    """One compiled variant of ``kernel`` ("dkdv" or "dq"): ``block_m`` query rows and
    ``block_n`` keys per step or program, ``stages`` ring slots, programs in the heavy-first order
    if ``heavy_first`` (causal only), the sliding-window mask where ``window`` (``WINDOW``), packed
    sequences where ``varlen`` (``VARLEN``), the dQ kernel's own delta where ``self_delta``
    (``SELF_DELTA``). Fields 4 and 5 are where tools/compile_sm90.py reads stages and warps."""

    block_m: int
    block_n: int
    head_dim: int
    causal: bool
    stages: int
    warps: int
    kernel: str
    heavy_first: bool = False
    window: bool = False
    varlen: bool = False
    self_delta: bool = False


#: Per head dim: (query rows per dK/dV ring slot, its STAGES) and (keys per dQ ring slot, its
#: STAGES). The dK/dV warpgroup holds dK and dV (2 x 64 x D fp32) next to S^T and dP^T (64 x
#: BLOCK_M each), the dQ warpgroup dQ next to S and dP (64 x BLOCK_N each): the streamed block is
#: as wide as the registers allow; the rings then fill shared memory (d128: k, v 64 KiB + 3 x 32
#: KiB; q, dO 64 KiB + 3 x 32 KiB).
BWD_TILES = {64: ((64, 4), (128, 3)), 128: ((64, 3), (64, 3))}


def dkdv_config(head_dim: int, causal: bool, heavy_first: bool = False, window: bool = False,
                varlen: bool = False) -> GluonAttnBwdConfig:
    """The dK/dV kernel's variant for head dim ``head_dim`` (64 or 128); ``heavy_first`` counts
    only for causal calls (a full mask's programs all weigh the same); ``window``: the
    sliding-window kernel, ``varlen``: the packed-sequence one (the same tiles)."""
    block_m, stages = BWD_TILES[head_dim][0]
    return GluonAttnBwdConfig(block_m, BLOCK, head_dim, bool(causal), stages, WARPS, "dkdv",
                              bool(causal and heavy_first), bool(window), bool(varlen))


def dq_config(head_dim: int, causal: bool, heavy_first: bool = False, window: bool = False,
              varlen: bool = False, self_delta: bool = False) -> GluonAttnBwdConfig:
    """The dQ kernel's variant for head dim ``head_dim`` (64 or 128); ``heavy_first``, ``window``
    and ``varlen`` as in ``dkdv_config``; ``self_delta``: the kernel works out delta and lse2
    itself (``SELF_DELTA``)."""
    block_n, stages = BWD_TILES[head_dim][1]
    return GluonAttnBwdConfig(BLOCK, block_n, head_dim, bool(causal), stages, WARPS, "dq",
                              bool(causal and heavy_first), bool(window), bool(varlen), bool(self_delta))



def window_query_span_host(n0: int, sq: int, sk: int, left: int, right: int, BLOCK_M: int, BLOCK_N: int):
    """``_window_query_span`` on the host, expression for expression (the tests hold the two texts
    equal and check this one against the brute-force mask)."""
    n_last = min(n0 + BLOCK_N, sk) - 1
    start, _, _, end = block_span_host(n0, n_last, sq, sq - sk, right, left, BLOCK_M)
    return start, end


if gluon is not None:

    @gluon.jit
    def _query_span(n0, sq, sk, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
        """``(start, end)``: the query blocks starting in [start, end) attend some of the keys from
        ``n0`` on. Causal row ``i`` attends keys ``j <= i + sk - sq``."""
        if CAUSAL:
            start = (gl.maximum(n0 - (sk - sq), 0) // BLOCK_M) * BLOCK_M
        else:
            start = n0 * 0
        return start, sq

    @gluon.jit
    def _window_query_span(n0, sq, sk, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """``(start, end)``: the query blocks starting in [start, end) hold every query row that
        attends one of the keys ``n0 .. n0 + BLOCK_N - 1`` (those below ``sk``) under the window
        ``(left, right)`` (``attention_gluon.window_bounds``'s), and no block without one: query
        ``i`` attends key ``j`` iff ``j + sq - sk - right <= i <= j + sq - sk + left``.
        ``start == end`` when no row attends them. ``window_query_span_host`` mirrors it."""
        n_last = gl.minimum(n0 + BLOCK_N, sk) - 1
        start, _, _, end = block_span(n0, n_last, sq, sq - sk, right, left, BLOCK_M)
        return start, end

    @gluon.jit
    def _grid_position(HEAVY_FIRST: gl.constexpr):
        """``(block, head program, blocks)``: this program's block along the sequence, its
        ``batch * heads + head`` and the number of blocks. The grid is ``(blocks, B * H)``, or
        ``(B * H, blocks)`` with ``HEAVY_FIRST``: the hardware starts programs in launch order,
        first grid dimension fastest, so there a block of every head starts before the next
        block of any head, and the heaviest blocks of the last heads do not start last."""
        if HEAVY_FIRST:
            block = gl.program_id(1)
            bh = gl.program_id(0)
            blocks = gl.num_programs(1)
        else:
            block = gl.program_id(0)
            bh = gl.program_id(1)
            blocks = gl.num_programs(0)
        return block, bh, blocks

    @gluon.jit
    def _key_program(cu_q_ptr, cu_k_ptr, SEQ_Q, SEQ_K, HEADS_KV, BLOCK_N: gl.constexpr, HEAVY_FIRST: gl.constexpr,
                     VARLEN: gl.constexpr):
        """``(batch, kv head, first key, q_start, sq, k_start, sk, live)`` of this dK/dV program:
        its sequence's first query token, query count, first key token and key count
        (``attention_gluon.sequence``), and whether its block starts inside the sequence (always,
        dense). Block 0 is the heaviest: causal key blocks are attended by fewer query blocks the
        later they start."""
        block, bh, _ = _grid_position(HEAVY_FIRST)
        b = bh // HEADS_KV
        q_start, sq = sequence(cu_q_ptr, b, SEQ_Q, VARLEN)
        k_start, sk = sequence(cu_k_ptr, b, SEQ_K, VARLEN)
        n0 = block * BLOCK_N
        if VARLEN:
            live = n0 < sk
        else:
            live = True
        return b, bh % HEADS_KV, n0, q_start, sq, k_start, sk, live

    @gluon.jit
    def _query_program(cu_q_ptr, cu_k_ptr, SEQ_Q, SEQ_K, HEADS_Q, GROUP, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                       HEAVY_FIRST: gl.constexpr, VARLEN: gl.constexpr):
        """``(batch, head, kv head, first query row, q_start, sq, k_start, sk, live)`` of this dQ
        program (see ``_key_program``); causal programs walk the query blocks last-first, so the
        blocks with the most keys start first (the forward's order where not ``HEAVY_FIRST``;
        varlen ones from each sequence's own last block)."""
        block, bh, blocks = _grid_position(HEAVY_FIRST)
        return query_block(cu_q_ptr, cu_k_ptr, block, blocks, bh, SEQ_Q, SEQ_K, HEADS_Q, GROUP, CAUSAL, BLOCK_M, VARLEN)

    @gluon.jit
    def _load_halves(a_desc, b_desc, a_smem, b_smem, bars, b, row0, col, ROWS: gl.constexpr):
        """TMA copies of the rows each math warpgroup keeps for the whole program: warpgroup
        ``wg``'s ``ROWS`` rows from ``row0 + wg * ROWS`` of ``a`` and ``b`` (column ``col``), both
        completing on ``bars[wg]``."""
        for wg in gl.static_range(2):
            bar = bars.index(wg)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [b, row0 + wg * ROWS, col], bar, a_smem.index(wg))
            _tma_load(b_desc, [b, row0 + wg * ROWS, col], bar, b_smem.index(wg))

    @gluon.jit
    def _load_thirds(a_desc, b_desc, c_desc, a_smem, b_smem, c_smem, bars, b, row0, col, ROWS: gl.constexpr):
        """``_load_halves`` of three tensors, all completing on ``bars[wg]``."""
        for wg in gl.static_range(2):
            bar = bars.index(wg)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes + c_desc.block_type.nbytes)
            _tma_load(a_desc, [b, row0 + wg * ROWS, col], bar, a_smem.index(wg))
            _tma_load(b_desc, [b, row0 + wg * ROWS, col], bar, b_smem.index(wg))
            _tma_load(c_desc, [b, row0 + wg * ROWS, col], bar, c_smem.index(wg))

    @gluon.jit
    def _start_products(a_first, a_second, ring_first, ring_second, ready_first, ready_second, slot, phase, zero,
                        ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
        """Waits for ring slot ``slot`` of each ring in turn and starts ``a_first @ first^T`` and
        ``a_second @ second^T`` (wgmma on fresh accumulators shaped like ``zero``, not awaited), so
        the first runs while the second's tile may still be landing. Returns ``(first product,
        second product, first tile, second tile)``, the tiles as ``[ROWS, HEAD_DIM]``."""
        mbarrier.wait(ready_first.index(slot), phase)
        first = ring_first.index(slot).reshape([ROWS, HEAD_DIM])
        x = warpgroup_mma(a_first, first.permute((1, 0)), zero, use_acc=False, is_async=True)
        mbarrier.wait(ready_second.index(slot), phase)
        second = ring_second.index(slot).reshape([ROWS, HEAD_DIM])
        y = warpgroup_mma(a_second, second.permute((1, 0)), zero, use_acc=False, is_async=True)
        return x, y, first, second

    @gluon.jit
    def _dkdv_load(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr, dk_ptr,
                   dv_ptr, stride_kt, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, kv_ready, q_ready,
                   do_ready, slot_empty, SEQ_Q, SEQ_K, HEADS_KV, GROUP, stride_lb, stride_lh, qk_scale, sm_scale, LEFT,
                   RIGHT, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                   STAGES: gl.constexpr, HEAVY_FIRST: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr):
        """The loader: both warpgroups' k and v rows, then q, dO, lse2 and delta of every query
        block of every query head of the group, in ring order (nothing for a varlen block past its
        sequence's end)."""
        b, hk, n0, q_start, sq, k_start, sk, live = _key_program(cu_q_ptr, cu_k_ptr, SEQ_Q, SEQ_K, HEADS_KV, BLOCK_N,
                                                                 HEAVY_FIRST, VARLEN)
        if live:
            _dkdv_load_rows(q_desc, k_desc, v_desc, do_desc, lse2_ptr, delta_ptr, k_smem, v_smem, q_ring, do_ring,
                            lse_ring, delta_ring, kv_ready, q_ready, do_ready, slot_empty, b, hk, n0, q_start, sq,
                            k_start, sk, GROUP, stride_lb, stride_lh, LEFT, RIGHT, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM,
                            STAGES, WINDOW, VARLEN)

    @gluon.jit
    def _dkdv_load_rows(q_desc, k_desc, v_desc, do_desc, lse2_ptr, delta_ptr, k_smem, v_smem, q_ring, do_ring,
                        lse_ring, delta_ring, kv_ready, q_ready, do_ready, slot_empty, b, hk, n0, q_start, sq, k_start,
                        sk, GROUP, stride_lb, stride_lh, LEFT, RIGHT, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, WINDOW: gl.constexpr,
                        VARLEN: gl.constexpr):
        """``_dkdv_load``'s copies for a program whose keys start at ``n0`` of its sequence."""
        tb = tma_batch(b, VARLEN)
        _load_halves(k_desc, v_desc, k_smem, v_smem, kv_ready, tb, k_start + n0, hk * HEAD_DIM, BLOCK_N // 2)
        if WINDOW:
            start, end = _window_query_span(n0, sq, sk, LEFT, RIGHT, BLOCK_M, BLOCK_N)
        else:
            start, end = _query_span(n0, sq, sk, CAUSAL, BLOCK_M)
        offs = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0]))
        step = 0
        for g in range(GROUP):
            h = hk * GROUP + g
            # Varlen: stride_lb is 0 and the sequence's rows start at token q_start.
            l_off = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + q_start
            for m0 in range(start, end, BLOCK_M):
                slot = step % STAGES
                # A fresh mbarrier counts as having completed the phase before phase 0, so the
                # first pass over the ring does not wait.
                mbarrier.wait(slot_empty.index(slot), ((step // STAGES) & 1) ^ 1)
                rows = m0 + offs
                # lse2 and delta go with q and dO: each thread's copies hold the barrier's phase
                # open until they land, so they are issued before the TMA bytes are expected.
                # Rows past sq are zero-filled; their q and dO rows are zeros too, so P^T dO and
                # dS^T vanish there.
                qbar = q_ready.index(slot)
                _cp_async(lse_ring.index(slot), lse2_ptr + l_off + rows, mask=rows < sq)
                async_copy.mbarrier_arrive(qbar, increment_count=True)
                mbarrier.expect(qbar, q_desc.block_type.nbytes)
                _tma_load(q_desc, [tb, q_start + m0, h * HEAD_DIM], qbar, q_ring.index(slot))
                dobar = do_ready.index(slot)
                _cp_async(delta_ring.index(slot), delta_ptr + l_off + rows, mask=rows < sq)
                async_copy.mbarrier_arrive(dobar, increment_count=True)
                mbarrier.expect(dobar, do_desc.block_type.nbytes)
                _tma_load(do_desc, [tb, q_start + m0, h * HEAD_DIM], dobar, do_ring.index(slot))
                step += 1

    @gluon.jit
    def _dkdv_blocks(k_tile, v_tile, q_ring, do_ring, lse_ring, delta_ring, q_ready, do_ready, slot_empty, dk, dv,
                     zero_s, step, lo, hi, diag0, sq, qk_scale, left, right, MASKED: gl.constexpr,
                     BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, WINDOW: gl.constexpr,
                     VARLEN: gl.constexpr):
        """dK/dV contributions of the query blocks starting in [lo, hi), ring steps from ``step``;
        ``MASKED`` blocks zero P^T above the causal diagonal: query ``i`` attends the
        warpgroup's key ``r`` iff ``i >= diag0 + r``; ``WINDOW``, iff
        ``diag0 + r - right <= i <= diag0 + r + left``. ``VARLEN``: queries from ``sq`` on are the
        next sequence's (read, not zeros): their lse2 is taken as +inf, so P^T and dS^T are 0
        there. Returns ``(dk, dv, step)``."""
        s_layout: gl.constexpr = zero_s.type.layout
        acc_layout: gl.constexpr = dk.type.layout
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        KEYS: gl.constexpr = zero_s.shape[0]
        for m0 in range(lo, hi, BLOCK_M):
            slot = step % STAGES
            phase = (step // STAGES) & 1
            st, dpt, q_tile, do_tile = _start_products(k_tile, v_tile, q_ring, do_ring, q_ready, do_ready, slot, phase,
                                                       zero_s, BLOCK_M, HEAD_DIM)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
            lse2 = lse_ring.index(slot).load(col_layout)
            if VARLEN:
                lse2 = gl.where(m0 + gl.arange(0, BLOCK_M, layout=col_layout) < sq, lse2, float("inf"))
            pt = gl.exp2(st * qk_scale - lse2[None, :])
            if MASKED:
                cols = m0 + gl.arange(0, BLOCK_M, layout=col_layout)
                rows = diag0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
                if WINDOW:
                    # One unsigned compare per element (two held one more live tile than the
                    # registers allow, d128): i - (r - right) in [0, left + right]. The difference
                    # stays inside int32 (|i|, |r| < 2^29, bounds <= 2^30), a negative one wraps
                    # above any width, and the width (up to 2^31) is summed unsigned.
                    off = (cols[None, :] - (rows[:, None] - right)).to(gl.uint32, bitcast=True)
                    width = left.to(gl.uint32, bitcast=True) + right.to(gl.uint32, bitcast=True)
                    pt = gl.where(off <= width, pt, 0.0)
                else:
                    pt = gl.where(cols[None, :] >= rows[:, None], pt, 0.0)
            dv = warpgroup_mma(gl.convert_layout(pt.to(q_ring.dtype), op_layout), do_tile, dv, is_async=True)
            # Groups retire in order: S^T is done, dP^T is the older of the two still in flight.
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt,))
            dst = pt * (dpt - delta_ring.index(slot).load(col_layout)[None, :])
            dk = warpgroup_mma(gl.convert_layout(dst.to(q_ring.dtype), op_layout), q_tile, dk, is_async=True)
            dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
            # This warpgroup's four products have read the slot: hand it back to the loader.
            mbarrier.arrive(slot_empty.index(slot), count=1)
            step += 1
        return dk, dv, step

    @gluon.jit
    def _dkdv_math(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr, dk_ptr,
                   dv_ptr, stride_kt, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, kv_ready, q_ready,
                   do_ready, slot_empty, SEQ_Q, SEQ_K, HEADS_KV, GROUP, stride_lb, stride_lh, qk_scale, sm_scale, LEFT,
                   RIGHT, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                   STAGES: gl.constexpr, HEAVY_FIRST: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr, WG: gl.constexpr):
        """Math warpgroup ``WG``: keys ``n0 + WG * 64`` to ``n0 + WG * 64 + 63``, dK and dV summed
        over the query heads of the group. ``WINDOW``: the query blocks of the program's window
        span, every one masked (as the causal ones, for the registers' sake). ``VARLEN``: keys and
        queries of this program's sequence, nothing at all for a block past its end."""
        b, hk, n0, q_start, sq, k_start, sk, live = _key_program(cu_q_ptr, cu_k_ptr, SEQ_Q, SEQ_K, HEADS_KV, BLOCK_N,
                                                                 HEAVY_FIRST, VARLEN)
        if live:
            _dkdv_rows(dk_desc, dv_desc, dk_ptr, dv_ptr, stride_kt, k_smem, v_smem, q_ring, do_ring, lse_ring,
                       delta_ring, kv_ready, q_ready, do_ready, slot_empty, b, hk, n0, q_start, sq, k_start, sk, GROUP,
                       qk_scale, sm_scale, LEFT, RIGHT, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, WINDOW, VARLEN, WG)

    @gluon.jit
    def _dkdv_rows(dk_desc, dv_desc, dk_ptr, dv_ptr, stride_kt, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring,
                   kv_ready, q_ready, do_ready, slot_empty, b, hk, n0, q_start, sq, k_start, sk, GROUP, qk_scale,
                   sm_scale, LEFT, RIGHT, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr,
                   WG: gl.constexpr):
        """``_dkdv_math``'s work for a program whose keys start at ``n0`` of its sequence."""
        KEYS: gl.constexpr = BLOCK_N // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        row0 = n0 + WG * KEYS
        if WINDOW:
            start, end = _window_query_span(n0, sq, sk, LEFT, RIGHT, BLOCK_M, BLOCK_N)
        else:
            start, end = _query_span(n0, sq, sk, CAUSAL, BLOCK_M)
        # Query i attends key j iff i + sk - sq >= j (causal; the window's bounds hang off this).
        diag0 = row0 - (sk - sq)

        zero_s = gl.zeros((KEYS, BLOCK_M), dtype=gl.float32, layout=s_layout)
        dk = gl.zeros((KEYS, HEAD_DIM), dtype=gl.float32, layout=acc_layout)
        dv = gl.zeros((KEYS, HEAD_DIM), dtype=gl.float32, layout=acc_layout)
        k_buf = k_smem.index(WG)
        v_buf = v_smem.index(WG)
        mbarrier.wait(kv_ready.index(WG), 0)
        k_tile = k_buf.reshape([KEYS, HEAD_DIM])
        v_tile = v_buf.reshape([KEYS, HEAD_DIM])
        # The ring step starts as a tensor (a literal 0 would be a constexpr, not loop-carriable).
        step = n0 * 0
        for g in range(GROUP):
            # Causal: every block is masked. A masked diagonal loop next to an unmasked one held
            # more loop state than the registers allow (spills in both loops, d128, sm_90); the
            # mask of a block below the diagonal keeps every element, at a compare and a select.
            dk, dv, step = _dkdv_blocks(k_tile, v_tile, q_ring, do_ring, lse_ring, delta_ring, q_ready, do_ready,
                                        slot_empty, dk, dv, zero_s, step, start, end, diag0, sq, qk_scale, LEFT, RIGHT,
                                        CAUSAL or WINDOW, BLOCK_M, HEAD_DIM, STAGES, WINDOW, VARLEN)

        # This warpgroup's k and v buffers are read by no pending wgmma now: they stage dK and dV.
        if VARLEN:
            # Keys past the sequence's end are the next sequence's: store_rows writes only its own.
            store_rows(dk * sm_scale, dk_ptr, k_start + row0, k_start + sk, stride_kt, k_buf, dk_desc, 0,
                       hk * HEAD_DIM, VARLEN)
            store_rows(dv, dv_ptr, k_start + row0, k_start + sk, stride_kt, v_buf, dv_desc, 0, hk * HEAD_DIM, VARLEN)
        else:
            # The TMA stores clip at the sequence's end (keys past Sk are never written).
            k_tile.store((dk * sm_scale).to(dk_desc.dtype))
            v_tile.store(dv.to(dv_desc.dtype))
            # Every thread's generic-proxy writes must be visible to the async proxy before the copies.
            fence_async_shared()
            _cta_barrier()
            _tma_store(dk_desc, [b, row0, hk * HEAD_DIM], k_buf)
            _tma_store(dv_desc, [b, row0, hk * HEAD_DIM], v_buf)
        tma.store_wait(0)

    @gluon.jit
    def attn_bwd_dkdv_gluon_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_ptr, delta_ptr, cu_q_ptr,
                                   cu_k_ptr, dk_ptr, dv_ptr, stride_kt, SEQ_Q, SEQ_K, HEADS_KV, GROUP, stride_lb,
                                   stride_lh, qk_scale, sm_scale, LEFT, RIGHT, CAUSAL: gl.constexpr,
                                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                                   STAGES: gl.constexpr, MATH_REGS: gl.constexpr, LOAD_REGS: gl.constexpr,
                                   HEAVY_FIRST: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr):
        """Grid ``(cdiv(Sk, BLOCK_N), B * Hkv)``, swapped with ``HEAVY_FIRST`` (``_grid_position``);
        launched with 4 warps and ``maxnreg``.
        ``qk_scale`` is the softmax scale times log2(e), ``sm_scale`` the softmax scale; ``lse2``
        and ``delta`` are the preprocess kernel's ``[B, Hq, Sq]`` (strides ``stride_lb``,
        ``stride_lh``, unit along Sq). k, v, dk, dv descriptors have ``BLOCK_N / 2`` rows per
        block, q and dO ``BLOCK_M``. ``WINDOW``: query ``i`` attends key ``j`` iff
        ``i + Sk - Sq - LEFT <= j <= i + Sk - Sq + RIGHT`` (``attention_gluon.window_bounds``);
        without it ``LEFT`` and ``RIGHT`` are not read and ``CAUSAL`` sets the mask. ``VARLEN``:
        packed ``[T, H, D]`` tensors read as one batch, sequence ``b`` spanning the tokens
        ``cu[b] .. cu[b + 1] - 1`` of the int32 ``cu_q_ptr`` / ``cu_k_ptr`` (``SEQ_Q``, ``SEQ_K``
        the longest counts; ``lse2``/``delta`` ``[Hq, Tq]``, ``stride_lb`` 0), and dK/dV rows that
        a tile holds past its sequence's end are not stored: tiles that run past it go through
        ``dk_ptr``/``dv_ptr`` (``stride_kt`` elements per token) by masked stores. Dense calls pass
        stand-ins there, never read."""
        KEYS: gl.constexpr = BLOCK_N // 2
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, 1, KEYS, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, 1, KEYS, HEAD_DIM], v_desc.layout)
        q_ring = gl.allocate_shared_memory(q_desc.dtype, [STAGES, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_ring = gl.allocate_shared_memory(do_desc.dtype, [STAGES, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
        row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
        delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
        kv_ready, q_ready, do_ready, slot_empty = ring_barriers(STAGES)
        # The argument tuples are spelled out at each use: assigned to a variable, their constexpr
        # entries would become tensors (triton 3.6). The math partitions differ only in WG.
        gl.warp_specialize([
            (_dkdv_math, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr,
                          dk_ptr, dv_ptr, stride_kt, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, kv_ready,
                          q_ready, do_ready, slot_empty, SEQ_Q, SEQ_K, HEADS_KV, GROUP, stride_lb, stride_lh, qk_scale,
                          sm_scale, LEFT, RIGHT, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HEAVY_FIRST, WINDOW, VARLEN, 0)),
            (_dkdv_math, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr,
                          dk_ptr, dv_ptr, stride_kt, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, kv_ready,
                          q_ready, do_ready, slot_empty, SEQ_Q, SEQ_K, HEADS_KV, GROUP, stride_lb, stride_lh, qk_scale,
                          sm_scale, LEFT, RIGHT, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HEAVY_FIRST, WINDOW, VARLEN, 1)),
            (_dkdv_load, (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr,
                          dk_ptr, dv_ptr, stride_kt, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, kv_ready,
                          q_ready, do_ready, slot_empty, SEQ_Q, SEQ_K, HEADS_KV, GROUP, stride_lb, stride_lh, qk_scale,
                          sm_scale, LEFT, RIGHT, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HEAVY_FIRST, WINDOW, VARLEN)),
        ], [4, 1], [MATH_REGS, LOAD_REGS])

    @gluon.jit
    def _dq_load(q_desc, k_desc, v_desc, do_desc, dq_desc, o_desc, lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr, dq_ptr,
                 stride_qt, q_smem, do_smem, o_smem, k_ring, v_ring, q_ready, k_ready, v_ready, kv_empty, SEQ_Q, SEQ_K,
                 HEADS_Q, GROUP, stride_lb, stride_lh, qk_scale, sm_scale, LEFT, RIGHT, CAUSAL: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 HEAVY_FIRST: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr, SELF_DELTA: gl.constexpr):
        """The loader: both warpgroups' q and dO rows (``SELF_DELTA``: and the forward's out), then
        every key block of the span in ring order (nothing for a varlen block past its sequence's
        end)."""
        b, h, hk, m0, q_start, sq, k_start, sk, live = _query_program(cu_q_ptr, cu_k_ptr, SEQ_Q, SEQ_K, HEADS_Q, GROUP,
                                                                      CAUSAL, BLOCK_M, HEAVY_FIRST, VARLEN)
        if live:
            tb = tma_batch(b, VARLEN)
            if SELF_DELTA:
                _load_thirds(q_desc, do_desc, o_desc, q_smem, do_smem, o_smem, q_ready, tb, q_start + m0, h * HEAD_DIM,
                             BLOCK_M // 2)
            else:
                _load_halves(q_desc, do_desc, q_smem, do_smem, q_ready, tb, q_start + m0, h * HEAD_DIM, BLOCK_M // 2)
            load_key_span(k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, kv_empty, tb, hk * HEAD_DIM, k_start, m0,
                          sq, sk, LEFT, RIGHT, CAUSAL, BLOCK_M, BLOCK_N, STAGES, False, WINDOW)

    @gluon.jit
    def _dq_blocks(q_tile, do_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, dq, zero_s, lse2, delta, rows, step,
                   lo, hi, sk, shift, qk_scale, left, right, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                   BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, WINDOW: gl.constexpr):
        """dQ contributions of the key blocks starting in [lo, hi), ring steps from ``step``;
        ``MASKED`` blocks zero P past ``sk`` and, causal, past each row's diagonal (``WINDOW``:
        outside each row's window ``[row + shift - left, row + shift + right]``). Returns
        ``(dq, step)``."""
        s_layout: gl.constexpr = zero_s.type.layout
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq.type.layout, k_width=2)
        for n0 in range(lo, hi, BLOCK_N):
            slot = step % STAGES
            phase = (step // STAGES) & 1
            s, dp, k_tile, _ = _start_products(q_tile, do_tile, k_ring, v_ring, k_ready, v_ready, slot, phase, zero_s,
                                               BLOCK_N, HEAD_DIM)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            p = gl.exp2(s * qk_scale - lse2[:, None])
            if MASKED:
                # Keys past sk read zeros, which would still give P = exp2(-lse2) there.
                ok = key_mask(n0, rows, sk, shift, left, right, s_layout, BLOCK_N, CAUSAL, WINDOW)
                p = gl.where(ok, p, 0.0)
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
            ds = p * (dp - delta[:, None])
            dq = warpgroup_mma(gl.convert_layout(ds.to(k_ring.dtype), op_layout), k_tile, dq, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
            mbarrier.arrive(kv_empty.index(slot), count=1)
            step += 1
        return dq, step

    @gluon.jit
    def _dq_math(q_desc, k_desc, v_desc, do_desc, dq_desc, o_desc, lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr, dq_ptr,
                 stride_qt, q_smem, do_smem, o_smem, k_ring, v_ring, q_ready, k_ready, v_ready, kv_empty, SEQ_Q, SEQ_K,
                 HEADS_Q, GROUP, stride_lb, stride_lh, qk_scale, sm_scale, LEFT, RIGHT, CAUSAL: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 HEAVY_FIRST: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr, SELF_DELTA: gl.constexpr,
                 WG: gl.constexpr):
        """Math warpgroup ``WG``: query rows ``m0 + WG * 64`` to ``m0 + WG * 64 + 63``. ``WINDOW``:
        masked key blocks at both edges of the program's window span, unmasked between.
        ``VARLEN``: rows and keys of this program's sequence, nothing at all for a block past its
        end. ``SELF_DELTA``: ``lse2_ptr`` is the forward's natural-log lse, and the warpgroup works
        out its rows' lse2 and delta = rowsum(dO * O) itself (O from ``o_smem``) instead of reading
        the preprocess kernel's."""
        Q_ROWS: gl.constexpr = BLOCK_M // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        b, h, hk, m0, q_start, sq, k_start, sk, live = _query_program(cu_q_ptr, cu_k_ptr, SEQ_Q, SEQ_K, HEADS_Q, GROUP,
                                                                      CAUSAL, BLOCK_M, HEAVY_FIRST, VARLEN)
        if live:
            row0 = m0 + WG * Q_ROWS
            start, full_start, full_end, end = program_key_span(m0, sq, sk, LEFT, RIGHT, CAUSAL, BLOCK_M, BLOCK_N,
                                                                False, WINDOW)
            shift = sk - sq
            rows = row0 + gl.arange(0, Q_ROWS, layout=gl.SliceLayout(1, s_layout))
            # Varlen: stride_lb is 0 and the sequence's rows start at token q_start.
            l_base = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + q_start
            if SELF_DELTA:
                # As the preprocess kernel: lse2 = lse * log2(e), +inf where lse is -inf (and past sq).
                lse = gl.load(lse2_ptr + l_base + rows, mask=rows < sq, other=float("-inf"))
                lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
                tile_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
                mbarrier.wait(q_ready.index(WG), 0)
                o_rows = o_smem.index(WG).reshape([Q_ROWS, HEAD_DIM]).load(tile_layout).to(gl.float32)
                do_rows = do_smem.index(WG).reshape([Q_ROWS, HEAD_DIM]).load(tile_layout).to(gl.float32)
                delta = gl.convert_layout(gl.sum(o_rows * do_rows, axis=1), gl.SliceLayout(1, s_layout))
                # Rows past a varlen sequence's end read the next one's tokens: their P is 0 anyway.
                delta = gl.where(rows < sq, delta, 0.0)
            else:
                # Rows past sq: lse2 = +inf makes their probabilities 0.
                lse2 = gl.load(lse2_ptr + l_base + rows, mask=rows < sq, other=float("inf"))
                delta = gl.load(delta_ptr + l_base + rows, mask=rows < sq, other=0.0)

            zero_s = gl.zeros((Q_ROWS, BLOCK_N), dtype=gl.float32, layout=s_layout)
            dq = gl.zeros((Q_ROWS, HEAD_DIM), dtype=gl.float32, layout=acc_layout)
            q_buf = q_smem.index(WG)
            mbarrier.wait(q_ready.index(WG), 0)
            q_tile = q_buf.reshape([Q_ROWS, HEAD_DIM])
            do_tile = do_smem.index(WG).reshape([Q_ROWS, HEAD_DIM])
            # The ring step starts as a tensor (a literal 0 would be a constexpr, not loop-carriable).
            step = full_end * 0
            if WINDOW:
                dq, step = _dq_blocks(q_tile, do_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, dq, zero_s, lse2,
                                      delta, rows, step, start, full_start, sk, shift, qk_scale, LEFT, RIGHT, True,
                                      CAUSAL, BLOCK_N, HEAD_DIM, STAGES, WINDOW)
            dq, step = _dq_blocks(q_tile, do_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, dq, zero_s, lse2, delta,
                                  rows, step, full_start, full_end, sk, shift, qk_scale, LEFT, RIGHT, False, CAUSAL,
                                  BLOCK_N, HEAD_DIM, STAGES, WINDOW)
            dq, step = _dq_blocks(q_tile, do_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, dq, zero_s, lse2, delta,
                                  rows, step, full_end, end, sk, shift, qk_scale, LEFT, RIGHT, True, CAUSAL, BLOCK_N,
                                  HEAD_DIM, STAGES, WINDOW)

            # This warpgroup's q buffer is read by no pending wgmma now: it stages dQ. The TMA store
            # clips at the tensor's end, store_rows' masked stores at a varlen sequence's.
            store_rows(dq * sm_scale, dq_ptr, q_start + row0, q_start + sq, stride_qt, q_buf, dq_desc,
                       tma_batch(b, VARLEN), h * HEAD_DIM, VARLEN)
            tma.store_wait(0)

    @gluon.jit
    def attn_bwd_dq_gluon_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, o_desc, lse2_ptr, delta_ptr, cu_q_ptr,
                                 cu_k_ptr, dq_ptr, stride_qt, SEQ_Q, SEQ_K, HEADS_Q, GROUP, stride_lb, stride_lh,
                                 qk_scale, sm_scale, LEFT, RIGHT, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                                 MATH_REGS: gl.constexpr, LOAD_REGS: gl.constexpr, HEAVY_FIRST: gl.constexpr,
                                 WINDOW: gl.constexpr, VARLEN: gl.constexpr, SELF_DELTA: gl.constexpr = False):
        """Grid ``(cdiv(Sq, BLOCK_M), B * Hq)`` (the forward's), swapped with ``HEAVY_FIRST``
        (``_grid_position``); launched with 4 warps and ``maxnreg``. Scales, ``lse2``/``delta``,
        ``LEFT``/``RIGHT``, ``WINDOW`` and ``VARLEN`` (cu_seqlens, and ``dq_ptr`` with
        ``stride_qt`` elements per token for the tiles that run past a sequence's end) as
        ``attn_bwd_dkdv_gluon_kernel``'s; q, dO and dq descriptors have ``BLOCK_M / 2`` rows per
        block, k and v ``BLOCK_N``. ``SELF_DELTA`` (see ``_dq_math``): ``o_desc`` reads the
        forward's out as ``do_desc`` reads dO, and ``lse2_ptr`` is the natural-log lse; without it
        ``o_desc`` is not read."""
        Q_ROWS: gl.constexpr = BLOCK_M // 2
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, 1, Q_ROWS, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [2, 1, Q_ROWS, HEAD_DIM], do_desc.layout)
        if SELF_DELTA:
            o_smem = gl.allocate_shared_memory(o_desc.dtype, [2, 1, Q_ROWS, HEAD_DIM], o_desc.layout)
        else:
            o_smem = do_smem  # not read
        k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_ready, k_ready, v_ready, kv_empty = ring_barriers(STAGES)
        gl.warp_specialize([
            (_dq_math, (q_desc, k_desc, v_desc, do_desc, dq_desc, o_desc, lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr,
                        dq_ptr, stride_qt, q_smem, do_smem, o_smem, k_ring, v_ring, q_ready, k_ready, v_ready,
                        kv_empty, SEQ_Q, SEQ_K, HEADS_Q, GROUP, stride_lb, stride_lh, qk_scale, sm_scale, LEFT, RIGHT,
                        CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HEAVY_FIRST, WINDOW, VARLEN, SELF_DELTA, 0)),
            (_dq_math, (q_desc, k_desc, v_desc, do_desc, dq_desc, o_desc, lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr,
                        dq_ptr, stride_qt, q_smem, do_smem, o_smem, k_ring, v_ring, q_ready, k_ready, v_ready,
                        kv_empty, SEQ_Q, SEQ_K, HEADS_Q, GROUP, stride_lb, stride_lh, qk_scale, sm_scale, LEFT, RIGHT,
                        CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HEAVY_FIRST, WINDOW, VARLEN, SELF_DELTA, 1)),
            (_dq_load, (q_desc, k_desc, v_desc, do_desc, dq_desc, o_desc, lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr,
                        dq_ptr, stride_qt, q_smem, do_smem, o_smem, k_ring, v_ring, q_ready, k_ready, v_ready,
                        kv_empty, SEQ_Q, SEQ_K, HEADS_Q, GROUP, stride_lb, stride_lh, qk_scale, sm_scale, LEFT, RIGHT,
                        CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HEAVY_FIRST, WINDOW, VARLEN, SELF_DELTA)),
        ], [4, 1], [MATH_REGS, LOAD_REGS])


# -- the gate ------------------------------------------------------------------------------------------
_read_switch = env_text_reader(ATTN_GLUON_BWD_ENV)


def switch_refusal() -> Optional[str]:
    """Why ``PRIMUS_TURBO_ATTN_GLUON_BWD`` keeps the kernels off, or None (unset or a true value:
    on). A malformed value raises ConfigError naming the variable."""
    raw = _read_switch()
    if parse_bool(raw, ATTN_GLUON_BWD_ENV) is False:
        return f"the Gluon attention backward is switched off ({ATTN_GLUON_BWD_ENV}={raw})"
    return None


_read_heavy_first = env_text_reader(ATTN_GLUON_BWD_HEAVY_FIRST_ENV)
_read_overlap = env_text_reader(ATTN_GLUON_BWD_OVERLAP_ENV)
_read_self_delta = env_text_reader(ATTN_GLUON_BWD_SELF_DELTA_ENV)


def heavy_first_setting() -> bool:
    """``PRIMUS_TURBO_ATTN_GLUON_BWD_HEAVY_FIRST`` read now: True unless set to a false value (the
    causal programs start heaviest block first across all heads). A malformed value raises
    ConfigError naming the variable."""
    return parse_bool(_read_heavy_first(), ATTN_GLUON_BWD_HEAVY_FIRST_ENV) is not False


def overlap_setting() -> bool:
    """``PRIMUS_TURBO_ATTN_GLUON_BWD_OVERLAP`` read now: True unless set to a false value (the dQ
    kernel runs on a side stream next to the dK/dV kernel, in eager execution). A malformed value
    raises ConfigError naming the variable."""
    return parse_bool(_read_overlap(), ATTN_GLUON_BWD_OVERLAP_ENV) is not False


def self_delta_setting() -> bool:
    """``PRIMUS_TURBO_ATTN_GLUON_BWD_SELF_DELTA`` read now: True only if set to a true value (the
    dQ kernel computes its rows' delta and lse2 itself, so that the preprocess runs on the side
    stream next to it, before the dK/dV kernel; used only where the overlap runs). A malformed
    value raises ConfigError naming the variable."""
    return parse_bool(_read_self_delta(), ATTN_GLUON_BWD_SELF_DELTA_ENV) is True


def variant_tag() -> str:
    """The variants away from their defaults as an identity suffix ("" by default, else
    "+no-heavy-first", "+no-overlap" and/or "+self-delta"), so that timings of one setting never
    stand for another's."""
    return (("" if heavy_first_setting() else "+no-heavy-first") + ("" if overlap_setting() else "+no-overlap")
            + ("+self-delta" if self_delta_setting() else ""))


def machine_refusal() -> Optional[str]:
    """Why this process cannot run the kernels at all, or None: this backward's switch, then the
    machine gate every Gluon kernel of the package shares (``fp8_blockwise_gluon.available``)."""
    return switch_refusal() or available()


def gluon_backward_refusal(p, q: Optional[torch.Tensor] = None, k: Optional[torch.Tensor] = None,
                           v: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                           dout: Optional[torch.Tensor] = None) -> Optional[str]:
    """None when these kernels serve the backward of problem ``p`` (with these tensors where
    given), else why not: the machine's reason, then the problem's (the Gluon forward's problem
    rules: ``attention_gluon.problem_refusal``), then the tensors'. q, k and v are read by TMA
    (``attention_gluon.tensor_refusal``); out is read through pointers and dout is copied to a
    TMA-readable layout where it is not, so of those two only the device is asked."""
    why = machine_refusal() or problem_refusal(p)
    if why or q is None:
        return why
    why = tensor_refusal(q=q, k=k, v=v)
    if why:
        return why
    for name, t in (("out", out), ("dout", dout)):
        if t is not None and t.device.type != "cuda":
            return f"{name} is on {t.device}"
    return None


# -- launch --------------------------------------------------------------------------------------------
#: The most blocks the second grid dimension holds (the heavy-first order puts blocks there).
_GRID_Y = 65535


def _grid(blocks: int, heads: int, heavy_first: bool) -> tuple[int, int]:
    """The launch grid of ``blocks`` blocks of ``heads`` (batch x heads) programs: ``(heads,
    blocks)`` in the heavy-first order (``_grid_position``), else ``(blocks, heads)``."""
    return (heads, blocks) if heavy_first else (blocks, heads)


def _heavy_first(causal: bool, heavy_first: bool, seqlen: int) -> bool:
    """Whether a launch over ``seqlen`` rows runs the heavy-first order: asked for, causal, and
    its blocks fit the grid's second dimension."""
    return bool(causal and heavy_first and -(-seqlen // BLOCK) <= _GRID_Y)


def _shapes(q: torch.Tensor, k: torch.Tensor, cu_seqlens, max_seqlens) -> tuple[int, int, int, int, int, int]:
    """``(B, Sq, Sk, Hq, Hkv, D)`` of a dense launch, or of a varlen one (``cu_seqlens`` given:
    packed ``[T, H, D]`` tensors, Sq and Sk the caller's ``max_seqlens``)."""
    if cu_seqlens is not None:
        return (cu_seqlens[0].numel() - 1, *max_seqlens, q.shape[1], k.shape[1], q.shape[2])
    return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]


def _lse_strides(lse2: torch.Tensor, varlen: bool) -> tuple[int, int]:
    """(batch, head) strides of a dense ``[B, Hq, Sq]`` or varlen ``[Hq, Tq]`` (batch stride 0) lse2."""
    return (0, lse2.stride(0)) if varlen else (lse2.stride(0), lse2.stride(1))


def dkdv_launch_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, dk: torch.Tensor,
                     dv: torch.Tensor, lse2: torch.Tensor, delta: torch.Tensor, softmax_scale: float,
                     causal: bool, heavy_first: bool = False, window: Optional[tuple[int, int]] = None,
                     cu_seqlens: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                     max_seqlens: Optional[tuple[int, int]] = None) -> tuple[tuple, tuple, dict]:
    """``(grid, args, kwargs)`` of the dK/dV launch writing ``dk`` and ``dv``, its causal programs
    in the heavy-first order if ``heavy_first`` (and the grid holds it), the ``WINDOW`` kernel for
    ``window`` = ``(window_left, window_right)`` where given, the ``VARLEN`` one for
    ``cu_seqlens`` = ``(cu_seqlens_q, cu_seqlens_k)`` (packed ``[T, H, D]`` tensors, lse2 and
    delta ``[Hq, Tq]``, ``max_seqlens`` the caller's ``(max_seqlen_q, max_seqlen_k)``);
    tools/compile_sm90.py compiles with them."""
    varlen = cu_seqlens is not None
    b, sq, sk, hq, hk, d = _shapes(q, k, cu_seqlens, max_seqlens)
    cfg = dkdv_config(d, causal, _heavy_first(causal, heavy_first, sk), window is not None, varlen)
    keys = cfg.block_n // 2
    cu_q, cu_k = cu_seqlens if varlen else (lse2, lse2)  # stand-ins: read under VARLEN only
    args = (descriptor(q, cfg.block_m), descriptor(k, keys), descriptor(v, keys), descriptor(dout, cfg.block_m),
            descriptor(dk, keys), descriptor(dv, keys), lse2, delta, cu_q, cu_k, dk, dv, hk * d if varlen else 0, sq,
            sk, hk, hq // hk, *_lse_strides(lse2, varlen), softmax_scale * _LOG2E, softmax_scale,
            *window_bounds(*(window or (-1, -1))))
    kwargs = dict(CAUSAL=bool(causal), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=d, STAGES=cfg.stages,
                  MATH_REGS=MATH_REGS, LOAD_REGS=LOAD_REGS, HEAVY_FIRST=cfg.heavy_first, WINDOW=cfg.window,
                  VARLEN=varlen, num_warps=4, maxnreg=MAXNREG)
    return _grid(-(-sk // cfg.block_n), b * hk, cfg.heavy_first), args, kwargs


def dq_launch_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor,
                   lse2: torch.Tensor, delta: torch.Tensor, softmax_scale: float, causal: bool,
                   heavy_first: bool = False, window: Optional[tuple[int, int]] = None,
                   cu_seqlens: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                   max_seqlens: Optional[tuple[int, int]] = None,
                   self_delta: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[tuple, tuple, dict]:
    """``(grid, args, kwargs)`` of the dQ launch writing ``dq``, its causal programs in the
    heavy-first order if ``heavy_first`` (and the grid holds it), ``window``, ``cu_seqlens`` and
    ``max_seqlens`` as in ``dkdv_launch_args``; ``self_delta`` = ``(out, lse)`` (the forward's,
    out laid out as TMA reads it, lse in ``lse2``'s layout) launches the ``SELF_DELTA`` kernel,
    which reads neither ``lse2`` nor ``delta``. tools/compile_sm90.py compiles with them."""
    varlen = cu_seqlens is not None
    b, sq, sk, hq, hk, d = _shapes(q, k, cu_seqlens, max_seqlens)
    cfg = dq_config(d, causal, _heavy_first(causal, heavy_first, sq), window is not None, varlen,
                    self_delta is not None)
    rows = cfg.block_m // 2
    cu_q, cu_k = cu_seqlens if varlen else (lse2, lse2)  # stand-ins: read under VARLEN only
    o_desc, lse_in = (descriptor(self_delta[0], rows), self_delta[1]) if self_delta is not None else \
        (descriptor(dout, rows), lse2)  # without SELF_DELTA the out descriptor is a stand-in, never read
    args = (descriptor(q, rows), descriptor(k, cfg.block_n), descriptor(v, cfg.block_n), descriptor(dout, rows),
            descriptor(dq, rows), o_desc, lse_in, delta, cu_q, cu_k, dq, hq * d if varlen else 0, sq, sk, hq,
            hq // hk, *_lse_strides(lse2, varlen), softmax_scale * _LOG2E, softmax_scale,
            *window_bounds(*(window or (-1, -1))))
    kwargs = dict(CAUSAL=bool(causal), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=d, STAGES=cfg.stages,
                  MATH_REGS=MATH_REGS, LOAD_REGS=LOAD_REGS, HEAVY_FIRST=cfg.heavy_first, WINDOW=cfg.window,
                  VARLEN=varlen, SELF_DELTA=cfg.self_delta, num_warps=4, maxnreg=MAXNREG)
    return _grid(-(-sq // cfg.block_m), b * hq, cfg.heavy_first), args, kwargs


def _tma_readable(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy where its layout is not one the descriptors read."""
    return x if tensor_refusal(x=x) is None else x.contiguous()


def attend_backward(p, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    dout: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor] = None,
                    cu_seqlens_k: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) shaped like q, k, v in their dtype, from the forward's out and float32
    natural-log lse ``[B, Hq, Sq]`` (varlen: ``[Hq, Tq]``, with both cu_seqlens, which only the
    device reads; tokens past the last sequence get zero gradients), for a call
    ``gluon_backward_refusal`` accepted; the gradients ``attention.attend_backward`` computes, bit
    for bit the same whatever the switches (they change when and where programs run, not what one
    computes).

    With ``PRIMUS_TURBO_ATTN_GLUON_BWD_OVERLAP`` on, in eager execution on CUDA tensors
    (``side_streams.overlappable``), the dK/dV kernel goes on a side stream and is launched first,
    the dQ kernel on the current stream (``side_streams.side_by_side``): both read only what the
    preprocess wrote before the fork, write disjoint outputs allocated before it, and the current
    stream waits for both before returning. With ``PRIMUS_TURBO_ATTN_GLUON_BWD_SELF_DELTA`` on as
    well, the preprocess moves onto the side stream ahead of the dK/dV kernel and the dQ kernel
    computes its rows' delta from out and dout itself: dk and dv are unchanged, dq's delta is
    summed in another order (the last bits of dq may differ from the default's)."""
    dout = _tma_readable(dout.to(q.dtype))
    lse = lse.contiguous()
    # Rows outside every sequence (varlen) are never read: the kernels mask rows past each end.
    lse2, delta = torch.empty_like(lse), torch.empty_like(lse)
    d = p.head_dim_v
    varlen = p.varlen
    cu_q = cu_seqlens_q if varlen else lse  # a stand-in, never read without VARLEN
    lse_strides = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))

    def preprocess() -> None:
        AK.attn_bwd_preprocess_kernel[(p.batch * p.heads_q, -(-p.seqlen_q // PRE_BLOCK_M))](
            out, dout, lse, lse2, delta, cu_q, *((0, *out.stride()) if varlen else out.stride()),
            *((0, *dout.stride()) if varlen else dout.stride()), *lse_strides, p.seqlen_q, p.heads_q,
            VARLEN=varlen, D_V=d, BLOCK_DV=d, BLOCK_M=PRE_BLOCK_M)

    overlap = overlap_setting() and overlappable(q)
    self_delta = overlap and self_delta_setting()
    # Contiguous, whatever q, k, v's strides: the descriptors store packed heads.
    dq, dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
    heavy_first = heavy_first_setting()
    window = (p.window_left, p.window_right) if has_window(p) else None
    seqs = dict(cu_seqlens=(cu_seqlens_q, cu_seqlens_k), max_seqlens=(p.seqlen_q, p.seqlen_k)) if varlen else {}
    dkdv_launch = dkdv_launch_args(q, k, v, dout, dk, dv, lse2, delta, p.softmax_scale, p.causal, heavy_first,
                                   window, **seqs)
    dq_launch = dq_launch_args(q, k, v, dout, dq, lse2, delta, p.softmax_scale, p.causal, heavy_first, window,
                               **seqs, self_delta=(_tma_readable(out.to(q.dtype)), lse) if self_delta else None)

    def run_dkdv() -> None:
        if self_delta:
            preprocess()
        grid, args, kwargs = dkdv_launch
        attn_bwd_dkdv_gluon_kernel[grid](*args, **kwargs)

    def run_dq() -> None:
        grid, args, kwargs = dq_launch
        attn_bwd_dq_gluon_kernel[grid](*args, **kwargs)

    if not self_delta:
        preprocess()
    if overlap:
        side_by_side(run_dq, run_dkdv, q.device)
    else:
        run_dkdv()
        run_dq()
    if varlen:
        # The kernels write every token of every sequence; the tokens past the last one read 0.
        for grad, cu in ((dq, cu_seqlens_q), (dk, cu_seqlens_k), (dv, cu_seqlens_k)):
            zero_tokens_past(grad, cu)
    return dq, dk, dv


__all__ = ["ATTN_GLUON_BWD_ENV", "ATTN_GLUON_BWD_HEAVY_FIRST_ENV", "ATTN_GLUON_BWD_OVERLAP_ENV",
           "ATTN_GLUON_BWD_SELF_DELTA_ENV", "KERNEL_REVISION", "self_delta_setting",
           "GluonAttnBwdConfig", "attend_backward", "dkdv_config", "dkdv_launch_args", "dq_config", "dq_launch_args",
           "gluon_backward_refusal", "heavy_first_setting", "machine_refusal", "overlap_setting", "switch_refusal",
           "variant_tag", "window_query_span_host"]
