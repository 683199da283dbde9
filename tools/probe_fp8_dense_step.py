"""GPU probe for the dense fp8 step's quantisers (tensorwise / rowwise).

1. ``check``: ``quantize_fp8_both``, ``quantize_fp8_in_turn`` and ``quantize_fp8`` on transposed
   views against the torch reference, bit for bit (odd sizes, both fp8 formats, special values).
2. ``quant``: the step's two quantisations of one tensor (along its features and along its
   tokens), timed as two ``quantize_fp8`` calls and as ``quantize_fp8_both`` under each launch
   shape, beside a clone of the same tensor (the bandwidth reference).
3. ``weight``: a weight's quantisations along K and along N under the split amax kernel's
   program targets and tiles.
4. ``profile``: one Linear step (forward + backward) of ``gemm_fp8`` under torch.profiler, per
   kernel, for a backend pinned by name.

Writes JSON lines to ``--out``; prints a readable summary.

    python tools/probe_fp8_dense_step.py --out $OUT/probe.jsonl
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import turbo_dispatch as turbo  # noqa: E402
from turbo_dispatch.backends.triton import quantize as Q  # noqa: E402
from turbo_dispatch.host_cover import median_gpu_ms  # noqa: E402
from turbo_dispatch.low_precision import Float8QuantConfig, ScalingGranularity as G, quantize  # noqa: E402

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
DEV = torch.device("cuda")
AMAX_LAUNCHES = [(16, 512, 16, 4), (16, 512, 32, 4), (8, 1024, 32, 4), (32, 512, 8, 8), (16, 256, 16, 4)]
CAST_LAUNCHES = [(64, 64, 4), (32, 64, 4), (64, 32, 4), (32, 128, 4), (64, 64, 2)]
SHAPES = [(4096, 4096), (4096, 8192), (4096, 14336), (4096, 28672), (4096, 57344), (8192, 3584)]


def emit(out, rec: dict) -> None:
    out.write(json.dumps(rec) + "\n")
    out.flush()
    print(json.dumps(rec))


def same(got, want) -> bool:
    return (got.data.shape == want.data.shape and got.scale.shape == want.scale.shape and got.axis == want.axis
            and torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
            and torch.equal(got.scale, want.scale))


def diff(got, want) -> dict:
    """What differs, for the record: shapes, scale values, and a few differing fp8 bytes."""
    rec = {"shapes": [list(got.data.shape), list(want.data.shape), list(got.scale.shape), list(want.scale.shape)]}
    if got.scale.shape == want.scale.shape:
        d = got.scale != want.scale
        rec["scale_diffs"] = int(d.sum())
        if d.any():
            rec["scale_sample"] = [got.scale[d][:3].tolist(), want.scale[d][:3].tolist()]
    if got.data.shape == want.data.shape:
        d = got.data.view(torch.uint8) != want.data.view(torch.uint8)
        rec["data_diffs"] = int(d.sum())
        if d.any():
            idx = d.nonzero()[:3].tolist()
            rec["data_sample"] = [[i, int(got.data.view(torch.uint8)[tuple(i)]), int(want.data.view(torch.uint8)[tuple(i)])]
                                  for i in idx]
    return rec


def check(out) -> bool:
    ok_all = True
    torch.manual_seed(7)
    for shape in [(1000, 3000), (129, 9001), (513, 257), (4096, 4096), (3, 70000)]:
        x = torch.randn(shape, device=DEV) * 5
        x[0] = 0
        x[1, :7] = 1e-39  # float32 subnormals
        x[2, 3] = 1e30  # saturates the row's neighbours to zero after scaling
        for view, fdt, g, xdt in itertools.product([False, True], [E4, E5], [G.TENSORWISE, G.ROWWISE],
                                                   [torch.bfloat16, torch.float32]):
            xv = (x.t() if view else x).to(xdt)
            rows, cols = Q.quantize_fp8_both(xv, fdt, g)
            pairs = {"both_rows": (rows, quantize(xv, fdt, g, axis=1)), "both_cols": (cols, quantize(xv, fdt, g, axis=0)),
                     "strided": (Q.quantize_fp8(xv.t(), fdt, g, axis=1), quantize(xv.t(), fdt, g, axis=1)),
                     "plain": (Q.quantize_fp8(xv, fdt, g, axis=1), quantize(xv, fdt, g, axis=1))}
            for name, make, axis in zip(("in_turn_rows", "in_turn_cols"), Q.quantize_fp8_in_turn(xv, fdt, g), (1, 0)):
                pairs[name] = (make(), quantize(xv, fdt, g, axis=axis))
            bad = {name: diff(got, want) for name, (got, want) in pairs.items() if not same(got, want)}
            if bad:
                ok_all = False
                emit(out, {"kind": "check", "shape": shape, "view": view, "fp8": str(fdt), "gran": g.name,
                           "x": str(xdt), "ok": False, "bad": bad})
    emit(out, {"kind": "check", "all": "PASS" if ok_all else "FAIL"})
    return ok_all


def time_ms(fn, reps: int = 20) -> float:
    return median_gpu_ms(fn, DEV, reps)


def quant(out) -> None:
    for (p, q), g in itertools.product(SHAPES, [G.ROWWISE, G.TENSORWISE]):
        x = torch.randn(p, q, device=DEV, dtype=torch.bfloat16)
        moved = x.numel() * 2 + 2 * x.numel()  # one bf16 read, two fp8 writes
        rec = {"kind": "quant", "shape": [p, q], "gran": g.name,
               "clone_ms": time_ms(lambda: x.clone()),
               "two_calls_ms": time_ms(lambda: (Q.quantize_fp8(x, E4, g, axis=1), Q.quantize_fp8(x.t(), E4, g, axis=1)))}
        best = None
        keep = (Q.BOTH_AMAX_LAUNCH, Q.BOTH_CAST_LAUNCH)
        try:
            for amax, cast in itertools.product(AMAX_LAUNCHES, CAST_LAUNCHES):
                Q.BOTH_AMAX_LAUNCH, Q.BOTH_CAST_LAUNCH = amax, cast
                ms = time_ms(lambda: Q.quantize_fp8_both(x, E4, g))
                rec[f"both{amax}{cast}"] = ms
                if best is None or ms < best[0]:
                    best = (ms, amax, cast)
            Q.BOTH_AMAX_LAUNCH, Q.BOTH_CAST_LAUNCH = keep
            rec["both_default_ms"] = time_ms(lambda: Q.quantize_fp8_both(x, E4, g))
        finally:
            Q.BOTH_AMAX_LAUNCH, Q.BOTH_CAST_LAUNCH = keep
        rec["best"] = best
        rec["clone_gbs"] = 4 * x.numel() / rec["clone_ms"] / 1e6
        rec["both_default_gbs"] = moved / rec["both_default_ms"] / 1e6
        emit(out, rec)


def weight_amax(out) -> None:
    """A weight's two quantisations: along K (its rows) and along N (the dgrad's K^T, a strided
    dim), under the split amax kernel's program targets and tiles."""
    keep = (Q.AMAX_PROGRAMS, Q.AMAX_TILE, Q.AMAX_TILE_STRIDED)
    for (n, k), g in itertools.product([(57344, 8192), (106496, 16384), (8192, 28672)], [G.ROWWISE, G.TENSORWISE]):
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
        rec = {"kind": "weight", "nk": [n, k], "gran": g.name, "clone_ms": time_ms(lambda: w.clone(), reps=5)}
        try:
            for programs, tile, strided in itertools.product([256, 1024, 4096], [(32, 128), (16, 256)],
                                                             [(128, 32), (64, 64), (256, 16)]):
                Q.AMAX_PROGRAMS, Q.AMAX_TILE, Q.AMAX_TILE_STRIDED = programs, tile, strided
                rec[f"k{programs}{tile}"] = time_ms(lambda: Q.quantize_fp8(w, E4, g, axis=1), reps=5)
                rec[f"n{programs}{strided}"] = time_ms(lambda: Q.quantize_fp8(w.t(), E4, g, axis=1), reps=5)
        finally:
            Q.AMAX_PROGRAMS, Q.AMAX_TILE, Q.AMAX_TILE_STRIDED = keep
        rec["k_default"] = time_ms(lambda: Q.quantize_fp8(w, E4, g, axis=1), reps=5)
        rec["n_default"] = time_ms(lambda: Q.quantize_fp8(w.t(), E4, g, axis=1), reps=5)
        emit(out, rec)
        del w
        torch.cuda.empty_cache()


def profile(out, backend: str, gran: G, m: int, n: int, k: int) -> None:
    cfg = Float8QuantConfig(granularity=gran)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
    turbo.GlobalBackendManager.set_gemm_backend(backend)
    try:
        def step():
            y = turbo.ops.gemm_fp8(x, w, trans_b=True, config=cfg)
            y.backward(grad)
            x.grad = w.grad = None

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        step_ms = time_ms(step, reps=10)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t > 0:
                rows.append((t / 5 / 1e3, e.count // 5, e.key[:90]))
        rows.sort(reverse=True)
        emit(out, {"kind": "profile", "backend": backend, "gran": gran.name, "mnk": [m, n, k], "step_ms": step_ms,
                   "kernels_ms": [[round(t, 4), c, name] for t, c, name in rows[:14]]})
    finally:
        turbo.GlobalBackendManager.set_gemm_backend(None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: check,quant,weight,profile")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(torch.cuda.get_device_name(), torch.__version__)
    ok = True
    with open(args.out, "w") as out:
        if "check" not in skip:
            ok = check(out)
        if "quant" not in skip:
            quant(out)
        if "weight" not in skip:
            weight_amax(out)
        if "profile" not in skip:
            for backend, gran, shape in itertools.product(["TRITON"], [G.ROWWISE, G.TENSORWISE],
                                                          [(4096, 57344, 8192), (4096, 3584, 18944)]):
                profile(out, backend, gran, *shape)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
