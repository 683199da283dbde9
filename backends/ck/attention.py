"""CK adapter for attention: SDPA's flash kernel with torch's ROCm flash-attention library set to CK.

On ROCm builds torch's FlashAttention (the SDPA flash backend) runs AOTriton by default and
Composable Kernel's fmha when ``torch.backends.cuda.preferred_rocm_fa_library("ck")`` is set.
This adapter runs ``scaled_dot_product_attention`` under ``sdpa_kernel([FLASH_ATTENTION])`` (the
flash kernel or an error, never a silent fallback) with that preference switched to CK for the
call and restored afterwards, under the lock every preference switch here shares
(``blaslt.gemm.run_switched``; the preference is process-global).

Backward: not ``native_autograd``. torch reads the preference again when the backward runs, which
is outside the forward's switch, so an autograd graph recorded by the forward could run AOTriton's
backward on CK's forward. Instead ``backward`` re-runs the forward under the switch and
differentiates it there (one recomputed forward per backward).

Conservative, like the CUDNN adapter: refuses everything not known to reach the flash kernel
through SDPA: fp32, head dims above 256 or not multiples of 8, Dv != Dqk, GQA/MQA, sliding
windows, causal with Sq != Sk (SDPA's is_causal is top-left aligned), varlen, dropout (the
recomputing backward would draw another mask) and deterministic=True. ``return_lse`` takes the
TORCH adapter's separate float32 lse pass. Not run on AMD hardware (docs/rocm.md).
"""
from __future__ import annotations

import functools

import torch

from ..blaslt import rocm
from ..blaslt.gemm import run_switched
from ..torch.attention import TorchAttention

MAX_HEAD_DIM = 256


def _fa_switch():
    """(get, set, _ROCmFABackend) of torch's ROCm flash-attention library preference, or None."""
    get = getattr(torch._C, "_get_rocm_fa_preferred_backend", None)
    put = getattr(torch._C, "_set_rocm_fa_preferred_backend", None)
    kind = getattr(torch._C, "_ROCmFABackend", None)
    if get is None or put is None or kind is None or not hasattr(kind, "Ck"):
        return None
    return get, put, kind


def with_ck_flash(fn):
    """Runs ``fn()`` with torch's ROCm flash-attention library set to CK, restored afterwards."""
    get, put, kind = _fa_switch()
    return run_switched(get, put, kind.Ck, fn)


@functools.lru_cache(maxsize=None)
def _unavailable() -> str | None:
    reason = rocm.rocm_unavailable()
    if reason is not None:
        return reason
    if _fa_switch() is None:
        return f"this torch ({torch.__version__}) has no CK member in preferred_rocm_fa_library"
    ck_sdpa = getattr(torch.backends.cuda, "is_ck_sdpa_available", None)
    if ck_sdpa is not None and not ck_sdpa():
        return "this torch build has no CK attention (torch.backends.cuda.is_ck_sdpa_available() is False)"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401  (presence check)
    except ImportError:
        return "this torch has no torch.nn.attention.sdpa_kernel (needs torch >= 2.3)"
    return None


class CkAttention(TorchAttention):
    """SDPA forced onto the flash kernel, with CK as torch's ROCm flash-attention library."""

    library = "ck"
    native_autograd = False

    def available(self) -> str | None:
        return _unavailable()

    def version(self) -> str:
        return f"hip-{torch.version.hip or 'none'}/torch-{torch.__version__}"

    def supports(self, p) -> str | None:
        if p.platform != "rocm":
            return f"CK attention runs on AMD GPUs under ROCm (platform is {p.platform})"
        reason = rocm.arch_reason("CK's flash attention through SDPA")
        if reason is not None:
            return reason
        if p.dtype not in (torch.bfloat16, torch.float16):
            return f"CK flash attention takes bf16/fp16 (dtype is {p.dtype})"
        if p.head_dim_v != p.head_dim_qk or p.head_dim_qk % 8 or p.head_dim_qk > MAX_HEAD_DIM:
            return (f"head dims q/k {p.head_dim_qk}, v {p.head_dim_v}: enabled for equal head dims, multiples of 8 "
                    f"up to {MAX_HEAD_DIM}")
        if p.heads_kv != p.heads_q:
            return f"GQA/MQA (heads_q={p.heads_q}, heads_kv={p.heads_kv}) is not enabled through SDPA's ROCm flash path"
        if p.varlen:
            return "varlen (packed THD) inputs do not go through SDPA's flash kernel"
        if p.window_left >= 0 or p.window_right > 0:
            return f"sliding window ({p.window_left}, {p.window_right}) is not supported by SDPA's flash kernel"
        if p.causal and p.seqlen_q != p.seqlen_k:
            return (f"causal with seqlen_q={p.seqlen_q} != seqlen_k={p.seqlen_k} needs a bottom-right mask; "
                    "SDPA's is_causal is top-left aligned")
        if p.dropout_p > 0:
            return "dropout: the recomputing backward would draw a different mask"
        if p.deterministic:
            return "deterministic=True: CK's flash backward is not promised deterministic"
        return None

    def _kernels(self, p, device_is_cuda: bool):
        from torch.nn.attention import SDPBackend

        return [SDPBackend.FLASH_ATTENTION]

    def _cudnn_lse_reason(self, p) -> str | None:
        return "the CK backend runs SDPA's flash kernel only"

    def _flash_refusal(self, p) -> str:
        return "the CK backend runs SDPA's flash kernel only"

    def _saving_path(self, p, q, k, v) -> str:
        return "sdpa"

    def describe(self, p) -> str:
        lse = "; lse by a separate float32 pass" if p.return_lse else ""
        mask = "is_causal" if p.causal else "no mask"
        return f"SDPA under sdpa_kernel([FLASH_ATTENTION]) with preferred_rocm_fa_library('ck'), {mask}{lse}"

    def forward(self, p, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, config=None):
        return with_ck_flash(lambda: super(CkAttention, self).forward(p, q, k, v, cu_seqlens_q, cu_seqlens_k, config))

    def backward(self, p, saved, grad_out, config=None):
        return with_ck_flash(lambda: super(CkAttention, self).backward(p, saved, grad_out, config))

    def compiled_forward(self, p, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, config=None):
        return with_ck_flash(
            lambda: super(CkAttention, self).compiled_forward(p, q, k, v, cu_seqlens_q, cu_seqlens_k, config))

    def compiled_backward(self, p, saved, grad_out, config=None):
        return with_ck_flash(lambda: super(CkAttention, self).compiled_backward(p, saved, grad_out, config))
