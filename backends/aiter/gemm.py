"""AITER adapters for gemm and gemm_fp8.

* ``AiterGemm`` (bf16/fp16 in and out): ``aiter.tuned_gemm.tgemm.mm(inp, weights, otype=...)``,
  AITER's shape-tuned dispatcher (hipBLASLt, its asm kernels, skinny GEMMs, Triton), computing
  ``inp @ weights^T`` like ``F.linear``: ``inp`` is op(A) ``[M, K]`` and ``weights`` op(B)^T
  ``[N, K]``, both row-major. (trans_a=False, trans_b=True) passes the operands as they are; any
  other layout copies the operand that is not K-major (the dispatcher's kernels are not all
  promised to take strided views). fp32 output is refused: some of the dispatcher's kernels write
  the input dtype and upcast afterwards, which is not an fp32 accumulator written out.
* ``AiterGemmFp8``: quantise both operands with our quantisers (K-major: ``[M, K]`` and
  ``[N, K]``), then by granularity:

  - TENSORWISE: ``aiter.hipb_mm(xq, wq.t(), solution_index=-1, out_dtype=..., scaleA=,
    scaleB=)``, AITER's hipBLASLt binding (one-element fp32 scales; ``mat2`` the column-major
    ``[K, N]`` view of ``wq``);
  - ROWWISE: ``aiter.gemm_a8w8(xq, wq, x_scale[M, 1], w_scale[N, 1], dtype=...)``;
  - BLOCKWISE 1x128 activations by 128x128 weight tiles: ``aiter.gemm_a8w8_blockscale(xq, wq,
    x_scale[M, K/128], w_scale[N/128, K/128], dtype=...)``, both scales row-major; a problem
    whose *first* operand holds the tiles runs swapped (C^T = B^T A^T).

  AITER's fp8 dtype is the GPU's (``aiter.dtypes.fp8``): float8_e4m3fn on gfx950, but
  float8_e4m3fnuz on gfx942 (MI300). Our recipes quantise to e4m3fn; on gfx942 the quantised
  operands are re-encoded, exactly: every e4m3fn value halved is an e4m3fnuz value (same
  mantissa bits, one more exponent at the bottom, none needed at the top: 448 / 2 <= 240), so
  ``data / 2`` in fnuz with ``scale * 2`` dequantises to the very same numbers. It costs one pass
  over the fp8 operands. e5m2 operands (the HYBRID recipe's gradients) are refused.
  Scales follow our dequant convention (``x = data * scale``), which is AITER's too.

The contract tests (tests/test_rocm_adapters.py) check these argument layouts against a stand-in
``aiter`` written from the library's documented semantics; none of it has run on AMD hardware.
"""
from __future__ import annotations

import threading

import torch

from turbo_dispatch.low_precision import QuantizedTensor, ScalingGranularity
from turbo_dispatch.low_precision.fast_quantize import quantize_operand

from ..blaslt.gemm import _swapped
from . import library
from .base import AiterAdapter

_TENSOR, _ROW, _BLOCK = ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE, ScalingGranularity.BLOCKWISE
_HALF = (torch.bfloat16, torch.float16)
#: The entry point each fp8 granularity calls: (module inside aiter, name).
_FP8_ENTRY = {_TENSOR: ("", "hipb_mm"), _ROW: ("", "gemm_a8w8"), _BLOCK: ("", "gemm_a8w8_blockscale")}
_BLOCK_SIZE = 128


def _kmajor(x: torch.Tensor) -> torch.Tensor:
    """``x`` row-major with unit last stride (a copy only when it is not)."""
    return x if x.stride(-1) == 1 and (x.dim() < 2 or x.stride(-2) == x.shape[-1]) else x.contiguous()


class AiterGemm(AiterAdapter):
    """bf16/fp16 GEMM through AITER's tuned dispatcher ``tuned_gemm.tgemm.mm``."""

    entry_points = (("tuned_gemm", "tgemm"),)

    def supports(self, p) -> str | None:
        reason = self.platform_reason(p) or self.half_reason(p.a_dtype, "AITER's tuned GEMM")
        if reason is not None:
            return reason
        if p.b_dtype != p.a_dtype or p.out_dtype != p.a_dtype:
            return (f"AITER's tuned GEMM writes the input dtype from operands of one dtype (got {p.a_dtype}, "
                    f"{p.b_dtype} -> {p.out_dtype})")
        return None

    def describe(self, p) -> str:
        copies = [name for name, kmajor in (("a", not p.trans_a), ("b", p.trans_b)) if not kmajor]
        note = f"; copies {' and '.join(copies)} to K-major first" if copies else ""
        return f"aiter.tuned_gemm.tgemm.mm (AITER's per-shape tuned dispatcher){note}"

    def run(self, p, a, b, config=None):
        inp = _kmajor(a.t() if p.trans_a else a)  # [M, K]
        weights = _kmajor(b if p.trans_b else b.t())  # [N, K]
        return library.call("tuned_gemm", "tgemm").mm(inp, weights, otype=p.out_dtype)


_HIPB_READY = threading.Lock()
_hipb_created = False


def _hipb_mm():
    """``aiter.hipb_mm``, after ``aiter.hipb_create_extension()`` has run once in this process
    (AITER's hipBLASLt binding needs its handle created first)."""
    global _hipb_created
    if not _hipb_created:
        with _HIPB_READY:
            if not _hipb_created:
                library.call("", "hipb_create_extension")()
                _hipb_created = True
    return library.call("", "hipb_mm")


def device_operand(q: QuantizedTensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale) of ``q`` as AITER's kernels read them: data contiguous in ``fp8`` (the GPU's
    e4m3 dtype), scale contiguous float32. e4m3fn data becomes e4m3fnuz exactly (see the module
    docstring): halved, with the scale doubled."""
    data, scale = q.data, q.scale.float()
    if fp8 == torch.float8_e4m3fnuz and data.dtype == torch.float8_e4m3fn:
        data = (data.to(torch.bfloat16) * 0.5).to(fp8)  # bf16 holds every e4m3 value exactly
        scale = scale * 2.0
    return data.contiguous(), scale.contiguous()


class AiterGemmFp8(AiterAdapter):
    """fp8 GEMM through AITER: hipb_mm (tensorwise), gemm_a8w8 (rowwise), gemm_a8w8_blockscale
    (1x128 by 128x128 blockwise). Refuses, never emulates, what those kernels do not take."""

    entry_points = (("", "dtypes"),)

    def supports(self, p) -> str | None:
        reason = self.platform_reason(p)
        if reason is not None:
            return reason
        g = p.granularity
        if g not in _FP8_ENTRY:
            return f"AITER has no {g.value} fp8 GEMM here (TENSORWISE, ROWWISE and BLOCKWISE 1x128/128x128 only)"
        if library.device_fp8() is None:
            return "aiter.dtypes.fp8 names no e4m3 dtype for this GPU"
        _, why = library.entry_point(*_FP8_ENTRY[g])
        if why is not None:
            return why
        if p.a_fp8 != torch.float8_e4m3fn or p.b_fp8 != torch.float8_e4m3fn:
            return f"AITER's fp8 GEMMs take e4m3 operands only (got {p.a_fp8}, {p.b_fp8})"
        if g is _TENSOR:
            if p.out_dtype not in _HALF + (torch.float32,):
                return f"hipb_mm writes bf16/fp16/fp32 (got {p.out_dtype})"
        elif p.out_dtype not in _HALF:
            return f"AITER's {g.value} fp8 GEMM writes bf16/fp16 (got {p.out_dtype})"
        if g is _BLOCK:
            return self._blockwise_reason(p)
        if p.k % 16 or p.n % 16:
            return f"AITER's {g.value} fp8 GEMM is taken with K and N divisible by 16 (K={p.k}, N={p.n})"
        return None

    @staticmethod
    def _blockwise_reason(p) -> str | None:
        if p.block_size != _BLOCK_SIZE:
            return f"gemm_a8w8_blockscale takes 128-element blocks (block_size={p.block_size})"
        if p.a_2d == p.b_2d:
            return ("gemm_a8w8_blockscale takes 1x128 blocks on one operand and 128x128 tiles on the other "
                    f"(a_2d={p.a_2d}, b_2d={p.b_2d})")
        n = p.m if p.a_2d else p.n  # the tiled operand's rows once it is the second operand
        if p.k % _BLOCK_SIZE or n % _BLOCK_SIZE:
            return (f"gemm_a8w8_blockscale is taken with K and the tiled operand's rows divisible by 128 "
                    f"(K={p.k}, rows={n})")
        return None

    def describe(self, p) -> str:
        kernel = {_TENSOR: "aiter.hipb_mm (hipBLASLt), tensorwise scales",
                  _ROW: "aiter.gemm_a8w8, x_scale [M, 1] / w_scale [N, 1]",
                  _BLOCK: "aiter.gemm_a8w8_blockscale, x_scale [M, K/128] / w_scale [N/128, K/128]"}.get(
            p.granularity, p.granularity.value)
        swap = "; operands swapped (first operand tiled)" if p.a_2d and not p.b_2d else ""
        fnuz = ("; e4m3fn operands re-encoded as e4m3fnuz (exact)"
                if library.device_fp8() == torch.float8_e4m3fnuz else "")
        return f"{kernel}{swap}{fnuz}"

    def run(self, p, a, b, config=None):
        if p.a_2d and not p.b_2d:
            return self.run(_swapped(p), b, a, config).t().contiguous()
        g, bs = p.granularity, p.block_size
        lhs = a.t() if p.trans_a else a  # [M, K]
        rhs = b if p.trans_b else b.t()  # [N, K]
        # A pre-quantised operand (QuantizedTensor along K) is taken as it came.
        qa = lhs if isinstance(lhs, QuantizedTensor) else quantize_operand(lhs, p.a_fp8, g, 1, bs, p.a_2d)
        qb = rhs if isinstance(rhs, QuantizedTensor) else quantize_operand(rhs, p.b_fp8, g, 1, bs, p.b_2d)
        fp8 = library.device_fp8()
        xq, x_scale = device_operand(qa, fp8)
        wq, w_scale = device_operand(qb, fp8)
        if g is _TENSOR:
            return _hipb_mm()(xq, wq.t(), solution_index=-1, out_dtype=p.out_dtype,
                              scaleA=x_scale.reshape(1), scaleB=w_scale.reshape(1))
        if g is _ROW:
            return library.call("", "gemm_a8w8")(xq, wq, x_scale.reshape(p.m, 1), w_scale.reshape(p.n, 1),
                                                 dtype=p.out_dtype)
        return library.call("", "gemm_a8w8_blockscale")(xq, wq, x_scale, w_scale, dtype=p.out_dtype)
