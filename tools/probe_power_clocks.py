"""Probe: the SM clock and board power each GEMM of the grouped step runs at, bf16 against fp8.

Runs each kernel back to back for ``--seconds`` while ``nvidia-smi`` samples power draw, SM clock
and the active clock-event (throttle) reasons every 50 ms, and reports the rate over the same
launches. Why: under ncu our blockwise forward and cuBLAS's blockwise kernel both ran at
~1.47 GHz (round 125), well under the 1.98 GHz maximum; if fp8 GEMMs run at a lower clock than
bf16 ones, the step's fp8 / bf16 ratio is capped below the 2x the tensor cores give per clock.

Kernels, DeepSeek-V3 up_gate at EP8 (32 experts x 4096 tokens: M 131072, N 4096, K 7168), random
operands: bf16 ``torch._grouped_mm`` forward; our Gluon WS grouped forward and wgrad (the step's
kernels, default configs); and dense 32768 x 4096 x 7168 bf16 ``torch.mm``, fp8 tensorwise
``torch._scaled_mm`` and cuBLAS blockwise ``F.scaled_mm``.

    cd tools && python3 probe_power_clocks.py --out $OUT/power.jsonl
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from probe_record import Jsonl, Smi  # noqa: E402

QUERY = "power.draw,clocks.sm,clocks_event_reasons.active,temperature.gpu"


def sample_while(fn, seconds: float) -> tuple[float, int, Smi]:
    """Run ``fn`` back to back for about ``seconds``; return (ms per call, calls, the samples)."""
    fn()
    torch.cuda.synchronize()
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with Smi(QUERY) as smi:
        time.sleep(0.2)
        calls, t0 = 0, time.perf_counter()
        start_ev.record()
        while time.perf_counter() - t0 < seconds:
            for _ in range(10):
                fn()
            calls += 10
            torch.cuda.synchronize()  # keeps the host from queueing far past the sampling window
        end_ev.record()
        end_ev.synchronize()
    return start_ev.elapsed_time(end_ev) / calls, calls, smi


def kernels():
    from backends.triton.configs import KERNEL_GLUON_WS
    from backends.triton.fp8_blockwise_gluon_ws import fp8_blockwise_grouped_gemm
    from backends.triton.fp8_blockwise_wgrad_ws import fp8_blockwise_wgrad
    from backends.triton.grouped_gemm import WGRAD_WS_CONFIGS, WS_CONFIGS
    g = torch.Generator(device="cuda").manual_seed(0)
    G, T, N, K = 32, 32 * 4096, 4096, 7168
    offs = torch.arange(0, T + 1, T // G, device="cuda", dtype=torch.int32)
    out = {}

    x16 = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w16 = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16, generator=g)
    ends = offs[1:].contiguous()
    out["bf16 torch._grouped_mm fwd (grouped)"] = (
        lambda: torch._grouped_mm(x16, w16.transpose(1, 2), offs=ends), 2.0 * T * N * K)

    x8 = x16.to(torch.float8_e4m3fn)
    w8 = w16.to(torch.float8_e4m3fn)
    sx = torch.rand(K // 128, T, device="cuda", generator=g).t() + 0.5  # [T, K/128], rows contiguous
    sw = torch.rand(G, N // 128, K // 128, device="cuda", generator=g) + 0.5
    y = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
    fwd_cfg = WS_CONFIGS[0]
    assert fwd_cfg[-1] == KERNEL_GLUON_WS
    out["fp8 Gluon WS grouped fwd"] = (
        lambda: fp8_blockwise_grouped_gemm(x8, w8, y, offs, sx, sx.stride(), sw, sw.stride(), fwd_cfg),
        2.0 * T * N * K)

    # The wgrad's operands as the dual quantiser leaves them: token-contiguous runs.
    xt = torch.randn(K, T, device="cuda", generator=g).to(torch.float8_e4m3fn)
    gt = torch.randn(N, T, device="cuda", generator=g).to(torch.float8_e4m3fn)
    s_x = torch.rand(T // 128, K, device="cuda", generator=g) + 0.5
    s_g = torch.rand(T // 128, N, device="cuda", generator=g) + 0.5
    dw = torch.empty(G, K, N, device="cuda", dtype=torch.bfloat16)
    out["fp8 Gluon WS grouped wgrad"] = (
        lambda: fp8_blockwise_wgrad(xt.t(), gt.t(), dw, offs, s_x, s_x.stride(), s_g, s_g.stride(),
                                    WGRAD_WS_CONFIGS[0]), 2.0 * T * N * K)

    M = 32768
    a16, b16 = x16[:M], torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g)
    out["bf16 torch.mm (dense)"] = (lambda: torch.mm(a16, b16.t()), 2.0 * M * N * K)
    a8, b8 = a16.to(torch.float8_e4m3fn), b16.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    out["fp8 tensorwise torch._scaled_mm (dense)"] = (
        lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16), 2.0 * M * N * K)
    try:
        from torch.nn.functional import ScalingType, scaled_mm
        sa = torch.rand(K // 128, M, device="cuda", generator=g).t() + 0.5
        sb = torch.rand(N // 128, K // 128, device="cuda", generator=g) + 0.5
        pad = torch.nn.functional.pad(sb, (0, (-sb.shape[1]) % 4)).contiguous().t()
        out["fp8 blockwise cuBLAS F.scaled_mm (dense)"] = (
            lambda: scaled_mm(a8, b8.t(), sa, ScalingType.BlockWise1x128, pad, ScalingType.BlockWise128x128,
                              output_dtype=torch.bfloat16), 2.0 * M * N * K)
    except ImportError:
        pass
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    emit = Jsonl(args.out, gpu=torch.cuda.get_device_name())
    for name, (fn, flops) in kernels().items():
        ms, calls, smi = sample_while(fn, args.seconds)
        clocks = smi.values(1)
        emit({"probe": "power", "kernel": name, "ms": ms, "calls": calls, "tflops": flops / ms / 1e9,
              "samples": len(smi.rows), "power_w_median": smi.median(0), "sm_mhz_median": smi.median(1),
              "sm_mhz_min": min(clocks) if clocks else None, "reasons": sorted({r[2] for r in smi.rows}),
              "temp_c_max": max(smi.values(3), default=None)})
        time.sleep(1.0)  # let the board cool a little between kernels
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
