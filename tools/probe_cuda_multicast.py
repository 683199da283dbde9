"""Probe: does multicasting B across a 2-CTA cluster lift the blockwise fp8 GEMM's rate on Hopper?

Builds ``tools/cuda_probe/fp8_blockwise_cluster.cu`` with nvcc (sm_90a), loads it through
cuda-bindings, checks both kernels (``fp8bw_c1`` one CTA per tile, ``fp8bw_c2`` clusters of two
CTAs sharing B through TMA multicast) against a float32 reference on random operands and scales,
then times them in turns with the library's warp-specialised Gluon kernel (the grouped forward's
kernel, dense launch, its default 128 x 256 x 128 4-stage config) and cuBLAS's blockwise
``F.scaled_mm`` on the same operands. One JSON line per measurement goes to ``--out``.

Needs an sm_90 GPU, nvcc and cuda-bindings (the device image has all three).

    cd tools && python3 probe_cuda_multicast.py --out $OUT/multicast.jsonl
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_probe"))

from cubin import Cubin  # noqa: E402
from probe_record import Jsonl, event_ms  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "cuda_probe" / "fp8_blockwise_cluster.cu"
SMEM = 4 * (128 * 128 + 256 * 128) + 1024 + 64  # the ring, the 1 KiB alignment pad, 8 mbarriers
GLUON_CFG = (128, 256, 128, 8, 4, 8)


def load(out_dir: Path) -> Cubin:
    return Cubin(SOURCE, out_dir, ["fp8bw_c1", "fp8bw_c2"], SMEM)


def prepare(kernels: Cubin, name: str, a, b, sa_km, sb, c):
    """A no-argument launcher of kernel ``name`` on these operands (maps built once)."""
    M, K = a.shape
    N = b.shape[0]
    params = [kernels.tensor_map(a), kernels.tensor_map(b), ctypes.c_void_p(sa_km.data_ptr()),
              ctypes.c_void_p(sb.data_ptr()), ctypes.c_void_p(c.data_ptr()), ctypes.c_int(M), ctypes.c_int(N),
              ctypes.c_int(K)]
    return kernels.launcher(name, (M // 128) * (N // 256), 384, params)


def operands(M: int, N: int, K: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(M, K, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    b = (torch.randn(N, K, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    sa_km = torch.rand(K // 128, M, device="cuda", generator=g) + 0.5  # [K blocks, M], rows contiguous
    sb = torch.rand(N // 128, K // 128, device="cuda", generator=g) + 0.5
    return a, b, sa_km, sb


def reference(a, b, sa_km, sb) -> torch.Tensor:
    a32 = a.float() * sa_km.t().repeat_interleave(128, dim=1)
    b32 = b.float() * sb.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    return a32 @ b32.t()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def peers(a, b, sa_km, sb):
    """Launchers of the Gluon WS kernel and cuBLAS blockwise on these operands, by name."""
    from backends.triton.fp8_blockwise_gluon_ws import fp8_blockwise_gemm as gluon_ws
    sa = sa_km.t()  # [M, K blocks] with rows contiguous: the layout the x quantiser writes
    out = {"gluon_ws": lambda: gluon_ws(a, b, sa, sb, torch.bfloat16, GLUON_CFG, a_group=1, b_group=128)}
    try:
        from torch.nn.functional import ScalingType, scaled_mm
    except ImportError:
        return out
    pad = torch.nn.functional.pad(sb, (0, (-sb.shape[1]) % 4)).contiguous()
    scale_b = pad.t()  # [K/128 padded, N/128], strides (1, K/128 padded)
    scale_a = sa  # [M, K/128], strides (1, M)
    bt = b.t()
    out["cublas_blockwise"] = lambda: scaled_mm(a, bt, scale_a, ScalingType.BlockWise1x128, scale_b,
                                                ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--shapes", default="8192x4096x7168,32768x4096x7168,32768x7168x2048,16384x2048x7168")
    parser.add_argument("--once", action="store_true",
                        help="run each kernel once at the first shape and stop (for ncu)")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    kernels = load(args.out.parent)
    if args.once:
        M, N, K = (int(v) for v in args.shapes.split(",")[0].split("x"))
        a, b, sa_km, sb = operands(M, N, K)
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        for name in ("fp8bw_c1", "fp8bw_c2"):
            prepare(kernels, name, a, b, sa_km, sb, c)()
        for fn in peers(a, b, sa_km, sb).values():
            fn()
        torch.cuda.synchronize()
        return 0
    emit = Jsonl(args.out, gpu=torch.cuda.get_device_name())
    # Correctness first, on small and odd-ish (but tile-aligned) shapes and the timed ones.
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for M, N, K in [(256, 256, 128), (512, 768, 384), (1024, 512, 1152)] + shapes:
        a, b, sa_km, sb = operands(M, N, K, seed=M + N + K)
        ref = reference(a, b, sa_km, sb)
        for name in ("fp8bw_c1", "fp8bw_c2"):
            c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            prepare(kernels, name, a, b, sa_km, sb, c)()
            torch.cuda.synchronize()
            emit({"probe": "check", "kernel": name, "shape": [M, N, K], "rel_err": rel_err(c, ref),
                  "nan": bool(c.isnan().any())})
        for name, fn in peers(a, b, sa_km, sb).items():
            emit({"probe": "check", "kernel": name, "shape": [M, N, K], "rel_err": rel_err(fn(), ref)})
        del ref

    for M, N, K in shapes:
        a, b, sa_km, sb = operands(M, N, K, seed=1)
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        fns = {name: prepare(kernels, name, a, b, sa_km, sb, c) for name in ("fp8bw_c1", "fp8bw_c2")}
        fns.update(peers(a, b, sa_km, sb))
        flops = 2.0 * M * N * K
        one = event_ms(fns["fp8bw_c1"], 1)
        reps = max(5, min(200, int(40.0 / max(one, 1e-3))))
        for fn in fns.values():
            event_ms(fn, reps)  # warm-up: compile, clocks
        times = {name: [] for name in fns}
        for _ in range(args.turns):
            for name, fn in fns.items():
                times[name].append(event_ms(fn, reps))
        for name, ts in times.items():
            ms = statistics.median(ts)
            emit({"probe": "time", "kernel": name, "shape": [M, N, K], "ms": ms, "tflops": flops / ms / 1e9,
                  "turns_ms": ts, "reps": reps})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
