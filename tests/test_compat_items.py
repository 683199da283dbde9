"""The constructors and names added for code written against Primus-Turbo, in our own terms:
``QuantizedTensor.quantize`` and ``ScalingRecipe`` (against float64 and against ``quantize``),
``quantize_fp8``/``dequantize_fp8``, ``Float8QuantConfig.replace`` and its frozen-field error,
``BackendChoice`` from ``GlobalBackendManager.get_*_backend``, and the ``BF16_FP16_FP32`` / ``FP4``
precision names. Primus-Turbo-style call sites are in tests/test_primus_compat.py.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch import BackendType, ConfigError, GlobalBackendManager, PrecisionType
from turbo_dispatch.backend_type import BackendChoice
from turbo_dispatch.low_precision import (FP8_MAX, Float8QuantConfig, QuantizedTensor, ScalingGranularity,
                                          ScalingRecipe, dequantize, dequantize_fp8, float8_e4m3, float8_e5m2,
                                          quantize, quantize_fp8)


@pytest.fixture(autouse=True)
def _reset():
    GlobalBackendManager.reset()
    yield
    GlobalBackendManager.reset()


def _bound(q: QuantizedTensor, x: torch.Tensor) -> torch.Tensor:
    """Per element, the most fp8 rounding may move it: a relative ulp of the format, or (for values
    in the subnormal range at their group's scale) an absolute step of that scale."""
    mantissa = 3 if q.real_dtype == torch.float8_e4m3fn else 2
    ones = dataclasses.replace(q, data=torch.ones_like(q.data))
    return x.double().abs() * 2.0 ** -mantissa + dequantize(ones, torch.float64) * 2.0 ** -9


CASES = [("tensorwise", None, None, -1), ("rowwise", None, None, -1), ("rowwise", None, None, 0),
         ("blockwise", 32, None, -1), ("blockwise", 32, ScalingRecipe(use_2d_block=True), -1),
         ("mx_blockwise", 32, ScalingRecipe(), -1)]


@pytest.mark.parametrize("gran, block, recipe, axis", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dest", [float8_e4m3, float8_e5m2])
def test_quantize_classmethod_vs_float64(gran, block, recipe, axis, dtype, dest):
    x = (torch.randn(64, 96, dtype=torch.float64) * torch.logspace(-2, 2, 96, dtype=torch.float64)).to(dtype)
    q = QuantizedTensor.quantize(x, dest, ScalingGranularity(gran), axis=axis, block_size=block, scaling_recipe=recipe)
    assert (q.dtype, q.real_dtype, q.shape, q.device) == (dtype, dest, x.shape, x.device)
    assert q.qdata is q.data and q.scale_inv is q.scale and q.quantized_axis == axis % 2
    assert q.scaling_recipe == ScalingRecipe(use_2d_block=recipe is not None and recipe.use_2d_block)
    same = quantize(x, dest, gran, axis=axis, block_size=block, block_2d=q.block_2d)
    assert torch.equal(q.data.view(torch.uint8), same.data.view(torch.uint8)) and torch.equal(q.scale, same.scale)
    back = q.dequantize()
    assert back.dtype == dtype
    err = (q.dequantize(torch.float64) - x.double()).abs()
    assert bool((err <= _bound(q, x)).all()), err.max()
    assert x.double().abs().max() <= FP8_MAX[dest] * q.scale.double().max() * (1 + 2 ** -20)


def test_group_lens_is_checked_and_changes_nothing():
    x = torch.randn(40, 64)
    lens = torch.tensor([10, 0, 30])
    for gran, block in (("tensorwise", None), ("rowwise", None), ("blockwise", 32)):
        for axis in (-1, 0):
            grouped = QuantizedTensor.quantize(x, float8_e4m3, gran, axis=axis, group_lens=lens, block_size=block)
            plain = QuantizedTensor.quantize(x, float8_e4m3, gran, axis=axis, block_size=block)
            assert torch.equal(grouped.scale, plain.scale) and torch.equal(grouped.data.float(), plain.data.float())
    with pytest.raises(ValueError, match="group_lens must be a 1-D integer tensor"):
        QuantizedTensor.quantize(x, float8_e4m3, "rowwise", group_lens=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="group_lens needs a 2-D token-major tensor"):
        QuantizedTensor.quantize(torch.randn(2, 40, 64), float8_e4m3, "rowwise", group_lens=lens)


@pytest.mark.parametrize("flag", ["use_sr", "use_rht", "shuffle_scale", "shuffle_out"])
def test_recipe_flags_without_an_implementation_are_refused(flag):
    with pytest.raises(ValueError, match=f"ScalingRecipe\\({flag}=True\\) is not supported"):
        quantize(torch.randn(4, 64), float8_e4m3, "mx_blockwise", scaling_recipe=ScalingRecipe(**{flag: True}))
    with pytest.raises(TypeError, match="scaling_recipe must be a ScalingRecipe"):
        quantize(torch.randn(4, 64), float8_e4m3, "tensorwise", scaling_recipe=(True,))
    with pytest.raises(ValueError, match="block_2d=True is only supported with BLOCKWISE"):
        quantize(torch.randn(4, 64), float8_e4m3, "rowwise", scaling_recipe=ScalingRecipe(use_2d_block=True))


@pytest.mark.parametrize("gran, block, recipe", [("tensorwise", None, None), ("rowwise", None, None),
                                                 ("blockwise", 32, None), ("blockwise", 32, ScalingRecipe(True)),
                                                 ("mx_blockwise", 32, None)])
@pytest.mark.parametrize("axis", [None, 0])
def test_quantize_fp8_pair_round_trip(gran, block, recipe, axis):
    x = torch.randn(48, 64)
    data, scale_inv = quantize_fp8(x, float8_e5m2, gran, block_size=block, axis=axis, scaling_recipe=recipe)
    q = quantize(x, float8_e5m2, gran, axis=-1 if axis is None else axis, block_size=block,
                 block_2d=recipe is not None)
    assert torch.equal(data.float(), q.data.float()) and torch.equal(scale_inv, q.scale)
    back = dequantize_fp8(data, torch.float64, gran, block_size=block, axis=axis, scale_inv=scale_inv,
                          scaling_recipe=recipe)
    assert torch.equal(back, dequantize(q, torch.float64))
    assert ((back - x.double()).norm() / x.double().norm()).item() < 0.1


def test_config_stays_frozen_and_names_the_way_to_a_copy():
    cfg = Float8QuantConfig()
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"cfg.replace\(granularity=...\) or "
                                                              r"dataclasses.replace\(cfg, granularity=...\)"):
        cfg.granularity = ScalingGranularity.ROWWISE
    with pytest.raises(AttributeError, match="Float8QuantConfig is frozen"):
        del cfg.format
    changed = cfg.replace(granularity="blockwise", block_size=128)
    assert changed == Float8QuantConfig(granularity="blockwise", block_size=128) and cfg == Float8QuantConfig()
    assert dataclasses.replace(cfg, format="hybrid").tag() == "hybrid/tensorwise/fp32"
    assert len({cfg, Float8QuantConfig(), changed}) == 2  # hashable, by value
    with pytest.raises(ValueError, match="needs block_size"):
        cfg.replace(granularity="blockwise")  # a copy is validated like a new config


def test_getters_return_a_backend_choice_from_code_or_env(monkeypatch):
    assert GlobalBackendManager.get_gemm_backend(PrecisionType.FP8) is None
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", "fp8:autotune,bf16_fp16_fp32:triton,other:torch")
    GlobalBackendManager.reset()
    get = GlobalBackendManager.get_grouped_gemm_backend
    assert get(PrecisionType.FP8) == BackendChoice(auto_tune=True) and get("fp8").source == "env"
    assert get(PrecisionType.BF16_FP16_FP32) == BackendChoice(BackendType.TRITON)
    assert get(PrecisionType.FP32) == BackendChoice(BackendType.TRITON)
    assert get() == BackendChoice(BackendType.TORCH)
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH, precision=PrecisionType.BF16_FP16_FP32)
    choice = get(PrecisionType.BF16)
    assert choice == BackendChoice(BackendType.TORCH) and choice.source == "code"
    assert choice.backend is BackendType.TORCH
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision=PrecisionType.FP16)
    with pytest.raises(ValueError, match="set apart.*fp16=BackendChoice\\(backend=<BackendType.TRITON"):
        get(PrecisionType.BF16_FP16_FP32)
    GlobalBackendManager.set_grouped_gemm_backend(auto_tune=True, precision="bf16_fp16_fp32")
    assert get(PrecisionType.BF16_FP16_FP32) == BackendChoice(None, True)
    assert GlobalBackendManager.auto_tune_enabled() is False


def test_high_precision_setting_reaches_the_resolver():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    GlobalBackendManager.set_gemm_backend(BackendType.TORCH, precision=PrecisionType.BF16_FP16_FP32)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        d = turbo.explain("gemm", a.to(dtype), b.to(dtype))
        assert (d.backend, d.source) == ("TORCH", "code")
    assert turbo.explain("gemm_fp8", a, b).source != "code"


def test_fp4_is_refused_with_the_reason(monkeypatch):
    reason = "precision FP4 cannot be set: turbo_dispatch has no FP4 ops"
    with pytest.raises(ValueError, match=reason):
        GlobalBackendManager.set_gemm_backend(BackendType.TORCH, precision=PrecisionType.FP4)
    with pytest.raises(ValueError, match=reason):
        GlobalBackendManager.get_gemm_backend("fp4")
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "fp4:torch,other:torch")
    with pytest.raises(ConfigError, match="PRIMUS_TURBO_GEMM_BACKEND='fp4:torch,other:torch': " + reason):
        GlobalBackendManager.reset()


def test_prequantised_grouped_operands_run_forward_only():
    lens = torch.tensor([5, 0, 7])
    a, w = torch.randn(12, 64), torch.randn(3, 32, 64)
    for gran, block in (("tensorwise", None), ("rowwise", None), ("blockwise", 32)):
        cfg = Float8QuantConfig(granularity=gran, block_size=block)
        qa = QuantizedTensor.quantize(a, float8_e4m3, gran, axis=-1, block_size=block)
        qw = QuantizedTensor.quantize(w, float8_e4m3, gran, axis=-1, block_size=block,
                                      scaling_recipe=ScalingRecipe(use_2d_block=block is not None))
        want = turbo.ops.grouped_gemm_fp8(a, w, lens, config=cfg)
        got = turbo.ops.grouped_gemm_fp8(qa, qw, lens, config=cfg, out_dtype=torch.float32)
        assert torch.equal(got, want), gran
        assert torch.equal(turbo.ops.grouped_gemm_fp8(a, qw, lens, config=cfg), want)
        compiled = torch.compile(lambda x, y: turbo.ops.grouped_gemm_fp8(x, y, lens, config=cfg,
                                                                         out_dtype=torch.float32), fullgraph=True)
        assert torch.equal(compiled(qa, qw), want)
    with pytest.raises(ValueError, match="a requires grad, but the other operand is a pre-quantised"):
        turbo.ops.grouped_gemm_fp8(a.requires_grad_(), qw, lens, config=cfg)
