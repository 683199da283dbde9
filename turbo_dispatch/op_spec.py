"""Op specifications: what the resolver and autotuner need to know about each op.

An op's *problem* is a hashable NamedTuple built only from host-side facts (shapes, dtypes,
layout flags, quantisation recipe, platform). It is both the cache key and the argument that
``Adapter.supports`` inspects, so a cached decision can never be reused for a call whose flags
differ from the ones ``supports`` approved.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch

from .backend_type import PrecisionType

#: op name -> settings family (which env var / GlobalBackendManager setter governs it).
OP_FAMILIES: dict[str, str] = {
    "gemm": "gemm",
    "gemm_fp8": "gemm",
    "grouped_gemm": "grouped_gemm",
    "grouped_gemm_fp8": "grouped_gemm",
    "attention": "attn",
    "moe_dispatch_combine": "moe_dispatch_combine",
}
KNOWN_OPS = frozenset(OP_FAMILIES)

#: family -> environment variable (names kept from Primus-Turbo).
FAMILY_ENV: dict[str, str] = {
    "gemm": "PRIMUS_TURBO_GEMM_BACKEND",
    "grouped_gemm": "PRIMUS_TURBO_GROUPED_GEMM_BACKEND",
    "attn": "PRIMUS_TURBO_ATTN_BACKEND",
    "moe_dispatch_combine": "PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND",
}

_DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def precision_of_dtype(dtype: torch.dtype) -> PrecisionType:
    return {torch.bfloat16: PrecisionType.BF16, torch.float16: PrecisionType.FP16}.get(dtype, PrecisionType.FP32)


def format_key(problem: NamedTuple) -> str:
    """Human-readable, canonical rendering of a problem key: ``m=8,n=16,...``."""
    parts = []
    for name, value in zip(problem._fields, problem):
        if isinstance(value, torch.dtype):
            value = dtype_name(value)
        elif isinstance(value, bool):
            value = int(value)
        elif isinstance(value, enum.Enum):
            value = value.value
        parts.append(f"{name}={value}")
    return ",".join(parts)


def run_adapter(adapter: Any, problem: Any, inputs: Sequence[Any], config: Any) -> Any:
    """The default ``OpSpec.run``: ``adapter.run(problem, *inputs, config=config)``."""
    return adapter.run(problem, *inputs, config=config)


def problem_platform(problem: Any) -> str:
    """The default ``OpSpec.platform_of``: the problem's own ``platform`` field."""
    return problem.platform


@dataclass(frozen=True)
class OpSpec:
    """What the framework needs to know about one op.

    ``make_inputs(problem, device)`` draws fresh random inputs for a problem (autotuning and
    offline tuning work from keys alone); ``run(adapter, problem, inputs, config)`` calls a
    backend; ``reference(problem, inputs)`` computes the high-precision answer and
    ``check(problem, out, ref)`` returns None or why ``out`` is wrong; ``flops(problem)`` is for reports.
    """

    name: str
    #: The problem NamedTuple (the tuning database decodes stored keys with it).
    problem_type: type
    precision_of: Callable[[Any], PrecisionType]
    make_inputs: Callable[[Any, torch.device], Sequence[Any]]
    reference: Callable[[Any, Sequence[Any]], Any]
    check: Callable[[Any, Any, Any], "str | None"]
    flops: Callable[[Any], float]
    #: Calls a backend on synthesised inputs; most ops pass them straight to ``adapter.run``.
    run: Callable[[Any, Any, Sequence[Any], Any], Any] = run_adapter
    #: Every problem so far carries a ``platform`` field.
    platform_of: Callable[[Any], str] = problem_platform
    #: True when ranks of one job meet different keys for this op (e.g. token counts under expert
    #: parallelism): online rank consensus, a collective, is skipped for it (docs/tuning-db.md).
    keys_vary_across_ranks: bool = False
    #: Draws the inputs candidates are *timed* on, where those should differ from the checked
    #: ones (``make_inputs``), or None: both the same. Grouped GEMMs check on a random split of the
    #: tokens (empty and tiny groups catch wrong kernels) but time on near-balanced routing, the
    #: design point of a load-balanced MoE layer: a random split's few huge groups favour other
    #: backends than the routing the op meets in training.
    make_timing_inputs: Callable[[Any, torch.device], Sequence[Any]] | None = None
    #: Builds the problem from the public call's arguments (what explain() uses).
    problem_from_call: Callable[..., Any] | None = None
    #: Maps a call's problem to the problem whose decision (and tuning) it shares, or None: every
    #: problem is its own key. Grouped GEMMs round their token count up to a bucket
    #: (``tuning.buckets``), since dropless routing changes it every step. The resolver still
    #: checks that the shared choice serves the call's own problem (``resolver.resolve``).
    shared_problem: Callable[[Any], Any] | None = None
    #: For a low-precision op with a high-precision counterpart: maps (problem, the input sets the
    #: tuner times it on) to (the counterpart op's name, its problem, its input sets: the same
    #: operands), or None where no counterpart applies (say, an operand arrives pre-quantised).
    #: The autotuner then also times the counterpart's platform default against the winner, so
    #: that ``explain`` can say where the low-precision op is slower (docs/tuning-db.md, ``peer_us``).
    high_precision_peer: Callable[[Any, Sequence[Sequence[Any]]],
                                  "tuple[str, Any, list[Sequence[Any]]] | None"] | None = None

    @property
    def family(self) -> str:
        return OP_FAMILIES[self.name]

    @property
    def env_var(self) -> str:
        return FAMILY_ENV[self.family]


def decision_problem(spec: OpSpec, problem: Any) -> Any:
    """The key ``problem``'s decision is made, tuned and stored under (``OpSpec.shared_problem``)."""
    return problem if spec.shared_problem is None else spec.shared_problem(problem)


_SPECS: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    if spec.name not in KNOWN_OPS:
        raise ValueError(f"unknown op {spec.name!r}; known ops: {', '.join(sorted(KNOWN_OPS))}")
    _SPECS[spec.name] = spec
    return spec


def get_op_spec(name: str) -> OpSpec:
    try:
        return _SPECS[name]
    except KeyError:
        implemented = ", ".join(sorted(_SPECS)) or "none"
        raise ValueError(f"op {name!r} is not implemented; implemented ops: {implemented}") from None


def implemented_ops() -> list[str]:
    return sorted(_SPECS)
