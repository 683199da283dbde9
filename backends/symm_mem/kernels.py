"""Triton kernels of the SYMM_MEM MoE backend: rows pushed into peers' symmetric buffers, rows
copied out of this rank's buffer, and landed rows summed per token.

Every kernel addresses the symmetric arena through ``local`` (this rank's arena viewed in the
kernel's element type) plus, for a peer, that peer's distance from ``local`` in elements
(``peer_delta[r]``). Expressing peers as ``local + delta`` rather than as raw addresses lets the
compiler keep the 16-element alignment it proves for ``local`` and the padded strides, so row
copies use wide vector loads and stores over NVLink; the host guarantees every delta, region offset
and stride is a multiple of ``ALIGN`` elements.

Which half of the arena a phase uses is read from the device counter ``phase`` (parity), not
passed from the host, so a captured CUDA graph alternates halves on replay exactly as eager
calls do.

Importing this module needs triton.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def push_rows_kernel(src, src_stride, row_words, pair_src, pair_rank, pair_dst, local, peer_delta, phase,
                     half_words, dst_offset, dst_stride, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """Pair ``p``: row ``pair_src[p]`` of ``src`` -> row ``pair_dst[p]`` of region ``dst_offset``
    in the current half of rank ``pair_rank[p]``'s arena; ``pair_dst[p] < 0`` skips the pair."""
    p = tl.program_id(0)
    dst_row = tl.load(pair_dst + p)
    if dst_row >= 0:
        src_row = tl.load(pair_src + p)
        rank = tl.load(pair_rank + p)
        delta = (tl.load(peer_delta + rank) // ALIGN) * ALIGN
        half = tl.load(phase) % 2
        dst_base = local + delta + half * half_words + dst_offset + dst_row * dst_stride
        src_base = src + src_row * src_stride
        for start in range(0, row_words, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < row_words
            tl.store(dst_base + cols, tl.load(src_base + cols, mask=mask), mask=mask)


@triton.jit
def copy_out_kernel(local, phase, half_words, src_offset, src_stride, out, out_stride, row_words, n_valid,
                    BLOCK: tl.constexpr):
    """Row ``i`` of region ``src_offset`` in the current half of this rank's arena -> row ``i`` of
    ``out``; rows at or past ``n_valid[0]`` are written as zeros."""
    i = tl.program_id(0)
    readable = tl.where(i < tl.load(n_valid), row_words, 0)  # a padding row reads nothing
    half = tl.load(phase) % 2
    src_base = local + half * half_words + src_offset + i * src_stride
    for start in range(0, row_words, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < row_words
        v = tl.load(src_base + cols, mask=cols < readable, other=0)
        tl.store(out + i * out_stride + cols, v, mask=mask)


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
