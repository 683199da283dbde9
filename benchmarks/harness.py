"""Shared benchmark harness: timing, correctness gate, CSV / markdown / PNG reports.

Every benchmark script builds ``Row`` objects through ``Bench`` and calls ``write_reports``:

* timing (``time_ms``): CUDA events around each call, an L2 flush (a write of twice the L2 size)
  before every timed call so no operand is served from cache, optional rotation over several
  input sets, a few warm-ups, then the *median* of a number of repeats chosen from a time budget
  (more repeats for short calls, at least ``min_repeats`` for long ones). A GPU spin before each
  timed call, sized to the call's host issue time measured in its untimed calls, keeps the host's
  time out of the window, so the times are GPU time. On the CPU it uses
  ``time.perf_counter`` and the reports say that CPU timings are meaningless (smoke runs only);
* the ``check`` column: PASS/FAIL from a gate against a float64 (CPU) / float32 (GPU) reference:
  relative error for bf16/fp16 outputs, SNR for fp8 (25 dB E4M3, 20 dB with E5M2). A FAIL *voids*
  the timing: TFLOPS and ratios are left empty, so a wrong-but-fast kernel never scores;
* ``step_host_ms``: the host's time to issue one forward+backward step (the forward's where no
  step is timed), measured around the timed calls; where it nears ``step_ms``, the host, not the
  GPU, would bound a training loop (on the CPU it is the wall time);
* ``ratio_vs_best_peer``: for each shape, (best time among the PASSing peer rows) / (this row's
  time) on the headline metric (combined step when timed, else forward); > 1 means faster than
  the best plain-PyTorch peer;
* the score: geomean over shapes of TFLOPS and of the ratio, per backend, over the shapes where
  both the backend and a peer passed (coverage shown); for the backends a script names (e.g. the
  autotuned row) a "lowest shape" line gives the lowest ratio and the shape it was measured on;
* results land in ``<out>/<gpu>_<date>_<name>.{csv,md,png}``, where ``<out>`` is ``--out`` (alias
  ``--out-dir``), else ``$TURBO_BENCH_OUT``, else ``bench-out/`` at the repository root (ignored by
  git: results are run artifacts, and docs/performance.md keeps the figures that last); the
  markdown header names the GPU, date, torch/triton/CUDA versions and the command line.
  matplotlib is optional: without it the PNG is skipped with a message.
"""
from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import math
import os
import platform
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from bench_out import DEFAULT_OUT, OUT_ENV, resolve_out_dir
from turbo_dispatch import host_cover

#: CSV columns every op writes, in order; op-specific extras (``Row.extra``) follow them.
BASE_COLUMNS = ["op", "shape", "model", "mb", "m", "n", "k", "backend", "check", "snr_db", "rel_err", "fwd_ms",
                "bwd_ms", "step_ms", "fwd_tflops", "step_tflops", "step_host_ms", "ratio_vs_best_peer", "peer",
                "note"]

REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 5e-3}


# -- environment -----------------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def gpu_slug(device: torch.device) -> str:
    """Short file-name tag of the device: ``h100``, ``h200``, ``mi300x``; ``cpu`` on the CPU."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    words = [w for w in re.split(r"[^A-Za-z0-9]+", name) if w and w.upper() not in ("NVIDIA", "AMD", "INSTINCT")]
    return (words[0] if words else "gpu").lower()


def environment(device: torch.device) -> dict[str, str]:
    """Versions and device facts for the report header."""
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = "not installed"
    env = {
        "device": device_name(device),
        "date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": str(torch.version.cuda),
        "hip": str(getattr(torch.version, "hip", None)),
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["sm_count"] = str(props.multi_processor_count)
        env["capability"] = "sm_%d%d" % torch.cuda.get_device_capability(device)
    return env


# -- timing ----------------------------------------------------------------------------------------
# The spin before each timed call is turbo_dispatch.host_cover's (shared with the autotuner).


class Timer:
    """Median-of-repeats timing with CUDA events and an L2 flush before each timed call, so rows
    compare GPU time. The host's time to issue a call would otherwise count as GPU time (the GPU
    idles inside the timed window while the host enqueues the work), so a GPU spin before the
    start event covers it: the spin is sized per function to its host issue time measured in the
    untimed calls (see ``host_cover.cover_cycles``; at least ~0.5 ms, at most 50 ms). Host time is reported
    apart: after each ``time_ms`` / ``time_interleaved``, ``last_host_ms`` holds each function's
    median host issue time (ms) over its timed calls, where the host, not the GPU, would bound a
    loop of such calls. Dispatch overhead has its own benchmark (bench_dispatch_overhead.py).

    ``target_ms`` bounds how long one measurement takes: repeats = target / (estimated time of one
    call), clamped to [min_repeats, max_repeats]. ``quick`` cuts warm-ups and repeats for smoke runs.
    """

    def __init__(self, device: torch.device, *, warmup: int = 2, min_repeats: int = 3, max_repeats: int = 25,
                 target_ms: float = 150.0):
        self.device = device
        self.warmup, self.min_repeats, self.max_repeats, self.target_ms = warmup, min_repeats, max_repeats, target_ms
        #: host issue time (ms) of each function of the last ``time_ms`` (one) / ``time_interleaved`` call
        self.last_host_ms: list[float] = []
        self._flush = None
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20)
            self._flush = torch.empty(2 * l2 // 4, dtype=torch.int32, device=device)

    def time_ms(self, fn: Callable[..., Any], sets: Sequence[Any] | None = None,
                setup: Callable[[], Any] | None = None) -> float:
        """Median milliseconds of ``fn()`` (or ``fn(sets[i % len(sets)])`` rotating input sets).
        ``setup`` runs before each call, untimed (e.g. to drop gradients). Sets ``last_host_ms``
        to ``[host issue time of fn]``."""
        call = (lambda i: fn()) if not sets else (lambda i: fn(sets[i % len(sets)]))
        gpu = self.device.type == "cuda"
        untimed: list[float] = []
        for i in range(self.warmup):
            if setup:
                setup()
            self._untimed(call, i, untimed)
        if gpu:
            torch.cuda.synchronize(self.device)
        # one timed call to size the number of repeats
        first = self._one(call, 0, setup, untimed)
        repeats = self._repeats(first[0])
        samples = [first] + [self._one(call, i + 1, setup, untimed) for i in range(repeats - 1)]
        self.last_host_ms = [self._host_ms([h for _, h in samples], untimed)]
        return statistics.median(ms for ms, _ in samples)

    def time_interleaved(self, fns: Sequence[Callable[[], Any]],
                         setups: Sequence[Callable[[], Any] | None] | None = None, per_turn: int = 2) -> list[float]:
        """Median milliseconds of each of ``fns``, timed in turns, so that slow drifts of the GPU
        (clocks falling as it heats) reach all of them alike. A turn of ``fns[j]`` runs
        ``setups[j]``, one untimed call, then ``per_turn`` timed calls; the untimed call warms
        what the setup dropped (pinning a backend starts a new settings generation, whose
        dispatch decisions are then resolved again: host work that would otherwise show as GPU
        idle time, and that training never pays between steps, since its settings stay put).
        Turns rotate their starting function; the repeat count comes from the slowest function's
        first samples. Sets ``last_host_ms`` to each function's host issue time."""
        setups = list(setups) if setups is not None else [None] * len(fns)
        calls = [(lambda i, fn=fn: fn()) for fn in fns]
        untimed: list[list[float]] = [[] for _ in calls]
        for j, (call, setup) in enumerate(zip(calls, setups)):
            for i in range(self.warmup):
                if setup:
                    setup()
                self._untimed(call, i, untimed[j])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        samples: list[list[tuple[float, float]]] = [[] for _ in calls]  # (GPU ms, host ms) per timed call

        def turn(j: int, i: int) -> None:
            if setups[j]:
                setups[j]()
            self._untimed(calls[j], i, untimed[j])
            samples[j] += [self._one(calls[j], i + k, None, untimed[j]) for k in range(per_turn)]

        for j in range(len(calls)):
            turn(j, 0)
        repeats = self._repeats(max(statistics.median(ms for ms, _ in s) for s in samples) if samples else 0.0)
        t = 1
        while samples and min(len(s) for s in samples) < repeats:
            for j in rotated(range(len(calls)), t):
                turn(j, t * per_turn)
            t += 1
        self.last_host_ms = [self._host_ms([h for _, h in s], u) for s, u in zip(samples, untimed)]
        return [statistics.median(ms for ms, _ in s) for s in samples]

    def _repeats(self, estimate_ms: float) -> int:
        """Samples per measurement: ``target_ms`` worth of calls of ``estimate_ms`` each, clamped to
        [min_repeats, max_repeats]."""
        return int(min(self.max_repeats, max(self.min_repeats, self.target_ms / max(estimate_ms, 1e-3))))

    @staticmethod
    def _host_ms(timed: Sequence[float], untimed: Sequence[float]) -> float:
        """A function's host issue time: the median over its timed calls, the steady state (the
        untimed calls of ``time_interleaved`` follow a backend pin and resolve dispatch decisions
        again). A call that waits on the GPU (a host sync) would also wait out the cover's spin in
        a timed call, which the untimed calls, started on an idle GPU, do not; the smaller of the
        two medians is right in both cases."""
        ms = statistics.median(timed)
        return min(ms, host_cover.typical_ms(untimed)) if untimed else ms

    def _untimed(self, call, i: int, host: list[float]) -> None:
        """One untimed call; appends its host issue time (ms, no synchronize inside) to ``host``."""
        host.append(host_cover.untimed_host_ms(lambda: call(i), self.device))

    def _one(self, call, i: int, setup, untimed_host: Sequence[float] = ()) -> tuple[float, float]:
        """(GPU ms, host issue ms) of one timed call; ``untimed_host``: the function's host times
        from its untimed calls, which size the cover. On the CPU both are the wall time."""
        if setup:
            setup()
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            call(i)
            ms = (time.perf_counter() - t0) * 1e3
            return ms, ms
        self._flush.zero_()  # evicts the operands from L2 (written after the previous call ended)
        # Keep the GPU busy while the host issues the call, so the events time the GPU work
        # alone: otherwise the host time (Python, dispatch, autograd: tens of us for one wrapper,
        # 1-2 ms for an fp8 grouped training step) would count as GPU time, the GPU idling inside
        # the window while it waits for launches. The spin is sized to this function's measured
        # host time (a fixed ~0.5 ms left longer steps uncovered).
        return host_cover.covered_call(lambda: call(i), self.device, host_cover.typical_ms(untimed_host))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- correctness gate ------------------------------------------------------------------------------
_CHUNK = 1 << 24  # elements per float64 chunk: bounds the temporaries for multi-GB outputs


def _sums(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(sum ref^2, sum (out - ref)^2) in float64, over chunks so a huge output needs no full
    float64 copy. Non-finite outputs give a non-finite noise term."""
    o, r = out.detach().reshape(-1), ref.detach().reshape(-1)
    signal = noise = 0.0
    for s in range(0, o.numel(), _CHUNK):
        rc = r[s:s + _CHUNK].double()
        signal += float(rc.pow(2).sum())
        noise += float((o[s:s + _CHUNK].double() - rc).pow(2).sum())
    return signal, noise


def snr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    signal, noise = _sums(out, ref)
    if not math.isfinite(noise):
        return math.nan
    return math.inf if noise == 0 else 10 * math.log10(max(signal, 1e-300) / noise)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    signal, noise = _sums(out, ref)
    return math.sqrt(noise / max(signal, 1e-300)) if math.isfinite(noise) else math.nan


@dataclass
class Check:
    """Gate result over one or more outputs (forward and each gradient): worst case wins."""

    ok: bool = True
    snr_db: float = math.inf
    rel_err: float = 0.0
    reasons: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        return "PASS" if self.ok else "FAIL"


def gate(pairs: Iterable[tuple[str, Any, torch.Tensor]], *, min_snr_db: float | None = None) -> Check:
    """Checks ``(name, out, ref)`` pairs. ``min_snr_db`` set: an SNR gate (fp8); otherwise the
    relative-error gate of the output dtype (bf16 2e-2, fp16/fp32 5e-3). Non-finite or misshapen
    outputs fail. Every pair's SNR and relative error are recorded (the worst is kept)."""
    result = Check()
    for name, out, ref in pairs:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(ref.shape):
            result.ok = False
            result.reasons.append(f"{name}: shape {tuple(getattr(out, 'shape', ()))} != {tuple(ref.shape)}")
            continue
        signal, noise = _sums(out, ref)
        if not math.isfinite(noise):
            result.ok = False
            result.reasons.append(f"{name}: NaN/inf")
            continue
        s = math.inf if noise == 0 else 10 * math.log10(max(signal, 1e-300) / noise)
        e = math.sqrt(noise / max(signal, 1e-300))
        result.snr_db, result.rel_err = min(result.snr_db, s), max(result.rel_err, e)
        if min_snr_db is not None:
            if s < min_snr_db:
                result.ok = False
                result.reasons.append(f"{name}: SNR {s:.1f} dB < {min_snr_db}")
        else:
            tol = REL_TOL.get(out.dtype, 5e-3)
            if e > tol:
                result.ok = False
                result.reasons.append(f"{name}: rel err {e:.2e} > {tol:.0e}")
    return result


def failed(reason: str) -> Check:
    return Check(ok=False, snr_db=math.nan, rel_err=math.nan, reasons=[reason])


# -- rows and scores -------------------------------------------------------------------------------
@dataclass
class Row:
    """One (shape, backend) measurement. ``flops`` counts the forward (2*M*N*K summed over the
    GEMMs); a step (fwd + dgrad + wgrad) counts ``step_flops`` (3x the forward unless given).
    ``step_host_ms``: the host's time to issue one step (the forward's where no step is timed);
    where it nears ``step_ms`` the host, not the GPU, would bound a training loop."""

    op: str
    shape: str
    backend: str
    model: str = ""
    mb: int | str = ""
    m: int = 0
    n: int = 0
    k: int = 0
    flops: float = 0.0
    step_flops: float | None = None
    check: Check | None = None
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    step_ms: float | None = None
    step_host_ms: float | None = None
    peer: bool = False
    note: str = ""
    extra: dict = field(default_factory=dict)
    ratio: float | None = None
    ratio_on: str = ""  # "step" or "fwd": the metric ``ratio`` compares (set by assign_ratios)

    @property
    def passed(self) -> bool:
        return self.check is not None and self.check.ok

    def headline_ms(self) -> float | None:
        return self.step_ms if self.step_ms is not None else self.fwd_ms

    def tflops(self, which: str) -> float | None:
        if not self.passed:
            return None  # a FAIL voids the timing
        if which == "fwd":
            ms, flops = self.fwd_ms, self.flops
        else:
            ms, flops = self.step_ms, (self.step_flops if self.step_flops is not None else 3 * self.flops)
        if ms is None or ms <= 0 or not flops:
            return None
        return flops / (ms * 1e-3) / 1e12

    def as_dict(self) -> dict[str, Any]:
        def num(x, digits=4):
            return "" if x is None or (isinstance(x, float) and math.isnan(x)) else (
                round(x, digits) if isinstance(x, float) and math.isfinite(x) else x)
        c = self.check
        d = {
            "op": self.op, "shape": self.shape, "model": self.model, "mb": self.mb, "m": self.m, "n": self.n,
            "k": self.k, "backend": self.backend, "check": c.status if c else "SKIP",
            "snr_db": num(c.snr_db, 2) if c else "", "rel_err": (f"{c.rel_err:.2e}" if c and math.isfinite(c.rel_err)
                                                               else ""),
            "fwd_ms": num(self.fwd_ms), "bwd_ms": num(self.bwd_ms), "step_ms": num(self.step_ms),
            "fwd_tflops": num(self.tflops("fwd"), 1), "step_tflops": num(self.tflops("step"), 1),
            "step_host_ms": num(self.step_host_ms),
            "ratio_vs_best_peer": num(self.ratio, 3), "peer": "yes" if self.peer else "",
            "note": "; ".join(filter(None, [self.note] + (c.reasons if c else []))),
        }
        d.update(self.extra)
        return d


def rotated(items: Sequence[Any], shift: int) -> list[Any]:
    """``items`` starting at position ``shift``: benches rotate the variant order per shape so no
    variant is always timed first (a GPU that heats up through a shape's runs would otherwise
    favour the first variant, usually the peer, in every shape)."""
    items = list(items)
    if not items:
        return items
    shift %= len(items)
    return items[shift:] + items[:shift]


def time_rows(entries: Sequence[tuple[Row, Any]], timer: Timer, inputs: tuple, grad: torch.Tensor | None,
              wants_grad: Callable[[Any], bool] = lambda v: True) -> None:
    """After the gate, for one shape's variants (``(row, variant)`` pairs): each variant's explain
    note, then forward, backward and step times (backward and step where ``grad`` is given and
    ``wants_grad(variant)``). Rows that failed the gate are not timed.

    Each metric is timed *in turns* (``Timer.time_interleaved``): every variant gets a turn
    (its pin, one untimed call, two timed ones) before any gets its next. Timed one after
    another, a large shape's later variants ran on a hotter, lower-clocked GPU (H100: identical
    torch kernels measured up to 8% apart at Qwen2.5-72B gate_up when timed in blocks); in turns
    every variant sees the same GPU.
    ``variant.enter`` (its backend pin), where it has one, runs before each of its calls, untimed.
    """
    live = []
    for row, v in entries:
        enter = getattr(v, "enter", None) or (lambda: None)
        if getattr(v, "explain", None) is not None:
            enter()
            try:
                row.note = v.explain()
            except Exception as exc:
                row.note = "explain: " + error_note(exc)
        if row.check is not None and row.check.ok:
            live.append((row, v, enter))
    if not live:
        return
    setups = [enter for _, _, enter in live]
    fwd = timer.time_interleaved([v.fwd for _, v, _ in live], setups)
    for (row, _, _), ms, host in zip(live, fwd, timer.last_host_ms):
        row.fwd_ms, row.step_host_ms = ms, host  # the step's host time replaces it where a step is timed
    back = [(row, v, enter) for row, v, enter in live if grad is not None and wants_grad(v)]
    if not back:
        return
    outs = []
    for _, v, enter in back:
        enter()
        outs.append(v.fwd())
    setups = [enter for _, _, enter in back]
    bwd = timer.time_interleaved(
        [lambda o=o: torch.autograd.grad(o, inputs, grad, retain_graph=True) for o in outs], setups)
    del outs
    step = timer.time_interleaved([lambda v=v: torch.autograd.grad(v.fwd(), inputs, grad) for _, v, _ in back],
                                  setups)
    for (row, _, _), b, st, host in zip(back, bwd, step, timer.last_host_ms):
        row.bwd_ms, row.step_ms, row.step_host_ms = b, st, host


def wall_ms(fns: Sequence[Callable[[], Any]], setups: Sequence[Callable[[], None]], device: torch.device,
            iters: int = 20, rounds: int = 3) -> list[float]:
    """Wall time per call (ms) of each function run ``iters`` times back to back, synchronised only
    at the end: what a training loop calling it sees, the larger of its GPU time and its host issue
    time, nothing hidden. Rounds go in turns over the functions (setup, one warm call, then the
    timed loop) and each function's median round is returned.

    >>> wall_ms([lambda: None], [lambda: None], torch.device("cpu"), iters=2, rounds=1)[0] >= 0.0
    True
    """
    per: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, (fn, setup) in enumerate(zip(fns, setups)):
            setup()
            fn()
            sync(device)
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            sync(device)
            per[i].append((time.perf_counter() - t0) * 1e3 / iters)
    return [statistics.median(p) for p in per]


def profile_calls(fn: Callable[[], Any], iters: int, device: torch.device, title: str = "", rows: int = 80) -> str:
    """Runs ``fn`` ``iters`` times under cProfile, then again under torch.profiler, and returns both
    tables as text: where the host time of a call goes (Python functions, torch ops, launches) and
    what the device ran; ``rows`` Python functions per cProfile table. The caller has run ``fn``
    before (compilation and tuning are not profiled)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    sync(device)
    prof.disable()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as trace:
        for _ in range(iters):
            fn()
        sync(device)
    averages = trace.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40)]
    if device.type == "cuda":
        tables.append(averages.table(sort_by="self_device_time_total", row_limit=25))
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return f"{title}\n{iters} calls\n\n" + text.getvalue() + "\n\n".join(tables)


def profile_to_file(folder: Path, label: str, fn: Callable[[], Any], iters: int, device: torch.device,
                    title: str) -> Path:
    """``profile_calls(fn, iters, device, title)`` written to ``folder/<label as a file name>.txt``
    (the folder made if missing); prints and returns the path. The caller has run ``fn`` before."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_") + ".txt")
    path.write_text(profile_calls(fn, iters, device, title))
    print(f"profile: {path}", flush=True)
    return path


def assign_ratios(rows: list[Row]) -> None:
    """ratio = best PASSing peer's time / this row's time, per shape (same op + shape), on the
    combined step when both the row and a peer have one, else on the forward."""
    by_shape: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        by_shape.setdefault((r.op, r.shape), []).append(r)
    for group in by_shape.values():
        peers = [r for r in group if r.peer and r.passed]
        best = {}
        for metric in ("step_ms", "fwd_ms"):
            times = [getattr(r, metric) for r in peers if getattr(r, metric)]
            best[metric] = min(times) if times else None
        for r in group:
            r.ratio, r.ratio_on = None, ""
            if not r.passed:
                continue
            for metric in ("step_ms", "fwd_ms"):
                mine = getattr(r, metric)
                if mine and best[metric]:
                    r.ratio, r.ratio_on = best[metric] / mine, metric[:-3]
                    break


def geomean(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def summary(rows: list[Row], by: str | None = None) -> list[dict[str, Any]]:
    """Per (op, backend): geomean fwd/step TFLOPS and ratio over shapes, PASS/FAIL counts. With
    ``by`` (a key of the rows' ``extra``), per (op, that key's value, backend) instead, in the
    value's first-seen order; the dict then carries the value under ``by``."""
    out = []
    part = (lambda r: r.extra.get(by, "")) if by else (lambda r: None)
    keys = list(dict.fromkeys((r.op, part(r), r.backend) for r in rows))
    for op, value, backend in keys:
        mine = [r for r in rows if r.op == op and part(r) == value and r.backend == backend]
        if all(r.check is None for r in mine):
            continue  # untimed info rows (e.g. peak memory): not part of the score
        shapes_total = len({r.shape for r in rows if r.op == op and part(r) == value})
        scored = [r for r in mine if r.ratio is not None]
        out.append({
            **({by: value} if by else {}),
            "op": op, "backend": backend, "peer": any(r.peer for r in mine),
            "pass": sum(r.passed for r in mine), "fail": sum(r.check is not None and not r.check.ok for r in mine),
            "shapes": f"{len(scored)}/{shapes_total}",
            "geomean_fwd_tflops": geomean(r.tflops("fwd") for r in mine),
            "geomean_step_tflops": geomean(r.tflops("step") for r in mine),
            "geomean_ratio": geomean(r.ratio for r in scored),
            **_lowest(scored),
        })
    return out


def _lowest(scored: list[Row]) -> dict[str, Any]:
    """The scored row with the lowest ratio: ``lowest_ratio``, its ``lowest_shape`` and the metric
    compared, ``lowest_on`` (None, "", "" when nothing was scored)."""
    low = min(scored, key=lambda r: r.ratio, default=None)
    return {"lowest_ratio": low.ratio if low else None, "lowest_shape": low.shape if low else "",
            "lowest_on": low.ratio_on if low else ""}


# -- reports ---------------------------------------------------------------------------------------
def _fmt(v: Any, digits: int = 3) -> str:
    if v is None or v == "":
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}f}" if math.isfinite(v) else str(v)
    return str(v)


def _score_cells(s: dict[str, Any]) -> str:
    """The counts and geomeans of one ``summary`` entry, as markdown table cells."""
    return (f"{s['pass']} | {s['fail']} | {s['shapes']} | {_fmt(s['geomean_fwd_tflops'], 1)} | "
            f"{_fmt(s['geomean_step_tflops'], 1)} | {_fmt(s['geomean_ratio'])}")


def write_reports(rows: list[Row], *, name: str, device: torch.device, out_dir: Path | str | None = None,
                  title: str = "", notes: Sequence[str] = (), plot_metric: str = "step",
                  breakdown: Sequence[str] = (), lowest: Sequence[str] = ()) -> dict[str, Path]:
    """Writes <out>/<gpu>_<date>_<name>.{csv,md,png} (``out``: see ``resolve_out_dir``); returns
    the paths written. Each column of ``breakdown`` (a key of the rows' ``extra``) adds a score
    table per value of it. Each backend named in ``lowest`` gets a "lowest shape" line per op under
    the score table: its lowest ratio vs the best peer and the shape it was measured on (a geomean
    can hide one slow shape)."""
    assign_ratios(rows)
    out_dir = resolve_out_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{gpu_slug(device)}_{_dt.date.today().isoformat()}_{name}"
    paths = {"csv": out_dir / f"{stem}.csv", "md": out_dir / f"{stem}.md"}

    dicts = [r.as_dict() for r in rows]
    columns = BASE_COLUMNS + [c for c in dict.fromkeys(k for d in dicts for k in d) if c not in BASE_COLUMNS]
    with open(paths["csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for d in dicts:
            writer.writerow(d)

    env = environment(device)
    lines = [f"# {title or name}", ""]
    lines.append(f"{env['device']}, {env['date']}: torch {env['torch']}, triton {env['triton']}, "
                 f"CUDA {env['cuda']}" + (f", HIP {env['hip']}" if env["hip"] != "None" else "")
                 + (f", {env['capability']} x {env['sm_count']} SMs" if "sm_count" in env else ""))
    lines.append("")
    lines.append("Command: `" + " ".join([Path(sys.argv[0]).name] + sys.argv[1:]) + "`")
    lines.append("")
    if device.type != "cuda":
        lines += ["**CPU smoke run: the timings below are meaningless** (no GPU; the run only checks that "
                  "the script, the gate and the reports work).", ""]
    lines += [f"- {n}" for n in notes]
    if notes:
        lines.append("")
    lines += ["## Score (geomean over shapes; ratio = best peer time / backend time, on the combined step where "
              "both have one, else the forward; >1 = faster than the best peer; FAIL rows are excluded)", "",
              "| op | backend | peer | PASS | FAIL | shapes scored | fwd TFLOPS | step TFLOPS | ratio vs best peer |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    scores = summary(rows)
    for s in scores:
        lines.append(f"| {s['op']} | {s['backend']} | {'yes' if s['peer'] else ''} | {_score_cells(s)} |")
    lows = [s for s in scores if s["backend"] in lowest]
    if lows:
        lines.append("")
    for s in lows:
        peers = " / ".join(dict.fromkeys(r.backend for r in rows if r.op == s["op"] and r.peer)) or "no peer"
        if s["lowest_ratio"] is None:
            low = f"none scored ({s['shapes']} shapes)"
        else:
            low = (f"{s['lowest_ratio']:.3f}x on {s['lowest_shape']} ({s['lowest_on']}); {s['shapes']} shapes "
                   f"scored, geomean {s['geomean_ratio']:.3f}x")
        lines.append(f"- lowest shape, {s['op']} {s['backend']} vs {peers}: {low}")
    for by in breakdown:
        lines += ["", f"## Score by {by}", "",
                  f"| op | {by} | backend | PASS | FAIL | shapes scored | fwd TFLOPS | step TFLOPS | ratio vs best peer |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for s in summary(rows, by=by):
            lines.append(f"| {s['op']} | {s[by]} | {s['backend']} | {_score_cells(s)} |")
    lines += ["", "## All rows", ""]
    shown = [c for c in columns if c not in ("op",) and any(d.get(c) not in ("", None) for d in dicts)]
    lines.append("| op | " + " | ".join(shown) + " |")
    lines.append("|---|" + "|".join("---" for _ in shown) + "|")
    for d in dicts:
        lines.append(f"| {d['op']} | " + " | ".join(str(d.get(c, "")).replace("|", "/") for c in shown) + " |")
    paths["md"].write_text("\n".join(lines) + "\n")

    png = out_dir / f"{stem}.png"
    message = plot(rows, png, metric=plot_metric, title=f"{title or name} ({env['device']})")
    if message is None:
        paths["png"] = png
    else:
        print(message)
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}")
    return paths


def plot(rows: list[Row], path: Path, *, metric: str = "step", title: str = "") -> str | None:
    """Grouped bars of TFLOPS per shape and backend (PASS rows only), or of the rows' ``extra``
    column named ``metric`` where they have one (e.g. ``gb_s``); returns why not, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: skipped the PNG (pip install matplotlib to get it)"
    values = {}
    by_extra = any(metric in r.extra for r in rows)
    for r in rows:
        if by_extra:
            t = r.extra.get(metric) if r.passed else None
        else:
            t = r.tflops(metric) if r.tflops(metric) is not None else r.tflops("fwd")
        if t is not None:
            values.setdefault(f"{r.op}:{r.shape}", {})[r.backend] = t
    if not values:
        return "no PASSing timed rows: skipped the PNG"
    shapes = list(values)
    backends = list(dict.fromkeys(b for v in values.values() for b in v))
    width = 0.8 / max(len(backends), 1)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.45 * len(shapes) * max(1, len(backends)) ** 0.5), 5.5))
    for i, b in enumerate(backends):
        xs = [j + i * width for j in range(len(shapes))]
        ax.bar(xs, [values[s].get(b, 0.0) for s in shapes], width=width, label=b)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels([s.split(":", 1)[1] for s in shapes], rotation=75, ha="right", fontsize=6)
    ax.set_ylabel(metric if by_extra else f"{metric} TFLOPS (fwd where no {metric})")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# -- shared helpers for the scripts ----------------------------------------------------------------
def add_common_args(parser) -> None:
    parser.add_argument("--device", default=None, help="cuda (default when a GPU is present) or cpu")
    parser.add_argument("--quick", action="store_true", help="few shapes, few repeats (smoke run)")
    parser.add_argument("--out", "--out-dir", dest="out_dir", default=None,
                        help=f"where reports go (default ${OUT_ENV}, else {DEFAULT_OUT})")
    parser.add_argument("--name", default=None, help="report name suffix (default from the options)")
    parser.add_argument("--target-ms", type=float, default=None, help="time budget of one measurement")
    parser.add_argument("--tune-budget-ms", type=float, default=None,
                        help="PRIMUS_TURBO_TUNE_BUDGET_MS for the autotuned rows (default 400; 50 with --quick)")


_COUNTS = {2: "two", 3: "three", 4: "four", 5: "five"}


def parse_shapes(spec: str, form: str, *, option: str = "--shapes",
                 names: Sequence[str] = ()) -> list[tuple[int, ...] | str]:
    """The items of a comma-separated shape list such as ``--shapes 4096x5120x3584,...``: each is
    ``form`` (sizes joined by 'x', e.g. ``MxNxK`` or ``GxTxNxK``) parsed to a tuple of positive
    ints, or one of ``names`` (case-insensitive), returned as that name in lower case. Bad text
    (a malformed or non-positive item, or no item at all) raises SystemExit naming ``option`` and
    the bad item."""
    dims = len(form.split("x"))
    known = {n.lower() for n in names}
    either = f" or one of: {', '.join(sorted(known))}" if known else ""
    out: list[tuple[int, ...] | str] = []
    for item in (v.strip() for v in spec.split(",") if v.strip()):
        if item.lower() in known:
            out.append(item.lower())
            continue
        try:
            sizes = tuple(int(v) for v in item.lower().split("x"))
        except ValueError:
            sizes = ()
        if len(sizes) != dims:
            raise SystemExit(f"{option}: {item!r} is not {form} ({_COUNTS.get(dims, dims)} integers joined by "
                             f"'x'){either}")
        if min(sizes) <= 0:
            raise SystemExit(f"{option}: {item!r} needs positive sizes")
        out.append(sizes)
    if not out:
        raise SystemExit(f"{option}: no shape in {spec!r}; give {form}[,...]{either}")
    return out


def pick_device(arg: str | None) -> torch.device:
    if arg is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(arg)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is visible to torch")
    return dev


def make_timer(device: torch.device, quick: bool, target_ms: float | None) -> Timer:
    if quick:
        return Timer(device, warmup=1, min_repeats=2, max_repeats=5, target_ms=target_ms or 20.0)
    return Timer(device, target_ms=target_ms or 120.0)


def set_tune_budget(ms: float | None, quick: bool) -> None:
    if "PRIMUS_TURBO_TUNE_BUDGET_MS" not in os.environ or ms is not None:
        os.environ["PRIMUS_TURBO_TUNE_BUDGET_MS"] = str(ms if ms is not None else (50 if quick else 400))


def gate_variant(row: "Row", enter: Callable[[], None], fwd: Callable[[], torch.Tensor], leaves: Sequence[torch.Tensor],
                 grad: torch.Tensor | None, refs: Sequence[Any], names: Sequence[str],
                 min_snr_db: float | None = None) -> "Row":
    """The correctness gate of one variant: ``enter()``, then ``fwd()`` and, where ``leaves`` are
    given, the gradients of ``grad`` with respect to them; each is checked against ``refs`` under
    ``names`` (the output first). A backend that does not serve the call leaves the row unchecked
    with a note; one that raises fails it. ``time_rows`` then times the PASSes."""
    from turbo_dispatch.errors import BackendUnsupportedError, NoBackendError

    enter()
    try:
        out = fwd()
        got = (out, *torch.autograd.grad(out, tuple(leaves), grad)) if leaves else (out,)
    except (BackendUnsupportedError, NoBackendError) as exc:
        row.note = "not served: " + error_note(exc)
        return row
    except Exception as exc:  # a crashing backend is a FAIL, the run goes on
        row.check = failed("raised " + error_note(exc))
        return row
    row.check = gate(list(zip(names, got, refs)), min_snr_db=min_snr_db)
    return row


def backend_pins(family: str) -> tuple[Callable[..., Callable[[], None]], Callable[[], None]]:
    """``(pin, plain)`` for one settings family (``gemm``, ``grouped_gemm``, ``attn``): ``pin(name,
    auto=False)`` returns the function a variant enters with (the family pinned to ``name``, or
    unpinned with autotune on or off), ``plain()`` unpins it with autotune off."""
    from turbo_dispatch import GlobalBackendManager

    setter = getattr(GlobalBackendManager, f"set_{family}_backend")

    def plain() -> None:
        setter(None)
        GlobalBackendManager.set_auto_tune(False)

    def pin(name: str | None, auto: bool = False) -> Callable[[], None]:
        def enter() -> None:
            plain()
            GlobalBackendManager.set_auto_tune(auto)
            if name is not None:
                setter(name)
        return enter

    return pin, plain


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_note(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:300]



@contextlib.contextmanager
def interruptible():
    """Stops the benchmark loop on Ctrl-C or SIGTERM (``timeout`` sends it) instead of dying, so
    the caller still writes reports of the rows measured so far. Yields a list that holds the
    reason when the loop was stopped."""
    stopped: list[str] = []

    def on_term(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield stopped
    except KeyboardInterrupt as exc:
        stopped.append(str(exc) or "interrupted")
        print(f"interrupted ({stopped[0]}): writing partial reports", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
