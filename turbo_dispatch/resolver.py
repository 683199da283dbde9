"""The priority chain: code setting -> env var -> tuned DB / autotune -> platform default -> fallback.

A pinned backend (code or env) that cannot serve the call is an error naming the reason, never
a silent swap. Automatic choices fall back with a logged reason. Decisions are cached per
(op, problem, settings generation): a warm call costs one dict lookup plus building the key.
An op with ``OpSpec.shared_problem`` (grouped GEMMs: token counts in buckets) decides, tunes and
stores under the shared problem; each call's own problem gets that decision once its backend is
checked against it.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from . import manager as _manager
from .backend_type import BackendType
from .decision import Decision
from .errors import BackendUnsupportedError, NoBackendError
from .op_spec import OpSpec, decision_problem, format_key
from .device_platform import vendor_blaslt
from .registry import get_registry

log = logging.getLogger("turbo_dispatch.resolver")

_cache: dict[tuple, Decision] = {}
_manager.on_change(_cache.clear)
#: Decisions cached at most; a full cache starts over. Token counts are bucketed, but other key
#: fields may still vary without bound in a long job, and a decision is cheap to make again (tuned
#: results stay in autotune's memory).
MAX_CACHED = 65536


def resolve(spec: OpSpec, problem: Any) -> Decision:
    """The decision for ``problem``; cached unless provisional."""
    settings = _manager.settings_for(spec.family)
    cache_key = (spec.name, problem, settings.generation)
    decision = _cache.get(cache_key)
    if decision is None:
        decision = _shared_decision(spec, problem, settings)
        _keep(cache_key, decision)
        log.debug("decision\n%s", decision)
    return decision


def _keep(cache_key: tuple, decision: Decision) -> None:
    if not decision.provisional:
        if len(_cache) >= MAX_CACHED:
            _cache.clear()
        _cache[cache_key] = decision


def _shared_decision(spec: OpSpec, problem: Any, settings: "_manager.Settings") -> Decision:
    """``problem``'s decision: its shared problem's (``decision_problem``), made once per shared
    key, where that backend serves ``problem`` itself; else one made for ``problem`` alone."""
    shared = decision_problem(spec, problem)
    if shared == problem:
        return _decide(spec, problem, settings)
    shared_key = (spec.name, shared, settings.generation)
    decision = _cache.get(shared_key)
    if decision is None:
        decision = _decide(spec, shared, settings)
        _keep(shared_key, decision)
    why = decision.entry.check(problem, spec.platform_of(problem))
    if why is not None:
        log.info("%s: %s, chosen for %s, cannot serve %s (%s); deciding it on its own", spec.name,
                 decision.backend, format_key(shared), format_key(problem), why)
        return _decide(spec, problem, settings)
    note = f"shared: decided for {format_key(shared)} (every call in its token bucket shares it)"
    return dataclasses.replace(decision, problem=problem, notes=decision.notes + (note,))


_epoch = 0


def clear_cache() -> None:
    """Forgets every cached decision (the tuners call it after storing new results) and starts a
    new ``epoch``."""
    global _epoch
    _epoch += 1
    _cache.clear()


def epoch() -> int:
    """A counter that ``clear_cache`` bumps: a cache of anything derived from decisions (the
    grouped step's plans) holds it beside ``Settings.generation`` and is void once either moved."""
    return _epoch


def _pinned_name(choice: "BackendType | str", platform: str, what: str) -> str:
    if choice is BackendType.BLASLT:
        name = vendor_blaslt(platform)
        if name is None:
            raise BackendUnsupportedError(f"{what}: BLASLT names the vendor BLAS-Lt, and platform {platform} has none")
        return name
    return choice.value if isinstance(choice, BackendType) else choice


def _decide(spec: OpSpec, problem: Any, settings: "_manager.Settings") -> Decision:
    from . import autotune

    registry = get_registry()
    platform = spec.platform_of(problem)
    precision = spec.precision_of(problem).value
    entries = registry.backends(spec.name)
    reasons = {e.name: e.check(problem, platform) for e in entries}

    def decided(entry, source, config=None, notes=(), provisional=False) -> Decision:
        rejected = tuple(
            (e.name, reasons[e.name] or f"can serve; not chosen ({entry.name} came from {source})")
            for e in entries
            if e is not entry
        )
        described = entry.adapter.describe(problem)
        notes = tuple(notes) + ((f"{entry.name}: {described}",) if described else ())
        return Decision(spec.name, problem, entry.name, source, config, rejected, notes, provisional, entry)

    choice, origin = settings.backend_choice(spec.family, precision)
    if choice is not None and choice is not BackendType.AUTOTUNE:
        what = (
            f"{spec.name} backend {choice} pinned by "
            + (f"GlobalBackendManager.set_{spec.family}_backend" if origin == "code" else spec.env_var)
            + f" (precision {precision})"
        )
        name = _pinned_name(choice, platform, what)
        entry = registry.get(spec.name, name)
        if entry is None:
            registered = ", ".join(e.name for e in entries) or "none"
            raise BackendUnsupportedError(f"{what}: {name} is not registered for {spec.name} (registered: {registered})")
        if reasons[name] is not None:
            raise BackendUnsupportedError(f"{what} cannot serve {format_key(problem)}: {reasons[name]}")
        return decided(entry, origin)

    notes: list[str] = []
    provisional = False
    # Stored results (memory, then the tuning DBs) apply whether or not autotune is on: a shipped
    # or cluster DB is meant to be used as is. Only profiling a miss needs autotune on.
    tune_on = choice is BackendType.AUTOTUNE or settings.global_auto_tune()[0]
    candidates = [e for e in entries if reasons[e.name] is None]
    outcome = autotune.tune(spec, problem, candidates, profile_allowed=tune_on)
    if outcome.entry is not None:
        return decided(outcome.entry, outcome.source, outcome.config, outcome.notes)
    notes += outcome.notes
    provisional = outcome.provisional

    chain = registry.default_chain(spec.name, platform)
    for i, default_name in enumerate(chain):
        if reasons.get(default_name) is None:
            if i:
                notes.append(f"platform default {default_name} (after {', '.join(chain[:i])})")
            return decided(registry.get(spec.name, default_name), "default", notes=notes, provisional=provisional)
        notes.append(f"platform default {default_name} rejected: {reasons[default_name]}")

    for entry in entries:
        if reasons[entry.name] is None:
            log.warning("%s %s: falling back to %s (%s)", spec.name, format_key(problem), entry.name, "; ".join(notes))
            return decided(entry, "fallback", notes=notes, provisional=provisional)

    detail = "\n".join(f"  {e.name}: {reasons[e.name]}" for e in entries) or "  (no backend registered)"
    raise NoBackendError(f"no backend can serve {spec.name} {format_key(problem)} on {platform}:\n{detail}")
