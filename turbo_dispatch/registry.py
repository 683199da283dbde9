"""Loads registry.yaml (plus plugin registries) into validated backend entries.

Schema (see docs/architecture.md)::

    version: 1
    ops:
      <op>:
        defaults: {cuda: <BACKEND>, rocm: <BACKEND>, cpu: <BACKEND>}
                                       # or a list per platform, [A, B]: the first that serves
        backends:                      # listed order = fallback order
          - name: <BACKEND>            # BackendType value, or a plugin's own name
            adapter: package.module:Class
            platforms: [cuda, rocm, cpu]
    kernels:                           # optional: kernel modules the core uses without an adapter
      <name>: package.module           # imported on first use by kernel_module(<name>)

Third-party backends arrive through the ``turbo_dispatch.backends`` entry-point group (an
object that is a registry path, a dict in this schema, or a callable returning either) and
through the files named by ``PRIMUS_TURBO_EXTRA_REGISTRY`` (os.pathsep-separated).
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable

import yaml

from .adapter import Adapter
from .backend_type import BackendType
from .errors import RegistryError
from .op_spec import KNOWN_OPS
from .device_platform import PLATFORMS

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "turbo_dispatch.backends"
EXTRA_REGISTRY_ENV = "PRIMUS_TURBO_EXTRA_REGISTRY"
_LINE = "__line__"


@dataclass
class BackendEntry:
    """One backend registered for one op; caches the adapter's availability."""

    op: str
    name: str
    adapter_path: str
    platforms: tuple[str, ...]
    origin: str
    adapter: Adapter = field(repr=False, default=None)  # type: ignore[assignment]
    _available: Any = field(default=..., repr=False)

    def available(self) -> str | None:
        if self._available is ...:
            try:
                self._available = self.adapter.available()
            except Exception as exc:  # an adapter probe must never take the job down
                self._available = f"availability probe raised {type(exc).__name__}: {exc}"
        return self._available

    def check(self, problem: Any, platform: str) -> str | None:
        """None when this entry can serve ``problem`` on ``platform``, else why not."""
        if platform not in self.platforms:
            return f"not registered for platform {platform} (only {', '.join(self.platforms)})"
        reason = self.available()
        if reason is not None:
            return f"unavailable: {reason}"
        try:
            return self.adapter.supports(problem)
        except Exception as exc:
            return f"supports() raised {type(exc).__name__}: {exc}"


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that remembers the line each mapping started on, for error messages."""

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        mapping = super().construct_mapping(node, deep=deep)
        mapping[_LINE] = node.start_mark.line + 1
        return mapping


@dataclass
class Registry:
    """All backends per op, with each op's default per platform, and the named kernel modules.

    A platform's default is a chain of one or more backends: the resolver takes the first that
    serves the problem (``SYMM_MEM`` where the group is one host's GPUs, else ``TORCH``, say);
    ``default`` names the chain's head."""

    entries: dict[str, list[BackendEntry]] = field(default_factory=dict)
    defaults: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    kernels: dict[str, str] = field(default_factory=dict)

    def backends(self, op: str, platform: str | None = None) -> list[BackendEntry]:
        """The op's entries in fallback order, optionally only those registered for a platform."""
        entries = self.entries.get(op, [])
        if platform is None:
            return list(entries)
        return [e for e in entries if platform in e.platforms]

    def get(self, op: str, name: str) -> BackendEntry | None:
        for entry in self.entries.get(op, []):
            if entry.name == name:
                return entry
        return None

    def default(self, op: str, platform: str) -> str | None:
        """The head of the op's default chain on ``platform`` (None without one)."""
        chain = self.defaults.get(op, {}).get(platform)
        return chain[0] if chain else None

    def default_chain(self, op: str, platform: str) -> tuple[str, ...]:
        """The op's defaults on ``platform`` in order of preference (empty without one)."""
        return self.defaults.get(op, {}).get(platform, ())

    def default_for(self, op: str, platform: str, problem: Any) -> str | None:
        """The platform default that serves ``problem``: the first of the default chain whose
        entry takes it (None when none does), the backend the resolver's default step picks."""
        for name in self.default_chain(op, platform):
            entry = self.get(op, name)
            if entry is not None and entry.check(problem, platform) is None:
                return name
        return None

    def names(self) -> set[str]:
        """Every backend name registered for any op."""
        return {e.name for entries in self.entries.values() for e in entries}

    # -- loading -----------------------------------------------------------------------------
    def add_document(self, doc: Any, origin: str, *, allow_defaults_override: bool) -> None:
        """Validates one registry document and adds its entries; errors name origin and line."""
        where = lambda node: f"{origin}:{node.get(_LINE, '?') if isinstance(node, dict) else '?'}"
        if not isinstance(doc, dict) or not isinstance(doc.get("ops"), dict):
            raise RegistryError(f"{where(doc)}: a registry needs a top-level mapping 'ops: {{<op>: ...}}'")
        version = doc.get("version", 1)
        if version != 1:
            raise RegistryError(f"{where(doc)}: unsupported registry version {version!r} (expected 1)")
        self._add_kernels(doc.get("kernels") or {}, origin, where)
        for op, spec in doc["ops"].items():
            if op == _LINE:
                continue
            if op not in KNOWN_OPS:
                raise RegistryError(
                    f"{where(doc['ops'])}: unknown op {op!r}; known ops: {', '.join(sorted(KNOWN_OPS))}"
                )
            if not isinstance(spec, dict):
                raise RegistryError(f"{where(doc['ops'])}: op {op!r} must map to 'backends' and 'defaults'")
            unknown = set(spec) - {"backends", "defaults", _LINE}
            if unknown:
                raise RegistryError(f"{where(spec)}: op {op!r} has unknown keys {sorted(unknown)}")
            for item in spec.get("backends", []) or []:
                self._add_entry(op, item, origin, where)
            defaults = spec.get("defaults") or {}
            for platform, name in defaults.items():
                if platform == _LINE:
                    continue
                if platform not in PLATFORMS:
                    raise RegistryError(
                        f"{where(defaults)}: op {op!r} default names unknown platform {platform!r}; "
                        f"valid: {', '.join(PLATFORMS)}"
                    )
                names = name if isinstance(name, list) else [name]
                if not names or not all(isinstance(n, str) and n for n in names):
                    raise RegistryError(f"{where(defaults)}: op {op!r}: the {platform} default must be a backend "
                                        f"name or a non-empty list of names; got {name!r}")
                chain = tuple(str(n).upper() for n in names)
                previous = self.defaults.setdefault(op, {}).get(platform)
                if previous is not None and previous != chain and not allow_defaults_override:
                    raise RegistryError(f"{where(defaults)}: op {op!r} already has a {platform} default")
                if previous is not None and previous != chain:
                    log.info("%s: %s default on %s changed from %s to %s", origin, op, platform,
                             " then ".join(previous), " then ".join(chain))
                self.defaults[op][platform] = chain

    def _add_kernels(self, kernels: Any, origin: str, where) -> None:
        """Records ``kernels: {name: package.module}``; a later document may point a name elsewhere."""
        if not isinstance(kernels, dict):
            raise RegistryError(f"{origin}: 'kernels' must map kernel names to module paths")
        for name, path in kernels.items():
            if name == _LINE:
                continue
            if not isinstance(path, str) or not path or ":" in path or any(not p for p in path.split(".")):
                raise RegistryError(f"{where(kernels)}: kernel {name!r} must name a module ('package.module'); "
                                    f"got {path!r}")
            previous = self.kernels.get(str(name))
            if previous is not None and previous != path:
                log.info("%s: kernel %s changed from %s to %s", origin, name, previous, path)
            self.kernels[str(name)] = path

    def _add_entry(self, op: str, item: Any, origin: str, where) -> None:
        if not isinstance(item, dict):
            raise RegistryError(f"{origin}: op {op!r}: each backend must be a mapping with name/adapter/platforms")
        missing = {"name", "adapter", "platforms"} - set(item)
        if missing:
            raise RegistryError(f"{where(item)}: backend of op {op!r} lacks {sorted(missing)}")
        name = str(BackendType.parse(str(item["name"])))
        if name in (BackendType.AUTOTUNE.value, BackendType.BLASLT.value):
            raise RegistryError(f"{where(item)}: {name} is an alias, not a registrable backend name")
        existing = self.get(op, name)
        if existing is not None:
            raise RegistryError(
                f"{where(item)}: duplicate backend {name!r} for op {op!r} (first registered at {existing.origin})"
            )
        platforms = item["platforms"]
        if isinstance(platforms, str):
            platforms = [platforms]
        bad = [p for p in platforms if p not in PLATFORMS]
        if not platforms or bad:
            raise RegistryError(
                f"{where(item)}: backend {name!r} of op {op!r} has invalid platforms {bad or platforms}; "
                f"valid: {', '.join(PLATFORMS)}"
            )
        adapter = _load_adapter(str(item["adapter"]), where(item))
        self.entries.setdefault(op, []).append(
            BackendEntry(op, name, str(item["adapter"]), tuple(platforms), where(item), adapter)
        )

    def validate_defaults(self) -> None:
        """Every default must name a backend registered for that op and platform."""
        for op, per_platform in self.defaults.items():
            for platform, chain in per_platform.items():
                for name in chain:
                    entry = self.get(op, name)
                    if entry is None or platform not in entry.platforms:
                        registered = ", ".join(e.name for e in self.backends(op, platform)) or "none"
                        raise RegistryError(f"op {op!r}: the {platform} default {name!r} is not a backend "
                                            f"registered for {platform} (registered: {registered})")


def _load_adapter(path: str, where: str) -> Adapter:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise RegistryError(f"{where}: adapter path {path!r} must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise RegistryError(f"{where}: adapter module {module_name!r} failed to import: {exc}") from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise RegistryError(f"{where}: adapter module {module_name!r} has no attribute {attr!r}")
    adapter = cls() if isinstance(cls, type) else cls
    if not isinstance(adapter, Adapter):
        raise RegistryError(f"{where}: {path!r} is not a turbo_dispatch.adapter.Adapter subclass")
    return adapter


def builtin_registry_path() -> Path:
    """Our registry.yaml: package data in an installed wheel, the repo root in a source checkout."""
    packaged = Path(__file__).with_name("registry.yaml")
    if packaged.is_file():
        return packaged
    return Path(__file__).resolve().parent.parent / "registry.yaml"


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise RegistryError(f"{path}: cannot read registry file: {exc}") from exc
    try:
        return yaml.load(text, Loader=_LineLoader)
    except yaml.YAMLError as exc:
        raise RegistryError(f"{path}: invalid YAML: {exc}") from exc


def _plugin_documents() -> Iterable[tuple[Any, str]]:
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        origin = f"entry point {ep.name} ({ep.value})"
        try:
            obj = ep.load()
            if callable(obj):
                obj = obj()
        except Exception as exc:
            raise RegistryError(f"{origin}: failed to load: {exc}") from exc
        if isinstance(obj, (str, os.PathLike)):
            yield _read_yaml(Path(obj)), str(obj)
        else:
            yield obj, origin


def load_registry(extra_files: Iterable[str] | None = None) -> Registry:
    """Builds the registry from our file, plugin entry points and the extra registry files."""
    registry = Registry()
    path = builtin_registry_path()
    registry.add_document(_read_yaml(path), str(path), allow_defaults_override=False)
    for doc, origin in _plugin_documents():
        registry.add_document(doc, origin, allow_defaults_override=True)
    if extra_files is None:
        extra_files = [p for p in os.environ.get(EXTRA_REGISTRY_ENV, "").split(os.pathsep) if p]
    for extra in extra_files:
        registry.add_document(_read_yaml(Path(extra)), extra, allow_defaults_override=True)
    registry.validate_defaults()
    return registry


_registry: Registry | None = None
_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, loaded on first use."""
    global _registry
    registry = _registry
    if registry is None:
        with _lock:
            if _registry is None:
                _registry = load_registry()
            registry = _registry
    return registry


def reload_registry() -> Registry:
    """Drops the loaded registry (e.g. after PRIMUS_TURBO_EXTRA_REGISTRY changed) and reloads it."""
    global _registry
    with _lock:
        _registry = load_registry()
        _kernel_modules.clear()
        return _registry


#: name -> (module, "") or (None, why not), filled by kernel_module.
_kernel_modules: dict[str, tuple[ModuleType | None, str]] = {}


def kernel_module(name: str) -> tuple[ModuleType | None, str]:
    """The kernel module registered as ``name`` under ``kernels``, imported on first use and cached:
    ``(module, "")``, or ``(None, why not)`` when none is registered or it does not import (no
    triton here, say). This is how the core reaches kernels without importing
    ``turbo_dispatch.backends``; a caller without the module takes its reference path."""
    found = _kernel_modules.get(name)
    if found is None:
        try:
            path = get_registry().kernels.get(name)
        except RegistryError as exc:
            return None, f"the registry did not load ({exc})"
        if path is None:
            found = (None, f"no kernel module {name!r} is registered (registry.yaml 'kernels')")
        else:
            try:
                found = (importlib.import_module(path), "")
            except Exception as exc:  # ImportError without triton, or a broken module
                found = (None, f"{path} is not importable ({type(exc).__name__}: {exc})")
        _kernel_modules[name] = found
    return found
