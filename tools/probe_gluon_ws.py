"""Time the warp-specialised Gluon blockwise kernel's knobs against cuBLASLt and the Triton kernel.

GEMM only, K-major fp8 operands quantised once (1 x 128 activation blocks, 128 x 128 weight
blocks). Per shape: ``F.scaled_mm`` (cuBLASLt) first as the reference output and peer, the
production Triton tile, then the warp-specialised kernel over pipeline depth. Each variant's
output is compared with cuBLASLt's (relative Frobenius error) before it is timed. One JSON line
per row in ``--out``.

``--grouped`` does the same for the M-grouped form (``fp8_blockwise_grouped_gemm``): first a
float64 check over empty, one-row and unaligned groups, then DeepSeek-V3 8 experts x 4096 tokens
(up_gate and down, balanced and skewed routing), kernel only, against the Triton grouped kernel.

Usage (on an sm_90 GPU): ``python tools/probe_gluon_ws.py [--grouped] [--tiles 128:6,256:4] --out ws.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.testing

from turbo_dispatch.backends.torch.gemm import _scaled
from turbo_dispatch.backends.triton import configs as C
from turbo_dispatch.backends.triton import fp8_blockwise_gluon_ws as GWS
from turbo_dispatch.backends.triton import fp8_gemm_kernels as FK
from turbo_dispatch.backends.triton.quantize import quantize_kmajor
from turbo_dispatch.low_precision import ScalingGranularity as G

from probe_fp8_blockwise import dense_operands  # a sibling in tools/, on sys.path when run as a script

E4 = torch.float8_e4m3fn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="4096x7168x16384,4096x4096x7168,8192x14336x4096")
    ap.add_argument("--stages", default="4,5,6")
    ap.add_argument("--tiles", default="",
                    help="warp-specialised variants BLOCK_N:stages[:GROUP_M][:smem|:gmem][:ptr|:tma][:whole], e.g. "
                         "128:6,256:3,256:3:ptr (smem/gmem: a's scales copied into shared memory by the loader or "
                         "read from global; tma/ptr: TMA-store or pointer-store epilogue; whole: no split of a short "
                         "last wave; left out: the launcher's choice); overrides --stages; each is first checked "
                         "against float64 on odd sizes")
    ap.add_argument("--grouped", action="store_true", help="the grouped form instead of the dense one")
    ap.add_argument("--overhead", action="store_true",
                    help="per shape and variant: eager time (do_bench), CUDA-graph replay time and the host time "
                         "of one launch, to tell launch overhead from kernel time")
    args = ap.parse_args()
    out = open(args.out, "w") if args.out else None

    def emit(**kw):
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()), flush=True)
        if out:
            out.write(json.dumps(kw) + "\n")
            out.flush()

    emit(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    torch.manual_seed(0)
    specs = args.tiles.split(",") if args.tiles else [f"128:{s}" for s in args.stages.split(",")]
    ws_cfgs = [_ws_variant(spec) for spec in specs]
    if args.grouped:
        return grouped(emit, ws_cfgs)
    if args.overhead:
        return overhead(emit, ws_cfgs, args.shapes.split(","))
    if args.tiles and not dense_check(emit, ws_cfgs):
        return 1
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        flops = 2.0 * m * n * k
        p, qa_t, qw_t, (qa, sa), (qb, sb) = dense_operands(m, n, k)
        ref = _scaled(p, qa_t, qw_t).float()
        variants = [("F.scaled_mm(cublaslt)", lambda: _scaled(p, qa_t, qw_t)),
                    ("triton(128, 128, 128, 8, 4, 8)", lambda: FK.fp8_gemm(
                        qa, qb, sa, sb, FK.SCALE_BLOCK, torch.bfloat16, C.TileConfig(128, 128, 128, 8, 4, 8),
                        a_group=1, b_group=128))]
        for v in ws_cfgs:
            variants.append((_ws_name(v), lambda v=v: _ws_dense(v, qa, qb, sa, sb, torch.bfloat16, 1)))
        for name, fn in variants:
            rel = float((fn().float() - ref).norm() / ref.norm())
            if not rel < 5e-3:
                emit(shape=shape, variant=name, rel=rel, status="FAIL")
                continue
            ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
            emit(shape=shape, variant=name, rel=rel, ms=ms, tflops=flops / ms / 1e9)
    return 0


def overhead(emit, ws_cfgs, shapes) -> int:
    """Eager (``do_bench``: host launch work the GPU waits for is counted) against CUDA-graph
    replay (kernel time alone) and the host time per launch (100 launches queued, no sync)."""
    import time

    for shape in shapes:
        m, n, k = (int(v) for v in shape.split("x"))
        p, qa_t, qw_t, (qa, sa), (qb, sb) = dense_operands(m, n, k)
        variants = [("F.scaled_mm(cublaslt)", lambda: _scaled(p, qa_t, qw_t))]
        variants += [(_ws_name(v), lambda v=v: _ws_dense(v, qa, qb, sa, sb, torch.bfloat16, 1)) for v in ws_cfgs]
        for name, fn in variants:
            fn()
            torch.cuda.synchronize()
            eager = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
            graph = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
            t0 = time.perf_counter()
            for _ in range(100):
                fn()
            host_us = (time.perf_counter() - t0) * 1e4
            torch.cuda.synchronize()
            emit(probe="overhead", shape=shape, variant=name, eager_ms=eager, graph_ms=graph, host_us=host_us,
                 eager_tflops=2.0 * m * n * k / eager / 1e9, graph_tflops=2.0 * m * n * k / graph / 1e9)
    return 0


def _ws_variant(spec: str) -> tuple:
    """``BLOCK_N:stages[:GROUP_M][:smem|:gmem][:ptr|:tma][:whole]`` -> (TileConfig, a's scales in
    shared memory, TMA-store epilogue, split a short last wave); a flag left out is the launcher's
    own choice (None; the split is on unless ``whole``)."""
    parts = spec.split(":")
    flags = {p for p in parts if not p.isdigit()}
    nums = [int(v) for v in parts if v.isdigit()]
    bn, st, gm = nums[0], nums[1], (nums[2] if len(nums) > 2 else 8)
    smem = True if "smem" in flags else False if "gmem" in flags else None
    tma = True if "tma" in flags else False if "ptr" in flags else None
    return C.TileConfig(128, bn, 128, gm, st, 8, 1, C.KERNEL_GLUON_WS), smem, tma, "whole" not in flags


def _ws_name(v) -> str:
    cfg, smem, tma, split = v
    flags = {True: ",smem", False: ",gmem", None: ""}[smem] + {True: ",tma", False: ",ptr", None: ""}[tma]
    flags += "" if split else ",whole"
    return f"ws(n{cfg.block_n},s{cfg.num_stages},g{cfg.group_m}{flags})"


def _force(v) -> None:
    GWS.SCALES_IN_SMEM, GWS.TMA_STORE, GWS.SPLIT_TAIL = v[1], v[2], v[3]


def _ws_dense(v, qa, qb, sa, sb, out_dtype, a_group):
    _force(v)
    return GWS.fp8_blockwise_gemm(qa, qb, sa, sb, out_dtype, v[0], a_group=a_group, b_group=128)


def dense_check(emit, cfgs) -> bool:
    """Each config against float64 on the dequantised operands: M of 1 and off the tile grid, N
    whose last tile is partly or (for a 256-column tile, its second half) wholly past N, N whose
    rows TMA cannot store (odd), K with a partial block, a short last wave split into halves (2100
    x 1800: 136 tiles, the last four split, one half wholly past N); 1 x 128 or 128 x 128 ``a``
    scales; fp32 and bf16 output (each its own staging buffer type)."""
    ok = True
    for cfg in cfgs:
        for m, n, k in [(1, 128, 256), (257, 384, 1000), (1000, 1000, 1157), (300, 999, 640), (2048, 1536, 4096),
                        (2100, 1800, 640)]:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for a2d, out_dtype in ((False, torch.float32), (True, torch.float32), (False, torch.bfloat16)):
                qa, sa = quantize_kmajor(a, E4, G.BLOCKWISE, 128, a2d)
                qb, sb = quantize_kmajor(b, E4, G.BLOCKWISE, 128, True)
                ga = 128 if a2d else 1
                out = _ws_dense(cfg, qa, qb, sa, sb, out_dtype, ga).double()
                da = qa.double() * sa.double().repeat_interleave(ga, 0)[:m].repeat_interleave(128, 1)[:, :k]
                db = qb.double() * sb.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
                ref = da @ db.t()
                rel = float((out - ref).norm() / ref.norm())
                good = rel < (1e-3 if out_dtype == torch.float32 else 5e-3) and bool(out.isfinite().all())
                ok &= good
                emit(check="dense_vs_float64", variant=_ws_name(cfg), shape=f"{m}x{n}x{k}", a2d=a2d,
                     out=str(out_dtype), rel=rel, status="PASS" if good else "FAIL")
    return ok


def _grouped_operands(lens, n, k):
    from turbo_dispatch.backends.triton.grouped_gemm import _quant_rows

    m = int(sum(lens))
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(lens), n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    qa, sa = _quant_rows(a.unsqueeze(0), E4, G.BLOCKWISE, 128)
    qw, sw = _quant_rows(w, E4, G.BLOCKWISE, 128, tile_2d=True)
    offs = torch.nn.functional.pad(torch.tensor(lens, device="cuda").cumsum(0), (1, 0)).to(torch.int32)
    return qa[0], sa, qw, sw, offs


def _grouped_ws(qa, sa, qw, sw, offs, v):
    _force(v)
    out = torch.empty((qa.shape[0], qw.shape[1]), dtype=torch.bfloat16, device=qa.device)
    return GWS.fp8_blockwise_grouped_gemm(qa, qw, out, offs, sa, (sa.stride(1), sa.stride(2)), sw, sw.stride(), v[0])


def _grouped_triton(qa, sa, qw, sw, offs, cfg=(128, 128, 128, 8, 4, 8, 1)):
    from turbo_dispatch.backends.triton.grouped_gemm import launch_fixed_k

    out = torch.empty((qa.shape[0], qw.shape[1]), dtype=torch.bfloat16, device=qa.device)
    return launch_fixed_k(qa, qw, out, offs, cfg, scale=3, sa=sa, sa_strides=(sa.stride(1), sa.stride(2)), sb=sw,
                          sb_strides=tuple(sw.stride()), qblock=128, sb_ndiv=128)


def grouped(emit, ws_cfgs) -> int:
    # float64 check: empty groups, a one-row group, sizes off the 128 grid, K with a partial block.
    lens = [0, 300, 1, 700, 0, 129, 0]
    for ws, n, k in [(ws, n, k) for ws in ws_cfgs for n, k in ((384, 1000), (256, 7168))]:
        qa, sa, qw, sw, offs = _grouped_operands(lens, n, k)
        out = _grouped_ws(qa, sa, qw, sw, offs, ws).double()
        bad = []
        for g in range(len(lens)):
            s0, s1 = int(offs[g]), int(offs[g + 1])
            if s1 == s0:
                continue
            da = qa[s0:s1, :k].double() * sa[0, s0:s1].double().repeat_interleave(128, 1)[:, :k]
            dw = qw[g, :, :k].double() * sw[g].double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            ref = da @ dw.t()
            rel = float((out[s0:s1] - ref).norm() / ref.norm())
            if not rel < 1e-2:
                bad.append((g, rel))
        emit(check="grouped_vs_float64", variant=_ws_name(ws), lens=lens, n=n, k=k,
             status="PASS" if not bad else "FAIL", bad=bad, finite=bool(out.isfinite().all()))
    # timing at DeepSeek-V3, 8 local experts x 4096 tokens
    for name, n, k in (("dsv3_up", 4096, 7168), ("dsv3_down", 7168, 2048)):
        for routing in ("balanced", "skewed"):
            if routing == "balanced":
                lens = [4096] * 8
            else:
                w = torch.tensor([1.0 / (i + 1) ** 1.2 for i in range(8)])
                lens = (w / w.sum() * 32768).floor().long().tolist()
                lens[0] += 32768 - sum(lens)
            qa, sa, qw, sw, offs = _grouped_operands(lens, n, k)
            flops = 2.0 * 32768 * n * k
            ref = _grouped_triton(qa, sa, qw, sw, offs).float()
            variants = [("triton(128, 128, 128, 8, 4, 8, 1)", lambda: _grouped_triton(qa, sa, qw, sw, offs))]
            for cfg in ws_cfgs:
                variants.append((_ws_name(cfg), lambda cfg=cfg: _grouped_ws(qa, sa, qw, sw, offs, cfg)))
            for vname, fn in variants:
                rel = float((fn().float() - ref).norm() / ref.norm())
                if not rel < 5e-3:
                    emit(shape=name, routing=routing, variant=vname, rel=rel, status="FAIL")
                    continue
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                emit(shape=name, routing=routing, variant=vname, rel=rel, ms=ms, tflops=flops / ms / 1e9)
    return 0


if __name__ == "__main__":
    sys.exit(main())
