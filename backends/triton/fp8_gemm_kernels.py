"""fp8 GEMM in Triton: ``C[M, N] = (A_q * sa) @ (B_q * sb)^T`` with both operands K-major.

Operands come from ``quantize.quantize_kmajor``: ``a`` [M, K] and ``b`` [N, K] in fp8 (e4m3 or
e5m2, mixed allowed), K contiguous, because Hopper's fp8 wgmma reads only K-major shared memory.
Scale modes (``SCALE_MODE``):

* 0 TENSORWISE: one scale each, applied once in the epilogue.
* 1 ROWWISE: ``sa[M]``, ``sb[N]``, applied in the epilogue as an outer product.
* 2 BLOCKWISE: one scale per (row group, K block) for each operand: ``sa[m // A_GROUP, kb]``,
  ``sb[n // B_GROUP, kb]``, with GROUP = 1 for 1 x bs runs and bs for bs x bs tiles. BLOCK_K
  equals the quantisation block, so every K step's partial product is promoted to fp32 with its
  own scales: ``acc += dot(a_blk, b_blk) * sa[:, None] * sb[None, :]``. When a tile lies inside
  one 2-D scale group (BLOCK_N <= bs) that operand's scale is a scalar load.

Same persistent, GROUP_M-swizzled grid and TMA/pointer split as gemm_kernels. fp8 TMA needs
16-byte strides: the quantiser pads K-major rows to 16 bytes, so TMA applies to every K.
"""
from __future__ import annotations

import torch

from .gemm_kernels import (DescriptorLayout, bind_cuda_context, interpreting, num_programs, tile_coords, tma_ok,
                           tma_pays, tma_supported)
from .prebound import PreboundKernel

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

#: Bumped whenever a kernel's code changes, so stored tuning results are invalidated.
KERNEL_REVISION = "fp8gemm-r1"

SCALE_TENSOR, SCALE_ROW, SCALE_BLOCK = 0, 1, 2

if triton is not None:

    @triton.jit
    def _group_scale(s_ptr, offs, off0, kt, s_row, s_k, n_valid, GROUP: tl.constexpr, BLOCK: tl.constexpr):
        """The K-block ``kt`` scales of a tile's rows, shaped to broadcast against [rows, cols]
        later: a scalar when the whole tile shares one group (GROUP multiple of BLOCK), else a
        vector gathered per row."""
        if GROUP >= BLOCK and GROUP % BLOCK == 0:
            return tl.load(s_ptr + (off0 // GROUP) * s_row + kt * s_k)
        else:
            return tl.load(s_ptr + (offs // GROUP) * s_row + kt * s_k, mask=offs < n_valid, other=0.0)

    @triton.jit
    def _fp8_gemm_kernel(a, b, c, sa_ptr, sb_ptr, M, N, K, sa_m, sa_k, sb_n, sb_k, sc_m, sc_n,
                         ssa_r, ssa_k, ssb_r, ssb_k, NUM_PROGS,
                         SCALE_MODE: tl.constexpr, A_GROUP: tl.constexpr, B_GROUP: tl.constexpr,
                         USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """Persistent fp8 GEMM; ``a`` [M, K] and ``b`` [N, K] are TMA descriptors (USE_TMA) or
        pointers with strides (sa_m, sa_k) / (sb_n, sb_k). (ssa_r, ssa_k) / (ssb_r, ssb_k) are
        the block-scale strides (SCALE_MODE 2)."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile_id in tl.range(pid, num_pid_m * num_pid_n, NUM_PROGS):
            pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            offs_m = off_m + tl.arange(0, BLOCK_M)
            offs_n = off_n + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kt in range(k_tiles):
                off_k = kt * BLOCK_K
                if USE_TMA:
                    av = a.load([off_m, off_k])
                    bv = b.load([off_n, off_k])
                else:
                    offs_k = off_k + tl.arange(0, BLOCK_K)
                    av = tl.load(a + offs_m[:, None] * sa_m + offs_k[None, :] * sa_k,
                                 mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
                    bv = tl.load(b + offs_n[:, None] * sb_n + offs_k[None, :] * sb_k,
                                 mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
                if SCALE_MODE == 2:
                    sa = _group_scale(sa_ptr, offs_m, off_m, kt, ssa_r, ssa_k, M, A_GROUP, BLOCK_M)
                    sb = _group_scale(sb_ptr, offs_n, off_n, kt, ssb_r, ssb_k, N, B_GROUP, BLOCK_N)
                    part = tl.dot(av, bv.T)
                    if A_GROUP >= BLOCK_M and A_GROUP % BLOCK_M == 0:
                        if B_GROUP >= BLOCK_N and B_GROUP % BLOCK_N == 0:
                            acc += part * (sa * sb)
                        else:
                            acc += part * (sa * sb)[None, :]
                    else:
                        if B_GROUP >= BLOCK_N and B_GROUP % BLOCK_N == 0:
                            acc += part * (sa * sb)[:, None]
                        else:
                            acc += part * sa[:, None] * sb[None, :]
                else:
                    acc = tl.dot(av, bv.T, acc)
            if SCALE_MODE == 0:
                acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
            elif SCALE_MODE == 1:
                sa = tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)
                sb = tl.load(sb_ptr + offs_n, mask=offs_n < N, other=0.0)
                acc = acc * sa[:, None] * sb[None, :]
            mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            tl.store(c + offs_m[:, None] * sc_m + offs_n[None, :] * sc_n, acc.to(c.dtype.element_ty), mask=mask)


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, scale_mode: int,
             out_dtype: torch.dtype, cfg, a_group: int = 1, b_group: int = 1,
             use_tma: bool | None = None) -> torch.Tensor:
    """``C = dequant(a) @ dequant(b)^T`` for K-major fp8 ``a`` [M, K], ``b`` [N, K].

    Scales per ``scale_mode``: 0-d tensors (tensorwise); [M]/[N]-element tensors (rowwise);
    2-D [rows/group, K/BLOCK_K] with any strides (blockwise; ``cfg`` BLOCK_K must equal the
    quantisation block). ``use_tma`` as in gemm_kernels.gemm. The launch is resolved once per
    problem key (``launch_key``) and pre-bound (prebound.py).
    """
    key = launch_key(a, b, sa, sb, scale_mode, out_dtype, cfg, a_group, b_group, use_tma)
    plan = FP8_GEMM_LAUNCHER.plan(key)
    if plan is None:
        return _fp8_gemm_first(key, a, b, sa, sb, scale_mode, out_dtype, cfg, a_group, b_group, use_tma)
    rows, cols, layouts = plan.state
    c = torch.empty((rows, cols), dtype=out_dtype, device=a.device)
    if layouts is None:
        plan(a, b, c, sa, sb)
    else:
        bind_cuda_context(a)
        plan(layouts[0].of(a), layouts[1].of(b), c, sa, sb)
    return c


def launch_key(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, scale_mode: int,
               out_dtype: torch.dtype, cfg, a_group: int, b_group: int, use_tma: bool | None) -> tuple:
    """What fixes an ``fp8_gemm`` launch: shapes, strides, dtypes and 16-byte alignment of the
    operands and scales, the device, the scale mode and groups, the output dtype, the tile config
    and the TMA request."""
    return (a.shape, a.stride(), a.dtype, b.shape, b.stride(), b.dtype, sa.shape, sa.stride(), sa.dtype, sb.shape,
            sb.stride(), sb.dtype, a.device, a.data_ptr() % 16 == 0, b.data_ptr() % 16 == 0, sa.data_ptr() % 16 == 0,
            sb.data_ptr() % 16 == 0, scale_mode, out_dtype, cfg, a_group, b_group, use_tma)


def _fp8_gemm_first(key: tuple, a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, scale_mode: int,
                    out_dtype: torch.dtype, cfg, a_group: int, b_group: int, use_tma: bool | None) -> torch.Tensor:
    """``fp8_gemm`` for a key without a plan: resolves the launch, runs it and binds the plan."""
    M, K = a.shape
    N = b.shape[0]
    if b.shape[1] != K:
        raise ValueError(f"fp8_gemm: a is {tuple(a.shape)}, b is {tuple(b.shape)}; both must be [*, K]")
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    dev = a.device.index if a.is_cuda else 0
    bm, bn, bk, group_m, stages, warps = cfg[:6]
    occupancy = cfg[6] if len(cfg) > 6 else 1
    can_tma = tma_supported(dev) and tma_ok(a) and tma_ok(b)
    if use_tma is None:
        use_tma = can_tma and tma_pays(M, N, K, bm, bn, bk)
    elif use_tma and not can_tma:
        raise ValueError("fp8_gemm: TMA requested but the operands or device do not allow it")
    if use_tma:
        bind_cuda_context(a)
        layouts = (DescriptorLayout(a, [M, K], a.stride(), [bm, bk]), DescriptorLayout(b, [N, K], b.stride(), [bn, bk]))
        a_arg, b_arg = layouts[0].of(a), layouts[1].of(b)
    else:
        layouts, a_arg, b_arg = None, a, b
    if scale_mode == SCALE_BLOCK:
        ssa, ssb = (sa.stride(0), sa.stride(1)), (sb.stride(0), sb.stride(1))
    else:
        ssa = ssb = (0, 0)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    progs = min(tiles, num_programs(dev) * occupancy)
    fixed = dict(M=M, N=N, K=K, sa_m=a.stride(0), sa_k=a.stride(1), sb_n=b.stride(0), sb_k=b.stride(1),
                 sc_m=c.stride(0), sc_n=c.stride(1), ssa_r=ssa[0], ssa_k=ssa[1], ssb_r=ssb[0], ssb_k=ssb[1],
                 NUM_PROGS=progs, SCALE_MODE=scale_mode, A_GROUP=a_group, B_GROUP=b_group, USE_TMA=use_tma,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m)
    FP8_GEMM_LAUNCHER.bind(key, (progs,), (a_arg, b_arg, c, sa, sb), fixed, dict(num_stages=stages, num_warps=warps),
                           state=(M, N, layouts))
    return c


#: ``_fp8_gemm_kernel``'s plans; the operands, the output and the scales change between calls of one key.
FP8_GEMM_LAUNCHER = (PreboundKernel(_fp8_gemm_kernel, per_call=("a", "b", "c", "sa_ptr", "sb_ptr"))
                     if triton is not None else None)


__all__ = ["KERNEL_REVISION", "SCALE_BLOCK", "SCALE_ROW", "SCALE_TENSOR", "fp8_gemm", "interpreting"]
