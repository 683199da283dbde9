"""Triton kernels for grouped GEMMs (bf16/fp16 and fp8), with the group boundaries read on the device.

Two kernels, one per grouped-GEMM shape (see turbo_dispatch/ops/grouped_gemm.py):

* ``grouped_fixed_k_kernel`` (forward and dgrad): ``out[s_g:e_g] = a[s_g:e_g] @ op(b[g])``. A
  *persistent* kernel: ``NUM_PROGS`` programs (one per SM) walk the global list of (group, tile)
  work items. No host ever sees the group sizes: every program reads ``offs[g]``/``offs[g+1]``
  itself, derives that group's tile count, and takes the tiles whose global index is
  ``pid (mod NUM_PROGS)``. So the launch grid depends only on the SM count (CUDA-graph capturable
  with any routing) and an empty group simply has no tiles. Rows past the last group (a padded
  buffer, ``M > offs[G]``) are one more run of tiles at the end of the list, stored as zeros: every
  row of the output is written, and an unpadded call finds that run empty.
* ``grouped_variable_k_kernel`` (wgrad): ``out[g] = x_g^T @ y_g``, the reduction running over
  each group's tokens. The tile count (G x m-tiles x n-tiles) is static, so it is a plain grid of
  one program per output tile; each program loops over its group's tokens (bounds read on the
  device). An empty group runs zero iterations and stores its zero accumulator: its slice of the
  output gets exact zeros, never uninitialised memory.

Scaling (``SCALE``): 0 none (bf16/fp16), 1 tensorwise, 2 rowwise, 3 blockwise. Tensor- and rowwise
scales are constant along the reduction, so they are applied once in the epilogue. Blockwise
scales change every ``QBLOCK`` elements of the reduction, so each ``BK`` step (``BK`` divides
``QBLOCK``, so a step never straddles two scale blocks) is its own fp8 MMA whose fp32 result is
multiplied by ``sa[row, kb] * sb[col, kb]`` before it is added to the accumulator (the "per-K-block
fp32 promotion"). The b scale is looked up at ``col // SB_NDIV``: ``SB_NDIV = block`` for the
weight's 2-D tiles (one scale per 128 x 128 tile), ``1`` for 1-D runs (one per column).

In the wgrad kernel, blockwise token runs are aligned to the *global* token index (run ``j`` holds
tokens ``[j*QBLOCK, (j+1)*QBLOCK)``), exactly as TORCH's ``quantize(x, axis=0)`` defines them; a run
may straddle two groups and its one scale serves both. Each group's loop therefore walks the
global ``BK`` grid from the step holding its first token, so every ``BK`` step lies in one run.
The steps entirely inside ``[s_g, e_g)`` (the interior) load without any token mask; only the
partial first and last steps ("edges", at most two per group, one for a group inside a single
``BK`` cell) zero the tokens outside the group, so no group sums another group's tokens. A token
mask on the contiguous dimension of a token-contiguous operand would keep every interior load
from vectorising (fp8: byte-wise loads), which is why the edges are peeled off the loop.

``UPCAST`` converts the operands before ``tl.dot``: 1 to float32, because the CPU interpreter
computes bf16 dots wrongly (interpreter runs always set it); 2 to float16, exact for every e4m3 and
e5m2 value, for GPUs/Triton versions whose fp8 MMA refuses mixed e4m3 x e5m2 operands (HYBRID).

``USE_TMA`` loads the operands through host-built tensor descriptors (TMA on Hopper). In the
variable-K kernel each operand's descriptor spans the whole operand, ``[cols, T]`` when it is
token-contiguous (the fp8 quantiser's layout: K-major, what the fp8 MMA needs) or ``[T, cols]``
when token-major (bf16/fp16 as the op passes them; the MMA reads the transposed tile); edge steps
load the full box and zero the out-of-group tokens in registers. In the fixed-K kernel it loads
``a`` and ``b``. Rows of a tile past its group's end are read from the next group (or zero-filled past
M_total) and never stored, so the descriptor of ``a`` spans all of a; ``b`` is viewed 2-D as
``[G*N, K]`` (K-major) or ``[G*K, N]`` (only when ``BK`` divides K, so a K step never reads the
next group's weights).
"""
from __future__ import annotations

import triton
import triton.language as tl

#: Values of the ``SCALE`` constexpr.
SCALE_NONE, SCALE_TENSOR, SCALE_ROW, SCALE_BLOCK = 0, 1, 2, 3

#: Bumped whenever a kernel's code changes; part of the adapters' identity().
KERNEL_REVISION = "gg-r5"


@triton.jit
def _tile_coords(local, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile ``local`` of a num_m x num_n grid, GROUP_M row-tiles at a time
    (neighbouring programs share b's column tiles and a's row tiles in L2)."""
    width = GROUP_M * num_n
    first_m = (local // width) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (local % width) % rows
    pid_n = (local % width) // rows
    return pid_m, pid_n


@triton.jit
def _dot_operands(a, b, UPCAST: tl.constexpr):
    """The tiles as ``tl.dot`` should see them (UPCAST, see the module docstring)."""
    if UPCAST == 1:
        return a.to(tl.float32), b.to(tl.float32)
    elif UPCAST == 2:
        return a.to(tl.float16), b.to(tl.float16)
    else:
        return a, b


@triton.jit
def grouped_fixed_k_kernel(
    a_ptr, b_ptr, c_ptr, offs_ptr, sa_ptr, sb_ptr, a_desc, b_desc,
    G, M, N, K, NUM_PROGS,
    stride_am, stride_ak, stride_bg, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbg, stride_sbn, stride_sbk,
    SCALE: tl.constexpr, QBLOCK: tl.constexpr, SB_NDIV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """c[s_g + i, n] = sum_k a[s_g + i, k] * b[g, k, n] (b addressed through (g, n, k) strides);
    c[offs[G]:M] = 0 (the rows past the last group)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    num_k = tl.cdiv(K, BK)
    tile = pid
    base = 0
    for g in range(G):
        start = tl.load(offs_ptr + g)
        rows = (tl.load(offs_ptr + g + 1) - start).to(tl.int32)
        num_m = tl.cdiv(rows, BM)
        count = num_m * num_n
        while tile < base + count:
            pid_m, pid_n = _tile_coords(tile - base, num_m, num_n, GROUP_M)
            rm = pid_m * BM + tl.arange(0, BM)
            rn = pid_n * BN + tl.arange(0, BN)
            row_ok = rm < rows
            col_ok = rn < N
            a_rows = start + rm.to(tl.int64)
            g64 = pid.to(tl.int64) * 0 + g  # int64 in compiled and interpreted runs alike
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for kt in range(num_k):
                k0 = kt * BK
                if USE_TMA:
                    a = a_desc.load([(start + pid_m * BM).to(tl.int32), k0])
                    if B_KMAJOR:
                        b = tl.trans(b_desc.load([g * N + pid_n * BN, k0]))
                    else:
                        b = b_desc.load([g * K + k0, pid_n * BN])
                else:
                    rk = k0 + tl.arange(0, BK)
                    a_p = a_ptr + a_rows[:, None] * stride_am + rk[None, :] * stride_ak
                    b_p = b_ptr + g64 * stride_bg + rk[:, None] * stride_bk + rn[None, :].to(tl.int64) * stride_bn
                    if EVEN_K:
                        a = tl.load(a_p, mask=row_ok[:, None], other=0.0)
                        b = tl.load(b_p, mask=col_ok[None, :], other=0.0)
                    else:
                        k_ok = rk < K
                        a = tl.load(a_p, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                        b = tl.load(b_p, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                a, b = _dot_operands(a, b, UPCAST)
                if SCALE == 3:
                    kb = k0 // QBLOCK
                    sa = tl.load(sa_ptr + a_rows * stride_sam + kb * stride_sak, mask=row_ok, other=0.0)
                    if SB_NDIV % BN == 0:
                        # The tile's columns share one 2-D scale block: a scalar, not a gathered
                        # vector and an outer product (fewer registers: more programs per SM).
                        sb = tl.load(sb_ptr + g64 * stride_sbg + ((pid_n * BN) // SB_NDIV) * stride_sbn
                                     + kb * stride_sbk)
                        acc += tl.dot(a, b) * (sa * sb)[:, None]
                    else:
                        sb = tl.load(sb_ptr + g64 * stride_sbg + (rn // SB_NDIV) * stride_sbn + kb * stride_sbk,
                                     mask=col_ok, other=0.0)
                        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
                else:
                    acc = tl.dot(a, b, acc)
            if SCALE == 1:
                acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
            if SCALE == 2:
                sa = tl.load(sa_ptr + a_rows * stride_sam, mask=row_ok, other=0.0)
                sb = tl.load(sb_ptr + g64 * stride_sbg + rn * stride_sbn, mask=col_ok, other=0.0)
                acc = acc * (sa[:, None] * sb[None, :])
            c_p = c_ptr + a_rows[:, None] * stride_cm + rn[None, :] * stride_cn
            tl.store(c_p, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
            tile += NUM_PROGS
        base += count
    end = tl.load(offs_ptr + G)
    tail = (M - end).to(tl.int32)
    count = tl.cdiv(tail, BM) * num_n
    while tile < base + count:
        local = tile - base
        rm = (local // num_n) * BM + tl.arange(0, BM)
        rn = (local % num_n) * BN + tl.arange(0, BN)
        c_p = c_ptr + (end + rm.to(tl.int64))[:, None] * stride_cm + rn[None, :] * stride_cn
        zeros = tl.zeros((BM, BN), dtype=c_ptr.dtype.element_ty)
        tl.store(c_p, zeros, mask=(rm < tail)[:, None] & (rn < N)[None, :])
        tile += NUM_PROGS


@triton.jit
def zero_rows_past_kernel(c_ptr, offs_ptr, G, M, N, stride_cm, stride_cn, BM: tl.constexpr, BN: tl.constexpr):
    """c[offs[G]:M] = 0, for kernels that write only their groups' rows. One program per BM rows
    of c; a program whose rows all lie inside the groups (every one, unpadded) loads one offset
    and stores nothing, so the launch costs next to nothing where there is no padding."""
    end = tl.load(offs_ptr + G).to(tl.int64)
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    row_ok = (rm >= end) & (rm < M)
    n_steps = tl.where(tl.program_id(0).to(tl.int64) * BM + BM > end, tl.cdiv(N, BN), 0)
    for j in range(0, n_steps):
        rn = j * BN + tl.arange(0, BN)
        c_p = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(c_p, tl.zeros((BM, BN), dtype=c_ptr.dtype.element_ty), mask=row_ok[:, None] & (rn < N)[None, :])


@triton.jit
def _zero_where_not(v, keep):
    """``v`` where ``keep``, else +0.0, selected on the integer bits: no float type promotion is
    involved, so it is the same on every Triton version for fp8 as for 16/32-bit floats."""
    if v.dtype.primitive_bitwidth == 8:
        bits = v.to(tl.int8, bitcast=True)
    elif v.dtype.primitive_bitwidth == 16:
        bits = v.to(tl.int16, bitcast=True)
    else:
        bits = v.to(tl.int32, bitcast=True)
    bits = tl.where(keep, bits, tl.zeros_like(bits))
    return bits.to(v.dtype, bitcast=True)


@triton.jit
def _vk_operand(ptr, desc, k0, pid_c, rc64, c_ok, tok64, t_ok, stride_t, stride_c,
                BC: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr, T_CONTIG: tl.constexpr,
                MASK_T: tl.constexpr):
    """One operand's ``[BC, BK]`` tile (columns x tokens) of the step at token ``k0``.

    Through TMA the box is ``[BC, BK]`` for a token-contiguous operand (descriptor ``[cols, T]``)
    or ``[BK, BC]`` for a token-major one (descriptor ``[T, cols]``), then ``tl.trans``: a
    transposed view of the shared-memory tile, which the bf16/fp16 MMA reads as it is. Rows and
    tokens past the tensor's end are zero-filled by the copy engine. ``MASK_T`` (edge steps only)
    zeroes the tokens outside the group: with TMA after the load (in registers), with pointers in the
    load mask. Interior steps carry no token mask, so pointer loads along a token-contiguous
    operand vectorise too.
    """
    if USE_TMA:
        if T_CONTIG:
            v = desc.load([pid_c * BC, k0])
        else:
            v = tl.trans(desc.load([k0, pid_c * BC]))
        if MASK_T:
            v = _zero_where_not(v, t_ok[None, :])
    else:
        p = ptr + tok64[None, :] * stride_t + rc64[:, None] * stride_c
        if MASK_T:
            v = tl.load(p, mask=t_ok[None, :] & c_ok[:, None], other=0.0)
        else:
            v = tl.load(p, mask=c_ok[:, None], other=0.0)
    return v


@triton.jit
def _vk_step(acc, kb, start, end, pid_m, pid_n, rm64, rn64, m_ok, n_ok,
             x_ptr, y_ptr, x_desc, y_desc, sx_ptr, sy_ptr,
             stride_xt, stride_xm, stride_yt, stride_yn, stride_sxk, stride_sxm, stride_syk, stride_syn,
             SCALE: tl.constexpr, QBLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             UPCAST: tl.constexpr, USE_TMA: tl.constexpr, X_TCONTIG: tl.constexpr, Y_TCONTIG: tl.constexpr,
             MASK_T: tl.constexpr):
    """acc += x[tokens of step kb, rows]^T @ y[tokens of step kb, cols] (scaled per step when blockwise).

    Both operands are zeroed outside the group on edge steps, not just one: the product would
    already be right with one, but a non-finite value in a neighbouring group's tokens would then
    leak in as 0 * inf = NaN.
    """
    k0 = kb * BK
    tok = k0 + tl.arange(0, BK)
    t_ok = (tok >= start) & (tok < end)
    tok64 = tok.to(tl.int64)
    x = _vk_operand(x_ptr, x_desc, k0, pid_m, rm64, m_ok, tok64, t_ok, stride_xt, stride_xm,
                    BM, BK, USE_TMA, X_TCONTIG, MASK_T)  # [BM, BK]
    y = tl.trans(_vk_operand(y_ptr, y_desc, k0, pid_n, rn64, n_ok, tok64, t_ok, stride_yt, stride_yn,
                             BN, BK, USE_TMA, Y_TCONTIG, MASK_T))  # [BK, BN]
    x, y = _dot_operands(x, y, UPCAST)
    if SCALE == 3:
        kq = k0 // QBLOCK  # BK divides QBLOCK: the whole step lies in one token run
        sx = tl.load(sx_ptr + kq * stride_sxk + rm64 * stride_sxm, mask=m_ok, other=0.0)
        sy = tl.load(sy_ptr + kq * stride_syk + rn64 * stride_syn, mask=n_ok, other=0.0)
        acc += tl.dot(x, y) * (sx[:, None] * sy[None, :])
    else:
        acc = tl.dot(x, y, acc)
    return acc


@triton.jit
def grouped_variable_k_kernel(
    x_ptr, y_ptr, c_ptr, offs_ptr, sx_ptr, sy_ptr, x_desc, y_desc,
    M, N,
    stride_xt, stride_xm, stride_yt, stride_yn, stride_cg, stride_cm, stride_cn,
    stride_sxk, stride_sxm, stride_syk, stride_syn,
    SCALE: tl.constexpr, QBLOCK: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
    USE_TMA: tl.constexpr, X_TCONTIG: tl.constexpr, Y_TCONTIG: tl.constexpr,
):
    """c[g, i, j] = sum over tokens t of group g of x[t, i] * y[t, j] (x, y addressed by strides,
    or by TMA descriptors over ``[cols, T]`` (``*_TCONTIG``) or ``[T, cols]``)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = num_m * num_n
    g = pid // per_group
    pid_m, pid_n = _tile_coords(pid % per_group, num_m, num_n, GROUP_M)
    start = tl.load(offs_ptr + g).to(tl.int32)
    end = tl.load(offs_ptr + g + 1).to(tl.int32)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # Token steps lie on the global BK grid (k0 = kb * BK, provably a multiple of BK: aligned,
    # vectorisable loads; BK divides QBLOCK, so a step never straddles two scale runs). The steps
    # entirely inside [start, end) carry no token mask; only the partial first and last steps do.
    first_full = tl.cdiv(start, BK)
    last_full = end // BK  # the interior steps are [first_full, last_full)
    if (start % BK != 0) & (start < end):  # head: also the only step of a group inside one BK cell
        acc = _vk_step(acc, start // BK, start, end, pid_m, pid_n, rm64, rn64, m_ok, n_ok,
                       x_ptr, y_ptr, x_desc, y_desc, sx_ptr, sy_ptr,
                       stride_xt, stride_xm, stride_yt, stride_yn, stride_sxk, stride_sxm, stride_syk, stride_syn,
                       SCALE, QBLOCK, BM, BN, BK, UPCAST, USE_TMA, X_TCONTIG, Y_TCONTIG, True)
    for kb in range(first_full, last_full):
        acc = _vk_step(acc, kb, start, end, pid_m, pid_n, rm64, rn64, m_ok, n_ok,
                       x_ptr, y_ptr, x_desc, y_desc, sx_ptr, sy_ptr,
                       stride_xt, stride_xm, stride_yt, stride_yn, stride_sxk, stride_sxm, stride_syk, stride_syn,
                       SCALE, QBLOCK, BM, BN, BK, UPCAST, USE_TMA, X_TCONTIG, Y_TCONTIG, False)
    if (end % BK != 0) & (last_full >= first_full):  # tail (not already the head's step)
        acc = _vk_step(acc, last_full, start, end, pid_m, pid_n, rm64, rn64, m_ok, n_ok,
                       x_ptr, y_ptr, x_desc, y_desc, sx_ptr, sy_ptr,
                       stride_xt, stride_xm, stride_yt, stride_yn, stride_sxk, stride_sxm, stride_syk, stride_syn,
                       SCALE, QBLOCK, BM, BN, BK, UPCAST, USE_TMA, X_TCONTIG, Y_TCONTIG, True)
    if SCALE == 1:
        acc = acc * (tl.load(sx_ptr) * tl.load(sy_ptr))
    if SCALE == 2:
        sx = tl.load(sx_ptr + rm64 * stride_sxm, mask=m_ok, other=0.0)
        sy = tl.load(sy_ptr + rn64 * stride_syn, mask=n_ok, other=0.0)
        acc = acc * (sx[:, None] * sy[None, :])
    c_p = c_ptr + g.to(tl.int64) * stride_cg + rm64[:, None] * stride_cm + rn64[None, :] * stride_cn
    tl.store(c_p, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
