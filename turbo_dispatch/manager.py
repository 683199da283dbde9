"""GlobalBackendManager: code-level backend settings, layered over the environment.

Settings live in one immutable snapshot that is swapped atomically under a lock, so readers
(the resolver's hot path) never lock and never see a half-applied change. Every change bumps a
generation counter; decisions are cached per generation, so a change takes effect on the next
call. Environment variables are read when the snapshot is first built and again on every
change or ``reset()``. An op call also compares its family's ``PRIMUS_TURBO_*_BACKEND`` text with
the snapshot's and re-reads the environment when it changed, so editing that variable in a running
process takes effect on the next call; the other variables count after ``reset()`` or a setter.
"""
from __future__ import annotations

import functools
import itertools
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from .backend_type import BackendChoice, BackendLike, BackendType, PrecisionType
from .env import (ALL_PRECISIONS, AUTO_TUNE_ENV, check_backend_name, env_reader, env_text, parse_backend_setting,
                  parse_bool)
from .op_spec import FAMILY_ENV
from .tuning import config as _db_config

Choice = "BackendType | str"


@dataclass(frozen=True)
class Settings:
    """One consistent view of every setting; never mutated after construction."""

    generation: int
    code: dict = field(default_factory=dict)  # family -> {precision|'*': BackendType|str}
    code_auto_tune: bool | None = None
    env: dict = field(default_factory=dict)  # family -> {precision|'*': BackendType|str}
    env_auto_tune: bool | None = None
    code_db: dict = field(default_factory=dict)  # tuning-DB settings set in code (tuning.config names)
    env_db: dict = field(default_factory=dict)  # tuning-DB settings read from the environment
    env_raw: dict = field(default_factory=dict)  # family -> its *_BACKEND variable's env_reader value when read

    @functools.cached_property
    def db(self) -> "_db_config.DbSettings":
        """The effective tuning-database settings (computed once per snapshot)."""
        return _db_config.effective(self.code_db, self.env_db)

    def backend_choice(self, family: str, precision: str) -> tuple["BackendType | str | None", str]:
        """The backend (or AUTOTUNE) set for this family/precision and where it came from."""
        for layer, source in ((self.code, "code"), (self.env, "env")):
            per_family = layer.get(family)
            if per_family:
                value = per_family.get(precision, per_family.get(ALL_PRECISIONS))
                if value is not None:
                    return value, source
        return None, ""

    def global_auto_tune(self) -> tuple[bool, str]:
        if self.code_auto_tune is not None:
            return self.code_auto_tune, "code"
        if self.env_auto_tune is not None:
            return self.env_auto_tune, "env"
        return False, ""


_generation = itertools.count(1)
#: Per family, the fast reader of its PRIMUS_TURBO_*_BACKEND variable (``settings_for``).
_ENV_READERS = {family: env_reader(var) for family, var in FAMILY_ENV.items()}
_lock = threading.RLock()
_settings: Settings | None = None
_listeners: list[Callable[[], None]] = []
_reset_listeners: list[Callable[[], None]] = []


def _plugin_names() -> set[str]:
    from .registry import get_registry

    return get_registry().names()


def _read_env() -> tuple[dict, dict, bool | None, dict]:
    """(each family's *_BACKEND reader value, the parsed settings, autotune, tuning-DB settings)."""
    plugins = None
    env_raw = {family: read() for family, read in _ENV_READERS.items()}
    env = {}
    for family, raw in env_raw.items():
        text = env_text(raw)
        if text is None or not text.strip():
            continue
        if plugins is None:
            plugins = _plugin_names()
        env[family] = parse_backend_setting(text, FAMILY_ENV[family], plugins)
    return env_raw, env, parse_bool(os.environ.get(AUTO_TUNE_ENV), AUTO_TUNE_ENV), _db_config.read_env()


def current_settings() -> Settings:
    """The live snapshot (built from the environment on first use)."""
    settings = _settings
    if settings is None:
        with _lock:
            if _settings is None:
                _publish(Settings(0))
            settings = _settings
    return settings  # type: ignore[return-value]


def _publish(base: Settings, **changes) -> None:
    """Re-reads the environment, applies ``changes`` and installs the result as a new generation."""
    global _settings
    env_raw, env, env_auto_tune, env_db = _read_env()
    _settings = replace(base, generation=next(_generation), env=env, env_auto_tune=env_auto_tune, env_db=env_db,
                        env_raw=env_raw, **changes)
    for listener in list(_listeners):
        listener()


def settings_for(family: str) -> Settings:
    """The live snapshot, re-read from the environment first if ``family``'s
    ``PRIMUS_TURBO_*_BACKEND`` text changed since it was taken: a process that edits
    ``os.environ`` gets the new backend on its next call. One environment lookup per call (the
    raw value, compared with the one the snapshot was taken at); the text is parsed again only
    when it changed."""
    settings = _settings or current_settings()
    read = _ENV_READERS[family]
    if read() != settings.env_raw.get(family):
        with _lock:
            settings = _settings or current_settings()
            if read() != settings.env_raw.get(family):
                _publish(settings)
            settings = _settings
    return settings  # type: ignore[return-value]


def on_change(listener: Callable[[], None]) -> None:
    """Registers a callback run after every settings change (e.g. to drop decision caches)."""
    _listeners.append(listener)


def on_reset(listener: Callable[[], None]) -> None:
    """Registers a callback run by ``GlobalBackendManager.reset()``, also when re-reading the
    environment fails (e.g. to forget in-memory tuning results)."""
    _reset_listeners.append(listener)


def _family_setter(family: str):
    def setter(backend: BackendLike | None = None, precision: PrecisionType | str | None = None,
               auto_tune: bool = False) -> None:
        if backend is not None and auto_tune:
            raise ValueError(
                f"set_{family}_backend: pass either backend=... (pin it) or auto_tune=True (tune it), not both"
            )
        keys = (ALL_PRECISIONS,) if precision is None else PrecisionType.parse(precision).setting_keys()
        value = BackendType.AUTOTUNE if auto_tune else None
        if backend is not None:
            value = check_backend_name(backend, _plugin_names(), f"set_{family}_backend(backend={backend!r})")
        with _lock:
            settings = current_settings()
            per_family = dict(settings.code.get(family, {}))
            if value is None and precision is None:
                per_family.clear()  # set_*(None) unsets every precision of the family
            for key in keys:
                if value is None:
                    per_family.pop(key, None)
                else:
                    per_family[key] = value
            code = dict(settings.code)
            if per_family:
                code[family] = per_family
            else:
                code.pop(family, None)
            _publish(settings, code=code)

    setter.__name__ = f"set_{family}_backend"
    setter.__doc__ = f"""Pins (or, with ``auto_tune=True``, autotunes) the {family} backend in code.

    ``precision`` limits the setting to one precision class (``BF16_FP16_FP32``: the three
    high precisions; FP4 is refused, there are no FP4 ops); the env var keeps governing the
    others. ``backend=None`` unsets: for one precision, or (with ``precision=None``) all of them.

    Example:
        >>> from turbo_dispatch import GlobalBackendManager, BackendType
        >>> GlobalBackendManager.set_{family}_backend(BackendType.TORCH, precision="bf16")
        >>> GlobalBackendManager.get_{family}_backend("bf16")
        BackendChoice(backend=<BackendType.TORCH: 'TORCH'>, auto_tune=False)
        >>> GlobalBackendManager.set_{family}_backend(None)
    """
    return staticmethod(setter)


def _family_getter(family: str):
    def getter(precision: PrecisionType | str | None = None) -> BackendChoice | None:
        settings = current_settings()
        keys = (ALL_PRECISIONS,) if precision is None else PrecisionType.parse(precision).setting_keys()
        choices = {key: BackendChoice.from_setting(*settings.backend_choice(family, key)) for key in keys}
        if len(set(choices.values())) > 1:
            each = ", ".join(f"{key}={choice}" for key, choice in choices.items())
            raise ValueError(f"get_{family}_backend({precision!r}): the precisions it covers are set apart "
                             f"({each}); ask for one of them")
        return choices[keys[0]]

    getter.__name__ = f"get_{family}_backend"
    getter.__doc__ = f"""The {family} setting in force for ``precision``: a ``BackendChoice`` (the
    backend, or ``auto_tune=True``; its ``source`` says "code" or "env"), None when neither code
    nor the environment sets one. ``precision=None`` reads the family-wide setting;
    ``BF16_FP16_FP32`` the one its three precisions share (ValueError if they differ)."""
    return staticmethod(getter)


def _set_db(name: str, value: object, unset: bool) -> None:
    with _lock:
        settings = current_settings()
        code_db = dict(settings.code_db)
        if unset:
            code_db.pop(name, None)
        else:
            code_db[name] = value
        _publish(settings, code_db=code_db)


class GlobalBackendManager:
    """Process-wide backend settings, set in code (they take priority over env vars).

    Example:
        >>> from turbo_dispatch import GlobalBackendManager, BackendType
        >>> GlobalBackendManager.set_gemm_backend(BackendType.TORCH, precision="fp8")
        >>> GlobalBackendManager.get_gemm_backend("fp8").backend
        <BackendType.TORCH: 'TORCH'>
        >>> GlobalBackendManager.reset()
        >>> GlobalBackendManager.get_gemm_backend("fp8") is None
        True
    """

    set_gemm_backend = _family_setter("gemm")
    set_grouped_gemm_backend = _family_setter("grouped_gemm")
    set_attn_backend = _family_setter("attn")
    set_moe_dispatch_combine_backend = _family_setter("moe_dispatch_combine")
    get_gemm_backend = _family_getter("gemm")
    get_grouped_gemm_backend = _family_getter("grouped_gemm")
    get_attn_backend = _family_getter("attn")
    get_moe_dispatch_combine_backend = _family_getter("moe_dispatch_combine")

    @staticmethod
    def set_auto_tune(enabled: bool | None) -> None:
        """Turns autotuning on or off for every op (None: defer to PRIMUS_TURBO_AUTO_TUNE)."""
        if enabled is not None and not isinstance(enabled, bool):
            raise TypeError(f"set_auto_tune(enabled=...) expects a bool or None, got {enabled!r}")
        with _lock:
            _publish(current_settings(), code_auto_tune=enabled)

    @staticmethod
    def get_auto_tune() -> bool:
        """Whether autotuning is globally on (code setting, else PRIMUS_TURBO_AUTO_TUNE)."""
        return current_settings().global_auto_tune()[0]

    #: ``get_auto_tune`` under the name code written for Primus-Turbo calls.
    auto_tune_enabled = get_auto_tune

    # -- tuning database ------------------------------------------------------------------------------
    @staticmethod
    def set_tune_db(path: "str | os.PathLike[str] | None", *, unset: bool = False) -> None:
        """Names the writable tuning DB (overrides PRIMUS_TURBO_TUNE_DB). ``None`` keeps results in
        memory only; ``unset=True`` drops the code setting (the env var / default apply again).

        Example:
            >>> from turbo_dispatch import GlobalBackendManager
            >>> GlobalBackendManager.set_tune_db("/tmp/my_tuning.jsonl")
            >>> str(GlobalBackendManager.get_tune_db())
            '/tmp/my_tuning.jsonl'
            >>> GlobalBackendManager.set_tune_db(None, unset=True)
        """
        _set_db("user_db", None if path is None else Path(path).expanduser(), unset)

    @staticmethod
    def get_tune_db() -> "Path | None":
        """The writable tuning DB in force (None: memory only)."""
        return current_settings().db.user_db

    @staticmethod
    def set_tune_db_path(paths: "Sequence[str | os.PathLike[str]] | None") -> None:
        """Read-only tuning DBs, searched in order after the user DB (overrides
        PRIMUS_TURBO_TUNE_DB_PATH; None unsets). They are never written."""
        if isinstance(paths, (str, os.PathLike)):
            raise TypeError("set_tune_db_path expects a list of paths (or None), not a single path")
        _set_db("read_only", None if paths is None else tuple(Path(p).expanduser() for p in paths), paths is None)

    @staticmethod
    def set_shipped_tune_db(enabled: bool | None) -> None:
        """Whether the DBs shipped in the package are searched (default on; None: defer to
        PRIMUS_TURBO_TUNE_DB_SHIPPED)."""
        if enabled is not None and not isinstance(enabled, bool):
            raise TypeError(f"set_shipped_tune_db(enabled=...) expects a bool or None, got {enabled!r}")
        _set_db("shipped", enabled, enabled is None)

    @staticmethod
    def set_record_untuned(path: "str | os.PathLike[str] | None") -> None:
        """Records every problem key the job meets without a tuned result into ``path`` (for
        ``turbo-dispatch tune --from-recorded``); None unsets (PRIMUS_TURBO_RECORD_UNTUNED applies)."""
        _set_db("record_untuned", None if path is None else Path(path).expanduser(), path is None)

    @staticmethod
    def tune_db_layers() -> "list[tuple[str, Path]]":
        """The tuning-DB files searched, in order, as (layer, path)."""
        return current_settings().db.layers()

    @staticmethod
    def reset() -> None:
        """Clears every code setting, re-reads the environment and drops all cached decisions
        and in-memory tuning results (through the ``on_reset`` callbacks)."""
        global _settings
        with _lock:
            # Drop the old snapshot first: if the environment is now invalid, every later call
            # must raise the same ConfigError instead of running on stale settings.
            _settings = None
            try:
                _publish(Settings(0))
            finally:
                for listener in list(_reset_listeners):
                    listener()
