"""The tuning-database file: JSON Lines, read tolerantly, written without losing anything.

One object per line (schema in docs/tuning-db.md): a ``header``, ``stamp`` lines (one per
environment), ``result`` lines (one tuned winner per stamp x op x key) and ``key`` lines (keys a
job met untuned, written by the record-untuned mode). Reading never raises on bad content: each
line that cannot be used is skipped and counted with its reason. Writing takes an exclusive lock
on ``<file>.lock``, re-reads the file, merges, writes a temporary file in the same folder, fsyncs
it and renames it over the original, so concurrent writers lose nothing and a writer killed at
any instant leaves either the old or the new complete file. Lines that are not valid JSON are
never silently dropped by a rewrite: every line that was skipped is appended to ``<file>.corrupt``
first.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
import tempfile
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from .stamp import Stamp

log = logging.getLogger("turbo_dispatch.tuning")

FORMAT = "turbo_dispatch-tunedb"
VERSION = 1
_RESULT_FIELDS = ("stamp", "op", "key", "backend", "config", "identity", "time_ms")
SCOPES = ("gemm", "step")


@dataclass(frozen=True)
class Result:
    """One tuned winner as stored: the key and config in their JSON forms."""

    stamp: str
    op: str
    key: dict
    backend: str
    config: Any
    identity: str
    time_ms: float
    candidates: dict = field(default_factory=dict)  # label -> ms, None when rejected
    rejected: tuple = ()  # (label, reason) pairs
    tuned: str = ""
    #: What ``time_ms`` and ``candidates`` time: ``gemm``, the GEMM alone (the offline and online
    #: tuners), or ``step``, a whole training step of the layer with this GEMM in it (the step tuner,
    #: ``tuning.step``): then every label's time is a step's, with the layer's other GEMMs as stored.
    scope: str = "gemm"
    #: Step results only: the default step's time in the step tuner's confirmation, the same on
    #: the layer's three entries, so that their speedup over the default is the layer's.
    default_ms: float | None = None
    #: The winner's device time and host issue time per call, in microseconds, where the tuner
    #: measured them (``time_ms`` is the larger of the two, per call); ``gpu_us`` is absent where the
    #: call computes on the host (cpu). Older entries have neither.
    gpu_us: float | None = None
    host_us: float | None = None
    #: fp8 ops with a high-precision counterpart: that op (``peer_op``, e.g. ``gemm``), its platform
    #: default (``peer_backend``) and the two costs per call in microseconds when the tuner re-timed
    #: the counterpart and the winner in turns on the same inputs (``peer_us``, ``peer_winner_us``).
    #: All four or none; older entries have none.
    peer_op: str | None = None
    peer_backend: str | None = None
    peer_us: float | None = None
    peer_winner_us: float | None = None

    @property
    def preference(self) -> tuple[bool, float]:
        """Sort key among results of one key: a step measurement first (it saw the GEMM among its
        neighbours, which a GEMM timed alone does not), then the faster."""
        return self.scope != "step", self.time_ms

    @property
    def key_text(self) -> str:
        return key_text(self.key)

    @property
    def merge_key(self) -> tuple[str, str, str]:
        return self.stamp, self.op, self.key_text

    def to_json(self) -> dict:
        return {"type": "result", "stamp": self.stamp, "op": self.op, "key": self.key, "backend": self.backend,
                "config": self.config, "identity": self.identity, "time_ms": self.time_ms,
                "candidates": self.candidates, "rejected": [list(r) for r in self.rejected], "tuned": self.tuned,
                **({} if self.scope == "gemm" else {"scope": self.scope}),
                **({} if self.default_ms is None else {"default_ms": self.default_ms}),
                **{name: value for name, value in (("gpu_us", self.gpu_us), ("host_us", self.host_us),
                                                   ("peer_op", self.peer_op), ("peer_backend", self.peer_backend),
                                                   ("peer_us", self.peer_us), ("peer_winner_us", self.peer_winner_us))
                   if value is not None}}

    @classmethod
    def from_json(cls, obj: dict) -> "Result":
        missing = [f for f in _RESULT_FIELDS if f not in obj]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        for name in ("stamp", "op", "backend", "identity"):
            if not isinstance(obj[name], str):
                raise ValueError(f"{name} must be a string")
        if not isinstance(obj["key"], dict):
            raise ValueError("key must be an object")
        time_ms = obj["time_ms"]
        if isinstance(time_ms, bool) or not isinstance(time_ms, (int, float)) or not math.isfinite(time_ms) \
                or time_ms < 0:
            raise ValueError(f"time_ms must be a finite non-negative number, got {time_ms!r}")
        candidates = obj.get("candidates", {})
        rejected = obj.get("rejected", [])
        if not isinstance(candidates, dict) or not isinstance(rejected, list):
            raise ValueError("candidates must be an object and rejected a list")
        scope = obj.get("scope", "gemm")
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        default_ms = obj.get("default_ms")
        if default_ms is not None and (isinstance(default_ms, bool) or not isinstance(default_ms, (int, float))
                                       or not math.isfinite(default_ms) or default_ms <= 0):
            raise ValueError(f"default_ms must be a finite positive number, got {default_ms!r}")
        gpu_us, host_us = (_optional_duration(obj, name) for name in ("gpu_us", "host_us"))
        return cls(obj["stamp"], obj["op"], obj["key"], obj["backend"], obj["config"], obj["identity"],
                   float(time_ms), candidates, tuple(tuple(r) for r in rejected), str(obj.get("tuned", "")), scope,
                   None if default_ms is None else float(default_ms), gpu_us, host_us, *_peer(obj))


_PEER_FIELDS = ("peer_op", "peer_backend", "peer_us", "peer_winner_us")


def _peer(obj: dict) -> tuple:
    """The peer fields of a result line: all absent (or null) gives four Nones; a partial set, a
    name that is not a non-empty string or a time that is not a finite positive number raises
    ValueError (the line is then skipped as malformed)."""
    present = [name for name in _PEER_FIELDS if obj.get(name) is not None]
    if not present:
        return None, None, None, None
    if len(present) != len(_PEER_FIELDS):
        missing = [name for name in _PEER_FIELDS if name not in present]
        raise ValueError(f"peer fields come together: {', '.join(present)} without {', '.join(missing)}")
    for name in ("peer_op", "peer_backend"):
        if not isinstance(obj[name], str) or not obj[name]:
            raise ValueError(f"{name} must be a non-empty string, got {obj[name]!r}")
    times = [_optional_duration(obj, name) for name in ("peer_us", "peer_winner_us")]
    for name, value in zip(("peer_us", "peer_winner_us"), times):
        if value == 0:
            raise ValueError(f"{name} must be a finite positive number, got {obj[name]!r}")
    return obj["peer_op"], obj["peer_backend"], *times


def _optional_duration(obj: dict, name: str) -> float | None:
    """The field ``name`` of a result line as a float: absent or null gives None; anything but a
    finite non-negative number raises ValueError (the line is then skipped as malformed)."""
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
    return float(value)


def key_text(key: dict) -> str:
    """Canonical text of a JSON key (field order as stored), used to index and sort."""
    return json.dumps(key, separators=(",", ":"))


@dataclass
class Contents:
    """What one file holds, plus what could not be used and why."""

    stamps: dict = field(default_factory=dict)  # id -> Stamp
    results: dict = field(default_factory=dict)  # merge_key -> Result
    keys: dict = field(default_factory=dict)  # (op, key_text) -> key object (recorded untuned keys)
    skipped: Counter = field(default_factory=Counter)  # reason -> lines
    unusable_lines: list = field(default_factory=list)  # raw skipped lines, backed up by a rewrite
    foreign: str | None = None  # why the whole file is not ours (then nothing else is read)

    def add_result(self, result: Result) -> bool:
        """Keeps the preferred of two measurements of one (stamp, op, key) (``Result.preference``:
        a step's over a lone GEMM's, then the faster); True if ``result`` won."""
        old = self.results.get(result.merge_key)
        if old is not None and old.preference <= result.preference:
            return False
        self.results[result.merge_key] = result
        self.__dict__.pop("_index", None)
        return True

    def discard(self, merge_key: tuple) -> None:
        self.results.pop(merge_key, None)
        self.__dict__.pop("_index", None)

    def for_key(self, op: str, text: str) -> list:
        """The results stored for (op, key text), any stamp; indexed on first use."""
        index = self.__dict__.get("_index")
        if index is None:
            index = {}
            for result in self.results.values():
                index.setdefault((result.op, result.key_text), []).append(result)
            self.__dict__["_index"] = index
        return index.get((op, text), [])

    def merge(self, other: "Contents") -> None:
        self.stamps.update(other.stamps)
        for result in other.results.values():
            self.add_result(result)
        self.keys.update(other.keys)

    def lines(self) -> Iterator[str]:
        """The file's lines in stable order: header, stamps, results, keys."""
        used = {r.stamp for r in self.results.values()}
        yield _dump({"type": "header", "format": FORMAT, "version": VERSION})
        for sid in sorted(self.stamps):
            if sid in used:
                yield _dump(self.stamps[sid].to_json())
        for mk in sorted(self.results, key=lambda k: (k[1], k[2], k[0])):
            yield _dump(self.results[mk].to_json())
        for op, text in sorted(self.keys):
            yield _dump({"type": "key", "op": op, "key": self.keys[(op, text)]})


def _dump(obj: dict) -> str:
    return json.dumps(obj, separators=(", ", ": "), allow_nan=False)


def parse(text: str, source: str = "<text>") -> Contents:
    """Parses file content; never raises on bad content (see ``Contents.skipped``)."""
    contents = Contents()
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            if _parse_line(contents, line):
                return contents
        except (RecursionError, MemoryError, TypeError, ValueError, KeyError) as exc:
            # A hostile line (say, JSON nested thousands deep) costs that line only.
            contents.skipped[f"unparsable line ({type(exc).__name__})"] += 1
            contents.unusable_lines.append(line)
    dangling = [r for r in contents.results.values() if r.stamp not in contents.stamps]
    for result in dangling:
        del contents.results[result.merge_key]
        contents.skipped["result references a stamp the file does not define"] += 1
        contents.unusable_lines.append(_dump(result.to_json()))
    return contents


def _parse_line(contents: Contents, line: str) -> bool:
    """Adds one line's content to ``contents``; True when the header says the file is foreign
    (then the caller stops reading)."""
    try:
        obj = json.loads(line)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        return _skip(contents, line, "corrupt line (not a JSON object)")
    kind = obj.get("type")
    if kind == "header":
        if obj.get("format") != FORMAT:
            contents.foreign = f"not a turbo_dispatch tuning DB (header format {obj.get('format')!r})"
            return True
        if not isinstance(obj.get("version"), int) or obj["version"] > VERSION:
            contents.foreign = f"written by schema version {obj.get('version')!r}; this version reads {VERSION}"
            return True
    elif kind == "stamp":
        try:
            stamp = Stamp.from_json(obj)
        except (KeyError, TypeError, ValueError) as exc:
            return _skip(contents, line, f"malformed stamp: {exc}")
        contents.stamps[stamp.id] = stamp
    elif kind == "result":
        try:
            contents.add_result(Result.from_json(obj))
        except (TypeError, ValueError) as exc:
            return _skip(contents, line, f"malformed result: {exc}")
    elif kind == "key":
        if not isinstance(obj.get("op"), str) or not isinstance(obj.get("key"), dict):
            return _skip(contents, line, "malformed key line: needs op (string) and key (object)")
        contents.keys[(obj["op"], key_text(obj["key"]))] = obj["key"]
    else:
        return _skip(contents, line, f"unknown line type {kind!r}")
    return False


def _skip(contents: Contents, line: str, reason: str) -> bool:
    contents.skipped[reason] += 1
    contents.unusable_lines.append(line)
    return False


# -- reading, with a cache and one warning per file version -------------------------------------------
_cache: dict[str, tuple[tuple, Contents]] = {}
_cache_lock = threading.Lock()


class TuningDBPathError(ValueError):
    """A tuning-DB path that must not be read or written: not a regular file, or a lock/backup
    sidecar that is a symbolic link. The message names the path and what it is."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def _require_regular(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise TuningDBPathError(f"tuning DB {path}: is a {_kind(mode)}, not a regular file")


def _signature(path: Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode


def _open_regular(path: Path, missing_ok: bool) -> int | None:
    """A read-only descriptor of the regular file at ``path`` (symlinks followed), or None when it
    is missing and ``missing_ok``. Never blocks: a FIFO or device is refused before it is opened,
    the open itself is non-blocking, and the descriptor is checked again (the path may have been
    swapped since the stat). Raises TuningDBPathError for anything but a regular file, and
    OSError when it cannot be opened."""
    try:
        st = path.stat()
    except FileNotFoundError:
        if missing_ok:
            return None
        raise TuningDBPathError(f"tuning DB {path}: does not exist") from None
    _require_regular(path, st.st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _require_regular(path, os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_readable(path: Path) -> None:
    """Raises TuningDBPathError unless ``path`` is an existing regular file, and OSError unless it
    can be opened for reading; reads nothing."""
    os.close(_open_regular(path, missing_ok=False))


def read_text(path: Path, *, missing_ok: bool = True) -> str:
    """The text of the regular file at ``path`` (``_open_regular``); "" when it is missing and
    ``missing_ok``."""
    fd = _open_regular(path, missing_ok)
    if fd is None:
        return ""
    with os.fdopen(fd, "rb") as handle:
        return handle.read().decode("utf-8", errors="replace")


_warned_unusable: set = set()


def read(path: "str | os.PathLike[str]") -> Contents:
    """The parsed file (empty when missing, unreadable or not a regular file: a layer that is a
    FIFO, device or directory is skipped with one warning); cached until the file changes."""
    path = Path(path)
    signature = _signature(path)
    if signature is None:
        return Contents()
    with _cache_lock:
        cached = _cache.get(str(path))
        if cached is not None and cached[0] == signature:
            return cached[1]
    try:
        text = read_text(path)
    except (OSError, TuningDBPathError) as exc:
        if (str(path), signature) not in _warned_unusable:
            _warned_unusable.add((str(path), signature))
            log.warning("tuning DB %s: cannot read it (%s); ignoring it", path, exc)
        return Contents()
    contents = parse(text, str(path))
    if contents.foreign:
        log.warning("tuning DB %s: %s; ignoring the whole file", path, contents.foreign)
    elif contents.skipped:
        detail = "; ".join(f"{n} x {why}" for why, n in contents.skipped.most_common())
        log.warning("tuning DB %s: skipped %d unusable line(s): %s", path, sum(contents.skipped.values()), detail)
    with _cache_lock:
        _cache[str(path)] = (signature, contents)
    return contents


# -- writing --------------------------------------------------------------------------------------------
def _open_sidecar(path: Path, flags: int) -> int:
    """Opens a lock or backup file beside the DB without following a symbolic link and without
    blocking, and only if it is a regular file: whoever can write the DB's folder must not be
    able to make a tuning run write to some other file."""
    umask = os.umask(0)
    os.umask(umask)
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                     0o666 & ~umask)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TuningDBPathError(f"tuning DB sidecar {path}: is a symbolic link; refusing to follow it") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise TuningDBPathError(f"tuning DB sidecar {path}: is a {_kind(mode)}, not a regular file")
    return fd


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``<path>.lock`` (a sidecar: the data file itself is replaced)."""
    import fcntl  # POSIX only, as is everything we run on

    fd = _open_sidecar(path.with_name(path.name + ".lock"), os.O_WRONLY | os.O_APPEND)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _append_backup(path: Path, lines: list) -> None:
    fd = _open_sidecar(path.with_name(path.name + ".corrupt"), os.O_WRONLY | os.O_APPEND)
    with os.fdopen(fd, "a", encoding="utf-8") as backup:
        backup.write("".join(line + "\n" for line in lines))


def writable_target(path: "str | os.PathLike[str]") -> Path:
    """Where a write to the DB at ``path`` lands: the file itself, or the file a symbolic link
    points to (a user DB linked to a team file updates the team file). Raises TuningDBPathError
    when that is anything but a regular file or a path still to be created."""
    path = Path(path)
    target = Path(os.path.realpath(path))
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        return target
    if not stat.S_ISREG(mode):
        raise TuningDBPathError(f"tuning DB {path}: is a {_kind(mode)}, not a regular file; refusing to write it")
    return target


def _atomic_write(path: Path, lines: Iterable[str]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file private (0600); a DB shared by a team keeps its mode, a new one
        # gets the usual umask-based mode.
        try:
            mode = path.stat().st_mode & 0o777
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for line in lines:
                out.write(line + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def rewrite(path: "str | os.PathLike[str]", change: Callable[[Contents], None]) -> Contents:
    """Under the lock: re-reads the file at ``path``, applies ``change`` to its contents in place
    and atomically writes the result, which it returns. Lines that could not be parsed are
    appended to ``<file>.corrupt`` before the rewrite drops them. A file that is not ours
    (foreign header) is never overwritten: that raises ValueError. A symbolic link is written
    through (its target is updated); a path that is not a regular file raises TuningDBPathError.
    """
    path = writable_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        writable_target(path)  # it may have changed while we waited for the lock
        current = parse(read_text(path), str(path))
        if current.foreign:
            raise ValueError(f"tuning DB {path}: {current.foreign}; refusing to overwrite it")
        if current.unusable_lines:
            _append_backup(path, current.unusable_lines)
            log.warning("tuning DB %s: moved %d unusable line(s) to %s.corrupt", path,
                        len(current.unusable_lines), path.name)
        current.unusable_lines = []
        change(current)
        _atomic_write(path, current.lines())
    return current


def update(path: "str | os.PathLike[str]", new: Contents) -> Contents:
    """Merges ``new`` into the file at ``path`` (``Contents.add_result`` picks between two results
    of one key) and returns what was written."""
    return rewrite(path, lambda current: current.merge(new))
