"""The TORCH attention adapter's FlashAttention path: PyTorch's own FlashAttention-2 kernels
(``aten._flash_attention_forward`` / ``aten._flash_attention_backward``, the kernels behind SDPA's
flash backend and ``torch.nn.attention.varlen``) called directly.

SDPA cannot return the lse and reaches windows only through an explicit mask, which sends it to
the memory-efficient kernel; the padded varlen path adds scatter/gather work and a
[B, max_seqlen_q, max_seqlen_k] mask. The FlashAttention kernels take dense [B, S, H, D] batches
as they are, and packed [T, H, D] tensors with ``cu_seqlens`` on the device (no host sync,
capturable); they apply FlashAttention's bottom-right aligned ``(left, right)`` windows (this
library's mask convention) and GQA/MQA without expanding k/v, and return the lse. Dense calls
take the batch kernels. They run causal forward+backward slower than cuDNN's (1.2-1.8x on an
H100, docs/kernels.md), which is why they only take what cuDNN cannot serve.

The adapter takes this path for every varlen call and for the dense calls SDPA serves badly (an
lse that cuDNN's kernel op cannot return (``cudnn_lse``), a window, causal with Sq > Sk), where
``reason`` accepts the call: NVIDIA GPU of compute
capability 8.0+, bf16/fp16, equal head dims that are multiples of 8 up to 256, no dropout, not
deterministic, flash SDP not switched off by the user (``torch.backends.cuda.enable_flash_sdp``),
and a torch whose kernels take windows and a softmax scale. Anything else keeps SDPA (dense) or
the padded path (varlen), and ``describe()`` says why.

Eager calls are differentiable through ``_FlashFunction`` (the forward saves out and the raw lse,
the backward is one FlashAttention backward). The compiled path does the same across its two
custom ops: ``forward_saving`` returns out and the lse, which the forward op hands to its backward
op, and ``backward_saved`` runs the kernel backward from them, so nothing is recomputed.

Rows that may attend no key (Sq > Sk causal, an empty sequence) come back as 0 with zero
gradients; FlashAttention reports their lse as +inf, which ``attend`` turns into -inf like the
other paths.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

#: FlashAttention's largest head dim.
MAX_HEAD_DIM = 256
_NEEDED_KEYWORDS = ("scale", "window_size_left", "window_size_right")


@functools.lru_cache(maxsize=None)
def _unavailable() -> Optional[str]:
    """Why this torch build has no usable FlashAttention kernels (None: it has)."""
    for name in ("_flash_attention_forward", "_flash_attention_backward"):
        op = getattr(torch.ops.aten, name, None)
        if op is None:
            return f"this torch has no aten.{name}"
        names = {a.name for a in op.default._schema.arguments}
        missing = [k for k in _NEEDED_KEYWORDS if k not in names]
        if missing:
            return f"this torch's aten.{name} takes no {', '.join(missing)}"
    check = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    if check is not None and not check():
        return "this torch build has no FlashAttention kernels"
    return None


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def reason(p, kernels) -> Optional[str]:
    """Why the FlashAttention kernels cannot serve this call (None: they can). ``kernels`` is the
    adapter's SDPA restriction (None when PyTorch chooses)."""
    if p.platform != "cuda":
        # ROCm builds carry their own flash kernels, with other limits; not tested there.
        return f"FlashAttention is taken on NVIDIA GPUs only (platform is {p.platform})"
    why = _unavailable()
    if why is not None:
        return why
    if kernels is not None:
        return "the SDPA kernels are restricted (deterministic)"
    if not torch.backends.cuda.flash_sdp_enabled():
        return "flash SDP is switched off (torch.backends.cuda.enable_flash_sdp(False))"
    if p.dtype not in (torch.bfloat16, torch.float16):
        return f"FlashAttention takes bf16/fp16 (dtype is {p.dtype})"
    if p.head_dim_v != p.head_dim_qk or p.head_dim_qk % 8 or p.head_dim_qk > MAX_HEAD_DIM:
        return (f"head dims q/k {p.head_dim_qk}, v {p.head_dim_v}: FlashAttention takes equal head dims, "
                f"multiples of 8 up to {MAX_HEAD_DIM}")
    if p.dropout_p > 0:
        return "dropout: the FlashAttention path here keeps no dropout state"
    if torch.cuda.is_available():
        major, minor = _capability(torch.cuda.current_device())
        if major < 8:
            return f"FlashAttention needs compute capability 8.0+ (device has {major}.{minor})"
    return None


def describe(p) -> str:
    """How ``attend`` serves a call ``reason`` accepted."""
    layout = "the packed tokens" if p.varlen else "the dense batch"
    parts = [f"FlashAttention (aten._flash_attention_forward/backward) on {layout}, no host sync"]
    if _is_causal(p):
        parts.append("causal in the kernel")
    elif p.window_left >= 0 or p.window_right >= 0:
        parts.append(f"window ({p.window_left}, {p.window_right}) in the kernel")
    if p.heads_kv != p.heads_q:
        parts.append(f"GQA {p.heads_q}/{p.heads_kv} in the kernel")
    if p.return_lse:
        parts.append("lse from the kernel")
    return "; ".join(parts)


class _Operands(NamedTuple):
    """One call as the kernels take it: dense [B, S, H, D] with no cu_seqlens, or packed [T, H, D]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: Optional[torch.Tensor]
    cu_k: Optional[torch.Tensor]


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _operands(p, q, k, v, cu_q, cu_k) -> _Operands:
    # The kernels need unit stride along the head dim only; dense calls pass no cu_seqlens (the
    # schema's non-optional backward arguments take None as an undefined tensor, as SDPA does).
    return _Operands(*(_last_dim_contiguous(x) for x in (q, k, v)), cu_q if p.varlen else None,
                     cu_k if p.varlen else None)


def _window_args(p) -> dict:
    # The problem's window is already FlashAttention's (bottom-right aligned, -1 unbounded).
    return dict(scale=p.softmax_scale, window_size_left=p.window_left, window_size_right=p.window_right)


def _is_causal(p) -> bool:
    return p.window_left < 0 and p.window_right == 0


def _forward_raw(p, x: _Operands):
    """(out shaped like q, raw lse ([B, Hq, Sq] dense, [Hq, Tq] packed) with +inf on empty rows,
    rng_state, unused)."""
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        x.q, x.k, x.v, x.cu_q, x.cu_k, p.seqlen_q, p.seqlen_k, 0.0, _is_causal(p), False, **_window_args(p))
    return out, lse, rng_state, unused


def _backward_raw(p, x: _Operands, out, lse, rng_state, unused, grad_out):
    return torch.ops.aten._flash_attention_backward(
        _last_dim_contiguous(grad_out), x.q, x.k, x.v, out, lse, x.cu_q, x.cu_k, p.seqlen_q, p.seqlen_k, 0.0,
        _is_causal(p), rng_state, unused, **_window_args(p))


class _FlashFunction(torch.autograd.Function):
    """Eager autograd over one call: saves out and the raw lse, one kernel backward."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, p):
        x = _Operands(q, k, v, cu_q, cu_k)
        out, lse, rng_state, unused = _forward_raw(p, x)
        ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse, rng_state, unused)
        ctx.p = p
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, cu_q, cu_k, out, lse, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = _backward_raw(ctx.p, _Operands(q, k, v, cu_q, cu_k), out, lse, rng_state, unused, grad_out)
        return dq, dk, dv, None, None, None


def _unpack_lse(p, lse: torch.Tensor) -> torch.Tensor:
    """The raw lse with -inf where a row attends nothing (the API's layout already)."""
    lse = lse.detach().float()
    want = (p.heads_q, p.total_q) if p.varlen else (p.batch, p.heads_q, p.seqlen_q)
    if tuple(lse.shape) != want:
        raise RuntimeError(f"aten._flash_attention_forward returned an lse of shape {tuple(lse.shape)}; "
                           f"expected {list(want)}")
    return lse.masked_fill(lse == float("inf"), float("-inf"))


def attend(p, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Optional[torch.Tensor],
           cu_k: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out shaped like q, lse in the API's layout or None) of a call ``reason`` accepted.
    Differentiable when q/k/v require grad."""
    x = _operands(p, q, k, v, cu_q, cu_k)
    out, lse = _FlashFunction.apply(x.q, x.k, x.v, x.cu_q, x.cu_k, p)
    return out, (_unpack_lse(p, lse) if p.return_lse else None)


@torch.no_grad()
def forward_saving(p, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Optional[torch.Tensor],
                   cu_k: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out shaped like q, lse in the API's layout) of a call ``reason`` accepted, without autograd
    (the compiled path's forward); ``backward_saved`` takes both back."""
    out, lse, _, _ = _forward_raw(p, _operands(p, q, k, v, cu_q, cu_k))
    return out, _unpack_lse(p, lse)


def _no_dropout_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # The backward reads the philox seed and offset only when it applies dropout, which this path
    # never does; tensors of the forward's dtypes and shapes stand in for them.
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device)


@torch.no_grad()
def backward_saved(p, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Optional[torch.Tensor],
                   cu_k: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from ``forward_saving``'s out and lse: one kernel backward. The kernel wants
    its raw lse back, +inf where a row attends nothing (-inf there would make exp(s - lse) infinite)."""
    raw = lse.masked_fill(lse == float("-inf"), float("inf"))
    seed, offset = _no_dropout_rng(q.device)
    return _backward_raw(p, _operands(p, q, k, v, cu_q, cu_k), _last_dim_contiguous(out), raw, seed, offset,
                         grad_out.to(q.dtype))
