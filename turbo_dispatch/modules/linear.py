"""Linear: a drop-in for torch.nn.Linear whose matmul goes through turbo_dispatch."""
from __future__ import annotations

from typing import Optional

import torch

from ..low_precision import Float8QuantConfig
from ..ops.gemm import gemm, gemm_fp8


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` with its GEMM dispatched (bf16/fp16/fp32, or fp8 with ``fp8_config``).

    Same constructor, parameters and state_dict as nn.Linear, so checkpoints move both ways.

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> layer = turbo.modules.Linear(32, 16)
        >>> layer(torch.randn(4, 32)).shape
        torch.Size([4, 16])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 fp8_config: Optional[Float8QuantConfig] = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if fp8_config is not None and not isinstance(fp8_config, Float8QuantConfig):
            raise TypeError(f"Linear: fp8_config must be a Float8QuantConfig or None; got {type(fp8_config).__name__}")
        self.fp8_config = fp8_config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if self.fp8_config is None:
            out = gemm(flat, self.weight, trans_b=True)
        else:
            out = gemm_fp8(flat, self.weight, trans_b=True, config=self.fp8_config)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        fp8 = "" if self.fp8_config is None else f", fp8={self.fp8_config.tag()}"
        return super().extra_repr() + fp8
