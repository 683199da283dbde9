"""TORCH adapters for gemm and gemm_fp8."""
from __future__ import annotations

import functools

import torch

from turbo_dispatch.adapter import Adapter
from turbo_dispatch.low_precision import QuantizedTensor, ScalingGranularity, dequantize, quantize


class _TorchAdapter(Adapter):
    library = "torch"

    def version(self) -> str:
        return torch.__version__


class TorchGemm(_TorchAdapter):
    """torch.matmul on views; no copies for any trans_a/trans_b combination."""

    differentiable = True

    def run(self, problem, a, b, config=None):
        lhs = a.t() if problem.trans_a else a
        rhs = b.t() if problem.trans_b else b
        if problem.out_dtype == a.dtype:
            return torch.matmul(lhs, rhs)
        if a.is_cuda and problem.out_dtype == torch.float32:
            # cuBLAS writes its fp32 accumulator directly, with no bf16/fp16 rounding in between.
            return torch.mm(lhs, rhs, out_dtype=torch.float32)
        return torch.matmul(lhs.float(), rhs.float()).to(problem.out_dtype)


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _f_scaled_mm():
    """torch.nn.functional.scaled_mm and ScalingType where this torch has them (2.10+)."""
    try:
        from torch.nn.functional import ScalingType, scaled_mm
    except ImportError:
        return None
    return scaled_mm, ScalingType


def _scaled_mm_unsupported(p) -> str | None:
    """Why torch._scaled_mm cannot run this recipe on this GPU (None: it can)."""
    if p.platform != "cuda":
        return f"torch._scaled_mm needs an NVIDIA GPU (platform is {p.platform})"
    if _capability(torch.cuda.current_device()) < (8, 9):
        return "torch._scaled_mm needs sm_89 or newer"
    if p.a_fp8 == p.b_fp8 == torch.float8_e5m2:
        return "cuBLASLt has no e5m2 x e5m2 GEMM"
    g = p.granularity
    if g in (ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE):
        if p.k % 16 or p.n % 16:
            return f"torch._scaled_mm needs K and N divisible by 16 (K={p.k}, N={p.n})"
        if g is ScalingGranularity.ROWWISE and p.out_dtype == torch.float16:
            return "rowwise torch._scaled_mm writes bf16/fp32, not fp16"
        return None
    if g is ScalingGranularity.BLOCKWISE:
        if _f_scaled_mm() is None:
            return "this torch has no torch.nn.functional.scaled_mm (blockwise recipes)"
        if p.block_size != 128 or p.k % 128 or p.n % 128:
            return f"blockwise torch scaled_mm needs block 128 and K, N divisible by 128 (K={p.k}, N={p.n})"
        if p.m % 8:
            # cuBLASLt returned NOT_SUPPORTED for M=1 on an H200 (M=200 and 256 ran).
            return f"blockwise torch scaled_mm needs M divisible by 8 here (M={p.m})"
        if torch.float8_e5m2 in (p.a_fp8, p.b_fp8):
            return "blockwise torch scaled_mm takes e4m3 operands only"
        if p.out_dtype != torch.bfloat16:
            return "blockwise torch scaled_mm writes bf16 only"
        return None
    return "MX_BLOCKWISE torch scaled_mm needs sm_100+"


def _row_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` with strides exactly (cols, 1). ``.contiguous()`` is not enough: it keeps odd
    strides on size-1 dims, which cuBLASLt rejects (seen with M=1 on an H200)."""
    if x.stride() == (x.shape[1], 1):
        return x
    return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)


def _col_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` with strides exactly (1, rows): the layout cuBLASLt reads block scales in."""
    return _row_major(x.t()).t()


class TorchGemmFp8(_TorchAdapter):
    """Quantise with turbo_dispatch.low_precision, then torch._scaled_mm (torch's cuBLASLt path)
    where this GPU supports the recipe, else an exact dequantise-then-matmul emulation. Either
    operand may arrive pre-quantised (a QuantizedTensor along K; its key dtype is fp8)."""

    def supports(self, p) -> str | None:
        if p.granularity is ScalingGranularity.MX_BLOCKWISE and p.platform in ("cuda", "rocm"):
            major = _capability(torch.cuda.current_device())[0] if p.platform == "cuda" else 0
            if major < 10:
                return "MX_BLOCKWISE needs hardware MX support (NVIDIA sm_100+); use BLOCKWISE on this GPU"
        return None

    def describe(self, p) -> str:
        reason = _scaled_mm_unsupported(p)
        if reason is None:
            return f"torch scaled_mm, {p.granularity.value}"
        return f"dequantise + matmul emulation ({reason})"

    def run(self, p, a, b, config=None):
        if p.a_2d and not p.b_2d:
            # cuBLASLt takes 2-D tiles only on its second operand: compute C^T = op(b)^T op(a)^T.
            swapped = p._replace(m=p.n, n=p.m, trans_a=not p.trans_b, trans_b=not p.trans_a, a_dtype=p.b_dtype,
                                 b_dtype=p.a_dtype, a_fp8=p.b_fp8, b_fp8=p.a_fp8, a_2d=False, b_2d=True)
            return self.run(swapped, b, a).t().contiguous()
        # A pre-quantised operand (a QuantizedTensor, fp8 dtype in the key) is used as it came.
        qa = a if isinstance(a, QuantizedTensor) else quantize(
            a, p.a_fp8, p.granularity, axis=0 if p.trans_a else 1, block_size=p.block_size, block_2d=p.a_2d)
        qb = b if isinstance(b, QuantizedTensor) else quantize(
            b, p.b_fp8, p.granularity, axis=1 if p.trans_b else 0, block_size=p.block_size, block_2d=p.b_2d)
        if _scaled_mm_unsupported(p) is None:
            return _scaled(p, qa, qb)
        lhs, rhs = dequantize(qa), dequantize(qb)
        return torch.matmul(lhs.t() if p.trans_a else lhs, rhs.t() if p.trans_b else rhs).to(p.out_dtype)


def _scaled(p, qa: QuantizedTensor, qb: QuantizedTensor) -> torch.Tensor:
    # cuBLASLt wants A row-major [M, K] and B column-major [K, N].
    lhs = _row_major(qa.data.t() if p.trans_a else qa.data)
    rhs = _row_major(qb.data).t() if p.trans_b else _col_major(qb.data)
    g = p.granularity
    if g is ScalingGranularity.TENSORWISE:
        return torch._scaled_mm(lhs, rhs, qa.scale, qb.scale, out_dtype=p.out_dtype)
    if g is ScalingGranularity.ROWWISE:
        return torch._scaled_mm(lhs, rhs, qa.scale.reshape(p.m, 1), qb.scale.reshape(1, p.n), out_dtype=p.out_dtype)
    scaled_mm = _f_scaled_mm()[0]
    return scaled_mm(lhs, rhs, *blockwise_scales(p, qa, qb), output_dtype=p.out_dtype)


def blockwise_scales(p, qa: QuantizedTensor, qb: QuantizedTensor) -> tuple:
    """(scale_a, kind_a, scale_b, kind_b) of ``F.scaled_mm``'s blockwise call for these operands,
    in the layouts torch checks for (copies only where the stored layout differs). Benchmarks
    build them once to time the GEMM alone."""
    ScalingType = _f_scaled_mm()[1]
    # Shapes and strides below are what torch 2.11 checks for on an H200 (its error messages name them).
    scale_a = _col_major(qa.scale.t() if p.trans_a else qa.scale)  # [M, K/128], strides (1, M)
    if p.b_2d:
        tiles = qb.scale if p.trans_b else qb.scale.t()  # [N/128, K/128]
        padded = torch.nn.functional.pad(tiles, (0, (-tiles.shape[1]) % 4))  # K/128 rounded up to 4
        scale_b = _row_major(padded).t()  # [K/128 padded, N/128], strides (1, K/128 padded)
        kind_b = ScalingType.BlockWise128x128
    else:
        scale_b = _col_major(qb.scale if p.trans_b else qb.scale.t())  # [N, K/128], strides (1, N)
        kind_b = ScalingType.BlockWise1x128
    return scale_a, ScalingType.BlockWise1x128, scale_b, kind_b
