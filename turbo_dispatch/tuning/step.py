"""Step tuning: a grouped GEMM layer's forward, dgrad and wgrad choices, timed together in whole
training steps.

The offline tuner (``tuning.offline``) times each GEMM alone. For grouped GEMMs that is a poor
guide below about 10% margins: inside a step the dgrad runs beside the wgrad on a second stream,
the GEMMs share the power cap and the caches with their neighbours (and, for fp8, with the
quantisers), and a choice that wins alone can lose in the step (docs/kernels.md). This tuner
times what the job runs: the public op's forward and backward on near-balanced routing.

Search: coordinate descent from the platform defaults. Each role (forward, dgrad, wgrad) in turn
tries every candidate that passes the op's correctness gate (``autotune.gate``, on a random split
of the tokens, as the other tuners do) with the other roles held at their current choices, and
keeps the fastest step; passes repeat until none changes (``max_passes``). A choice is made by
putting it in the autotuner's memory for the role's key, where the resolver finds it first.

Only a confirmed gain is stored: the tuned step and the default step are then timed in turns
(``confirm_rounds`` pairs), and the layer's three entries are written (``store.Result.scope`` =
``"step"``: their times are whole steps) only where the tuned one was faster in every round and
at least ``min_speedup`` times faster in the median (``unconfirmed``). Otherwise nothing is
written and the keys keep running the default.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

import torch

from .. import autotune
from .. import manager as _manager
from .. import presets
from .. import resolver
from ..backend_type import BackendType
from ..op_spec import format_key, get_op_spec
from ..registry import get_registry
from .database import result_for
from ..device_platform import platform_of
from .keys import fp8_config, layer_keys, looked_up
from ..ops.grouped_gemm_routing import near_balanced_lens, offsets

log = logging.getLogger("turbo_dispatch.tuning")

ROLES = ("forward", "dgrad", "wgrad")
#: The ops the step tuner tunes (``tune --step``); others are tuned one key at a time.
STEP_OPS = ("grouped_gemm", "grouped_gemm_fp8")
#: A role's new choice must beat its current one by this much in the sweep to replace it, so that
#: timing noise between equal candidates does not keep a pass going.
SWEEP_MARGIN = 0.01


@dataclass(frozen=True)
class Layer:
    """One grouped layer: ``op`` grouped_gemm or grouped_gemm_fp8 (then ``granularity``), the
    weight [groups, n, k] applied as in GroupedLinear (trans_b=True) to ``m_total`` routed tokens."""

    op: str
    shape: presets.GroupedShape
    dtype: torch.dtype = torch.bfloat16
    granularity: str | None = None
    model: str = ""

    @property
    def label(self) -> str:
        s = self.shape
        recipe = f" fp8 {self.granularity}" if self.op == "grouped_gemm_fp8" else ""
        return f"{self.model + '/' if self.model else ''}{s.name} G={s.groups} M={s.m_total} N={s.n} K={s.k}{recipe}"


@dataclass(frozen=True)
class Candidate:
    backend: str
    config: Hashable
    entry: Any = field(compare=False, hash=False)

    @property
    def label(self) -> str:
        return autotune.candidate_label(self.backend, self.config)


@dataclass(frozen=True)
class RoleReport:
    """One role's sweep: every candidate's step time (ms) with the other roles as they then were."""

    role: str
    op: str
    key: str
    winner: str
    default: str
    timings: tuple[tuple[str, float], ...]
    rejected: tuple[tuple[str, str], ...] = ()
    held: str = ""  # why the role was not swept (its key was chosen for an earlier layer)


@dataclass(frozen=True)
class StepReport:
    """What step-tuning one layer gave. ``default_ms`` and ``tuned_ms`` are the confirmation's
    medians, timed in turns; ``status`` is "tuned" (entries written), "default kept", "held" (every
    key was chosen for an earlier layer of the run), "stored" (already in the DB) or "failed"."""

    layer: str
    status: str
    default_ms: float = math.nan
    tuned_ms: float = math.nan
    roles: tuple[RoleReport, ...] = ()
    seconds: float = 0.0
    note: str = ""
    rounds: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())  # the confirmation: (default, tuned) ms

    @property
    def speedup(self) -> float:
        return self.default_ms / self.tuned_ms if self.tuned_ms > 0 else math.nan


@dataclass(frozen=True)
class _Role:
    name: str
    op: str
    problem: Any  # the decision (bucketed) problem: the key calls look up
    candidates: tuple[Candidate, ...]  # those that passed the gate, in profiling order
    rejected: tuple[tuple[str, str], ...]
    default: Candidate | None


def model_layers(model: str, ops: Sequence[str], granularities: Sequence[str], ep: int = 8,
                 tokens_per_expert: int = 4096, dtype: torch.dtype = torch.bfloat16) -> list[Layer]:
    """The grouped layers of an MoE preset (up_gate and down) for the grouped ops among ``ops``.

    Example:
        >>> [l.label for l in model_layers("tiny", ["grouped_gemm"], [], ep=1, tokens_per_expert=8)]
        ['tiny/up_gate G=4 M=32 N=64 K=64', 'tiny/down G=4 M=32 N=64 K=32']
    """
    preset = presets.get_model(model)
    if not preset.is_moe:
        return []
    shapes = presets.moe_grouped_shapes(preset, ep, tokens_per_expert)
    layers = [Layer("grouped_gemm", s, dtype, None, model) for s in shapes if "grouped_gemm" in ops]
    if "grouped_gemm_fp8" in ops:
        layers += [Layer("grouped_gemm_fp8", s, dtype, g, model) for g in granularities for s in shapes]
    return layers


def _pin_error(op: str, problem: Any) -> str | None:
    spec = get_op_spec(op)
    choice, origin = _manager.current_settings().backend_choice(spec.family, spec.precision_of(problem).value)
    if choice is None or choice is BackendType.AUTOTUNE:
        return None
    where = f"GlobalBackendManager.set_{spec.family}_backend" if origin == "code" else spec.env_var
    return (f"step tuning needs {op} unpinned: {where} pins {choice}, and a pinned backend overrides every "
            f"tuned choice; unset it to tune")


def _gated_role(name: str, op: str, problem: Any, device: torch.device) -> _Role:
    """The role's candidates (every backend x config that serves it) that pass the gate."""
    spec = get_op_spec(op)
    platform = spec.platform_of(problem)
    entries = [e for e in get_registry().backends(op) if e.check(problem, platform) is None]
    checked = spec.make_inputs(problem, device)
    reference = spec.reference(problem, checked)
    default_name = get_registry().default_for(op, platform, problem)
    passed, rejected, default = [], [], None
    for entry, config, first in autotune._plan(entries, problem):
        candidate = Candidate(entry.name, config, entry)
        reason = autotune.gate(spec, problem, entry, config, checked, reference)
        if reason is None:
            passed.append(candidate)
            # The default is what a call with nothing stored runs: the default backend with no
            # config, which is its adapter's first config (Adapter.configs).
            if entry.name == default_name and first:
                default = candidate
        else:
            rejected.append((candidate.label, f"failed the correctness gate: {reason}"))
            log.info("step tune %s %s: %s rejected: %s", op, format_key(problem), candidate.label, reason)
    return _Role(name, op, problem, tuple(passed), tuple(rejected), default)


def _step_inputs(layer: Layer, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Input sets for the step (enough of them that rotating defeats the L2 cache), each on
    near-balanced routing: (a, w, group_lens, group_offs, grad)."""
    s = layer.shape

    def draw() -> tuple[torch.Tensor, ...]:
        lens = near_balanced_lens(s.m_total, s.groups).to(device)
        a = torch.randn(s.m_total, s.k, device=device, dtype=layer.dtype).requires_grad_()
        w = (torch.randn(s.groups, s.n, s.k, device=device, dtype=layer.dtype) * s.k ** -0.5).requires_grad_()
        grad = torch.randn(s.m_total, s.n, device=device, dtype=layer.dtype)
        return a, w, lens, offsets(lens, s.m_total), grad

    first = draw()
    return [first] + [draw() for _ in range(autotune.timing_set_count(first, device, 4) - 1)]


def step_fn(layer: Layer) -> Callable[[Sequence[torch.Tensor]], None]:
    """One training step of ``layer`` through the public op: forward, then backward of ``grad``."""
    from ..ops import grouped_gemm, grouped_gemm_fp8

    fp8 = fp8_config(layer.granularity) if layer.op == "grouped_gemm_fp8" else None

    def step(inputs: Sequence[torch.Tensor]) -> None:
        a, w, lens, offs, grad = inputs
        a.grad = w.grad = None
        if fp8 is None:
            out = grouped_gemm(a, w, lens, offs, trans_b=True)
        else:
            out = grouped_gemm_fp8(a, w, lens, offs, trans_b=True, config=fp8)
        out.backward(grad)

    return step


@contextmanager
def _chosen(choices: dict[tuple[str, Any], Candidate]):
    """Makes every call of the keys in ``choices`` run its candidate: the resolver finds a
    result in the autotuner's memory before any DB. What memory held is restored afterwards."""
    with autotune._lock:
        saved = {key: autotune._memory.get(key) for key in choices}
        for key, c in choices.items():
            autotune._memory[key] = autotune.TuneRecord(c.backend, c.config, math.nan, note=f"step tune: {c.label}")
    resolver.clear_cache()
    try:
        yield
    finally:
        with autotune._lock:
            for key, record in saved.items():
                if record is None:
                    autotune._memory.pop(key, None)
                else:
                    autotune._memory[key] = record
        resolver.clear_cache()


class _Timer:
    """Times the step under a set of choices (host time covered on CUDA, ``autotune._time_ms``)."""

    def __init__(self, layer: Layer, device: torch.device, candidate_s: float):
        self.step = step_fn(layer)
        self.sets = _step_inputs(layer, device)
        self.device = device
        self.candidate_s = candidate_s

    def __call__(self, choices: dict[tuple[str, Any], Candidate]) -> float:
        with _chosen(choices):
            return autotune._time_ms(self.step, self.sets, self.device, time.monotonic() + self.candidate_s)


def unconfirmed(default_rounds: Sequence[float], tuned_rounds: Sequence[float], min_speedup: float) -> str | None:
    """Why the confirmation's rounds (the default step and the tuned one timed in turns, one pair
    per round) do not show a gain, or None. A gain needs the tuned step faster in *every* round
    (by chance, with no real difference, that happens in 1 of 2**rounds runs) and the medians at
    least ``min_speedup`` apart. One of the two alone is not enough: the same choices timed twice
    differ by a few percent on a GPU, which a median of a few rounds can mistake for a gain.

    >>> unconfirmed([10, 10, 10, 10, 10], [8, 8, 12, 8, 8], 1.02)
    'tuned step faster in 4 of 5 rounds, not all'
    >>> unconfirmed([10, 10, 10], [9.9, 9.9, 9.9], 1.02)
    'tuned step 1.010x the default in turns, under --min-speedup 1.02'
    >>> unconfirmed([10, 10, 10], [9, 9, 9], 1.02) is None
    True
    """
    wins = sum(t < d for d, t in zip(default_rounds, tuned_rounds))
    if wins < len(default_rounds):
        return f"tuned step faster in {wins} of {len(default_rounds)} rounds, not all"
    speedup = statistics.median(default_rounds) / statistics.median(tuned_rounds)
    if not speedup >= min_speedup:
        return f"tuned step {speedup:.3f}x the default in turns, under --min-speedup {min_speedup}"
    return None


def tune_layer(layer: Layer, device: torch.device, *, min_speedup: float = 1.02, max_passes: int = 2,
               confirm_rounds: int = 5, candidate_s: float = 0.1,
               held: dict[tuple[str, Any], tuple[Candidate, str]] | None = None,
               ) -> tuple[StepReport, list]:
    """Step-tunes one layer; returns its report and the (result, stamp) pairs to store (empty
    unless ``confirm_rounds`` rounds in turns confirm the tuned step ``min_speedup`` times faster
    than the default's, ``unconfirmed``). ``max_passes`` bounds the coordinate descent;
    ``candidate_s`` is the time spent timing each candidate step (at least five steps).

    ``held`` maps role keys already chosen (for an earlier layer of the same run) to (choice,
    that layer's label): such a role is held at its choice, not swept, so one key never gets two
    answers; keys this layer chooses are added to it.
    """
    held = {} if held is None else held
    started = time.perf_counter()
    roles: list[_Role] = []
    for name, (op, problem) in zip(ROLES, _layer_problems(layer, platform_of(device.type))):
        pinned = _pin_error(op, problem)
        if pinned is not None:
            raise ValueError(pinned)
        roles.append(_gated_role(name, op, problem, device))
    broken = [r for r in roles if not r.candidates]
    if broken:
        why = "; ".join(f"{r.name}: " + ("; ".join(f"{label}: {reason}" for label, reason in r.rejected)
                                          or "no backend serves it") for r in broken)
        return StepReport(layer.label, "failed", seconds=time.perf_counter() - started, note=why), []
    key = lambda role: (role.op, role.problem)  # noqa: E731
    was_held = {key(r): held[key(r)] for r in roles if key(r) in held}
    if len(was_held) == len(roles):
        return StepReport(layer.label, "held", seconds=time.perf_counter() - started,
                          note=f"its keys were chosen for {next(iter(was_held.values()))[1]}"), []
    # The baseline is what a call runs with nothing stored (the default; its first passing
    # candidate where the default itself failed the gate), except for held roles.
    default = {key(r): was_held[key(r)][0] if key(r) in was_held else r.default or r.candidates[0] for r in roles}
    choice = dict(default)
    # A default that failed the gate is a finding in itself; the baseline is then the role's first
    # correct candidate, and the report says so.
    broken_defaults = "; ".join(f"{r.name}: the default failed the gate, baseline {default[key(r)].label}"
                                for r in roles if r.default is None and key(r) not in was_held)
    if broken_defaults:
        log.warning("step tune %s: %s", layer.label, broken_defaults)

    def noted(note: str) -> str:
        return "; ".join(part for part in (note, broken_defaults) if part)
    timer = _Timer(layer, device, candidate_s)
    sweeps: dict[str, dict[str, float]] = {}
    for _ in range(max_passes):
        changed = False
        for role in roles:
            if key(role) in was_held or len(role.candidates) < 2:
                continue
            times = {}
            for candidate in role.candidates:
                times[candidate] = timer({**choice, key(role): candidate})
                log.info("step tune %s %s %s: %.4f ms", layer.label, role.name, candidate.label, times[candidate])
            sweeps[role.name] = {c.label: ms for c, ms in times.items()}
            best = min(times, key=times.get)
            if best != choice[key(role)] and times[best] < times[choice[key(role)]] * (1 - SWEEP_MARGIN):
                choice[key(role)] = best
                changed = True
        if not changed:
            break
    reports = tuple(RoleReport(
        r.name, r.op, format_key(r.problem), choice[key(r)].label, default[key(r)].label,
        tuple(sweeps.get(r.name, {}).items()), r.rejected,
        held=f"held at its choice for {was_held[key(r)][1]}" if key(r) in was_held else "") for r in roles)
    if choice == default:
        baseline = [times[default[key(r)].label] for r in roles for times in [sweeps.get(r.name, {})]
                    if default[key(r)].label in times]
        return StepReport(layer.label, "default kept", statistics.median(baseline) if baseline else math.nan,
                          roles=reports, seconds=time.perf_counter() - started,
                          note=noted("no role's choice beat the default" if sweeps else "no role has a choice")), []
    rounds: dict[str, list[float]] = {"default": [], "tuned": []}
    for _ in range(confirm_rounds):
        rounds["default"].append(timer(default))
        rounds["tuned"].append(timer(choice))
    default_ms, tuned_ms = (statistics.median(rounds[k]) for k in ("default", "tuned"))
    report = StepReport(layer.label, "tuned", default_ms, tuned_ms, reports, time.perf_counter() - started,
                        note=noted(""), rounds=(tuple(rounds["default"]), tuple(rounds["tuned"])))
    doubt = unconfirmed(rounds["default"], rounds["tuned"], min_speedup)
    if doubt is not None:
        return dataclasses.replace(report, status="default kept", note=noted(doubt)), []
    stored = []
    for role in roles:
        if key(role) in was_held:  # stored with the layer that chose it
            continue
        chosen = choice[key(role)]
        held[key(role)] = (chosen, layer.label)
        timings = tuple(sweeps.get(role.name, {chosen.label: tuned_ms}).items())
        record = autotune.TuneRecord(chosen.backend, chosen.config, tuned_ms, role.rejected,
                                     timings + tuple((label, math.inf) for label, _ in role.rejected))
        stored.append(result_for(get_op_spec(role.op), role.problem, record, [c.entry for c in role.candidates],
                                 scope="step", default_ms=default_ms))
    return report, stored


def _layer_problems(layer: Layer, platform: str) -> list[tuple[str, Any]]:
    """The layer's three (op, problem) keys, forward, dgrad, wgrad, as calls on ``platform`` look
    them up."""
    return [looked_up(op, problem, platform)
            for op, problem in layer_keys(layer.op, layer.shape, layer.dtype, layer.granularity)]


def _stored_layer(layer: Layer, db: Path, platform: str) -> bool:
    """Whether ``db`` already holds a usable step result for each of the layer's three keys."""
    from .offline import stored_in

    for op, problem in _layer_problems(layer, platform):
        stored = stored_in(db, get_op_spec(op), problem)
        if stored is None or stored.scope != "step":
            return False
    return True


def run(layers: Sequence[Layer], db: Path, device: torch.device, *, force: bool = False, progress: bool = True,
        distributed: bool = False, **tune_kwargs: Any) -> list[StepReport]:
    """Step-tunes ``layers`` and merges the confirmed choices into ``db`` (sharded over ranks
    under ``distributed``, as ``offline.run``); one report per layer. A layer whose three keys
    already have step results in ``db`` is skipped unless ``force``. ``tune_kwargs`` go to
    ``tune_layer``.

    Example (CPU, the TORCH backend alone, so there is no choice to make):
        >>> import tempfile, pathlib
        >>> layers = model_layers("tiny", ["grouped_gemm"], [], ep=1, tokens_per_expert=8)[:1]
        >>> db = pathlib.Path(tempfile.mkdtemp()) / "steps.jsonl"
        >>> [r.status for r in run(layers, db, torch.device("cpu"), progress=False)]
        ['default kept']
    """
    from .offline import run_sharded

    platform = platform_of(device.type)
    held: dict = {}

    def tune(layer: Layer) -> tuple[StepReport, list]:
        if not force and _stored_layer(layer, db, platform):
            return StepReport(layer.label, "stored", note=str(db)), []
        report, stored = tune_layer(layer, device, held=held, **tune_kwargs)
        log.info("step tune %s: %s, %.3fx (%.1f s)", layer.label, report.status, report.speedup, report.seconds)
        return report, stored

    return run_sharded(layers, db, tune, progress=progress, distributed=distributed, unit="layer")
