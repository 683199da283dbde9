"""Offline tuning: profile a list of problem keys and store the winners in a tuning DB.

Used by ``turbo-dispatch tune``. Keys come from model presets (``keys.model_keys``) or from a
file written by the record-untuned mode. Under torch.distributed each rank tunes every
world_size-th key on its own GPU and rank 0 merges all results into the DB, so a node with 8
GPUs tunes 8 keys at a time.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .. import autotune
from ..op_spec import decision_problem, format_key, get_op_spec
from ..registry import get_registry
from . import store
from .codec import decode_key, encode_key
from .database import contents_of, judge, result_for
from .stamp import Stamp

log = logging.getLogger("turbo_dispatch.tuning")


@dataclass(frozen=True)
class KeyReport:
    """What tuning one key gave, for the summary table."""

    op: str
    key: str
    status: str  # "tuned", "stored" (already in a DB), "failed", "no candidate"
    winner: str = "-"
    winner_ms: float = math.nan
    default: str = "-"
    default_ms: float = math.nan
    seconds: float = 0.0
    note: str = ""

    @property
    def speedup(self) -> float:
        return self.default_ms / self.winner_ms if self.winner_ms > 0 else math.nan


def recorded_keys(path: "str | os.PathLike[str]") -> list[tuple[str, Any]]:
    """The (op, problem) keys of a record-untuned file; undecodable lines are logged and skipped."""
    store.check_readable(Path(path))  # a directory, FIFO or missing file is an error here
    contents = store.read(path)
    if contents.foreign:
        raise ValueError(f"{path}: {contents.foreign}")
    keys = []
    for (op, _), key in sorted(contents.keys.items()):
        try:
            spec = get_op_spec(op)
            keys.append((op, decode_key(spec.problem_type, key)))
        except (ValueError, TypeError) as exc:
            log.warning("%s: skipping recorded %s key %s: %s", path, op, key, exc)
    return keys


def _default_label(op: str, problem: Any) -> str | None:
    return get_registry().default_for(op, get_op_spec(op).platform_of(problem), problem)


def default_ms(default: str, timings: Sequence[tuple[str, float]]) -> float:
    """The default backend's time among a profile's labelled ``timings``: its unconfigured label,
    else its first config's (``Adapter.configs`` lists the config a call without one runs first,
    and the profile times each backend's configs in that order). NaN where it was not timed."""
    for label, ms in timings:
        if label == default or label.startswith(default + "["):
            return ms if math.isfinite(ms) else math.nan
    return math.nan


def stored_in(db: Path, spec, problem: Any) -> "store.Result | None":
    """The fastest result in ``db`` that serves ``problem`` on this machine, if any."""
    contents = store.read(db)
    usable = [r for r in contents.for_key(spec.name, store.key_text(encode_key(problem)))
              if judge(r, contents.stamps).reason is None]
    return min(usable, key=lambda r: r.preference, default=None)


def tune_one(op: str, problem: Any, force: bool = False,
             db: Path | None = None) -> tuple[KeyReport, "tuple[store.Result, Stamp] | None"]:
    """Profiles one key, unless ``db`` already holds a usable result for it and not ``force``
    (only the target DB counts: a result in another layer would be missing from the file
    being produced). A key whose op shares decisions (``OpSpec.shared_problem``: grouped GEMMs'
    token buckets) is tuned and stored as the shared key, the one calls look up. A key that
    cannot even be set up (a recorded key with a negative size, say) is a ``failed`` report with
    the reason, never an exception: one bad key must not end a run over many."""
    try:
        return _tune_one(op, problem, force, db)
    except Exception as exc:  # noqa: BLE001 - reported per key, like a candidate's failure
        log.debug("tune %s %r failed", op, problem, exc_info=True)
        try:
            key = format_key(problem)
        except Exception:  # noqa: BLE001 - a key too broken to print
            key = repr(problem)
        return KeyReport(op, key, "failed", note=f"cannot tune this key: {type(exc).__name__}: {exc}"), None


def _tune_one(op: str, problem: Any, force: bool, db: Path | None) -> tuple[KeyReport, "tuple[store.Result, Stamp] | None"]:
    spec = get_op_spec(op)
    problem = decision_problem(spec, problem)
    platform = spec.platform_of(problem)
    key = format_key(problem)
    default = _default_label(op, problem) or "-"
    if not force and db is not None:
        stored = stored_in(db, spec, problem)
        if stored is not None:
            return KeyReport(op, key, "stored", stored.backend, stored.time_ms, default, note=str(db)), None
    entries = get_registry().backends(op)
    candidates = [e for e in entries if e.check(problem, platform) is None]
    if not candidates:
        reasons = "; ".join(f"{e.name}: {e.check(problem, platform)}" for e in entries)
        return KeyReport(op, key, "no candidate", default=default, note=reasons), None
    started = time.perf_counter()
    record = autotune.profile(spec, problem, candidates)
    seconds = time.perf_counter() - started
    default_time = default_ms(default, record.timings)
    if record.backend is None:
        note = "; ".join(f"{label}: {why}" for label, why in record.rejected)
        return KeyReport(op, key, "failed", default=default, default_ms=default_time, seconds=seconds, note=note), None
    autotune._memory[(spec.name, problem)] = record
    winner = record.backend if record.config is None else f"{record.backend}[{record.config}]"
    report = KeyReport(op, key, "tuned", winner, record.time_ms, default, default_time, seconds)
    return report, result_for(spec, problem, record, candidates)


def _progress(items: Sequence, enabled: bool, desc: str, unit: str):
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit=unit, dynamic_ncols=True)


def run(keys: Sequence[tuple[str, Any]], db: Path, *, force: bool = False, progress: bool = True,
        distributed: bool = False) -> list[KeyReport]:
    """Tunes ``keys`` and merges the winners into ``db``; returns one report per key (on rank 0
    under ``distributed``, every rank's keys; elsewhere this rank's)."""
    def tune_key(item: tuple[str, Any]) -> tuple[KeyReport, list]:
        report, stored = tune_one(*item, force, db)
        log.info("tune %s %s: %s %s (%.1f s)", item[0], report.key, report.status, report.winner, report.seconds)
        return report, [] if stored is None else [stored]

    return run_sharded(keys, db, tune_key, progress=progress, distributed=distributed, unit="key")


def run_sharded(items: Sequence[Any], db: Path, tune_item: Callable[[Any], tuple[Any, list]], *,
                progress: bool = True, distributed: bool = False, unit: str = "key") -> list:
    """The loop of the offline tuners: ``tune_item(item)`` gives (report, [(result, stamp), ...]),
    and the results are merged into ``db``. Under ``distributed`` each rank takes every
    world_size-th item and rank 0 gathers and writes everything (and returns every report);
    alone, results are written as they come, so an interrupted run keeps what it measured."""
    rank, world = 0, 1
    if distributed:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mine = list(items)[rank::world]
    reports: list = []
    results: list[tuple[dict, dict]] = []  # (result json, stamp json): stamps travel with results
    desc = f"tuning (rank {rank}/{world})" if world > 1 else "tuning"
    for item in _progress(mine, progress and rank == 0, desc, unit):
        report, stored = tune_item(item)
        reports.append(report)
        fresh = [(result.to_json(), stamp.to_json()) for result, stamp in stored]
        results += fresh
        if world == 1:
            _write(db, fresh)
    if world > 1:
        gathered_reports: list = [None] * world
        gathered_results: list = [None] * world
        torch.distributed.gather_object(reports, gathered_reports if rank == 0 else None, dst=0)
        torch.distributed.gather_object(results, gathered_results if rank == 0 else None, dst=0)
        if rank == 0:
            reports = [r for part in gathered_reports for r in part]
            _write(db, [r for part in gathered_results for r in part])
        torch.distributed.barrier()
    return reports


def _write(db: Path, results: Sequence[tuple[dict, dict]]) -> None:
    if not results:
        return
    store.update(db, contents_of([(store.Result.from_json(r), Stamp.from_json(s)) for r, s in results]))
