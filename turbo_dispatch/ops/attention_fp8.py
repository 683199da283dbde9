"""flash_attn_fp8_func: attention with q, k, v quantised to float8 e4m3, and its quantisers.

Scaling (Primus-Turbo's recipe): BLOCKWISE (the default, 64) gives one float32 scale per
``block_size`` consecutive tokens of one (batch, head) over the whole head dim; TENSORWISE one
scale per tensor. A scale is ``amax / 448`` (448 is e4m3's largest value; an all-zero block gets
1), so every quantised element lies in [-448, 448].

The quantisers (``quantize_tokens`` / ``dequantize_tokens``) are torch ops that backends serving
``"fp8"`` call on the high-precision q, k, v they receive; the op layer only carries the recipe in
the problem key (``fp8``, ``fp8_block``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..low_precision import FP8_MAX, Float8QuantConfig
from ..low_precision.config import Format, ScalingGranularity
from .attention import dense_attention

#: BLOCKWISE block size when no config is given (Primus-Turbo's default and only size).
DEFAULT_BLOCK = 64
FP8_DTYPE = torch.float8_e4m3fn


def fp8_block_of(op: str, fp8_config: Optional[Float8QuantConfig]) -> int:
    """The problem's ``fp8_block`` for a config: its BLOCKWISE ``block_size``, 0 for TENSORWISE;
    raises naming what this op does not serve (E5M2, ROWWISE, MX_BLOCKWISE)."""
    if fp8_config is None:
        return DEFAULT_BLOCK
    if not isinstance(fp8_config, Float8QuantConfig):
        raise TypeError(f"{op}: fp8_config must be a Float8QuantConfig or None; got {type(fp8_config).__name__}")
    if fp8_config.format is Format.E5M2:
        raise ValueError(f"{op}: q, k and v are quantised to e4m3 (Format.E4M3, or HYBRID whose forward format it "
                         "is); Format.E5M2 is not served")
    if fp8_config.granularity is ScalingGranularity.BLOCKWISE:
        return int(fp8_config.block_size)
    if fp8_config.granularity is ScalingGranularity.TENSORWISE:
        return 0
    raise ValueError(f"{op}: fp8_config.granularity must be BLOCKWISE (blocks of tokens of one head) or TENSORWISE; "
                     f"got {fp8_config.granularity.name}")


def _token_scales(descale: torch.Tensor, seqlen: int, block: int) -> torch.Tensor:
    """Per-token scales ``[B, S, H, 1]`` from block scales ``[B, H, blocks]`` (or the tensor's
    scale, broadcastable, for block 0)."""
    if block == 0:
        return descale.reshape(())
    return descale.repeat_interleave(block, dim=2)[:, :, :seqlen].transpose(1, 2)[..., None]


def quantize_tokens(x: torch.Tensor, block: int, token_contiguous: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, descale)`` of a dense ``[B, S, H, D]`` tensor: e4m3 ``data`` of x's shape and the
    float32 dequantisation scales ``[B, H, cdiv(S, block)]`` (block > 0) or a ``[B, H, 1]`` view
    of one scale (block 0, zero strides), so that ``x ~ data * descale`` per token block.

    ``token_contiguous`` lays ``data`` out with the tokens innermost (a ``[B, H, D, S]`` buffer
    seen as ``[B, S, H, D]``): the layout an fp8 matrix product wants for an operand whose
    reduction runs over tokens (v in P @ V).
    """
    b, s, h, _ = x.shape
    fmax = FP8_MAX[FP8_DTYPE]
    if block == 0:
        amax = x.abs().amax().float().reshape(1, 1, 1)
    else:
        blocks = -(-s // block)
        padded = F.pad(x, (0, 0, 0, 0, 0, blocks * block - s))
        amax = padded.abs().reshape(b, blocks, block, h, -1).amax(dim=(2, 4)).float().transpose(1, 2)
    descale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    scaled = (x.float() / _token_scales(descale, s, block)).clamp_(-fmax, fmax)
    if token_contiguous:
        data = torch.empty((b, h, x.shape[3], s), device=x.device, dtype=FP8_DTYPE).permute(0, 3, 1, 2)
        data.copy_(scaled)
    else:
        data = scaled.to(FP8_DTYPE)
    return data, (descale.expand(b, h, 1) if block == 0 else descale.contiguous())


def dequantize_tokens(data: torch.Tensor, descale: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """``quantize_tokens``'s inverse up to rounding: ``data * descale`` in ``dtype``, contiguous."""
    values = data.float() * _token_scales(descale[:1, :1] if block == 0 else descale, data.shape[1], block)
    return values.to(dtype, memory_format=torch.contiguous_format)


def flash_attn_fp8_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                        softmax_scale: Optional[float] = None, causal: bool = False,
                        window_size: tuple[int, int] = (-1, -1), deterministic: bool = False,
                        return_lse: bool = False, *, fp8_config: Optional[Float8QuantConfig] = None,
                        sink: Optional[torch.Tensor] = None):
    """flash_attn_func with q, k, v quantised to float8 e4m3 for the forward's two products.

    Takes and returns what ``flash_attn_func`` does (dense ``[B, S, H, D]`` bf16/fp16 q, k, v;
    ``out`` in q's dtype; the lse with ``return_lse``; ``sink``), plus ``fp8_config``:
    BLOCKWISE (default ``block_size`` 64: one scale per 64 tokens of one head) or TENSORWISE,
    format E4M3 or HYBRID.

    Contract:

    * forward: q, k, v are quantised (``quantize_tokens``); ``QK^T`` runs on the fp8 operands with
      fp32 accumulation and is dequantised by the q and k scales; the softmax probabilities are
      quantised to e4m3 with the fixed scale 448 (they lie in [0, 1]) and ``PV`` runs in fp8,
      dequantised by the v scale. The lse is that of the dequantised scores;
    * backward: in q's dtype, by the high-precision kernels, from the *dequantised* q, k, v and the
      fp8 forward's out and lse (nothing is recomputed), so the gradients are those of attention
      on the dequantised inputs, carrying the forward's fp8 rounding through out and lse. They
      flow to q, k, v (straight through the quantisation) and to ``sink``;
    * served by the TRITON backend on NVIDIA GPUs with fp8 tensor cores (sm_89 and newer); other
      backends refuse it with their reason. Dropout is refused.

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> from turbo_dispatch.low_precision import Float8QuantConfig
        >>> cfg = Float8QuantConfig(granularity="blockwise", block_size=64)
        >>> q = torch.randn(1, 128, 4, 64, dtype=torch.bfloat16)
        >>> turbo.ops.flash_attn_fp8_func(q, q, q, causal=True, fp8_config=cfg)  # doctest: +SKIP
    """
    op = "flash_attn_fp8_func"
    return dense_attention(op, q, k, v, dropout_p, softmax_scale, causal, window_size, deterministic, return_lse,
                           sink, fp8_block_of(op, fp8_config))
