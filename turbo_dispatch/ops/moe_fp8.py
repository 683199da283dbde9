"""fp8 payloads for moe_dispatch: an activation quantised per row (or per 1 x block run along hidden)
travels as its fp8 rows plus its scale rows, and arrives in the form it came in.

Two forms are accepted:

* a :class:`~turbo_dispatch.low_precision.QuantizedTensor` ``[T, H]`` quantised along the last axis
  with one scale per row (ROWWISE) or per 1 x block_size run (BLOCKWISE / MX_BLOCKWISE, 1-D blocks),
  e.g. ``quantize(x, float8_e4m3fn, "blockwise", block_size=128)``; the received rows come back as a
  QuantizedTensor with the same recipe, which ``grouped_gemm_fp8`` takes as a pre-quantised ``a``
  (forward only, no dequantisation);
* DeepEP's ``(x_fp8, scales)`` pair: ``x_fp8`` [T, H] float8, ``scales`` [T, S] float32 (or another
  float dtype); the received pair comes back as a tuple.

Only the fp8 bytes and the scales move, in one dispatch: ``pack_rows`` lays each token's fp8 data and
its scales' bytes side by side in one row (the scales from the next 16-byte boundary, rows padded to
16 bytes), so the exchange carries both and ``unpack_rows`` gives the received data and scales back as
contiguous tensors. Padding rows of a ``num_worst_tokens`` buffer arrive as zero data with zero scales,
which dequantise to zeros.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

from ..low_precision import QuantizedTensor, ScalingGranularity

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_ROW_SCALED = (ScalingGranularity.ROWWISE, ScalingGranularity.BLOCKWISE, ScalingGranularity.MX_BLOCKWISE)


class Fp8Payload(NamedTuple):
    """An fp8 activation split into what travels: ``data`` [T, H] fp8, ``scale`` [T, S], and ``wrap``,
    which rebuilds the caller's form from the received data and scale rows."""

    data: torch.Tensor
    scale: torch.Tensor
    wrap: Callable[[torch.Tensor, torch.Tensor], Any]


def fp8_payload(op: str, x: object) -> Optional[Fp8Payload]:
    """``x`` split for dispatch if it is a QuantizedTensor or an ``(x_fp8, scales)`` pair, else None.

    Raises (before any communication) when the scales do not run one row per token along hidden.
    """
    if isinstance(x, QuantizedTensor):
        if x.data.dim() != 2 or x.granularity not in _ROW_SCALED or x.block_2d or x.axis not in (1, -1):
            raise ValueError(f"{op}: a QuantizedTensor x must be [num_tokens, hidden], quantised along hidden with "
                             "row or 1-D block scales (e.g. quantize(x, float8_e4m3fn, 'blockwise', block_size=128)); "
                             f"got {x.granularity.value} axis={x.axis} block_2d={x.block_2d} shape "
                             f"{tuple(x.data.shape)}")
        _check_scale(op, "x.scale", x.scale, x.data.shape[0])

        def wrap(data: torch.Tensor, scale: torch.Tensor) -> QuantizedTensor:
            return QuantizedTensor(data=data, scale=scale, granularity=x.granularity, axis=1,
                                   block_size=x.block_size, block_2d=False, orig_dtype=x.orig_dtype)

        return Fp8Payload(x.data, x.scale, wrap)
    if isinstance(x, tuple):
        if len(x) != 2 or not all(isinstance(t, torch.Tensor) for t in x):
            raise TypeError(f"{op}: a tuple x must be DeepEP's (x_fp8 [num_tokens, hidden], scales [num_tokens, S]) "
                            "pair of tensors")
        data, scale = x
        if data.dtype not in _FP8 or data.dim() != 2:
            raise TypeError(f"{op}: the data of an (x_fp8, scales) pair must be a 2-D float8 tensor; got "
                            f"{data.dtype} {tuple(data.shape)}")
        if scale.dtype not in _SCALE_DTYPES:
            raise TypeError(f"{op}: the scales of an (x_fp8, scales) pair must be float32 (DeepEP's), float64, bf16 "
                            f"or fp16; got {scale.dtype}")
        _check_scale(op, "scales", scale, data.shape[0])
        return Fp8Payload(data, scale, lambda d, s: (d, s))
    return None


def _check_scale(op: str, name: str, scale: torch.Tensor, rows: int) -> None:
    if scale.dim() != 2 or scale.shape[0] != rows:
        raise ValueError(f"{op}: {name} must be [num_tokens={rows}, scales per row]; got {tuple(scale.shape)}")


def packed_layout(hidden: int, scale: torch.Tensor) -> tuple[int, int, int]:
    """``(scale offset, scale bytes, row width)`` in bytes of a packed row of ``hidden`` fp8 values and
    ``scale``'s row: the scales start at the first 16-byte boundary after the data (so they can be
    viewed in their own dtype), and the row is padded to 16 bytes (aligned rows for the copies).

    >>> packed_layout(7168, torch.ones(4, 56))
    (7168, 224, 7392)
    """
    offset = -(-hidden // 16) * 16
    nbytes = scale.shape[1] * scale.element_size()
    return offset, nbytes, -(-(offset + nbytes) // 16) * 16


def pack_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[T, width]`` rows in ``data``'s fp8 dtype holding each token's fp8 data and then its scales'
    bytes (``packed_layout``); the padding bytes are left unset (never read back).

    >>> d = torch.randn(3, 20).to(torch.float8_e4m3fn)
    >>> s = torch.rand(3, 2)
    >>> back = unpack_rows(pack_rows(d, s), 20, s)
    >>> torch.equal(back[0].view(torch.uint8), d.view(torch.uint8)), torch.equal(back[1], s)
    (True, True)
    """
    tokens, hidden = data.shape
    offset, nbytes, width = packed_layout(hidden, scale)
    packed = torch.empty((tokens, width), dtype=torch.uint8, device=data.device)
    packed[:, :hidden].copy_(data.view(torch.uint8))
    packed[:, offset:offset + nbytes].copy_(scale.contiguous().view(torch.uint8))
    return packed.view(data.dtype)


def unpack_rows(rows: torch.Tensor, hidden: int, scale_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data [R, hidden], scale [R, S])``, contiguous, out of the packed ``rows`` ``[R, width]`` a
    dispatch of ``pack_rows``'s output delivered; ``scale_like`` gives the scales' dtype and count."""
    offset, nbytes, _ = packed_layout(hidden, scale_like)
    raw = rows.view(torch.uint8)
    data = raw[:, :hidden].contiguous().view(rows.dtype)
    scale = raw[:, offset:offset + nbytes].contiguous().view(scale_like.dtype)
    return data, scale
