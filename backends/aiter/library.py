"""Finding AMD's AITER library and its entry points, lazily.

AITER ("AI Tensor Engine for ROCm") is published on PyPI as ``amd-aiter`` and imported as
``aiter``. PyPI's own ``aiter`` is an unrelated package (asyncio iterator helpers) that takes the
same import name, so finding a module called ``aiter`` is not enough: AMD's is recognised by its
``aiter/ops`` subpackage, and anything else is refused with a reason that names what was found.

Importing AMD's ``aiter`` loads its JIT machinery (and may build kernels on first use), so nothing
here imports it until an adapter's ``available()`` asks, and then once per process. Entry points
are looked up once each (``entry_point``); an adapter names the ones it calls and reports the
first that is missing (an ``AITER_TRITON_ONLY`` install, say, has the Triton ops but none of the
CK/HIP ones).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from importlib import metadata
from types import ModuleType
from typing import Any, Iterable

import torch

DISTRIBUTION = "amd-aiter"
_INSTALL = f"install AMD's AITER ({DISTRIBUTION} on PyPI; its import name is aiter)"
#: Modules of PyPI's asyncio-iterator ``aiter`` package (aiter 0.13): seen next to its __init__.py.
_ASYNCIO_AITER_MODULES = ("map_aiter.py", "push_aiter.py", "join_aiters.py")


def _impostor_reason(spec) -> str | None:
    """Why the module ``spec`` describes is not AMD's AITER (None: it has the ``ops`` subpackage)."""
    locations = list(spec.submodule_search_locations or [])
    if any(os.path.isdir(os.path.join(loc, "ops")) for loc in locations):
        return None
    where = locations[0] if locations else (spec.origin or "?")
    asyncio_kind = any(os.path.isfile(os.path.join(loc, name)) for loc in locations for name in _ASYNCIO_AITER_MODULES)
    dists = ", ".join(metadata.packages_distributions().get("aiter", [])) or "unknown"
    what = ("PyPI's unrelated asyncio-iterator package 'aiter'" if asyncio_kind
            else "not AMD's AITER (it has no aiter.ops subpackage)")
    return f"the installed 'aiter' ({where}, distribution {dists}) is {what}; {_INSTALL}"


@functools.lru_cache(maxsize=None)
def load() -> tuple[ModuleType | None, str | None]:
    """(the ``aiter`` module, None), or (None, why it cannot be used). Imports it on first call."""
    try:
        spec = importlib.util.find_spec("aiter")
    except (ImportError, ValueError) as exc:
        return None, f"looking for the aiter module failed ({type(exc).__name__}: {exc}); {_INSTALL}"
    if spec is None:
        return None, f"aiter is not installed; {_INSTALL}"
    reason = _impostor_reason(spec)
    if reason is not None:
        return None, reason
    try:
        module = importlib.import_module("aiter")
    except Exception as exc:  # noqa: BLE001 - a broken install or a failed JIT build is a reason, not a crash
        return None, f"import aiter failed ({type(exc).__name__}: {str(exc)[:300]})"
    return module, None


@functools.lru_cache(maxsize=None)
def entry_point(module: str, name: str) -> tuple[Any, str | None]:
    """(``module.name``, None) from AMD's AITER, or (None, why it is not there). ``module`` is a
    dotted path inside the package ("" for the top level)."""
    _, why = load()
    if why is not None:
        return None, why
    path = "aiter" + (f".{module}" if module else "")
    try:
        found = getattr(importlib.import_module(path), name, None)
    except Exception as exc:  # noqa: BLE001 - a submodule that fails to import is a reason
        return None, f"import {path} failed ({type(exc).__name__}: {str(exc)[:300]})"
    if found is None:
        return None, f"this aiter ({version()}) has no {path}.{name}"
    return found, None


def missing(points: Iterable[tuple[str, str]]) -> str | None:
    """The reason the first of ``points`` ((module, name) pairs) is unavailable, else None."""
    for module, name in points:
        _, why = entry_point(module, name)
        if why is not None:
            return why
    return None


def call(module: str, name: str) -> Any:
    """The entry point ``aiter[.module].name`` (raises RuntimeError with the reason if missing)."""
    found, why = entry_point(module, name)
    if why is not None:
        raise RuntimeError(why)
    return found


@functools.lru_cache(maxsize=None)
def version() -> str:
    """The installed amd-aiter's version ('absent' when it is not installed)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        module, _ = load()
        return str(getattr(module, "__version__", "absent")) if module is not None else "absent"


def device_fp8() -> torch.dtype | None:
    """The fp8 e4m3 dtype AITER's fp8 kernels take on this GPU (``aiter.dtypes.fp8``:
    float8_e4m3fnuz on gfx942, float8_e4m3fn on gfx950), None when it names neither."""
    dtypes, why = entry_point("", "dtypes")
    if why is not None:
        return None
    fp8 = getattr(dtypes, "fp8", None)
    return fp8 if fp8 in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) else None


def reset() -> None:
    """Forgets what was found (tests that swap the ``aiter`` on sys.path call it)."""
    load.cache_clear()
    entry_point.cache_clear()
    version.cache_clear()
