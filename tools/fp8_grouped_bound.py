"""Best step time an fp8 grouped GEMM could reach, per case of a bench CSV, against its bf16 peer.

The grouped fp8 op takes bf16 in and gives bf16 out, so one training step (forward, dgrad, wgrad)
must at least run its three GEMMs and move its quantisation bytes:

* x [M, K]: read once in bf16, written twice in fp8 (along K for the forward, along M for the
  wgrad): 4 bytes per element;
* the gradient [M, N]: the same, 4 bytes per element;
* the weight [G, N, K]: read in bf16 and written as 128 x 128 tiles, once per copy: 2 + copies
  bytes per element. Both copies hold the same values under the same scales, but Hopper's fp8
  wgmma reads its B operand only K-major, so the forward (reducing over K) and the dgrad
  (reducing over N) each need the weight laid out with their own reduction axis contiguous:
  ``--weight-copies 2`` (the default). One copy (3 bytes) is the bound of an MMA that can read
  fp8 either way round.

Each GEMM also reads its two fp8 operands and writes its bf16 output (the forward x and the
weight, writing y [M, N]; the dgrad the gradient and the weight, writing dx [M, K]; the wgrad
the gradient and x, writing dw [G, N, K]), so it takes at least the larger of its FLOPs at its
rate and those bytes at ``--tbps`` (at 512 tokens per expert the wgrad's K is 512 and its dw
write is as large as the weight). With the forward and dgrad at ``--tflops``, the wgrad at
``--wgrad-tflops`` (default: the same) and the bytes at ``--tbps``, and nothing else (no launch
gaps, no scale traffic, no overlap between kernels), the step takes the three GEMMs' times plus
the quantisation bytes over ``--tbps``. Dividing the CSV's measured bf16 step time by it gives
the largest ratio kernels at those rates could show for that case.

Usage:
    python tools/fp8_grouped_bound.py bench-out/h100_<date>_fp8_blockwise_grouped_gemm_ep8_tpe4096.csv \
        --tflops 1224 --wgrad-tflops 958 --tbps 2.5 [--weight-copies 2]

(the CSV of ``python benchmarks/suite.py --family grouped_gemm_fp8``, or of bench_grouped_gemm.py).
"""
from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from harness import geomean  # noqa: E402  (the reports' one geomean)


def step_bound_ms(m: int, n: int, k: int, groups: int, tflops: float, tbps: float,
                  wgrad_tflops: float | None = None, weight_copies: int = 2) -> float:
    """Lower bound of one fp8 step's time in ms (see the module doc)."""
    flops, bw, w = 2.0 * m * n * k, tbps * 1e12, groups * n * k
    gemm_s = (max(flops / (tflops * 1e12), (m * k + w + 2.0 * m * n) / bw)  # forward
              + max(flops / (tflops * 1e12), (m * n + w + 2.0 * m * k) / bw)  # dgrad
              + max(flops / ((wgrad_tflops or tflops) * 1e12), (m * n + m * k + 2.0 * w) / bw))  # wgrad
    moved = 4.0 * m * k + 4.0 * m * n + (2.0 + weight_copies) * w
    return 1e3 * (gemm_s + moved / bw)


def bounds(rows: list[dict], tflops: float, tbps: float, fp8_backend: str, bf16_prefix: str,
           wgrad_tflops: float | None = None, weight_copies: int = 2) -> list[dict]:
    by_shape: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by_shape[r["shape"]][r["backend"]] = r
    out = []
    for shape, per in by_shape.items():
        bf16 = next((r for b, r in per.items() if b.startswith(bf16_prefix) and r["step_ms"]), None)
        fp8 = per.get(fp8_backend)
        if bf16 is None or fp8 is None or not fp8["step_ms"]:
            continue
        m, n, k, g = int(fp8["m"]), int(fp8["n"]), int(fp8["k"]), int(fp8["groups"])
        best = step_bound_ms(m, n, k, g, tflops, tbps, wgrad_tflops, weight_copies)
        out.append({"shape": shape, "bf16_ms": float(bf16["step_ms"]), "fp8_ms": float(fp8["step_ms"]),
                    "bound_ms": best, "measured_ratio": float(bf16["step_ms"]) / float(fp8["step_ms"]),
                    "bound_ratio": float(bf16["step_ms"]) / best})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="a bench_grouped_gemm.py --dtype fp8 CSV with a bf16 peer row per shape")
    parser.add_argument("--tflops", type=float, required=True, help="GEMM rate assumed for the forward and dgrad")
    parser.add_argument("--wgrad-tflops", type=float, default=None, help="GEMM rate of the wgrad (default: --tflops)")
    parser.add_argument("--weight-copies", type=int, choices=(1, 2), default=2,
                        help="fp8 copies of the weight written per step (default 2: see the module doc)")
    parser.add_argument("--tbps", type=float, required=True, help="memory rate assumed for the quantisation bytes")
    parser.add_argument("--backend", default="turbo autotune", help="the fp8 row measured (default: turbo autotune)")
    parser.add_argument("--bf16-prefix", default="bf16 ", help="backend prefix of the bf16 peer rows")
    args = parser.parse_args(argv)
    with open(args.csv) as fh:
        rows = list(csv.DictReader(fh))
    result = bounds(rows, args.tflops, args.tbps, args.backend, args.bf16_prefix, args.wgrad_tflops,
                    args.weight_copies)
    if not result:
        raise SystemExit(f"{args.csv}: no shape has both a {args.backend!r} row and a {args.bf16_prefix!r}* row")
    print(f"| case | bf16 ms | fp8 ms | bound ms | measured vs bf16 | bound vs bf16 |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in result:
        print(f"| {r['shape']} | {r['bf16_ms']:.3f} | {r['fp8_ms']:.3f} | {r['bound_ms']:.3f} | "
              f"{r['measured_ratio']:.3f} | {r['bound_ratio']:.3f} |")
    print(f"\ngeomean over {len(result)} cases: measured {geomean(r['measured_ratio'] for r in result):.3f}x, "
          f"bound {geomean(r['bound_ratio'] for r in result):.3f}x (forward and dgrad at {args.tflops:g} TFLOPS, "
          f"wgrad at {args.wgrad_tflops or args.tflops:g}, quantisation bytes at {args.tbps:g} TB/s, "
          f"{args.weight_copies} weight cop{'y' if args.weight_copies == 1 else 'ies'}); "
          f"{sum(r['bound_ratio'] < 1.3 for r in result)} cases have a bound below 1.3x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
