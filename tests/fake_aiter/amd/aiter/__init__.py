"""Stand-in for AMD's AITER (``amd-aiter``): the entry points our adapters call, in plain torch.

Signatures follow the library's (aiter/ops/gemm_op_a8w8.py, aiter/ops/gradlib.py,
aiter/ops/mha.py); each checks the layouts the library documents and computes in float64. Every
call is appended to ``CALLS`` as ``(name, details)``.
"""
from __future__ import annotations

import torch

from . import dtypes
from ._attention import flash_attn_func, flash_attn_varlen_func, mha_bwd, mha_varlen_bwd  # noqa: F401

__version__ = "0.0.0+fake"
CALLS: list = []
_state = {"hipb_extension": False}
_HALF = (torch.bfloat16, torch.float16)


def _check_fp8(*tensors):
    for t in tensors:
        assert t.dtype == dtypes.fp8, f"fp8 operands must be aiter.dtypes.fp8 ({dtypes.fp8}) on this GPU; got {t.dtype}"


def _check_row_major(name, t):
    assert t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == t.shape[1], \
        f"{name} must be a row-major [rows, K] tensor; got shape {tuple(t.shape)}, strides {t.stride()}"


def _check_scale(name, s, shape):
    assert s.dtype == torch.float32, f"{name} must be float32; got {s.dtype}"
    assert tuple(s.shape) == tuple(shape), f"{name} must have shape {tuple(shape)}; got {tuple(s.shape)}"
    assert s.is_contiguous(), f"{name} must be contiguous"


def gemm_a8w8(XQ, WQ, x_scale, w_scale, bias=None, dtype=torch.bfloat16, splitK=None):
    """Y[M, N] = (XQ * x_scale) @ (WQ * w_scale)^T: XQ [M, K], WQ [N, K], x_scale [M, 1], w_scale [N, 1]."""
    _check_fp8(XQ, WQ)
    _check_row_major("XQ", XQ)
    _check_row_major("WQ", WQ)
    m, n = XQ.shape[0], WQ.shape[0]
    _check_scale("x_scale", x_scale, (m, 1))
    _check_scale("w_scale", w_scale, (n, 1))
    assert dtype in _HALF, f"gemm_a8w8 writes bf16/fp16; got {dtype}"
    CALLS.append(("gemm_a8w8", {"x_scale": tuple(x_scale.shape), "w_scale": tuple(w_scale.shape)}))
    x = XQ.double() * x_scale.double()
    w = WQ.double() * w_scale.double()
    return (x @ w.t()).to(dtype)


def _expand_blocks(scale, rows, cols, block_rows, block_cols):
    full = scale.double().repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return full[:rows, :cols]


def gemm_a8w8_blockscale(XQ, WQ, x_scale, w_scale, dtype=torch.bfloat16, isBpreshuffled=False):
    """Y[M, N] with XQ [M, K] in 1x128 blocks (x_scale [M, K/128]) and WQ [N, K] in 128x128 tiles
    (w_scale [N/128, K/128]), both scales row-major."""
    assert dtype in _HALF, f"gemm_a8w8_blockscale writes bf16/fp16; got {dtype}"
    assert not isBpreshuffled
    _check_fp8(XQ, WQ)
    _check_row_major("XQ", XQ)
    _check_row_major("WQ", WQ)
    (m, k), n = XQ.shape, WQ.shape[0]
    kb, nb = -(-k // 128), -(-n // 128)
    _check_scale("x_scale", x_scale, (m, kb))
    _check_scale("w_scale", w_scale, (nb, kb))
    CALLS.append(("gemm_a8w8_blockscale", {"x_scale": tuple(x_scale.shape), "w_scale": tuple(w_scale.shape)}))
    x = XQ.double() * _expand_blocks(x_scale, m, k, 1, 128)
    w = WQ.double() * _expand_blocks(w_scale, n, k, 128, 128)
    return (x @ w.t()).to(dtype)


def hipb_create_extension():
    _state["hipb_extension"] = True


def _hipb_layout_ok(t):
    """hipb_mm takes each matrix row-major or column-major (gradlib/csrc/hipbsolgemm.cu)."""
    rows, cols = t.shape
    return (t.stride(0) == 1 and t.stride(1) >= max(1, rows)) or (t.stride(1) == 1 and t.stride(0) >= max(1, cols))


def hipb_mm(mat1, mat2, solution_index, bias=None, out_dtype=None, scaleA=None, scaleB=None, scaleOut=None,
            bpreshuffle=None, use_gelu=None):
    """mat1 [M, K] @ mat2 [K, N] on hipBLASLt; tensorwise scales are one-element float32 tensors."""
    assert _state["hipb_extension"], "hipb_create_extension() must run before hipb_mm"
    assert mat1.dim() == 2 and mat2.dim() == 2 and mat1.shape[1] == mat2.shape[0]
    assert mat1.dtype == mat2.dtype
    assert _hipb_layout_ok(mat1) and _hipb_layout_ok(mat2), "unusual strides"
    if mat1.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        _check_fp8(mat1, mat2)
    a, b = mat1.double(), mat2.double()
    if scaleA is not None:
        assert scaleA.dtype == torch.float32 and scaleB.dtype == torch.float32
        assert scaleA.numel() == 1 and scaleB.numel() == 1, "this stand-in checks tensorwise scales only"
        a, b = a * scaleA.double(), b * scaleB.double()
    CALLS.append(("hipb_mm", {"solution_index": solution_index, "mat2_strides": mat2.stride()}))
    return (a @ b).to(out_dtype or mat1.dtype)
