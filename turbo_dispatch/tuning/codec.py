"""Problem keys and configs to and from JSON.

A problem (an op's NamedTuple key) is stored as an object of its fields in field order, with
dtypes by short name (``bf16``, ``e4m3``), enums by value and the rest as JSON scalars, so a
line reads like the key ``turbo-dispatch explain`` prints. Decoding checks the field names
against this version's problem type: a key written by a version whose problem had other fields
does not decode (the entry is skipped as stale, never misapplied).

Configs must be JSON scalars or (nested) tuples of them; tuples are stored as lists.
"""
from __future__ import annotations

import enum
import typing
from typing import Any, Hashable

import torch

from ..op_spec import _DTYPE_NAMES, dtype_name

_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
_SCALARS = (str, int, float, bool, type(None))


def encode_key(problem: Any) -> dict:
    """The JSON object for ``problem``."""
    out = {}
    for name, value in zip(problem._fields, problem):
        if isinstance(value, torch.dtype):
            value = dtype_name(value)
        elif isinstance(value, enum.Enum):
            value = value.value
        elif not isinstance(value, _SCALARS):
            raise TypeError(f"problem field {name}={value!r} has no JSON form")
        out[name] = value
    return out


def _decode_field(name: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        hint = next(h for h in typing.get_args(hint) if h is not type(None))
    if hint is torch.dtype:
        if value not in _DTYPES_BY_NAME:
            raise ValueError(f"field {name}: unknown dtype {value!r}")
        return _DTYPES_BY_NAME[value]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"field {name}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"field {name}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"field {name}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"field {name}: expected a string, got {value!r}")
        return value
    raise ValueError(f"field {name}: cannot decode type {hint!r}")


def decode_key(problem_type: type, obj: Any) -> Any:
    """The problem for ``obj``; ValueError when it does not match ``problem_type``'s fields."""
    if not isinstance(obj, dict):
        raise ValueError(f"key must be an object, got {type(obj).__name__}")
    expected = list(problem_type._fields)
    if list(obj) != expected:
        raise ValueError(f"key fields {list(obj)} do not match {problem_type.__name__}{tuple(expected)}")
    hints = typing.get_type_hints(problem_type)
    return problem_type(*(_decode_field(name, hints[name], obj[name]) for name in expected))


def encode_config(config: Hashable) -> Any:
    if isinstance(config, tuple):
        return [encode_config(c) for c in config]
    if isinstance(config, _SCALARS):
        return config
    raise TypeError(f"config {config!r} has no JSON form (use scalars or tuples of them)")


def decode_config(value: Any) -> Hashable:
    if isinstance(value, list):
        return tuple(decode_config(v) for v in value)
    if isinstance(value, _SCALARS):
        return value
    raise ValueError(f"config {value!r} is not a JSON scalar or list")
