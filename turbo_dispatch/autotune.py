"""Correctness-gated autotuning of one problem key over backends and their configs.

Results live in process memory and, through ``tuning.database``, in the persistent tuning DB
layers (memory first, then the user DB, read-only DBs and shipped DBs; new winners are merged
into the user DB). A key whose every candidate failed is remembered in memory and not retried. While a CUDA graph is
being captured or torch.compile is tracing, nothing is profiled: stored results still apply,
and a miss yields a *provisional* outcome that is used once and not cached.
"""
from __future__ import annotations

import logging
import math
import os
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

from . import host_cover
from . import manager as _manager
from .env import parse_bool, parse_nonnegative_float
from .op_spec import OpSpec, dtype_name, format_key
from .tuning import database as _tunedb

log = logging.getLogger("turbo_dispatch.autotune")

BUDGET_ENV = "PRIMUS_TURBO_TUNE_BUDGET_MS"
CONSENSUS_ENV = "PRIMUS_TURBO_TUNE_CONSENSUS"
_DEFAULT_BUDGET_MS = 3000.0
_WARMUP = 3
_MAX_REPEATS = 25
_MIN_REPEATS = 5
#: A candidate whose lone-call host time is at least this share of its GPU time also gets its host
#: time taken from a loop of calls (``host_cover.loop_host_ms``); far below it, the GPU bounds the
#: loop whatever the host's exact time, and the extra calls would only spend tuning budget.
_LOOP_HOST_SHARE = 0.5

#: Counters that tests and the CLI read: "keys_profiled", "candidate_runs".
STATS: Counter = Counter()


@dataclass(frozen=True)
class TuneRecord:
    """The outcome of tuning one key: the winner (None when every candidate failed).

    ``source`` is "autotune" (profiled in this process) or "tuned-db" (read from a database);
    ``timings`` holds every candidate's median (inf when rejected) for reports and the DB;
    ``measured`` the same as (backend, config, ms), where this process profiled the key, so that
    ranks can agree on it later (``tuning.rank_sync``). ``gpu_ms`` and ``host_ms`` split the
    winner's ``time_ms`` into its device time (None off CUDA/ROCm, where the host computes) and its
    host issue time, where they were measured: the cost is the larger of the two per call (under
    rank consensus ``time_ms`` is the worst rank's and the split this rank's own).

    For an op with a high-precision counterpart (``OpSpec.high_precision_peer``), ``peer_op`` and
    ``peer_backend`` name the counterpart op and its platform default, and ``peer_ms`` and
    ``peer_winner_ms`` are that default's and the winner's costs per call when re-timed in turns on
    the same inputs (``_time_peer``); all None where the counterpart was not timed.
    """

    backend: str | None
    config: Hashable
    time_ms: float
    rejected: tuple[tuple[str, str], ...] = ()
    timings: tuple[tuple[str, float], ...] = ()
    source: str = "autotune"
    note: str = ""
    measured: tuple[tuple[str, Hashable, float], ...] = ()
    gpu_ms: float | None = None
    host_ms: float | None = None
    peer_op: str | None = None
    peer_backend: str | None = None
    peer_ms: float | None = None
    peer_winner_ms: float | None = None


@dataclass(frozen=True)
class CallTime:
    """What timing one candidate found, per call, as medians in ms: ``cost_ms`` (the larger of
    the device and host times of each call, what a loop of back-to-back calls sees), ``gpu_ms``
    (device time; None where the call computes on the host) and ``host_ms`` (host issue time)."""

    cost_ms: float
    gpu_ms: float | None
    host_ms: float

    @classmethod
    def of(cls, samples: Sequence[tuple[float | None, float]]) -> "CallTime":
        """The medians of (device ms or None, host ms) samples; the cost is taken per sample, so
        that a call bound by the device on some samples and by the host on others counts right."""
        device = [gpu for gpu, _ in samples if gpu is not None]
        cost = [host if gpu is None else max(gpu, host) for gpu, host in samples]
        return cls(statistics.median(cost), statistics.median(device) if device else None,
                   statistics.median(host for _, host in samples))

    @classmethod
    def combined(cls, times: Sequence["CallTime"]) -> "CallTime":
        """One CallTime for several measurements of one candidate: each field's median."""
        device = [t.gpu_ms for t in times if t.gpu_ms is not None]
        return cls(statistics.median(t.cost_ms for t in times), statistics.median(device) if device else None,
                   statistics.median(t.host_ms for t in times))


@dataclass
class TuneOutcome:
    entry: Any = None
    config: Hashable = None
    source: str = "autotune"
    notes: list[str] = field(default_factory=list)
    provisional: bool = False


_memory: dict[tuple[str, Any], TuneRecord] = {}
#: DB hits, by (op, problem, the DB settings they were read under): a hit found with a layer that
#: is since turned off or renamed (``set_shipped_tune_db(False)``, another read-only path) must not
#: keep applying, so hits are not kept with this process's own results in ``_memory``.
_db_hits: dict[tuple[str, Any, Any], TuneRecord] = {}
_lock = threading.Lock()


def clear_memory() -> None:
    """Forgets every in-memory tuning result and cached DB hit (GlobalBackendManager.reset calls this)."""
    with _lock:
        _memory.clear()
        _db_hits.clear()


_manager.on_reset(clear_memory)


def known_records() -> list[tuple[str, Any, TuneRecord]]:
    """(op, problem, record) for every key this process has a result for: profiled here (memory)
    or read from a tuning DB under the DB settings now in force. A snapshot, for ``rank_sync``."""
    db_settings = _manager.current_settings().db
    with _lock:
        known = {(op, problem): record for (op, problem), record in _memory.items()}
        for (op, problem, settings), record in _db_hits.items():
            if settings == db_settings:
                known.setdefault((op, problem), record)
    return [(op, problem, record) for (op, problem), record in known.items()]


def adopt(op: str, problem: Any, record: TuneRecord) -> None:
    """Makes ``record`` this process's result for (op, problem), ahead of every DB layer (the
    resolver's cached decisions must be dropped by the caller)."""
    with _lock:
        _memory[(op, problem)] = record


def profiling_blocked() -> str | None:
    """Why profiling must not happen right now, or None."""
    if torch.compiler.is_compiling():
        return "torch.compile is tracing"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is being captured"
    return None


def lookup(op: str, problem: Any) -> TuneRecord | None:
    """The in-memory result for (op, problem), if this process has one."""
    return _memory.get((op, problem))


def _stored(spec: OpSpec, problem: Any) -> TuneRecord | None:
    """The memory layer, then the database layers (a DB hit is cached under the DB settings in
    force, ``_db_hits``)."""
    record = _memory.get((spec.name, problem))
    if record is not None:
        return record
    db_settings = _manager.current_settings().db
    record = _db_hits.get((spec.name, problem, db_settings))
    if record is not None:
        return record
    try:
        hit = _tunedb.lookup(spec, problem)
    except Exception as exc:  # a broken DB must never take the job down
        log.warning("tuning DB lookup for %s failed (%s: %s); ignoring the DB", spec.name, type(exc).__name__, exc)
        hit = None
    if hit is None:
        return None
    record = TuneRecord(hit.backend, hit.config, hit.time_ms, source="tuned-db", note=hit.note(),
                        gpu_ms=hit.gpu_ms, host_ms=hit.host_ms, peer_op=hit.peer_op, peer_backend=hit.peer_backend,
                        peer_ms=hit.peer_ms, peer_winner_ms=hit.peer_winner_ms)
    _db_hits[(spec.name, problem, db_settings)] = record
    return record


def tune(spec: OpSpec, problem: Any, candidates: Sequence[Any], profile_allowed: bool = True) -> TuneOutcome:
    """The stored winner for ``problem`` (memory, then the tuning DBs) or, when
    ``profile_allowed`` and nothing blocks it, a freshly profiled one (saved to the user DB).

    With ``profile_allowed=False`` (autotune off) a miss returns an empty outcome: the resolver
    goes on to the default.
    """
    record = _stored(spec, problem)
    if record is None:
        _tunedb.record_untuned(spec, problem)
        if not profile_allowed:
            return TuneOutcome()
        blocked = profiling_blocked()
        if blocked is not None:
            return TuneOutcome(notes=[f"autotune: no stored result and {blocked}, so nothing was profiled"],
                               provisional=True)
        with _lock:
            record = _memory.get((spec.name, problem))
            if record is None:
                record = profile(spec, problem, candidates)
                _memory[(spec.name, problem)] = record
                if record.backend is not None:
                    _tunedb.save([_tunedb.result_for(spec, problem, record, candidates)])
    if record.backend is None:
        reasons = "; ".join(f"{name}: {why}" for name, why in record.rejected) or "no candidate"
        return TuneOutcome(notes=[f"autotune failed for this key earlier (remembered, not retried): {reasons}"])
    entry = next((c for c in candidates if c.name == record.backend), None)
    if entry is None:
        return TuneOutcome(notes=[f"{record.source} winner {record.backend} cannot serve this call any more"])
    notes = [record.note or f"tuned: {record.time_ms:.4f} ms"]
    if record.host_ms is not None:
        notes.append(_tunedb.per_call_text(record.gpu_ms, record.host_ms))
    if record.peer_ms is not None and record.peer_winner_ms is not None:
        notes.append(_tunedb.peer_text(record.peer_op, record.peer_backend, record.peer_ms, record.peer_winner_ms,
                                       _peer_dtype(problem)))
    return TuneOutcome(entry, record.config, source=record.source, notes=notes)


def _budget_s() -> float:
    return parse_nonnegative_float(os.environ.get(BUDGET_ENV), BUDGET_ENV, _DEFAULT_BUDGET_MS) / 1e3


def timing_set_count(sample: Sequence[Any], device: torch.device, most: int) -> int:
    """How many independent input sets like ``sample`` rotating timed calls need so that none
    finds its operands in L2: enough for twice the L2 size, at least 1, at most ``most`` (1 off
    CUDA)."""
    if device.type != "cuda":
        return 1
    nbytes = sum(t.numel() * t.element_size() for t in sample if isinstance(t, torch.Tensor))
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(most, math.ceil(2 * l2 / max(nbytes, 1))))


def _input_sets(spec: OpSpec, problem: Any,
                device: torch.device) -> tuple[Sequence[Any], list[Sequence[Any]]]:
    """(the inputs candidates are checked on, the input sets they are timed on): enough
    independent timing sets that rotating through them defeats the L2 cache, drawn by the op's
    ``make_timing_inputs`` where it has one (the checked set is then not timed)."""
    checked = spec.make_inputs(problem, device)
    draw = spec.make_timing_inputs
    first = checked if draw is None else draw(problem, device)
    count = timing_set_count(first, device, 8)
    return checked, [first] + [(draw or spec.make_inputs)(problem, device) for _ in range(count - 1)]


#: The host clock that times CPU candidates. Tests substitute a clock that also counts the cost
#: their fixture backends declare, so a loaded machine's scheduling cannot decide their outcome.
_clock: "Callable[[], float]" = time.perf_counter


def _time_ms(fn, sets: list, device: torch.device, deadline: float, parts: list | None = None) -> float:
    """Median cost in milliseconds of ``fn`` over rotating input sets (``_measure``); the full
    ``CallTime`` is appended to ``parts`` when one is given. The tuner times candidates through this
    function, so a probe that wraps it (say, to skew one rank's timings) changes what the tuner sees."""
    timed = _measure(fn, sets, device, deadline)
    if parts is not None:
        parts.append(timed)
    return timed.cost_ms


def _measure(fn, sets: list, device: torch.device, deadline: float) -> CallTime:
    """The ``CallTime`` of ``fn`` over rotating input sets, as a caller that issues calls back to
    back sees it: per call, the larger of its GPU time and its host issue time.

    On CUDA a spin sized to the call's host issue time (measured in the warm-ups) precedes each
    timed call (``host_cover``), so the events time GPU work alone and the host clock times the
    issue alone; the cost takes the larger. GPU time alone would rank a kernel with a slow launch
    path above a plain call wherever the host is the bottleneck (tiny GEMMs, small experts), and
    host-inflated events would rank launch paths where the GPU is (large problems). Where the
    host time comes near the GPU time, it is taken from a loop of back-to-back calls
    (``host_cover.loop_host_ms``), since a lone call's issue after a synchronisation runs slower
    than a loop's. Off CUDA the host computes the call, so the host clock (``_clock``) is the
    whole cost."""
    host = [host_cover.untimed_host_ms(lambda: fn(sets[i % len(sets)]), device) for i in range(_WARMUP)]
    samples: list[tuple[float | None, float]] = []  # (GPU ms or None, host ms)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        host_ms = host_cover.typical_ms(host)
        for i in range(_MAX_REPEATS):
            samples.append(host_cover.covered_call(lambda: fn(sets[i % len(sets)]), device, host_ms))
            if len(samples) >= _MIN_REPEATS and time.monotonic() > deadline:
                break
        gpu_ms = statistics.median(gpu for gpu, _ in samples)
        if host_ms >= _LOOP_HOST_SHARE * gpu_ms:
            # The host may bound a loop of these calls: its issue time is what a loop sees, not a
            # lone call's after a synchronisation.
            loop = host_cover.loop_host_ms(lambda i: fn(sets[i % len(sets)]), device, len(samples))
            samples = [(gpu, loop) for gpu, _ in samples]
    else:
        for i in range(_MAX_REPEATS):
            t0 = _clock()
            fn(sets[i % len(sets)])
            samples.append((None, (_clock() - t0) * 1e3))
            if len(samples) >= _MIN_REPEATS and time.monotonic() > deadline:
                break
    return CallTime.of(samples)


def _plan(candidates: Sequence[Any], problem: Any) -> list[tuple[Any, Hashable, bool]]:
    """(backend, config, is_first_config) in profiling order: every backend's first config
    before any backend's second. First configs are always profiled (at the minimum repeat
    count once the budget is spent), so a slow candidate early in the list can never keep a
    faster backend from being measured; the budget only cuts the extra configs."""
    per_backend = []
    for entry in candidates:
        try:
            configs = list(entry.adapter.configs(problem)) or [None]
        except Exception as exc:  # a broken configs() still leaves the backend's default
            log.warning("autotune: %s.configs() raised %s: %s; trying its default only", entry.name,
                        type(exc).__name__, exc)
            configs = [None]
        per_backend.append((entry, configs))
    plan = []
    for depth in range(max((len(c) for _, c in per_backend), default=0)):
        plan += [(entry, configs[depth], depth == 0) for entry, configs in per_backend if depth < len(configs)]
    return plan


def candidate_label(backend: str, config: Hashable) -> str:
    """How reports and the tuning DB name one candidate: ``TRITON[(128, 256, 64, 8, 3, 8)]``, or the
    backend alone where it has no configs."""
    return backend if config is None else f"{backend}[{config}]"


def gate(spec: OpSpec, problem: Any, entry: Any, config: Hashable, checked: Sequence[Any],
         reference: Any) -> str | None:
    """The correctness gate: None when ``entry`` with ``config`` computes ``problem`` right on the
    ``checked`` inputs (against ``reference``), else why not. A candidate that raises fails it."""
    try:
        return spec.check(problem, spec.run(entry.adapter, problem, checked, config), reference)
    except Exception as exc:  # a broken candidate loses, it does not take the job down
        return f"raised {type(exc).__name__}: {exc}"


def profile(spec: OpSpec, problem: Any, candidates: Sequence[Any]) -> TuneRecord:
    """Times every (backend, config) that first passes the op's correctness check."""
    platform = spec.platform_of(problem)
    device = torch.device("cuda", torch.cuda.current_device()) if platform in ("cuda", "rocm") else torch.device("cpu")
    key = format_key(problem)
    STATS["keys_profiled"] += 1
    checked, sets = _input_sets(spec, problem, device)
    reference = spec.reference(problem, checked)
    budget = _budget_s()
    spent = 0.0  # seconds in timing loops; compiles and correctness runs are not budgeted
    timings: list[tuple[str, Hashable, float]] = []  # (backend, config, ms); inf = rejected
    splits: dict[tuple[str, Hashable], CallTime] = {}  # (backend, config) -> its sweep measurement
    rejected: list[tuple[str, str]] = []
    for entry, config, first in _plan(candidates, problem):
        label = candidate_label(entry.name, config)
        if not first and spent > budget and any(math.isfinite(t[2]) for t in timings):
            rejected.append((label, "not profiled: the key's time budget ran out"))
            timings.append((entry.name, config, math.inf))
            continue
        STATS["candidate_runs"] += 1
        reason = gate(spec, problem, entry, config, checked, reference)
        if reason is None:
            try:
                run = lambda inputs: spec.run(entry.adapter, problem, inputs, config)
                started = time.monotonic()
                parts: list[CallTime] = []
                ms = _time_ms(run, sets, device, started + max(budget - spent, 0.0), parts)
                spent += time.monotonic() - started
                if parts:  # a wrapped ``_time_ms`` may not fill it
                    splits[(entry.name, config)] = parts[-1]
            except Exception as exc:  # a broken candidate loses, it does not take the job down
                reason = f"raised {type(exc).__name__}: {exc}"
        if reason is not None:
            rejected.append((label, f"failed the correctness gate: {reason}"))
            log.info("autotune %s %s: %s rejected: %s", spec.name, key, label, reason)
            timings.append((entry.name, config, math.inf))
            continue
        log.info("autotune %s %s: %s %.4f ms", spec.name, key, label, ms)
        timings.append((entry.name, config, ms))
    agreed = False
    if consensus_enabled():
        if spec.keys_vary_across_ranks:
            # A collective on a key other ranks may never meet would hang them (docs/tuning-db.md).
            log.info("autotune %s %s: rank consensus skipped (keys vary across ranks); call "
                     "turbo_dispatch.sync_tuning() on every rank after a warm-up step, or tune this op offline, "
                     "for one choice on every rank", spec.name, key)
        else:
            timings = agree_across_ranks(key, timings)
            agreed = True  # every rank must keep the agreed pick: no rank-local confirmation
    labelled = [(candidate_label(name, config), ms) for name, config, ms in timings]
    finite = [t for t in timings if math.isfinite(t[2])]
    best = min(((ms, name, config) for name, config, ms in finite), default=None, key=lambda t: t[0])
    if best is None:
        log.warning("autotune %s %s: every candidate failed; remembered for this key", spec.name, key)
        return TuneRecord(None, None, math.inf, tuple(rejected), tuple(labelled), measured=tuple(timings))
    note, split = "", None
    if not agreed:
        best, note, split = _confirm_against_default(spec, problem, candidates, finite, best, sets, device)
    if split is None:
        split = splits.get((best[1], best[2]))
    log.info("autotune %s %s: winner %s (%.4f ms)", spec.name, key, best[1], best[0])
    peer = _time_peer(spec, problem, next(c for c in candidates if c.name == best[1]), best[2], sets, device)
    return TuneRecord(best[1], best[2], best[0], tuple(rejected), tuple(labelled), note=note,
                      measured=tuple(timings), gpu_ms=None if split is None else split.gpu_ms,
                      host_ms=None if split is None else split.host_ms,
                      **({} if peer is None else peer))


def _peer_dtype(problem: Any) -> str | None:
    """The high-precision dtype a peer comparison of ``problem`` ran in, for ``explain``'s note."""
    dtype = getattr(problem, "a_dtype", None)
    return dtype_name(dtype) if isinstance(dtype, torch.dtype) else None


def _time_peer(spec: OpSpec, problem: Any, winner: Any, config: Hashable, sets: list,
               device: torch.device) -> dict | None:
    """Where ``spec`` has a high-precision counterpart for ``problem`` (``OpSpec.high_precision_peer``):
    the counterpart op's platform default (as an untuned call runs it: no config) and ``winner``
    with ``config`` timed in turns on the same input sets, ``CONFIRM_ROUNDS`` rounds, as the
    ``TuneRecord`` fields ``peer_op``, ``peer_backend``, ``peer_ms`` and ``peer_winner_ms`` (medians
    of each one's cost per call). None where there is no counterpart, it has no default for the
    problem, or anything fails: this comparison informs ``explain`` and never decides or breaks tuning."""
    if spec.high_precision_peer is None:
        return None
    from .op_spec import get_op_spec
    from .registry import get_registry

    try:
        mapped = spec.high_precision_peer(problem, sets)
        if mapped is None:
            return None
        peer_name, peer_problem, peer_sets = mapped
        peer_spec = get_op_spec(peer_name)
        registry = get_registry()
        backend = registry.default_for(peer_name, peer_spec.platform_of(peer_problem), peer_problem)
        if backend is None:
            log.info("autotune %s %s: no %s default serves %s; no peer timing", spec.name, format_key(problem),
                     peer_name, format_key(peer_problem))
            return None
        adapter = registry.get(peer_name, backend).adapter
        runs = {"peer": (lambda inputs: peer_spec.run(adapter, peer_problem, inputs, None), list(peer_sets)),
                "winner": (lambda inputs: spec.run(winner.adapter, problem, inputs, config), sets)}
        times: dict[str, list[float]] = {"peer": [], "winner": []}
        for _ in range(CONFIRM_ROUNDS):
            for label in ("peer", "winner"):
                fn, inputs = runs[label]
                times[label].append(_time_ms(fn, inputs, device, 0.0))
        peer_ms, winner_ms = statistics.median(times["peer"]), statistics.median(times["winner"])
        if not (math.isfinite(peer_ms) and math.isfinite(winner_ms) and peer_ms > 0 and winner_ms > 0):
            raise ValueError(f"non-positive or infinite times: peer {peer_ms} ms, winner {winner_ms} ms")
    except Exception as exc:  # informational only: tuning goes on without it
        log.warning("autotune %s %s: timing the high-precision peer failed (%s: %s); not recorded", spec.name,
                    format_key(problem), type(exc).__name__, exc)
        return None
    log.info("autotune %s %s: peer %s %s %.4f ms, winner %.4f ms in turns", spec.name, format_key(problem),
             peer_name, backend, peer_ms, winner_ms)
    return {"peer_op": peer_name, "peer_backend": backend, "peer_ms": peer_ms, "peer_winner_ms": winner_ms}


#: Rounds of the confirmation that re-times a winner against the platform default in turns.
CONFIRM_ROUNDS = 3


def _confirm_against_default(spec: OpSpec, problem: Any, candidates: Sequence[Any], finite: list, best: tuple,
                             sets: list, device: torch.device) -> tuple[tuple, str, CallTime | None]:
    """``best`` (ms, backend, config), or the platform default's first measured config when
    re-timing the two in turns shows the winner is not faster: one sweep measurement per candidate
    can favour one by noise or by what ran before it, and a choice slower than the call the op
    would make anyway is worse than no tuning. Returns the pick, a note for the record ("" when
    the sweep's winner is the default or the default was not measured) and, where the default is
    kept, its device/host split in the confirmation (its time is the pick's; else None)."""
    from .registry import get_registry

    default = get_registry().default_for(spec.name, spec.platform_of(problem), problem)
    entries = {c.name: c for c in candidates}
    measured = [config for name, config, _ in finite if name == default]
    if default is None or default == best[1] or default not in entries or not measured:
        return best, "", None
    picks = {"winner": (best[1], best[2]), "default": (default, measured[0])}
    times: dict[str, list[float]] = {"winner": [], "default": []}
    parts: dict[str, list[CallTime]] = {"winner": [], "default": []}
    for _ in range(CONFIRM_ROUNDS):
        for label in ("default", "winner"):
            entry, config = entries[picks[label][0]], picks[label][1]
            run = lambda inputs, entry=entry, config=config: spec.run(entry.adapter, problem, inputs, config)
            times[label].append(_time_ms(run, sets, device, 0.0, parts[label]))
    winner_ms, default_ms = statistics.median(times["winner"]), statistics.median(times["default"])
    if winner_ms < default_ms:
        return best, f"confirmed in turns: {winner_ms:.4f} ms against the default {default} at {default_ms:.4f} ms", None
    return (default_ms, default, measured[0]), (
        f"the sweep's winner {candidate_label(best[1], best[2])} was not faster than the default {default} when "
        f"re-timed in turns ({winner_ms:.4f} against {default_ms:.4f} ms): the default is kept"), \
        (CallTime.combined(parts["default"]) if parts["default"] else None)


def consensus_enabled() -> bool:
    """Rank consensus is opt-in (PRIMUS_TURBO_TUNE_CONSENSUS=1) and needs torch.distributed."""
    if not parse_bool(os.environ.get(CONSENSUS_ENV), CONSENSUS_ENV):
        return False
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def agree_across_ranks(key: str, timings: list[tuple[str, Hashable, float]]) -> list[tuple[str, Hashable, float]]:
    """Makes every rank see the same timings: each candidate's worst time over all ranks.

    The winner is then the same on every rank. This is a collective: every rank must tune the
    same keys in the same order, or the job hangs. Keys that differ between ranks (e.g. MoE
    token counts) must therefore not be tuned online with consensus on: tune them offline, or
    pin them. Mismatched keys or candidate lists are detected here and raise instead of mixing
    one rank's timings into another's key.
    """
    dist = torch.distributed
    mine = (key, [(name, repr(config)) for name, config, _ in timings], [ms for _, _, ms in timings])
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    for rank, (other_key, labels, _) in enumerate(gathered):
        if other_key != key or labels != mine[1]:
            raise RuntimeError(
                f"autotune rank consensus: rank {rank} tuned {other_key} with candidates {labels}, this rank "
                f"{key} with {mine[1]}; with {CONSENSUS_ENV}=1 every rank must tune the same keys in the same order"
            )
    worst = [max(times[i] for _, _, times in gathered) for i in range(len(timings))]
    return [(name, config, ms) for (name, config, _), ms in zip(timings, worst)]
