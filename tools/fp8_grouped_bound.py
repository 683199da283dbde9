"""Best step time an fp8 grouped GEMM could reach, per case of a bench CSV, against its bf16 peer.

The grouped fp8 op takes bf16 in and gives bf16 out, so one training step (forward, dgrad, wgrad)
must at least run its three GEMMs and move its quantisation bytes:

* x [M, K]: read once in bf16, written twice in fp8 (along K for the forward, along M for the
  wgrad): 4 bytes per element;
* the gradient [M, N]: the same, 4 bytes per element;
* the weight [G, N, K]: read in bf16, written once as 2-D tiles that serve forward and dgrad:
  3 bytes per element.

With the GEMMs at ``--tflops`` and the bytes at ``--tbps``, and nothing else (no launch gaps,
no scale traffic), the step takes ``3 * 2*M*N*K / tflops + bytes / tbps``. Dividing the CSV's
measured bf16 step time by it gives the largest ratio any kernel could show for that case.

Usage:
    python tools/fp8_grouped_bound.py benchmarks/results/h100_2026-11-24r44_fp8_blockwise_grouped_gemm_ep8_tpe4096.csv \
        --tflops 1226 --tbps 3.0
"""
from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from harness import geomean  # noqa: E402  (the reports' one geomean)


def step_bound_ms(m: int, n: int, k: int, groups: int, tflops: float, tbps: float) -> float:
    """Lower bound of one fp8 step's time in ms (see the module doc)."""
    gemm_s = 3 * 2.0 * m * n * k / (tflops * 1e12)
    moved = 4.0 * m * k + 4.0 * m * n + 3.0 * groups * n * k
    return 1e3 * (gemm_s + moved / (tbps * 1e12))


def bounds(rows: list[dict], tflops: float, tbps: float, fp8_backend: str, bf16_prefix: str) -> list[dict]:
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
        best = step_bound_ms(m, n, k, g, tflops, tbps)
        out.append({"shape": shape, "bf16_ms": float(bf16["step_ms"]), "fp8_ms": float(fp8["step_ms"]),
                    "bound_ms": best, "measured_ratio": float(bf16["step_ms"]) / float(fp8["step_ms"]),
                    "bound_ratio": float(bf16["step_ms"]) / best})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="a bench_grouped_gemm.py --dtype fp8 CSV with a bf16 peer row per shape")
    parser.add_argument("--tflops", type=float, required=True, help="GEMM rate assumed for all three GEMMs")
    parser.add_argument("--tbps", type=float, required=True, help="memory rate assumed for the quantisation bytes")
    parser.add_argument("--backend", default="turbo autotune", help="the fp8 row measured (default: turbo autotune)")
    parser.add_argument("--bf16-prefix", default="bf16 ", help="backend prefix of the bf16 peer rows")
    args = parser.parse_args(argv)
    with open(args.csv) as fh:
        rows = list(csv.DictReader(fh))
    result = bounds(rows, args.tflops, args.tbps, args.backend, args.bf16_prefix)
    if not result:
        raise SystemExit(f"{args.csv}: no shape has both a {args.backend!r} row and a {args.bf16_prefix!r}* row")
    print(f"| case | bf16 ms | fp8 ms | bound ms | measured vs bf16 | bound vs bf16 |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in result:
        print(f"| {r['shape']} | {r['bf16_ms']:.3f} | {r['fp8_ms']:.3f} | {r['bound_ms']:.3f} | "
              f"{r['measured_ratio']:.3f} | {r['bound_ratio']:.3f} |")
    print(f"\ngeomean over {len(result)} cases: measured {geomean(r['measured_ratio'] for r in result):.3f}x, "
          f"bound {geomean(r['bound_ratio'] for r in result):.3f}x (GEMMs at {args.tflops:g} TFLOPS, "
          f"quantisation bytes at {args.tbps:g} TB/s); "
          f"{sum(r['bound_ratio'] < 1.3 for r in result)} cases have a bound below 1.3x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
