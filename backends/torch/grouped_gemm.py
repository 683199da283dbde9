"""TORCH adapters for grouped_gemm and grouped_gemm_fp8.

Plain torch runs a grouped GEMM one of two ways:

* ``torch._grouped_mm``: torch's CUTLASS grouped kernel on NVIDIA sm_90 / sm_100, bf16 in and
  out. It reads the group boundaries (int32 cumulative *end* offsets) on the device, so it never
  syncs the host and can be captured in a CUDA graph. The adapter uses it for the forward and dgrad
  (``a[M, K]`` x ``b[G, K, N]``, ``b`` passed as a transposed view when ``trans_b``) and for the
  variable-K wgrad (``x.t()[P, M]`` x ``y[M, Q]`` -> ``[G, P, Q]``: the token-major operands are
  column- and row-major respectively, the layout torch's kernel accepts with empty groups and no
  alignment rule on the group sizes).
* a per-group loop of ``torch.mm`` everywhere else (CPU, other GPUs, fp16/fp32, unaligned K/N).
  Slicing a group needs its length *on the host*, so the loop reads ``group_lens`` (one
  device->host sync per call on a GPU; free on the CPU) and cannot run while a CUDA graph is
  being captured (it raises a clear error instead). It also re-checks, for free, that the lengths
  are non-negative and sum to at most the token count.

Padded inputs (M_total > sum(group_lens), a padded MoE receive buffer): the rows past the last group
belong to no group. The forward/dgrad output has zeros there (the loop zeroes them from its host
copy of the lengths; after torch's grouped kernels, which leave them unwritten, a device-side
pass zeroes them without a host sync), and the wgrad never reads them.

fp8: operands are quantised with ``turbo_dispatch.low_precision.quantize`` (an operand that
arrives as a QuantizedTensor, pre-quantised by the training step, is used as is); TENSORWISE and
ROWWISE forward/dgrad GEMMs with e4m3 operands and bf16 output run on ``torch._scaled_grouped_mm``
(rowwise scales; a tensorwise scale is broadcast to rows, which is the same math). Everything
else is emulated exactly: dequantise, then the grouped GEMM above (bf16 ``torch._grouped_mm``
on capable GPUs when the output is bf16, else the loop in float32).
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch

from turbo_dispatch.low_precision import QuantizedTensor, ScalingGranularity, dequantize, quantize

from .gemm import _capability, _TorchAdapter

log = logging.getLogger("turbo_dispatch.backends.torch.grouped_gemm")

#: torch._grouped_mm's CUTLASS path refuses 1024 groups or more.
_MAX_GROUPS = 1023
_INT32_MAX = 2**31 - 1


# -- which path a problem takes (host-side facts only) ----------------------------------------------
def _gpu_arch_reason(platform: str, what: str) -> str | None:
    if platform != "cuda":
        return f"{what} needs an NVIDIA sm_90/sm_100 GPU (platform is {platform})"
    major = _capability(torch.cuda.current_device())[0]
    if major not in (9, 10):
        return f"{what}'s kernel runs on sm_90/sm_100 only (this GPU is sm_{major}x)"
    return None


def _grouped_mm_unsupported(platform: str, in_dtype: torch.dtype, out_dtype: torch.dtype, g: int, m: int, n: int,
                            k: int, variable_k: bool) -> str | None:
    """Why torch._grouped_mm cannot run this GEMM without a host sync (None: it can)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"this torch ({torch.__version__}) has no torch._grouped_mm"
    reason = _gpu_arch_reason(platform, "torch._grouped_mm")
    if reason is not None:
        return reason
    if in_dtype != torch.bfloat16 or out_dtype != torch.bfloat16:
        return "torch._grouped_mm's sync-free kernel takes bf16 in and out only"
    if g > _MAX_GROUPS:
        return f"torch._grouped_mm takes at most {_MAX_GROUPS} groups (G={g})"
    # 16-byte strides: the leading dimension of every operand and of the output.
    dims = {"P": m, "Q": n} if variable_k else {"K": k, "N": n}
    odd = {name: size for name, size in dims.items() if size % 8}
    if odd:
        shown = ", ".join(f"{name}={size}" for name, size in odd.items())
        return f"torch._grouped_mm needs 16-byte strides ({'/'.join(dims)} divisible by 8 for bf16; {shown})"
    if (k if variable_k else m) > _INT32_MAX:
        return "torch._grouped_mm takes int32 offsets; the token count exceeds int32"
    return None


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """Contiguous, with a 16-byte aligned data pointer (what the CUTLASS kernels' TMA needs)."""
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    return x


def _offsets_end_i32(group_offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm's ``offs``: int32 cumulative end offsets, length G. A view of int32
    group_offs (what the op computes); int64 offsets a caller passed are converted on the device."""
    ends = group_offs[1:]
    return ends if ends.dtype == torch.int32 else ends.to(torch.int32)


def _host_lens(group_lens: torch.Tensor, total: int) -> list[int]:
    """group_lens on the host (one device->host sync on a GPU), checked against the token count
    (which they may fall short of: the rows past the last group are padding)."""
    if group_lens.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "grouped_gemm: the TORCH per-group loop reads group_lens on the host, which a CUDA graph capture "
            "forbids; capture needs the torch._grouped_mm path (bf16, sm_90/sm_100, K and N divisible by 8)")
    lens = group_lens.tolist()
    if any(n < 0 for n in lens) or sum(lens) > total:
        raise ValueError(f"grouped_gemm: group_lens must be non-negative and sum to at most {total} (the token "
                         f"count); got {lens if len(lens) <= 16 else str(lens[:16])[:-1] + ', ...]'} (sum {sum(lens)})")
    return lens


# -- the two grouped GEMM shapes, each with its fast path and its loop ------------------------------
def _fixed_k_loop(a: torch.Tensor, b: torch.Tensor, lens: list[int], trans_b: bool) -> torch.Tensor:
    """out[s:e] = a[s:e] @ op(b[i]); the rows past the last group (padding) are zeros."""
    n = b.shape[1] if trans_b else b.shape[2]
    out = a.new_empty((a.shape[0], n))
    start = 0
    for i, length in enumerate(lens):
        if length:
            end = start + length
            torch.mm(a[start:end], b[i].t() if trans_b else b[i], out=out[start:end])
            start = end
    out[start:].zero_()
    return out


@functools.lru_cache(maxsize=None)
def _device_tail_zeroer() -> Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The Triton kernel that zeroes the padded tail touching only its rows, or None where Triton
    does not import (then a masked pass over the whole output serves)."""
    try:
        from turbo_dispatch.backends.triton import grouped_kernels  # noqa: F401  (imports triton itself)
        from turbo_dispatch.backends.triton.grouped_gemm import zero_padded_tail
    except ImportError:
        return None
    return zero_padded_tail


def _zero_padded_tail(out: torch.Tensor, group_offs: torch.Tensor) -> torch.Tensor:
    """``out[group_offs[-1]:] = 0`` after a torch grouped kernel, which writes only its groups'
    rows; the boundary stays on the device (no host sync, capturable)."""
    if out.shape[0] == 0:
        return out
    zeroer = _device_tail_zeroer() if out.is_cuda else None
    if zeroer is not None:
        return zeroer(out, group_offs)
    rows = torch.arange(out.shape[0], device=out.device)
    return out.masked_fill_((rows >= group_offs[-1])[:, None], 0)


def _variable_k_loop(x: torch.Tensor, y: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """out[i] = x[s:e]^T @ y[s:e]; an empty group's slice is set to exact zeros."""
    out = x.new_empty((len(lens), x.shape[1], y.shape[1]))
    start = 0
    for i, length in enumerate(lens):
        if length:
            end = start + length
            torch.mm(x[start:end].t(), y[start:end], out=out[i])
            start = end
        else:
            out[i].zero_()
    return out


def fixed_k(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor, group_offs: torch.Tensor, trans_b: bool,
            fast: bool) -> torch.Tensor:
    """[M, N] = per-group a @ op(b[i]) in a's dtype; ``fast``: torch._grouped_mm (the caller checked it can)."""
    if fast:
        n = b.shape[1] if trans_b else b.shape[2]
        if a.shape[0] == 0:
            return a.new_empty((0, n))
        b = _aligned(b)
        out = torch._grouped_mm(_aligned(a), b.transpose(1, 2) if trans_b else b, offs=_offsets_end_i32(group_offs))
        return _zero_padded_tail(out, group_offs)
    return _fixed_k_loop(a, b, _host_lens(group_lens, a.shape[0]), trans_b)


def variable_k(x: torch.Tensor, y: torch.Tensor, group_lens: torch.Tensor, group_offs: torch.Tensor,
               fast: bool) -> torch.Tensor:
    """[G, P, Q] = per-group x_i^T @ y_i over the token dimension; empty groups give exact zeros."""
    g = group_lens.shape[0]
    if fast:
        if x.shape[0] == 0:
            return x.new_zeros((g, x.shape[1], y.shape[1]))
        # x.t() is column-major [P, M] and y row-major [M, Q]: torch's kernel accepts empty groups and
        # any group size in exactly this layout.
        out = torch._grouped_mm(_aligned(x).t(), _aligned(y), offs=_offsets_end_i32(group_offs))
        if _capability(x.get_device())[0] >= 10:
            # pytorch/pytorch#172439: on sm_100 empty groups were seen to get non-zero gradients.
            out = torch.where((group_lens == 0)[:, None, None], torch.zeros((), dtype=out.dtype, device=out.device),
                              out)
        return out
    return _variable_k_loop(x, y, _host_lens(group_lens, x.shape[0]))


# -- adapters -----------------------------------------------------------------------------------------
class TorchGroupedGemm(_TorchAdapter):
    """torch._grouped_mm where it runs without a host sync, else a per-group torch.mm loop.

    The loop reads group_lens on the host (one sync per call on a GPU) and cannot be captured in a
    CUDA graph; ``describe`` (shown by ``turbo_dispatch.explain``) says which path a key takes.
    """

    @staticmethod
    def _fast_reason(p) -> str | None:
        return _grouped_mm_unsupported(p.platform, p.dtype, p.dtype, p.g, p.m, p.n, p.k, p.variable_k)

    def describe(self, p) -> str:
        reason = self._fast_reason(p)
        if reason is None:
            return "torch._grouped_mm (no host sync, capturable)"
        return f"per-group torch.mm loop: reads group_lens on the host, not capturable ({reason})"

    def run(self, p, a, b, group_lens, group_offs, config=None):
        fast = self._fast_reason(p) is None
        if p.variable_k:
            return variable_k(a, b, group_lens, group_offs, fast)
        return fixed_k(a, b, group_lens, group_offs, p.trans_b, fast)


#: Problem keys whose call torch._scaled_grouped_mm rejected at run time (argument checks this
#: torch applies that our static rules missed), with the reason; those keys are emulated.
_SCALED_REFUSED: dict = {}
_DEVICE_FAILURE = ("out of memory", "cuda error", "illegal memory", "device-side assert", "cublas_status",
                   "cudnn_status", "hip error")


def _is_refusal(exc: BaseException) -> bool:
    """An argument check that rejected the call (safe to emulate), not a device failure (OOM, a
    CUDA error), which must reach the user instead of silently turning into a slower path."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    text = str(exc).lower()
    return not any(marker in text for marker in _DEVICE_FAILURE)


def _scaled_grouped_unsupported(p) -> str | None:
    """Why torch._scaled_grouped_mm cannot run this fp8 GEMM (None: it can)."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"this torch ({torch.__version__}) has no torch._scaled_grouped_mm"
    if p in _SCALED_REFUSED:
        return _SCALED_REFUSED[p]
    reason = _gpu_arch_reason(p.platform, "torch._scaled_grouped_mm")
    if reason is not None:
        return reason
    if p.variable_k:
        return "variable-K (wgrad) fp8 grouped GEMMs would need per-group token scales; emulated"
    if p.granularity not in (ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE):
        return f"torch has no {p.granularity.value} fp8 grouped GEMM"
    if p.a_fp8 != torch.float8_e4m3fn or p.b_fp8 != torch.float8_e4m3fn:
        return "torch._scaled_grouped_mm takes e4m3 operands only"
    if p.out_dtype != torch.bfloat16:
        return "torch._scaled_grouped_mm writes bf16 only"
    if p.k % 16 or p.n % 16:
        return f"torch._scaled_grouped_mm needs K and N divisible by 16 (K={p.k}, N={p.n})"
    if p.g > _MAX_GROUPS:
        return f"torch._scaled_grouped_mm takes at most {_MAX_GROUPS} groups (G={p.g})"
    if p.m > _INT32_MAX:
        return "torch._scaled_grouped_mm takes int32 offsets; the token count exceeds int32"
    return None


def _emulation_fast(p) -> bool:
    """Dequantised operands can use bf16 torch._grouped_mm (no host sync) for this problem."""
    return _grouped_mm_unsupported(p.platform, torch.bfloat16, p.out_dtype, p.g, p.m, p.n, p.k, p.variable_k) is None


class TorchGroupedGemmFp8(_TorchAdapter):
    """Quantise with turbo_dispatch.low_precision, then torch._scaled_grouped_mm where the recipe and
    GPU allow, else an exact dequantise-then-grouped-GEMM emulation."""

    def supports(self, p) -> str | None:
        if p.granularity is ScalingGranularity.MX_BLOCKWISE:
            return "MX_BLOCKWISE is not supported for grouped GEMMs"
        return None

    def describe(self, p) -> str:
        reason = _scaled_grouped_unsupported(p)
        if reason is None:
            return f"torch._scaled_grouped_mm, {p.granularity.value}"
        inner = ("bf16 torch._grouped_mm (no host sync)" if _emulation_fast(p)
                 else "float32 per-group loop (reads group_lens on the host)")
        return f"dequantise + {inner} ({reason})"

    def run(self, p, x, y, group_lens, group_offs, config=None):
        gran, bs = p.granularity, p.block_size

        def quantized(t, dtype, **kw) -> QuantizedTensor:  # a pre-quantised operand is used as it came
            return t if isinstance(t, QuantizedTensor) else quantize(t, dtype, gran, block_size=bs, **kw)

        if p.variable_k:
            # wgrad: both operands in runs along the token dimension (the reduction).
            qx = quantized(x, p.a_fp8, axis=0)
            qy = quantized(y, p.b_fp8, axis=0)
        else:
            qx = quantized(x, p.a_fp8, axis=1)
            qy = quantized(y, p.b_fp8, axis=2 if p.trans_b else 1, block_2d=p.b_2d)
            if _scaled_grouped_unsupported(p) is None:
                out = _scaled_grouped(p, qx, qy, group_offs)
                if out is not None:
                    return out
        fast = _emulation_fast(p)
        work = torch.bfloat16 if fast else torch.float32
        # Contiguous: a pre-quantised operand may be stored transposed, and the same values must
        # give the same bits whichever layout they came in (the GEMM's summation order follows it).
        lhs, rhs = dequantize(qx, work).contiguous(), dequantize(qy, work).contiguous()
        if p.variable_k:
            out = variable_k(lhs, rhs, group_lens, group_offs, fast)
        else:
            out = fixed_k(lhs, rhs, group_lens, group_offs, p.trans_b, fast)
        return out.to(p.out_dtype)


def _scaled_grouped(p, qa: QuantizedTensor, qb: QuantizedTensor, group_offs: torch.Tensor) -> torch.Tensor | None:
    """torch._scaled_grouped_mm with rowwise scales: A row-major [M, K] with scale [M], B column-major
    [G, K, N] with scale [G, N]. Returns None (after logging once) if this torch rejects the call
    for this key; device failures (OOM, CUDA errors) are raised."""
    m = qa.data.shape[0]
    if m == 0:
        return qa.data.new_empty((0, p.n), dtype=p.out_dtype)
    mat_b = qb.data.transpose(1, 2) if p.trans_b else qb.data.transpose(1, 2).contiguous().transpose(1, 2)
    if p.granularity is ScalingGranularity.TENSORWISE:
        scale_a = qa.scale.reshape(1).expand(m).contiguous()
        scale_b = qb.scale.reshape(1, 1).expand(p.g, p.n).contiguous()
    else:
        scale_a = qa.scale.reshape(m)
        scale_b = qb.scale.reshape(p.g, p.n)
    try:
        out = torch._scaled_grouped_mm(qa.data, mat_b, scale_a, scale_b, offs=_offsets_end_i32(group_offs),
                                       out_dtype=p.out_dtype)
    except (TypeError, RuntimeError) as exc:
        if not _is_refusal(exc) or (qa.data.is_cuda and torch.cuda.is_current_stream_capturing()):
            raise
        _SCALED_REFUSED[p] = f"torch._scaled_grouped_mm rejected this key ({type(exc).__name__}: {exc})"
        log.warning("grouped_gemm_fp8 %s: %s; emulating this key from now on", p, _SCALED_REFUSED[p])
        return None
    return _zero_padded_tail(out, group_offs)
