"""Where the tuning databases live: env vars, code overrides and the resulting layers.

Layers, first match wins: in-memory results -> the writable user DB -> the read-only DBs of
``PRIMUS_TURBO_TUNE_DB_PATH`` (in order) -> the DBs this package ships -> the op's default.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from ..env import parse_bool

DB_ENV = "PRIMUS_TURBO_TUNE_DB"
DB_PATH_ENV = "PRIMUS_TURBO_TUNE_DB_PATH"
SHIPPED_ENV = "PRIMUS_TURBO_TUNE_DB_SHIPPED"
RECORD_ENV = "PRIMUS_TURBO_RECORD_UNTUNED"
_OFF = {"off", "none", "0", "false", "no"}

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "tuned"


def default_user_db() -> Path:
    """``$XDG_CACHE_HOME/turbo_dispatch/tuning.jsonl`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "turbo_dispatch" / "tuning.jsonl"


@dataclass(frozen=True)
class DbSettings:
    """The effective database settings (code overrides applied over the environment)."""

    user_db: Path | None  # None: results are kept in memory only
    read_only: tuple[Path, ...]
    shipped: bool
    record_untuned: Path | None

    def layers(self) -> list[tuple[str, Path]]:
        """(layer name, file) in lookup order; the user DB first, shipped DBs last."""
        return list(self._layers)

    @functools.cached_property
    def _layers(self) -> tuple[tuple[str, Path], ...]:
        # Once per settings snapshot: every resolver miss looks the layers up, and listing the
        # shipped folder each time would put a directory scan on that path.
        out: list[tuple[str, Path]] = []
        if self.user_db is not None:
            out.append(("user", self.user_db))
        out += [("read-only", p) for p in self.read_only]
        if self.shipped and SHIPPED_DIR.is_dir():
            out += [("shipped", p) for p in sorted(SHIPPED_DIR.glob("*.jsonl"))]
        return tuple(out)


def _path_or_off(raw: str | None) -> Path | None:
    if raw is None or raw.strip().lower() in _OFF or not raw.strip():
        return None
    return Path(raw.strip()).expanduser()


def read_env() -> dict:
    """The database settings present in the environment (absent keys: not set there)."""
    env: dict = {}
    if DB_ENV in os.environ:
        env["user_db"] = _path_or_off(os.environ[DB_ENV])
    if os.environ.get(DB_PATH_ENV, "").strip():
        env["read_only"] = tuple(Path(p).expanduser() for p in os.environ[DB_PATH_ENV].split(os.pathsep) if p.strip())
    shipped = parse_bool(os.environ.get(SHIPPED_ENV), SHIPPED_ENV)
    if shipped is not None:
        env["shipped"] = shipped
    if os.environ.get(RECORD_ENV, "").strip():
        env["record_untuned"] = _path_or_off(os.environ[RECORD_ENV])
    return env


def effective(code: dict, env: dict) -> DbSettings:
    """Code settings override env settings override the defaults."""
    def pick(name, default):
        if name in code:
            return code[name]
        return env.get(name, default)

    return DbSettings(
        user_db=pick("user_db", default_user_db()),
        read_only=tuple(pick("read_only", ())),
        shipped=pick("shipped", True),
        record_untuned=pick("record_untuned", None),
    )
