"""RMSNormLinear and SwiGLUMLP: modules whose fp8 GEMM inputs come pre-quantised from the op that
produces them (a fused Triton kernel, registry kernel ``fused_fp8_producers``).

The fused path runs where that kernel module is available (a GPU, or the Triton interpreter) and
a ``fp8_config`` is set with a recipe it serves (TENSORWISE, ROWWISE, 1-D BLOCKWISE); elsewhere
the modules are the unfused pair (plain-torch norm / SwiGLU, then ``modules.Linear``). Both paths
read the same parameters, so the choice never changes a state_dict.

Without fp8 (or with a recipe the producers do not serve), ``SwiGLUMLP``'s ``silu(gate) * up`` is
``ops.swiglu``: still one kernel each way where the kernel module runs.

Training through the fused path (``_ProducedLinear``): ``gemm_fp8`` has no backward for a
pre-quantised operand, so the Function saves what ``gemm_fp8``'s own autograd saves (the
producer's output quantised along M for the wgrad, the weight for the dgrad) and runs that
Function's backward on it, then the producer's backward (``rms_norm_backward``,
``swiglu_backward`` of the kernel module: Triton kernels reading each input once): the GEMM
gradients are those of the unfused step.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Optional

import torch

from ..low_precision import Float8QuantConfig, QuantizedTensor, ScalingGranularity
from ..ops.gemm import gemm_fp8
from ..ops.gemm_autograd import fp8_gemm_backward
from ..ops.gemm_fp8_step import saved_as_quantized, wgrad_operand
from ..ops.gemm_problem import forward_fp8_problem
from ..ops.activation import swiglu
from ..registry import kernel_module
from .linear import Linear

__all__ = ["RMSNormLinear", "SwiGLUMLP"]

#: The registry name of the kernel module with ``rms_norm_quantize`` and ``swiglu_quantize``.
KERNEL = "fused_fp8_producers"
_FUSED_GRANULARITIES = (ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE, ScalingGranularity.BLOCKWISE)
_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=None)
def _kernels() -> Optional[ModuleType]:
    """The fused-producer kernel module when it can run here, else None."""
    module, _ = kernel_module(KERNEL)
    if module is None or module.available() is not None:
        return None
    return module


def _fused_kernels(x: torch.Tensor, cfg: Optional[Float8QuantConfig], width: int) -> Optional[ModuleType]:
    """The kernel module when this call may take the fused path (see the module docstring)."""
    if cfg is None or cfg.granularity not in _FUSED_GRANULARITIES or x.dtype not in _FUSED_DTYPES:
        return None
    module = _kernels()
    if module is None or width > module.MAX_ROW or not module.serves(x):
        return None
    return module


def _recipe(cfg: Float8QuantConfig) -> tuple[torch.dtype, ScalingGranularity, Optional[int]]:
    return cfg.format.fwd_dtype(), cfg.granularity, cfg.block_size


_RMS_NORM, _SWIGLU = "rms_norm", "swiglu"


def _produce(kernels: ModuleType, op: str, a: torch.Tensor, b: torch.Tensor, eps: float, cfg: Float8QuantConfig,
             return_out: bool) -> tuple[QuantizedTensor, Optional[torch.Tensor]]:
    if op == _RMS_NORM:
        return kernels.rms_norm_quantize(a, b, eps, *_recipe(cfg), return_out=return_out)
    return kernels.swiglu_quantize(a, b, *_recipe(cfg), return_out=return_out)


class _ProducedLinear(torch.autograd.Function):
    """``apply(kernels, op, a, b, eps, weight, cfg)``: ``producer(a, b) @ weight.T`` in fp8, with
    the producer writing the GEMM's quantised input (see the module docstring for the backward).
    ``a``, ``b`` are 2-D: (x, norm weight) for ``_RMS_NORM``, (gate, up) for ``_SWIGLU``."""

    @staticmethod
    def forward(ctx, kernels, op, a, b, eps, weight, cfg):
        # The producer's high-precision output is written only for the wgrad's operand: without
        # it the kernels move fewer bytes (TENSORWISE recomputes the op rather than re-read it).
        need_w = ctx.needs_input_grad[5]
        q, out = _produce(kernels, op, a, b, eps, cfg, return_out=need_w)
        y = gemm_fp8(q, weight, trans_b=True, out_dtype=a.dtype, config=cfg)
        qa = wgrad_operand(out, False, cfg) if need_w else None
        ctx.save_for_backward(a, b, weight, None if qa is None else qa.data, None if qa is None else qa.scale)
        ctx.gemm = forward_fp8_problem(a, weight, False, True, a.dtype, cfg)  # a has out's shape and dtype
        ctx.op, ctx.eps, ctx.cfg, ctx.kernels = op, eps, cfg, kernels
        return y

    @staticmethod
    def backward(ctx, grad):
        a, b, weight, qa_data, qa_scale = ctx.saved_tensors
        need_w = ctx.needs_input_grad[5]
        qa = None if qa_data is None else saved_as_quantized(qa_data, qa_scale, ctx.cfg)
        grad_out, grad_w = fp8_gemm_backward(ctx.gemm, ctx.cfg, qa, weight, grad.contiguous(), True, need_w)
        if ctx.op == _RMS_NORM:
            grad_a, grad_b = ctx.kernels.rms_norm_backward(a, b, ctx.eps, grad_out)
        else:
            grad_a, grad_b = ctx.kernels.swiglu_backward(a, b, grad_out)
        return None, None, grad_a, grad_b, None, grad_w, None


def _produced_linear(kernels: ModuleType, op: str, a: torch.Tensor, b: torch.Tensor, eps: float,
                     linear: Linear) -> torch.Tensor:
    """``linear(producer(a, b))`` for ``a``, ``b`` of any leading shape, through ``_ProducedLinear``."""
    lead = a.shape[:-1]
    a2 = a.reshape(-1, a.shape[-1])
    b2 = b.contiguous() if op == _RMS_NORM else b.reshape(-1, b.shape[-1])
    out = _ProducedLinear.apply(kernels, op, a2, b2, eps, linear.weight, linear.fp8_config)
    if linear.bias is not None:
        out = out + linear.bias
    return out.reshape(*lead, linear.out_features)


class RMSNormLinear(torch.nn.Module):
    """``Linear(RMSNorm(x))`` with the norm writing the GEMM's fp8 input directly.

    Parameters and state_dict keys are those of the unfused pair held as ``norm``
    (``torch.nn.RMSNorm(hidden, eps)``) and ``linear`` (``modules.Linear(hidden, out, bias)``):
    ``norm.weight``, ``linear.weight`` and, with ``bias``, ``linear.bias``; so a checkpoint of
    the pair loads here and back. The norm runs in float32 and rounds to x's dtype.

    >>> layer = RMSNormLinear(64, 32)
    >>> sorted(layer.state_dict()), layer(torch.randn(3, 64)).shape
    (['linear.weight', 'norm.weight'], torch.Size([3, 32]))
    """

    def __init__(self, hidden: int, out: int, eps: float = 1e-6, bias: bool = False,
                 fp8_config: Optional[Float8QuantConfig] = None, device=None, dtype=None) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, eps=eps, device=device, dtype=dtype)
        self.linear = Linear(hidden, out, bias=bias, device=device, dtype=dtype, fp8_config=fp8_config)

    @property
    def fp8_config(self) -> Optional[Float8QuantConfig]:
        return self.linear.fp8_config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = _fused_kernels(x, self.fp8_config, x.shape[-1])
        if kernels is None:
            return self.linear(self.norm(x))
        return _produced_linear(kernels, _RMS_NORM, x, self.norm.weight, self.norm.eps, self.linear)


class SwiGLUMLP(torch.nn.Module):
    """The Llama MLP ``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the SwiGLU writing the
    down projection's fp8 input directly (without fp8: one SwiGLU kernel each way).

    Parameters and state_dict keys are those of three bias-free ``modules.Linear`` named
    ``gate_proj`` / ``up_proj`` ([ffn, hidden]) and ``down_proj`` ([hidden, ffn]), the
    Hugging Face Llama names, so such an MLP's checkpoint loads as is.

    >>> mlp = SwiGLUMLP(32, 48)
    >>> sorted(mlp.state_dict()), mlp(torch.randn(5, 32)).shape
    (['down_proj.weight', 'gate_proj.weight', 'up_proj.weight'], torch.Size([5, 32]))
    """

    def __init__(self, hidden: int, ffn: int, fp8_config: Optional[Float8QuantConfig] = None, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, ffn, bias=False, device=device, dtype=dtype, fp8_config=fp8_config)
        self.up_proj = Linear(hidden, ffn, bias=False, device=device, dtype=dtype, fp8_config=fp8_config)
        self.down_proj = Linear(ffn, hidden, bias=False, device=device, dtype=dtype, fp8_config=fp8_config)

    @property
    def fp8_config(self) -> Optional[Float8QuantConfig]:
        return self.down_proj.fp8_config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        kernels = _fused_kernels(x, self.fp8_config, gate.shape[-1])
        if kernels is not None:
            return _produced_linear(kernels, _SWIGLU, gate, up, 0.0, self.down_proj)
        return self.down_proj(swiglu(gate, up))
