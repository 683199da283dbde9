"""Rotary position embedding (RoPE) as one pass over the tensor, forward and backward.

``apply_rotary_emb(x, cos, sin)`` rotates ``x [B, S, H, D]`` (or packed ``[T, H, D]``) by
position; ``split_qkv_rotary_emb(qkv, q_heads, kv_heads, cos, sin)`` takes a fused q/k/v
projection's output ``[B, S, (Hq + 2 Hkv) D]`` and returns q and k rotated and v, each a
contiguous ``[B, S, H, D]`` tensor: the split, the rotation and v's copy in one read and one
write of each element (backward alike, into one packed gradient). Written in plain torch the
same step casts to float32, multiplies, adds, concatenates and casts back, each a pass over the
tensor, and its backward repeats them.

Contract (both ops):

* ``cos``, ``sin``: ``[S, R]`` (every sequence at positions 0..S-1) or ``[B, S, R]`` (positions
  per sequence; ``[T, R]`` for packed ``[T, H, D]`` input), any float dtype, with ``1 <= 2R <= D``.
  The first ``2R`` features of each head are rotated, the rest pass through unchanged (partial
  rotary). They are constants: no gradient flows to them, and one that requires grad while
  autograd records is refused. The kernel path's backward is differentiable once (a second
  derivative raises); the torch path's as often as torch's.
* Pairs: rotate-half (``(i, i + R)``, the Llama / GPT-NeoX layout) or, with
  ``interleaved=True``, adjacent features ``(2i, 2i + 1)`` (GPT-J). For a pair ``(x1, x2)`` at
  angle ``a``: ``(x1 cos a - x2 sin a, x2 cos a + x1 sin a)``.
* Arithmetic in float32 (float64 for float64 input) from the tables as given, rounded once to
  ``x``'s dtype.
* The Triton kernel (registry kernel ``rotary``) serves bf16 / fp16 / fp32 GPU tensors; other
  calls, ``PRIMUS_TURBO_ROTARY_TRITON=0`` (read per call) and traced calls (``torch.compile``,
  whose own fusion of the torch expression is the better kernel there, or a fake / proxy tensor
  mode) take the torch path, which computes the same.

>>> import torch
>>> from turbo_dispatch.ops import apply_rotary_emb
>>> x = torch.randn(2, 8, 4, 16)
>>> angle = torch.outer(torch.arange(8.0), torch.rand(8))
>>> apply_rotary_emb(x, angle.cos(), angle.sin()).shape
torch.Size([2, 8, 4, 16])
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ..env import env_text_reader
from ._common import require_bool
from .eager_kernels import eager_kernel_module

__all__ = ["apply_rotary_emb", "split_qkv_rotary_emb", "TRITON_ENV"]

#: Set to 0/false to keep the torch path (read on every call).
TRITON_ENV = "PRIMUS_TURBO_ROTARY_TRITON"
_READ_SWITCH = env_text_reader(TRITON_ENV)
KERNEL = "rotary"


# -- checks ------------------------------------------------------------------------------------
def _tables(op: str, cos: object, sin: object, x_shape: tuple, dim: int, packed: bool) -> int:
    """Checks ``cos`` / ``sin`` against a ``[B, S, H, D]`` (or packed ``[T, H, D]``) input of
    ``x_shape`` with ``dim`` features per head; returns R, the rotated pairs per head."""
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor [S, R] or [B, S, R]; got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be a floating-point tensor; got {t.dtype}")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{op}: {name} requires grad, but no gradient flows to the rotary tables; "
                             f"pass {name}.detach()")
    if cos.shape != sin.shape:
        raise ValueError(f"{op}: cos and sin must have one shape; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    seq = x_shape[0] if packed else x_shape[1]
    allowed = "[T, R]" if packed else "[S, R] or [B, S, R]"
    if cos.dim() not in ((2,) if packed else (2, 3)) or cos.shape[-2] != seq:
        raise ValueError(f"{op}: cos and sin must be {allowed} with {'T' if packed else 'S'} = {seq}; "
                         f"got {tuple(cos.shape)}")
    if cos.dim() == 3 and cos.shape[0] not in (1, x_shape[0]):
        raise ValueError(f"{op}: cos and sin [B, S, R] must have B = 1 or {x_shape[0]}; got {tuple(cos.shape)}")
    half = cos.shape[-1]
    if not 1 <= 2 * half <= dim:
        raise ValueError(f"{op}: cos and sin's last dimension R must satisfy 1 <= 2R <= head dim {dim}; got R = {half}")
    return half


def _same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"{op}: {', '.join(tensors)} must be on one device; got {sorted(map(str, devices))}")


def _require_float(op: str, name: str, x: object, dims: tuple[int, ...], hint: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor {hint}; got {type(x).__name__}")
    if x.dim() not in dims:
        raise ValueError(f"{op}: {name} must be {hint}; got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor; got {x.dtype}")
    return x


# -- the torch path ----------------------------------------------------------------------------
def _as_bshr(table: torch.Tensor, math: torch.dtype) -> torch.Tensor:
    """A table as ``math`` dtype ``[Bc, S, 1, R]``, broadcasting over heads."""
    table = table.to(math)
    return (table if table.dim() == 3 else table.unsqueeze(0)).unsqueeze(2)


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotation of ``x [B, S, H, D]`` in torch ops (the reference, and the path where the
    kernel does not run); contiguous output in x's dtype."""
    half = cos.shape[-1]
    math = torch.float64 if x.dtype == torch.float64 else torch.float32
    c, s = _as_bshr(cos, math), _as_bshr(sin, math)
    xf = x.to(math)
    rot, rest = xf[..., :2 * half], xf[..., 2 * half:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rotated, rest), dim=-1).to(x.dtype)


# -- the kernel path ---------------------------------------------------------------------------
def _kernels(x: torch.Tensor) -> Optional[ModuleType]:
    """The kernel module when this call takes the Triton path (see the module docstring)."""
    return eager_kernel_module(KERNEL, x, _READ_SWITCH, TRITON_ENV)


def _kernel_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables as the kernel reads them: float32 ``[Bc, S, R]``, unit stride along R."""
    def one(t: torch.Tensor) -> torch.Tensor:
        t = t if t.dim() == 3 else t.unsqueeze(0)
        t = t.detach().to(torch.float32)
        return t if t.stride(-1) == 1 else t.contiguous()
    return one(cos), one(sin)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


class _Rotary(torch.autograd.Function):
    """``x [B, S, H, D]`` rotated through the kernel; its backward rotates the gradient back."""

    @staticmethod
    def forward(ctx, kernels, x, cos, sin, half, interleaved):
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        kernels.rotate_into(_unit_last(x), out, cos, sin, half, interleaved, False)
        ctx.kernels, ctx.half, ctx.interleaved = kernels, half, interleaved
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        grad_x = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        ctx.kernels.rotate_into(_unit_last(grad), grad_x, cos, sin, ctx.half, ctx.interleaved, True)
        return None, grad_x, None, None, None, None


def _qkv_sections(q_heads: int, kv_heads: int) -> tuple[tuple[int, int, bool], ...]:
    """(first head, heads, rotated) of q, k and v in a packed projection's heads."""
    return (0, q_heads, True), (q_heads, kv_heads, True), (q_heads + kv_heads, kv_heads, False)


class _SplitQkvRotary(torch.autograd.Function):
    """``qkv [B, S, (Hq + 2 Hkv) D]`` into contiguous q, k (rotated) and v through the kernel; the
    backward writes the three gradients into one packed one."""

    @staticmethod
    def forward(ctx, kernels, qkv, q_heads, kv_heads, cos, sin, half, interleaved):
        bsz, seq, width = qkv.shape
        dim = width // (q_heads + 2 * kv_heads)
        packed = qkv.as_strided((bsz, seq, q_heads + 2 * kv_heads, dim), (qkv.stride(0), qkv.stride(1), dim, 1),
                                qkv.storage_offset())
        outs = []
        for first, heads, rotate in _qkv_sections(q_heads, kv_heads):
            out = torch.empty((bsz, seq, heads, dim), dtype=qkv.dtype, device=qkv.device)
            kernels.rotate_into(packed[:, :, first:first + heads], out, cos if rotate else None,
                                sin if rotate else None, half if rotate else 0, interleaved, False)
            outs.append(out)
        ctx.kernels, ctx.split, ctx.half, ctx.interleaved = kernels, (q_heads, kv_heads, dim), half, interleaved
        ctx.save_for_backward(cos, sin)
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        q_heads, kv_heads, dim = ctx.split
        bsz, seq = dq.shape[:2]  # autograd hands zeros for an output the loss did not use
        grad = torch.empty((bsz, seq, (q_heads + 2 * kv_heads) * dim), dtype=dq.dtype, device=dq.device)
        packed = grad.view(bsz, seq, q_heads + 2 * kv_heads, dim)
        for g, (first, heads, rotate) in zip((dq, dk, dv), _qkv_sections(q_heads, kv_heads)):
            section = packed[:, :, first:first + heads]
            ctx.kernels.rotate_into(_unit_last(g), section, cos if rotate else None, sin if rotate else None,
                                    ctx.half if rotate else 0, ctx.interleaved, True)
        return None, grad, None, None, None, None, None, None


# -- the ops -----------------------------------------------------------------------------------
def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                     interleaved: bool = False) -> torch.Tensor:
    """``x [B, S, H, D]`` (or packed ``[T, H, D]``) rotated by position: a new contiguous tensor
    of x's shape and dtype (see the module docstring for ``cos`` / ``sin`` and the pairs).

    >>> x = torch.randn(1, 3, 2, 4)
    >>> zero = torch.zeros(3, 2)
    >>> torch.equal(apply_rotary_emb(x, zero.cos(), zero.sin()), x)   # angle 0: unchanged
    True
    """
    op = "apply_rotary_emb"
    x = _require_float(op, "x", x, (3, 4), "[B, S, H, D] or [T, H, D]")
    require_bool(op, "interleaved", interleaved)
    packed = x.dim() == 3
    half = _tables(op, cos, sin, tuple(x.shape), x.shape[-1], packed)
    _same_device(op, x=x, cos=cos, sin=sin)
    x4 = x.unsqueeze(0) if packed else x
    kernels = _kernels(x)
    if kernels is None or x.numel() == 0:
        out = _rotate_torch(x4, cos.detach(), sin.detach(), interleaved)
    else:
        c, s = _kernel_tables(cos, sin)
        out = _Rotary.apply(kernels, x4, c, s, half, interleaved)
    return out.squeeze(0) if packed else out


def split_qkv_rotary_emb(qkv: torch.Tensor, q_heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor, *,
                         interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` of a fused projection's output ``qkv [B, S, (q_heads + 2 kv_heads) D]`` (or
    packed ``[T, ...]``): q ``[B, S, q_heads, D]`` and k ``[B, S, kv_heads, D]`` rotated as
    ``apply_rotary_emb`` rotates, v ``[B, S, kv_heads, D]`` as is; each contiguous, in qkv's dtype.

    >>> qkv = torch.randn(2, 5, (4 + 2 * 2) * 8)
    >>> angle = torch.outer(torch.arange(5.0), torch.rand(4))
    >>> [tuple(t.shape) for t in split_qkv_rotary_emb(qkv, 4, 2, angle.cos(), angle.sin())]
    [(2, 5, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8)]
    """
    op = "split_qkv_rotary_emb"
    qkv = _require_float(op, "qkv", qkv, (2, 3), "[B, S, (q_heads + 2 kv_heads) * D] or [T, ...]")
    for name, value in (("q_heads", q_heads), ("kv_heads", kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{op}: {name} must be a positive int; got {value!r}")
    require_bool(op, "interleaved", interleaved)
    heads = q_heads + 2 * kv_heads
    width = qkv.shape[-1]
    if width % heads or width == 0:
        raise ValueError(f"{op}: qkv's last dimension ({width}) must be (q_heads + 2 * kv_heads) = {heads} times "
                         f"a positive head dim")
    dim = width // heads
    packed = qkv.dim() == 2
    qkv3 = qkv.unsqueeze(0) if packed else qkv
    half = _tables(op, cos, sin, tuple(qkv.shape[:-1]) + (heads, dim), dim, packed)
    _same_device(op, qkv=qkv, cos=cos, sin=sin)
    kernels = _kernels(qkv)
    if kernels is None or qkv.numel() == 0:
        q, k, v = qkv3.reshape(*qkv3.shape[:2], heads, dim).split([q_heads, kv_heads, kv_heads], dim=2)
        c, s = cos.detach(), sin.detach()
        outs = (_rotate_torch(q, c, s, interleaved), _rotate_torch(k, c, s, interleaved), v.contiguous())
    else:
        c, s = _kernel_tables(cos, sin)
        outs = _SplitQkvRotary.apply(kernels, _unit_last(qkv3), q_heads, kv_heads, c, s, half, interleaved)
    return tuple(t.squeeze(0) for t in outs) if packed else tuple(outs)
