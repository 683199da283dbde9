"""Both blockwise quantisations of one tensor, from one read where a kernel allows.

A blockwise fp8 training step reads each operand in two GEMMs that want it quantised differently:
the activation in 1 x block runs along its features (forward) and along its tokens (wgrad), the
weight in block x block tiles stored two ways (forward and dgrad). ``quantize_runs_both`` and
``quantize_tiles_both`` make both from one read with the registry's ``fp8_dual_quantize`` kernel
on a GPU, else from two reference ``quantize`` calls; the bits are the same either way.

Outputs that feed TMA kernels have their fp8 rows padded in memory to 16 bytes
(``empty_padded_rows``); the padding is never read.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch

from ..registry import kernel_module
from .config import ScalingGranularity
from .quantize import QuantizedTensor
from .quantize import quantize as reference_quantize

log = logging.getLogger(__name__)

#: The registry name of the kernel module with ``dual_quantize``.
KERNEL = "fp8_dual_quantize"

#: Block sizes whose two quantisations come from one read (the kernel's one-tile blocks: a power
#: of two, so a block is one tile).
DUAL_BLOCK_SIZES = (32, 64, 128)

_BLOCKWISE = ScalingGranularity.BLOCKWISE


@functools.lru_cache(maxsize=None)
def _dual_kernel() -> Optional[Callable]:
    module, why = kernel_module(KERNEL)
    fn = getattr(module, "dual_quantize", None)
    if fn is None:  # no triton here: the reference quantises twice, with the same result
        log.debug("dual quantiser unavailable (%s); quantising twice", why or "no dual_quantize")
    return fn


@functools.lru_cache(maxsize=None)
def _prepare_kernel(name: str = "prepare_dual_quantize") -> Optional[Callable]:
    module, _ = kernel_module(KERNEL)
    return getattr(module, name, None)


def _one_read(x: torch.Tensor, block_size: int) -> bool:
    """Whether the one-read kernel may quantise ``x`` with ``block_size`` (a GPU tensor, a block it takes)."""
    return x.is_cuda and block_size in DUAL_BLOCK_SIZES


def empty_padded_rows(like: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, pad: int = 16) -> torch.Tensor:
    """An uninitialised ``shape`` tensor on ``like``'s device whose rows are padded in memory to a
    multiple of ``pad`` elements (for fp8, 16 bytes: the row stride TMA descriptors need; the
    padding is never read): a view of the padded storage. Every quantiser that feeds TMA, and
    the fake implementations that must match it, lay out their outputs with this."""
    *lead, cols = shape
    if cols % pad == 0:  # no padding: the storage itself (a view is host time on every step)
        return like.new_empty(shape, dtype=dtype)
    return like.new_empty((*lead, -(-cols // pad) * pad), dtype=dtype)[..., :cols]


def padded_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into ``empty_padded_rows`` storage (the dual kernel's layout)."""
    out = empty_padded_rows(t, tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def quantize_both_tensors(x3: torch.Tensor, dtype: torch.dtype, block_size: int, tile_2d: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data, scale, data_t, scale_t)`` of ``x3[G, R, C]`` as the ``fp8_dual_quantize`` kernel's
    ``dual_quantize`` returns them (fp8 rows padded to 16 bytes, token runs' row scales to 16
    floats): from that one-read kernel on a GPU, else from two reference ``quantize`` calls,
    which give the same bits."""
    fn = _dual_kernel() if _one_read(x3, block_size) else None
    if fn is not None:
        return fn(x3, dtype, block_size, tile_2d)
    if tile_2d:
        q = reference_quantize(x3, dtype, _BLOCKWISE, axis=2, block_size=block_size, block_2d=True)
        return padded_rows(q.data), q.scale, padded_rows(q.data.transpose(1, 2)), q.scale.transpose(1, 2)
    rows = reference_quantize(x3, dtype, _BLOCKWISE, axis=2, block_size=block_size)
    cols = reference_quantize(x3, dtype, _BLOCKWISE, axis=1, block_size=block_size)
    return padded_rows(rows.data), padded_rows(rows.scale), padded_rows(cols.data.transpose(1, 2)), cols.scale


def quantize_both_tensors_like(x: torch.Tensor, dtype: torch.dtype, block_size: int, tile_2d: bool
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised tensors with the shapes and strides of ``quantize_both_tensors`` for ``x``:
    ``[T, C]`` runs (without the group dim) or ``[G, R, C]`` tiles. Works on ``meta``: for fake
    implementations and for building keys without quantising anything."""
    *lead, r, c = x.shape
    n_r, n_c = -(-r // block_size), -(-c // block_size)
    data = empty_padded_rows(x, (*lead, r, c), dtype)
    data_t = empty_padded_rows(x, (*lead, c, r), dtype)
    if tile_2d:
        return (data, x.new_empty((*lead, n_r, n_c), dtype=torch.float32), data_t,
                x.new_empty((*lead, n_c, n_r), dtype=torch.float32))
    return data, empty_padded_rows(x, (r, n_c), torch.float32), data_t, x.new_empty((n_r, c), dtype=torch.float32)


def runs_from_tensors(data: torch.Tensor, scale: torch.Tensor, data_t: torch.Tensor, scale_t: torch.Tensor,
                      block_size: int) -> tuple[QuantizedTensor, QuantizedTensor]:
    """The two QuantizedTensors of ``quantize_runs_both`` from its 2-D tensors (a custom op's outputs)."""
    make = dict(granularity=_BLOCKWISE, block_size=block_size, block_2d=False)
    return (QuantizedTensor(data=data, scale=scale, axis=1, **make),
            QuantizedTensor(data=data_t.t(), scale=scale_t, axis=0, **make))


def tiles_from_tensors(data: torch.Tensor, scale: torch.Tensor, data_t: torch.Tensor,
                       block_size: int) -> tuple[QuantizedTensor, QuantizedTensor]:
    """The two QuantizedTensors of ``quantize_tiles_both`` from its tensors (a custom op's outputs)."""
    make = dict(scale=scale, granularity=_BLOCKWISE, axis=2, block_size=block_size, block_2d=True)
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


def prepare_runs_both(x: torch.Tensor, dtype: torch.dtype, block_size: int):
    """``(quantize_runs_both(x, dtype, block_size), runs)``: this call's result, and ``runs(x)``,
    which gives ``quantize_runs_both``'s result for a later ``x`` with the same dtype, shape,
    strides, device and 16-byte alignment as this one (the caller's key holds them) with the
    kernel's launch resolved once (its ``prepare_runs_2d``); where there is none, ``runs``
    is ``quantize_runs_both`` itself."""
    fn = _prepare_kernel("prepare_runs_2d") if _one_read(x, block_size) else None
    if fn is None:
        return quantize_runs_both(x, dtype, block_size), lambda x: quantize_runs_both(x, dtype, block_size)
    (data, scale, data_t, scale_t), quantize = fn(x, dtype, block_size)

    def runs(x: torch.Tensor) -> tuple[QuantizedTensor, QuantizedTensor]:
        return runs_from_tensors(*quantize(x), block_size)

    return runs_from_tensors(data, scale, data_t, scale_t, block_size), runs


def prepare_tiles_both(w: torch.Tensor, dtype: torch.dtype, block_size: int):
    """``(quantize_tiles_both(w, dtype, block_size), tiles)``, as ``prepare_runs_both`` for the
    weight's tiles."""
    fn = _prepare_kernel() if _one_read(w, block_size) else None
    if fn is None:
        return quantize_tiles_both(w, dtype, block_size), lambda w: quantize_tiles_both(w, dtype, block_size)
    (data, scale, data_t, _), quantize = fn(w, dtype, block_size, True)

    def tiles(w: torch.Tensor) -> tuple[QuantizedTensor, QuantizedTensor]:
        data, scale, data_t, _ = quantize(w)
        return tiles_from_tensors(data, scale, data_t, block_size)

    return tiles_from_tensors(data, scale, data_t, block_size), tiles


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
