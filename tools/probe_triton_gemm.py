"""GPU probe for the TRITON gemm / gemm_fp8 backend: correctness grid, then timings.

Run on a CUDA GPU from the repo root (installed editable, or PYTHONPATH=.):
    PYTHONUNBUFFERED=1 python3 tools/probe_triton_gemm.py [--out DIR] [--skip-check] [--skip-time]

1. Checks (PASS/FAIL lines): the Triton quantiser is bit-identical to
   turbo_dispatch.low_precision.quantize (data and scales) on odd shapes, transposed views and
   every granularity; bf16/fp16/fp32 gemm over every layout, odd sizes, TMA and pointer paths and
   every config of configs(); fp8 gemm forward plus the exact dgrad/wgrad problems of the op's
   backward (ops.gemm._fp8_grads) for every granularity, SNR vs the float64 product of the
   high-precision inputs (>= 25 dB e4m3, >= 20 dB with e5m2).
2. Timings (triton.testing.do_bench, median, L2 cleared between reps) in TFLOPS on the issue's
   shapes: torch.matmul vs each Triton config (bf16); torch._scaled_mm / F.scaled_mm blockwise vs
   each Triton fp8 config on pre-quantised operands; the quantiser's bandwidth; end-to-end adapters.
A CSV of every timing goes to DIR/triton_gemm_times.csv.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import sys
import time

import torch


from turbo_dispatch.backends.triton import configs as C  # noqa: E402
from turbo_dispatch.backends.triton import fp8_gemm_kernels as FK  # noqa: E402
from turbo_dispatch.backends.triton import gemm_kernels as GK  # noqa: E402
from turbo_dispatch.backends.triton.gemm import TritonGemm, TritonGemmFp8  # noqa: E402
from turbo_dispatch.backends.triton.quantize import (quantize_fp8, quantize_fp8_with_transpose,  # noqa: E402
                                                     quantize_kmajor)
from turbo_dispatch.backends.torch.gemm import TorchGemmFp8  # noqa: E402
from turbo_dispatch.low_precision import ScalingGranularity as G, quantize  # noqa: E402
from turbo_dispatch.ops.gemm import _fp8_grads, gemm_fp8_problem, gemm_problem  # noqa: E402

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
RESULTS = {"pass": 0, "fail": 0}


def report(ok: bool, what: str) -> None:
    RESULTS["pass" if ok else "fail"] += 1
    if not ok or os.environ.get("PROBE_VERBOSE"):
        print(("PASS " if ok else "FAIL ") + what, flush=True)


def snr(out, ref) -> float:
    noise = (out.double() - ref).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


def rel(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


# -- checks --------------------------------------------------------------------------------------
def check_quantize() -> None:
    grans = [(G.TENSORWISE, None, False), (G.ROWWISE, None, False), (G.BLOCKWISE, 128, False),
             (G.BLOCKWISE, 100, False), (G.BLOCKWISE, 128, True), (G.BLOCKWISE, 64, True)]
    # Each (mode, dtype, block) combination is a separate Triton compile: keep the grid small.
    for shape, xdt in [((1000, 3000), torch.bfloat16), ((129, 9001), torch.float32)]:
        x = torch.randn(shape, device="cuda") * 5
        x[3] = 0  # an all-zero row: scale 1
        x[5, :7] = 1e-30  # tiny values: clamp_min path
        x = x.to(xdt)
        for view, fdt, axis, (g, bs, b2) in itertools.product([False, True], [E4, E5], [0, 1], grans):
            if xdt == torch.float32 and (fdt == E5 or view):
                continue
            xv = x.t() if view else x
            r = quantize(xv, fdt, g, axis=axis, block_size=bs, block_2d=b2)
            q = quantize_fp8(xv, fdt, g, axis=axis, block_size=bs, block_2d=b2)
            q1, qt = quantize_fp8_with_transpose(xv, fdt, g, axis=axis, block_size=bs, block_2d=b2)
            ok = (torch.equal(q.data.view(torch.uint8), r.data.view(torch.uint8)) and torch.equal(q.scale, r.scale)
                  and torch.equal(q1.data.view(torch.uint8), r.data.view(torch.uint8))
                  and torch.equal(qt.data.view(torch.uint8), r.data.t().contiguous().view(torch.uint8)))
            if not ok:
                d = (q.data.float() - r.data.float()).abs()
                print(f"   data mismatches {(q.data.view(torch.uint8) != r.data.view(torch.uint8)).sum().item()} "
                      f"max|d| {d.max().item()} scale max|d| {(q.scale - r.scale).abs().max().item()}")
            report(ok, f"quantize bit-exact {shape} {xdt} view_t={view} {fdt} axis={axis} {g.name} bs={bs} 2d={b2}")
    # NaN in one row: that row's scale (and only it) NaN, as in the reference.
    x = torch.randn(64, 300, device="cuda")
    x[7, 11] = float("nan")
    for g in (G.ROWWISE, G.TENSORWISE):
        q = quantize_fp8(x, E4, g, axis=1)
        r = quantize(x, E4, g, axis=1)
        report(torch.equal(torch.isnan(q.scale), torch.isnan(r.scale)), f"quantize NaN propagation {g.name}")


def check_gemm() -> None:
    ad = TritonGemm()
    shapes = [(1, 33, 127), (257, 129, 1001), (512, 384, 1024), (1000, 999, 1000)]
    for (m, n, k), dt, (ta, tb) in itertools.product(shapes, [torch.bfloat16, torch.float16, torch.float32],
                                                     itertools.product([False, True], [False, True])):
        a = torch.randn((k, m) if ta else (m, k), device="cuda", dtype=dt)
        b = torch.randn((n, k) if tb else (k, n), device="cuda", dtype=dt)
        ref = (a.t() if ta else a).double() @ (b.t() if tb else b).double()
        for od in {dt, torch.float32}:
            p = gemm_problem(a, b, ta, tb, od)
            for tma in (None, False):
                out = GK.gemm(a, b, ta, tb, od, C.from_tuple(ad.configs(p)[0]), use_tma=tma)
                tol = 2e-2 if od == torch.bfloat16 else 5e-3
                e = rel(out, ref)
                report(e <= tol and out.isfinite().all().item(),
                       f"gemm {m}x{n}x{k} {dt} ta={ta} tb={tb} out={od} tma={tma} rel={e:.2e}")
    # every config of configs() on one odd and one large shape
    for m, n, k in [(300, 520, 264), (2048, 2048, 1024)]:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        ref = a.double() @ b.double()
        p = gemm_problem(a, b, False, False, None)
        for cfg in ad.configs(p):
            e = rel(ad.run(p, a, b, config=cfg), ref)
            report(e <= 2e-2, f"gemm config {cfg} {m}x{n}x{k} rel={e:.2e}")


def check_fp8() -> None:
    ad = TritonGemmFp8()
    torch_ad = TorchGemmFp8()
    recipes = [(G.TENSORWISE, None), (G.ROWWISE, None), (G.BLOCKWISE, 128), (G.BLOCKWISE, 64)]
    shapes = [(1, 33, 127), (257, 384, 1000), (128, 256, 256), (512, 768, 1536)]
    for (m, n, k), (g, bs), (ta, tb), fmt in itertools.product(shapes, recipes, itertools.product([False, True], [False, True]),
                                                               ["e4m3", "hybrid"]):
        fwd, bwd = E4, (E5 if fmt == "hybrid" else E4)
        a = torch.randn((k, m) if ta else (m, k), device="cuda", dtype=torch.bfloat16)
        b = torch.randn((n, k) if tb else (k, n), device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w2d = g is G.BLOCKWISE
        calls = []

        def mm8(x, y, xta, ytb, od, xf, yf, x2d, y2d):
            p = gemm_fp8_problem(x, y, xta, ytb, od, xf, yf, g, bs, x2d, y2d)
            reason = ad.supports(p)
            if reason:
                raise AssertionError(reason)
            out = ad.run(p, x, y)
            ref = (x.t() if xta else x).double() @ (y.t() if ytb else y).double()
            calls.append((p, out, ref, torch_ad.run(p, x, y)))
            return out

        mm8(a, b, ta, tb, torch.bfloat16, fwd, fwd, False, w2d)
        _fp8_grads(mm8, a, b, grad, ta, tb, fwd, bwd, g, True, True)
        for role, (p, out, ref, tout) in zip(("fwd", "dgrad", "wgrad"), calls):
            gate = 20.0 if E5 in (p.a_fp8, p.b_fp8) else 25.0
            s = snr(out, ref)
            # Against TORCH's result on the same quantised values: only accumulation order differs.
            agree = rel(out, tout.double())
            ok = s >= gate and out.isfinite().all().item() and (agree < 1e-2)
            report(ok, f"fp8 {role} {p.m}x{p.n}x{p.k} {g.name}{bs or ''} ta={p.trans_a} tb={p.trans_b} "
                       f"{fmt} a2d={p.a_2d} b2d={p.b_2d} snr={s:.1f}dB vs_torch={agree:.1e}")
    for (g, bs), od in itertools.product(recipes, [torch.bfloat16, torch.float16, torch.float32]):
        a = torch.randn(300, 520, device="cuda")
        b = torch.randn(264, 520, device="cuda")
        p = gemm_fp8_problem(a, b, False, True, od, E4, E4, g, bs, False, g is G.BLOCKWISE)
        ref = a.double() @ b.double().t()
        for cfg in ad.configs(p):
            s = snr(ad.run(p, a, b, config=cfg), ref)
            report(s >= 25, f"fp8 config {cfg} {g.name}{bs or ''} out={od} snr={s:.1f}dB")


# -- timings -------------------------------------------------------------------------------------
def bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def time_all(out_dir: str, budget_s: float) -> None:
    t_end = time.time() + budget_s
    rows = []
    shapes = [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 7168, 16384), (16384, 4096, 14336)]

    def rec(kind, shape, variant, ms):
        m, n, k = shape
        tf = 2 * m * n * k / ms / 1e9
        rows.append(dict(kind=kind, m=m, n=n, k=k, variant=variant, ms=round(ms, 4), tflops=round(tf, 1)))
        print(f"{kind:10s} {m}x{n}x{k} {variant:42s} {ms:8.3f} ms {tf:7.1f} TFLOPS", flush=True)

    fsm = _f_scaled_mm()
    for shape in shapes:
        if time.time() > t_end:
            print("time budget reached; stopping timings")
            break
        m, n, k = shape
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)  # weight [N, K]: the NT layout
        # bf16
        rec("bf16", shape, "torch.matmul NT", bench(lambda: a @ w.t()))
        p = gemm_problem(a, w, False, True, None)
        for cfg in TritonGemm().configs(p):
            cfgt = C.from_tuple(cfg)
            rec("bf16", shape, f"triton NT {cfg}", bench(lambda: GK.gemm(a, w, False, True, torch.bfloat16, cfgt)))
        # fp8 on pre-quantised operands
        qa_t, sa_t = quantize_kmajor(a, E4, G.TENSORWISE, None, False)
        qb_t, sb_t = quantize_kmajor(w, E4, G.TENSORWISE, None, False)
        rec("fp8-tw", shape, "torch._scaled_mm", bench(lambda: torch._scaled_mm(qa_t, qb_t.t(), sa_t, sb_t, out_dtype=torch.bfloat16)))
        qa_r, sa_r = quantize_kmajor(a, E4, G.ROWWISE, None, False)
        qb_r, sb_r = quantize_kmajor(w, E4, G.ROWWISE, None, False)
        rec("fp8-row", shape, "torch._scaled_mm", bench(lambda: torch._scaled_mm(qa_r, qb_r.t(), sa_r, sb_r.reshape(1, -1), out_dtype=torch.bfloat16)))
        qa_b, sa_b = quantize_kmajor(a, E4, G.BLOCKWISE, 128, False)
        qb_b, sb_b = quantize_kmajor(w, E4, G.BLOCKWISE, 128, True)
        if fsm is not None:
            scaled_mm, ST = fsm
            pad = (-sb_b.shape[1]) % 4
            sbp = torch.nn.functional.pad(sb_b, (0, pad)).contiguous().t()
            try:
                rec("fp8-block", shape, "F.scaled_mm 1x128/128x128",
                    bench(lambda: scaled_mm(qa_b, qb_b.t(), sa_b, ST.BlockWise1x128, sbp, ST.BlockWise128x128,
                                            output_dtype=torch.bfloat16)))
            except Exception as e:  # noqa: BLE001
                print("F.scaled_mm blockwise failed:", str(e)[:200])
        p8 = gemm_fp8_problem(a, w, False, True, torch.bfloat16, E4, E4, G.BLOCKWISE, 128, False, True)
        cands = list(TritonGemmFp8().configs(p8)) + [(128, 128, 128, 8, 5, 8), (128, 256, 128, 8, 4, 8),
                                                      (256, 128, 128, 8, 4, 8), (64, 128, 128, 8, 5, 4)]
        for cfg in dict.fromkeys(cands):
            cfgt = C.from_tuple(cfg)
            for mode, (qa, sa, qb, sb, ag, bg), name in [
                (FK.SCALE_BLOCK, (qa_b, sa_b, qb_b, sb_b, 1, 128), "fp8-block"),
                (FK.SCALE_TENSOR, (qa_t, sa_t, qb_t, sb_t, 1, 1), "fp8-tw"),
                (FK.SCALE_ROW, (qa_r, sa_r.reshape(-1), qb_r, sb_r.reshape(-1), 1, 1), "fp8-row"),
            ]:
                try:
                    ms = bench(lambda: FK.fp8_gemm(qa, qb, sa, sb, mode, torch.bfloat16, cfgt, ag, bg))
                    rec(name, shape, f"triton {cfg}", ms)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a config
                    print(f"{name} {cfg} failed: {str(e)[:160]}")
        # quantiser bandwidth and end-to-end adapters (quantise + GEMM)
        ms = bench(lambda: quantize_kmajor(a, E4, G.BLOCKWISE, 128, False))
        print(f"quantize   {m}x{k} 1x128 triton {ms:.3f} ms = {(a.numel() * 3) / ms / 1e9:.0f} GB/s", flush=True)
        ms = bench(lambda: quantize(a, E4, G.BLOCKWISE, axis=1, block_size=128))
        print(f"quantize   {m}x{k} 1x128 torch  {ms:.3f} ms", flush=True)
        at = a.t().contiguous()
        ms = bench(lambda: quantize_kmajor(at.t(), E4, G.BLOCKWISE, 128, False))
        print(f"quantize   {m}x{k} 1x128 triton transposing {ms:.3f} ms = {(a.numel() * 3) / ms / 1e9:.0f} GB/s", flush=True)
        rec("e2e-block", shape, "TORCH adapter", bench(lambda: TorchGemmFp8().run(p8, a, w)))
        rec("e2e-block", shape, "TRITON adapter default", bench(lambda: TritonGemmFp8().run(p8, a, w)))
        del a, w
        torch.cuda.empty_cache()
    path = os.path.join(out_dir, "triton_gemm_times.csv")
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=["kind", "m", "n", "k", "variant", "ms", "tflops"])
        wr.writeheader()
        wr.writerows(rows)
    print("\nbest per (kind, shape):")
    best = {}
    for r in rows:
        key = (r["kind"], r["m"], r["n"], r["k"])
        if r["variant"].startswith("triton") and (key not in best or r["tflops"] > best[key]["tflops"]):
            best[key] = r
    for key, r in best.items():
        peers = [x["tflops"] for x in rows if (x["kind"], x["m"], x["n"], x["k"]) == key and not x["variant"].startswith("triton")]
        print(f"  {key}: triton {r['tflops']} ({r['variant']}) vs peer {max(peers) if peers else '-'}")


def _f_scaled_mm():
    try:
        from torch.nn.functional import ScalingType, scaled_mm
    except ImportError:
        return None
    return scaled_mm, ScalingType


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--time-budget", type=float, default=240.0)
    args = ap.parse_args()
    import triton

    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    torch.manual_seed(0)
    if not args.skip_check:
        for fn in (check_quantize, check_gemm, check_fp8):
            t0 = time.time()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - report and go on to the next group
                import traceback

                traceback.print_exc()
                report(False, f"{fn.__name__} raised {type(e).__name__}: {str(e)[:300]}")
            print(f"{fn.__name__}: {time.time() - t0:.0f}s, pass={RESULTS['pass']} fail={RESULTS['fail']}", flush=True)
    if not args.skip_time:
        time_all(args.out, args.time_budget)
    print(f"CHECKS pass={RESULTS['pass']} fail={RESULTS['fail']}")
    return 1 if RESULTS["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
