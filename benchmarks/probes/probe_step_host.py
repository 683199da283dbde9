#!/usr/bin/env python3
"""Where the host time of an eager fp8 blockwise grouped training step goes.

The eager ``grouped_gemm_fp8`` step (forward, dgrad, wgrad and the three quantisations) issues its
work in more host time than the bf16 ``torch._grouped_mm`` step, and at small expert layers the
host, not the GPU, bounds a training loop. This probe times, as host microseconds per call in a
loop of back-to-back calls issued while the GPU is held busy (so that no call waits for the GPU),
the whole step and each piece of its per-call-key plan (``ops/grouped_gemm_plan.py``) alone,
beside the primitives they are made of: an allocation, a torch launch, a Triton launch through a
pre-bound plan, an event fork and join. The pieces' sum against the whole step says how much the
layers around them cost.

Usage:
    python benchmarks/probes/probe_step_host.py                          # Qwen3-30B-A3B down, EP8
    python benchmarks/probes/probe_step_host.py --groups 16 --tokens-per-group 2048 --n 4096 --k 1536
    python benchmarks/probes/probe_step_host.py --device cpu --tokens-per-group 64 --n 256 --k 256

On the CPU the plan's pieces are the CPU backends' and the CUDA primitives are left out (a smoke run
of the probe itself; the numbers mean nothing for a GPU).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import torch

import turbo_dispatch as turbo
from turbo_dispatch import GlobalBackendManager, host_cover
from turbo_dispatch.low_precision import Float8QuantConfig
from turbo_dispatch.ops import grouped_gemm_plan

#: GPU time the spin holds the stream for while a round of calls is issued (ms): longer than any
#: round's host time, so that no call waits for the GPU.
SPIN_MS = 60.0


def host_us(fn: Callable[[], Any], device: torch.device, calls: int, rounds: int) -> tuple[float, float]:
    """(median, min) over ``rounds`` of the host time per call (us) of ``calls`` back-to-back calls,
    issued behind a GPU spin on CUDA."""
    per_call = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda._sleep(int(SPIN_MS * host_cover.cycles_per_ms(device)))
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) * 1e6 / calls)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return statistics.median(per_call), min(per_call)


def step_pieces(a, b, lens, offs, grad, cfg) -> list[tuple[str, Callable[[], Any]]]:
    """The step and its plan's pieces, each a callable on inputs made once here."""
    fwd, bwd, bs = cfg.format.fwd_dtype(), cfg.format.bwd_dtype(), cfg.block_size

    def step():
        out = turbo.ops.grouped_gemm_fp8(a, b, lens, offs, config=cfg)
        torch.autograd.grad(out, (a, b), grad)

    def forward():
        with torch.no_grad():
            turbo.ops.grouped_gemm_fp8(a.detach(), b.detach(), lens, offs, config=cfg)

    for _ in range(3):
        step()
    key = grouped_gemm_plan.step_key(a, b, lens, offs, True, None, cfg)
    plan = None if key is None else grouped_gemm_plan.lookup(key)
    pieces = [("whole step (forward + autograd.grad)", step), ("forward alone, no grad (unplanned path)", forward)]
    pieces += layer_rows(step, plan, a.device)
    if plan is None or not plan._backward:
        return pieces
    (back,) = plan._backward.values()
    ad, bd = a.detach(), b.detach()
    qa, a_saved = plan.runs_both(ad, fwd, bs)
    qb, b_saved = plan.tiles_both(bd, fwd, bs)
    g_rows, g_cols = back.runs_both(grad, bwd, bs)
    return pieces + [
        ("plan: quantise a (runs, both ways)", lambda: plan.runs_both(ad, fwd, bs)),
        ("plan: quantise b (tiles)", lambda: plan.tiles_both(bd, fwd, bs)),
        ("plan: forward GEMM (+ padded-tail zeroing)", lambda: plan.forward(qa, qb, lens, offs)),
        ("plan: quantise the gradient (runs, both ways)", lambda: back.runs_both(grad, bwd, bs)),
        ("plan: dgrad GEMM (+ padded-tail zeroing)", lambda: back._mm8(g_rows, b_saved, lens, offs)),
        ("plan: wgrad GEMM", lambda: back._mm8_k(g_cols, a_saved, lens, offs)),
    ]


class _PassThrough(torch.autograd.Function):
    """The least a Python autograd function costs: forward and backward hand their input on."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def layer_rows(step: Callable[[], Any], plan, device: torch.device) -> list[tuple[str, Callable[[], Any]]]:
    """The layers around the plan's pieces: the step with each piece returning its first result
    again (no launch, no allocation), beside what Python and a Python autograd function cost here."""
    x = torch.ones(16, device=device, requires_grad=True)
    gx = torch.ones(16, device=device)

    def noop():
        pass

    def hundred_noops():
        for _ in range(100):
            noop()

    rows = [("100 calls of a no-op Python function", hundred_noops),
            ("a pass-through Python autograd function: forward + autograd.grad",
             lambda: torch.autograd.grad(_PassThrough.apply(x), (x,), gx))]
    if plan is None or not plan._backward:
        return rows
    (back,) = plan._backward.values()
    owners = [(plan, "_runs"), (plan, "_tiles"), (plan, "_forward"), (back, "_runs"), (back, "_mm8"), (back, "_mm8_k")]

    def cached(fn):
        kept = []

        def again(*args):
            if not kept:
                kept.append(fn(*args))
            return kept[0]

        return again

    stubs = [cached(getattr(owner, name)) for owner, name in owners]
    originals = [getattr(owner, name) for owner, name in owners]

    def with_stubs():
        for (owner, name), stub in zip(owners, stubs):
            setattr(owner, name, stub)
        try:
            step()
        finally:
            for (owner, name), fn in zip(owners, originals):
                setattr(owner, name, fn)

    return rows + [("whole step, the six pieces returning cached results (the layers around them)", with_stubs)]


def primitives(device: torch.device, out_shape: tuple, offs) -> list[tuple[str, Callable[[], Any]]]:
    """What the pieces are made of, on CUDA."""
    if device.type != "cuda":
        return []
    from turbo_dispatch.backends.triton.grouped_launch import prepare_zero_padded_tail
    from turbo_dispatch.low_precision.side_streams import side_by_side

    out = torch.empty(out_shape, dtype=torch.bfloat16, device=device)
    tiny = torch.ones(16, device=device)
    rezero = prepare_zero_padded_tail(out, offs)
    return [
        ("torch.empty (the step's output)", lambda: torch.empty(out_shape, dtype=torch.bfloat16, device=device)),
        ("torch.zeros(1, int32)", lambda: torch.zeros(1, dtype=torch.int32, device=device)),
        ("torch.add of 16 floats (one torch launch)", lambda: torch.add(tiny, tiny)),
        ("Triton launch through a pre-bound plan (tail zeroing)", lambda: rezero(out, offs)),
        ("side_by_side fork and join of two no-ops", lambda: side_by_side(lambda: None, lambda: None, device)),
    ]


def bf16_step(a, b, offs, grad) -> Callable[[], Any]:
    offs32 = offs[1:].to(torch.int32)
    a16, b16 = a.detach().requires_grad_(), b.detach().requires_grad_()

    def step():
        out = torch._grouped_mm(a16, b16.transpose(-2, -1), offs=offs32)
        torch.autograd.grad(out, (a16, b16), grad)

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--tokens-per-group", type=int, default=4096)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--k", type=int, default=768)
    parser.add_argument("--backend", default="TRITON", help="grouped_gemm_fp8 backend to pin (default TRITON; "
                        "'auto' leaves the choice to the op)")
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per round (default 20)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    g, t, n, k = args.groups, args.tokens_per_group, args.n, args.k
    GlobalBackendManager.reset()
    if args.backend.lower() != "auto":
        GlobalBackendManager.set_grouped_gemm_backend(args.backend, precision="fp8")
    cfg = Float8QuantConfig(granularity="blockwise", block_size=128)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(g * t, k, generator=gen).bfloat16().to(device).requires_grad_()
    b = torch.randn(g, n, k, generator=gen).bfloat16().to(device).requires_grad_()
    grad = torch.randn(g * t, n, generator=gen).bfloat16().to(device)
    lens = torch.full((g,), t, dtype=torch.int64, device=device)
    offs = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"probe_step_host: {name}, torch {torch.__version__}; G={g} x {t} tokens, N={n}, K={k}, blockwise fp8, "
          f"backend {args.backend}; host us per call, {args.calls} calls x {args.rounds} rounds")
    rows = step_pieces(a, b, lens, offs, grad, cfg) + primitives(device, (g * t, n), offs)
    if device.type == "cuda":
        rows.append(("bf16 torch._grouped_mm step (forward + autograd.grad)", bf16_step(a, b, offs, grad)))
    print("| what | host us per call (median) | min |")
    print("|---|---:|---:|")
    pieces_sum = 0.0
    for label, fn in rows:
        fn()  # warm
        median, low = host_us(fn, device, args.calls, args.rounds)
        if label.startswith("plan:"):
            pieces_sum += median
        print(f"| {label} | {median:.1f} | {low:.1f} |", flush=True)
    if pieces_sum:
        print(f"| sum of the plan's six pieces | {pieces_sum:.1f} | |")
    GlobalBackendManager.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
