"""The TORCH attention adapter's dense calls that ask for the lse without a window: SDPA's cuDNN
kernel through its aten op (``aten._scaled_dot_product_cudnn_attention`` with
``compute_log_sumexp``), which returns the lse that the public SDPA call drops.

Where cuDNN can serve an lse call it is the faster of the two kernels that return one (about
1.7x PyTorch's FlashAttention-2 kernels on an H100, docs/kernels.md). The cases are the
ones the CUDNN backend has verified (its ``supports()``: bf16/fp16, GQA from torch 2.11, equal
head dims that are multiples of 8 up to 128, no window, causal only with Sq == Sk, no dropout, not
deterministic), and cuDNN SDP must not be switched off (``torch.backends.cuda.enable_cudnn_sdp``).
The aten op is differentiable (PyTorch's own cuDNN backward); the lse is not.

The compiled path (``turbo_dispatch::flash_attn_fwd``) takes this kernel for every dense call
it can serve, with or without an lse, because the lse costs nothing here and lets the backward
(``backward``) run PyTorch's cuDNN backward op from the saved out and lse instead of recomputing
the forward.
"""
from __future__ import annotations

from typing import Optional

import torch


def reason(p) -> Optional[str]:
    """Why SDPA's cuDNN kernel cannot serve this dense lse call (None: it can)."""
    from turbo_dispatch.backends.cudnn.attention import CudnnAttention, _unavailable

    if p.varlen:
        return "varlen: not through SDPA's cuDNN kernel"
    if p.platform != "cuda":
        return f"cuDNN SDPA runs on NVIDIA GPUs only (platform is {p.platform})"
    why = _unavailable()
    if why is not None:
        return why
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return "cuDNN SDP is switched off (torch.backends.cuda.enable_cudnn_sdp(False))"
    return CudnnAttention().supports(p._replace(return_lse=False))


def describe(p) -> str:
    """How ``attend`` serves a call ``reason`` accepted (the TORCH and CUDNN backends alike)."""
    mask = "is_causal" if p.causal else "no mask"  # the only masks reason() lets through
    return f"SDPA's cuDNN kernel (aten._scaled_dot_product_cudnn_attention), {mask}; lse from the kernel"


def _forward_raw(p, qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor):
    """(out [B, Hq, Sq, Dv], lse) of the kernel op on [B, H, S, D] views; the lse as the op
    returns it ([B, Hq, Sq, 1] float32)."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        qt, kt, vt, None, True, 0.0, p.causal, False, scale=p.softmax_scale)[:2]


def _backward_raw(p, gt, qt, kt, vt, ot, lse):
    """(dq, dk, dv) as [B, H, S, D] from PyTorch's cuDNN backward op. Without dropout the kernel
    reads no philox state, so zeros stand in for the forward's seed and offset."""
    seed = torch.zeros((), dtype=torch.long, device=qt.device)
    offset = torch.zeros((), dtype=torch.long, device=qt.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        gt, qt, kt, vt, ot, lse, seed, offset, None, None, None, p.seqlen_q, p.seqlen_k, 0.0, p.causal,
        scale=p.softmax_scale)


def attend(p, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Sq, Hq, Dv], lse [B, Hq, Sq] float32) of a call ``reason`` accepted;
    differentiable in q/k/v."""
    out, lse = _forward_raw(p, *(x.transpose(1, 2) for x in (q, k, v)))
    if lse.numel() != p.batch * p.heads_q * p.seqlen_q:
        raise RuntimeError(f"aten._scaled_dot_product_cudnn_attention returned an lse of shape {tuple(lse.shape)}; "
                           f"expected [{p.batch}, {p.heads_q}, {p.seqlen_q}]")
    return out.transpose(1, 2), lse.detach().float().reshape(p.batch, p.heads_q, p.seqlen_q)


@torch.no_grad()
def backward(p, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) as [B, S, H, D] from ``attend``'s inputs, its out and its lse (the compiled
    path's backward: no recomputation). cuDNN wants the output gradient laid out like the output,
    so both are [B, S, H, D] contiguous here."""
    out = out.contiguous()
    grad_out = grad_out.to(out.dtype).contiguous()
    qt, kt, vt, ot, gt = (x.transpose(1, 2) for x in (q, k, v, out, grad_out))
    lse = lse.reshape(p.batch, p.heads_q, p.seqlen_q, 1)
    return tuple(x.transpose(1, 2) for x in _backward_raw(p, gt, qt, kt, vt, ot, lse))
