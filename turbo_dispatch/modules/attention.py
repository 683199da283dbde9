"""TurboAttention: the attention op as an nn.Module (Primus-Turbo's constructor, plus sinks)."""
from __future__ import annotations

from typing import Optional

import torch

from ..low_precision import Float8QuantConfig
from ..ops.attention import flash_attn_func
from ..ops.attention_fp8 import flash_attn_fp8_func, fp8_block_of


class TurboAttention(torch.nn.Module):
    """``flash_attn_func`` (or ``flash_attn_fp8_func`` with ``fp8_config``) over q, k, v in
    ``[B, S, H, D]`` (any strides), with the call's options fixed at construction.

    The constructor takes Primus-Turbo's arguments: ``dropout_p``, ``softmax_scale``, ``causal``,
    ``window_size``, ``deterministic``, ``return_lse`` (forward returns ``(out, lse)``) and
    ``fp8_config``; ``alibi_slopes``, ``return_attn_probs``, ``ulysses_group`` and ``ring_group``
    are accepted at their defaults only (no ALiBi, no probabilities returned, no context
    parallelism here) and refused otherwise, at construction. ``sink_heads=H`` adds a learnable
    attention sink, ``self.sink`` (``[H]`` float32, zeros at first: every row's denominator then
    starts at 1), one logit per query head (GPT-OSS); ``forward(..., sink=t)`` passes a sink
    instead, for a module without one. Sinks and fp8 run on the TRITON backend (GPU).

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> attn = turbo.modules.TurboAttention(causal=True, window_size=(8, 0))
        >>> q, k, v = torch.randn(2, 16, 4, 32), torch.randn(2, 16, 2, 32), torch.randn(2, 16, 2, 32)
        >>> attn(q, k, v).shape
        torch.Size([2, 16, 4, 32])
        >>> turbo.modules.TurboAttention(sink_heads=4).sink.shape
        torch.Size([4])
    """

    def __init__(self, dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), alibi_slopes: Optional[torch.Tensor] = None,
                 deterministic: bool = False, return_lse: bool = False, return_attn_probs: bool = False,
                 fp8_config: Optional[Float8QuantConfig] = None, ulysses_group=None, ring_group=None, *,
                 sink_heads: Optional[int] = None, device=None) -> None:
        super().__init__()
        where = "TurboAttention"
        if alibi_slopes is not None:
            raise ValueError(f"{where}: alibi_slopes is not supported (the attention kernels here have no ALiBi bias)")
        if return_attn_probs:
            raise ValueError(f"{where}: return_attn_probs=True is not supported (no kernel here returns the "
                             "probabilities)")
        if ulysses_group is not None or ring_group is not None:
            raise ValueError(f"{where}: ulysses_group / ring_group (context parallelism) are not supported; "
                             "shard the sequence outside the module")
        if fp8_config is not None:
            fp8_block_of(where, fp8_config)  # refuses what flash_attn_fp8_func would, now rather than at forward
        if sink_heads is not None and (isinstance(sink_heads, bool) or not isinstance(sink_heads, int)
                                       or sink_heads < 1):
            raise ValueError(f"{where}: sink_heads must be a positive int (the number of query heads) or None; "
                             f"got {sink_heads!r}")
        self.dropout_p = dropout_p
        self.softmax_scale = softmax_scale
        self.causal = causal
        self.window_size = window_size
        self.deterministic = deterministic
        self.return_lse = return_lse
        self.fp8_config = fp8_config
        if sink_heads is None:
            self.register_parameter("sink", None)
        else:
            self.sink = torch.nn.Parameter(torch.zeros(sink_heads, device=device, dtype=torch.float32))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor] = None,
                sink: Optional[torch.Tensor] = None):
        """``out [B, Sq, Hq, Dv]`` (and the lse with ``return_lse``) of q ``[B, Sq, Hq, D]``, k
        ``[B, Sk, Hkv, D]``, v ``[B, Sk, Hkv, Dv]``. ``bias`` must be None (Primus-Turbo's slot for
        an additive bias, which no kernel here takes); ``sink`` only where the module has none."""
        if bias is not None:
            raise ValueError("TurboAttention: an attention bias is not supported")
        if sink is not None and self.sink is not None:
            raise ValueError("TurboAttention: this module has its own sink (sink_heads); pass no sink to forward")
        kwargs = dict(dropout_p=self.dropout_p, softmax_scale=self.softmax_scale, causal=self.causal,
                      window_size=self.window_size, deterministic=self.deterministic, return_lse=self.return_lse,
                      sink=sink if sink is not None else self.sink)
        if self.fp8_config is not None:
            return flash_attn_fp8_func(q, k, v, fp8_config=self.fp8_config, **kwargs)
        return flash_attn_func(q, k, v, **kwargs)

    def extra_repr(self) -> str:
        parts = [f"causal={self.causal}", f"window_size={tuple(self.window_size)}"]
        if self.softmax_scale is not None:
            parts.append(f"softmax_scale={self.softmax_scale}")
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p}")
        if self.sink is not None:
            parts.append(f"sink_heads={self.sink.shape[0]}")
        if self.fp8_config is not None:
            parts.append(f"fp8={self.fp8_config.tag()}")
        return ", ".join(parts)
