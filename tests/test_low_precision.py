"""Tests for turbo_dispatch.low_precision (config validation and fp8 quantize/dequantize)."""

from __future__ import annotations

import doctest
import importlib
import math
import shutil

import pytest
import torch

from turbo_dispatch.low_precision import (
    FP8_MAX,
    Float8QuantConfig,
    Format,
    QuantizedTensor,
    ScaleDtype,
    ScalingGranularity,
    dequantize,
    quantize,
    quantize_with_config,
)

config_mod = importlib.import_module("turbo_dispatch.low_precision.config")
# Not `from ... import quantize`: the package re-exports the *function* `quantize`,
# which shadows the submodule attribute of the same name.
quantize_mod = importlib.import_module("turbo_dispatch.low_precision.quantize")

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
G = ScalingGranularity
MIN_SNR_DB = {E4: 25.0, E5: 20.0}


# ----------------------------------------------------------------------------- config


def test_format_dtypes() -> None:
    assert (Format.E4M3.fwd_dtype(), Format.E4M3.bwd_dtype()) == (E4, E4)
    assert (Format.E5M2.fwd_dtype(), Format.E5M2.bwd_dtype()) == (E5, E5)
    assert (Format.HYBRID.fwd_dtype(), Format.HYBRID.bwd_dtype()) == (E4, E5)
    assert [g.value for g in G] == ["tensorwise", "rowwise", "blockwise", "mx_blockwise"]


def test_config_defaults_strings_hash_and_tag() -> None:
    cfg = Float8QuantConfig()
    assert (cfg.format, cfg.granularity, cfg.scale_dtype, cfg.block_size) == (
        Format.E4M3, G.TENSORWISE, ScaleDtype.FP32, None,
    )
    s = Float8QuantConfig(format="HYBRID", granularity="BlockWise", scale_dtype="fp32", block_size=128)
    assert s == Float8QuantConfig(Format.HYBRID, G.BLOCKWISE, ScaleDtype.FP32, 128)
    assert s.format is Format.HYBRID and s.granularity is G.BLOCKWISE
    assert len({s, Float8QuantConfig("hybrid", "blockwise", block_size=128), cfg}) == 2
    assert s.tag() == "hybrid/blockwise128/fp32"
    assert cfg.tag() == "e4m3/tensorwise/fp32"
    mx = Float8QuantConfig(granularity="mx_blockwise", scale_dtype="E8M0")
    assert mx.block_size == 32 and mx.tag() == "e4m3/mx_blockwise32/e8m0"
    assert Float8QuantConfig(granularity=G.BLOCKWISE, block_size=16).block_size == 16
    for bad in (7, 48, 1024, 10**6):  # not a power of two, or beyond any useful block
        with pytest.raises(ValueError, match="block_size, a power of two"):
            Float8QuantConfig(granularity=G.BLOCKWISE, block_size=bad)
    with pytest.raises(Exception):
        cfg.block_size = 3  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"format": "e3m4"}, "format"),
        ({"format": 1}, "format"),
        ({"granularity": "columnwise"}, "granularity"),
        ({"scale_dtype": torch.float32}, "scale_dtype"),
        ({"granularity": "blockwise"}, "block_size"),
        ({"granularity": "blockwise", "block_size": 0}, "block_size"),
        ({"granularity": "blockwise", "block_size": -128}, "block_size"),
        ({"granularity": "blockwise", "block_size": 128.0}, "block_size"),
        ({"granularity": "blockwise", "block_size": True}, "block_size"),
        ({"granularity": "mx_blockwise", "scale_dtype": "e8m0", "block_size": 64}, "block_size"),
        ({"granularity": "mx_blockwise"}, "scale_dtype"),
        ({"granularity": "tensorwise", "block_size": 128}, "block_size"),
        ({"granularity": "rowwise", "block_size": 128}, "block_size"),
        ({"granularity": "blockwise", "block_size": 128, "scale_dtype": "e8m0"}, "scale_dtype"),
        ({"scale_dtype": "e8m0"}, "scale_dtype"),
    ],
)
def test_config_validation(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Float8QuantConfig(**kwargs)


def test_config_error_message_lists_choices() -> None:
    with pytest.raises(ValueError, match="TENSORWISE, ROWWISE, BLOCKWISE, MX_BLOCKWISE"):
        Float8QuantConfig(granularity="columnwise")
    with pytest.raises(ValueError, match=r"block_size, a power of two \(one of 16, 32, 64, 128, 256, 512, e.g. 128\); got None"):
        Float8QuantConfig(granularity="blockwise")


# ----------------------------------------------------------------------------- helpers


def make_input(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """randn with per-row magnitudes spread over 10**[-2, 2] (never zero)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    rows = shape[-2] if len(shape) >= 2 else 1
    mags = 10 ** (torch.rand(rows, 1, generator=g) * 4 - 2)
    return x * mags


def snr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    return 10 * math.log10(x.double().square().sum().item() / (x.double() - y.double()).square().sum().item())


def expected_scale_shape(shape: tuple[int, ...], gran: G, axis: int, bs: int | None, block_2d: bool) -> tuple:
    axis %= len(shape)
    if gran is G.TENSORWISE:
        return ()
    out = list(shape)
    if gran is G.ROWWISE:
        out[axis] = 1
    elif block_2d:
        out[-2], out[-1] = -(-shape[-2] // bs), -(-shape[-1] // bs)
    else:
        out[axis] = -(-shape[axis] // bs)
    return tuple(out)


def block_reduce(t: torch.Tensor, axis: int, bs: int, block_2d: bool) -> torch.Tensor:
    """Per-block amax of |t| computed independently of the library (torch.split)."""
    t = t.abs()
    if block_2d:
        rows = [
            torch.stack([c.amax(dim=(-2, -1)) for c in r.split(bs, dim=-1)], dim=-1) for r in t.split(bs, dim=-2)
        ]
        return torch.stack(rows, dim=-2)
    return torch.cat([c.amax(dim=axis, keepdim=True) for c in t.split(bs, dim=axis)], dim=axis)


SHAPES = [(1, 127), (33, 127), (130, 257), (3, 65, 130)]
# (granularity, block_size, block_2d)
RECIPES = [
    (G.TENSORWISE, None, False),
    (G.ROWWISE, None, False),
    (G.BLOCKWISE, 128, False),
    (G.BLOCKWISE, 32, False),
    (G.BLOCKWISE, 128, True),
    (G.BLOCKWISE, 32, True),
    (G.MX_BLOCKWISE, 32, False),
]
CASES = [
    pytest.param(shape, axis, gran, bs, b2d, id=f"{'x'.join(map(str, shape))}-ax{axis}-{gran.value}{bs or ''}{'-2d' if b2d else ''}")
    for shape in SHAPES
    for axis in ((0, 1) if len(shape) == 2 else (0, 1, -1))
    for gran, bs, b2d in RECIPES
    if not (b2d and axis != -1 and len(shape) == 3)  # 2-D tiles ignore axis: one 3-D case is enough
]


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(("shape", "axis", "gran", "bs", "b2d"), CASES)
def test_round_trip(shape, axis, gran, bs, b2d, dtype) -> None:
    x = make_input(shape)
    q = quantize(x, dtype, gran, axis=axis, block_size=bs, block_2d=b2d)
    assert isinstance(q, QuantizedTensor)
    assert q.data.dtype == dtype and q.data.shape == x.shape
    assert q.scale.dtype == torch.float32
    assert tuple(q.scale.shape) == expected_scale_shape(shape, gran, axis, bs, b2d)
    assert q.axis == axis % x.dim() and q.granularity is gran and q.block_2d == b2d
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()

    deq = dequantize(q)
    assert deq.shape == x.shape and deq.dtype == torch.float32
    assert snr_db(x, deq) >= MIN_SNR_DB[dtype]
    assert dequantize(q, torch.bfloat16).dtype == torch.bfloat16

    fp8_max = FP8_MAX[dtype]
    data = q.data.float()
    assert data.abs().max() <= fp8_max
    if gran is G.ROWWISE:
        # Tight: every row's max hits FP8_MAX (up to fp8 rounding of amax/scale).
        assert (data.abs().amax(dim=axis % x.dim(), keepdim=True) >= 0.9 * fp8_max).all()
    if gran is G.TENSORWISE:
        assert data.abs().max() >= 0.9 * fp8_max
    if gran in (G.BLOCKWISE, G.MX_BLOCKWISE):
        ax = axis % x.dim()
        block_max = block_reduce(data, ax, bs, b2d)
        assert block_max.shape == q.scale.shape
        assert (block_max <= fp8_max).all()
        if gran is G.BLOCKWISE:
            assert (block_max >= 0.9 * fp8_max).all(), "blockwise scales must be tight"
            torch.testing.assert_close(q.scale, block_reduce(x, ax, bs, b2d) / fp8_max)
        else:
            mant, exp = torch.frexp(q.scale)
            assert (mant == 0.5).all(), "MX scales must be exact powers of two"
            # Rounded-up power of two: scale = 2 ** ceil(log2(amax / FP8_MAX)), so nothing clips
            # and every nonzero block is more than half-full.
            amax = block_reduce(x, ax, bs, False)
            expected = torch.exp2(torch.ceil(torch.log2(amax.double() / fp8_max))).float()
            nonzero = amax > 0
            assert torch.equal(q.scale[nonzero], expected[nonzero])
            assert (block_max[nonzero] >= fp8_max / 2).all()


def test_snr_has_margin() -> None:
    """Typical SNRs (recorded for the report): comfortably above the thresholds."""
    x = make_input((130, 257))
    got = {
        (dt, g): snr_db(x, dequantize(quantize(x, dt, g, block_size=128 if g is G.BLOCKWISE else None)))
        for dt in (E4, E5)
        for g in (G.TENSORWISE, G.ROWWISE, G.BLOCKWISE, G.MX_BLOCKWISE)
    }
    for (dt, _), v in got.items():
        assert v >= MIN_SNR_DB[dt] + 3, got


def test_quantize_with_config_picks_dtype() -> None:
    x = make_input((4, 64))
    cfg = Float8QuantConfig("hybrid", "blockwise", block_size=32)
    assert quantize_with_config(x, cfg).data.dtype == E4
    q = quantize_with_config(x, cfg, grad=True, axis=0)
    assert q.data.dtype == E5 and q.axis == 0 and q.scale.shape == (1, 64)
    q2 = quantize_with_config(x, cfg, block_2d=True)
    assert q2.block_2d and q2.scale.shape == (1, 2)
    mx = quantize_with_config(x, Float8QuantConfig("e5m2", "mx_blockwise", "e8m0"))
    assert mx.data.dtype == E5 and mx.block_size == 32 and mx.scale.shape == (4, 2)


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="torch lacks float8_e8m0fnu")
def test_scale_e8m0() -> None:
    x = make_input((8, 96))
    q = quantize(x, E4, "mx_blockwise")
    s = q.scale_e8m0()
    assert s.dtype == torch.float8_e8m0fnu and torch.equal(s.float(), q.scale)
    with pytest.raises(ValueError, match="MX_BLOCKWISE"):
        quantize(x, E4, "rowwise").scale_e8m0()


def test_mx_extreme_exponents_are_exact() -> None:
    # Tiny (subnormal) and huge amax stay in the E8M0 range and exact powers of two; amax/448
    # below the smallest normal float32 is floored there (2**-126).
    x = torch.tensor([[1e-44] * 32, [3e38] * 32, [2.0**-120] * 32, [448.0] * 32])
    q = quantize(x, E4, "mx_blockwise")
    assert torch.equal(q.scale.flatten(), torch.tensor([2.0**-126, 2.0**120, 2.0**-126, 1.0]))
    assert torch.isfinite(dequantize(q)).all()
    torch.testing.assert_close(dequantize(q)[1:], x[1:], rtol=0.07, atol=0)


# ----------------------------------------------------------------------------- zeros / non-finite


@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(
    ("gran", "bs", "b2d", "zero"),
    [
        (G.ROWWISE, None, False, (slice(3, 4), slice(None))),
        (G.BLOCKWISE, 32, False, (slice(3, 4), slice(32, 64))),
        (G.BLOCKWISE, 32, True, (slice(32, 64), slice(0, 32))),
        (G.BLOCKWISE, 32, False, (slice(3, 4), slice(64, 70))),  # partial last block
        (G.MX_BLOCKWISE, 32, False, (slice(5, 6), slice(0, 32))),
    ],
)
def test_zero_block(gran, bs, b2d, zero, dtype) -> None:
    x = make_input((40, 70))
    x[zero] = 0
    q = quantize(x, dtype, gran, block_size=bs, block_2d=b2d)
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    assert (q.scale == 1).any()  # the zero block's scale
    deq = dequantize(q)
    assert torch.isfinite(deq).all()
    assert (deq[zero] == 0).all()
    assert snr_db(x, deq) >= MIN_SNR_DB[dtype]


@pytest.mark.parametrize("gran", [G.TENSORWISE, G.ROWWISE, G.BLOCKWISE, G.MX_BLOCKWISE])
def test_all_zero_tensor(gran) -> None:
    x = torch.zeros(4, 64)
    q = quantize(x, E4, gran, block_size=32 if gran is G.BLOCKWISE else None)
    assert (q.scale == 1).all()
    assert torch.equal(dequantize(q), x)


@pytest.mark.parametrize("gran", [G.BLOCKWISE, G.MX_BLOCKWISE])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_poisons_only_its_block(gran, bad) -> None:
    x = make_input((2, 64))
    x[0, 5] = bad
    deq = dequantize(quantize(x, E4, gran, block_size=32))
    assert deq[0, :32].isnan().all()  # documented: whole group becomes NaN
    assert torch.isfinite(deq[0, 32:]).all() and torch.isfinite(deq[1]).all()


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        ((torch.arange(8), E4, "tensorwise"), {}, "x must be a floating-point"),
        (([1.0, 2.0], E4, "tensorwise"), {}, "x must be a floating-point"),
        ((torch.tensor(1.0), E4, "tensorwise"), {}, "at least 1 dimension"),
        ((torch.randn(4, 8), torch.float16, "tensorwise"), {}, "dtype"),
        ((torch.randn(4, 8), torch.float8_e4m3fnuz, "tensorwise"), {}, "dtype"),
        ((torch.randn(4, 8), E4, "columnwise"), {}, "granularity"),
        ((torch.randn(4, 8), E4, "blockwise"), {}, "block_size"),
        ((torch.randn(4, 8), E4, "blockwise"), {"block_size": 0}, "block_size"),
        ((torch.randn(4, 8), E4, "blockwise"), {"block_size": -4}, "block_size"),
        ((torch.randn(4, 8), E4, "mx_blockwise"), {"block_size": 16}, "block_size"),
        ((torch.randn(4, 8), E4, "rowwise"), {"block_size": 16}, "block_size"),
        ((torch.randn(8), E4, "blockwise"), {"block_size": 4, "block_2d": True}, "block_2d"),
        ((torch.randn(4, 8), E4, "rowwise"), {"block_2d": True}, "block_2d"),
        ((torch.randn(4, 8), E4, "rowwise"), {"axis": 2}, "axis"),
        ((torch.randn(4, 8), E4, "rowwise"), {"axis": -3}, "axis"),
    ],
)
def test_bad_inputs(args, kwargs, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        quantize(*args, **kwargs)


def test_bad_dequantize_and_config_args() -> None:
    q = quantize(torch.randn(2, 8), E4, "rowwise")
    with pytest.raises(ValueError, match="out_dtype"):
        dequantize(q, torch.int32)
    with pytest.raises(ValueError, match="out_dtype"):
        dequantize(q, E4)
    with pytest.raises(ValueError, match="config"):
        quantize_with_config(torch.randn(2, 8), "e4m3")  # type: ignore[arg-type]


def test_doctests() -> None:
    from turbo_dispatch.low_precision import dual_quantize, fast_quantize

    for mod in (config_mod, quantize_mod, fast_quantize, dual_quantize):
        result = doctest.testmod(mod, extraglobs={"torch": torch})
        assert result.failed == 0, mod.__name__


# ----------------------------------------------------------------------------- torch.compile


def _compile_usable() -> bool:
    try:
        import torch._dynamo  # noqa: F401
    except Exception:
        return False
    return torch._dynamo.is_dynamo_supported() and any(shutil.which(c) for c in ("g++", "c++", "gcc", "cc"))


@pytest.mark.skipif(not _compile_usable(), reason="torch.compile (dynamo + a C++ compiler) not usable here")
def test_compile_fullgraph_blockwise() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q1 = quantize(x, E4, G.BLOCKWISE, block_size=16)
        q2 = quantize(x, E5, G.BLOCKWISE, block_size=16, block_2d=True, axis=0)
        q3 = quantize(x, E4, G.MX_BLOCKWISE, axis=0)
        return tuple(t for q in (q1, q2, q3) for t in (q.data, q.scale, dequantize(q)))

    torch._dynamo.reset()
    x = make_input((40, 36))
    compiled = torch.compile(fn, fullgraph=True)
    for got, want in zip(compiled(x), fn(x)):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)
