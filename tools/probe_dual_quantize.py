"""GPU probe of the dual quantiser's TMA kernel against its pointer kernel, in one process.

Usage (repo installed): ``python3 tools/probe_dual_quantize.py [--out FILE] [--no-sweep]``.

Checks first, each printed as PASS/FAIL: the TMA kernel, the pointer kernel and the adapters'
``quantize_cells`` give the same bits (data and scales, NaN scales equal) on inputs with zero
cells, signed zeros, subnormal-sized cells, values near the top of the range, an inf and a NaN, at
odd sizes, both fp8 formats, blocks 128/64/32, runs and tiles; and a layout TMA cannot address
(a row stride that is not a 16-byte multiple) still goes to the pointer kernel.

Then times, per shape of the blockwise training step (DeepSeek-V3 and Qwen3-30B-A3B EP8 operands),
the pointer kernel and every TMA launch (warps, pipeline stages, programs per SM), as ms and
TB/s of bf16 read plus fp8 written, and keeps the fastest TMA launch per mode for the rest of the
run (printed as ``best``).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import turbo_dispatch.backends.triton.dual_quantize as DQ  # noqa: E402
from probe_grouped_step import OUT, E4, E5, _eq, emit, time_ms  # noqa: E402
from turbo_dispatch.backends.triton.grouped_quantize import quantize_cells  # noqa: E402

#: name -> (tile_2d, G, R, C): the step's three dual quantisations per GEMM pair.
SHAPES = {"dsv3_x": (False, 1, 32768, 7168), "dsv3_dy_up": (False, 1, 32768, 4096),
          "dsv3_w_up": (True, 8, 4096, 7168), "dsv3_w_down": (True, 8, 7168, 2048),
          "qwen3_x": (False, 1, 65536, 2048), "qwen3_w_up": (True, 16, 1536, 2048)}
LAUNCHES = [(w, s, p) for w in (8, 16) for s in (1, 2, 3) for p in (1, 2)]


def _specials(g: int, r: int, c: int) -> torch.Tensor:
    x = torch.randn(g, r, c, device="cuda", dtype=torch.bfloat16) * 7
    x[0, :, 128:min(c, 256)] = 0
    x[-1, min(r - 1, 517), 3] = float("nan")
    x[-1, 0:128, 0:128] *= 1e-38
    x[0, min(r, 200):min(r, 300), :] = -0.0
    x[0, r - 1, c - 1] = float("inf")
    x[0, r // 2:, 40:60] *= 3e37
    return x


def _same(a, b) -> bool:
    return all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) if u.dtype in (E4, E5) else _eq(u, v)
               for u, v in zip(a, b))


def _both(x, dt, block, tile):
    """(TMA result or None when it did not launch, pointer result)."""
    launched = []
    real = DQ._launch_tma
    DQ._launch_tma = lambda *a, **k: launched.append(real(*a, **k)) or launched[-1]
    try:
        tma = DQ.dual_quantize(x, dt, block, tile)
    finally:
        DQ._launch_tma = real
    DQ.USE_TMA = False
    try:
        ptr = DQ.dual_quantize(x, dt, block, tile)
    finally:
        DQ.USE_TMA = True
    return (tma if launched and launched[0] else None), ptr


def check() -> bool:
    ok = True
    for dt in (E4, E5):
        for g, r, c in ((3, 1000, 296), (1, 333, 136), (2, 128, 512)):
            x = _specials(g, r, c)
            for block in (128, 64, 32):
                for tile in (False, True):
                    tma, ptr = _both(x, dt, block, tile)
                    if tile:
                        q, qs = quantize_cells(x, dt, block, block)
                        qt, _ = quantize_cells(x.transpose(1, 2), dt, block, block)
                        ref = (q, qs, qt, qs.transpose(1, 2))
                    else:
                        q, qs = quantize_cells(x, dt, 1, block)
                        qt, qts = quantize_cells(x.transpose(1, 2), dt, 1, block, scale_rows_inner=True)
                        ref = (q, qs, qt, qts.transpose(1, 2))
                    good = tma is not None and _same(tma, ptr) and _same(ptr, ref)
                    emit(check="dual_tma", dtype=str(dt), shape=(g, r, c), block=block, tiles=tile,
                         launched=tma is not None, result="PASS" if good else "FAIL")
                    ok = ok and good
    x = torch.randn(1, 300, 300, device="cuda", dtype=torch.bfloat16)  # 600-byte rows: not for TMA
    tma, ptr = _both(x, E4, 128, False)
    emit(check="dual_tma_refuses_unaligned_rows", result="PASS" if tma is None else "FAIL")
    return ok and tma is None


def sweep(shapes: list[str]) -> None:
    best: dict[bool, dict] = {False: {}, True: {}}
    for name in shapes:
        tile, g, r, c = SHAPES[name]
        x = torch.randn(g, r, c, device="cuda", dtype=torch.bfloat16)
        moved = x.numel() * 3  # bf16 read + two fp8 copies written (scales are < 1%)
        DQ.USE_TMA = False
        ptr_ms = time_ms(lambda: DQ.dual_quantize(x, E4, 128, tile))
        DQ.USE_TMA = True
        emit(probe="dual", shape=name, kernel="pointer", ms=ptr_ms, tbs=moved / ptr_ms * 1e-9)
        saved = DQ.TMA_LAUNCH[tile]
        for launch in LAUNCHES:
            DQ.TMA_LAUNCH[tile] = launch
            try:
                ms = time_ms(lambda: DQ.dual_quantize(x, E4, 128, tile))
            except Exception as exc:  # noqa: BLE001 - a launch that does not compile is a result
                emit(probe="dual", shape=name, kernel="tma", launch=launch, error=f"{type(exc).__name__}: {str(exc)[:200]}")
                continue
            emit(probe="dual", shape=name, kernel="tma", launch=launch, ms=ms, tbs=moved / ms * 1e-9,
                 vs_pointer=ptr_ms / ms)
            best[tile].setdefault(launch, []).append(ptr_ms / ms)
        DQ.TMA_LAUNCH[tile] = saved
        del x
        torch.cuda.empty_cache()
    for tile, by_launch in best.items():
        if by_launch:
            gm = {k: float(torch.tensor(v).log().mean().exp()) for k, v in by_launch.items()}
            top = max(gm, key=gm.get)
            DQ.TMA_LAUNCH[tile] = top
            emit(probe="dual_best", tiles=tile, launch=top, geomean_vs_pointer=gm[top],
                 default=saved_default(tile), default_vs_pointer=gm.get(saved_default(tile)))


def saved_default(tile: bool):
    return _DEFAULTS[tile]


_DEFAULTS = dict(DQ.TMA_LAUNCH)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    if args.out:
        OUT.append(open(args.out, "w"))
    emit(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    ok = check()
    if not args.no_sweep:
        sweep(args.shapes.split(","))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
