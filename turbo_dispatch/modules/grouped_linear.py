"""GroupedLinear: G expert weights applied to their own token groups (an MoE expert layer)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..low_precision import Float8QuantConfig
from ..ops.grouped_gemm import grouped_gemm, grouped_gemm_fp8


class GroupedLinear(torch.nn.Module):
    """G bias-free linear layers, one per token group: ``out[s_i:e_i] = x[s_i:e_i] @ weight[i].T``.

    ``weight`` is [num_groups, out_features, in_features] (each slice laid out like
    nn.Linear.weight, i.e. the ``trans_b=True`` convention of grouped_gemm) and is initialised
    per group as nn.Linear initialises its weight. ``forward(x, group_lens, group_offs=None)``
    takes ``x`` [M_total, in_features], its rows grouped by expert, and int64 ``group_lens`` [G]
    on x's device summing to M_total (zeros allowed). With ``fp8_config`` the GEMMs run in fp8
    (grouped_gemm_fp8); otherwise in the weight's dtype.

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> layer = turbo.modules.GroupedLinear(3, 16, 8)
        >>> layer(torch.randn(10, 16), torch.tensor([4, 0, 6])).shape
        torch.Size([10, 8])
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, device=None, dtype=None,
                 fp8_config: Optional[Float8QuantConfig] = None) -> None:
        super().__init__()
        for name, value in (("num_groups", num_groups), ("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GroupedLinear: {name} must be a positive int; got {value!r}")
        if fp8_config is not None and not isinstance(fp8_config, Float8QuantConfig):
            raise TypeError(
                f"GroupedLinear: fp8_config must be a Float8QuantConfig or None; got {type(fp8_config).__name__}")
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.fp8_config = fp8_config
        self.weight = torch.nn.Parameter(torch.empty((num_groups, out_features, in_features), device=device,
                                                     dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's kaiming_uniform_(a=sqrt(5)) is U(-1/sqrt(in), 1/sqrt(in)); per group here.
        bound = 1.0 / math.sqrt(self.in_features)
        torch.nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, group_lens: torch.Tensor,
                group_offs: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.fp8_config is None:
            return grouped_gemm(x, self.weight, group_lens, group_offs, trans_b=True)
        return grouped_gemm_fp8(x, self.weight, group_lens, group_offs, trans_b=True, config=self.fp8_config)

    def extra_repr(self) -> str:
        fp8 = "" if self.fp8_config is None else f", fp8={self.fp8_config.tag()}"
        return f"num_groups={self.num_groups}, in_features={self.in_features}, out_features={self.out_features}{fp8}"
