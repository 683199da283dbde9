"""What gemm and grouped_gemm share about their operands and keys.

Cheap device and platform tests for the eager fast path, the fields every fp8 problem key has,
and the fp8 operand that may arrive pre-quantised (a ``QuantizedTensor``): its checks, and how a
custom op, which cannot take one, passes it as (fp8 data, scale) and rebuilds it.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from ..device_platform import platform_of
from ..low_precision import QuantizedTensor, ScalingGranularity, dequantize
from ._common import HIGH_PRECISION, check_snr, require_dtype

#: The dtypes the fast path accepts without the full checks.
HIGH_PRECISION_SET = frozenset(HIGH_PRECISION)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: An fp8 GEMM operand: high precision (quantised by the backend) or already quantised.
Fp8Operand = Union[torch.Tensor, QuantizedTensor]

#: Builds a NamedTuple key from a tuple without its generated ``__new__`` (the fast path's cost).
new_key = tuple.__new__

#: Fields of every problem key, after its shape: the operands' dtypes as they arrive, the output's.
DTYPE_FIELDS = (("a_dtype", torch.dtype), ("b_dtype", torch.dtype), ("out_dtype", torch.dtype))
#: Fields of every fp8 problem key, after DTYPE_FIELDS: each operand's float8 dtype (HYBRID
#: backward mixes them) and the scaling recipe.
FP8_RECIPE_FIELDS = (("a_fp8", torch.dtype), ("b_fp8", torch.dtype), ("granularity", ScalingGranularity),
                     ("block_size", Optional[int]))

_GPU_PLATFORM = platform_of("cuda")


def data_of(x: Any) -> Any:
    """The tensor whose shape and device an operand has (a QuantizedTensor's fp8 data)."""
    return x.data if isinstance(x, QuantizedTensor) else x


def scale_of(x: Any) -> Optional[torch.Tensor]:
    """A QuantizedTensor's scale, None for a plain tensor: what a custom op passes beside the data."""
    return x.scale if isinstance(x, QuantizedTensor) else None


def tensor_platform(x: torch.Tensor) -> str:
    """``platform_of(x.device.type)`` without building a device object (is_cuda / is_cpu are flags)."""
    return _GPU_PLATFORM if x.is_cuda else ("cpu" if x.is_cpu else platform_of(x.device.type))


def same_device(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Cheap same-device test for the fast path; anything but cpu/cpu or one GPU takes the slow path
    (get_device() is -1 for every non-CUDA device, so it alone cannot tell cpu from meta)."""
    if a.is_cuda:
        return b.is_cuda and a.get_device() == b.get_device()
    return a.is_cpu and b.is_cpu


def needs_grad(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.requires_grad or b.requires_grad) and torch.is_grad_enabled()


def check_prequantized(op: str, name: str, q: QuantizedTensor, fp8: torch.dtype, granularity: ScalingGranularity,
                       block_size: Optional[int], is_2d: bool, k_axis: int) -> None:
    """A pre-quantised operand must be exactly what the backend would have made of it: same
    recipe, scales along this GEMM's K. Anything else is a caller bug, named here."""
    want = (fp8, granularity, block_size, is_2d)
    got = (q.data.dtype, q.granularity, q.block_size, q.block_2d)
    if got != want:
        raise ValueError(f"{op}: pre-quantised {name} is (dtype, granularity, block_size, block_2d)={got}, "
                         f"but this GEMM quantises {name} as {want}")
    if not is_2d and granularity is not ScalingGranularity.TENSORWISE and q.axis != k_axis:
        raise ValueError(f"{op}: pre-quantised {name} has its scales along dim {q.axis}, but this GEMM's "
                         f"reduction dim of {name} is dim {k_axis}")


def operand_dtype(op: str, name: str, x: Fp8Operand, fp8: torch.dtype, granularity: ScalingGranularity,
                  block_size: Optional[int], is_2d: bool, k_axis: int) -> torch.dtype:
    """The dtype an operand arrives in: high precision (quantised inside), or fp8 (== ``fp8``)
    when it is a QuantizedTensor made as the backend would have made it."""
    if isinstance(x, QuantizedTensor):
        check_prequantized(op, name, x, fp8, granularity, block_size, is_2d, k_axis)
        return x.data.dtype
    require_dtype(op, f"{name}.dtype (high-precision input, or a QuantizedTensor)", x.dtype)
    return x.dtype


def rebuild_quantized(x: torch.Tensor, scale: Optional[torch.Tensor], granularity: ScalingGranularity,
                      block_size: Optional[int], axis: int, block_2d: bool) -> Fp8Operand:
    """A custom op's operand: ``x`` itself without a scale, else the QuantizedTensor that was
    passed as (fp8 data ``x``, ``scale``)."""
    if scale is None:
        return x
    return QuantizedTensor(data=x, scale=scale, granularity=granularity, axis=axis, block_size=block_size,
                           block_2d=block_2d)


def dequantized(inputs: Sequence[Any]) -> list:
    """The inputs with each QuantizedTensor replaced by its exact value, its dequantisation (its
    rounding already happened): what a reference computes from."""
    return [dequantize(x) if isinstance(x, QuantizedTensor) else x for x in inputs]


def fp8_check(p: Any, out: Any, ref: torch.Tensor) -> Optional[str]:
    """The autotuner's accuracy gate for an fp8 problem; E5M2 operands keep two fewer mantissa
    bits, hence the lower gate."""
    return check_snr(20.0 if torch.float8_e5m2 in (p.a_fp8, p.b_fp8) else 25.0)(out, ref)
