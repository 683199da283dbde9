"""Triton kernels of the SYMM_MEM MoE backend: the routing plan, rows pushed into peers' symmetric
buffers, rows copied out of this rank's buffer, and landed rows summed per token.

Every kernel addresses the symmetric arena through ``local`` (this rank's arena viewed in the
kernel's element type) plus, for a peer, that peer's distance from ``local`` in elements
(``peer_delta[r]``). Expressing peers as ``local + delta`` rather than as raw addresses lets the
compiler keep the 16-element alignment it proves for ``local`` and the padded strides, so row
copies use wide vector loads and stores over NVLink; the host guarantees every delta, region offset
and stride is a multiple of ``ALIGN`` elements.

Which half of the arena a phase uses is read from the device counter ``phase`` (parity), not
passed from the host, so a captured CUDA graph alternates halves on replay exactly as eager
calls do.

The plan kernels replace a few dozen small tensor ops per call: at the token counts of a decode
step or a small expert, the host's issue time for those ops, not the bytes, bounds the call.

Importing this module needs triton.
"""
from __future__ import annotations

import triton
import triton.language as tl


#: ``msg`` stores min and max expert id as ``ID_BIAS - min`` and ``ID_BIAS + max`` (ids clamped to
#: +-ID_CLAMP first), so that atomic maxima over a zeroed buffer give both, and 0 means "no tokens".
ID_BIAS = 1 << 41
ID_CLAMP = 1 << 40
_ID_BIAS = tl.constexpr(ID_BIAS)  # a jitted function reads only constexpr globals
_ID_CLAMP = tl.constexpr(ID_CLAMP)


@triton.jit
def _sent_to(idx, num_tokens, num_experts, local_experts, block, TOPK: tl.constexpr, TOPK_P: tl.constexpr,
             WORLD_P: tl.constexpr, BLOCK_T: tl.constexpr):
    """Tokens of one block: their ids [BLOCK_T, TOPK_P] (-1 outside), which of them are real
    experts, and sent[t, r] = 1 where token t has an expert on rank r."""
    rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.arange(0, TOPK_P)
    cell = (rows < num_tokens)[:, None] & (slots < TOPK)[None, :]
    ids = tl.load(idx + rows[:, None] * TOPK + slots[None, :], mask=cell, other=-1)
    valid = cell & (ids >= 0) & (ids < num_experts)
    dest_of = tl.where(valid, ids // local_experts, -1)
    ranks = tl.arange(0, WORLD_P)
    sent = tl.max((dest_of[:, :, None] == ranks[None, None, :]).to(tl.int64), axis=1)
    return rows, ids, cell, valid, sent


@triton.jit
def route_count_kernel(idx, num_tokens, num_experts, local_experts, block_counts, msg, TOPK: tl.constexpr,
                       TOPK_P: tl.constexpr, WORLD: tl.constexpr, WORLD_P: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program b, tokens [b * BLOCK_T, (b + 1) * BLOCK_T): ``block_counts[b, r]`` = its tokens bound
    for rank r; adds into ``msg`` (zeroed by the caller) ``[rows per rank (W) | rows per global
    expert (E) | ID_BIAS - min id | ID_BIAS + max id]``."""
    b = tl.program_id(0)
    rows, ids, cell, valid, sent = _sent_to(idx, num_tokens, num_experts, local_experts, b, TOPK, TOPK_P, WORLD_P,
                                            BLOCK_T)
    ranks = tl.arange(0, WORLD_P)
    per_rank = tl.sum(sent, axis=0)
    tl.store(block_counts + b * WORLD + ranks, per_rank, mask=ranks < WORLD)
    tl.atomic_add(msg + ranks, per_rank, mask=ranks < WORLD)
    tl.atomic_add(msg + WORLD + ids, tl.full([BLOCK_T, TOPK_P], 1, tl.int64), mask=valid)
    clamped = tl.minimum(tl.maximum(ids, -_ID_CLAMP), _ID_CLAMP)
    low = tl.max(tl.max(tl.where(cell, _ID_BIAS - clamped, 0), axis=1), axis=0)
    high = tl.max(tl.max(tl.where(cell, _ID_BIAS + clamped, 0), axis=1), axis=0)
    tl.atomic_max(msg + WORLD + num_experts, low)
    tl.atomic_max(msg + WORLD + num_experts + 1, high)


@triton.jit
def place_kernel(table, table_stride, idx, probs, block_counts, num_tokens, num_experts, me, worst, local_experts,
                 dst_row, slot, local, peer_delta, phase, half_words, meta_stride, HAS_PROBS: tl.constexpr,
                 TOPK: tl.constexpr, TOPK_P: tl.constexpr, WORLD: tl.constexpr, WORLD_P: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """Program b, tokens [b * BLOCK_T, (b + 1) * BLOCK_T) (``route_count_kernel``'s blocks, whose
    ``block_counts`` give the tokens of earlier blocks), per (token, rank) pair, from the
    all-gathered count table (``table[s, r]``, r < W: rows s sends r):

    * ``dst_row``: the receive row on r (rows of ranks before this one, then this rank's tokens
      for r in token order), -1 if not sent or past ``worst``;
    * ``slot``: where r's row comes back to (after this rank's rows for ranks < r, or r * worst
      under a worst case), -1 if nothing comes back;
    * the row's metadata, stored straight into row ``dst_row`` of rank r's metadata region (the
      current half of its arena, ``local`` viewed as int64, rows ``meta_stride`` apart): local
      expert ids, then probabilities as fp32 bits, one int64 each; id -1 / probability 0 where
      the expert is not on r."""
    b = tl.program_id(0)
    rows, ids, cell, valid, sent = _sent_to(idx, num_tokens, num_experts, local_experts, b, TOPK, TOPK_P, WORLD_P,
                                            BLOCK_T)
    ranks = tl.arange(0, WORLD_P)
    real = ranks < WORLD
    before = tl.zeros([WORLD_P], dtype=tl.int64)
    for prior in range(0, b):
        before += tl.load(block_counts + prior * WORLD + ranks, mask=real, other=0)
    pos = tl.where(sent > 0, tl.cumsum(sent, axis=0) - 1 + before[None, :], -1)  # rank among my tokens for r
    counts = tl.load(table + ranks[:, None] * table_stride + ranks[None, :], mask=real[:, None] & real[None, :],
                     other=0)  # [s, r]
    base = tl.sum(tl.where((ranks < me)[:, None], counts, 0), axis=0)  # rows of ranks before me, per r
    mine = tl.load(table + me * table_stride + ranks, mask=real, other=0)
    send_base = tl.cumsum(mine, axis=0) - mine
    in_rows = rows < num_tokens
    pair = in_rows[:, None] & real[None, :]
    dst = base[None, :] + pos
    if worst > 0:
        kept = (pos >= 0) & (dst < worst)
        back = ranks[None, :] * worst + pos
    else:
        kept = pos >= 0
        back = send_base[None, :] + pos
    p = rows[:, None] * WORLD + ranks[None, :]
    tl.store(dst_row + p, tl.where(kept, dst, -1), mask=pair)
    tl.store(slot + p, tl.where(kept, back, -1), mask=pair)
    slots = tl.arange(0, TOPK_P)
    if HAS_PROBS:
        w = tl.load(probs + rows[:, None] * TOPK + slots[None, :], mask=cell, other=0).to(tl.float32)
    else:
        w = tl.zeros([BLOCK_T, TOPK_P], dtype=tl.float32)
    bits = w.to(tl.int32, bitcast=True).to(tl.int64)
    lid = ids[:, None, :] - (ranks * local_experts)[None, :, None]  # [BLOCK_T, WORLD_P, TOPK_P]
    here = (lid >= 0) & (lid < local_experts)
    delta = tl.load(peer_delta + ranks, mask=real, other=0)
    half = tl.load(phase) % 2
    row_at = delta[None, :] + half * half_words + tl.where(kept, dst, 0) * meta_stride  # [BLOCK_T, WORLD_P]
    out = local + row_at[:, :, None] + slots[None, None, :]
    m3 = (pair & kept)[:, :, None] & (slots < TOPK)[None, None, :]
    tl.store(out, tl.where(here, lid, -1), mask=m3)
    tl.store(out + TOPK, tl.where(here, bits[:, None, :], 0), mask=m3)


@triton.jit
def receive_plan_kernel(table, table_stride, me, worst, recv_rows, back_rank, back_dst, num_recv, n_valid,
                        WORLD: tl.constexpr, WORLD_P: tl.constexpr, BLOCK_R: tl.constexpr):
    """Per received row i: its source rank (``back_rank``) and its landing slot there
    (``back_dst``, -1 for padding rows); program 0 also writes ``num_recv`` (rows the senders had
    for this rank) and ``n_valid`` (rows kept: ``min(num_recv, worst)`` under a worst case)."""
    ranks = tl.arange(0, WORLD_P)
    real = ranks < WORLD
    counts = tl.load(table + ranks[:, None] * table_stride + ranks[None, :], mask=real[:, None] & real[None, :],
                     other=0)  # [s, r]
    from_src = tl.sum(tl.where((ranks == me)[None, :], counts, 0), axis=1)  # [s]: rows s sent me
    ends = tl.cumsum(from_src, axis=0)
    before_me = tl.sum(tl.where((ranks < me)[None, :], counts, 0), axis=1)  # [s]: rows s sent to ranks < me
    total = tl.sum(from_src, axis=0)
    valid = tl.where(worst > 0, tl.minimum(total, worst), total)
    if tl.program_id(0) == 0:
        tl.store(num_recv, total)
        tl.store(n_valid, valid)
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    src = tl.minimum(tl.sum(((ends[None, :] <= i[:, None]) & real[None, :]).to(tl.int64), axis=1), WORLD - 1)
    is_src = ranks[None, :] == src[:, None]
    j = i - tl.sum(tl.where(is_src, (ends - from_src)[None, :], 0), axis=1)
    if worst > 0:
        land = me * worst + j
    else:
        land = tl.sum(tl.where(is_src, before_me[None, :], 0), axis=1) + j
    rows = i < recv_rows
    tl.store(back_rank + i, src, mask=rows)
    tl.store(back_dst + i, tl.where(i < valid, land, -1), mask=rows)


@triton.jit
def push_rows_kernel(src, src_stride, row_words, src_div, pair_rank, pair_dst, local, peer_delta, phase, half_words,
                     dst_offset, dst_stride, WORLD: tl.constexpr, RANKS_GIVEN: tl.constexpr, BLOCK: tl.constexpr,
                     ALIGN: tl.constexpr):
    """Pair ``p``: row ``p // src_div`` of ``src`` -> row ``pair_dst[p]`` of region ``dst_offset``
    in the current half of rank ``pair_rank[p]``'s arena (``p % WORLD`` unless ``RANKS_GIVEN``);
    ``pair_dst[p] < 0`` skips the pair."""
    p = tl.program_id(0)
    dst_row = tl.load(pair_dst + p)
    if dst_row >= 0:
        if RANKS_GIVEN:
            rank = tl.load(pair_rank + p)
        else:
            rank = p % WORLD
        delta = (tl.load(peer_delta + rank) // ALIGN) * ALIGN
        half = tl.load(phase) % 2
        dst_base = local + delta + half * half_words + dst_offset + dst_row * dst_stride
        src_base = src + (p // src_div) * src_stride
        for start in range(0, row_words, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < row_words
            tl.store(dst_base + cols, tl.load(src_base + cols, mask=mask), mask=mask)


@triton.jit
def _copy_row(src_base, dst_base, row_words, readable, BLOCK: tl.constexpr):
    """``row_words`` words from ``src_base`` to ``dst_base``; words at or past ``readable`` are
    written as zeros (0: a padding row, which reads nothing)."""
    for start in range(0, row_words, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(src_base + cols, mask=cols < readable, other=0)
        tl.store(dst_base + cols, v, mask=cols < row_words)


@triton.jit
def copy_out_kernel(local, phase, half_words, src_offset, src_stride, out, out_stride, row_words, n_valid,
                    BLOCK: tl.constexpr):
    """Row ``i`` of region ``src_offset`` in the current half of this rank's arena -> row ``i`` of
    ``out``; rows at or past ``n_valid[0]`` are written as zeros."""
    i = tl.program_id(0)
    readable = tl.where(i < tl.load(n_valid), row_words, 0)
    half = tl.load(phase) % 2
    _copy_row(local + half * half_words + src_offset + i * src_stride, out + i * out_stride, row_words, readable,
              BLOCK)


@triton.jit
def receive_kernel(local, local_meta, phase, half_words, half_meta, x_offset, x_stride, meta_stride, n_valid,
                   out, out_stride, row_words, recv_idx, recv_probs, counts, local_experts, HAS_PROBS: tl.constexpr,
                   COUNT: tl.constexpr, TOPK: tl.constexpr, TOPK_P: tl.constexpr, BLOCK: tl.constexpr):
    """Received row ``i`` out of the current half of this rank's arena: its payload (region
    ``x_offset`` of ``local``, rows ``x_stride`` apart) into row i of ``out``, its metadata (row i of
    ``local_meta``, the arena as int64) into ``recv_idx`` (int64 local expert ids) and, with
    ``HAS_PROBS``, ``recv_probs`` (fp32 bits, converted to its type). Rows at or past
    ``n_valid[0]`` are padding: payload zeros, ids -1, probabilities 0. With ``COUNT`` every local
    id of a real row adds one to ``counts[id]`` (zeroed by the caller)."""
    i = tl.program_id(0)
    half = tl.load(phase) % 2
    readable = tl.where(i < tl.load(n_valid), row_words, 0)
    _copy_row(local + half * half_words + x_offset + i * x_stride, out + i * out_stride, row_words, readable, BLOCK)
    slots = tl.arange(0, TOPK_P)
    cell = slots < TOPK
    kept = cell & (slots * 0 + i < tl.load(n_valid))  # a [TOPK_P] mask: a scalar one breaks the interpreter
    meta = local_meta + half * half_meta + i * meta_stride
    ids = tl.load(meta + slots, mask=kept, other=-1)
    tl.store(recv_idx + i * TOPK + slots, ids, mask=cell)
    if HAS_PROBS:
        bits = tl.load(meta + TOPK + slots, mask=kept, other=0)
        w = bits.to(tl.int32).to(tl.float32, bitcast=True)
        tl.store(recv_probs + i * TOPK + slots, w.to(recv_probs.dtype.element_ty), mask=cell)
    if COUNT:
        named = cell & (ids >= 0) & (ids < local_experts)
        tl.atomic_add(counts + tl.where(named, ids, 0), tl.full([TOPK_P], 1, tl.int64), mask=named)


@triton.jit
def sum_landed_kernel(local, phase, half_words, land_offset, land_stride, slot, out, out_stride, hidden,
                      WORLD: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """``out[t] = sum over r = 0..WORLD-1 (in that order) of landed row slot[t, r]`` (slots < 0
    add nothing), accumulated in ``ACC`` and rounded once to ``out``'s type."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    base = local + (tl.load(phase) % 2) * half_words + land_offset
    acc = tl.zeros([BLOCK], dtype=ACC)
    for r in tl.static_range(WORLD):
        row = tl.load(slot + t * WORLD + r)
        width = tl.where(row >= 0, hidden, 0)  # nothing came back for this pair: add nothing
        v = tl.load(base + row * land_stride + cols, mask=cols < width, other=0)
        acc += v.to(ACC)
    tl.store(out + t * out_stride + cols, acc.to(out.dtype.element_ty), mask=mask)
