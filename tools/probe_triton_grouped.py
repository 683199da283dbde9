"""GPU probe of the TRITON grouped GEMMs: correctness and TFLOPS vs torch._grouped_mm /
torch._scaled_grouped_mm on DeepSeek-V3 and Mixtral expert shapes with balanced, skewed and
empty-expert routings. Usage (repo installed): ``python3 tools/probe_triton_grouped.py [--quick]``.
Prints one line per measurement; ``--out FILE`` also writes them as JSON lines.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import torch
import triton
import triton.testing

from turbo_dispatch.backends.torch.grouped_gemm import TorchGroupedGemm, TorchGroupedGemmFp8
from turbo_dispatch.backends.triton import grouped_gemm as tgg
from turbo_dispatch.low_precision import ScalingGranularity as SG
from turbo_dispatch.ops.grouped_gemm import grouped_gemm_fp8_problem, grouped_gemm_problem, variable_k_problem

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
ROWS: list[dict] = []


def emit(**kw):
    ROWS.append(kw)
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()), flush=True)


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def routing(kind: str, total: int, g: int) -> list[int]:
    if kind == "balanced":
        lens = [total // g] * g
    elif kind == "skewed":
        w = [0.5 ** i for i in range(g)]
        lens = [int(total * x / sum(w)) for x in w]
    elif kind == "empty":  # two experts get nothing
        lens = [total // (g - 2)] * (g - 2) + [0, 0]
    else:
        raise ValueError(kind)
    lens[0] += total - sum(lens)
    return lens


def lens_offs(lens):
    t = torch.tensor(lens, dtype=torch.int64, device="cuda")
    return t, torch.nn.functional.pad(torch.cumsum(t, 0), (1, 0))


def rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def snr(out, ref):
    err = (out.double() - ref.double()).norm() ** 2
    return (10 * torch.log10(ref.double().norm() ** 2 / err)).item()


SHAPES = {  # name: (G, tokens, N, K) of the forward GEMM
    "dsv3_up": (8, 32768, 4096, 7168),
    "dsv3_down": (8, 32768, 7168, 2048),
    "mixtral_up": (8, 16384, 28672, 4096),
    "mixtral_down": (8, 16384, 4096, 14336),
}


def probe_bf16(shape, kind, sweep):
    g, t, n, k = SHAPES[shape]
    lens, offs = lens_offs(routing(kind, t, g))
    a = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    grad = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    tri, tor = tgg.TritonGroupedGemm(), TorchGroupedGemm()
    cases = {
        "fwd": (grouped_gemm_problem(a, w, lens, offs, True), a, w),
        "dgrad": (grouped_gemm_problem(grad, w, lens, offs, False), grad, w),
        "wgrad": (variable_k_problem(grad, a, lens, offs), grad, a),
    }
    for name, (p, x, y) in cases.items():
        flops = 2.0 * t * n * k
        ref = tor.run(p, x, y, lens, offs)
        t_ref = bench(lambda: tor.run(p, x, y, lens, offs))
        emit(dtype="bf16", shape=shape, routing=kind, gemm=name, impl="torch._grouped_mm", ms=t_ref,
             tflops=flops / t_ref * 1e-9)
        for cfg in (tri.configs(p) if sweep else [None]):
            try:
                out = tri.run(p, x, y, lens, offs, config=cfg)
                err = rel(out, ref)
                tm = bench(lambda: tri.run(p, x, y, lens, offs, config=cfg))
                emit(dtype="bf16", shape=shape, routing=kind, gemm=name, impl=f"triton{cfg or ''}", ms=tm,
                     tflops=flops / tm * 1e-9, speedup=t_ref / tm, rel_vs_torch=f"{err:.2e}",
                     ok=err < 2e-2)
            except Exception as exc:  # noqa: BLE001 - report and go on
                emit(dtype="bf16", shape=shape, routing=kind, gemm=name, impl=f"triton{cfg}", error=repr(exc)[:300])


def probe_fp8(shape, kind, gran, sweep, gemms=("fwd",)):
    g, t, n, k = SHAPES[shape]
    lens, offs = lens_offs(routing(kind, t, g))
    a = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    grad = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    bs = 128 if gran is SG.BLOCKWISE else None
    b2d = gran is SG.BLOCKWISE
    tri, tor = tgg.TritonGroupedGemmFp8(), TorchGroupedGemmFp8()
    flops = 2.0 * t * n * k
    for gemm in gemms:
        if gemm == "fwd":
            p = grouped_gemm_fp8_problem(a, w, lens, offs, True, False, torch.bfloat16, E4, E4, gran, bs, b2d)
            x, y = a, w
        elif gemm == "dgrad_hybrid":
            p = grouped_gemm_fp8_problem(grad, w, lens, offs, False, False, torch.bfloat16, E5, E4, gran, bs, b2d)
            x, y = grad, w
        else:  # wgrad, e4m3
            p = grouped_gemm_fp8_problem(grad, a, lens, offs, False, True, torch.bfloat16, E4, E4, gran, bs, False)
            x, y = grad, a
        ref = tor.run(p, x, y, lens, offs)
        t_ref = bench(lambda: tor.run(p, x, y, lens, offs))
        emit(dtype="fp8", gran=gran.value, shape=shape, routing=kind, gemm=gemm, impl="TORCH adapter (quant+gemm)",
             ms=t_ref, tflops=flops / t_ref * 1e-9, path=tor.describe(p)[:60])
        for cfg in (tri.configs(p) if sweep else [None]):
            try:
                out = tri.run(p, x, y, lens, offs, config=cfg)
                s = snr(out, ref)
                tm = bench(lambda: tri.run(p, x, y, lens, offs, config=cfg))
                emit(dtype="fp8", gran=gran.value, shape=shape, routing=kind, gemm=gemm, impl=f"triton{cfg or ''}",
                     ms=tm, tflops=flops / tm * 1e-9, speedup=t_ref / tm, snr_vs_torch=s, ok=s > 30)
            except Exception as exc:  # noqa: BLE001
                emit(dtype="fp8", gran=gran.value, shape=shape, gemm=gemm, impl=f"triton{cfg}", error=repr(exc)[:300])
        if gemm == "fwd":
            probe_fp8_kernel_only(p, a, w, lens, offs, gran, shape, kind, flops)


def probe_fp8_kernel_only(p, a, w, lens, offs, gran, shape, kind, flops):
    """GEMM kernel alone on pre-quantised operands (Triton vs torch._scaled_grouped_mm)."""
    bs = p.block_size
    qa, sa = tgg._quant_rows(a.unsqueeze(0), E4, gran, bs)
    qb, sb = tgg._quant_rows(w, E4, gran, bs, tile_2d=p.b_2d)
    out = torch.empty(a.shape[0], w.shape[1], device="cuda", dtype=torch.bfloat16)
    mode = tgg._SCALE_MODE[gran]
    sas, sbs = ((0, 0), (0, 0, 0)) if mode == 1 else ((sa.stride(1), sa.stride(2)), sb.stride())
    for cfg in tgg._fp8_configs(p)[:3]:
        try:
            fn = lambda: tgg.launch_fixed_k(qa[0], qb, out, offs, cfg, scale=mode, sa=sa, sa_strides=sas, sb=sb,  # noqa: E731
                                           sb_strides=sbs, qblock=bs or 128, sb_ndiv=bs if p.b_2d else 1)
            tm = bench(fn)
            emit(dtype="fp8", gran=gran.value, shape=shape, routing=kind, gemm="fwd", impl=f"triton-kernel-only{cfg}",
                 ms=tm, tflops=flops / tm * 1e-9)
        except Exception as exc:  # noqa: BLE001
            emit(dtype="fp8", gran=gran.value, shape=shape, impl=f"triton-kernel-only{cfg}", error=repr(exc)[:300])
    t_q = bench(lambda: (tgg._quant_rows(a.unsqueeze(0), E4, gran, bs),
                         tgg._quant_rows(w, E4, gran, bs, tile_2d=p.b_2d)))
    emit(dtype="fp8", gran=gran.value, shape=shape, impl="triton-quantize(a+w)", ms=t_q)
    if gran in (SG.ROWWISE, SG.TENSORWISE) and hasattr(torch, "_scaled_grouped_mm"):
        from turbo_dispatch.low_precision import quantize

        qa2 = quantize(a, E4, gran, axis=1)
        qb2 = quantize(w, E4, gran, axis=2)
        m = a.shape[0]
        s_a = qa2.scale.reshape(m) if gran is SG.ROWWISE else qa2.scale.reshape(1).expand(m).contiguous()
        s_b = qb2.scale.reshape(w.shape[0], w.shape[1]) if gran is SG.ROWWISE else \
            qb2.scale.reshape(1, 1).expand(w.shape[0], w.shape[1]).contiguous()
        ends = offs[1:].to(torch.int32)
        try:
            fn = lambda: torch._scaled_grouped_mm(qa2.data, qb2.data.transpose(1, 2), s_a, s_b, offs=ends,  # noqa: E731
                                                  out_dtype=torch.bfloat16)
            tm = bench(fn)
            emit(dtype="fp8", gran=gran.value, shape=shape, routing=kind, gemm="fwd",
                 impl="torch._scaled_grouped_mm-kernel-only", ms=tm, tflops=flops / tm * 1e-9)
            t_q2 = bench(lambda: (quantize(a, E4, gran, axis=1), quantize(w, E4, gran, axis=2)))
            emit(dtype="fp8", gran=gran.value, shape=shape, impl="torch-quantize(a+w)", ms=t_q2)
        except Exception as exc:  # noqa: BLE001
            emit(impl="torch._scaled_grouped_mm", error=repr(exc)[:300])


def probe_mixed_mma():
    """Does tl.dot take e5m2 x e4m3 directly on this Triton? (else the fp16 route is used)"""
    g, t, n, k = 8, 8192, 2048, 2048
    lens, offs = lens_offs(routing("balanced", t, g))
    grad = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
    for gran in (SG.ROWWISE, SG.BLOCKWISE):
        bs = 128 if gran is SG.BLOCKWISE else None
        p = grouped_gemm_fp8_problem(grad, w, lens, offs, False, False, torch.bfloat16, E5, E4, gran, bs,
                                     gran is SG.BLOCKWISE)
        ref = TorchGroupedGemmFp8().run(p, grad, w, lens, offs)
        for direct in (False, True):
            tgg._MIXED_FP8_MMA = direct
            try:
                out = tgg.TritonGroupedGemmFp8().run(p, grad, w, lens, offs)
                tm = bench(lambda: tgg.TritonGroupedGemmFp8().run(p, grad, w, lens, offs))
                emit(probe="mixed_fp8_mma", gran=gran.value, direct=direct, snr_vs_torch=snr(out, ref), ms=tm,
                     tflops=2.0 * t * n * k / tm * 1e-9)
            except Exception as exc:  # noqa: BLE001
                emit(probe="mixed_fp8_mma", gran=gran.value, direct=direct, error=repr(exc)[:300])
        tgg._MIXED_FP8_MMA = False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--focus", action="store_true")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds; later sections are skipped past it")
    args = ap.parse_args()
    t0 = time.time()
    emit(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    steps = [
        lambda: probe_bf16("dsv3_up", "balanced", sweep=True),
        lambda: probe_fp8("dsv3_up", "balanced", SG.BLOCKWISE, sweep=True, gemms=("fwd", "wgrad")),
        lambda: probe_fp8("dsv3_up", "balanced", SG.ROWWISE, sweep=True),
        lambda: probe_mixed_mma(),
        lambda: probe_fp8("dsv3_down", "balanced", SG.BLOCKWISE, sweep=False, gemms=("fwd", "dgrad_hybrid", "wgrad")),
        lambda: probe_fp8("dsv3_down", "balanced", SG.ROWWISE, sweep=False),
    ]
    for shape in ("dsv3_down", "mixtral_up", "mixtral_down"):
        steps.append(lambda shape=shape: probe_bf16(shape, "balanced", sweep=False))
    for kind in ("skewed", "empty"):
        steps.append(lambda kind=kind: probe_bf16("dsv3_up", kind, sweep=False))
        steps.append(lambda kind=kind: probe_fp8("dsv3_up", kind, SG.BLOCKWISE, sweep=False))
    for shape in ("mixtral_up", "mixtral_down"):
        steps.append(lambda shape=shape: probe_fp8(shape, "balanced", SG.BLOCKWISE, sweep=False))
    if args.quick:
        steps = steps[:1]
    if args.focus:  # the second-round set: wgrad, blockwise fp8 and the default picks end to end
        steps = [
            lambda: probe_fp8("dsv3_up", "balanced", SG.BLOCKWISE, sweep=True, gemms=("fwd", "wgrad")),
            lambda: probe_bf16("dsv3_up", "balanced", sweep=True),
            lambda: probe_fp8("dsv3_down", "balanced", SG.BLOCKWISE, sweep=False, gemms=("fwd", "dgrad_hybrid",
                                                                                        "wgrad")),
            lambda: probe_fp8("dsv3_up", "skewed", SG.ROWWISE, sweep=False, gemms=("fwd", "wgrad")),
            lambda: probe_bf16("mixtral_up", "skewed", sweep=False),
        ]
    for step in steps:
        if time.time() - t0 > args.budget:
            emit(skipped="budget")
            break
        try:
            step()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            for r in ROWS:
                f.write(json.dumps(r, default=str) + "\n")


if __name__ == "__main__":
    main()
