"""Time the warp-specialised Gluon blockwise kernel's knobs against cuBLASLt and the Triton kernel.

GEMM only, K-major fp8 operands quantised once (1 x 128 activation blocks, 128 x 128 weight
blocks). Per shape: ``F.scaled_mm`` (cuBLASLt) first as the reference output and peer, the
production Triton tile, then the warp-specialised kernel over pipeline depth and with/without
loading scales one K block ahead. Each variant's output is compared with cuBLASLt's (relative
Frobenius error) before it is timed. One JSON line per row in ``--out``.

Usage (on an sm_90 GPU): ``python tools/probe_gluon_ws.py --out ws.jsonl``.
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
from turbo_dispatch.backends.triton.quantize import quantize_fp8, quantize_kmajor
from turbo_dispatch.low_precision import ScalingGranularity as G
from turbo_dispatch.ops.gemm import gemm_fp8_problem

E4 = torch.float8_e4m3fn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="4096x7168x16384,4096x4096x7168,8192x14336x4096")
    ap.add_argument("--stages", default="4,5,6")
    args = ap.parse_args()
    out = open(args.out, "w") if args.out else None

    def emit(**kw):
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()), flush=True)
        if out:
            out.write(json.dumps(kw) + "\n")
            out.flush()

    emit(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        flops = 2.0 * m * n * k
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        p = gemm_fp8_problem(a, w, False, True, torch.bfloat16, E4, E4, G.BLOCKWISE, 128, False, True)
        qa_t = quantize_fp8(a, E4, G.BLOCKWISE, axis=1, block_size=128)
        qw_t = quantize_fp8(w, E4, G.BLOCKWISE, axis=1, block_size=128, block_2d=True)
        ref = _scaled(p, qa_t, qw_t).float()
        qa, sa = quantize_kmajor(a, E4, G.BLOCKWISE, 128, False)
        qb, sb = quantize_kmajor(w, E4, G.BLOCKWISE, 128, True)
        variants = [("F.scaled_mm(cublaslt)", lambda: _scaled(p, qa_t, qw_t)),
                    ("triton(128, 128, 128, 8, 4, 8)", lambda: FK.fp8_gemm(
                        qa, qb, sa, sb, FK.SCALE_BLOCK, torch.bfloat16, C.TileConfig(128, 128, 128, 8, 4, 8),
                        a_group=1, b_group=128))]
        for stages in (int(s) for s in args.stages.split(",")):
            for ahead in (True, False):
                cfg = C.TileConfig(128, 128, 128, 8, stages, 8, 1, C.KERNEL_GLUON_WS)
                variants.append((f"ws(s{stages}, scale_ahead={int(ahead)})",
                                 lambda cfg=cfg, ahead=ahead: GWS.fp8_blockwise_gemm(
                                     qa, qb, sa, sb, torch.bfloat16, cfg, a_group=1, b_group=128, scale_ahead=ahead)))
        for name, fn in variants:
            rel = float((fn().float() - ref).norm() / ref.norm())
            if not rel < 5e-3:
                emit(shape=shape, variant=name, rel=rel, status="FAIL")
                continue
            ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
            emit(shape=shape, variant=name, rel=rel, ms=ms, tflops=flops / ms / 1e9)
    return 0


if __name__ == "__main__":
    sys.exit(main())
