"""The fastest fp8 quantiser that runs here, with the reference one as its fallback.

``quantize_operand`` uses the fused Triton quantiser (one read of the input, no float32
temporaries) when the registry's ``fp8_quantize`` kernel module imports and reports itself
available, else the reference ``low_precision.quantize``. Both give bit-identical data and scales,
so the choice changes speed and peak memory, never a result. The CUBLASLT adapter and the fp8
GEMM's saved activation share this policy, so it lives in one place.
"""
from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Callable, Optional

import torch

from ..registry import kernel_module
from .config import ScalingGranularity
from .quantize import QuantizedTensor
from .quantize import quantize as reference_quantize

log = logging.getLogger(__name__)

#: The registry name of the kernel module with ``quantize_fp8``, ``quantize_fp8_both``,
#: ``quantize_fp8_in_turn`` and ``available``.
KERNEL = "fp8_quantize"


@functools.lru_cache(maxsize=None)
def _triton_quantizer() -> tuple[Optional[Callable], str]:
    """(quantize_fp8, "") when the Triton quantiser can run here, else (None, why not)."""
    module, why = kernel_module(KERNEL)
    if module is None:
        return None, why
    fn = getattr(module, "quantize_fp8", None)
    if not callable(fn):
        return None, f"{module.__name__} has no quantize_fp8"
    probe = getattr(module, "available", None)
    if callable(probe):
        try:
            reason = probe()
        except Exception as exc:
            reason = f"available() raised {type(exc).__name__}: {exc}"
        if reason:
            return None, f"Triton quantizer unavailable: {reason}"
    return fn, ""


#: (granularity, block_2d, block_size) -> why the Triton quantiser refused that recipe (then the
#: reference one serves it). Keyed by block size too: one unsupported block size must not send
#: the recipe's other block sizes to the slower quantiser.
_TRITON_REFUSED: dict[tuple[ScalingGranularity, bool, Optional[int]], str] = {}


def quantizer_name(granularity: ScalingGranularity, block_2d: bool, block_size: Optional[int] = None) -> str:
    """Which quantiser ``quantize_operand`` uses for this recipe, and if not Triton, why."""
    fn, why = _triton_quantizer()
    if fn is None:
        return f"reference turbo_dispatch.low_precision.quantize ({why})"
    refused = _TRITON_REFUSED.get((granularity, block_2d, block_size))
    if refused is not None:
        return f"reference turbo_dispatch.low_precision.quantize (the Triton quantizer refused this recipe: {refused})"
    return "Triton quantize_fp8"


def quantize_operand(x: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity, axis: int,
                     block_size: Optional[int], block_2d: bool) -> QuantizedTensor:
    """``quantize(x, dtype, granularity, axis=axis, ...)`` with the Triton quantiser when available.

    A recipe it refuses (ValueError, TypeError, NotImplementedError) is logged once and served by
    the reference quantiser from then on (``quantizer_name`` says so); both give the same
    QuantizedTensor layout."""
    fn, _ = _triton_quantizer()
    key = (granularity, block_2d, block_size)
    if fn is not None and key not in _TRITON_REFUSED:
        try:
            return fn(x, dtype, granularity, axis=axis, block_size=block_size, block_2d=block_2d)
        except (ValueError, TypeError, NotImplementedError) as exc:
            _TRITON_REFUSED[key] = f"{type(exc).__name__}: {exc}"
            log.warning("gemm_fp8: Triton quantizer refused %s (block_2d=%s, block_size=%s): %s; using the "
                        "reference quantizer for this recipe from now on", granularity.value, block_2d, block_size, exc)
    return reference_quantize(x, dtype, granularity, axis=axis, block_size=block_size, block_2d=block_2d)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity,
                  block_size: Optional[int]) -> QuantizedTensor:
    """``quantize(x, axis=1)``: through ``quantize_operand`` on a GPU, the reference on the CPU."""
    if x.is_cuda:
        return quantize_operand(x, dtype, granularity, 1, block_size, False)
    return reference_quantize(x, dtype, granularity, axis=1, block_size=block_size)


#: Recipes whose groups need an amax pass of their own: a tensor's two quantisations can share it.
SHARED_AMAX_GRANULARITIES = (ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE)


def _fused_module(x: torch.Tensor, granularity: ScalingGranularity) -> Optional[ModuleType]:
    """The Triton quantiser module when it serves ``x`` under ``granularity`` with a shared
    amax pass (a GPU tensor, a recipe of SHARED_AMAX_GRANULARITIES), else None."""
    if not x.is_cuda or granularity not in SHARED_AMAX_GRANULARITIES or _triton_quantizer()[0] is None:
        return None
    return kernel_module(KERNEL)[0]


def quantize_both_axes(x: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity,
                       block_size: Optional[int]) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``x[P, Q]`` quantised along Q (``axis=1``) and along P (``axis=0``), exactly as two
    ``quantize`` calls give them: what a training step needs of an activation (along the
    features for its GEMM, along the tokens for the wgrad). The second one's data is stored
    ``[Q, P]`` and shown as a ``[P, Q]`` view, the K-major layout the wgrad reads.

    On a GPU under TENSORWISE / ROWWISE: two reads of ``x`` (``quantize_fp8_both``); otherwise
    two ``quantize_operand`` calls, with the same bits.

    >>> rows, cols = quantize_both_axes(torch.randn(300, 256), torch.float8_e4m3fn, ScalingGranularity.ROWWISE, None)
    >>> rows.axis, tuple(rows.scale.shape), cols.axis, tuple(cols.scale.shape), cols.data.stride(0)
    (1, (300, 1), 0, (1, 256), 1)
    """
    fused = _fused_module(x, granularity)
    if fused is not None:
        return fused.quantize_fp8_both(x, dtype, granularity)
    rows = quantize_operand(x, dtype, granularity, 1, block_size, False)
    cols = quantize_operand(x.t(), dtype, granularity, 1, block_size, False)
    return rows, cols.t()


def quantize_both_axes_in_turn(x: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity
                               ) -> tuple[Callable[[], object], Callable[[], object]]:
    """Two callables giving ``x[P, Q]`` for a GEMM that reduces along Q, then for one that
    reduces along P, made one at a time so that only one fp8 copy need be alive (the backward's
    gradient: dgrad, then wgrad). Under TENSORWISE / ROWWISE on a GPU every amax comes from one
    shared read and each callable runs one cast (``quantize_fp8_in_turn``); otherwise both give
    ``x`` itself, for each GEMM's backend to quantise (BLOCKWISE runs need no shared amax: one
    read each either way). Same bits either way.
    """
    fused = _fused_module(x, granularity)
    if fused is not None:
        return fused.quantize_fp8_in_turn(x, dtype, granularity)
    return (lambda: x), (lambda: x)
