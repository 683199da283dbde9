"""One tuned choice per key on every rank, agreed at a point the caller names (``sync_tuning``).

Online rank consensus (``PRIMUS_TURBO_TUNE_CONSENSUS=1``) agrees key by key, inside the tuning
call, so it must skip ops whose keys differ between ranks (grouped GEMM under expert parallelism):
a rank waiting in a collective for a key another rank never meets would hang. ``sync_tuning`` is
the other way round: one collective that every rank calls at the same point of the job (after a
warm-up step, before CUDA graphs are captured), over whatever keys each rank has met by then. No
rank waits on a key, so key sets may differ, and afterwards every rank runs the same backend and
config for every key any rank has tuned or read from a DB.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Hashable, Sequence

import torch

from .. import autotune, resolver
from ..op_spec import format_key

log = logging.getLogger("turbo_dispatch.tuning.rank_sync")

#: (op, problem, record) as one rank knows it (``autotune.known_records``).
Known = tuple[str, Any, autotune.TuneRecord]


@dataclass(frozen=True)
class SyncReport:
    """What ``sync_tuning`` did on this rank: ``keys`` agreed in all, of which this rank had not met
    ``adopted`` and had chosen differently ``changed``; ``failed`` keys have no candidate that
    passed on every rank that profiled them (the platform default serves them everywhere)."""

    ranks: int
    keys: int
    adopted: int
    changed: int
    failed: int


def agree(per_rank: Sequence[Sequence[Known]]) -> dict[tuple[str, Any], autotune.TuneRecord]:
    """The one record per (op, problem) that every rank adopts, from each rank's known records
    (index = rank). Pure: the same input gives the same choice on every rank.

    Where ranks profiled a key, each candidate counts at its worst time over the ranks that
    profiled it (absent or rejected on one of them: not a candidate), as online consensus does, so
    the winner is fast on every rank that runs it. Where no rank profiled it (tuned-DB hits only),
    the lowest rank's record stands.
    """
    keys: dict[tuple[str, Any], list[autotune.TuneRecord]] = {}
    for known in per_rank:
        for op, problem, record in known:
            keys.setdefault((op, problem), []).append(record)
    return {key: _agree_on(key, records) for key, records in keys.items()}


def _agree_on(key: tuple[str, Any], records: list[autotune.TuneRecord]) -> autotune.TuneRecord:
    profiled = [r for r in records if r.measured]
    if not profiled:
        first = next((r for r in records if r.backend is not None), records[0])
        return replace(first, note=_note(first.note, "the lowest rank's stored result", len(records)))
    # Configs compare by value across processes, so candidates are matched by (backend, repr(config)).
    tables = [{(name, repr(config)): (name, config, ms) for name, config, ms in r.measured} for r in profiled]
    candidates: dict[Hashable, tuple[str, Hashable]] = {}
    for table in tables:  # in rank order, first seen first: ties break the same way on every rank
        for label, (name, config, _) in table.items():
            candidates.setdefault(label, (name, config))
    # A candidate some rank did not plan counts as inf there: it is not one every rank can run.
    measured = tuple((name, config, max(table[label][2] if label in table else math.inf for table in tables))
                     for label, (name, config) in candidates.items())
    labelled = tuple((autotune.candidate_label(name, config), ms) for name, config, ms in measured)
    rejected = tuple(dict.fromkeys(why for r in profiled for why in r.rejected))
    finite = [(ms, name, config) for name, config, ms in measured if math.isfinite(ms)]
    if not finite:
        log.warning("sync_tuning %s %s: no candidate passed on every rank that profiled it", key[0],
                    format_key(key[1]))
        return autotune.TuneRecord(None, None, math.inf, rejected, labelled, measured=measured,
                                   note=_note("", "no candidate passed on every rank", len(profiled)))
    ms, name, config = min(finite, key=lambda t: t[0])
    return autotune.TuneRecord(name, config, ms, rejected, labelled, measured=measured,
                               note=_note(f"tuned: {ms:.4f} ms", "each candidate at its worst rank's time",
                                          len(profiled)),
                               **_peer_of(profiled, name, config))


def _peer_of(profiled: list[autotune.TuneRecord], name: str, config: Hashable) -> dict:
    """The high-precision peer comparison (``TuneRecord.peer_*``) of the lowest rank whose own
    winner is the agreed one: a comparison against another winner would not describe it."""
    for r in profiled:
        if r.backend == name and repr(r.config) == repr(config) and r.peer_ms is not None:
            return dict(peer_op=r.peer_op, peer_backend=r.peer_backend, peer_ms=r.peer_ms,
                        peer_winner_ms=r.peer_winner_ms)
    return {}


def _note(base: str, how: str, ranks: int) -> str:
    agreed = f"agreed by sync_tuning over {ranks} rank(s): {how}"
    return f"{base}; {agreed}" if base else agreed


def sync_tuning(group: "torch.distributed.ProcessGroup | None" = None) -> SyncReport:
    """Makes every rank of ``group`` run the same backend and config for every key that any of
    them has autotuned or read from a tuning DB in this process.

    A collective (one ``all_gather_object``): call it on every rank of ``group``, at the same
    point of the job, as many times on each, e.g. after the first training step of a job that
    autotunes grouped GEMMs under expert parallelism, whose keys differ between ranks and so skip
    online consensus. Call it before CUDA graphs are captured: a captured graph keeps the kernels
    it recorded. The agreed results live in this process's memory, ahead of the DB layers; the
    DBs are not rewritten (a later job whose ranks read different DBs calls it again, or tunes
    offline and ships one file).

    Example (a one-rank group here; in a job, every rank after its warm-up step)::

        >>> import torch.distributed as dist, turbo_dispatch as turbo
        >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29511", rank=0, world_size=1)
        >>> turbo.sync_tuning()
        SyncReport(ranks=1, keys=0, adopted=0, changed=0, failed=0)
        >>> dist.destroy_process_group()
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sync_tuning: torch.distributed is not initialised; call it on every rank after "
                           "init_process_group")
    mine = autotune.known_records()
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    agreed = agree(gathered)
    before = {(op, problem): record for op, problem, record in mine}
    adopted = changed = failed = 0
    for (op, problem), record in agreed.items():
        own = before.get((op, problem))
        if own is None:
            adopted += 1
        elif (own.backend, own.config) != (record.backend, record.config):
            changed += 1
            log.info("sync_tuning %s %s: %s -> %s", op, format_key(problem),
                     autotune.candidate_label(own.backend, own.config), autotune.candidate_label(record.backend,
                                                                                                 record.config))
        failed += record.backend is None
        autotune.adopt(op, problem, record)
    resolver.clear_cache()
    report = SyncReport(world, len(agreed), adopted, changed, failed)
    log.info("sync_tuning: %s", report)
    return report


__all__ = ["SyncReport", "agree", "sync_tuning"]
