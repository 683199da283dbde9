"""Probe: is the dual token-run quantiser's 2.3-2.5 TB/s the access pattern's limit or the kernel's?

Builds ``tools/cuda_probe/dual_quantize_runs.cu`` (plain CUDA, sm_90a), checks it against a
float32 torch reference and against the library's ``dual_quantize`` (the Gluon runs kernel on
Hopper), then times it in turns with that kernel and with a clone of the same tensor, at the
step's activation and gradient shapes. One JSON line per measurement goes to ``--out``.

    cd tools && python3 probe_cuda_quantizer.py --out $OUT/quantizer.jsonl
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

SOURCE = Path(__file__).resolve().parent / "cuda_probe" / "dual_quantize_runs.cu"
E4M3 = torch.float8_e4m3fn
SHAPES = "131072x7168,131072x4096,65536x768,65536x2048"


def cuda_dual(kernels: Cubin, x: torch.Tensor):
    """(launch, (q, s, qt, st)) of the CUDA kernel on ``x`` [T, C]."""
    T, C = x.shape
    q = torch.empty(T, C, device="cuda", dtype=torch.uint8)
    qt = torch.empty(C, T, device="cuda", dtype=torch.uint8)
    s = torch.empty(T, C // 128, device="cuda")
    st = torch.empty(T // 128, C, device="cuda")
    params = [ctypes.c_void_p(t.data_ptr()) for t in (x, q, qt, s, st)] + [ctypes.c_int(T), ctypes.c_int(C)]
    return kernels.launcher("dual_runs", (T // 128, C // 128), 256, params), (q, s, qt, st)


def reference(x: torch.Tensor):
    """(q, s) of 1 x 128 runs along the last axis, by torch in float32 (correctly rounded division)."""
    T, C = x.shape
    xs = x.float().view(T, C // 128, 128)
    amax = xs.abs().amax(-1)
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (xs / s[..., None]).to(E4M3).view(T, C), s


def compare(q_bytes: torch.Tensor, s: torch.Tensor, q_ref: torch.Tensor, s_ref: torch.Tensor) -> dict:
    """Fraction of fp8 codes that differ, the largest difference in fp8 steps, and the scales'
    largest relative difference."""
    a = q_bytes.view(E4M3).float()
    b = q_ref.float()
    diff = a != b
    # one fp8 step at b's magnitude: 2^(floor(log2 |b|) - 3) for e4m3's 3 mantissa bits
    step = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(2.0 ** -6))) - 3)
    return {"codes_differing": float(diff.float().mean()),
            "max_steps": float(((a - b).abs() / step).max()),
            "scale_rel": float(((s - s_ref).abs() / s_ref).max())}


def time_turns(fns: dict, turns: int, reps: int) -> dict:
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(turns):
        for name, fn in fns.items():
            times[name].append(event_ms(fn, reps))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--turns", type=int, default=7)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from backends.triton.dual_quantize import dual_quantize
    kernels = Cubin(SOURCE, args.out.parent, ["dual_runs"])
    emit = Jsonl(args.out, gpu=torch.cuda.get_device_name())
    for shape in ["256x384"] + args.shapes.split(","):
        T, C = (int(v) for v in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(T + C)
        # rows and columns of different magnitudes, so the two run directions get different scales
        x = (torch.randn(T, C, device="cuda", generator=g) * torch.exp(torch.randn(T, 1, device="cuda", generator=g))
             * torch.exp(0.5 * torch.randn(1, C, device="cuda", generator=g))).to(torch.bfloat16)
        launch, (q, s, qt, st) = cuda_dual(kernels, x)
        launch()
        lib = dual_quantize(x.unsqueeze(0), E4M3, 128, False)
        torch.cuda.synchronize()
        q_ref, s_ref = reference(x)
        qt_ref, st_ref = reference(x.t().contiguous())
        emit({"probe": "check", "shape": [T, C], "side": "rows", "cuda": compare(q, s, q_ref, s_ref),
              "library": compare(lib[0][0].view(torch.uint8), lib[1][0], q_ref, s_ref)})
        emit({"probe": "check", "shape": [T, C], "side": "columns (transposed)",
              "cuda": compare(qt, st.t(), qt_ref, st_ref),
              "library": compare(lib[2][0].view(torch.uint8), lib[3][0].t(), qt_ref, st_ref)})
        del q_ref, s_ref, qt_ref, st_ref, lib
        if shape == "256x384":
            continue
        moved = 4.0 * T * C  # bf16 read, two fp8 copies written (scales: 2 / 128 of that)
        fns = {"cuda": launch, "library (Gluon runs)": lambda: dual_quantize(x.unsqueeze(0), E4M3, 128, False),
               "clone": lambda: x.clone()}
        reps = max(3, min(50, int(20.0 / max(moved / 2.5e9, 1e-3))))
        ms = time_turns(fns, args.turns, reps)
        for name, t in ms.items():
            emit({"probe": "time", "shape": [T, C], "kernel": name, "ms": t, "tbps": moved / t / 1e9,
                  "reps": reps})
        x = q = s = qt = st = launch = fns = None  # free this shape's tensors before the next one's
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
