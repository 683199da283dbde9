"""The TORCH attention adapter's packed (varlen) path through PyTorch's own FlashAttention call,
``torch.nn.attention.varlen.varlen_attn`` (torch 2.10+), where it can serve the call.

Without it the adapter pads the packed tokens to [B, max_seqlen] and attends with a per-sequence
boolean mask, which reaches SDPA's masked (memory-efficient) kernel: on an H100 (torch 2.11, 8
sequences of 1024 tokens, causal, H=32, D=128, bf16, forward+backward) 4.2 ms against 1.5 ms for
``varlen_attn`` (tools/probe_attention.py, round 133). ``varlen_attn`` takes the packed tensors
and ``cu_seqlens`` on the device as they are (no host sync, capturable), with FlashAttention's
bottom-right aligned ``window_size``, which is this library's mask convention.

Its signature moved between releases (2.10: ``is_causal`` only in the first form, then
``scale`` / ``window_size`` / ``return_aux``; 2.12 adds ``enable_gqa``), so what it takes is read
off the signature once. A call it cannot serve (no CUDA tensor, a dtype other than bf16/fp16, a
head dim FlashAttention does not take, v's head dim unlike q's, dropout, deterministic, an lse or
a window this torch's signature has no way to ask for) keeps the padded path: ``reason`` says why.
The compiled path's backward (``TorchAttention.backward``, a recomputation under ``torch.func.vjp``)
also takes the padded path: ``varlen_attn``'s autograd.Function has no ``setup_context``, which
torch.func requires (torch 2.11, round 134).
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch

#: FlashAttention's largest head dim.
MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=None)
def _varlen_api() -> tuple[Optional[object], frozenset]:
    """(varlen_attn, its keyword names), or (None, empty) when this torch has none."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None, frozenset()
    fn = getattr(varlen, "varlen_attn", None)
    if fn is None:
        return None, frozenset()
    try:
        names = frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pragma: no cover - an unreadable signature: do not guess
        return None, frozenset()
    return fn, names


def reason(p, kernels) -> Optional[str]:
    """Why ``varlen_attn`` cannot serve this varlen call (None: it can). ``kernels`` is the
    adapter's SDPA restriction (None when PyTorch chooses)."""
    fn, names = _varlen_api()
    if fn is None:
        return "this torch has no torch.nn.attention.varlen.varlen_attn"
    if p.platform != "cuda":
        # ROCm builds have the function too, but it is not tested there.
        return f"varlen_attn is taken on NVIDIA GPUs only (platform is {p.platform})"
    if kernels is not None:
        return "the SDPA kernels are restricted (deterministic)"
    if p.dtype not in (torch.bfloat16, torch.float16):
        return f"varlen_attn takes bf16/fp16 (dtype is {p.dtype})"
    if p.head_dim_v != p.head_dim_qk or p.head_dim_qk % 8 or p.head_dim_qk > MAX_HEAD_DIM:
        return (f"head dims q/k {p.head_dim_qk}, v {p.head_dim_v}: FlashAttention takes equal head dims, "
                f"multiples of 8 up to {MAX_HEAD_DIM}")
    if p.dropout_p > 0:
        return "varlen_attn has no dropout"
    if p.return_lse and "return_aux" not in names:
        return "this torch's varlen_attn cannot return the lse"
    pure_causal = p.window_left < 0 and p.window_right == 0
    no_window = p.window_left < 0 and p.window_right < 0
    if "window_size" not in names and not (no_window or (pure_causal and "is_causal" in names)):
        return f"this torch's varlen_attn takes no window ({p.window_left}, {p.window_right})"
    if "scale" not in names:
        return "this torch's varlen_attn takes no softmax scale"
    return None


def describe(p) -> str:
    """How ``attend`` serves a call ``reason`` accepted."""
    _, names = _varlen_api()
    parts = ["torch.nn.attention.varlen.varlen_attn (FlashAttention) on the packed tokens, no host sync"]
    if p.heads_kv != p.heads_q:
        parts.append("GQA via enable_gqa" if "enable_gqa" in names else "GQA via repeat_interleave of k/v")
    if p.return_lse:
        parts.append("lse from the kernel")
    return "; ".join(parts)


def attend(p, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor
           ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out [Tq, Hq, Dv], lse [Hq, Tq] or None) of a call ``reason`` accepted. Differentiable
    (varlen_attn's own autograd). Rows that may attend no key give 0 and an lse of -inf, as the
    padded path does (FlashAttention reports +inf there)."""
    fn, names = _varlen_api()
    kwargs = {"scale": p.softmax_scale}
    if "window_size" in names:
        kwargs["window_size"] = (p.window_left, p.window_right)
    elif p.window_right == 0:
        kwargs["is_causal"] = True
    if p.heads_kv != p.heads_q:
        if "enable_gqa" in names:
            kwargs["enable_gqa"] = True
        else:
            # FlashAttention's grouping: query head h reads kv head h // (Hq / Hkv).
            rep = p.heads_q // p.heads_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if p.return_lse:
        from torch.nn.attention.varlen import AuxRequest

        out, lse = fn(q, k, v, cu_q, cu_k, p.seqlen_q, p.seqlen_k, return_aux=AuxRequest(lse=True), **kwargs)
        if tuple(lse.shape) != (p.heads_q, p.total_q):
            raise RuntimeError(f"varlen_attn returned an lse of shape {tuple(lse.shape)}; expected "
                               f"[heads_q, total_q] = [{p.heads_q}, {p.total_q}]")
        lse = lse.detach().float()
        return out, lse.masked_fill(lse == float("inf"), float("-inf"))
    return fn(q, k, v, cu_q, cu_k, p.seqlen_q, p.seqlen_k, **kwargs), None
