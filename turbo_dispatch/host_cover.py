"""Keep the GPU busy while the host issues a timed call, so CUDA events time GPU work alone.

A call timed as ``start.record(); fn(); end.record()`` on an idle GPU counts the host's issue time
(Python, dispatch, autograd, launches) as GPU time wherever the host is slower than the GPU: on
small shapes the events then time the host, and two kernels compare by their launch paths. A GPU
spin (``torch.cuda._sleep``) enqueued before the start event keeps the stream busy while the host
enqueues the call; sized to the call's measured host time, the events see only GPU work. Used by
the autotuner (``autotune._time_ms``) and the benchmark harness (``benchmarks/harness.py``).

>>> cover_cycles(0.2, 2e6)  # 0.2 ms of host time at 2 GHz: the floor, 1e6 cycles (~0.5 ms)
1000000
"""
from __future__ import annotations

import functools
import math
import statistics
import time
from typing import Any, Callable, Sequence

import torch

#: GPU clock cycles of the spin before each timed call, at least: ~0.5 ms at Hopper clocks
#: (1.6-2 GHz). Calls whose host issue time is longer get a longer spin (``cover_cycles``).
FLOOR_CYCLES = 1_000_000
#: The longest spin, in ms of GPU time: a host stall measured in the untimed calls (a collection,
#: a compile) must not make every timed call wait that long.
CAP_MS = 50.0
#: The spin is sized to 1.5x the typical host issue time plus 0.1 ms. The typical time is a median
#: of a few untimed calls, and a call's host time varies from call to call (Python, the allocator,
#: the launch queue); the 0.1 ms pays for the start event's record and whatever a very short
#: call's median misses. Too long a spin only costs wall time (it runs before the start event);
#: too short a one lets host time count as GPU time, hence the margin.
MARGIN = 1.5
SLACK_MS = 0.1
#: Plausible GPU clocks for the ``torch.cuda._sleep`` calibration (0.1-5 GHz, in cycles per ms);
#: outside it the measurement is taken as broken and ``FALLBACK_CYCLES_PER_MS`` (2 GHz) is used.
CYCLES_PER_MS_RANGE = (1e5, 5e6)
FALLBACK_CYCLES_PER_MS = 2e6


def cover_cycles(host_ms: float, cycles_per_ms: float, floor: int = FLOOR_CYCLES, cap_ms: float = CAP_MS) -> int:
    """GPU cycles of the spin that covers a call whose typical host issue time is ``host_ms``:
    (host_ms x margin + slack) worth of cycles, at least ``floor``, at most ``cap_ms`` worth."""
    need = math.ceil((max(host_ms, 0.0) * MARGIN + SLACK_MS) * cycles_per_ms)
    return int(min(max(floor, need), math.ceil(cap_ms * cycles_per_ms)))


def typical_ms(samples: Sequence[float]) -> float:
    """Median host time of a function's untimed calls, leaving out the first where there are
    more: a first call may compile or autotune (seconds), which no later call repeats."""
    rest = list(samples[1:]) or list(samples)
    return statistics.median(rest) if rest else 0.0


@functools.lru_cache(maxsize=None)
def cycles_per_ms(device: torch.device) -> float:
    """GPU cycles per ms of ``torch.cuda._sleep`` on ``device``, measured once per process: the
    spin counts clock cycles, and the clock differs by GPU and by power state. The larger of two
    measurements is kept (a higher clock means more cycles per ms: a spin sized from it errs long,
    the safe side)."""
    n = 10_000_000  # ~5 ms at 2 GHz: launch costs are noise against it
    with torch.cuda.device(device):
        torch.cuda._sleep(FLOOR_CYCLES)  # warm-up: loads the kernel, raises the clock
        rates = []
        for _ in range(2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(n)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
            rates.append(n / ms if ms > 0 else 0.0)
    rate = max(rates)
    lo, hi = CYCLES_PER_MS_RANGE
    return rate if lo <= rate <= hi else FALLBACK_CYCLES_PER_MS


def untimed_host_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Host issue time (ms) of one untimed call of ``fn``, started on an idle GPU (synchronised
    first on CUDA, so the time holds no wait for earlier work): a sample for ``typical_ms``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def loop_host_ms(fn: Callable[[int], Any], device: torch.device, calls: int) -> float:
    """Host time (ms) per call of ``calls`` back-to-back calls ``fn(0) .. fn(calls - 1)``, started
    on an idle GPU and with no synchronisation between them: the issue rate a caller's loop sees.

    A single call timed on its own after a synchronisation pays for a cold start (caches, the
    driver's launch path) that a loop amortises; where the host bounds the loop, that difference
    can reorder launch paths of equal GPU cost.

    >>> loop_host_ms(lambda i: None, torch.device("cpu"), 4) >= 0.0
    True
    """
    if calls < 1:
        raise ValueError(f"loop_host_ms: calls must be >= 1, got {calls}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    per_call = (time.perf_counter() - t0) * 1e3 / calls
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return per_call


def covered_call(fn: Callable[[], Any], device: torch.device, host_ms: float) -> tuple[float, float]:
    """(GPU ms, host issue ms) of one CUDA call of ``fn`` between two events, after the spin that
    covers a typical host time of ``host_ms``."""
    spin(device, host_ms)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host


def spin(device: torch.device, host_ms: float) -> None:
    """Enqueue the spin that covers a call of typical host time ``host_ms`` on ``device``'s
    current stream (nothing where torch has no ``cuda._sleep``)."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(cover_cycles(host_ms, cycles_per_ms(device)))


def median_gpu_ms(fn: Callable[[], Any], device: torch.device, reps: int = 20) -> float:
    """Median GPU time (ms) of ``reps`` covered calls of ``fn``, the spin sized from the typical
    host time of three untimed calls (which also warm it up): the probes' timing."""
    host_ms = typical_ms([untimed_host_ms(fn, device) for _ in range(3)])
    return statistics.median(covered_call(fn, device, host_ms)[0] for _ in range(reps))
