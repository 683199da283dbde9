"""Autotuning under dropless routing (GPU probe): how many keys a run of training steps profiles
when the tokens a rank receives change every step, with the grouped GEMMs' token buckets
(``OpSpec.shared_problem``) and with exact keys, side by side in one process.

Each mode runs ``--steps`` blockwise fp8 (or bf16) grouped training steps at one MoE shape, the
routing redrawn every step so that M_total moves within +-``--spread`` of its mean, with autotuning
on (300 ms per key unless ``PRIMUS_TURBO_TUNE_BUDGET_MS`` says otherwise) and a fresh tuning DB. Reported per mode: keys profiled, candidate runs, distinct M_total values,
the wall time of the whole run (profiling included), and the median step time of its last
``--tail`` steps. Usage (repo installed):
``python3 tools/probe_dropless_tuning.py --shape qwen3_down --steps 40 --out FILE``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import turbo_dispatch as turbo
from turbo_dispatch import GlobalBackendManager, autotune, resolver
from turbo_dispatch.low_precision import Float8QuantConfig

sys.path.insert(0, str(Path(__file__).parent))
from probe_grouped_step import OUT, SHAPES, emit  # noqa: E402  (sibling in tools/)

_grouped = importlib.import_module("turbo_dispatch.ops.grouped_gemm")
#: A shape small enough for the CPU (``--device cpu``): the probe's own check that it runs.
SHAPES = {**SHAPES, "tiny": (4, 1024, 64, 128)}


def routings(groups: int, mean_tokens: int, spread: float, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` random group sizes (multinomial over ``groups`` experts) whose totals are drawn
    uniformly within ``mean_tokens * (1 +- spread)``: the tokens a rank receives under dropless
    routing."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        total = int(mean_tokens * (1 + spread * (2 * torch.rand(1, generator=gen).item() - 1)))
        picks = torch.randint(0, groups, (total,), generator=gen)
        out.append(torch.bincount(picks, minlength=groups).to(torch.int64))
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_mode(shape: str, shared: bool, steps: int, spread: float, tail: int, fp8: bool, device: str) -> dict:
    g, tokens, n, k = SHAPES[shape]
    specs = (_grouped.GROUPED_GEMM, _grouped.GROUPED_GEMM_FP8)
    if not shared:  # exact keys: what the resolver did before token buckets
        for spec in specs:
            object.__setattr__(spec, "shared_problem", None)
    os.environ["PRIMUS_TURBO_TUNE_DB"] = str(Path(tempfile.mkdtemp()) / "tuning.jsonl")
    GlobalBackendManager.reset()
    GlobalBackendManager.set_auto_tune(True)
    autotune._memory.clear()
    resolver.clear_cache()
    runs0 = autotune.STATS.get("candidate_runs", 0)
    torch.manual_seed(0)
    w = (torch.randn(g, n, k, device=device, dtype=torch.bfloat16) * 0.05).requires_grad_()
    cfg = Float8QuantConfig(granularity="blockwise", block_size=128)
    lens_list = routings(g, tokens, spread, steps)
    step_ms = []
    start = time.perf_counter()
    try:
        for lens_cpu in lens_list:
            m = int(lens_cpu.sum())
            lens = lens_cpu.to(device)
            a = torch.randn(m, k, device=device, dtype=torch.bfloat16).requires_grad_()
            grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
            _sync(device)
            t0 = time.perf_counter()
            if fp8:
                out = turbo.ops.grouped_gemm_fp8(a, w, lens, trans_b=True, config=cfg)
            else:
                out = turbo.ops.grouped_gemm(a, w, lens, trans_b=True)
            out.backward(grad)
            _sync(device)
            step_ms.append((time.perf_counter() - t0) * 1e3)
            w.grad = None
        keys = len(autotune._memory)  # before the reset below, which drops it
    finally:
        for spec in specs:
            object.__setattr__(spec, "shared_problem", _grouped._token_bucketed)
        GlobalBackendManager.reset()
    wall_s = time.perf_counter() - start
    return dict(probe="dropless_tuning", shape=shape, mode="buckets" if shared else "exact", fp8=fp8, steps=steps,
                spread=spread, distinct_m_total=len({int(x.sum()) for x in lens_list}),
                keys_profiled=keys,
                candidate_runs=autotune.STATS.get("candidate_runs", 0) - runs0, wall_s=round(wall_s, 2),
                tail_step_ms=round(statistics.median(step_ms[-tail:]), 3), first_step_ms=round(step_ms[0], 1))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3_down")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--spread", type=float, default=0.1)
    ap.add_argument("--tail", type=int, default=10)
    ap.add_argument("--bf16", action="store_true", help="bf16 grouped_gemm instead of blockwise fp8")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.out:
        OUT.append(open(args.out, "w"))
    os.environ.setdefault("PRIMUS_TURBO_TUNE_BUDGET_MS", "300")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    emit(gpu=name, torch=torch.__version__, budget_ms=os.environ["PRIMUS_TURBO_TUNE_BUDGET_MS"])
    for shared in (True, False):
        emit(**run_mode(args.shape, shared, args.steps, args.spread, args.tail, not args.bf16, args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
