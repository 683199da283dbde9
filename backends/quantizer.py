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



# -- both quantisations of one tensor (the blockwise training step) ---------------------------------------
#: Block sizes whose two quantisations come from one read (the Triton kernel's one-tile blocks:
#: a power of two, so a block is one tile).
DUAL_BLOCK_SIZES = (32, 64, 128)


@functools.lru_cache(maxsize=None)
def _dual_kernel() -> Callable | None:
    try:
        from turbo_dispatch.backends.triton.dual_quantize import dual_quantize
    except Exception as exc:  # no triton here: the reference quantises twice, with the same result
        log.debug("dual quantiser not importable (%s: %s); quantising twice", type(exc).__name__, exc)
        return None
    return dual_quantize


def empty_padded_rows(like: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, pad: int = 16) -> torch.Tensor:
    """An uninitialised ``shape`` tensor on ``like``'s device whose rows are padded in memory to a
    multiple of ``pad`` elements (for fp8, 16 bytes: the row stride TMA descriptors need; the
    padding is never read): a view of the padded storage. Every quantiser that feeds TMA, and
    the fake implementations that must match it, lay out their outputs with this."""
    *lead, cols = shape
    return like.new_empty((*lead, -(-cols // pad) * pad), dtype=dtype)[..., :cols]


def padded_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into ``empty_padded_rows`` storage (the dual kernel's layout)."""
    out = empty_padded_rows(t, tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def quantize_both_tensors(x3: torch.Tensor, dtype: torch.dtype, block_size: int, tile_2d: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data, scale, data_t, scale_t)`` of ``x3[G, R, C]`` as
    ``turbo_dispatch.backends.triton.dual_quantize.dual_quantize`` returns them (same layouts, fp8
    rows padded to 16 bytes, token runs' row scales to 16 floats): from its one-read kernel on a
    GPU, else from two reference ``quantize`` calls, which give the same bits."""
    fn = _dual_kernel()
    if fn is not None and x3.is_cuda and block_size in DUAL_BLOCK_SIZES:
        return fn(x3, dtype, block_size, tile_2d)
    blockwise = ScalingGranularity.BLOCKWISE
    if tile_2d:
        q = _reference_quantize(x3, dtype, blockwise, axis=2, block_size=block_size, block_2d=True)
        return padded_rows(q.data), q.scale, padded_rows(q.data.transpose(1, 2)), q.scale.transpose(1, 2)
    rows = _reference_quantize(x3, dtype, blockwise, axis=2, block_size=block_size)
    cols = _reference_quantize(x3, dtype, blockwise, axis=1, block_size=block_size)
    return padded_rows(rows.data), padded_rows(rows.scale), padded_rows(cols.data.transpose(1, 2)), cols.scale


#: Recipes whose groups need an amax pass of their own: a tensor's two quantisations can share it.
SHARED_AMAX_GRANULARITIES = (ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE)


def _fused_module(x: torch.Tensor, granularity: ScalingGranularity):
    """The Triton quantiser module when it serves ``x`` under ``granularity`` with a shared
    amax pass (a GPU tensor, a recipe of SHARED_AMAX_GRANULARITIES), else None."""
    if not x.is_cuda or granularity not in SHARED_AMAX_GRANULARITIES or _triton_quantizer()[0] is None:
        return None
    from turbo_dispatch.backends.triton import quantize as triton_quantize

    return triton_quantize


def quantize_both_axes(x: torch.Tensor, dtype: torch.dtype, granularity: ScalingGranularity,
                       block_size: int | None) -> tuple[QuantizedTensor, QuantizedTensor]:
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
    shared read now and each callable runs one cast (``quantize_fp8_in_turn``); otherwise both
    give ``x`` itself, and each GEMM's backend quantises it as before (BLOCKWISE runs need no
    shared amax: one read each either way). Same bits either way.
    """
    fused = _fused_module(x, granularity)
    if fused is not None:
        return fused.quantize_fp8_in_turn(x, dtype, granularity)
    return (lambda: x), (lambda: x)


def runs_from_tensors(data: torch.Tensor, scale: torch.Tensor, data_t: torch.Tensor, scale_t: torch.Tensor,
                      block_size: int) -> tuple[QuantizedTensor, QuantizedTensor]:
    """The two QuantizedTensors of ``quantize_runs_both`` from its 2-D tensors (a custom op's outputs)."""
    make = dict(granularity=ScalingGranularity.BLOCKWISE, block_size=block_size, block_2d=False)
    return (QuantizedTensor(data=data, scale=scale, axis=1, **make),
            QuantizedTensor(data=data_t.t(), scale=scale_t, axis=0, **make))


def tiles_from_tensors(data: torch.Tensor, scale: torch.Tensor, data_t: torch.Tensor,
                       block_size: int) -> tuple[QuantizedTensor, QuantizedTensor]:
    """The two QuantizedTensors of ``quantize_tiles_both`` from its tensors (a custom op's outputs)."""
    make = dict(scale=scale, granularity=ScalingGranularity.BLOCKWISE, axis=2, block_size=block_size, block_2d=True)
    return QuantizedTensor(data=data, **make), QuantizedTensor(data=data_t.transpose(1, 2), **make)


def quantize_runs_both(x: torch.Tensor, dtype: torch.dtype, block_size: int
                       ) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``x[T, C]`` quantised in 1 x block runs along C (``axis=1``: the forward's or dgrad's
    operand) and along T (``axis=0``: the wgrad's), exactly as two ``quantize`` calls give them,
    from one read of ``x`` on a GPU. The second one's data is a token-contiguous ``[T, C]`` view
    (stored ``[C, T]``), the layout the K-major fp8 MMA reads.

    >>> rows, cols = quantize_runs_both(torch.randn(300, 256), torch.float8_e4m3fn, 128)
    >>> rows.axis, tuple(rows.scale.shape), cols.axis, tuple(cols.scale.shape), cols.data.stride(0)
    (1, (300, 2), 0, (3, 256), 1)
    """
    data, scale, data_t, scale_t = quantize_both_tensors(x.unsqueeze(0), dtype, block_size, False)
    return runs_from_tensors(data[0], scale[0], data_t[0], scale_t[0], block_size)


def quantize_tiles_both(w: torch.Tensor, dtype: torch.dtype, block_size: int
                        ) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``w[G, R, C]`` in block x block tiles per group (``block_2d``), twice with the same values:
    data stored as ``w`` is (C contiguous), and stored transposed (R contiguous) but shown as a
    ``[G, R, C]`` view. The forward reads the first and the dgrad the second, each K-major. One
    read of ``w`` on a GPU.

    >>> fwd, bwd = quantize_tiles_both(torch.randn(2, 256, 384), torch.float8_e4m3fn, 128)
    >>> tuple(fwd.scale.shape), fwd.data.stride(2), bwd.data.stride(1)
    ((2, 2, 3), 1, 1)
    """
    data, scale, data_t, _ = quantize_both_tensors(w, dtype, block_size, True)
    return tiles_from_tensors(data, scale, data_t, block_size)


@functools.lru_cache(maxsize=None)
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index)


#: Per device: every stream a ``side_by_side`` call started from, in eager execution.
_FORK_CALLERS: dict[int, list[torch.cuda.Stream]] = {}


def _wait_for_callers(side: torch.cuda.Stream, current: torch.cuda.Stream, device_index: int) -> None:
    """Makes ``side`` wait for ``current`` and, outside a CUDA-graph capture, for every stream an
    earlier fork on this device started from.

    Why the earlier ones: the side stream's outputs come from its own pool of the caching
    allocator and are not ``record_stream``-ed on the caller's stream (the allocator's event
    bookkeeping held their blocks back while the GPU lagged, and a step's allocations then cost
    milliseconds of host time: round 150). A block a caller frees goes back to that pool at once;
    it is next handed out inside a later fork, whose side-stream work must then follow every
    caller-stream use of the block. Those uses were queued before the free, so waiting on each
    caller stream at the fork covers them, including a caller that since switched streams. Uses on
    other streams follow PyTorch's rule (the user's ``record_stream``). While capturing, the side
    stream joins the capture and allocates from the graph's private pool, so the eager streams
    are not waited on (an eager stream cannot be waited on inside a capture)."""
    side.wait_stream(current)
    if torch.cuda.is_current_stream_capturing():
        return
    callers = _FORK_CALLERS.setdefault(device_index, [])
    if current not in callers:
        callers.append(current)
    for caller in callers:
        if caller != current:
            side.wait_stream(caller)


def overlappable(t: torch.Tensor) -> bool:
    """Whether work on ``t`` may be split over two streams (``side_by_side``): a real CUDA tensor
    in eager execution. Not while anything traces it (torch.compile, AOT autograd, opcheck, fake
    or proxy tensors: any active dispatch mode or tensor subclass), where the streams would be
    recorded into the graph."""
    from turbo_dispatch.tracing import tracing

    return t.is_cuda and type(t) is torch.Tensor and not tracing()


def side_by_side(first: Callable[[], object], second: Callable[[], object], device: torch.device
                 ) -> tuple[object, object]:
    """``(first(), second())``, ``second`` on a side stream of CUDA ``device`` while ``first`` runs
    on the current stream; the current stream waits for both before anything queued after the
    call. For two memory-bound kernels neither of which reaches the memory's rate alone (the
    blockwise step's activation and weight quantisers: H100, round 94, 1.03-1.11x at small MoE
    shapes). Each call's outputs may be used on the current stream at once; ``second``'s come from
    the side stream's pool of the caching allocator, safe to free and reuse as any tensor made on
    the current stream (``_wait_for_callers`` says why no ``record_stream`` is needed). Capturable
    in a CUDA graph (the fork and join are stream waits).

    >>> side_by_side(lambda: 1, lambda: 2, torch.device("cuda"))  # doctest: +SKIP
    (1, 2)
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_stream(device)
    side = _side_stream(index)
    _wait_for_callers(side, current, index)  # second's inputs are ready, its pool's blocks free
    with torch.cuda.stream(side):
        second_out = second()
    first_out = first()
    current.wait_stream(side)
    return first_out, second_out

