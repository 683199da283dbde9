"""The fastest fp8 quantizer that runs here: the fused Triton one (one read, no float32
temporaries) when it is importable and available, else the reference
``turbo_dispatch.low_precision.quantize``. Both give bit-identical data and scales, so the choice
never changes a result, only speed and memory. Shared by the CUBLASLT adapter and the fp8 GEMM's
saved activation (``turbo_dispatch.ops.gemm``), so the fallback policy lives in one place.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable

import torch

from turbo_dispatch.low_precision import QuantizedTensor, ScalingGranularity
from turbo_dispatch.low_precision import quantize as _reference_quantize

log = logging.getLogger("turbo_dispatch.backends.quantizer")


@functools.lru_cache(maxsize=None)
def _triton_quantizer() -> tuple[Callable | None, str]:
    """(quantize_fp8, "") when the Triton quantizer can run here, else (None, why not)."""
    try:
        from turbo_dispatch.backends.triton import quantize as triton_quantize
    except Exception as exc:  # ImportError without triton, or a broken module: use the reference
        return None, f"turbo_dispatch.backends.triton.quantize is not importable ({type(exc).__name__}: {exc})"
    fn = getattr(triton_quantize, "quantize_fp8", None)
    if not callable(fn):
        return None, "turbo_dispatch.backends.triton.quantize has no quantize_fp8"
    probe = getattr(triton_quantize, "available", None)
    if callable(probe):
        try:
            reason = probe()
        except Exception as exc:
            reason = f"available() raised {type(exc).__name__}: {exc}"
        if reason:
            return None, f"Triton quantizer unavailable: {reason}"
    return fn, ""


#: (granularity, block_2d, block_size) -> why the Triton quantizer refused that recipe (then the
#: reference one serves it). Keyed by block size too: one unsupported block size must not send
#: the recipe's other block sizes to the slower quantizer.
_TRITON_REFUSED: dict[tuple[ScalingGranularity, bool, int | None], str] = {}


def quantizer_name(granularity: ScalingGranularity, block_2d: bool, block_size: int | None = None) -> str:
    """Which quantizer ``quantize_operand`` uses for this recipe, and if not Triton, why."""
    fn, why = _triton_quantizer()
    if fn is None:
        return f"reference turbo_dispatch.low_precision.quantize ({why})"
    refused = _TRITON_REFUSED.get((granularity, block_2d, block_size))
    if refused is not None:
        return f"reference turbo_dispatch.low_precision.quantize (the Triton quantizer refused this recipe: {refused})"
    return "Triton quantize_fp8"


def quantize_operand(x: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity, axis: int,
                     block_size: int | None, block_2d: bool) -> QuantizedTensor:
    """Quantises with the Triton quantizer when available; a recipe it refuses (ValueError,
    TypeError, NotImplementedError) is logged once and served by the reference quantizer from then
    on (``describe`` shows it), so both give the same QuantizedTensor layout."""
    fn, _ = _triton_quantizer()
    key = (granularity, block_2d, block_size)
    if fn is not None and key not in _TRITON_REFUSED:
        try:
            return fn(x, dtype, granularity, axis=axis, block_size=block_size, block_2d=block_2d)
        except (ValueError, TypeError, NotImplementedError) as exc:
            _TRITON_REFUSED[key] = f"{type(exc).__name__}: {exc}"
            log.warning("gemm_fp8: Triton quantizer refused %s (block_2d=%s, block_size=%s): %s; using the "
                        "reference quantizer for this recipe from now on", granularity.value, block_2d, block_size, exc)
    return _reference_quantize(x, dtype, granularity, axis=axis, block_size=block_size, block_2d=block_2d)
