"""CUDNN adapter for attention: SDPA with the cuDNN kernel forced.

``torch.nn.functional.scaled_dot_product_attention`` runs under
``sdpa_kernel([SDPBackend.CUDNN_ATTENTION])``, so it either runs cuDNN's fused attention or raises;
it never falls back to another kernel silently. In eager mode the backward is SDPA's cuDNN
backward node recorded by that forward; the compiled path's recomputing backward forces the same
kernel again.

``supports()`` is deliberately conservative: it refuses every case we have not seen cuDNN SDPA
(through torch 2.11, cuDNN 9, sm_90) serve correctly, each with its reason:

* platform other than CUDA (no ROCm build of cuDNN SDPA);
* dtype other than bf16/fp16;
* head dim above 128, or not a multiple of 8; a v head dim different from q/k's (MLA 192/128);
* GQA/MQA (Hkv != Hq) on torch releases before 2.11: not every release routes enable_gqa to cuDNN,
  and 2.11 is the first the GPU grid checked;
* sliding windows, and causal masks with Sq != Sk (SDPA's is_causal is top-left aligned, the
  API promises bottom-right);
* dropout, varlen (no packed layout through SDPA), deterministic=True (cuDNN's backward is not promised deterministic).
* attention sinks and fp8 (``sdpa_feature_refusal``: SDPA has neither).

``return_lse=True`` goes to the kernel's aten op (``backends/torch/cudnn_lse.py``,
``aten._scaled_dot_product_cudnn_attention`` with ``compute_log_sumexp``), which returns the lse
that the public SDPA call drops.

``sdpa_kernel`` toggles process-wide flags for the duration of the call, so a thread running SDPA
elsewhere at the same moment sees them too (a PyTorch limitation).

The forced cuDNN kernel also *runs* Dv != Dqk, head dims 40 and 256, dropout and boolean masks
(H200, torch 2.11, cuDNN 9.19); running is not being right, and other cuDNN versions differ, so
those stay refused until the GPU grid checks them. GQA/MQA is checked (``GQA_FROM_TORCH``).

The GPU tests (tests/test_attention.py, marker ``gpu``) run every case of their grid that
``supports()`` accepts against the float64 reference, forward and backward, so widening these
limits means adding the new cases to that grid first.
"""
from __future__ import annotations

import functools

import torch

from turbo_dispatch.backends.torch import cudnn_lse
from turbo_dispatch.backends.torch.attention import TorchAttention, sdpa_feature_refusal

MAX_HEAD_DIM = 128
#: The torch release from which SDPA hands GQA/MQA calls to cuDNN unexpanded and the GPU grid
#: (tests/test_attention.py) checks them, forward, backward and lse (H100, cuDNN 9.19).
GQA_FROM_TORCH = "2.11"


def _gqa_verified() -> bool:
    return torch.torch_version.TorchVersion(torch.__version__) >= GQA_FROM_TORCH


@functools.lru_cache(maxsize=None)
def _unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if getattr(torch.version, "hip", None):
        return "this is a ROCm build of torch; cuDNN SDPA is NVIDIA-only"
    if not torch.backends.cudnn.is_available():
        return "this torch build has no cuDNN (torch.backends.cudnn.is_available() is False)"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401  (presence check)
    except ImportError:
        return "this torch has no torch.nn.attention.sdpa_kernel (needs torch >= 2.3)"
    if not hasattr(SDPBackend, "CUDNN_ATTENTION"):
        return "this torch has no SDPBackend.CUDNN_ATTENTION"
    version = torch.backends.cudnn.version() or 0
    if version < 90000:
        return f"cuDNN {version} is too old for fused attention through SDPA (need 9.0+)"
    major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
    if major < 8:
        return f"cuDNN SDPA needs sm_80 or newer; this GPU is sm_{major}{minor}"
    return None


class CudnnAttention(TorchAttention):
    """SDPA forced onto cuDNN's fused attention kernel."""

    library = "cudnn"
    native_autograd = True

    def available(self) -> str | None:
        return _unavailable()

    def version(self) -> str:
        return f"{torch.backends.cudnn.version()}/torch-{torch.__version__}"

    def supports(self, p) -> str | None:
        reason = sdpa_feature_refusal(p)
        if reason is not None:
            return reason
        if p.platform != "cuda":
            return f"cuDNN SDPA runs on NVIDIA GPUs only (platform is {p.platform})"
        if p.dtype not in (torch.bfloat16, torch.float16):
            return f"cuDNN SDPA takes bf16/fp16 only (dtype is {p.dtype})"
        if p.head_dim_v != p.head_dim_qk:
            return f"v head dim {p.head_dim_v} differs from q/k head dim {p.head_dim_qk} (not enabled for cuDNN)"
        if p.head_dim_qk > MAX_HEAD_DIM or p.head_dim_qk % 8:
            return f"head dim {p.head_dim_qk}: cuDNN SDPA is enabled for multiples of 8 up to {MAX_HEAD_DIM}"
        if p.heads_kv != p.heads_q and not _gqa_verified():
            return (f"GQA/MQA (heads_q={p.heads_q}, heads_kv={p.heads_kv}) is enabled for cuDNN from torch "
                    f"{GQA_FROM_TORCH} (the first release the GPU grid checked it on); "
                    f"this is torch {torch.__version__}")
        if p.varlen:
            return "varlen (packed THD) inputs are not supported through SDPA's cuDNN kernel"
        if p.window_left >= 0 or p.window_right > 0:
            return f"sliding window ({p.window_left}, {p.window_right}) is not supported by SDPA's cuDNN kernel"
        if p.causal and p.seqlen_q != p.seqlen_k:
            return (f"causal with seqlen_q={p.seqlen_q} != seqlen_k={p.seqlen_k} needs a bottom-right mask; "
                    "SDPA's cuDNN kernel is top-left aligned")
        if p.dropout_p > 0:
            return "dropout is not enabled for cuDNN"
        if p.deterministic:
            return "deterministic=True: cuDNN's attention backward is not promised deterministic"
        return None

    def _kernels(self, p, device_is_cuda: bool):
        from torch.nn.attention import SDPBackend

        return [SDPBackend.CUDNN_ATTENTION]

    def _cudnn_lse_reason(self, p) -> str | None:
        return None if p.return_lse else "no lse asked for"

    def _flash_refusal(self, p) -> str:
        return "this backend runs cuDNN's kernel only"

    def _saving_path(self, p, q, k, v) -> str:
        return "cudnn"  # supports() admitted the call, and the kernel op returns the lse

    def describe(self, p) -> str:
        if p.return_lse:
            return cudnn_lse.describe(p)
        return "SDPA under sdpa_kernel([CUDNN_ATTENTION]), " + ("is_causal" if p.causal else "no mask")
