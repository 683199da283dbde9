"""Code written for Primus-Turbo's documented PyTorch API, run on turbo_dispatch.

Each test is a call site as a Primus-Turbo user writes it (names, argument order, keywords and the
documented semantics), with the imports aliased through our own modules, shown beside each import.
Where we deliberately differ, the test pins our behaviour and docs/primus-compat.md gives the
reason. The numbers are checked against float64 references.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import turbo_dispatch as turbo  # import primus_turbo.pytorch as turbo
# from primus_turbo.pytorch.core.backend import BackendChoice, BackendType, GlobalBackendManager, PrecisionType
from turbo_dispatch import BackendType, GlobalBackendManager, PrecisionType
from turbo_dispatch.backend_type import BackendChoice
# from primus_turbo.pytorch.core.low_precision import (Float8QuantConfig, Format, ScaleDtype, ScalingGranularity,
#                                                      ScalingRecipe, float8_e4m3, float8_e5m2)
from turbo_dispatch.low_precision import (Float8QuantConfig, Format, ScaleDtype, ScalingGranularity, ScalingRecipe,
                                          float8_e4m3, float8_e5m2)
# from primus_turbo.pytorch.core.quantized_tensor import QuantizedTensor
from turbo_dispatch.low_precision import QuantizedTensor
# from primus_turbo.pytorch.ops import quantize_fp8, dequantize_fp8
from turbo_dispatch.low_precision import dequantize_fp8, quantize_fp8


def _snr(out, ref) -> float:
    ref = ref.double().cpu()
    err = (out.double().cpu() - ref).norm() ** 2
    return (10 * torch.log10(ref.norm() ** 2 / err.clamp_min(1e-300))).item()


def _grouped_ref(a, b, group_lens, trans_b):
    a64, b64 = a.double().cpu(), b.double().cpu()
    outs, start = [], 0
    for i, n in enumerate(group_lens.tolist()):
        outs.append(a64[start:start + n] @ (b64[i].t() if trans_b else b64[i]))
        start += n
    width = b.shape[1] if trans_b else b.shape[2]
    return torch.cat(outs + [a64.new_zeros((a.shape[0] - start, width))])


# -- 1. operators ---------------------------------------------------------------------------------------
def test_gemm(device):
    dtype = torch.bfloat16
    M, N, K = 128, 256, 512
    a = torch.randn((M, K), dtype=dtype, device=device)
    b = torch.randn((K, N), dtype=dtype, device=device)
    c = turbo.ops.gemm(a, b, trans_a=False, trans_b=False, out_dtype=dtype)
    assert c.shape == (M, N) and _snr(c, a.double().cpu() @ b.double().cpu()) > 40


def test_grouped_gemm(device):
    dtype = torch.bfloat16
    G, M, N, K = 4, 128, 256, 512
    group_lens = torch.tensor([32, 16, 48, 32], dtype=torch.long, device=device)
    a = torch.randn(M, K, device=device, dtype=dtype)
    b = torch.randn(G, K, N, device=device, dtype=dtype)
    c = turbo.ops.grouped_gemm(a, b, group_lens, trans_b=False)
    assert c.shape == (128, 256) and _snr(c, _grouped_ref(a, b, group_lens, False)) > 40


def test_grouped_gemm_padded_buffer(device):
    """M_total > sum(group_lens): the rows past the groups come back zero, with zero gradients."""
    group_lens = torch.tensor([32, 0, 48], dtype=torch.long, device=device)
    a = torch.randn(100, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(3, 32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = turbo.ops.grouped_gemm(a, b, group_lens, trans_b=True)
    out.backward(torch.randn_like(out))
    assert not out[80:].any() and not a.grad[80:].any()
    assert _snr(out, _grouped_ref(a.detach(), b.detach(), group_lens, True)) > 40


def test_grouped_gemm_num_cu_and_schedule(device):
    group_lens = torch.tensor([40, 24], dtype=torch.long, device=device)
    a = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
    b = torch.randn(2, 128, 64, device=device, dtype=torch.bfloat16)
    out = turbo.ops.grouped_gemm(a, b, group_lens, None, False, 8, "static")
    assert torch.equal(out, turbo.ops.grouped_gemm(a, b, group_lens))
    with pytest.raises(ValueError, match="schedule"):
        turbo.ops.grouped_gemm(a, b, group_lens, schedule="work_steal")


# -- 2. modules ----------------------------------------------------------------------------------------
def test_linear_module_compiled(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    in_features, out_features, bias = 512, 256, True
    input = torch.randn(128, in_features, device=device, dtype=dtype)
    model = turbo.modules.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
    ref = torch.nn.functional.linear(input.double(), model.weight.double(), model.bias.double())
    model = torch.compile(model, fullgraph=True)
    output = model(input)
    assert output.shape == (128, 256) and _snr(output, ref) > 40


# -- 3. low precision ------------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity, block_size", [(ScalingGranularity.TENSORWISE, None),
                                                     (ScalingGranularity.ROWWISE, None),
                                                     (ScalingGranularity.BLOCKWISE, 128)])
def test_gemm_fp8(device, granularity, block_size):
    dtype = torch.bfloat16
    M, N, K = 128, 256, 512
    a = torch.randn((M, K), dtype=dtype, device=device)
    b = torch.randn((N, K), dtype=dtype, device=device)
    fp8_cfg = Float8QuantConfig(format=Format.E4M3, granularity=granularity, block_size=block_size)
    c = turbo.ops.gemm_fp8(a, b, trans_a=False, trans_b=True, out_dtype=dtype, config=fp8_cfg)
    assert c.shape == (128, 256) and _snr(c, a.double().cpu() @ b.double().cpu().t()) > 25


def test_gemm_mxfp8_cpu():
    dtype = torch.bfloat16
    a, b = torch.randn((128, 512), dtype=dtype), torch.randn((256, 512), dtype=dtype)
    mxfp8_cfg = Float8QuantConfig(format=Format.E4M3, granularity=ScalingGranularity.MX_BLOCKWISE, block_size=32,
                                  scale_dtype=ScaleDtype.E8M0)
    c = turbo.ops.gemm_fp8(a, b, trans_a=False, trans_b=True, out_dtype=dtype, config=mxfp8_cfg)
    assert c.shape == (128, 256) and _snr(c, a.double() @ b.double().t()) > 25


def test_grouped_gemm_fp8(device):
    dtype = torch.bfloat16
    G, M, N, K = 4, 128, 256, 512
    group_lens = torch.tensor([32, 16, 48, 32], device=device)
    a = torch.randn(M, K, device=device, dtype=dtype)
    b = torch.randn(G, N, K, device=device, dtype=dtype)
    fp8_cfg = Float8QuantConfig(format=Format.E4M3, granularity=ScalingGranularity.TENSORWISE)
    c = turbo.ops.grouped_gemm_fp8(a, b, group_lens, trans_b=True, config=fp8_cfg)
    assert c.shape == (128, 256) and _snr(c, _grouped_ref(a, b, group_lens, True)) > 25


def test_quantized_tensor_quantize(device):
    x = torch.randn(256, 512, dtype=torch.bfloat16, device=device)
    qt = QuantizedTensor.quantize(x, float8_e4m3, ScalingGranularity.ROWWISE, axis=-1)
    assert qt.dtype == torch.bfloat16 and qt.real_dtype == float8_e4m3
    assert qt.shape == torch.Size([256, 512]) and tuple(qt.scale_inv.shape) == (256, 1)
    assert qt.qdata is not None and qt.granularity == ScalingGranularity.ROWWISE and qt.block_size is None
    assert _snr(qt.dequantize(), x) > 25
    mx = QuantizedTensor.quantize(x, float8_e4m3, ScalingGranularity.MX_BLOCKWISE, block_size=32,
                                  scaling_recipe=ScalingRecipe(use_2d_block=False))
    assert tuple(mx.scale_inv.shape) == (256, 512 // 32) and mx.scaling_recipe == ScalingRecipe()


def test_prequantized_operands_in_the_fp8_gemms(device):
    """Forward with pre-quantised operands; we give them no gradient path (docs/primus-compat.md)."""
    dtype = torch.bfloat16
    config = Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, format=Format.E4M3, block_size=128)
    a = torch.randn(128, 256, dtype=dtype, device=device)
    b = torch.randn(256, 256, dtype=dtype, device=device)
    qt_a = QuantizedTensor.quantize(a, float8_e4m3, config.granularity, block_size=config.block_size, axis=-1)
    qt_b = QuantizedTensor.quantize(b, float8_e4m3, config.granularity, block_size=config.block_size, axis=-1,
                                    scaling_recipe=ScalingRecipe(use_2d_block=True))
    with torch.no_grad():
        c = turbo.ops.gemm_fp8(qt_a, qt_b, False, True, dtype, config)
    assert _snr(c, a.double().cpu() @ b.double().cpu().t()) > 25
    group_lens = torch.tensor([100, 28], device=device)
    w = torch.randn(2, 256, 256, dtype=dtype, device=device)
    qt_w = QuantizedTensor.quantize(w, float8_e4m3, config.granularity, block_size=config.block_size, axis=-1,
                                    scaling_recipe=ScalingRecipe(use_2d_block=True))
    qt_a = QuantizedTensor.quantize(a, float8_e4m3, config.granularity, block_size=config.block_size, axis=-1,
                                    group_lens=group_lens)
    out = turbo.ops.grouped_gemm_fp8(qt_a, qt_w, group_lens, trans_b=True, out_dtype=dtype, config=config)
    assert _snr(out, _grouped_ref(a, w, group_lens, True)) > 25


def test_quantize_fp8_functions(device):
    x = torch.randn(128, 256, dtype=torch.bfloat16, device=device)
    data, scale_inv = quantize_fp8(x, float8_e5m2, ScalingGranularity.BLOCKWISE, block_size=128, axis=1)
    back = dequantize_fp8(data, torch.bfloat16, ScalingGranularity.BLOCKWISE, block_size=128, axis=1,
                          scale_inv=scale_inv)
    assert data.dtype == float8_e5m2 and _snr(back, x) > 20
    data, scale_inv = quantize_fp8(x, float8_e4m3, ScalingGranularity.BLOCKWISE, block_size=128,
                                   scaling_recipe=ScalingRecipe(use_2d_block=True))
    assert tuple(scale_inv.shape) == (1, 2)


def test_changing_a_config_field():
    """Configs are frozen here (they key caches): the error says how to derive a changed copy."""
    config = Float8QuantConfig(format=Format.E4M3, granularity=ScalingGranularity.TENSORWISE)
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"config.replace|cfg.replace\(format=...\)"):
        config.format = Format.HYBRID
    config = config.replace(format=Format.HYBRID)
    assert config.format == Format.HYBRID


# -- fuse_bgrad_accum_pattern (Megatron) ------------------------------------------------------------------
@pytest.mark.parametrize("op", ["gemm", "gemm_fp8", "grouped_gemm", "grouped_gemm_fp8"])
def test_fuse_bgrad_accum_megatron(device, op):
    dtype = torch.bfloat16
    group_lens = torch.tensor([48, 16], dtype=torch.long, device=device)
    shape = (2, 128, 256) if op.startswith("grouped") else (128, 256)
    weight = torch.nn.Parameter(torch.randn(shape, dtype=dtype, device=device))
    weight.main_grad = torch.zeros(shape, dtype=torch.float32, device=device)
    weight.grad_added_to_main_grad = False
    x = torch.randn(64, 256, dtype=dtype, device=device, requires_grad=True)
    if op == "gemm":
        out = turbo.ops.gemm(x, weight, False, True, dtype, fuse_bgrad_accum_pattern="megatron")
    elif op == "gemm_fp8":
        out = turbo.ops.gemm_fp8(x, weight, False, True, dtype, Float8QuantConfig(),
                                 fuse_bgrad_accum_pattern="megatron")
    elif op == "grouped_gemm":
        out = turbo.ops.grouped_gemm(x, weight, group_lens, trans_b=True, fuse_bgrad_accum_pattern="megatron")
    else:
        out = turbo.ops.grouped_gemm_fp8(x, weight, group_lens, trans_b=True, fuse_bgrad_accum_pattern="megatron")
    grad = torch.randn_like(out)
    out.backward(grad)
    assert weight.grad_added_to_main_grad is True
    x64, g64 = x.detach().double().cpu(), grad.double().cpu()
    if op.startswith("grouped"):
        ref = torch.stack([g64[:48].t() @ x64[:48], g64[48:].t() @ x64[48:]])
    else:
        ref = g64.t() @ x64
    assert _snr(weight.main_grad, ref) > (25 if op.endswith("fp8") else 40)


# -- 5. backend and autotune -----------------------------------------------------------------------------
def test_backend_selection_in_code(device):
    GlobalBackendManager.set_gemm_backend(BackendType.TORCH)
    a = torch.randn((128, 512), dtype=torch.bfloat16, device=device)
    b = torch.randn((256, 512), dtype=torch.bfloat16, device=device)
    fp8_cfg = Float8QuantConfig(format=Format.E4M3, granularity=ScalingGranularity.TENSORWISE)
    out = turbo.ops.gemm_fp8(a, b, trans_a=False, trans_b=True, out_dtype=torch.bfloat16, config=fp8_cfg)
    assert out.shape == (128, 256)
    assert GlobalBackendManager.get_gemm_backend(PrecisionType.FP8) == BackendChoice(BackendType.TORCH)
    GlobalBackendManager.set_gemm_backend(None)
    assert GlobalBackendManager.get_gemm_backend(PrecisionType.FP8) is None


def test_auto_tune_switches():
    GlobalBackendManager.set_auto_tune(True)
    assert GlobalBackendManager.auto_tune_enabled() is True
    GlobalBackendManager.reset()
    assert GlobalBackendManager.auto_tune_enabled() is False
    GlobalBackendManager.set_gemm_backend(auto_tune=True, precision=PrecisionType.FP8)
    assert GlobalBackendManager.get_gemm_backend(PrecisionType.FP8) == BackendChoice(auto_tune=True)
    assert GlobalBackendManager.get_gemm_backend(PrecisionType.BF16_FP16_FP32) is None


def test_backend_environment_variables(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_AUTO_TUNE", "1")
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "HIPBLASLT")
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", "fp8:autotune,other:ck")
    GlobalBackendManager.reset()  # our settings snapshot the environment (docs/primus-compat.md)
    assert GlobalBackendManager.auto_tune_enabled() is True
    assert GlobalBackendManager.get_gemm_backend(PrecisionType.FP8) == BackendChoice(BackendType.HIPBLASLT)
    assert GlobalBackendManager.get_gemm_backend(PrecisionType.BF16_FP16_FP32) == BackendChoice(BackendType.HIPBLASLT)
    get_grouped = GlobalBackendManager.get_grouped_gemm_backend
    assert get_grouped(PrecisionType.FP8) == BackendChoice(auto_tune=True)
    assert get_grouped(PrecisionType.BF16_FP16_FP32) == BackendChoice(BackendType.CK)
    with pytest.raises(ValueError, match="no FP4 ops"):
        get_grouped(PrecisionType.FP4)
