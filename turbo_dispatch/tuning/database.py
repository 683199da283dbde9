"""The layered tuning database: find a stored winner for a key, store a new one, record misses.

Validation is per entry (docs/tuning-db.md). An entry serves this machine when its stamp's hard
fields match this machine, its op and key decode with this version's problem type, its backend
is registered, and the backend's current ``identity(config)`` equals the stored one. Anything
else is skipped with a reason; the other entries of the file still serve.
"""
from __future__ import annotations

import datetime
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable, Sequence

from .. import manager as _manager
from ..op_spec import OpSpec, format_key, get_op_spec
from . import store
from .codec import decode_config, decode_key, encode_config, encode_key
from .stamp import Stamp, current_stamp

log = logging.getLogger("turbo_dispatch.tuning")


@dataclass(frozen=True)
class Hit:
    """A stored winner that serves this call."""

    backend: str
    config: Hashable
    time_ms: float
    layer: str
    path: Path
    soft: tuple[str, ...]  # soft stamp fields that differ from this machine
    gpu_ms: float | None = None  # the entry's device time per call, where stored
    host_ms: float | None = None  # the entry's host issue time per call, where stored
    #: The high-precision counterpart's comparison, where stored (``autotune.TuneRecord``).
    peer_op: str | None = None
    peer_backend: str | None = None
    peer_ms: float | None = None
    peer_winner_ms: float | None = None

    def note(self) -> str:
        soft = f"; differs in {', '.join(self.soft)} (soft)" if self.soft else ""
        return f"tuned-db: {self.backend} {self.time_ms:.4f} ms from the {self.layer} DB {self.path}{soft}"


@dataclass(frozen=True)
class Verdict:
    """Whether one stored result serves this machine, and why not."""

    problem: Any  # the decoded problem, None when the key does not decode
    reason: str | None  # None: usable
    soft: tuple[str, ...] = ()


def judge(result: store.Result, stamps: dict, entry_for=None) -> Verdict:
    """Validates one stored result for this machine (the hard/soft rules of docs/tuning-db.md).

    ``entry_for(op, backend)`` returns the registry entry (default: the live registry).
    """
    from ..registry import get_registry

    try:
        spec = get_op_spec(result.op)
    except ValueError:
        return Verdict(None, f"unknown op {result.op!r}")
    try:
        problem = decode_key(spec.problem_type, result.key)
    except (ValueError, TypeError, KeyError) as exc:
        return Verdict(None, f"stale key schema: {exc}")
    stamp: Stamp = stamps[result.stamp]
    platform = spec.platform_of(problem)
    if stamp.platform != platform:
        return Verdict(problem, f"stamp platform {stamp.platform} differs from the key's {platform}")
    try:
        here = current_stamp(platform)
    except Exception:  # e.g. a cuda key on a machine without a GPU
        return Verdict(problem, f"tuned on another machine: platform {platform} ({stamp.gpu}); this machine has "
                                f"no {platform} device")
    foreign = stamp.hard_mismatch(here)
    if foreign:
        return Verdict(problem, foreign)
    entry = (entry_for or get_registry().get)(result.op, result.backend)
    if entry is None:
        return Verdict(problem, f"backend {result.backend} is not registered for {result.op}")
    try:
        config = decode_config(result.config)
        identity = entry.adapter.identity(config)
    except Exception as exc:
        return Verdict(problem, f"backend {result.backend} cannot describe config {result.config!r}: {exc}")
    if identity != result.identity:
        return Verdict(problem, f"stale: tuned with {result.identity}, this install has {identity}")
    try:
        refusal = entry.adapter.check_config(problem, config)
    except Exception as exc:  # a config malformed enough to break the check itself
        refusal = f"{type(exc).__name__}: {exc}"
    if refusal:
        return Verdict(problem, f"invalid config for {result.backend}: {refusal}")
    return Verdict(problem, None, tuple(stamp.soft_mismatch(here)))


def lookup(spec: OpSpec, problem: Any) -> Hit | None:
    """The first usable stored winner for ``problem`` across the layers, or None."""
    settings = _manager.current_settings().db
    key = encode_key(problem)
    text = store.key_text(key)
    for layer, path in settings.layers():
        contents = store.read(path)
        matches = contents.for_key(spec.name, text)
        usable = []
        for result in matches:
            verdict = judge(result, contents.stamps)
            if verdict.reason is None:
                usable.append((result, verdict))
            else:
                log.info("tuning DB %s: entry for %s %s skipped: %s", path, spec.name, format_key(problem),
                         verdict.reason)
        if usable:
            result, verdict = min(usable, key=lambda rv: rv[0].preference)
            return Hit(result.backend, decode_config(result.config), result.time_ms, layer, path, verdict.soft,
                       _ms(result.gpu_us), _ms(result.host_us), result.peer_op, result.peer_backend,
                       _ms(result.peer_us), _ms(result.peer_winner_us))
    return None


def result_for(spec: OpSpec, problem: Any, record: Any, candidates: Sequence[Any],
               scope: str = "gemm", default_ms: float | None = None) -> tuple[store.Result, Stamp]:
    """The stored form of one tuning outcome on this machine, and the stamp it references.

    ``record`` is an ``autotune.TuneRecord`` with a winner; ``candidates`` the registry entries
    it was tuned over (the winner's adapter gives the identity); ``scope`` what its times time
    and ``default_ms`` the default step's time, for step results (``store.Result``).
    """
    entry = next(c for c in candidates if c.name == record.backend)
    stamp = current_stamp(spec.platform_of(problem))
    result = store.Result(
        stamp=stamp.id, op=spec.name, key=encode_key(problem), backend=record.backend,
        config=encode_config(record.config), identity=entry.adapter.identity(record.config),
        time_ms=round(float(record.time_ms), 6),
        candidates={label: (round(ms, 6) if math.isfinite(ms) else None) for label, ms in record.timings},
        rejected=tuple((label, why) for label, why in record.rejected),
        tuned=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        scope=scope,
        default_ms=None if default_ms is None else round(float(default_ms), 6),
        gpu_us=_us(record.gpu_ms),
        host_us=_us(record.host_ms),
        **_peer_fields(record),
    )
    return result, stamp


def _peer_fields(record: Any) -> dict:
    """The ``store.Result`` peer fields of ``record``: all four, or none where it has no complete
    finite comparison."""
    fields = {"peer_op": record.peer_op, "peer_backend": record.peer_backend, "peer_us": _us(record.peer_ms),
              "peer_winner_us": _us(record.peer_winner_ms)}
    return fields if None not in fields.values() else {}


def _us(ms: float | None) -> float | None:
    return None if ms is None or not math.isfinite(ms) else round(float(ms) * 1e3, 3)


def _ms(us: float | None) -> float | None:
    return None if us is None else us / 1e3


def per_call_text(gpu_ms: float | None, host_ms: float) -> str:
    """How ``explain`` states a tuned entry's measured split, e.g. ``gpu 5.2 us, host 83.7 us per
    call``; where the call computes on the host (``gpu_ms`` None), the host time alone."""
    host = f"host {host_ms * 1e3:.1f} us per call"
    if gpu_ms is None:
        return f"{host} (no device: the host computes the call)"
    return f"gpu {gpu_ms * 1e3:.1f} us, {host}"


def peer_ratio(peer_ms: float, winner_ms: float) -> float:
    """How many times faster the tuned choice ran than its high-precision peer in the turns:
    ``peer_ms / winner_ms`` (above 1: the low-precision op is faster)."""
    return peer_ms / winner_ms


#: Ratios this close to 1 are reported as a tie: re-timing in turns still moves by about this much.
PEER_TIE = 0.02


def peer_text(peer_op: str | None, peer_backend: str | None, peer_ms: float, winner_ms: float,
              dtype: str | None = None) -> str:
    """How ``explain`` states the high-precision comparison, e.g. ``bf16 peer grouped_gemm TORCH:
    0.913 ms per call; this fp8 choice 0.945 ms = 0.97x its speed: fp8 loses on this key (...)``."""
    ratio = peer_ratio(peer_ms, winner_ms)
    if abs(ratio - 1.0) <= PEER_TIE:
        verdict = f": a tie within {PEER_TIE:.0%}"
    else:
        verdict = ": fp8 loses on this key" if ratio < 1.0 else ": fp8 wins on this key"
    return (f"{dtype or 'high-precision'} peer {peer_op} {peer_backend}: {peer_ms:.3f} ms per call; this fp8 choice "
            f"{winner_ms:.3f} ms = {ratio:.2f}x its speed{verdict} (the forward call, quantisation included, "
            f"timed in turns against the high-precision op's default on the same inputs)")


def contents_of(pairs: Sequence[tuple[store.Result, Stamp]]) -> store.Contents:
    """A Contents holding the results of ``(result, stamp)`` pairs and the stamps they reference."""
    contents = store.Contents()
    for result, stamp in pairs:
        contents.stamps[stamp.id] = stamp
        contents.add_result(result)
    return contents


_write_failed: set = set()


def save(pairs: Sequence[tuple[store.Result, Stamp]]) -> None:
    """Merges ``(result, stamp)`` pairs into the writable user DB, if one is set; a failure is
    logged once and never raised (a training job must not die because its cache folder is
    read-only)."""
    path = _manager.current_settings().db.user_db
    if path is None or not pairs:
        return
    try:
        store.update(path, contents_of(pairs))
    except Exception as exc:
        if str(path) not in _write_failed:
            _write_failed.add(str(path))
            log.warning("tuning DB %s: cannot write tuning results (%s); they stay in memory", path, exc)


_recorded: set = set()


def record_untuned(spec: OpSpec, problem: Any) -> None:
    """In record-untuned mode, appends ``problem`` to the record file (once per process and key)."""
    path = _manager.current_settings().db.record_untuned
    if path is None or (spec.name, problem, path) in _recorded:
        return
    _recorded.add((spec.name, problem, path))
    contents = store.Contents()
    key = encode_key(problem)
    contents.keys[(spec.name, store.key_text(key))] = key
    try:
        store.update(path, contents)
    except Exception as exc:
        log.warning("record-untuned file %s: cannot write (%s)", path, exc)
