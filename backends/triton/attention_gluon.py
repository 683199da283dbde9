"""Flash attention forward for Hopper in Gluon: one TMA warp, two softmax/MMA warpgroups.

Serves a subset of the TRITON attention adapter's calls (``gluon_forward_refusal`` names every
case it leaves to the plain-Triton kernel of attention_kernels.py): dense bf16/fp16 batches
``q [B, Sq, Hq, D]``, ``k``/``v [B, Sk, Hkv, D]`` with D = 64 or 128 for q, k and v, MHA/GQA/MQA,
no mask, the bottom-right causal mask or (behind ``PRIMUS_TURBO_ATTN_GLUON_WINDOW``) a sliding
window, Sq != Sk, any softmax scale. Its results mean what
``attention_kernels.attn_fwd_kernel``'s mean, so the backward kernels start from them unchanged:
out ``[B, Sq, Hq, D]`` in the inputs' dtype, and the float32 natural-log lse of the scaled scores
``[B, Hq, Sq]``; a row that may attend no key (causal with Sq > Sk; a right window bound with
Sq > Sk + right, the only way a window empties a row) gets out = 0 and lse = -inf. Varlen calls
(``VARLEN``) take packed ``q [Tq, Hq, D]``, ``k``/``v [Tk, Hkv, D]`` with int32 ``cu_seqlens``
read on the device only, and give out ``[Tq, Hq, D]`` and the lse ``[Hq, Tq]``, the masks per
sequence; rows of a sequence without keys and tokens past the last sequence get out 0, lse -inf.

Structure (one program per 128 query rows of one head, ``(query blocks, B * Hq)`` grid, the
causal blocks with the most keys first):

* a loader partition of one warp issues TMA copies: each math warpgroup's 64 rows of q once,
  then k and v blocks of ``BLOCK_N`` keys into a ring of ``STAGES`` slots, each slot with a
  ``k_ready`` and a ``v_ready`` mbarrier (so S = Q K^T starts before v lands) and a ``kv_empty``
  mbarrier that both math warpgroups arrive on once their PV product has read the slot;
* two math warpgroups (the default partition and a 4-warp worker, as in
  fp8_blockwise_gluon_ws.py) own 64 rows each and synchronise only through those mbarriers, so
  one warpgroup's softmax runs on the CUDA cores while the other's wgmmas run on the tensor
  cores. Per key block: S = Q K^T (wgmma, both operands in shared memory), the online softmax in
  fp32 in the exp2 domain (scores times ``scale * log2(e)``), P rounded to the inputs' dtype in
  registers as the A operand of O += P V (wgmma), then the slot is released;
* causal: key blocks past the last row's diagonal are never loaded; the blocks that every row of
  the program may attend whole run without a mask, the rest (the diagonal and the sequence end)
  with one;
* sliding windows (``WINDOW``, two math warpgroups only): row ``i`` attends key ``j`` iff
  ``i + Sk - Sq - LEFT <= j <= i + Sk - Sq + RIGHT`` (``window_bounds``: an unbounded side is
  ``UNBOUNDED``). ``block_span`` gives each program its key blocks: the loader starts at the first
  block some row attends, not at 0, and stops after the last; the blocks every row attends whole
  run unmasked, those at both edges masked. ``block_span_host`` and ``window_key_span_host`` are
  their host mirrors, which the CPU tests hold to the kernels' text and to a brute-force mask;
* tails: q, k, v and out are read and written through rank-3 TMA descriptors over
  ``[B, S, H * D]``, which clip at each sequence's end (zeros read, nothing written past it), so
  odd lengths need no padding and no other batch's tokens are read; keys past Sk are masked out
  of the scores;
* epilogue: each math warpgroup normalises its rows, stages them in its own q buffer (no longer
  read) and stores them by TMA; the lse goes out through masked pointer stores;
* varlen (``VARLEN``): the descriptors read the packed tensors as one batch ``[1, T, H * D]``
  (``as_batch``) and each program reads its sequence's first token and length from cu_seqlens
  (``program_rows``; a block past its sequence's end does nothing, causal blocks run each
  sequence's last block first). TMA clips only at ``T``, so the last key block of a sequence reads
  the next one's keys (masked out of the scores like the dense tail: k/v tokens that belong to no
  sequence must be finite, since P = 0 multiplies them), and an output tile that runs past its
  sequence's end is written by masked pointer stores instead of TMA (``store_rows``).

The pipelined variant (``PIPELINE``; the default at head dim 128, where it measured faster, and
forced on or off for every head dim by ``PRIMUS_TURBO_ATTN_GLUON_PIPELINE=1``/``0``) also
overlaps part of a warpgroup's own softmax with its own wgmmas, in the FlashAttention-3 order: per
key block j it issues S_j = Q K_j^T, rescales O while S_j runs, issues O += P_{j-1} V_{j-1}, waits
for S_j alone (one group left in flight), runs block j's softmax, then waits for the PV product
and releases its slot. One S tile is live at a time, and P_{j-1} is a dependency of that last wait,
so no register of an in-flight wgmma is written and ptxas keeps the wgmmas asynchronous. ptxas
does schedule that wait right after the softmax's row maximum (its own choice: rounding P after the
wait in the source compiles to the same SASS), so the exponentials run after the PV product. The
first block of the span (block 0, but for a window) runs before the loop, masked (a program whose
rows attend no key runs it too, fully masked), and the last PV product after it. A
slot is released one block later than in the default variant, so the ring has one slot more
(``PIPELINED_TILES``).

Variants, each on its own switch (``VARIANT_SWITCHES``: three warpgroups and the folded scale on
by default, the emulated exponentials off, as measured), for the head dims where the softmax, not
the tensor cores, sets the pace (d64: a 128-key block costs each
math warp about as many issue slots and MUFU cycles as its two wgmmas take on the tensor cores):

* ``PRIMUS_TURBO_ATTN_GLUON_WG3``: three math warpgroups (192 query rows per program; d64 only,
  unpipelined), so that three warps per SM sub-partition hide one another's softmax latency and
  each loaded key block serves 192 rows. Causal warpgroups walk only their own rows' key span and
  hand the slots of the program's later blocks back unread;
* ``PRIMUS_TURBO_ATTN_GLUON_FOLD_SCALE``: the row maximum of the raw scores, the scale folded into
  the exponent's FFMA (one multiply per score less; positive scales only);
* ``PRIMUS_TURBO_ATTN_GLUON_EXP2_EMU``: one exponential in eight of the unmasked blocks by a cubic
  on the FMA pipe (``_exp2_mixed``), the rest on MUFU.

Needs triton with Gluon on a release in ``GLUON_TRITON_RELEASES`` and an sm_90 GPU.
``PRIMUS_TURBO_ATTN_GLUON=0`` switches the kernel off, as ``PRIMUS_TURBO_GLUON_KERNELS=0`` does
every Gluon kernel (the adapter then runs the plain-Triton forward); both are read on every call,
as are ``PRIMUS_TURBO_ATTN_GLUON_PIPELINE``, the variant switches and
``PRIMUS_TURBO_ATTN_GLUON_WINDOW`` (on by default; set to a false value, windowed calls run the
plain-Triton kernels, forward and backward).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from turbo_dispatch.env import env_text_reader, parse_bool

from .grouped_launch import zero_padded_tail
from .fp8_blockwise_gluon import available, gluon, shared_layout
from .gemm_kernels import bind_cuda_context

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    from .fp8_blockwise_gluon import GluonDescriptor, _cta_barrier, _tma_load
    from .fp8_blockwise_gluon_ws import _tma_store

#: Set to 0/false to keep every attention call on the plain-Triton forward kernel.
ATTN_GLUON_ENV = "PRIMUS_TURBO_ATTN_GLUON"
#: 1/true: the pipelined variant at every head dim; 0/false: at none; unset: ``PIPELINED_HEAD_DIMS``.
ATTN_GLUON_PIPELINE_ENV = "PRIMUS_TURBO_ATTN_GLUON_PIPELINE"
#: Three math warpgroups (192 query rows per program) at the head dims of ``WG3_TILES``, unpipelined
#: whatever ``PRIMUS_TURBO_ATTN_GLUON_PIPELINE`` says; on unless set to 0/false.
ATTN_GLUON_WG3_ENV = "PRIMUS_TURBO_ATTN_GLUON_WG3"
#: The row maximum of the raw scores, the scale folded into the exponent's FFMA (calls with a
#: positive softmax scale); on unless set to 0/false.
ATTN_GLUON_FOLD_SCALE_ENV = "PRIMUS_TURBO_ATTN_GLUON_FOLD_SCALE"
#: 1/true: one exponential in ``EXP2_EMU_PACK`` of the unmasked key blocks by a polynomial on the
#: FMA units instead of MUFU; off by default (it measured slower).
ATTN_GLUON_EXP2_EMU_ENV = "PRIMUS_TURBO_ATTN_GLUON_EXP2_EMU"
#: 1/true: calls with a sliding window (``window_left >= 0`` or ``window_right > 0``) run the
#: ``WINDOW`` kernels, forward and backward; off by default (the plain-Triton kernels serve them).
ATTN_GLUON_WINDOW_ENV = "PRIMUS_TURBO_ATTN_GLUON_WINDOW"
#: Bumped whenever a variant's code or the choice between them changes.
KERNEL_REVISION = "attn-gluon-r4"
#: Head dims that run the pipelined variant unless the switch says otherwise: at d128 it ran
#: 1.05-1.08x the default variant's forward on an H200, at d64 0.95x (docs/performance.md).
PIPELINED_HEAD_DIMS = frozenset({128})
#: Query rows per math warpgroup (one wgmma M).
ROWS = 64
#: Query rows per program: two math warpgroups of 64 rows.
BLOCK_M = 2 * ROWS
#: Registers per thread requested for the math warpgroups and the loader, and the kernel-wide
#: cap: three warpgroups (default math, worker math, loader padded to a warpgroup) share 64K
#: registers, and the default partition gets what the cap leaves (3 * 168 - 232 - 40 = 232).
MATH_REGS, LOAD_REGS, MAXNREG = 232, 40, 168
#: The same with three math warpgroups: four warpgroups share 64K registers (cap 128), and
#: 4 * 128 - 2 * 160 - 32 leaves the default partition 160 as well.
WG3_REGS = (160, 32, 128)
#: Warps a program runs: the default math warpgroup, the worker math warpgroup(s) and the loader.
WARPS = 9
#: Exponentials per inline-asm group of the ``EXP2_EMU`` variant, one of them by polynomial: at
#: d64 a key block costs each math warp ~440 issue slots besides the exponentials (scale folded)
#: and 64 MUFU.EX2 of 8 cycles each, so moving one in eight (+8 issue slots each) to the FMA pipe
#: roughly balances the two.
EXP2_EMU_PACK = 8
_HALF = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_LOG2E = 1.4426950408889634


class GluonAttnConfig(NamedTuple):
    """One compiled variant: ``BLOCK_N`` keys per ring slot and ``STAGES`` slots for head dim
    ``head_dim``, pipelined or not, ``math_wgs`` math warpgroups of ``ROWS`` query rows, the
    softmax's options (``fold_scale``, ``exp2_emu``: see their switches), and ``window``: the
    sliding-window mask (``WINDOW``), ``varlen``: packed sequences (``VARLEN``; the launch decides
    it, the field names the compiled kernel for tools/compile_sm90.py). Fields 4 and 5 are where
    tools/compile_sm90.py reads stages and warps."""

    block_m: int
    block_n: int
    head_dim: int
    causal: bool
    stages: int
    warps: int = WARPS
    pipeline: bool = False
    math_wgs: int = 2
    fold_scale: bool = False
    exp2_emu: bool = False
    window: bool = False
    varlen: bool = False

    def regs(self) -> tuple[int, int, int]:
        """(math partitions', loader's, kernel-wide cap) registers per thread."""
        return WG3_REGS if self.math_wgs == 3 else (MATH_REGS, LOAD_REGS, MAXNREG)


#: (BLOCK_N, STAGES) per head dim: the ring fills shared memory as far as it goes with 128-key
#: slots (d128: q 32 KiB + 2 x 64 KiB; d64: q 16 KiB + 3 x 32 KiB).
TILES = {64: (128, 3), 128: (128, 2)}
#: The pipelined variant's: a warpgroup holds two slots at once (block j's k, block j-1's v), so
#: one slot more keeps a full block of loading ahead (d128: q 32 KiB + 3 x 64 KiB = 224 KiB).
PIPELINED_TILES = {64: (128, 4), 128: (128, 3)}
#: The three-warpgroup variant's, at the head dims it serves: its math warpgroups hold
#: 64 x 128 scores, P and a 64 x D accumulator in 160 registers, which d64 fits (d128 does not);
#: three consumers drift apart further, so one slot more than the default (q 24 KiB + 4 x 32 KiB).
WG3_TILES = {64: (128, 4)}


def config_for(head_dim: int, causal: bool, pipeline: bool = False, wg3: bool = False, fold_scale: bool = False,
               exp2_emu: bool = False, window: bool = False, varlen: bool = False) -> GluonAttnConfig:
    """The variant that serves head dim ``head_dim`` (64 or 128): pipelined or the default, with
    three math warpgroups where ``wg3`` and ``WG3_TILES`` serves the head dim (then unpipelined),
    and the softmax options as asked. ``window``: the sliding-window kernel, always on two math
    warpgroups (three would each walk a span of their own inside the program's, at both edges).
    ``varlen``: the packed-sequence kernel (the same tiles and variants)."""
    wg3 = bool(wg3) and head_dim in WG3_TILES and not window
    pipeline = bool(pipeline) and not wg3
    block_n, stages = (WG3_TILES if wg3 else PIPELINED_TILES if pipeline else TILES)[head_dim]
    wgs = 3 if wg3 else 2
    return GluonAttnConfig(ROWS * wgs, block_n, head_dim, bool(causal), stages, 4 * wgs + 1, pipeline, wgs,
                           bool(fold_scale), bool(exp2_emu), bool(window), bool(varlen))


#: The bound a window side that is unbounded (-1) is launched with: no query row is that far
#: from any key, and row + shift +- this stays inside int32 for sequences below 2^29.
UNBOUNDED = 1 << 30


def window_bounds(window_left: int, window_right: int) -> tuple[int, int]:
    """``(LEFT, RIGHT)`` the ``WINDOW`` kernels take for the op's ``window_size``: each side as is,
    ``UNBOUNDED`` where it is -1. Row ``i`` attends key ``j`` iff
    ``i + shift - LEFT <= j <= i + shift + RIGHT`` (``shift = Sk - Sq``)."""
    return (UNBOUNDED if window_left < 0 else int(window_left), UNBOUNDED if window_right < 0 else int(window_right))


def block_span_host(a0: int, a_last: int, len_b: int, shift: int, lo_w: int, hi_w: int, BLOCK: int):
    """``block_span`` on the host, expression for expression (the tests hold the two texts equal
    and check this one against the brute-force mask); ``//`` only ever meets non-negative
    operands, where Python's floor and the kernels' truncation agree."""
    lo = max(a0 + shift - lo_w, 0)
    full_lo = max(a_last + shift - lo_w, 0)
    hi = min(a_last + shift + hi_w + 1, len_b)
    full_hi = min(a0 + shift + hi_w + 1, len_b)
    start = (lo // BLOCK) * BLOCK
    end = max(hi, start)
    end_blocks = start + ((end - start + BLOCK - 1) // BLOCK) * BLOCK
    full_start = min(start + ((full_lo - start + BLOCK - 1) // BLOCK) * BLOCK, end_blocks)
    full_end = full_start + (max(full_hi - full_start, 0) // BLOCK) * BLOCK
    return start, full_start, full_end, end


def window_key_span_host(m0: int, sq: int, sk: int, left: int, right: int, BLOCK_M: int, BLOCK_N: int,
                         PIPELINE: bool):
    """``window_key_span`` on the host, expression for expression (see ``block_span_host``)."""
    m_last = min(m0 + BLOCK_M, sq) - 1
    start, full_start, full_end, end = block_span_host(m0, m_last, sk, sk - sq, left, right, BLOCK_N)
    if PIPELINE:
        end = max(end, start + 1)
    return start, full_start, full_end, end


if gluon is not None:

    @gluon.jit
    def key_span(m0, sq, sk, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  PIPELINE: gl.constexpr):
        """``(full_end, end)`` for the query rows ``m0 .. m0 + BLOCK_M - 1``: key blocks starting
        below ``full_end`` need no mask for any row, those in [full_end, end) need one, keys from
        ``end`` on are attended by no row. Causal row ``i`` attends keys ``j <= i + sk - sq``.
        ``PIPELINE``: ``end >= 1``, since the pipelined variant always runs block 0."""
        if CAUSAL:
            m_last = gl.minimum(m0 + BLOCK_M, sq) - 1
            end = gl.maximum(gl.minimum(m_last + sk - sq + 1, sk), 1 if PIPELINE else 0)
            full = gl.maximum(gl.minimum(m0 + sk - sq + 1, sk), 0)
        else:
            end = sk
            full = sk
            if PIPELINE:
                # Varlen: a sequence without keys still runs (and masks) block 0.
                end = gl.maximum(m0 * 0 + sk, 1)
        return (full // BLOCK_N) * BLOCK_N, end

    @gluon.jit
    def block_span(a0, a_last, len_b, shift, lo_w, hi_w, BLOCK: gl.constexpr):
        """The blocks of ``BLOCK`` along axis B that rows ``a0 .. a_last`` of axis A meet, when row
        ``a`` meets ``b`` iff ``a + shift - lo_w <= b <= a + shift + hi_w`` and ``0 <= b < len_b``
        (``a0 + shift - lo_w < len_b``: each row's range starts inside axis B).
        ``(start, full_start, full_end, end)``: the blocks starting in [start, end) are exactly
        those holding a met ``b`` (the rows' ranges tile one interval); those in
        [full_start, full_end) lie inside every row's range and below ``len_b`` (no mask), those
        in [start, full_start) and [full_end, end) need the mask. An empty span has
        ``end == start``. ``block_span_host`` is its host mirror."""
        lo = gl.maximum(a0 + shift - lo_w, 0)
        full_lo = gl.maximum(a_last + shift - lo_w, 0)
        hi = gl.minimum(a_last + shift + hi_w + 1, len_b)
        full_hi = gl.minimum(a0 + shift + hi_w + 1, len_b)
        start = (lo // BLOCK) * BLOCK
        end = gl.maximum(hi, start)
        end_blocks = start + ((end - start + BLOCK - 1) // BLOCK) * BLOCK
        full_start = gl.minimum(start + ((full_lo - start + BLOCK - 1) // BLOCK) * BLOCK, end_blocks)
        full_end = full_start + (gl.maximum(full_hi - full_start, 0) // BLOCK) * BLOCK
        return start, full_start, full_end, end

    @gluon.jit
    def window_key_span(m0, sq, sk, left, right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        PIPELINE: gl.constexpr):
        """``block_span`` of the key blocks for the query rows ``m0 .. m0 + BLOCK_M - 1`` (those
        below ``sq``) under the window ``(left, right)`` (``window_bounds``'s). ``PIPELINE``:
        ``end > start``, since the pipelined variant always runs its first block (fully masked
        for rows that attend no key). ``window_key_span_host`` is its host mirror."""
        m_last = gl.minimum(m0 + BLOCK_M, sq) - 1
        start, full_start, full_end, end = block_span(m0, m_last, sk, sk - sq, left, right, BLOCK_N)
        if PIPELINE:
            end = gl.maximum(end, start + 1)
        return start, full_start, full_end, end

    @gluon.jit
    def program_key_span(m0, sq, sk, left, right, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, PIPELINE: gl.constexpr, WINDOW: gl.constexpr):
        """``(start, full_start, full_end, end)`` of the key blocks the query rows from ``m0``
        walk: ``window_key_span``'s under ``WINDOW``; else ``key_span``'s, whose blocks start at 0
        and need no mask below ``full_end``."""
        if WINDOW:
            start, full_start, full_end, end = window_key_span(m0, sq, sk, left, right, BLOCK_M, BLOCK_N, PIPELINE)
        else:
            start = 0
            full_start = 0
            full_end, end = key_span(m0, sq, sk, CAUSAL, BLOCK_M, BLOCK_N, PIPELINE)
        return start, full_start, full_end, end

    @gluon.jit
    def sequence(cu_ptr, b, SEQ, VARLEN: gl.constexpr):
        """``(first token, length)`` of sequence ``b``: from the int32 ``cu_seqlens`` at ``cu_ptr``
        (``VARLEN``), else ``(0, SEQ)``."""
        if VARLEN:
            start = gl.load(cu_ptr + b)
            length = gl.load(cu_ptr + b + 1) - start
        else:
            start = 0
            length = SEQ
        return start, length

    @gluon.jit
    def tma_batch(b, VARLEN: gl.constexpr):
        """The descriptors' batch coordinate of batch ``b``: 0 for packed varlen tensors (one
        ``[1, T, H * D]`` batch, ``descriptor``), else ``b``."""
        if VARLEN:
            tb = 0
        else:
            tb = b
        return tb

    @gluon.jit
    def program_rows(cu_q_ptr, cu_k_ptr, SEQ_Q, SEQ_K, HEADS_Q, GROUP, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                     VARLEN: gl.constexpr):
        """``query_block`` of this program of a ``(query blocks, B * Hq)`` grid."""
        return query_block(cu_q_ptr, cu_k_ptr, gl.program_id(0), gl.num_programs(0), gl.program_id(1), SEQ_Q, SEQ_K,
                           HEADS_Q, GROUP, CAUSAL, BLOCK_M, VARLEN)

    @gluon.jit
    def query_block(cu_q_ptr, cu_k_ptr, block, blocks, bh, SEQ_Q, SEQ_K, HEADS_Q, GROUP, CAUSAL: gl.constexpr,
                    BLOCK_M: gl.constexpr, VARLEN: gl.constexpr):
        """``(b, h, hk, m0, q_start, sq, k_start, sk, live)`` of query block ``block`` of ``blocks``
        of (batch x query head) ``bh``: batch, head, kv head, first query row, and the sequence's
        first query token, query count, first key token and key count (``sequence``). Causal
        programs walk the query blocks last-first, so the blocks with the most keys start first;
        varlen ones from each sequence's own last block. ``live``: the block starts inside its
        sequence (always, dense: the grid is exact; varlen grids cover the longest sequence). The
        forward's programs and the dQ kernel's share it."""
        b = bh // HEADS_Q
        h = bh % HEADS_Q
        q_start, sq = sequence(cu_q_ptr, b, SEQ_Q, VARLEN)
        k_start, sk = sequence(cu_k_ptr, b, SEQ_K, VARLEN)
        if CAUSAL:
            if VARLEN:
                block = (sq + BLOCK_M - 1) // BLOCK_M - 1 - block
            else:
                block = blocks - 1 - block
        m0 = block * BLOCK_M
        if VARLEN:
            live = (m0 >= 0) & (m0 < sq)
        else:
            live = True
        return b, h, h // GROUP, m0, q_start, sq, k_start, sk, live

    @gluon.jit
    def _attn_load(q_desc, k_desc, v_desc, o_desc, lse_ptr, cu_q_ptr, cu_k_ptr, o_ptr, stride_ot, q_smem, k_ring,
                   v_ring, q_ready, k_ready, v_ready, kv_empty, SEQ_Q, SEQ_K, HEADS_Q, GROUP, stride_lb, stride_lh,
                   qk_scale, LEFT, RIGHT, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PIPELINE: gl.constexpr, MATH_WGS: gl.constexpr,
                   FOLD: gl.constexpr, EMU: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr):
        """The loader: every math warpgroup's q rows, then every key block of the span in ring order
        (nothing for a varlen block past its sequence's end)."""
        b, h, hk, m0, q_start, sq, k_start, sk, live = program_rows(cu_q_ptr, cu_k_ptr, SEQ_Q, SEQ_K, HEADS_Q, GROUP,
                                                                    CAUSAL, BLOCK_M, VARLEN)
        tb = tma_batch(b, VARLEN)
        ROWS: gl.constexpr = BLOCK_M // MATH_WGS
        if live:
            for wg in gl.static_range(MATH_WGS):
                bar = q_ready.index(wg)
                mbarrier.expect(bar, q_desc.block_type.nbytes)
                _tma_load(q_desc, [tb, q_start + m0 + wg * ROWS, h * HEAD_DIM], bar, q_smem.index(wg))
            load_key_span(k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, kv_empty, tb, hk * HEAD_DIM, k_start, m0,
                          sq, sk, LEFT, RIGHT, CAUSAL, BLOCK_M, BLOCK_N, STAGES, PIPELINE, WINDOW)

    @gluon.jit
    def ring_barriers(STAGES: gl.constexpr):
        """``(once, ready_a, ready_b, empty)``, initialised: one barrier per math warpgroup for its
        rows loaded once, and per ring slot one barrier for each of the loader's two copies and an
        ``empty`` barrier both math warpgroups arrive on (count 2)."""
        return consumer_ring_barriers(STAGES, 2)

    @gluon.jit
    def consumer_ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """``ring_barriers`` for ``CONSUMERS`` math warpgroups: ``once`` has one barrier per
        warpgroup, ``empty`` counts ``CONSUMERS`` arrivals."""
        once = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        ready_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(once.index(i), count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready_a.index(s), count=1)
            mbarrier.init(ready_b.index(s), count=1)
            mbarrier.init(empty.index(s), count=CONSUMERS)
        return once, ready_a, ready_b, empty

    @gluon.jit
    def load_kv_ring(k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, kv_empty, b, col, k_start, start, end,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """The loader's stream of the key blocks starting in ``[start, end)`` of batch ``b`` (the
        descriptor's batch coordinate), keys counted from token ``k_start`` (a varlen sequence's
        first), columns from ``col``: k and v of each block into the next ring slot (the first into slot 0) once the
        math warpgroups have emptied it, each with its own ready barrier (so S = Q K^T can start
        before v lands)."""
        step = 0
        for n0 in range(start, end, BLOCK_N):
            slot = step % STAGES
            # A fresh mbarrier counts as having completed the phase before phase 0, so the first
            # pass over the ring does not wait.
            mbarrier.wait(kv_empty.index(slot), ((step // STAGES) & 1) ^ 1)
            kbar = k_ready.index(slot)
            mbarrier.expect(kbar, k_desc.block_type.nbytes)
            _tma_load(k_desc, [b, k_start + n0, col], kbar, k_ring.index(slot))
            vbar = v_ready.index(slot)
            mbarrier.expect(vbar, v_desc.block_type.nbytes)
            _tma_load(v_desc, [b, k_start + n0, col], vbar, v_ring.index(slot))
            step += 1

    @gluon.jit
    def load_key_span(k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, kv_empty, b, col, k_start, m0, sq, sk, left,
                      right, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, PIPELINE: gl.constexpr, WINDOW: gl.constexpr):
        """``load_kv_ring`` over the key blocks the query rows from ``m0`` attend
        (``program_key_span``)."""
        start, _, _, end = program_key_span(m0, sq, sk, left, right, CAUSAL, BLOCK_M, BLOCK_N, PIPELINE, WINDOW)
        load_kv_ring(k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, kv_empty, b, col, k_start, start, end, BLOCK_N,
                     STAGES)

    @gluon.jit
    def _exp2_mixed(x):
        """``exp2(x)`` for finite ``x <= 0`` (what the online softmax of an unmasked key block
        feeds it), one element in ``EXP2_EMU_PACK`` (8) by polynomial on the FMA and integer units
        instead of MUFU, to unload the MUFU pipe at small head dims: 2^x = 2^j * q(f) with
        j = rint(x) (the 1.5 * 2^23 rounding trick), f = x - j in [-1/2, 1/2], q a cubic within
        7.5e-5 relative of 2^f (well inside bf16/fp16's rounding of P), 2^j added to the exponent
        bits. x is clamped at -125 first, so 2^j * q(f) stays a normal float; what it gives there
        (2^-125, not 0) is negligible next to the row maximum's 1."""
        return gl.inline_asm_elementwise(
            """
            {
            .reg .f32 f, j;
            .reg .b32 t, q;
            ex2.approx.ftz.f32 $0, $8;
            ex2.approx.ftz.f32 $1, $9;
            ex2.approx.ftz.f32 $2, $10;
            ex2.approx.ftz.f32 $3, $11;
            ex2.approx.ftz.f32 $4, $12;
            ex2.approx.ftz.f32 $5, $13;
            ex2.approx.ftz.f32 $6, $14;
            max.ftz.f32 f, $15, 0fC2FA0000;
            add.rn.f32 t, f, 0f4B400000;
            sub.rn.f32 j, t, 0f4B400000;
            sub.rn.f32 f, f, j;
            fma.rn.f32 q, f, 0f3D61FB53, 0f3E786EE6;
            fma.rn.f32 q, q, f, 0f3F31798D;
            fma.rn.f32 q, q, f, 0f3F7FFB4A;
            shl.b32 t, t, 23;
            add.s32 $7, q, t;
            }
            """,
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r",
            [x],
            dtype=gl.float32,
            is_pure=True,
            pack=8,
        )

    @gluon.jit
    def key_mask(n0, rows, sk, shift, left, right, layout: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
        """Which keys ``n0 .. n0 + BLOCK_N - 1`` each query row of ``rows`` (in ``layout``'s row
        slice) attends: keys before ``sk`` and, with ``WINDOW``, inside ``[row + shift - left, row +
        shift + right]``, else causal, not past ``row + shift``. Broadcasts against a
        [rows, BLOCK_N] tile in ``layout``; the forward's softmax and the dQ kernel share it."""
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        ok = cols[None, :] < sk
        if WINDOW:
            diag = rows[:, None] + shift
            ok = ok & (cols[None, :] <= diag + right) & (cols[None, :] >= diag - left)
        elif CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None] + shift)
        return ok

    @gluon.jit
    def _softmax(s, n0, m_i, l_i, rows, sk, shift, qk_scale, left, right, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                 BLOCK_N: gl.constexpr, FOLD: gl.constexpr, EMU: gl.constexpr, WINDOW: gl.constexpr):
        """The online softmax's step for the raw scores ``s`` of the key block at ``n0``:
        ``(p, alpha, m_new, l_new)``, p in fp32 and the exp2 domain, ``alpha`` the factor that
        moves what is summed so far from max ``m_i`` to ``m_new``. ``MASKED`` masks keys past
        ``sk`` and, causal, past each row's diagonal; ``WINDOW``, outside each row's window
        ``[row + shift - left, row + shift + right]`` instead. ``FOLD`` (a positive ``qk_scale`` only):
        the row maximum of the raw scores, scaled once per row, so that the scale costs no
        multiply per score but rides in the exponent's FFMA. ``EMU``: unmasked blocks take
        ``_exp2_mixed``."""
        s_layout: gl.constexpr = s.type.layout
        if not FOLD:
            s = s * qk_scale
        if MASKED:
            ok = key_mask(n0, rows, sk, shift, left, right, s_layout, BLOCK_N, CAUSAL, WINDOW)
            s = gl.where(ok, s, float("-inf"))
        if FOLD:
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1))
        if MASKED:  # a row with no key yet keeps m = -inf: subtract 0 instead (exp2(-inf) = 0)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        if FOLD:
            x = s * qk_scale - m_use[:, None]
        else:
            x = s - m_use[:, None]
        if EMU and not MASKED:
            p = _exp2_mixed(x)
        else:
            p = gl.exp2(x)
        alpha = gl.exp2(m_i - m_use)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _attn_blocks(q_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, acc, m_i, l_i, zero_s, step, lo, hi, rows,
                     sk, shift, qk_scale, left, right, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                     BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr,
                     EMU: gl.constexpr, WINDOW: gl.constexpr):
        """The online softmax over the key blocks starting in [lo, hi), ring steps from ``step``;
        ``MASKED`` blocks mask as ``_softmax`` does.
        Returns ``(acc, m_i, l_i, step)``."""
        o_layout: gl.constexpr = acc.type.layout
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        for n0 in range(lo, hi, BLOCK_N):
            slot = step % STAGES
            phase = (step // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            k_tile = k_ring.index(slot).reshape([BLOCK_N, HEAD_DIM])
            s = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            p, alpha, m_new, l_i = _softmax(s, n0, m_i, l_i, rows, sk, shift, qk_scale, left, right, MASKED, CAUSAL,
                                            BLOCK_N, FOLD, EMU, WINDOW)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(k_ring.dtype), p_layout)
            mbarrier.wait(v_ready.index(slot), phase)
            acc = warpgroup_mma(p_op, v_ring.index(slot).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            # The slot is read by this warpgroup's two products: hand it back to the loader.
            mbarrier.arrive(kv_empty.index(slot), count=1)
            m_i = m_new
            step += 1
        return acc, m_i, l_i, step

    @gluon.jit
    def _release_rest(k_ready, kv_empty, step, lo, hi, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """Hands back, unread, the ring slots of the key blocks starting in [lo, hi) (ring steps
        from ``step``) that the program loads for its other warpgroups' rows. Each waits for its
        block to land first: only then has the slot's previous block been released by every
        warpgroup, so this arrival counts towards the right phase."""
        for n0 in range(lo, hi, BLOCK_N):
            slot = step % STAGES
            mbarrier.wait(k_ready.index(slot), (step // STAGES) & 1)
            mbarrier.arrive(kv_empty.index(slot), count=1)
            step += 1

    @gluon.jit
    def _attn_blocks_pipelined(q_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, acc, alpha, m_i, l_i, p_op, zero_s,
                               step, lo, hi, rows, sk, shift, qk_scale, left, right, MASKED: gl.constexpr,
                               CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                               STAGES: gl.constexpr, FOLD: gl.constexpr, EMU: gl.constexpr, WINDOW: gl.constexpr):
        """The pipelined variant's key blocks starting in [lo, hi), ring steps from ``step`` >= 1:
        block j's S and block j-1's PV product (``p_op``, rescale ``alpha`` pending) in flight
        together, block j's softmax after S. Returns ``(acc, alpha, m_i, l_i, p_op, step)`` with
        the last block's product (and its rescale) still to do."""
        o_layout: gl.constexpr = acc.type.layout
        p_layout: gl.constexpr = p_op.type.layout
        for n0 in range(lo, hi, BLOCK_N):
            slot = step % STAGES
            prev = (step - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (step // STAGES) & 1)
            k_tile = k_ring.index(slot).reshape([BLOCK_N, HEAD_DIM])
            s = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            mbarrier.wait(v_ready.index(prev), ((step - 1) // STAGES) & 1)
            acc = warpgroup_mma(p_op, v_ring.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            # Groups complete in order: one left in flight means S is done and PV may run on.
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            p, alpha, m_i, l_i = _softmax(s, n0, m_i, l_i, rows, sk, shift, qk_scale, left, right, MASKED, CAUSAL,
                                          BLOCK_N, FOLD, EMU, WINDOW)
            p_next = gl.convert_layout(p.to(k_ring.dtype), p_layout)
            # p_op is a dependency: its registers stay untouched until the product has read them.
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
            mbarrier.arrive(kv_empty.index(prev), count=1)
            p_op = p_next
            step += 1
        return acc, alpha, m_i, l_i, p_op, step

    @gluon.jit
    def _attn_pipelined(q_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, acc, m_i, l_i, zero_s, start, full_start,
                        full_end, end, rows, sk, shift, qk_scale, left, right, CAUSAL: gl.constexpr,
                        BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr,
                        EMU: gl.constexpr, WINDOW: gl.constexpr):
        """The pipelined variant over the key blocks starting in [start, end) (``end > start``;
        unmasked in [full_start, full_end), which without ``WINDOW`` starts at ``start`` = 0): the
        first block's S and softmax, the pipelined blocks, the last PV product. Returns
        ``(acc, m_i, l_i)``."""
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
        o_layout: gl.constexpr = acc.type.layout
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q_tile, k_ring.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        # Masked whatever its span: a no-op on a block every row attends whole, and what makes a
        # program whose rows attend no key come out with l = 0 (out 0, lse -inf).
        p, alpha, m_i, l_i = _softmax(s, start, m_i, l_i, rows, sk, shift, qk_scale, left, right, True, CAUSAL,
                                      BLOCK_N, FOLD, EMU, WINDOW)
        p_op = gl.convert_layout(p.to(k_ring.dtype), p_layout)
        # The ring step starts as a tensor (a literal would be a constexpr, not loop-carriable).
        step = full_end * 0 + 1
        second = start + BLOCK_N
        if WINDOW:
            acc, alpha, m_i, l_i, p_op, step = _attn_blocks_pipelined(
                q_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, acc, alpha, m_i, l_i, p_op, zero_s, step, second,
                full_start, rows, sk, shift, qk_scale, left, right, True, CAUSAL, BLOCK_N, HEAD_DIM, STAGES, FOLD,
                EMU, WINDOW)
            acc, alpha, m_i, l_i, p_op, step = _attn_blocks_pipelined(
                q_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, acc, alpha, m_i, l_i, p_op, zero_s, step,
                gl.maximum(full_start, second), full_end, rows, sk, shift, qk_scale, left, right, False, CAUSAL,
                BLOCK_N, HEAD_DIM, STAGES, FOLD, EMU, WINDOW)
        else:
            acc, alpha, m_i, l_i, p_op, step = _attn_blocks_pipelined(
                q_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, acc, alpha, m_i, l_i, p_op, zero_s, step, second,
                full_end, rows, sk, shift, qk_scale, left, right, False, CAUSAL, BLOCK_N, HEAD_DIM, STAGES, FOLD, EMU,
                WINDOW)
        acc, alpha, m_i, l_i, p_op, step = _attn_blocks_pipelined(
            q_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, acc, alpha, m_i, l_i, p_op, zero_s, step,
            gl.maximum(full_end, second), end, rows, sk, shift, qk_scale, left, right, True, CAUSAL, BLOCK_N,
            HEAD_DIM, STAGES, FOLD, EMU, WINDOW)
        last = (step - 1) % STAGES
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.wait(v_ready.index(last), ((step - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_ring.index(last).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
        mbarrier.arrive(kv_empty.index(last), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def store_rows(x, base, first, limit, stride, buf, desc, tb, col, VARLEN: gl.constexpr):
        """The epilogue's store of the ``[rows, D]`` tile ``x`` (registers, cast to the destination's
        dtype) as the rows ``first ..`` of the tensor behind ``desc``, starting at column ``col``:
        staged in ``buf`` (read by no pending wgmma) and stored by TMA, which clips at the tensor's
        end. ``VARLEN``: only rows below ``limit`` (the sequence's end) are written, since the next
        sequence's rows follow it; a tile that runs past it takes masked pointer stores from
        ``base`` (the tensor's data, ``stride`` elements per row), for the rest TMA as dense."""
        ROWS: gl.constexpr = x.shape[0]
        tile = buf.reshape([ROWS, x.shape[1]])
        if VARLEN:
            if first + ROWS <= limit:
                tile.store(x.to(desc.dtype))
                fence_async_shared()
                _cta_barrier()
                _tma_store(desc, [tb, first, col], buf)
            else:
                layout: gl.constexpr = x.type.layout
                rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
                cols = gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, layout))
                mask = (first + rows[:, None] < limit) & (cols[None, :] < x.shape[1])
                ptrs = base + first.to(gl.int64) * stride + col + (rows[:, None] * stride + cols[None, :])
                gl.store(ptrs, x.to(desc.dtype), mask=mask)
        else:
            tile.store(x.to(desc.dtype))
            # Every thread's generic-proxy writes must be visible to the async proxy before the copy.
            fence_async_shared()
            _cta_barrier()
            _tma_store(desc, [tb, first, col], buf)

    @gluon.jit
    def _attn_math(q_desc, k_desc, v_desc, o_desc, lse_ptr, cu_q_ptr, cu_k_ptr, o_ptr, stride_ot, q_smem, k_ring,
                   v_ring, q_ready, k_ready, v_ready, kv_empty, SEQ_Q, SEQ_K, HEADS_Q, GROUP, stride_lb, stride_lh,
                   qk_scale, LEFT, RIGHT, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PIPELINE: gl.constexpr, MATH_WGS: gl.constexpr,
                   FOLD: gl.constexpr, EMU: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr,
                   WG: gl.constexpr):
        """Math warpgroup ``WG``: query rows ``m0 + WG * 64`` to ``m0 + WG * 64 + 63``. With two
        warpgroups both walk the program's key span; with three (unpipelined) each walks its own
        rows' span and hands back the slots of the program's blocks past it unread, so causal
        warpgroups above the diagonal skip the blocks only their neighbours' rows attend. ``WINDOW``
        (two warpgroups): masked blocks at both edges of the program's span, unmasked between.
        ``VARLEN``: rows and keys of this program's sequence (``program_rows``), nothing at all for
        a block past its end."""
        gl.static_assert(MATH_WGS == 2 or not PIPELINE, "three math warpgroups run unpipelined")
        gl.static_assert(MATH_WGS == 2 or not WINDOW, "windows run on two math warpgroups")
        ROWS: gl.constexpr = BLOCK_M // MATH_WGS
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        b, h, hk, m0, q_start, sq, k_start, sk, live = program_rows(cu_q_ptr, cu_k_ptr, SEQ_Q, SEQ_K, HEADS_Q, GROUP,
                                                                    CAUSAL, BLOCK_M, VARLEN)
        if live:
            row0 = m0 + WG * ROWS
            start, full_start, full_end, end = program_key_span(m0, sq, sk, LEFT, RIGHT, CAUSAL, BLOCK_M, BLOCK_N,
                                                                PIPELINE, WINDOW)
            prog_end = end
            if MATH_WGS == 3:
                full_end, end = key_span(row0, sq, sk, CAUSAL, ROWS, BLOCK_N, PIPELINE)
                # Rows wholly past the sequence's end (the last program's) attend nothing.
                live_wg = (row0 < sq).to(gl.int32)
                full_end = full_end * live_wg
                end = end * live_wg
            shift = sk - sq
            rows = row0 + gl.arange(0, ROWS, layout=row_layout)

            zero_s = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=s_layout)
            acc = gl.zeros((ROWS, HEAD_DIM), dtype=gl.float32, layout=o_layout)
            m_i = gl.full((ROWS,), float("-inf"), dtype=gl.float32, layout=row_layout)
            l_i = gl.zeros((ROWS,), dtype=gl.float32, layout=row_layout)
            q_buf = q_smem.index(WG)
            mbarrier.wait(q_ready.index(WG), 0)
            q_tile = q_buf.reshape([ROWS, HEAD_DIM])
            if PIPELINE:
                acc, m_i, l_i = _attn_pipelined(q_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, acc, m_i, l_i,
                                                zero_s, start, full_start, full_end, end, rows, sk, shift, qk_scale,
                                                LEFT, RIGHT, CAUSAL, BLOCK_N, HEAD_DIM, STAGES, FOLD, EMU, WINDOW)
            else:
                # The ring step starts as a tensor (a literal 0 would be a constexpr, not loop-carriable).
                step = full_end * 0
                if WINDOW:
                    acc, m_i, l_i, step = _attn_blocks(q_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, acc, m_i,
                                                       l_i, zero_s, step, start, full_start, rows, sk, shift, qk_scale,
                                                       LEFT, RIGHT, True, CAUSAL, BLOCK_N, HEAD_DIM, STAGES, FOLD, EMU,
                                                       WINDOW)
                acc, m_i, l_i, step = _attn_blocks(q_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, acc, m_i, l_i,
                                                   zero_s, step, full_start, full_end, rows, sk, shift, qk_scale, LEFT,
                                                   RIGHT, False, CAUSAL, BLOCK_N, HEAD_DIM, STAGES, FOLD, EMU, WINDOW)
                acc, m_i, l_i, step = _attn_blocks(q_tile, k_ring, v_ring, k_ready, v_ready, kv_empty, acc, m_i, l_i,
                                                   zero_s, step, full_end, end, rows, sk, shift, qk_scale, LEFT, RIGHT,
                                                   True, CAUSAL, BLOCK_N, HEAD_DIM, STAGES, FOLD, EMU, WINDOW)

            attended = l_i > 0.0
            l_safe = gl.where(attended, l_i, 1.0)
            lse = gl.where(attended, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
            # Varlen: stride_lb is 0 and the sequence's rows start at token q_start.
            lse_base = lse_ptr + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + q_start
            gl.store(lse_base + rows, lse, mask=rows < sq)
            out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
            # This warpgroup's q buffer is read by no pending wgmma now: it stages the output. The
            # TMA store clips at the tensor's end, store_rows' masked stores at a varlen sequence's.
            store_rows(out, o_ptr, q_start + row0, q_start + sq, stride_ot, q_buf, o_desc, tma_batch(b, VARLEN),
                       h * HEAD_DIM, VARLEN)
            if MATH_WGS == 3:
                _release_rest(k_ready, kv_empty, step, step * BLOCK_N, prog_end, BLOCK_N, STAGES)
            tma.store_wait(0)

    @gluon.jit
    def attn_fwd_gluon_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, cu_q_ptr, cu_k_ptr, o_ptr, stride_ot, SEQ_Q,
                              SEQ_K, HEADS_Q, GROUP, stride_lb, stride_lh, qk_scale, LEFT, RIGHT,
                              CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, MATH_REGS: gl.constexpr,
                              LOAD_REGS: gl.constexpr, PIPELINE: gl.constexpr, MATH_WGS: gl.constexpr,
                              FOLD: gl.constexpr, EMU: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr):
        """Grid ``(cdiv(Sq, BLOCK_M), B * Hq)``; launched with 4 warps (the default partition)
        and ``maxnreg``. ``qk_scale`` is the softmax scale times log2(e); the descriptors are
        ``descriptor``'s, q and out with ``BLOCK_M / MATH_WGS`` rows per block, k and v
        ``BLOCK_N``; ``PIPELINE`` selects the pipelined variant, ``MATH_WGS`` (2 or 3, then
        unpipelined) the math warpgroups, ``FOLD`` (a positive ``qk_scale`` only) and ``EMU`` the
        softmax options of ``GluonAttnConfig``. ``WINDOW`` (two math warpgroups): row ``i`` attends
        key ``j`` iff ``i + Sk - Sq - LEFT <= j <= i + Sk - Sq + RIGHT`` (``window_bounds``), and
        only the key blocks some row of the program attends are loaded; without it ``LEFT`` and
        ``RIGHT`` are not read and ``CAUSAL`` sets the mask. ``VARLEN``: q, k, v and out are packed
        ``[T, H, D]`` tensors read as one batch (``descriptor``), sequence ``b`` spans tokens
        ``cu[b] .. cu[b + 1] - 1`` of the int32 ``cu_q_ptr`` / ``cu_k_ptr`` (``SEQ_Q`` the longest
        query count, which sizes the grid; ``SEQ_K`` unread), out is also written through ``o_ptr``
        (``stride_ot`` elements per token) and the lse is ``[Hq, Tq]`` (``stride_lb`` 0); dense
        calls pass stand-ins there, never read."""
        # Buffers of rank 3 like the descriptors' blocks ([1, rows, D]); the math reshapes them to 2-D.
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [MATH_WGS, 1, BLOCK_M // MATH_WGS, HEAD_DIM],
                                           q_desc.layout)
        k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_ready, k_ready, v_ready, kv_empty = consumer_ring_barriers(STAGES, MATH_WGS)
        # The argument tuples are spelled out at each use: assigned to a variable, their constexpr
        # entries would become tensors (triton 3.6). The math partitions differ only in WG; the
        # third one, listed last, runs only with three math warpgroups.
        gl.warp_specialize([
            (_attn_math, (q_desc, k_desc, v_desc, o_desc, lse_ptr, cu_q_ptr, cu_k_ptr, o_ptr, stride_ot, q_smem,
                          k_ring, v_ring, q_ready, k_ready, v_ready, kv_empty, SEQ_Q, SEQ_K, HEADS_Q, GROUP, stride_lb,
                          stride_lh, qk_scale, LEFT, RIGHT, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, PIPELINE,
                          MATH_WGS, FOLD, EMU, WINDOW, VARLEN, 0)),
            (_attn_math, (q_desc, k_desc, v_desc, o_desc, lse_ptr, cu_q_ptr, cu_k_ptr, o_ptr, stride_ot, q_smem,
                          k_ring, v_ring, q_ready, k_ready, v_ready, kv_empty, SEQ_Q, SEQ_K, HEADS_Q, GROUP, stride_lb,
                          stride_lh, qk_scale, LEFT, RIGHT, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, PIPELINE,
                          MATH_WGS, FOLD, EMU, WINDOW, VARLEN, 1)),
            (_attn_load, (q_desc, k_desc, v_desc, o_desc, lse_ptr, cu_q_ptr, cu_k_ptr, o_ptr, stride_ot, q_smem,
                          k_ring, v_ring, q_ready, k_ready, v_ready, kv_empty, SEQ_Q, SEQ_K, HEADS_Q, GROUP, stride_lb,
                          stride_lh, qk_scale, LEFT, RIGHT, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, PIPELINE,
                          MATH_WGS, FOLD, EMU, WINDOW, VARLEN)),
            (_attn_math, (q_desc, k_desc, v_desc, o_desc, lse_ptr, cu_q_ptr, cu_k_ptr, o_ptr, stride_ot, q_smem,
                          k_ring, v_ring, q_ready, k_ready, v_ready, kv_empty, SEQ_Q, SEQ_K, HEADS_Q, GROUP, stride_lb,
                          stride_lh, qk_scale, LEFT, RIGHT, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, PIPELINE,
                          MATH_WGS, FOLD, EMU, WINDOW, VARLEN, 2)),
        ][:MATH_WGS + 1], [4, 1, 4][:MATH_WGS], [MATH_REGS, LOAD_REGS, MATH_REGS][:MATH_WGS])


# -- the gate ------------------------------------------------------------------------------------------
_read_switch = env_text_reader(ATTN_GLUON_ENV)


def _switch_refusal() -> Optional[str]:
    raw = _read_switch()
    if parse_bool(raw, ATTN_GLUON_ENV) is False:
        return f"the Gluon attention forward is switched off ({ATTN_GLUON_ENV}={raw})"
    return None


_read_pipeline = env_text_reader(ATTN_GLUON_PIPELINE_ENV)


def pipeline_setting() -> Optional[bool]:
    """``PRIMUS_TURBO_ATTN_GLUON_PIPELINE`` read now: True or False where set, None where unset
    (each head dim's default, ``PIPELINED_HEAD_DIMS``). A malformed value is a ConfigError naming
    the variable."""
    return parse_bool(_read_pipeline(), ATTN_GLUON_PIPELINE_ENV)


#: Each variant switch by ``config_for``'s keyword: its variable, its tag in identities and its
#: setting when unset. Three warpgroups (d64) and the folded scale are on by default: on an H200
#: they ran the d64 causal forward 1.13x and the d128 forwards 1.02-1.06x faster; the emulated
#: exponentials ran slower and stay off (docs/performance.md).
VARIANT_SWITCHES = {"wg3": (ATTN_GLUON_WG3_ENV, "wg3", True), "fold_scale": (ATTN_GLUON_FOLD_SCALE_ENV, "fold", True),
                    "exp2_emu": (ATTN_GLUON_EXP2_EMU_ENV, "emu", False)}
_variant_readers = {key: env_text_reader(env) for key, (env, _, _) in VARIANT_SWITCHES.items()}


def variant_settings() -> dict[str, bool]:
    """The variant switches (``VARIANT_SWITCHES``) read now, by ``config_for``'s keyword: the value
    set, else the switch's default. A malformed value is a ConfigError naming the variable."""
    settings = {}
    for key, read in _variant_readers.items():
        env, _, default = VARIANT_SWITCHES[key]
        value = parse_bool(read(), env)
        settings[key] = default if value is None else value
    return settings


def variant_tag() -> str:
    """``+tag`` for each variant switch set away from its default (``"+emu"``, ``"+no-fold"``;
    ``""`` with the defaults): the settings that change the compiled kernel, for the adapter's
    identity."""
    settings = variant_settings()
    return "".join(("+" if settings[key] else "+no-") + tag
                   for key, (_, tag, default) in VARIANT_SWITCHES.items() if settings[key] != default)


def pipelined(head_dim: int) -> bool:
    """Whether a call of head dim ``head_dim`` runs the pipelined variant (switches read per
    call): never where the three-warpgroup variant serves it."""
    if variant_settings()["wg3"] and head_dim in WG3_TILES:
        return False
    setting = pipeline_setting()
    return head_dim in PIPELINED_HEAD_DIMS if setting is None else setting


def call_config(head_dim: int, causal: bool, window: bool = False, varlen: bool = False) -> GluonAttnConfig:
    """The variant a call of head dim ``head_dim`` runs, every switch read now; ``window``: the
    call has a sliding window (``has_window``), which runs on two math warpgroups, pipelined as
    ``PRIMUS_TURBO_ATTN_GLUON_PIPELINE`` or ``PIPELINED_HEAD_DIMS`` says; ``varlen``: packed
    sequences (the same variant, its ``VARLEN`` kernel)."""
    settings = variant_settings()
    if window:
        setting = pipeline_setting()
        pipeline = head_dim in PIPELINED_HEAD_DIMS if setting is None else setting
        return config_for(head_dim, causal, pipeline, window=True, varlen=varlen, **settings)
    return config_for(head_dim, causal, pipelined(head_dim), varlen=varlen, **settings)


_read_window = env_text_reader(ATTN_GLUON_WINDOW_ENV)


def window_setting() -> bool:
    """``PRIMUS_TURBO_ATTN_GLUON_WINDOW`` read now: True where unset or true (windowed calls run
    the Gluon kernels), False where set to a false value. A malformed value is a ConfigError
    naming the variable."""
    return parse_bool(_read_window(), ATTN_GLUON_WINDOW_ENV) is not False


def window_tag() -> str:
    """``"-window"`` while ``PRIMUS_TURBO_ATTN_GLUON_WINDOW`` switches the Gluon windows off, else
    ``""``: the adapter's identity, so that timings of windowed calls on one kernel never stand
    for the other's."""
    return "" if window_setting() else "-window"


def has_window(p) -> bool:
    """Whether problem ``p`` needs the ``WINDOW`` kernels: a left window, or a right one other than
    the causal diagonal (``AttentionProblem``'s window is normalised)."""
    return p.window_left >= 0 or p.window_right > 0


def machine_refusal() -> Optional[str]:
    """Why this process cannot run the kernel at all, or None: this kernel's switch
    (``PRIMUS_TURBO_ATTN_GLUON``), then the machine gate every Gluon kernel of the package shares
    (``fp8_blockwise_gluon.available``: ``PRIMUS_TURBO_GLUON_KERNELS``, no Gluon, a Triton release
    outside ``GLUON_TRITON_RELEASES``, the interpreter, no NVIDIA GPU, not sm_90)."""
    return _switch_refusal() or available()


def problem_refusal(p) -> Optional[str]:
    """Why the kernel does not serve the attention problem ``p`` (an ``AttentionProblem``), or None."""
    if p.fp8:
        return "fp8 calls run on the plain-Triton forward"
    if p.sink:
        return "calls with attention sinks run on the plain-Triton forward"
    if p.dropout_p > 0:
        return "dropout is not implemented"
    if has_window(p) and not window_setting():
        return (f"window ({p.window_left}, {p.window_right}): {ATTN_GLUON_WINDOW_ENV} switches the Gluon "
                "windowed kernels off")
    if p.dtype not in _HALF:
        return f"dtype {p.dtype}: bf16/fp16 only"
    if p.head_dim_qk != p.head_dim_v or p.head_dim_qk not in TILES:
        return f"head dims q/k {p.head_dim_qk}, v {p.head_dim_v}: both must be one of {sorted(TILES)}"
    if p.seqlen_q < 1 or p.seqlen_k < 1 or p.batch < 1 or p.total_q < 1 or p.total_k < 1:
        return "empty batch or sequence"
    if p.batch * p.heads_q > 65535:
        return f"batch x query heads = {p.batch * p.heads_q}: the grid's second dimension holds 65535"
    return None


def tensor_refusal(**tensors: torch.Tensor) -> Optional[str]:
    """Why the named dense ``[B, S, H, D]`` (or packed varlen ``[T, H, D]``, read as one batch:
    ``as_batch``) tensors cannot be read by this kernel's TMA descriptors (``descriptor``), or
    None: each token's heads packed (``stride(2) == D``, ``stride(3) == 1``), the base and the
    batch and token strides 16-byte aligned, and CUDA tensors (asked last, so the layout rules are
    checkable on any device)."""
    tensors = {name: as_batch(t) for name, t in tensors.items()}
    for name, t in tensors.items():
        if t.dim() != 4 or t.stride(3) != 1 or t.stride(2) != t.shape[3]:
            return f"{name} strides {tuple(t.stride())}: each token's heads must be packed and contiguous"
        es = t.element_size()
        if t.data_ptr() % 16 or (t.stride(0) * es) % 16 or (t.stride(1) * es) % 16:
            return f"{name}: base and batch/token strides must be 16-byte aligned for TMA"
    for name, t in tensors.items():
        if t.device.type != "cuda":
            return f"{name} is on {t.device}"
    return None


def gluon_forward_refusal(p, q: Optional[torch.Tensor] = None, k: Optional[torch.Tensor] = None,
                          v: Optional[torch.Tensor] = None) -> Optional[str]:
    """None when the Gluon forward serves problem ``p`` (with these q, k, v where given), else why
    not: the machine's reason first (``machine_refusal``), then the problem's, then the tensors'."""
    why = machine_refusal() or problem_refusal(p)
    if why or q is None:
        return why
    return tensor_refusal(q=q, k=k, v=v)


# -- launch --------------------------------------------------------------------------------------------
def as_batch(x: torch.Tensor) -> torch.Tensor:
    """A packed varlen ``[T, H, D]`` tensor as the one-batch ``[1, T, H, D]`` the descriptors read
    (the kernels address sequence ``b``'s tokens from ``cu_seqlens[b]``); 4-D tensors as they are."""
    return x.unsqueeze(0) if x.dim() == 3 else x


def descriptor(x: torch.Tensor, rows: int):
    """A rank-3 TMA descriptor over the dense ``[B, S, H, D]`` tensor ``x`` read as
    ``[B, S, H * D]`` (heads packed, ``tensor_refusal``), with blocks of ``rows`` tokens of one head
    (``[1, rows, D]``). TMA clips the block at ``S`` per batch. A packed varlen ``[T, H, D]``
    tensor is read as ``[1, T, H * D]`` (``as_batch``): TMA clips at ``T`` only, so a block that
    runs past a sequence's end reads the next sequence's tokens, which the kernels mask."""
    x = as_batch(x)
    b, s, h, d = x.shape
    block = (1, rows, d)
    bind_cuda_context(x)
    return GluonDescriptor(x, [b, s, h * d], [x.stride(0), x.stride(1), 1], list(block),
                           shared_layout(block, _HALF[x.dtype]))


def launch_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                softmax_scale: float, cfg: GluonAttnConfig, window: tuple[int, int] = (-1, -1),
                cu_seqlens: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                max_seqlens: Optional[tuple[int, int]] = None) -> tuple[tuple, tuple, dict]:
    """``(grid, args, kwargs)`` of one launch of variant ``cfg`` (``config_for``; its head dim and
    mask those of the call) writing ``out`` and ``lse``; tools/compile_sm90.py compiles with them.
    ``fold_scale`` applies to a positive ``softmax_scale`` only (the row maximum of the raw scores
    is the scaled one's only then). ``window``: the call's ``(window_left, window_right)``, read
    where ``cfg.window`` (a causal call's right side is 0). ``cu_seqlens``: a varlen launch's
    ``(cu_seqlens_q, cu_seqlens_k)`` (int32 ``[B + 1]`` on the device, never read here) over packed
    ``[T, H, D]`` q, k, v, out and an lse ``[Hq, Tq]``, with ``max_seqlens`` the caller's
    ``(max_seqlen_q, max_seqlen_k)`` (the grid covers the longest query sequence)."""
    varlen = cu_seqlens is not None
    if varlen != cfg.varlen:
        raise ValueError(f"attention_gluon.launch_args: cfg.varlen={cfg.varlen} but cu_seqlens "
                         f"{'given' if varlen else 'not given'}")
    if varlen:
        b, (sq, sk) = cu_seqlens[0].numel() - 1, max_seqlens
        hq, d, hk = q.shape[1], q.shape[2], k.shape[1]
        cu_q, cu_k = cu_seqlens
        lse_strides, out_stride = (0, lse.stride(0)), out.stride(0)
    else:
        b, sq, hq, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        cu_q = cu_k = lse  # stand-ins: read under VARLEN only
        lse_strides, out_stride = (lse.stride(0), lse.stride(1)), 0
    rows = cfg.block_m // cfg.math_wgs
    math_regs, load_regs, maxnreg = cfg.regs()
    args = (descriptor(q, rows), descriptor(k, cfg.block_n), descriptor(v, cfg.block_n), descriptor(out, rows), lse,
            cu_q, cu_k, out, out_stride, sq, sk, hq, hq // hk, *lse_strides, softmax_scale * _LOG2E,
            *window_bounds(*window))
    kwargs = dict(CAUSAL=cfg.causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=d, STAGES=cfg.stages,
                  MATH_REGS=math_regs, LOAD_REGS=load_regs, PIPELINE=cfg.pipeline, MATH_WGS=cfg.math_wgs,
                  FOLD=cfg.fold_scale and softmax_scale > 0, EMU=cfg.exp2_emu, WINDOW=cfg.window, VARLEN=varlen,
                  num_warps=4, maxnreg=maxnreg)
    return (-(-sq // cfg.block_m), b * hq), args, kwargs


def attend(p, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor] = None,
           cu_seqlens_k: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out shaped like q in the inputs' dtype, float32 natural-log lse ``[B, Hq, Sq]``, varlen
    ``[Hq, Tq]``) of a call ``gluon_forward_refusal(p, q, k, v)`` accepted; the same contract as
    ``attention.attend``'s forward, varlen included (rows of empty or fully masked sequences: out
    0, lse -inf; tokens past ``cu_seqlens_q[-1]``: out 0, lse -inf). The variant is
    ``call_config``'s (the ``WINDOW`` kernel for a call with a sliding window). Varlen calls
    (``p.varlen``) pass both cu_seqlens, which only the device reads."""
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    window = has_window(p)
    cfg = call_config(p.head_dim_qk, p.causal, window, p.varlen)
    if p.varlen:
        # The kernel writes every token of every sequence; only the lse (Hq x Tq floats) is
        # filled first, out's tokens past the last sequence by a kernel that reads cu_seqlens.
        lse = torch.full((p.heads_q, p.total_q), float("-inf"), device=q.device, dtype=torch.float32)
        grid, args, kwargs = launch_args(q, k, v, out, lse, p.softmax_scale, cfg, (p.window_left, p.window_right),
                                         (cu_seqlens_q, cu_seqlens_k), (p.seqlen_q, p.seqlen_k))
        attn_fwd_gluon_kernel[grid](*args, **kwargs)
        zero_tokens_past(out, cu_seqlens_q)
        return out, lse
    lse = torch.empty((p.batch, p.heads_q, p.seqlen_q), device=q.device, dtype=torch.float32)
    grid, args, kwargs = launch_args(q, k, v, out, lse, p.softmax_scale, cfg, (p.window_left, p.window_right))
    attn_fwd_gluon_kernel[grid](*args, **kwargs)
    return out, lse



def zero_tokens_past(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Zeros the tokens of the packed, contiguous ``[T, ...]`` tensor ``x`` past ``cu_seqlens[-1]``
    (read on the device, CUDA-graph safe), which the varlen kernels leave unwritten: the padded
    tail of the grouped GEMMs (``grouped_launch.zero_padded_tail``) over ``x`` as ``[T, rest]``;
    returns ``x``."""
    zero_padded_tail(x.flatten(1), cu_seqlens)
    return x


__all__ = ["ATTN_GLUON_ENV", "ATTN_GLUON_EXP2_EMU_ENV", "ATTN_GLUON_FOLD_SCALE_ENV", "ATTN_GLUON_PIPELINE_ENV",
           "ATTN_GLUON_WG3_ENV", "ATTN_GLUON_WINDOW_ENV", "KERNEL_REVISION", "PIPELINED_HEAD_DIMS", "UNBOUNDED",
           "VARIANT_SWITCHES", "GluonAttnConfig", "as_batch", "attend", "block_span_host", "call_config", "config_for",
           "gluon_forward_refusal", "has_window", "launch_args", "machine_refusal", "pipeline_setting", "pipelined",
           "problem_refusal", "tensor_refusal", "variant_settings", "variant_tag", "window_bounds",
           "window_key_span_host", "window_setting", "window_tag", "zero_tokens_past"]
