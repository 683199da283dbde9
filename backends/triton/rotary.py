"""Rotary position embedding in Triton: one kernel that reads a ``[B, S, H, D]`` view once and
writes its rotated copy once (``turbo_dispatch.ops.rotary`` is the op around it).

A launch rotates one section: ``H`` heads of a source view into a destination view of the same
logical shape, each with its own strides (the last dimension contiguous). The op's forward of
``split_qkv_rotary_emb`` is three such launches out of one packed projection (q and k rotated, v
copied), its backward the same three into one packed gradient, so the split, the rotation and the
``.contiguous()`` of v cost one read and one write of each element in either direction.

The rotation is computed in float32 from the given ``cos`` / ``sin`` tables (``[Bc, S, R]``
float32, ``Bc`` 1 or B) and rounded once to the destination's dtype: for the first ``2R`` features,
rotate-half pairs ``(i, i + R)`` or interleaved pairs ``(2i, 2i + 1)``; features past ``2R`` are
copied. ``INVERSE`` rotates by the opposite angle (``sin`` negated): the gradient of a rotation.

>>> from turbo_dispatch.ops.rotary import apply_rotary_emb    # the op; this module is its kernel
"""
from __future__ import annotations

from typing import Optional

import torch

from .interpret import interpreting
from .prebound import PreboundKernel

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["available", "serves", "rotate_into", "launch", "DTYPES"]

#: Element dtypes the kernel reads and writes (float64 and others take the op's torch path).
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Elements of one head row a program moves per token block: 16 tokens x 128 features of bf16 are
#: 4 KiB in and out per program, 16 bytes per thread per access at 4 warps.
TILE = 2048
WARPS = 4


def available() -> Optional[str]:
    """None when the kernel can run here (triton importable; a GPU or TRITON_INTERPRET=1), else why not."""
    if triton is None:
        return "triton is not installed"
    if interpreting() or torch.cuda.is_available():
        return None
    return "no GPU (torch.cuda.is_available() is False) and TRITON_INTERPRET is not set"


def serves(x: torch.Tensor) -> bool:
    """Whether the kernel runs on ``x`` here: a GPU tensor (or any under the interpreter) of a dtype
    in ``DTYPES``."""
    return x.dtype in DTYPES and (x.is_cuda or interpreting())


if triton is not None:

    @triton.jit
    def _rotary_kernel(src, dst, cos, sin, T, S, s_b, s_s, s_h, d_b, d_s, d_h, c_b, c_s,
                       R: tl.constexpr, PASS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_P: tl.constexpr, ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr,
                       INVERSE: tl.constexpr):
        # program (token block, head); token t of the view is (b, s) = divmod(t, S)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        head = tl.program_id(1).to(tl.int64)
        in_t = t < T
        t = t.to(tl.int64)  # offsets of long sequences times many heads pass 2**31
        b = t // S
        s = t - b * S
        src_row = (b * s_b + s * s_s + head * s_h)[:, None]
        dst_row = (b * d_b + s * d_s + head * d_h)[:, None]
        if R > 0:
            r = tl.arange(0, BLOCK_R)
            mask = in_t[:, None] & (r < R)[None, :]
            if INTERLEAVED:
                first, second = (2 * r)[None, :], (2 * r + 1)[None, :]
            else:
                first, second = r[None, :], (r + R)[None, :]
            x1 = tl.load(src + src_row + first, mask=mask)
            x2 = tl.load(src + src_row + second, mask=mask)
            if ROTATE:
                table = (b * c_b + s * c_s)[:, None] + r[None, :]
                c = tl.load(cos + table, mask=mask)
                sn = tl.load(sin + table, mask=mask)
                if INVERSE:
                    sn = -sn
                a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
                x1 = (a1 * c - a2 * sn).to(dst.dtype.element_ty)
                x2 = (a2 * c + a1 * sn).to(dst.dtype.element_ty)
            tl.store(dst + dst_row + first, x1, mask=mask)
            tl.store(dst + dst_row + second, x2, mask=mask)
        if PASS > 0:
            p = 2 * R + tl.arange(0, BLOCK_P)
            mask = in_t[:, None] & (p < 2 * R + PASS)[None, :]
            tl.store(dst + dst_row + p[None, :], tl.load(src + src_row + p[None, :], mask=mask), mask=mask)

    _LAUNCHER = PreboundKernel(_rotary_kernel, per_call=("src", "dst", "cos", "sin"))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def launch(src: torch.Tensor, dst: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
           half: int, interleaved: bool, inverse: bool) -> tuple[tuple, tuple, dict, dict]:
    """``(grid, per-call tensors, fixed arguments, options)`` of ``rotate_into``'s launch (also what
    tools/compile_sm90.py compiles)."""
    bsz, seq, heads, dim = src.shape
    tokens = bsz * seq
    rotate = cos is not None and half > 0
    if cos is None:
        cos = sin = src  # unread: ROTATE is off
        c_b = c_s = 0
    else:
        c_b = cos.stride(0) if cos.shape[0] > 1 else 0
        c_s = cos.stride(1)
    block_r, block_p = _pow2(max(half, 1)), _pow2(max(dim - 2 * half, 1))
    block_t = max(1, min(_pow2(tokens), TILE // _pow2(dim)))
    grid = (triton.cdiv(tokens, block_t), heads)
    fixed = dict(T=tokens, S=seq, s_b=src.stride(0), s_s=src.stride(1), s_h=src.stride(2), d_b=dst.stride(0),
                 d_s=dst.stride(1), d_h=dst.stride(2), c_b=c_b, c_s=c_s, R=half, PASS=dim - 2 * half,
                 BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_P=block_p, ROTATE=rotate, INTERLEAVED=interleaved,
                 INVERSE=inverse)
    return grid, (src, dst, cos, sin), fixed, dict(num_warps=WARPS)


def rotate_into(src: torch.Tensor, dst: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                half: int, interleaved: bool, inverse: bool) -> None:
    """Writes ``src`` rotated into ``dst``: both ``[B, S, H, D]`` views of one dtype with unit
    stride along D; ``cos`` / ``sin`` float32 ``[Bc, S, half]`` with unit stride along the last
    dimension (Bc 1 or B), or None with ``half`` 0 to copy. The first ``2 * half`` features are
    rotated (by ``-angle`` when ``inverse``), the rest copied. The caller checks the shapes."""
    if src.numel() == 0:
        return
    _LAUNCHER.launch(*launch(src, dst, cos, sin, half, interleaved, inverse))
