"""Host cost of the CUBLASLT adapter's preferred-BLAS-library switch (set, run, restore).

Times, per call on a tiny 16x16x16 bf16 GEMM (so the host path dominates): torch.matmul alone,
the BlasLtGemm adapter (two switches per call), the adapter when cuBLASLt is already preferred
(no switch), and one bare get+set+set round trip of torch's switch. Median of rounds.

Usage: python benchmarks/bench_blaslt_switch.py        (needs a CUDA GPU)
"""
from __future__ import annotations

import statistics
import time

import torch

from turbo_dispatch.backends.blaslt.gemm import BlasLtGemm
from turbo_dispatch.ops.gemm import gemm_problem


def per_call_us(fn, iters: int = 20000, rounds: int = 5) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


def main() -> None:
    a = torch.randn(16, 16, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(16, 16, device="cuda", dtype=torch.bfloat16)
    p = gemm_problem(a, b, False, True)
    ad = BlasLtGemm()
    get, put, kind = torch._C._get_blas_preferred_backend, torch._C._set_blas_preferred_backend, torch._C._BlasBackend
    previous = get()
    try:
        put(kind.Cublas)
        plain = per_call_us(lambda: torch.matmul(a, b.t()))
        switched = per_call_us(lambda: ad.run(p, a, b))
        cublas_cfg = per_call_us(lambda: ad.run(p, a, b, config="cublas"))
        put(kind.Cublaslt)
        no_switch = per_call_us(lambda: ad.run(p, a, b))
        put(kind.Cublas)

        def round_trip():
            prev = get()
            put(kind.Cublaslt)
            put(prev)
        bare = per_call_us(round_trip, iters=100000)
    finally:
        put(previous)
    print(f"torch.matmul (cuBLAS preferred)          {plain:7.2f} us/call")
    print(f"BlasLtGemm.run, switch + restore         {switched:7.2f} us/call  (+{switched - plain:.2f})")
    print(f"BlasLtGemm.run, cuBLASLt already set     {no_switch:7.2f} us/call  (+{no_switch - plain:.2f})")
    print(f"BlasLtGemm.run config=cublas (no switch) {cublas_cfg:7.2f} us/call  (+{cublas_cfg - plain:.2f})")
    print(f"bare get + set + set of the switch       {bare:7.3f} us")


if __name__ == "__main__":
    main()
