"""One timing line per op family: the turbo_dispatch call against plain torch doing the same
work, same process, same GPU, so we know the wrappers add nothing measurable at real sizes.

Not a tuning benchmark (the fast backends come later): both sides run PyTorch's own kernels.
Times are the median of ``triton.testing.do_bench`` (CUDA events) over fresh-allocation-free
calls; TFLOPS count 2*M*N*K per GEMM (fwd) and 4*B*H*Sq*Sk*D*(0.5 if causal) for attention fwd.

Usage: python benchmarks/bench_wrappers.py [--json PATH]      (needs a CUDA GPU)
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import turbo_dispatch as turbo
from turbo_dispatch.low_precision import Float8QuantConfig, ScalingGranularity


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def grouped_rows(results: list) -> None:
    g, tokens, k, n = 8, 4096, 4096, 2048
    a = torch.randn(g * tokens, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((g,), tokens, device="cuda", dtype=torch.int64)
    offs = torch.cumsum(lens, 0).to(torch.int32)
    flops = 2.0 * g * tokens * k * n
    turbo_ms = bench(lambda: turbo.ops.grouped_gemm(a, b, lens, trans_b=True))
    plain_ms = bench(lambda: torch._grouped_mm(a, b.transpose(-2, -1), offs=offs))
    results.append(("grouped_gemm bf16 fwd", "torch._grouped_mm", f"G={g} M={g * tokens} N={n} K={k}",
                    turbo_ms, plain_ms, flops))
    cfg = Float8QuantConfig(granularity=ScalingGranularity.ROWWISE)
    d = turbo.explain("grouped_gemm_fp8", a, b, lens, trans_b=True, config=cfg)
    group_offs = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0))  # as the op computes it
    direct = lambda: d.entry.adapter.run(d.problem, a, b, lens, group_offs, config=d.config)
    try:
        plain8 = bench(direct)
        turbo8 = bench(lambda: turbo.ops.grouped_gemm_fp8(a, b, lens, trans_b=True, config=cfg))
        results.append(("grouped_gemm_fp8 rowwise fwd (quantise incl.)", "same adapter called directly",
                        f"G={g} M={g * tokens} N={n} K={k}", turbo8, plain8, flops))
    except Exception as exc:  # report, don't hide
        results.append(("grouped_gemm_fp8 rowwise fwd (quantise incl.)", f"FAILED: {type(exc).__name__}: {exc}", "", 0, 0, 0))


def attention_rows(results: list) -> None:
    b, s, h, dim = 2, 4096, 32, 128
    q, k, v = (torch.randn(b, s, h, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    flops = 4.0 * b * h * s * s * dim * 0.5
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend, kernels in (("TORCH", None), ("CUDNN", [SDPBackend.CUDNN_ATTENTION])):
        turbo.GlobalBackendManager.set_attn_backend(backend)
        try:
            turbo_ms = bench(lambda: turbo.ops.flash_attn_func(q, k, v, causal=True))
            if kernels is None:
                plain_ms = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2))
            else:
                def plain():
                    with sdpa_kernel(kernels):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)
                plain_ms = bench(plain)
            results.append((f"attention {backend} causal fwd", "F.scaled_dot_product_attention",
                            f"B={b} S={s} H={h} D={dim}", turbo_ms, plain_ms, flops))
        except Exception as exc:
            results.append((f"attention {backend}", f"FAILED: {type(exc).__name__}: {exc}", "", 0, 0, 0))
        finally:
            turbo.GlobalBackendManager.set_attn_backend(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    results: list = []
    grouped_rows(results)
    attention_rows(results)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}\n")
    print("| op | plain torch peer | shape | turbo ms | plain ms | turbo/plain | turbo TFLOPS |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, peer, shape, t_ms, p_ms, flops in results:
        ratio = t_ms / p_ms if p_ms else float("nan")
        tflops = flops / (t_ms * 1e-3) / 1e12 if t_ms else float("nan")
        print(f"| {name} | {peer} | {shape} | {t_ms:.4f} | {p_ms:.4f} | {ratio:.3f} | {tflops:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
