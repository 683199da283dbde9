"""What ``turbo-dispatch db show|validate|prune|merge`` compute (the CLI only prints it)."""
from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from . import store
from .database import judge, peer_ratio


@dataclass(frozen=True)
class EntryRow:
    op: str
    key: str
    backend: str
    config: object
    time_ms: float
    gpu: str
    status: str  # "ok", "ok (soft: driver)", or "skipped: <reason>"
    scope: str = "gemm"  # what time_ms times (store.Result.scope)
    gpu_us: float | None = None  # the winner's device time per call, where stored
    host_us: float | None = None  # the winner's host issue time per call, where stored
    peer: str | None = None  # the high-precision counterpart, "op/BACKEND", where stored
    peer_ratio: float | None = None  # its time over the winner's in turns (above 1: the winner is faster)


@dataclass
class FileReport:
    path: Path
    rows: list = field(default_factory=list)
    line_problems: Counter = field(default_factory=Counter)  # unparseable lines by reason
    entry_skips: Counter = field(default_factory=Counter)  # entries unusable here, by reason
    foreign: str | None = None
    missing: bool = False

    @property
    def usable(self) -> int:
        return sum(1 for r in self.rows if r.status.startswith("ok"))

    def summary(self) -> str:
        if self.missing:
            return f"{self.path}: no such file"
        if self.foreign:
            return f"0 entries ({self.foreign})"
        skipped = sum(self.entry_skips.values()) + sum(self.line_problems.values())
        text = f"{len(self.rows)} entries ({self.usable} usable here, {skipped} skipped"
        reasons = self.line_problems + self.entry_skips
        if reasons:
            text += ": " + "; ".join(f"{n} x {why}" for why, n in reasons.most_common())
        return text + ")"


def _reason_class(reason: str) -> str:
    """Groups per-entry reasons for the summary (the rows keep the full text)."""
    for prefix in ("tuned on another machine", "stale:", "stale key schema", "unknown op", "backend"):
        if reason.startswith(prefix):
            return prefix.rstrip(":")
    return reason


def inspect(path: "str | os.PathLike[str]") -> FileReport:
    """Every entry of the file at ``path`` with its verdict for this machine."""
    path = Path(path)
    report = FileReport(path)
    if not path.exists():
        report.missing = True
        return report
    contents = store.read(path)
    report.foreign = contents.foreign
    report.line_problems.update(contents.skipped)
    for mk in sorted(contents.results, key=lambda k: (k[1], k[2], k[0])):
        result = contents.results[mk]
        stamp = contents.stamps[result.stamp]
        verdict = judge(result, contents.stamps)
        if verdict.reason is None:
            status = "ok" + (f" (soft: {', '.join(verdict.soft)})" if verdict.soft else "")
        else:
            status = f"skipped: {verdict.reason}"
            report.entry_skips[_reason_class(verdict.reason)] += 1
        key = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in result.key.items())
        stored_peer = result.peer_us is not None
        report.rows.append(EntryRow(result.op, key, result.backend, result.config, result.time_ms, stamp.gpu, status,
                                    result.scope, result.gpu_us, result.host_us,
                                    f"{result.peer_op}/{result.peer_backend}" if stored_peer else None,
                                    peer_ratio(result.peer_us, result.peer_winner_us) if stored_peer else None))
    return report


def validate_problems(report: FileReport) -> list[str]:
    """Problems that make ``db validate`` fail: an unreadable/foreign file, unparseable lines, and
    entries that are broken or stale for *this* machine. Entries tuned on another GPU are fine
    (a cluster file may cover several) and are not problems."""
    if report.missing:
        return ["no such file"]
    problems = [report.foreign] if report.foreign else []
    problems += [f"{n} line(s): {why}" for why, n in report.line_problems.items()]
    problems += [f"{n} entr{'y' if n == 1 else 'ies'}: {why}" for why, n in report.entry_skips.items()
                 if why != "tuned on another machine"]
    return problems


def prune(path: "str | os.PathLike[str]", foreign_too: bool = False,
          min_speedup: float | None = None) -> tuple[int, int]:
    """Drops the entries that are unusable on this machine (stale identity, undecodable key,
    unknown op/backend; with ``foreign_too`` also entries of other machines) and, with
    ``min_speedup``, every entry whose winner was not at least that many times faster than the
    op's platform default in its own profile (``speedup_over_default``; unknown counts as not):
    a key left out runs the default, so a DB to ship keeps only the wins that are worth their risk.
    Returns (removed, kept)."""
    removed = 0

    def change(contents: store.Contents) -> None:
        nonlocal removed
        for mk, result in list(contents.results.items()):
            reason = judge(result, contents.stamps).reason
            stale = reason is not None and (foreign_too or not reason.startswith("tuned on another machine"))
            if stale or (min_speedup is not None and not speedup_over_default(result) >= min_speedup):
                contents.discard(mk)
                removed += 1

    written = store.rewrite(path, change)
    return removed, len(written.results)


def speedup_over_default(result: store.Result) -> float:
    """How many times faster the stored winner ran than the op's platform default did in the same
    profile (the default backend's first config where it has configs), or, for a step result, the
    layer's default step against its tuned step in the confirmation; NaN where the default was
    not timed there or has no default on the entry's platform."""
    from ..registry import get_registry
    from .offline import default_ms

    if not result.time_ms > 0:
        return math.nan
    if result.default_ms is not None:  # a step result: its layer's confirmed speedup
        return result.default_ms / result.time_ms
    timings = [(label, math.inf if ms is None else ms) for label, ms in result.candidates.items()]
    # the default that served the key is the first of the chain that was timed (one that refused
    # the key was no candidate)
    for default in get_registry().default_chain(result.op, result.key.get("platform", "")):
        ms = default_ms(default, timings)
        if not math.isnan(ms):
            return ms / result.time_ms
    return math.nan


def merge(output: "str | os.PathLike[str]", inputs: Sequence["str | os.PathLike[str]"]) -> tuple[int, list[str]]:
    """Merges ``inputs`` into ``output`` (created if missing; its own entries are kept, and the
    preferred measurement of one stamp/op/key wins, ``store.Result.preference``). Returns (entries
    written, warnings)."""
    combined = store.Contents()
    warnings = []
    for path in inputs:
        if not Path(path).exists():
            raise ValueError(f"db merge: input {path} does not exist")
        contents = store.read(path)
        if contents.foreign:
            raise ValueError(f"db merge: input {path}: {contents.foreign}")
        if contents.skipped:
            warnings.append(f"{path}: skipped " + "; ".join(f"{n} x {why}" for why, n in contents.skipped.items()))
        combined.merge(contents)
    written = store.update(output, combined)
    return len(written.results), warnings
