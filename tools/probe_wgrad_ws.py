"""Time the warp-specialised blockwise fp8 wgrad kernel against the Triton variable-K kernel.

Kernel only, operands quantised once as the training step quantises them (128-token runs,
token-contiguous fp8, the dual quantiser's layout). For each shape and routing: the Triton
kernel's default config first (its output is the reference the others are compared with,
relative Frobenius error, which must stay under 1e-3 before a time counts), then every
warp-specialised config with the scales copied into shared memory, the default with them read
from global memory, and the 256-row tile. A routing name ending in ``_aligned`` rounds every group to
a multiple of 128 tokens, so that no step is an edge step. One JSON line per row in ``--out``.

Routings ``bench_skewed`` and ``bench_empty`` are the bench's own
(``benchmarks/bench_grouped_gemm.group_lens``: Zipf-like, and a quarter of the experts empty, seeded).

Usage (on an sm_90 GPU): ``python tools/probe_wgrad_ws.py --out wgrad.jsonl [--shapes dsv3_w13,dsv3_w2]``.
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

from turbo_dispatch.backends.quantizer import quantize_runs_both
from turbo_dispatch.backends.triton import fp8_blockwise_wgrad_ws as GWW
from turbo_dispatch.backends.triton import grouped_gemm as GG

from probe_triton_grouped import (OUT_FILE, WGRAD_SHAPES, bench_routing, emit, lens_offs, rel,  # sibling in tools/
                                  routing)

E4 = torch.float8_e4m3fn
ONLY_DEFAULT = False
SHAPES = dict(WGRAD_SHAPES, qwen3_w13=(16, 65536, 1536, 2048), qwen3_w2=(16, 65536, 2048, 768),
              dsv3_w13_ep8=(32, 131072, 4096, 7168), gptoss_w13=(4, 16384, 5760, 2880),
              gptoss_w2=(4, 16384, 2880, 2880))


def operand(t: torch.Tensor):
    """The wgrad operand the step saves: ([T, cols] token-contiguous fp8, scale, (run, column) strides)."""
    _, runs_t = quantize_runs_both(t, E4, 128)
    return runs_t.data, runs_t.scale, (runs_t.scale.stride(0), runs_t.scale.stride(1))


def probe(shape: str, kind: str) -> None:
    g, tokens, m, n = SHAPES[shape]
    base = kind.removesuffix("_aligned")
    if base.startswith("bench_"):
        lens = bench_routing(base[len("bench_"):], tokens, g)
    else:
        lens = routing(base, tokens, g)
    if base != kind:  # the same routing with every group a multiple of 128 tokens: no edge steps
        lens = [n_ // 128 * 128 for n_ in lens]
        lens[0] += tokens - sum(lens)
    _, offs = lens_offs(lens)
    offs = offs.to(torch.int32)
    flops = 2.0 * tokens * m * n
    qx, sx, sxs = operand(torch.randn(tokens, m, device="cuda", dtype=torch.bfloat16))
    qy, sy, sys_ = operand(torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16))
    tag = dict(shape=shape, routing=kind, g=g, tokens=tokens, m=m, n=n)
    triton_cfg = (64, 128, 128, 8, 4, 4, 1)  # the Triton kernel's measured best (configs.py notes)
    out = torch.empty((g, m, n), device="cuda", dtype=torch.bfloat16)

    def run_triton():
        return GG.launch_variable_k(qx, qy, out, offs, triton_cfg, scale=3, sx=sx, sx_strides=sxs, sy=sy,
                                    sy_strides=sys_, qblock=128)

    ref = run_triton().float().clone()
    ms = triton.testing.do_bench(run_triton, warmup=10, rep=100, return_mode="median")
    emit(**tag, impl=f"triton{triton_cfg}", ms=ms, tflops=flops / ms * 1e-9)
    base = ms
    first = GG.WGRAD_WS_CONFIGS[0][:6]
    variants = [(cfg[:6], True) for cfg in GG.WGRAD_WS_CONFIGS] + [(first, False)]
    variants.append(((256, 128, 128, 8, 3, 8), True))  # not offered (spills); timed to see what it costs
    if ONLY_DEFAULT:
        variants = variants[:1]
    for cfg, smem in variants:
        ws = torch.full((g, m, n), float("nan"), device="cuda", dtype=torch.bfloat16)

        def run_ws():
            GWW.SCALES_IN_SMEM = smem
            return GWW.fp8_blockwise_wgrad(qx, qy, ws, offs, sx, sxs, sy, sys_, cfg)

        try:
            err = rel(run_ws(), ref)
            if not err < 1e-3:
                emit(**tag, impl=f"ws{cfg}", scales_smem=smem, rel=f"{err:.2e}", ok=False)
                continue
            ms = triton.testing.do_bench(run_ws, warmup=10, rep=100, return_mode="median")
            emit(**tag, impl=f"ws{cfg}", scales_smem=smem, ms=ms, tflops=flops / ms * 1e-9, vs_triton=base / ms,
                 rel=f"{err:.2e}", ok=True)
        except Exception as exc:  # noqa: BLE001 - report and go on
            emit(**tag, impl=f"ws{cfg}", scales_smem=smem, error=repr(exc)[:300], ok=False)
    GWW.SCALES_IN_SMEM = True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="dsv3_w13,dsv3_w2,qwen3_w13,qwen3_w2")
    ap.add_argument("--routings", default="balanced,skewed,empty",
                    help="balanced, skewed, empty, or one of them + '_aligned' (groups rounded to 128 tokens)")
    ap.add_argument("--ws-only-default", action="store_true", help="time only the default WS config")
    args = ap.parse_args()
    global ONLY_DEFAULT
    ONLY_DEFAULT = args.ws_only_default
    if args.out:
        OUT_FILE.append(open(args.out, "w"))
    emit(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    for shape in args.shapes.split(","):
        for kind in args.routings.split(","):
            probe(shape, kind)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
