"""The blockwise grouped_gemm_fp8 training step: every operand quantised once, for both GEMMs
that read it.

Under BLOCKWISE with a block the one-read quantiser takes, the step quantises ``a``, ``b`` and
the gradient once each instead of once per GEMM, and saves fp8 ``a`` and ``b`` for the backward
instead of the inputs. The results are bit-identical either way: the forward's and dgrad's 2-D
weight tiles are the same tiles, and the wgrad's token runs are computed from the same values,
so this changes traffic, not math. The eager autograd Function and the compiled step op both
build on these helpers.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..low_precision import Float8QuantConfig, QuantizedTensor, ScalingGranularity, weight_reuse
from ..low_precision.dual_quantize import DUAL_BLOCK_SIZES
from ..low_precision.side_streams import overlappable, side_by_side
from .gemm_operands import data_of
from .grouped_gemm_problem import GroupedGemmFp8Problem


def step_reuses_quantization(cfg: Float8QuantConfig) -> bool:
    """Whether a training step under ``cfg`` quantises each operand once (BLOCKWISE with a block of
    ``DUAL_BLOCK_SIZES``) instead of once per GEMM."""
    return cfg.granularity is ScalingGranularity.BLOCKWISE and cfg.block_size in DUAL_BLOCK_SIZES


def quantize_for_step(a, b, cfg: Float8QuantConfig, need_a: bool, need_b: bool, runs_both: Callable,
                      tiles_both: Callable, reuse: bool = False):
    """(forward a, forward b, a saved for the wgrad, b saved for the dgrad). Where a gradient is
    needed, its saved operand is quantised with the forward's in one read; an operand no
    backward GEMM reads stays high precision, for the forward's backend to quantise. With
    ``reuse`` (the eager path), b's tiles come from and go to an enclosing
    ``low_precision.reuse_quantized_weights`` block.

    ``runs_both(x, dtype, block)`` and ``tiles_both(w, dtype, block)`` are
    ``low_precision.dual_quantize.quantize_runs_both``/``quantize_tiles_both`` or their custom-op
    or shape-only equivalents."""
    fwd, bs = cfg.format.fwd_dtype(), cfg.block_size
    kept = weight_reuse.lookup(b, fwd, bs) if need_a and reuse else None
    qa, qb, a_saved, b_saved = _quantize_both_operands(a, b, fwd, bs, need_a and kept is None, need_b, runs_both,
                                                       tiles_both)
    if kept is not None:
        return qa, kept[0], a_saved, kept[1]
    if need_a and reuse:
        weight_reuse.keep(b, fwd, bs, (qb, b_saved))
    return qa, qb, a_saved, b_saved


def _quantize_both_operands(a, b, fwd: torch.dtype, bs: int, need_a: bool, need_b: bool, runs_both: Callable,
                            tiles_both: Callable):
    """``quantize_for_step``'s quantisations: a's runs where the wgrad reads them, b's tiles
    where the dgrad reads them."""
    if need_a and need_b and overlappable(a):
        # The two quantisers are memory-bound and neither reaches the memory's rate alone: the
        # weight's tiles beside the activation's runs.
        (qa, a_saved), (qb, b_saved) = side_by_side(lambda: runs_both(a, fwd, bs), lambda: tiles_both(b, fwd, bs),
                                                    a.device)
        return qa, qb, a_saved, b_saved
    qa, a_saved = runs_both(a, fwd, bs) if need_b else (a, None)
    qb, b_saved = tiles_both(b, fwd, bs) if need_a else (b, None)
    return qa, qb, a_saved, b_saved


def step_forward_problem(problem: GroupedGemmFp8Problem, qa, qb) -> GroupedGemmFp8Problem:
    """The forward's key once ``quantize_for_step`` quantised its operands: the inputs' key with
    the fp8 dtypes of the operands that now arrive pre-quantised (the inputs are validated
    already, and our own quantiser made qa and qb)."""
    return problem._replace(a_dtype=data_of(qa).dtype, b_dtype=data_of(qb).dtype)


# -- a saved QuantizedTensor goes through save_for_backward as its two tensors ----------------------
def unpack(q: Optional[QuantizedTensor]) -> tuple:
    """(data, scale), or (None, None) for no tensor."""
    return (None, None) if q is None else (q.data, q.scale)


def layout(q: Optional[QuantizedTensor]) -> Optional[tuple]:
    """What ``repack`` needs besides the tensors: (granularity, axis, block_size, block_2d)."""
    return None if q is None else (q.granularity, q.axis, q.block_size, q.block_2d)


def repack(layout: Optional[tuple], data, scale) -> Optional[QuantizedTensor]:
    """A saved QuantizedTensor rebuilt from its ``layout`` and the tensors save_for_backward
    kept (which guard them against in-place changes and let saved-tensor hooks move them)."""
    if layout is None:
        return None
    granularity, axis, block_size, block_2d = layout
    return QuantizedTensor(data=data, scale=scale, granularity=granularity, axis=axis, block_size=block_size,
                           block_2d=block_2d)
