"""AITER adapter for attention: ``aiter.flash_attn_func`` / ``aiter.flash_attn_varlen_func``.

AITER's flash attention follows FlashAttention's API, which is our op's: BSHD dense inputs
(``[B, S, H, D]``) or packed THD with int32 ``cu_seqlens``, GQA/MQA, causal masks aligned to the
bottom-right corner, ``window_size`` with a third field (attention-sink tokens; we pass 0), a
float32 lse ``[B, Hq, Sq]`` (dense) or ``[Hq, Tq]`` (varlen). Head dims that are not multiples of 8
are padded by the library. Every argument after the tensors is passed by keyword: the varlen
function takes ``min_seqlen_q`` right after ``max_seqlen_k``, so a positional ``dropout_p`` would
land there.

Autograd: ``native_autograd``. The library's functions are ``torch.autograd.Function``s whose
backward runs AITER's ``mha_bwd`` / ``mha_varlen_bwd`` from the forward's saved out, lse and RNG
state, so eager calls (dropout included) use it as is. Their forward asserts that the lse is asked
for whenever a gradient will be needed (it saves it), so the adapter asks for it then and drops it
when the caller did not. ``backward`` (the compiled path's, which has no autograd graph to reuse)
re-runs the forward through the same autograd function and differentiates it: one recomputed
forward, and no dropout (refused under torch.compile by the op).

Differences from our contract, handled here: a query row that may attend no key gets lse ``+inf``
from FlashAttention-style kernels; ours is ``-inf`` (the log of an empty sum), so ``+inf`` entries
are rewritten.

Refused: fp32 inputs, head dims above 256, other platforms/archs. Contract-tested against a
stand-in ``aiter`` (tests/test_rocm_adapters.py); not run on AMD hardware.
"""
from __future__ import annotations

import torch

from . import library
from .base import AiterAdapter

MAX_HEAD_DIM = 256


def _our_lse(lse: torch.Tensor) -> torch.Tensor:
    """The library's lse in our convention (``-inf`` where a row attends no key), detached: the
    lse is not differentiable."""
    lse = lse.detach()
    return lse.masked_fill(lse == float("inf"), float("-inf"))


class AiterAttention(AiterAdapter):
    """FlashAttention through AITER (CK / asm kernels picked by the library), forward and backward."""

    entry_points = (("", "flash_attn_func"), ("", "flash_attn_varlen_func"))
    native_autograd = True

    def supports(self, p) -> str | None:
        reason = self.platform_reason(p) or self.half_reason(p.dtype, "AITER's flash attention")
        if reason is not None:
            return reason
        if max(p.head_dim_qk, p.head_dim_v) > MAX_HEAD_DIM:
            return (f"AITER's flash attention takes head dims up to {MAX_HEAD_DIM} "
                    f"(q/k {p.head_dim_qk}, v {p.head_dim_v})")
        return None

    def describe(self, p) -> str:
        fn = "flash_attn_varlen_func" if p.varlen else "flash_attn_func"
        if p.window_left < 0 and p.window_right < 0:
            mask = "no mask"
        elif p.causal and p.window_left < 0:
            mask = "causal (bottom-right)"
        else:
            mask = f"window ({p.window_left}, {p.window_right})"
        return f"aiter.{fn}, {mask}; backward: the library's autograd (mha_bwd)"

    def _attend(self, p, q, k, v, cu_q, cu_k, want_lse: bool):
        """(out, lse or None) from the library; differentiable when q/k/v require grad."""
        kwargs = dict(dropout_p=p.dropout_p, softmax_scale=p.softmax_scale, causal=p.causal,
                      window_size=(p.window_left, p.window_right, 0), deterministic=p.deterministic,
                      return_lse=want_lse)
        if p.varlen:
            result = library.call("", "flash_attn_varlen_func")(q, k, v, cu_q, cu_k, p.seqlen_q, p.seqlen_k,
                                                                 **kwargs)
        else:
            result = library.call("", "flash_attn_func")(q, k, v, **kwargs)
        return result if want_lse else (result, None)

    def forward(self, p, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, config=None):
        """(out, lse or None, saved); differentiable when q/k/v require grad."""
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        out, lse = self._attend(p, q, k, v, cu_seqlens_q, cu_seqlens_k, p.return_lse or needs_grad)
        lse = _our_lse(lse) if p.return_lse else None
        return out, lse, (q, k, v, cu_seqlens_q, cu_seqlens_k)

    def backward(self, p, saved, grad_out, config=None):
        """(dq, dk, dv) by re-running the forward through the library's autograd function."""
        if p.dropout_p > 0:
            raise NotImplementedError("AITER attention backward by recomputation cannot reproduce the forward's "
                                      "dropout mask; dropout_p > 0 needs the eager path")
        q, k, v, cu_q, cu_k = saved[:5]
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            out, _ = self._attend(p, *leaves, cu_q, cu_k, want_lse=True)
        return torch.autograd.grad(out, leaves, grad_out.to(out.dtype))

    def run(self, p, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, config=None):
        return self.forward(p, q, k, v, cu_seqlens_q, cu_seqlens_k, config)[0]
