"""GPU probe: variants of the blockwise fp8 GEMM kernel (1x128 activation runs x 128x128 weight
tiles) against the production Triton kernel and F.scaled_mm (cuBLASLt), GEMM only, on
pre-quantised operands. Usage (repo installed): ``python3 tools/probe_fp8_blockwise.py [--out F]``.

The variants test where the production kernel loses time. Its K loop issues one wgmma per
128-deep K block into a fresh accumulator and must wait for it before the fp32 promotion
``acc += part * scale``, so the tensor cores idle during every promotion:

* ``kpair``: two K blocks per loop step (two independent dots in flight, one wait per pair);
* ``ws_outer`` / ``ws_inner``: Triton's automatic warp specialisation (a TMA producer warp and
  consumer warpgroups) on the persistent tile loop or on the K loop;
* ``grid``: one program per tile instead of a persistent grid;
* tile shapes 128x128 (8 warps) and 128x256 (8 warps; the promotion's temporary doubles the
  accumulator's registers).

Every variant is checked against cuBLASLt's output on the same quantised operands (relative
error) before its time counts. Prints one line per measurement, best per shape last.

Round 1 (11-23) measured those variants: none beat the production 128 x 128 tile. The default
run now times every production candidate of ``configs.fp8_candidates`` (including the
``occupancy`` > 1 configs: two or three persistent programs of a 64 x 128 tile per SM, so one's
promotion overlaps another's wgmma, and the Gluon kernel's configs, which overlap promotion and
wgmma inside one program); ``--variants`` adds the round-1 sweep. PRIMUS_TURBO_GLUON_KERNELS=0
leaves the Gluon configs out.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

from turbo_dispatch.backends.torch.gemm import _scaled
from turbo_dispatch.backends.triton import fp8_gemm_kernels as FK
from turbo_dispatch.backends.triton import configs as C
from turbo_dispatch.backends.triton.gemm import gluon_kernel
from turbo_dispatch.backends.triton.gemm_kernels import tile_coords
from turbo_dispatch.backends.triton.quantize import quantize_fp8, quantize_kmajor
from turbo_dispatch.low_precision import ScalingGranularity as G
from turbo_dispatch.ops.gemm import gemm_fp8_problem

E4 = torch.float8_e4m3fn


@triton.jit
def _step(a_desc, b_desc, sa_ptr, sb_ptr, offs_m, off_m, off_n, offs_n, kt, k_tiles, M, N, ssa_r, ssa_k, ssb_r,
          ssb_k, BN: tl.constexpr, BK: tl.constexpr):
    """One K block's promoted partial product. Past the last block the copy engine zero-fills
    the operands, so the part is zero and the scale index is only clamped in bounds."""
    av = a_desc.load([off_m, kt * BK])
    bv = b_desc.load([off_n, kt * BK])
    ks = tl.minimum(kt, k_tiles - 1)
    sa = tl.load(sa_ptr + offs_m * ssa_r + ks * ssa_k, mask=offs_m < M, other=0.0)
    part = tl.dot(av, bv.T)
    if BN <= 128:
        sb = tl.load(sb_ptr + (off_n // 128) * ssb_r + ks * ssb_k)
        return part * (sa * sb)[:, None]
    else:
        sb = tl.load(sb_ptr + (offs_n // 128) * ssb_r + ks * ssb_k, mask=offs_n < N, other=0.0)
        return part * sa[:, None] * sb[None, :]


@triton.jit
def blockwise_variant(a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, M, N, K, ssa_r, ssa_k, ssb_r, ssb_k, sc_m, NUM_PROGS,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                      KPAIR: tl.constexpr, WS_OUTER: tl.constexpr, WS_INNER: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile_id in tl.range(pid, num_pid_m * num_pid_n, NUM_PROGS, warp_specialize=WS_OUTER):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        offs_m = off_m + tl.arange(0, BM)
        offs_n = off_n + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if KPAIR:
            for kt in tl.range(0, k_tiles, 2, warp_specialize=WS_INNER):
                p0 = _step(a_desc, b_desc, sa_ptr, sb_ptr, offs_m, off_m, off_n, offs_n, kt, k_tiles, M, N, ssa_r, ssa_k,
                           ssb_r, ssb_k, BN, BK)
                p1 = _step(a_desc, b_desc, sa_ptr, sb_ptr, offs_m, off_m, off_n, offs_n, kt + 1, k_tiles, M, N, ssa_r,
                           ssa_k, ssb_r, ssb_k, BN, BK)
                acc += p0 + p1
        else:
            for kt in tl.range(0, k_tiles, warp_specialize=WS_INNER):
                acc += _step(a_desc, b_desc, sa_ptr, sb_ptr, offs_m, off_m, off_n, offs_n, kt, k_tiles, M, N, ssa_r,
                             ssa_k, ssb_r, ssb_k, BN, BK)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(c_ptr + offs_m[:, None] * sc_m + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


def run_variant(qa, sa, qb, sb, bm, bn, warps, stages, kpair, ws_outer, ws_inner, persistent):
    m, k = qa.shape
    n = qb.shape[0]
    c = torch.empty((m, n), dtype=torch.bfloat16, device=qa.device)
    a_desc = TensorDescriptor(qa, [m, k], list(qa.stride()), [bm, 128])
    b_desc = TensorDescriptor(qb, [n, k], list(qb.stride()), [bn, 128])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    progs = min(tiles, torch.cuda.get_device_properties(0).multi_processor_count) if persistent else tiles
    blockwise_variant[(progs,)](a_desc, b_desc, c, sa, sb, m, n, k, sa.stride(0), sa.stride(1), sb.stride(0),
                                sb.stride(1), c.stride(0), progs, BM=bm, BN=bn, BK=128, GROUP_M=8, KPAIR=kpair,
                                WS_OUTER=ws_outer, WS_INNER=ws_inner, num_warps=warps, num_stages=stages)
    return c


def dense_operands(m: int, n: int, k: int):
    """Random bf16 ``a`` [m, k] and ``w`` [n, k] (scaled by 0.05) quantised for the blockwise GEMM
    (1 x 128 activation runs, 128 x 128 weight tiles): the problem key and torch's quantised
    tensors for ``F.scaled_mm``, then the K-major ``(data, scale)`` pairs our kernels take."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    p = gemm_fp8_problem(a, w, False, True, torch.bfloat16, E4, E4, G.BLOCKWISE, 128, False, True)
    qa_t = quantize_fp8(a, E4, G.BLOCKWISE, axis=1, block_size=128)
    qw_t = quantize_fp8(w, E4, G.BLOCKWISE, axis=1, block_size=128, block_2d=True)
    kmajor = quantize_kmajor(a, E4, G.BLOCKWISE, 128, False), quantize_kmajor(w, E4, G.BLOCKWISE, 128, True)
    return (p, qa_t, qw_t) + kmajor


def emit(out, **kw):
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()), flush=True)
    if out:
        out.write(json.dumps(kw) + "\n")
        out.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="4096x7168x16384,4096x4096x7168,8192x14336x4096,2048x7168x2048")
    ap.add_argument("--variants", action="store_true", help="also time the round-1 kernel variants")
    args = ap.parse_args()
    out = open(args.out, "w") if args.out else None
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    variants = []
    for bm, bn, warps, stages in ([] if not args.variants else ((128, 128, 8, 4), (128, 256, 8, 3), (128, 128, 4, 4), (64, 256, 4, 4))):
        for kpair, ws_outer, ws_inner, persistent in ((0, 0, 0, 1), (1, 0, 0, 1), (0, 0, 0, 0), (1, 0, 0, 0),
                                                       (0, 1, 0, 1), (0, 0, 1, 0), (1, 0, 1, 0)):
            variants.append((bm, bn, warps, stages, kpair, ws_outer, ws_inner, persistent))
    broken: set = set()
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        flops = 2.0 * m * n * k
        p, qa_t, qw_t, (qa, sa), (qb, sb) = dense_operands(m, n, k)
        ref = _scaled(p, qa_t, qw_t)
        ms = triton.testing.do_bench(lambda: _scaled(p, qa_t, qw_t), warmup=50, rep=200, return_mode="median")
        best = ("cublaslt", flops / ms / 1e9)
        emit(out, shape=shape, variant="F.scaled_mm(cublaslt)", ms=ms, tflops=flops / ms / 1e9)
        for tc in C.fp8_candidates(m, n, k, 128):
            cfg = C.as_tuple(tc)
            if tc.kernel in C.GLUON_KERNELS:
                GLK = gluon_kernel(tc.kernel)
                why = GLK.available() or GLK.config_error(tc, 128)
                if why:
                    emit(out, shape=shape, variant=f"gluon{cfg}", status="SKIP", reason=why)
                    continue
                fn = lambda: GLK.fp8_blockwise_gemm(qa, qb, sa, sb, torch.bfloat16, tc, a_group=1,  # noqa: E731
                                                    b_group=128)
            else:
                fn = lambda: FK.fp8_gemm(qa, qb, sa, sb, FK.SCALE_BLOCK, torch.bfloat16, tc, a_group=1, b_group=128)  # noqa: E731
            err = ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
            ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
            emit(out, shape=shape, variant=f"production{cfg}", rel=err, ms=ms, tflops=flops / ms / 1e9)
            if err < 5e-3 and flops / ms / 1e9 > best[1]:
                best = (f"production{cfg}", flops / ms / 1e9)
        for v in variants:
            if v in broken:
                continue
            name = "bm{}_bn{}_w{}_s{}_kpair{}_wso{}_wsi{}_pers{}".format(*v)
            try:
                fn = lambda: run_variant(qa, sa, qb, sb, *v)  # noqa: E731
                got = fn()
                torch.cuda.synchronize()
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 5e-3:
                    emit(out, shape=shape, variant=name, rel=err, status="FAIL")
                    continue
                ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
                tf = flops / ms / 1e9
                emit(out, shape=shape, variant=name, rel=err, ms=ms, tflops=tf)
                if tf > best[1]:
                    best = (name, tf)
            except Exception as exc:  # a variant that does not compile on this Triton
                broken.add(v)
                emit(out, shape=shape, variant=name, status="ERROR", error=f"{type(exc).__name__}: {str(exc)[:300]}")
                traceback.print_exc(limit=1)
        emit(out, shape=shape, variant="BEST", best=best[0], tflops=best[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
