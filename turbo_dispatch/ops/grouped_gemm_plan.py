"""Per-call-key plans of the eager blockwise ``grouped_gemm_fp8`` training step.

An eager step (forward, dgrad, wgrad, and the quantisations of ``a``, ``b`` and the gradient) works
out the same things on every call with the same arguments' layout: the problem keys and their
checks, the resolver's decisions, each backend's configs, output shapes, launch arguments and
kernel plans. A ``StepPlan`` keeps them per call key (``step_key``): the first call with a key
runs the full path and prepares each piece (``Adapter.prepare``, ``low_precision.dual_quantize
.prepare_runs_both``/``prepare_tiles_both``); later calls run the prepared pieces, which allocate
the outputs and launch. The backward keeps a ``BackwardPlan`` per layout of the incoming gradient.

The key holds every fact the full path reads from the arguments: per tensor its type, shape,
strides, dtype, device and whether its data pointer is 16-byte aligned (what TMA descriptors and
Triton's specialisation read), ``requires_grad`` of ``a`` and ``b``, ``trans_b``, ``out_dtype`` and
the config. Never the group lengths' values (they are data, read on the device). So the checks
that passed for the first call hold for every later call with the key, and a prepared piece
sees operands laid out as the ones it was prepared with (the step's own quantisers make them).

What stays per call: the ``group_lens`` value check (it reads the environment switch and, when
on, the device), the backend environment variable (``manager.settings_for`` re-reads it; a
changed text starts a new settings generation), ``reuse_quantized_weights``, the compute-unit
cap, ``main_grad`` accumulation, whether the two-stream overlap applies, and each prepared
backend's own environment switches (``Adapter.prepare``).

Plans are void once the settings generation (``GlobalBackendManager`` setters, ``reset``, a
changed backend variable, the tuning-DB settings) or the resolver's ``epoch`` (the tuners storing
results) moved: the next call drops them all and plans afresh. A piece whose decision is
provisional (autotuning not finished) is not kept: every call resolves it again, as the unplanned
path does. Not used while anything traces (torch.compile, dispatch modes) or for tensor
subclasses: those take the unplanned path.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from .. import manager as _manager
from .. import resolver as _resolver
from ..low_precision import Float8QuantConfig
from ..low_precision.dual_quantize import prepare_runs_both, prepare_tiles_both
from ..tracing import tracing
from .grouped_gemm_fp8_step import step_forward_problem
from .grouped_gemm_problem import GroupedGemmFp8Problem, grouped_gemm_fp8_problem
from . import grouped_gemm_spec as _spec
from .grouped_gemm_spec import GROUPED_GEMM_FP8

#: Step plans kept at most; a full cache starts over (a job whose shapes vary without bound must
#: not grow it without bound; a plan is cheap to make again).
MAX_PLANS = 1024
#: Backward plans (gradient layouts) kept per step plan at most.
MAX_BACKWARD_PLANS = 16

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_plans: dict = {}
_state: list = [None]  # (settings generation, resolver epoch) the plans in _plans were made under
_lock = threading.Lock()
#: Step plans made (cache misses) and found (hits) since the process started: tests read them.
stats = {"built": 0, "hits": 0}


def _tensor_facts(t: torch.Tensor) -> tuple:
    return (t.__class__, t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def step_key(a, b, group_lens, group_offs, trans_b, out_dtype, config: Float8QuantConfig) -> Optional[tuple]:
    """The plan key of a ``grouped_gemm_fp8`` training call, or None where the call must take the
    unplanned path (an argument that is not a plain tensor, ``trans_b`` not a bool, tracing)."""
    if (a.__class__ not in _PLAIN or b.__class__ not in _PLAIN or group_lens.__class__ is not torch.Tensor
            or trans_b.__class__ is not bool or (group_offs is not None and group_offs.__class__ is not torch.Tensor)
            or tracing()):
        return None
    return (a.__class__, a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16 == 0, a.requires_grad,
            b.__class__, b.shape, b.stride(), b.dtype, b.device, b.data_ptr() % 16 == 0, b.requires_grad,
            group_lens.shape, group_lens.dtype, group_lens.device,
            None if group_offs is None else (group_offs.shape, group_offs.dtype, group_offs.device),
            trans_b, out_dtype, config)


def _current_state() -> tuple:
    return _manager.settings_for(GROUPED_GEMM_FP8.family).generation, _resolver.epoch()


def lookup(key: tuple) -> Optional["StepPlan"]:
    """The plan kept for ``key`` under the current settings and decisions, or None. Re-reads the
    family's backend variable first (``manager.settings_for``)."""
    state = _current_state()
    if state != _state[0]:
        with _lock:
            _plans.clear()
            _state[0] = state
        return None
    plan = _plans.get(key)
    if plan is not None:
        stats["hits"] += 1
    return plan


def keep(key: tuple, problem: GroupedGemmFp8Problem, config: Float8QuantConfig) -> "StepPlan":
    """A new plan for ``key``, whose call validated to ``problem``; kept for later calls."""
    plan = StepPlan(problem, config, _state[0])
    with _lock:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
        stats["built"] += 1
    return plan


def clear() -> None:
    """Forgets every plan."""
    with _lock:
        _plans.clear()


class _RunsQuantiser:
    """``runs_both`` with the signature of ``quantize_runs_both``, prepared by its first call
    (``prepare_runs_both``): the activation's quantiser of a step plan, the gradient's of a
    backward plan."""

    __slots__ = ("_runs",)

    def __init__(self) -> None:
        self._runs: Optional[Callable] = None

    def runs_both(self, x: torch.Tensor, dtype: torch.dtype, block_size: int):
        again = self._runs
        if again is not None:
            return again(x)
        result, self._runs = prepare_runs_both(x, dtype, block_size)
        return result


class StepPlan(_RunsQuantiser):
    """One call key's plan: its forward problem, the prepared quantisers of ``a`` and ``b``, the
    prepared forward GEMM (each made by the first call that needs it), and the backward plans.

    ``runs_both``/``tiles_both`` have the signature of ``quantize_runs_both``/``quantize_tiles_both``
    (``grouped_gemm_fp8_step.quantize_for_step`` takes them); ``forward(qa, qb, group_lens,
    group_offs)`` runs the forward GEMM on what they made."""

    __slots__ = ("problem", "config", "state", "_tiles", "_forward", "_backward")

    def __init__(self, problem: GroupedGemmFp8Problem, config: Float8QuantConfig, state: tuple) -> None:
        super().__init__()
        self.problem, self.config, self.state = problem, config, state
        self._tiles: Optional[Callable] = None
        self._forward: Optional[Callable] = None
        self._backward: dict = {}

    def tiles_both(self, w: torch.Tensor, dtype: torch.dtype, block_size: int):
        again = self._tiles
        if again is not None:
            return again(w)
        result, self._tiles = prepare_tiles_both(w, dtype, block_size)
        return result

    def forward(self, qa, qb, group_lens, group_offs) -> torch.Tensor:
        again = self._forward
        if again is not None:
            return again(qa, qb, group_lens, group_offs)
        out, self._forward = _spec.prepare_fp8(step_forward_problem(self.problem, qa, qb), qa, qb, group_lens,
                                                group_offs)
        return out

    def backward_plan(self, grad: Any) -> Optional["BackwardPlan"]:
        """The plan of the backward for this gradient's layout, or None where the backward takes
        the unplanned path: the settings or decisions changed since the forward (the unplanned
        path resolves under the new ones), something traces, or ``grad`` is not a plain tensor."""
        if grad.__class__ is not torch.Tensor or tracing() or _current_state() != self.state:
            return None
        key = _tensor_facts(grad)
        plan = self._backward.get(key)
        if plan is None:
            if len(self._backward) >= MAX_BACKWARD_PLANS:
                self._backward.clear()
            plan = self._backward.setdefault(key, BackwardPlan(self.config))
        return plan


class BackwardPlan(_RunsQuantiser):
    """The backward's prepared pieces for one gradient layout: the gradient's quantiser
    (``runs_both``) and the dgrad's and wgrad's GEMMs (``mm8``/``mm8_k``, the callables of
    ``grouped_gemm_grads.grouped_fp8_grads``). Each is prepared by its first call, which builds
    and checks the GEMM's problem key exactly as the unplanned path does; within one step plan
    each is always called with the same flags."""

    __slots__ = ("config", "_mm8", "_mm8_k")

    def __init__(self, config: Float8QuantConfig) -> None:
        super().__init__()
        self.config = config
        self._mm8: Optional[Callable] = None
        self._mm8_k: Optional[Callable] = None

    def mm8(self, x, y, lens, offs, trans_b, out_dtype, x_fp8, y_fp8, y_2d):
        again = self._mm8
        if again is not None:
            return again(x, y, lens, offs)
        out, self._mm8 = self._prepare(x, y, lens, offs, trans_b, False, out_dtype, x_fp8, y_fp8, y_2d)
        return out

    def mm8_k(self, x, y, lens, offs, out_dtype, x_fp8, y_fp8):
        again = self._mm8_k
        if again is not None:
            return again(x, y, lens, offs)
        out, self._mm8_k = self._prepare(x, y, lens, offs, False, True, out_dtype, x_fp8, y_fp8, False)
        return out

    def _prepare(self, x, y, lens, offs, trans_b, variable_k, out_dtype, x_fp8, y_fp8, y_2d):
        """The GEMM's problem key, built and checked as the unplanned path does, run and prepared."""
        cfg = self.config
        p = grouped_gemm_fp8_problem(x, y, lens, offs, trans_b, variable_k, out_dtype, x_fp8, y_fp8, cfg.granularity,
                                     cfg.block_size, y_2d)
        return _spec.prepare_fp8(p, x, y, lens, offs)
