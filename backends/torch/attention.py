"""TORCH adapter for attention: torch.nn.functional.scaled_dot_product_attention (SDPA).

PyTorch picks the kernel (flash / memory-efficient / cuDNN / math on GPUs; its own CPU kernels
or math on CPUs). Inputs arrive as [B, S, H, D] and are handed to SDPA as [B, H, S, D] views.

Masks (bottom-right aligned, FlashAttention semantics; see turbo_dispatch/ops/attention.py):

* no window, not causal: no mask;
* causal with Sq == Sk: ``is_causal=True`` (top-left and bottom-right coincide);
* causal with Sq < Sk: ``torch.nn.attention.bias.causal_lower_right``, which reaches the flash /
  memory-efficient kernels' native lower-right masks on GPUs;
* everything else (windows, causal with Sq > Sk, varlen): an explicit boolean mask. Query rows
  that may attend no key get an all-True mask row (so no kernel divides by an empty sum) and
  their output is multiplied by 0 afterwards, which also zeroes their gradients.

GQA/MQA: ``enable_gqa=True`` where this torch has it (2.5+), except on GPUs when an explicit mask
is needed: there k/v are expanded with ``repeat_interleave``, because the masked GPU kernel
(memory-efficient) does not take GQA and SDPA would otherwise fall back to the math kernel,
which materialises every score.

cuDNN lse path (``cudnn_lse``): dense calls that ask for the lse and that the CUDNN backend has
verified run SDPA's cuDNN kernel op, which returns the lse at no extra cost (docs/kernels.md).

FlashAttention path (``flash_native``): on NVIDIA GPUs PyTorch's own FlashAttention-2 kernels,
called directly, serve every varlen call and the other dense calls SDPA serves badly (an lse
cuDNN cannot return, a window, causal with Sq > Sk) wherever they can (bf16/fp16, equal head dims
up to 256, no dropout, not deterministic): they return the lse and apply windows in the kernel.
What neither serves takes the paths below, and ``describe()`` says which path and why.

lse elsewhere: SDPA does not return it, so ``return_lse`` adds a separate pass that computes the
scores in float32 query block by query block (at most 2**26 scores at a time; a dense block reads
only the keys its rows may attend) and takes their logsumexp. It runs without autograd (the lse
is not differentiable) and costs one extra QK^T plus a few memory-bound passes over the scores,
several times the attention itself (docs/kernels.md), so it serves only what the two kernel
paths above cannot.

Varlen elsewhere: the packed tokens are scattered into padded [B, max_seqlen, H, D] tensors with
indices computed on the device from cu_seqlens (searchsorted), attended with a per-sequence
boolean mask, and gathered back. Nothing reads cu_seqlens on the host, so there is no host sync
and the call can be captured in a CUDA graph; the price is padding work and memory of order
B * max_seqlen_q * max_seqlen_k for the mask, and the masked kernel is slower than the causal
one (about 3x FlashAttention's varlen kernel, docs/kernels.md). Tokens beyond
``cu_seqlens[-1]`` or sequences longer than ``max_seqlen`` break the FlashAttention contract:
indices are clamped so nothing reads out of bounds, but the result for those tokens is undefined.

``deterministic=True`` restricts SDPA to its math kernel on GPUs (deterministic, but slow and
O(Sq*Sk) memory); on CPUs PyTorch's kernels are deterministic already.

Attention sinks and fp8 calls are refused (``sdpa_feature_refusal``): SDPA has no sink term in
its softmax denominator and no fp8 path; TRITON serves both.

Dropout uses SDPA's own dropout (``dropout_p``); in eager mode the backward reuses the mask the
forward drew (it is SDPA's own autograd graph).

Under torch.compile (``compiled_forward`` / ``compiled_backward``) a call runs the kernel its eager
call runs, but where that is cuDNN or FlashAttention it runs through the op that returns the lse,
asked for or not (for SDPA's unmasked calls, the kernel ``torch._fused_sdp_choice`` names): the
forward op hands out and the lse to the backward op, whose kernel backward starts from them. The
other calls run SDPA and recompute the forward in the backward.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from turbo_dispatch.adapter import Adapter

from . import cudnn_lse, flash_native

try:  # torch >= 2.3
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover - older torch
    SDPBackend = sdpa_kernel = None

try:
    from torch.nn.attention.bias import causal_lower_right
except ImportError:  # pragma: no cover - older torch
    causal_lower_right = None


@functools.lru_cache(maxsize=None)
def has_enable_gqa() -> bool:
    """SDPA's enable_gqa argument exists from torch 2.5."""
    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


_LSE_BLOCK = 1 << 26  # scores per block of the float32 lse pass


# -- masks ------------------------------------------------------------------------------------------
def _dense_allowed(p, device) -> Optional[torch.Tensor]:
    """Boolean [Sq, Sk]: may query i attend key j (None: every pair may)."""
    if p.window_left < 0 and p.window_right < 0:
        return None
    i = torch.arange(p.seqlen_q, device=device)[:, None]
    j = torch.arange(p.seqlen_k, device=device)[None, :]
    rel = j - i - (p.seqlen_k - p.seqlen_q)  # key position relative to the query's diagonal
    allowed = torch.ones(p.seqlen_q, p.seqlen_k, dtype=torch.bool, device=device)
    if p.window_right >= 0:
        allowed &= rel <= p.window_right
    if p.window_left >= 0:
        allowed &= rel >= -p.window_left
    return allowed


def _dense_has_empty_rows(p) -> bool:
    """Whether some query row may attend no key: only when the right bound cuts off row 0
    (``Sk - Sq + right < 0``); the left bound never empties a row (Sk >= 1)."""
    return p.window_right >= 0 and p.seqlen_k - p.seqlen_q + p.window_right < 0


def _varlen_allowed(p, cu_q: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
    """Boolean [B, max_sq, max_sk] per-sequence mask (padding keys excluded)."""
    lens_q = (cu_q[1:] - cu_q[:-1]).long()[:, None, None]
    lens_k = (cu_k[1:] - cu_k[:-1]).long()[:, None, None]
    i = torch.arange(p.seqlen_q, device=cu_q.device)[None, :, None]
    j = torch.arange(p.seqlen_k, device=cu_q.device)[None, None, :]
    allowed = j < lens_k
    rel = j - i - (lens_k - lens_q)
    if p.window_right >= 0:
        allowed = allowed & (rel <= p.window_right)
    if p.window_left >= 0:
        allowed = allowed & (rel >= -p.window_left)
    return allowed


def _token_index(cu: torch.Tensor, total: int, batch: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position) of every packed token, computed on the device."""
    t = torch.arange(total, device=cu.device, dtype=cu.dtype)
    seq = torch.searchsorted(cu[1:].contiguous(), t, right=True).clamp_(max=batch - 1)
    pos = (t.long() - cu.long()[seq]).clamp_(0, max_len - 1)
    return seq, pos


# -- the SDPA call ------------------------------------------------------------------------------------
class _Plan:
    """How one call hands its mask to SDPA: ``attn_mask``/``is_causal`` for SDPA, ``allowed``
    (for the lse pass) and ``rows`` (a 0/1 multiplier for rows that attend nothing, or None)."""

    __slots__ = ("attn_mask", "is_causal", "allowed", "rows", "explicit")

    def __init__(self, attn_mask=None, is_causal=False, allowed=None, rows=None, explicit=False):
        self.attn_mask, self.is_causal, self.allowed, self.rows, self.explicit = \
            attn_mask, is_causal, allowed, rows, explicit


def _guard(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = allowed.any(-1, keepdim=True)
    return allowed | ~rows, rows


def _sdpa_mask(p) -> str:
    """How a dense call hands its mask to SDPA (the same cases as ``_dense_plan``)."""
    pure_causal = p.window_left < 0 and p.window_right == 0
    if p.window_left < 0 and p.window_right < 0:
        return "no mask"
    if pure_causal and p.seqlen_q == p.seqlen_k:
        return "is_causal"
    if pure_causal and p.seqlen_q < p.seqlen_k and causal_lower_right is not None:
        return "causal_lower_right bias"
    return "explicit boolean mask"


def _dense_plan(p, device, need_allowed: bool) -> _Plan:
    kind = _sdpa_mask(p)
    if kind == "no mask":
        return _Plan()
    if kind == "is_causal":
        return _Plan(is_causal=True, allowed=_dense_allowed(p, device) if need_allowed else None)
    if kind == "causal_lower_right bias":
        return _Plan(attn_mask=causal_lower_right(p.seqlen_q, p.seqlen_k),
                     allowed=_dense_allowed(p, device) if need_allowed else None)
    allowed = _dense_allowed(p, device)
    if _dense_has_empty_rows(p):
        mask, rows = _guard(allowed)
        return _Plan(attn_mask=mask, allowed=allowed, rows=rows, explicit=True)
    return _Plan(attn_mask=allowed, allowed=allowed, explicit=True)


def _sdpa(p, qt, kt, vt, plan: _Plan, kernels) -> torch.Tensor:
    """SDPA on [B, H, S, D] tensors, under ``sdpa_kernel(kernels)`` when kernels is not None."""
    kwargs = {}
    if p.heads_kv != p.heads_q:
        if has_enable_gqa() and not (plan.explicit and qt.is_cuda):
            kwargs["enable_gqa"] = True
        else:
            rep = p.heads_q // p.heads_kv
            kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
    call = functools.partial(F.scaled_dot_product_attention, qt, kt, vt, attn_mask=plan.attn_mask,
                             dropout_p=p.dropout_p, is_causal=plan.is_causal, scale=p.softmax_scale, **kwargs)
    if kernels is None:
        out = call()
    else:
        with sdpa_kernel(kernels):
            out = call()
    if plan.rows is not None:
        out = out * plan.rows.unsqueeze(-3).to(out.dtype)  # rows: [..., Sq, 1] -> [..., 1, Sq, 1]
    return out


_BMM_OUT_DTYPE: dict = {}


def _scores(qc: torch.Tensor, kc: torch.Tensor) -> torch.Tensor:
    """float32 qc @ kc^T for [N, M, D] x [N, S, D]: bf16/fp16 GEMMs accumulate into float32 output
    directly where this torch has ``torch.bmm(..., out_dtype=)`` on the device (CUDA, 2.8+);
    otherwise the operands are upcast first."""
    if qc.dtype != torch.float32 and qc.is_cuda and _BMM_OUT_DTYPE.get(qc.dtype, True):
        try:
            return torch.bmm(qc, kc.transpose(1, 2), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _BMM_OUT_DTYPE[qc.dtype] = False
    return torch.bmm(qc.float(), kc.float().transpose(1, 2))


def _key_range(p, s: int, e: int) -> tuple[int, int]:
    """Keys [lo, hi) that rows s..e-1 of a dense problem may attend at all."""
    off = p.seqlen_k - p.seqlen_q
    lo = max(0, s + off - p.window_left) if p.window_left >= 0 else 0
    hi = min(p.seqlen_k, e - 1 + off + p.window_right + 1) if p.window_right >= 0 else p.seqlen_k
    return lo, hi


@torch.no_grad()
def _lse(p, qt, kt, allowed: Optional[torch.Tensor]) -> torch.Tensor:
    """float32 logsumexp of the scaled scores, [B, Hq, Sq]; -inf on rows that attend nothing.

    ``allowed`` is None, [Sq, Sk] (dense) or [B, Sq, Sk] (varlen). Query blocks of at most
    _LSE_BLOCK scores; a dense block only reads the keys its rows may attend (causal: about half
    the work, windows: the window's width)."""
    b, hq, sq, d = qt.shape
    hk, sk = kt.shape[1], kt.shape[2]
    rep = hq // hk
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=qt.device)
    step = max(1, _LSE_BLOCK // max(1, b * hq * sk))
    for s in range(0, sq, step):
        e = min(sq, s + step)
        lo, hi = _key_range(p, s, e) if allowed is not None and allowed.dim() == 2 else (0, sk)
        if hi <= lo:
            continue  # every row of the block attends nothing
        qc = qt[:, :, s:e].reshape(b * hk, rep * (e - s), d)
        kc = kt[:, :, lo:hi].reshape(b * hk, hi - lo, d)
        scores = _scores(qc, kc).mul_(p.softmax_scale).view(b, hk, rep, e - s, hi - lo)
        if allowed is not None:
            block = allowed[..., s:e, lo:hi]
            block = block[:, None, None] if block.dim() == 3 else block  # [B, c, S] -> [B, 1, 1, c, S]
            scores.masked_fill_(~block, float("-inf"))
        lse[:, :, s:e] = torch.logsumexp(scores, -1).view(b, hq, e - s)
    return lse


SDP_FLASH, SDP_CUDNN = 1, 3  # torch._fused_sdp_choice's answers (SDPBackend's values)


def _sdpa_choice(p, q, k, v) -> Optional[int]:
    """The kernel SDPA would run for a dense call it serves without an explicit mask (an
    SDPBackend value), None where this torch cannot say. Its lower-right causal bias runs the
    FlashAttention kernel wherever that can serve."""
    kind = _sdpa_mask(p)
    if kind == "causal_lower_right bias":
        return SDP_FLASH
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None or kind not in ("no mask", "is_causal"):
        return None
    kwargs = dict(dropout_p=p.dropout_p, is_causal=kind == "is_causal", scale=p.softmax_scale)
    if p.heads_kv != p.heads_q:
        if not has_enable_gqa():
            return None
        kwargs["enable_gqa"] = True
    try:
        return int(choose(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs))
    except (RuntimeError, TypeError, ValueError):
        return None


def sdpa_feature_refusal(p) -> Optional[str]:
    """Why an SDPA-based adapter refuses a call with attention sinks or fp8 (None: it has
    neither): SDPA has no term for a sink in the softmax denominator and no fp8 path."""
    if p.sink:
        return "attention sinks: SDPA's kernels have no sink term in the softmax denominator (TRITON serves sinks)"
    if p.fp8:
        return "fp8 attention: SDPA's kernels have no fp8 path (TRITON serves flash_attn_fp8_func)"
    return None


class TorchAttention(Adapter):
    """torch.nn.functional.scaled_dot_product_attention with PyTorch's own kernel choice."""

    library = "torch"
    #: forward() builds an autograd graph when its inputs require grad; eager calls use it as is.
    native_autograd = True

    def version(self) -> str:
        return torch.__version__

    def supports(self, p) -> Optional[str]:
        return sdpa_feature_refusal(p)

    def _kernels(self, p, device_is_cuda: bool):
        """SDPA backends to restrict to (None: PyTorch chooses)."""
        if p.deterministic and device_is_cuda and sdpa_kernel is not None:
            return [SDPBackend.MATH]
        return None

    def _cudnn_lse_reason(self, p) -> Optional[str]:
        """Why this call's lse does not come from SDPA's cuDNN kernel op (None: it does)."""
        if not p.return_lse:
            return "no lse asked for"
        return cudnn_lse.reason(p)

    def _flash_reason(self, p) -> Optional[str]:
        """Why this call does not take the FlashAttention path (None: it does)."""
        if self._cudnn_lse_reason(p) is None:
            return "SDPA's cuDNN kernel returns this call's lse"
        return self._flash_refusal(p)

    def _flash_refusal(self, p) -> Optional[str]:
        """``_flash_reason`` for a call the cuDNN lse path does not take: the callers that have
        asked ``_cudnn_lse_reason`` already do not ask it again."""
        if not p.varlen and not p.return_lse and _sdpa_mask(p) != "explicit boolean mask":
            return "SDPA serves it without an lse or an explicit mask"
        return flash_native.reason(p, self._kernels(p, p.platform in ("cuda", "rocm")))

    def describe(self, p) -> str:
        if self._cudnn_lse_reason(p) is None:
            return cudnn_lse.describe(p)
        why = self._flash_refusal(p)
        if why is None:
            return flash_native.describe(p)
        if p.varlen:
            how = ("varlen: padded to [B, max_seqlen] on the device with a per-sequence mask (no host sync; "
                   f"not FlashAttention: {why})")
        else:
            how = _sdpa_mask(p)
            if p.return_lse or how == "explicit boolean mask":
                how += f" (not FlashAttention: {why})"
        parts = [f"SDPA, {how}"]
        if p.heads_kv != p.heads_q:
            parts.append("GQA via enable_gqa" if has_enable_gqa() else "GQA via repeat_interleave")
        if p.return_lse:
            parts.append("lse by a separate float32 pass")
        if p.deterministic and p.platform in ("cuda", "rocm"):
            parts.append("deterministic: math kernel")
        return "; ".join(parts)

    def _path(self, p) -> str:
        """The kernel an eager call takes: "cudnn" (an lse call on cuDNN's kernel op), "flash"
        (FlashAttention) or "sdpa" (SDPA's paths)."""
        if self._cudnn_lse_reason(p) is None:
            return "cudnn"
        return "flash" if self._flash_refusal(p) is None else "sdpa"

    # -- the attention adapter protocol ---------------------------------------------------------------
    def forward(self, p, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, config=None):
        """(out, lse or None, saved). Differentiable when q/k/v require grad."""
        path = self._path(p)
        if path == "cudnn":
            out, lse = cudnn_lse.attend(p, q, k, v)
            return out.contiguous(), lse, (q, k, v, cu_seqlens_q, cu_seqlens_k)
        if path == "flash":
            out, lse = flash_native.attend(p, q, k, v, cu_seqlens_q, cu_seqlens_k)
            return out, lse, (q, k, v, cu_seqlens_q, cu_seqlens_k)
        return self._forward(p, q, k, v, cu_seqlens_q, cu_seqlens_k)

    def _forward(self, p, q, k, v, cu_seqlens_q, cu_seqlens_k):
        """The SDPA paths (dense, or varlen padded)."""
        kernels = self._kernels(p, q.is_cuda)
        if p.varlen:
            out, lse = self._varlen(p, q, k, v, cu_seqlens_q, cu_seqlens_k, kernels)
        else:
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            plan = _dense_plan(p, q.device, p.return_lse)
            out = _sdpa(p, qt, kt, vt, plan, kernels).transpose(1, 2)
            lse = _lse(p, qt, kt, plan.allowed) if p.return_lse else None
        return out.contiguous(), lse, (q, k, v, cu_seqlens_q, cu_seqlens_k)

    def backward(self, p, saved, grad_out, config=None):
        """(dq, dk, dv) by recomputing the forward through SDPA's paths (the compiled path's
        backward where its forward's kernel returned no lse)."""
        if p.dropout_p > 0:
            raise NotImplementedError("attention backward by recomputation cannot reproduce the forward's "
                                      "dropout mask; dropout_p > 0 needs the eager path")
        q, k, v, cu_q, cu_k = saved
        p = p._replace(return_lse=False)  # the lse is not differentiable; the backward needs none
        # torch.func.vjp rather than enable_grad + autograd.grad: inside a custom op's
        # implementation the autograd dispatch keys are excluded, and functorch's grad
        # transform is what re-enables them for its own level.
        _, vjp = torch.func.vjp(lambda q, k, v: self._forward(p, q, k, v, cu_q, cu_k)[0], q, k, v)
        return vjp(grad_out.to(q.dtype))

    # -- the compiled path: a forward that hands its out and lse to the backward -----------------
    def _saving_path(self, p, q, k, v) -> str:
        """Which kernel a compiled call takes: "cudnn" or "flash" (both return the lse, from which
        with out their backward op starts) or "sdpa" (the backward recomputes the forward).

        The eager call's kernel, always: lse calls on cuDNN's op, the calls eager takes to
        FlashAttention. The dense calls eager hands to SDPA without a mask take the kernel SDPA
        would pick, through the op that returns the lse, where that is cuDNN or FlashAttention.
        Taking FlashAttention where SDPA picks cuDNN would not pay: cuDNN with the recomputation
        is faster (docs/kernels.md)."""
        path = self._path(p)
        if path != "sdpa" or p.varlen or p.return_lse:
            return path
        choice = _sdpa_choice(p, q, k, v)
        if choice == SDP_CUDNN and self._cudnn_lse_reason(p._replace(return_lse=True)) is None:
            return "cudnn"
        if choice == SDP_FLASH and flash_native.reason(p, self._kernels(p, q.is_cuda)) is None:
            return "flash"
        return "sdpa"

    def compiled_forward(self, p, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, config=None):
        """(out, lse or None) without autograd; the lse comes whenever the kernel returns one."""
        path = self._saving_path(p, q, k, v)
        if path == "cudnn":
            out, lse = cudnn_lse.attend(p, q, k, v)
            return out.contiguous(), lse
        if path == "flash":
            return flash_native.forward_saving(p, q, k, v, cu_seqlens_q, cu_seqlens_k)
        out, lse, _ = self._forward(p, q, k, v, cu_seqlens_q, cu_seqlens_k)
        return out, lse

    def compiled_backward(self, p, saved, grad_out, config=None):
        """(dq, dk, dv) from ``saved = (q, k, v, cu_q, cu_k, out, lse)``, ``compiled_forward``'s
        out and lse: one kernel backward where that forward's kernel returned the lse, else the
        recomputing ``backward``."""
        q, k, v, cu_q, cu_k, out, lse = saved
        path = self._saving_path(p, q, k, v)
        if path == "cudnn":
            return cudnn_lse.backward(p, q, k, v, out, lse, grad_out)
        if path == "flash":
            return flash_native.backward_saved(p, q, k, v, cu_q, cu_k, out, lse, grad_out)
        return self.backward(p, saved[:5], grad_out, config)

    def run(self, p, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, config=None):
        return self.forward(p, q, k, v, cu_seqlens_q, cu_seqlens_k, config)[0]

    def _varlen(self, p, q, k, v, cu_q, cu_k, kernels):
        seq_q, pos_q = _token_index(cu_q, p.total_q, p.batch, p.seqlen_q)
        seq_k, pos_k = _token_index(cu_k, p.total_k, p.batch, p.seqlen_k)
        qp = q.new_zeros(p.batch, p.seqlen_q, p.heads_q, p.head_dim_qk).index_put((seq_q, pos_q), q)
        kp = k.new_zeros(p.batch, p.seqlen_k, p.heads_kv, p.head_dim_qk).index_put((seq_k, pos_k), k)
        vp = v.new_zeros(p.batch, p.seqlen_k, p.heads_kv, p.head_dim_v).index_put((seq_k, pos_k), v)
        allowed = _varlen_allowed(p, cu_q, cu_k)  # [B, Sq, Sk]
        mask, rows = _guard(allowed)
        plan = _Plan(attn_mask=mask.unsqueeze(1), rows=rows, explicit=True)
        qt, kt = qp.transpose(1, 2), kp.transpose(1, 2)
        out = _sdpa(p, qt, kt, vp.transpose(1, 2), plan, kernels)  # [B, Hq, Sq, Dv]
        out = out.transpose(1, 2)[seq_q, pos_q]
        lse = None
        if p.return_lse:
            lse = _lse(p, qt, kt, allowed).transpose(1, 2)[seq_q, pos_q].t()  # [Hq, Tq]
        return out, lse
