"""The PRIMUS_TURBO_* environment grammar.

``PRIMUS_TURBO_<FAMILY>_BACKEND`` holds a comma-separated list of items. An item is either a
bare backend name (all precisions not listed elsewhere) or ``<precision>:<backend>``, where
precision is one of bf16/fp16/fp32/fp8, ``bf16_fp16_fp32`` (= bf16, fp16 and fp32) or ``other``
(= every precision not listed); ``fp4`` is refused with the reason (there are no FP4 ops). The backend
may be ``autotune``. Names are case-insensitive. Examples: ``TRITON``,
``fp8:triton,bf16:cublaslt``, ``fp8:autotune,other:torch``.
"""
from __future__ import annotations

import os
from typing import Callable, Iterable

from .backend_type import BackendType, PrecisionType, settable_precisions
from .errors import ConfigError

ALL_PRECISIONS = "*"
_OTHER_NAMES = {"other", "others", "default", "all", "*"}
AUTO_TUNE_ENV = "PRIMUS_TURBO_AUTO_TUNE"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def valid_backend_names(plugin_names: Iterable[str]) -> list[str]:
    return sorted({m.value for m in BackendType} | {"NATIVE"} | set(plugin_names))


def check_backend_name(backend: "BackendType | str", plugin_names: Iterable[str], where: str) -> "BackendType | str":
    """Parses a backend name, rejecting one that is neither built in nor registered by a plugin."""
    plugin_names = set(plugin_names)
    try:
        parsed = BackendType.parse(backend)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {backend!r} is not a backend name; valid backends: "
                          f"{', '.join(valid_backend_names(plugin_names))}") from None
    if not isinstance(parsed, BackendType) and parsed not in plugin_names:
        raise ConfigError(
            f"{where}: unknown backend {backend!r}; valid backends: {', '.join(valid_backend_names(plugin_names))}"
        )
    return parsed


def parse_backend_setting(raw: str, env_var: str, plugin_names: Iterable[str]) -> dict[str, "BackendType | str"]:
    """Parses one ``PRIMUS_TURBO_*_BACKEND`` value into {precision or '*': backend}."""
    setting: dict[str, BackendType | str] = {}
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        precision_text, sep, backend_text = item.rpartition(":")
        if not backend_text.strip():
            raise ConfigError(f"{env_var}={raw!r}: item {item!r} names no backend; valid backends: "
                              f"{', '.join(valid_backend_names(plugin_names))}")
        if not sep or precision_text.strip().lower() in _OTHER_NAMES:
            keys: tuple[str, ...] = (ALL_PRECISIONS,)
        else:
            try:
                precision = PrecisionType.parse(precision_text)
            except ValueError:
                valid = ", ".join(settable_precisions() + ["other"])
                raise ConfigError(
                    f"{env_var}={raw!r}: unknown precision {precision_text.strip()!r}; valid precisions: {valid}"
                ) from None
            try:
                keys = precision.setting_keys()
            except ValueError as exc:
                raise ConfigError(f"{env_var}={raw!r}: {exc}") from None
        for key in keys:
            if key in setting:
                raise ConfigError(f"{env_var}={raw!r}: precision {key if key != '*' else 'other'!r} is set twice")
        backend = check_backend_name(backend_text.strip(), plugin_names, f"{env_var}={raw!r}")
        setting.update(dict.fromkeys(keys, backend))
    return setting


def parse_bool(raw: str | None, env_var: str) -> bool | None:
    """Parses an on/off environment variable; None when it is unset."""
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{env_var}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def parse_nonnegative_float(raw: str | None, env_var: str, default: float) -> float:
    """Parses a finite number >= 0 from an environment variable; ``default`` when unset or blank.
    A bad value raises ConfigError naming the variable, never a bare ValueError."""
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value != float("inf")):
        raise ConfigError(f"{env_var}={raw!r}: expected a number >= 0 (default {default:g})")
    return value


def env_reader(name: str) -> Callable[[], "str | bytes | None"]:
    """A reader of environment variable ``name`` for paths taken on every call: it returns a
    value that compares equal between two reads exactly when the variable's text is the same
    (None when unset), not necessarily a ``str``.

    ``os.environ.get`` encodes the key, looks it up and decodes the value through three Python
    frames; on POSIX, where ``os.environ`` keeps the encoded variables in a dict that every
    change through ``os.environ`` updates, the reader looks the encoded key up there directly.
    Elsewhere, or if that dict is not there, it is ``os.environ.get``.

    >>> read = env_reader("PATH")
    >>> read() == env_reader("PATH")()
    True
    """
    data = getattr(os.environ, "_data", None)
    if os.name != "posix" or not isinstance(data, dict):
        return lambda: os.environ.get(name)
    key = os.fsencode(name)
    return lambda: data.get(key)


def env_text_reader(name: str) -> Callable[[], "str | None"]:
    """``env_reader`` whose value is the variable's text (None when unset): for switches read on
    every call and then parsed; the decoding happens only when the variable is set.

    >>> env_text_reader("PRIMUS_TURBO_SURELY_UNSET_VARIABLE")() is None
    True
    """
    read = env_reader(name)
    return lambda: env_text(read())


def env_text(raw: "str | bytes | None") -> "str | None":
    """The text of an ``env_reader`` value (None stays None)."""
    return os.fsdecode(raw) if isinstance(raw, bytes) else raw
