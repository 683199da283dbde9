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
import contextlib
import gc
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import torch

import turbo_dispatch as turbo
from turbo_dispatch import GlobalBackendManager, host_cover
from turbo_dispatch.backends.triton import prebound
from turbo_dispatch.low_precision import Float8QuantConfig
from turbo_dispatch.ops import grouped_gemm_fp8_step, grouped_gemm_grads, grouped_gemm_plan

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


def in_turns(fns: list[Callable[[], Any]], device: torch.device, calls: int, rounds: int
             ) -> list[tuple[float, float]]:
    """``host_us`` of each of ``fns``, one round of each in turn per round (a machine whose speed
    drifts during the run then shifts every row alike, so rows compare within the run)."""
    for fn in fns:
        fn()  # warm
    per_round: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for times, fn in zip(per_round, fns):
            times.append(host_us(fn, device, calls, 1)[0])
    return [(statistics.median(times), min(times)) for times in per_round]


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
    plan = _step_plan(a, b, lens, offs, cfg)
    def step_without_gc():
        was = gc.isenabled()
        gc.disable()
        try:
            step()
        finally:
            if was:
                gc.enable()

    def step_in_turn():
        with _replaced(_IN_TURN):
            step()

    pieces = [("whole step (forward + autograd.grad)", step),
              ("whole step, Python's garbage collector off", step_without_gc),
              ("whole step, its two side-stream forks run in turn on one stream", step_in_turn),
              ("forward alone, no grad (unplanned path)", forward)]
    pieces += layer_rows(step, plan, a.device)
    if plan is None or not plan._backward:
        return pieces
    (back,) = plan._backward.values()
    ad, bd = a.detach(), b.detach()
    qa, a_saved = plan.runs_both(ad, fwd, bs)
    qb, b_saved = plan.tiles_both(bd, fwd, bs)
    g_rows, g_cols = back.runs_both(grad, bwd, bs)

    def chained():
        qa, a_saved = plan.runs_both(ad, fwd, bs)
        qb, b_saved = plan.tiles_both(bd, fwd, bs)
        plan.forward(qa, qb, lens, offs)
        g_rows, g_cols = back.runs_both(grad, bwd, bs)
        back._mm8(g_rows, b_saved, lens, offs)
        back._mm8_k(g_cols, a_saved, lens, offs)

    return pieces + [
        ("the six pieces chained on each other's fresh results (no autograd, one stream)", chained),
        ("plan: quantise a (runs, both ways)", lambda: plan.runs_both(ad, fwd, bs)),
        ("plan: quantise b (tiles)", lambda: plan.tiles_both(bd, fwd, bs)),
        ("plan: forward GEMM", lambda: plan.forward(qa, qb, lens, offs)),
        ("plan: quantise the gradient (runs, both ways)", lambda: back.runs_both(grad, bwd, bs)),
        ("plan: dgrad GEMM", lambda: back._mm8(g_rows, b_saved, lens, offs)),
        ("plan: wgrad GEMM", lambda: back._mm8_k(g_cols, a_saved, lens, offs)),
    ]


def _in_turn(first: Callable[[], Any], second: Callable[[], Any], device: torch.device) -> tuple[Any, Any]:
    return first(), second()


#: ``side_by_side`` where the step calls it, replaced by a call in turn (``_replaced``'s form).
_IN_TURN = [(module, "side_by_side", lambda _: _in_turn) for module in (grouped_gemm_fp8_step, grouped_gemm_grads)]


def allocator_counts(step: Callable[[], Any], device: torch.device, calls: int) -> dict[str, float]:
    """Per step, over ``calls`` steps issued as ``host_us`` issues them: the caching allocator's
    allocations, and the device allocations, frees and retries under them (each a driver call
    of hundreds of us; a warm step should make none)."""
    names = ("allocation.all.allocated", "num_device_alloc", "num_device_free", "num_alloc_retries")
    before = torch.cuda.memory_stats(device)
    host_us(step, device, calls, 1)
    after = torch.cuda.memory_stats(device)
    return {name: (after.get(name, 0) - before.get(name, 0)) / calls for name in names}


def _step_plan(a, b, lens, offs, cfg):
    """The step plan the op keeps for these arguments, or None."""
    key = grouped_gemm_plan.step_key(a, b, lens, offs, True, None, cfg)
    return None if key is None else grouped_gemm_plan.lookup(key)


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

    # Made once: each stub keeps its first result across calls.
    stubs = [(owner, name, lambda _, stub=cached(getattr(owner, name)): stub) for owner, name in owners]

    def with_stubs():
        with _replaced(stubs):
            step()

    return rows + [("whole step, the six pieces returning cached results (the layers around them)", with_stubs)]


@contextlib.contextmanager
def _replaced(wraps: list) -> Iterator[None]:
    """Within the block, each attribute ``name`` of ``owner`` in ``wraps`` (``(owner, name, wrap)``)
    is ``wrap(its function)``; a class's static method stays a static method. Restored after."""
    saved = []
    try:
        for owner, name, wrap in wraps:
            raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            saved.append((owner, name, raw))
            if isinstance(raw, staticmethod):
                setattr(owner, name, staticmethod(wrap(raw.__func__)))
            else:
                setattr(owner, name, wrap(raw))
        yield
    finally:
        for owner, name, raw in reversed(saved):
            setattr(owner, name, raw)


def _timed(fn: Callable, totals: dict, label: str) -> Callable:
    """``fn`` adding its inclusive host time (s) to ``totals[label]`` on every call."""
    clock = time.perf_counter

    def timed(*args, **kwargs):
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += clock() - t0

    return timed


def in_step_split(step: Callable[[], Any], plan, device: torch.device, calls: int, rounds: int
                  ) -> list[tuple[str, float]]:
    """(label, median host us per step) of each layer and piece, timed inside the whole step
    (inclusive: a layer's time holds the pieces it calls), in the loop ``host_us`` runs: what the
    pieces cost where the step calls them, against their cost alone."""
    from turbo_dispatch.ops import grouped_gemm_autograd

    fn_cls = grouped_gemm_autograd.GroupedFp8Function
    (back,) = plan._backward.values()
    points = [
        ("op call: forward, autograd.Function.apply included", turbo.ops, "grouped_gemm_fp8"),
        ("  GroupedFp8Function.forward", fn_cls, "forward"),
        ("    quantize_for_step (a and b, side by side)", grouped_gemm_autograd, "quantize_for_step"),
        ("      fork/join of the quantisers (side_by_side)", grouped_gemm_fp8_step, "side_by_side"),
        ("        plan: quantise a", plan, "_runs"),
        ("        plan: quantise b", plan, "_tiles"),
        ("    plan: forward GEMM", plan, "_forward"),
        ("  GroupedFp8Function.backward", fn_cls, "backward"),
        ("    grouped_fp8_grads", grouped_gemm_autograd, "grouped_fp8_grads"),
        ("      plan: quantise the gradient", back, "_runs"),
        ("      fork/join of dgrad and wgrad (side_by_side)", grouped_gemm_grads, "side_by_side"),
        ("        plan: dgrad GEMM", back, "_mm8"),
        ("        plan: wgrad GEMM", back, "_mm8_k"),
    ]
    totals = {label: 0.0 for label, _, _ in points}
    totals["whole step"] = 0.0
    timed_step = _timed(step, totals, "whole step")
    per_round: dict = {label: [] for label in totals}
    with _replaced([(owner, name, lambda fn, label=label: _timed(fn, totals, label)) for label, owner, name in points]):
        timed_step()  # warm
        for _ in range(rounds):
            for label in totals:
                totals[label] = 0.0
            host_us(timed_step, device, calls, 1)
            for label, seconds in totals.items():
                per_round[label].append(seconds * 1e6 / calls)
    return [(label, statistics.median(values)) for label, values in per_round.items()]


def print_cprofile(step: Callable[[], Any], device: torch.device, calls: int, rounds: int, top: int) -> None:
    """The ``top`` functions by own time (cProfile, which slows Python code more than C calls) of
    the whole step's loop, per step. On CUDA autograd runs the backward on its device thread: from
    Python 3.12 a profile (``sys.monitoring``) sees every thread and one table holds both; before,
    it sees its own thread only, so a second profile, enabled inside the autograd function's
    backward, gives the backward's table."""
    import cProfile

    caller = cProfile.Profile()
    if sys.version_info >= (3, 12) or device.type == "cpu":  # one profile sees the backward too
        caller.enable()
        host_us(step, device, calls, rounds)
        caller.disable()
        _print_profile("the step, all its threads", caller, calls * rounds, top)
        return
    from turbo_dispatch.ops import grouped_gemm_autograd

    backward = cProfile.Profile()

    def profiled(original):
        def profiled_backward(ctx, grad):
            backward.enable()
            try:
                return original(ctx, grad)
            finally:
                backward.disable()

        return profiled_backward

    with _replaced([(grouped_gemm_autograd.GroupedFp8Function, "backward", profiled)]):
        caller.enable()
        host_us(step, device, calls, rounds)
        caller.disable()
    for title, profile in (("calling thread", caller), ("backward on autograd's thread", backward)):
        _print_profile(title, profile, calls * rounds, top)


def _print_profile(title: str, profile, steps: int, top: int) -> None:
    import pstats

    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]
    print(f"\ncProfile, {title} ({steps} steps): own and inclusive us per step")
    print("| function | calls per step | own us | inclusive us |")
    print("|---|---:|---:|---:|")
    for (path, line, name), (_, ncalls, own, inclusive, _) in rows:
        where = f"{path.rsplit('/', 2)[-1]}:{line}" if line else path
        print(f"| {name} ({where}) | {ncalls / steps:.1f} | {own * 1e6 / steps:.1f} | {inclusive * 1e6 / steps:.1f} |")


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
    parser.add_argument("--cprofile", type=int, default=0, metavar="TOP",
                        help="also print the TOP functions by own time (cProfile) of the whole step's loop")
    parser.add_argument("--launcher-object", action="store_true",
                        help="launch Triton kernels through Triton's launcher object instead of its C function "
                             "(PRIMUS_TURBO_TRITON_C_LAUNCH=0): the A/B of that path")
    args = parser.parse_args(argv)
    if args.launcher_object:
        os.environ[prebound.C_LAUNCH_ENV] = "0"  # read when each plan is bound, all below
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
    launcher = ", launcher object" if args.launcher_object else ""
    print(f"probe_step_host: {name}, torch {torch.__version__}; G={g} x {t} tokens, N={n}, K={k}, blockwise fp8, "
          f"backend {args.backend}{launcher}; host us per call, {args.calls} calls x {args.rounds} rounds, "
          "the rows in turn each round")
    rows = step_pieces(a, b, lens, offs, grad, cfg) + primitives(device, (g * t, n), offs)
    if device.type == "cuda":
        rows.append(("bf16 torch._grouped_mm step (forward + autograd.grad)", bf16_step(a, b, offs, grad)))
    print("| what | host us per call (median) | min |")
    print("|---|---:|---:|")
    pieces_sum = 0.0
    timed = in_turns([fn for _, fn in rows], device, args.calls, args.rounds)
    for (label, _), (median, low) in zip(rows, timed):
        if label.startswith("plan:"):
            pieces_sum += median
        print(f"| {label} | {median:.1f} | {low:.1f} |", flush=True)
    if pieces_sum:
        print(f"| sum of the plan's six pieces | {pieces_sum:.1f} | |")
    if device.type == "cuda":
        counts = allocator_counts(rows[0][1], device, args.calls)
        print("\nCaching allocator per whole step: " + ", ".join(f"{k} {v:.1f}" for k, v in counts.items()))
    plan = _step_plan(a, b, lens, offs, cfg)
    if plan is not None and plan._backward:
        step = step_pieces(a, b, lens, offs, grad, cfg)[0][1]
        print("\nInside the whole step (inclusive host us per step, median over rounds; depth: what calls what):")
        print("| depth | layer or piece | host us per step |")
        print("|---:|---|---:|")
        for label, us in in_step_split(step, plan, device, args.calls, args.rounds):
            print(f"| {(len(label) - len(label.lstrip())) // 2} | {label.strip()} | {us:.1f} |", flush=True)
        if args.cprofile:
            print_cprofile(step, device, args.calls, args.rounds, args.cprofile)
    GlobalBackendManager.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
