"""Where the eager blockwise fp8 step's allocations spend host time (GPU probe).

Round 149's operator profile of the step (``probe_host_layers.py --aten``) showed its 15
``aten::empty`` calls per step at ~45 us of CPU each, against ~8 us for the bf16 step's
``empty_strided`` and ~12 us for one ``torch.empty`` timed alone. This probe asks why:

* ``step`` host time (batches of back-to-back steps behind one GPU spin, as
  ``probe_host_layers.host_us``) with the step's two-stream forks on, off (``overlappable`` made
  False: every kernel on the current stream), and each fork alone off;
* per-call CPU time of every ``aten::empty`` in 5 steps, with its shape, under torch.profiler,
  for the forks on and off: the slowest calls and the median;
* the step's allocations replayed alone (their shapes and dtypes, 10 per batch);
* what a user's eager loop sees: ``wall`` time per step over 50 steps issued back to back with
  no spin (max of host and GPU), the step's GPU time with its host time covered
  (``host_cover``), and the caching allocator's counters (device allocations, retries, frees of
  cached blocks) over those steps, for the forks on and off and for the bf16 step.

``--graphed`` instead times, in turns, what the same loop sees with each step captured once in a
CUDA graph and replayed (the remedy for a host-bound eager step) against the eager steps, fp8
and bf16: wall per step over 50 steps (replays) back to back, and GPU time with the host covered.

Usage (repo installed): ``python3 tools/probe_host_alloc.py --shape qwen3_down [--graphed] --out FILE``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import sys
from pathlib import Path

import torch

from turbo_dispatch import BackendType, GlobalBackendManager
from turbo_dispatch.backends import quantizer

sys.path.insert(0, str(Path(__file__).parent))
from probe_grouped_step import OUT, emit, step_fn, step_graph, step_operands, time_ms  # noqa: E402  (sibling in tools/)
from probe_host_layers import SPIN_CYCLES, host_us  # noqa: E402

_grouped = importlib.import_module("turbo_dispatch.ops.grouped_gemm")


@contextlib.contextmanager
def forks(forward: bool, backward: bool):
    """The step's two-stream forks switched as asked: the forward's (quantisers side by side)
    through ``quantizer.overlappable`` as the forward sees it, the backward's through
    ``BACKWARD_SIDE_BY_SIDE``."""
    saved = quantizer.overlappable, _grouped.BACKWARD_SIDE_BY_SIDE
    original = saved[0]
    if not forward:
        # _quantize_both_operands imports overlappable at call time; the backward's fork is
        # switched by its own flag, so it keeps the real predicate.
        def only_backward(t):
            frame = sys._getframe(1)
            return original(t) if frame.f_code.co_name != "_quantize_both_operands" else False

        quantizer.overlappable = only_backward
    _grouped.BACKWARD_SIDE_BY_SIDE = backward
    try:
        yield
    finally:
        quantizer.overlappable, _grouped.BACKWARD_SIDE_BY_SIDE = saved


def _record_on(result, stream) -> None:
    """The ``record_stream`` of every tensor in ``result`` that ``side_by_side`` made up to round
    152 (QuantizedTensors' data and scale, tuples of them)."""
    if isinstance(result, torch.Tensor):
        result.record_stream(stream)
    elif hasattr(result, "data") and hasattr(result, "scale"):
        _record_on(result.data, stream)
        _record_on(result.scale, stream)
    elif isinstance(result, (tuple, list)):
        for item in result:
            _record_on(item, stream)


@contextlib.contextmanager
def with_record_stream():
    """``side_by_side`` as it was up to round 152: its side outputs ``record_stream``-ed on the
    caller's stream (the same-run reference for the change)."""
    saved = quantizer.side_by_side

    def recorded(first, second, device):
        out = saved(first, second, device)
        _record_on(out[1], torch.cuda.current_stream(device))
        return out

    quantizer.side_by_side = recorded
    try:
        yield
    finally:
        quantizer.side_by_side = saved


def empties(run, steps: int = 5) -> list[tuple[float, str]]:
    """(CPU us, shape) of every aten::empty / empty_strided the ``steps`` steps dispatch."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            run()
    torch.cuda.synchronize()
    out = []
    for evt in prof.events():
        if evt.name in ("aten::empty", "aten::empty_strided"):
            out.append((evt.cpu_time_total, str(evt.input_shapes[:1])))
    return out


#: The caching allocator's counters ``wall`` reports (their growth over the timed steps).
ALLOC_STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def wall(run, steps: int = 50) -> tuple[float, dict]:
    """(ms per step, allocator counter growth) of ``steps`` steps issued back to back, no spin,
    one synchronisation at the end: the time an eager training loop sees."""
    import time

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    after = torch.cuda.memory_stats()
    return ms, {k: after.get(k, 0) - before.get(k, 0) for k in ALLOC_STATS}


def graphed_against_eager(shape: str, a, w, lens, offs, cfg, grad, turns: int = 3) -> None:
    """Wall per step of 50 steps back to back, eager and as replays of one CUDA graph of the
    step (``step_graph``), fp8 blockwise (TRITON) and bf16 (TORCH), in turns; with each its GPU
    time (host covered)."""
    pins = {"fp8": (BackendType.TRITON, "fp8"), "bf16": (BackendType.TORCH, "bf16")}
    graphs = {}
    for name, (backend, precision) in pins.items():
        GlobalBackendManager.set_grouped_gemm_backend(backend, precision=precision)
        graphs[name] = step_graph(a, w, lens, offs, cfg if name == "fp8" else None, grad)
    for _ in range(turns):
        for name, (backend, precision) in pins.items():
            GlobalBackendManager.set_grouped_gemm_backend(backend, precision=precision)
            eager = step_fn(a, w, lens, offs, cfg if name == "fp8" else None, grad)
            for mode, run in (("eager", eager), ("graph", graphs[name].replay)):
                ms, stats = wall(run)
                emit(probe="graphed", shape=shape, variant=name, mode=mode, wall_ms=ms, gpu_ms=time_ms(run),
                     **stats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3_down")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--record-only", action="store_true",
                    help="only the forks as they are, with record_stream as before round 153, and none, in turns")
    ap.add_argument("--graphed", action="store_true",
                    help="only eager steps against replays of one CUDA graph of the step, fp8 and bf16, in turns")
    args = ap.parse_args()
    if args.out:
        OUT.append(open(args.out, "w"))
    _, _, _, lens, offs, a, w, grad, cfg = step_operands(args.shape)
    GlobalBackendManager.reset()
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="fp8")
    step = step_fn(a, w, lens, offs, cfg, grad)
    if args.graphed:
        graphed_against_eager(args.shape, a, w, lens, offs, cfg, grad)
        return 0
    if args.record_only:
        variants = (("forks", contextlib.nullcontext), ("forks_record_stream", with_record_stream),
                    ("no_forks", lambda: forks(False, False)))
        for _ in range(3):
            for name, ctx in variants:
                with ctx():
                    med, low = host_us(step, args.reps)
                    ms, stats = wall(step)
                emit(probe="record", shape=args.shape, variant=name, host_median_us=med, host_min_us=low,
                     wall_ms=ms, **stats)
        for name, ctx in variants:
            with ctx():
                calls = empties(step)
                gpu = time_ms(step)
            emit(probe="record_empties", shape=args.shape, variant=name, gpu_ms=gpu,
                 total_us_per_step=sum(t for t, _ in calls) / 5,
                 slowest=[f"{t:.0f}us" for t, _ in sorted(calls, reverse=True)[:4]])
        return 0
    for _ in range(2):  # turns: the device's host is noisy
        for fwd, bwd in ((True, True), (False, False), (False, True), (True, False)):
            with forks(fwd, bwd):
                med, low = host_us(step, args.reps)
            emit(probe="host_forks", shape=args.shape, forward_fork=fwd, backward_fork=bwd, median_us=med,
                 min_us=low)
    for fwd_bwd in (True, False):
        with forks(fwd_bwd, fwd_bwd):
            calls = empties(step)
        times = sorted(calls, reverse=True)
        emit(probe="empties", shape=args.shape, forks=fwd_bwd, calls_per_step=len(calls) / 5,
             median_us=statistics.median(t for t, _ in calls), total_us_per_step=sum(t for t, _ in calls) / 5,
             slowest=[f"{t:.0f}us {s}" for t, s in times[:12]])
    bf16 = step_fn(a, w, lens, offs, None, grad)
    for _ in range(2):
        for fwd_bwd in (True, False):
            with forks(fwd_bwd, fwd_bwd):
                ms, stats = wall(step)
                gpu = time_ms(step)
            emit(probe="wall", shape=args.shape, variant="fp8", forks=fwd_bwd, wall_ms=ms, gpu_ms=gpu, **stats)
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH, precision="bf16")
        ms, stats = wall(bf16)
        emit(probe="wall", shape=args.shape, variant="bf16", wall_ms=ms, gpu_ms=time_ms(bf16), **stats)
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="fp8")
    with forks(True, True):
        before = torch.cuda.memory_stats()
        med, low = host_us(step, args.reps)
        after = torch.cuda.memory_stats()
    emit(probe="host_us_allocator", shape=args.shape, median_us=med,
         **{k: after.get(k, 0) - before.get(k, 0) for k in ALLOC_STATS})
    # The allocations alone, same shapes, dtype and device as a step's quantiser outputs.
    t, n, k = a.shape[0], w.shape[1], w.shape[2]
    shapes = [((t, -(-k // 16) * 16), torch.float8_e4m3fn), ((k, -(-t // 16) * 16), torch.float8_e4m3fn),
              ((t, 16), torch.float32), ((-(-t // 128), k), torch.float32), ((t, n), torch.bfloat16)]

    def alloc():
        return [torch.empty(s, dtype=d, device="cuda") for s, d in shapes]

    med, low = host_us(alloc, args.reps)
    emit(probe="alloc_alone", shape=args.shape, tensors=len(shapes), median_us_per_call=med / len(shapes),
         min_us_per_call=low / len(shapes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
