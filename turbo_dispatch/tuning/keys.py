"""The problem keys a training step of a model preset meets, built from shapes alone.

Keys come from the ops' own problem builders and gradient formulas, run on ``meta`` tensors, so
the offline tuner tunes exactly the forward, dgrad and wgrad keys the job will look up (same
layout flags, same fp8 roles) without allocating anything.
"""
from __future__ import annotations

import importlib
from typing import Any, Iterable, Sequence

import torch

from .. import presets
from ..low_precision import Float8QuantConfig
from ..op_spec import decision_problem, get_op_spec
from ..low_precision.dual_quantize import quantize_both_tensors_like, runs_from_tensors, tiles_from_tensors
from ..ops import gemm_fp8_step, gemm_grads, grouped_gemm_fp8_step, grouped_gemm_grads
from ..ops.gemm_problem import forward_fp8_problem as gemm_forward_fp8_problem
from ..ops.gemm_problem import gemm_fp8_problem, gemm_problem
from ..ops.grouped_gemm_problem import forward_fp8_problem as grouped_forward_fp8_problem
from ..ops.grouped_gemm_problem import grouped_gemm_fp8_problem, grouped_gemm_problem, variable_k_problem
# importlib: turbo_dispatch.ops re-exports functions named like some of its modules.
_attention = importlib.import_module("turbo_dispatch.ops.attention")

OPS = ("gemm", "gemm_fp8", "grouped_gemm", "grouped_gemm_fp8", "attention")
FP8_GRANULARITIES = ("tensorwise", "rowwise", "blockwise")


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def fp8_config(granularity: str) -> Float8QuantConfig:
    """The fp8 recipe the presets' keys assume for ``granularity`` (blockwise: 128-wide blocks)."""
    return Float8QuantConfig(granularity=granularity, block_size=128 if granularity == "blockwise" else None)


def _linear_gemm_keys(shape: presets.LinearShape, dtype: torch.dtype) -> list[tuple[str, Any]]:
    """y = x @ W^T (what modules.Linear calls), then its dgrad and wgrad."""
    x, w, dy = _meta(shape.m, shape.k, dtype=dtype), _meta(shape.n, shape.k, dtype=dtype), _meta(shape.m, shape.n, dtype=dtype)
    keys = [("gemm", gemm_problem(x, w, False, True))]

    def record(a, b, trans_a, trans_b, out_dtype):
        keys.append(("gemm", gemm_problem(a, b, trans_a, trans_b, out_dtype)))
        return None

    gemm_grads.gemm_grads(record, x, w, dy, False, True, True, True)
    return keys


def _linear_fp8_keys(shape: presets.LinearShape, dtype: torch.dtype, granularity: str) -> list[tuple[str, Any]]:
    cfg = fp8_config(granularity)
    x, w, dy = _meta(shape.m, shape.k, dtype=dtype), _meta(shape.n, shape.k, dtype=dtype), _meta(shape.m, shape.n, dtype=dtype)
    keys = [("gemm_fp8", gemm_forward_fp8_problem(x, w, False, True, None, cfg))]

    def record(a, b, ta, tb, od, af, bf, a2d, b2d):
        keys.append(("gemm_fp8", gemm_fp8_problem(a, b, ta, tb, od, af, bf, cfg.granularity, cfg.block_size,
                                                  a2d, b2d)))
        return None

    # The wgrad reads the activation as the forward saved it (pre-quantised, fp8 dtype in its key).
    gemm_grads.fp8_grads(record, gemm_fp8_step.wgrad_operand_like(x, False, cfg), w, dy, False, True,
                         cfg.format.fwd_dtype(), cfg.format.bwd_dtype(), cfg.granularity, True, True, a_dtype=x.dtype)
    return keys


def _grouped_operands(shape: presets.GroupedShape, dtype: torch.dtype):
    x = _meta(shape.m_total, shape.k, dtype=dtype)
    w = _meta(shape.groups, shape.n, shape.k, dtype=dtype)  # GroupedLinear's [G, N, K] weight, trans_b=True
    dy = _meta(shape.m_total, shape.n, dtype=dtype)
    lens = _meta(shape.groups, dtype=torch.int64)
    return x, w, dy, lens


def _grouped_keys(shape: presets.GroupedShape, dtype: torch.dtype) -> list[tuple[str, Any]]:
    x, w, dy, lens = _grouped_operands(shape, dtype)
    keys = [("grouped_gemm", grouped_gemm_problem(x, w, lens, None, True))]

    def mm(a, b, group_lens, group_offs, trans_b):
        keys.append(("grouped_gemm", grouped_gemm_problem(a, b, group_lens, group_offs, trans_b)))

    def mm_k(a, b, group_lens, group_offs):
        keys.append(("grouped_gemm", variable_k_problem(a, b, group_lens, group_offs)))

    grouped_gemm_grads.grouped_grads(mm, mm_k, x, w, dy, lens, None, True, True, True)
    return keys


def _grouped_fp8_keys(shape: presets.GroupedShape, dtype: torch.dtype, granularity: str) -> list[tuple[str, Any]]:
    cfg = fp8_config(granularity)
    x, w, dy, lens = _grouped_operands(shape, dtype)
    keys = [("grouped_gemm_fp8", grouped_forward_fp8_problem(x, w, lens, None, True, None, cfg))]

    def mm8(a, b, group_lens, group_offs, trans_b, out_dtype, a_fp8, b_fp8, b_2d):
        keys.append(("grouped_gemm_fp8", grouped_gemm_fp8_problem(
            a, b, group_lens, group_offs, trans_b, False, out_dtype, a_fp8, b_fp8, cfg.granularity, cfg.block_size,
            b_2d)))

    def mm8_k(a, b, group_lens, group_offs, out_dtype, a_fp8, b_fp8):
        keys.append(("grouped_gemm_fp8", grouped_gemm_fp8_problem(
            a, b, group_lens, group_offs, False, True, out_dtype, a_fp8, b_fp8, cfg.granularity, cfg.block_size,
            False)))

    fwd, bwd = cfg.format.fwd_dtype(), cfg.format.bwd_dtype()
    if not grouped_gemm_fp8_step.step_reuses_quantization(cfg):
        grouped_gemm_grads.grouped_fp8_grads(mm8, mm8_k, x, w, dy, lens, None, True, fwd, bwd, cfg.granularity,
                                             True, True)
        return keys
    # The blockwise step quantises each operand once and its GEMMs take them pre-quantised (fp8
    # dtypes in their keys): the keys are those, built from the quantiser's shape-only outputs.
    def runs(t, dtype, block):
        return runs_from_tensors(*quantize_both_tensors_like(t, dtype, block, False), block)

    def tiles(t, dtype, block):
        return tiles_from_tensors(*quantize_both_tensors_like(t, dtype, block, True)[:3], block)

    qa, qb, a_saved, b_saved = grouped_gemm_fp8_step.quantize_for_step(x, w, cfg, True, True, runs, tiles)
    keys[0] = ("grouped_gemm_fp8", grouped_gemm_fp8_step.step_forward_problem(keys[0][1], qa, qb))
    grouped_gemm_grads.grouped_fp8_grads(mm8, mm8_k, a_saved, b_saved, dy, lens, None, True, fwd, bwd,
                                         cfg.granularity, True, True, a_dtype=x.dtype, b_dtype=w.dtype, runs_both=runs,
                                         block_size=cfg.block_size)
    return keys


def layer_keys(op: str, shape: presets.GroupedShape, dtype: torch.dtype = torch.bfloat16,
               granularity: str | None = None) -> list[tuple[str, Any]]:
    """The (op, problem) keys of one grouped layer's training step in the order the step meets
    them, forward, dgrad, wgrad (``op`` grouped_gemm, or grouped_gemm_fp8 with ``granularity``);
    the call's own problems, before token bucketing and with the platform left as built.

    Example:
        >>> [p.variable_k for _, p in layer_keys("grouped_gemm", presets.GroupedShape("up", 4, 64, 32, 16))]
        [False, False, True]
    """
    if op == "grouped_gemm":
        return _grouped_keys(shape, dtype)
    if op == "grouped_gemm_fp8":
        if granularity not in FP8_GRANULARITIES:
            raise ValueError(f"layer_keys: granularity must be one of {', '.join(FP8_GRANULARITIES)} for "
                             f"grouped_gemm_fp8, got {granularity!r}")
        return _grouped_fp8_keys(shape, dtype, granularity)
    raise ValueError(f"layer_keys: op must be grouped_gemm or grouped_gemm_fp8, got {op!r}")


def _attention_keys(shape: tuple, dtype: torch.dtype) -> list[tuple[str, Any]]:
    batch, seq, heads, kv_heads, head_dim = shape
    q = _meta(batch, seq, heads, head_dim, dtype=dtype)
    kv = _meta(batch, seq, kv_heads, head_dim, dtype=dtype)
    return [("attention", _attention.attention_problem(q, kv, kv, causal=True))]


def model_keys(model: str, ops: Sequence[str], platform: str, micro_batches: Sequence[int] = (1,),
               seq_len: int | None = None, fp8_granularities: Sequence[str] = FP8_GRANULARITIES,
               ep: int = 8, tokens_per_expert: int = 4096, dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, Any]]:
    """Every (op, problem key) of one training step of ``model`` for ``ops``, deduplicated, in
    a stable order, with the platform set to ``platform``.

    Example:
        >>> keys = model_keys("tiny", ["gemm"], "cpu")
        >>> {op for op, _ in keys}, keys[0][1].platform
        ({'gemm'}, 'cpu')
    """
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}; tunable ops: {', '.join(OPS)}")
    bad = sorted(set(fp8_granularities) - set(FP8_GRANULARITIES))
    if bad:
        raise ValueError(f"unknown fp8 granularity {', '.join(bad)}; valid: {', '.join(FP8_GRANULARITIES)}")
    preset = presets.get_model(model)
    keys: list[tuple[str, Any]] = []
    for mb in micro_batches:
        linears = presets.dense_linear_shapes(preset, mb, seq_len)
        if "gemm" in ops:
            for shape in linears:
                keys += _linear_gemm_keys(shape, dtype)
        if "gemm_fp8" in ops:
            for granularity in fp8_granularities:
                for shape in linears:
                    keys += _linear_fp8_keys(shape, dtype, granularity)
        if "attention" in ops:
            for shape in presets.attention_shapes(preset, mb, seq_len):
                keys += _attention_keys(shape, dtype)
    if preset.is_moe:
        grouped = presets.moe_grouped_shapes(preset, ep, tokens_per_expert)
        if "grouped_gemm" in ops:
            for shape in grouped:
                keys += layer_keys("grouped_gemm", shape, dtype)
        if "grouped_gemm_fp8" in ops:
            for granularity in fp8_granularities:
                for shape in grouped:
                    keys += layer_keys("grouped_gemm_fp8", shape, dtype, granularity)
    return _dedupe(looked_up(op, problem, platform) for op, problem in keys)


def looked_up(op: str, problem: Any, platform: str) -> tuple[str, Any]:
    """``(op, problem)`` as a call on ``platform`` looks it up, which is where its tuning is
    stored: the platform set, and grouped GEMMs' token count at the top of its bucket."""
    return op, decision_problem(get_op_spec(op), problem._replace(platform=platform))


def _dedupe(keys: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    seen: dict = {}
    for item in keys:
        seen.setdefault(item, None)
    return list(seen)
