"""Correctness of turbo_dispatch.ops.gemm / gemm_fp8 and turbo_dispatch.modules.Linear.

Conventions (DESIGN.md "Testing conventions"): the reference is the same math in float64 on the
upcast inputs (for fp8: the *unquantized* inputs), computed with torch.autograd on float64
copies; inputs and output gradients are random (never zeros); freed memory is poisoned with NaN
before each op call and every output and gradient must be finite (fully written).

Gates: relative error ||x - ref|| / ||ref|| <= 1e-5 for fp32 on CPU (5e-3 on GPU, where TF32
may be on), 1e-2 for bf16; fp8 by SNR = 10*log10(||ref||^2 / ||ref - x||^2) >= 25 dB for E4M3
and >= 20 dB for E5M2 / HYBRID, for the output and both gradients.

SNR of tiny tensors: an fp8 GEMM's error is a sum of independent relative rounding errors, so
its SNR is a statistic whose spread grows as the tensor shrinks (a 1 x 33 output is 33 samples).
Where the smallest of out / a.grad / b.grad holds fewer than 2048 elements, the signal and noise
energies are summed over several independent draws (up to 16) before taking the ratio: the
same quantity, estimated from enough samples that the gate tests the kernel, not the seed.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch import BackendUnsupportedError, NoBackendError
from turbo_dispatch.low_precision import Float8QuantConfig, Format, ScalingGranularity

G = ScalingGranularity
BF16, FP32 = torch.bfloat16, torch.float32

SHAPES = [(1, 33, 127), (17, 65, 31), (64, 48, 256)]  # (M, N, K)
# (1, 33, 127) and (64, 160, 256) are the issue's, run for every granularity; (128, 256, 256) has
# K and N divisible by 128, so on a GPU the forward and both backward GEMMs of BLOCKWISE/128 reach
# torch's scaled_mm path (it is run for blockwise128 only, to keep the CPU run short).
FP8_SHAPES = [(1, 33, 127), (64, 160, 256)]
FP8_BLOCK128_SHAPE = (128, 256, 256)
TRANS = list(itertools.product([False, True], [False, True]))
TRANS_IDS = [f"{'T' if ta else 'N'}{'T' if tb else 'N'}" for ta, tb in TRANS]

#: id -> (input dtype, out_dtype argument)
DTYPES = {"fp32": (FP32, None), "bf16": (BF16, None), "bf16_to_fp32": (BF16, FP32)}

#: id -> config; every ScalingGranularity, BLOCKWISE at two block sizes.
GRANULARITIES = {
    "tensorwise": dict(granularity=G.TENSORWISE),
    "rowwise": dict(granularity=G.ROWWISE),
    "blockwise128": dict(granularity=G.BLOCKWISE, block_size=128),
    "blockwise32": dict(granularity=G.BLOCKWISE, block_size=32),
    "mx32": dict(granularity=G.MX_BLOCKWISE, block_size=32, scale_dtype="e8m0"),
}
MIN_SNR_DB = {Format.E4M3: 25.0, Format.E5M2: 20.0, Format.HYBRID: 20.0}


# -- helpers ---------------------------------------------------------------------------------------
def randn(shape, dtype, device, requires_grad=False) -> torch.Tensor:
    """Standard-normal values in ``dtype``, with exact zeros (vanishingly rare) replaced by 1."""
    x = torch.randn(shape, device=device)
    x = torch.where(x == 0, torch.ones_like(x), x).to(dtype)
    return x.requires_grad_(requires_grad)


def operands(m, n, k, trans_a, trans_b, dtype, device, requires_grad=True):
    a = randn((k, m) if trans_a else (m, k), dtype, device, requires_grad)
    b = randn((n, k) if trans_b else (k, n), dtype, device, requires_grad)
    return a, b


def poison(device) -> None:
    """Leaves freed NaN memory behind, which the op's next allocations are likely to reuse, so an
    output element a kernel forgets to write shows up as non-finite."""
    junk = torch.full((1 << 14,), float("nan"), device=device)
    del junk


def reference(a, b, trans_a, trans_b, grad):
    """float64 output and gradients of op(a) @ op(b) on the upcast inputs, via torch.autograd."""
    a64 = a.detach().cpu().double().requires_grad_()
    b64 = b.detach().cpu().double().requires_grad_()
    out = (a64.t() if trans_a else a64) @ (b64.t() if trans_b else b64)
    out.backward(grad.detach().cpu().double())
    return out.detach(), a64.grad, b64.grad


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.detach().cpu().double()
    return float((x.detach().cpu().double() - ref).norm() / ref.norm())


def rel_tol(dtype: torch.dtype, device: str) -> float:
    if dtype == BF16:
        return 1e-2
    return 1e-5 if device == "cpu" else 5e-3  # GPU fp32 may run on TF32


def snr_db(signal: float, noise: float) -> float:
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def assert_written(name: str, x: torch.Tensor, shape, dtype) -> None:
    assert tuple(x.shape) == tuple(shape), f"{name}: shape {tuple(x.shape)}, expected {tuple(shape)}"
    assert x.dtype == dtype, f"{name}: dtype {x.dtype}, expected {dtype}"
    assert torch.isfinite(x).all(), f"{name}: has NaN/inf (unwritten or overflowed elements)"


def mx_unsupported_here(device: str, cfg: Float8QuantConfig) -> bool:
    """MX_BLOCKWISE on a GPU without hardware MX (NVIDIA older than sm_100, or ROCm) must be
    refused with an error that says so, not emulated."""
    if cfg.granularity is not G.MX_BLOCKWISE or device != "cuda":
        return False
    return torch.version.hip is not None or torch.cuda.get_device_capability() < (10, 0)


def fp8_snrs(device, m, n, k, trans_a, trans_b, cfg, dtype=BF16, out_dtype=None) -> dict[str, float]:
    """SNR (dB) of gemm_fp8's output, a.grad and b.grad against the float64 reference of the
    unquantized inputs; energies pooled over independent draws for tiny tensors (module doc)."""
    trials = min(16, max(1, math.ceil(2048 / min(m * n, m * k, k * n))))
    signal, noise = [0.0] * 3, [0.0] * 3
    for _ in range(trials):
        a, b = operands(m, n, k, trans_a, trans_b, dtype, device)
        poison(device)
        out = turbo.ops.gemm_fp8(a, b, trans_a=trans_a, trans_b=trans_b, out_dtype=out_dtype, config=cfg)
        assert_written("out", out, (m, n), out_dtype or dtype)
        grad = randn(out.shape, out.dtype, device)
        poison(device)
        out.backward(grad)
        assert_written("a.grad", a.grad, a.shape, a.dtype)
        assert_written("b.grad", b.grad, b.shape, b.dtype)
        for i, (x, ref) in enumerate(zip((out, a.grad, b.grad), reference(a, b, trans_a, trans_b, grad))):
            signal[i] += float(ref.pow(2).sum())
            noise[i] += float((x.detach().cpu().double() - ref).pow(2).sum())
    return {name: snr_db(s, e) for name, s, e in zip(("out", "a.grad", "b.grad"), signal, noise)}


# -- gemm: forward and backward against float64 ------------------------------------------------
@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("trans_a,trans_b", TRANS, ids=TRANS_IDS)
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_gemm_matches_fp64(device, m, n, k, trans_a, trans_b, dtype_id):
    dtype, out_dtype = DTYPES[dtype_id]
    a, b = operands(m, n, k, trans_a, trans_b, dtype, device)
    poison(device)
    out = turbo.ops.gemm(a, b, trans_a=trans_a, trans_b=trans_b, out_dtype=out_dtype)
    assert_written("out", out, (m, n), out_dtype or dtype)
    assert out.device == a.device
    grad = randn(out.shape, out.dtype, device)
    poison(device)
    out.backward(grad)
    assert_written("a.grad", a.grad, a.shape, dtype)
    assert_written("b.grad", b.grad, b.shape, dtype)
    for name, x, ref in zip(("out", "a.grad", "b.grad"), (out, a.grad, b.grad),
                            reference(a, b, trans_a, trans_b, grad)):
        err, tol = rel_error(x, ref), rel_tol(x.dtype, device)
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"

    # The no-grad fast path runs the same backend call as the autograd path: the same numbers
    # (bit for bit on the CPU; on a GPU, within the dtype's default tolerance).
    with torch.no_grad():
        plain = turbo.ops.gemm(a, b, trans_a=trans_a, trans_b=trans_b, out_dtype=out_dtype)
    exact = dict(rtol=0, atol=0) if device == "cpu" else {}
    torch.testing.assert_close(plain, out.detach(), **exact)


@pytest.mark.parametrize("which", ["a", "b"])
def test_gemm_grad_of_one_operand(device, which):
    a, b = operands(17, 65, 31, False, True, FP32, device, requires_grad=False)
    (a if which == "a" else b).requires_grad_()
    out = turbo.ops.gemm(a, b, trans_b=True)
    grad = randn(out.shape, out.dtype, device)
    out.backward(grad)
    _, ref_ga, ref_gb = reference(a, b, False, True, grad)
    if which == "a":
        assert b.grad is None and rel_error(a.grad, ref_ga) <= rel_tol(FP32, device)
    else:
        assert a.grad is None and rel_error(b.grad, ref_gb) <= rel_tol(FP32, device)


@pytest.mark.parametrize("trans_a,trans_b", TRANS, ids=TRANS_IDS)
def test_gemm_non_contiguous_inputs(device, trans_a, trans_b):
    m, n, k = 17, 65, 31
    # Every other column of a wider tensor: a strided, non-contiguous view of the right shape.
    a_full = randn((k, 2 * m) if trans_a else (m, 2 * k), FP32, device, requires_grad=True)
    b_full = randn((n, 2 * k) if trans_b else (k, 2 * n), FP32, device, requires_grad=True)
    a, b = a_full[:, ::2], b_full[:, ::2]
    assert not a.is_contiguous() and not b.is_contiguous()
    out = turbo.ops.gemm(a, b, trans_a=trans_a, trans_b=trans_b)
    grad = randn(out.shape, out.dtype, device)
    out.backward(grad)
    ref, ref_ga, ref_gb = reference(a, b, trans_a, trans_b, grad)
    tol = rel_tol(FP32, device)
    assert rel_error(out, ref) <= tol
    assert rel_error(a_full.grad[:, ::2], ref_ga) <= tol and rel_error(b_full.grad[:, ::2], ref_gb) <= tol
    assert not a_full.grad[:, 1::2].any() and not b_full.grad[:, 1::2].any()


# -- fp8: every granularity x format x layout, output and both gradients by SNR ------------------
def _fp8_cases():
    for shape, (ta, tb), fmt, gran_id in itertools.product(FP8_SHAPES + [FP8_BLOCK128_SHAPE], TRANS, Format,
                                                           GRANULARITIES):
        if shape == FP8_BLOCK128_SHAPE and gran_id != "blockwise128":
            continue
        case_id = f"{'x'.join(map(str, shape))}-{'T' if ta else 'N'}{'T' if tb else 'N'}-{fmt.name}-{gran_id}"
        yield pytest.param(*shape, ta, tb, fmt, gran_id, id=case_id)


@pytest.mark.parametrize("m,n,k,trans_a,trans_b,fmt,gran_id", list(_fp8_cases()))
def test_gemm_fp8_snr(device, m, n, k, trans_a, trans_b, fmt, gran_id):
    cfg = Float8QuantConfig(format=fmt, **GRANULARITIES[gran_id])
    if mx_unsupported_here(device, cfg):
        a, b = operands(m, n, k, trans_a, trans_b, BF16, device)
        with pytest.raises((BackendUnsupportedError, NoBackendError), match="MX"):
            turbo.ops.gemm_fp8(a, b, trans_a=trans_a, trans_b=trans_b, config=cfg)
        return
    snrs = fp8_snrs(device, m, n, k, trans_a, trans_b, cfg)
    gate = MIN_SNR_DB[fmt]
    low = {name: round(db, 2) for name, db in snrs.items() if db < gate}
    assert not low, f"{cfg.tag()}: SNR below {gate} dB: {low} (all: { {k_: round(v, 2) for k_, v in snrs.items()} })"


@pytest.mark.parametrize("gran_id", ["tensorwise", "rowwise", "blockwise128"])
@pytest.mark.parametrize("dtype,out_dtype", [(BF16, FP32), (FP32, None), (FP32, BF16)],
                         ids=["bf16_to_fp32", "fp32", "fp32_to_bf16"])
def test_gemm_fp8_dtypes(device, dtype, out_dtype, gran_id):
    cfg = Float8QuantConfig(format=Format.E4M3, **GRANULARITIES[gran_id])
    snrs = fp8_snrs(device, 64, 160, 256, False, True, cfg, dtype=dtype, out_dtype=out_dtype)
    assert min(snrs.values()) >= MIN_SNR_DB[Format.E4M3], snrs


# -- the custom-op (torch.compile) path agrees with the eager fast path --------------------------
def _grads_of(fn, a, b, grad):
    a, b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    out = fn(a, b)
    out.backward(grad)
    return out.detach(), a.grad, b.grad


@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("trans_a,trans_b", TRANS, ids=TRANS_IDS)
def test_gemm_custom_op_matches_eager(device, trans_a, trans_b, dtype_id):
    dtype, out_dtype = DTYPES[dtype_id]
    a, b = operands(17, 65, 31, trans_a, trans_b, dtype, device, requires_grad=False)
    grad = randn((17, 65), out_dtype or dtype, device)
    eager = _grads_of(lambda x, y: turbo.ops.gemm(x, y, trans_a, trans_b, out_dtype), a, b, grad)
    op = _grads_of(lambda x, y: torch.ops.turbo_dispatch.gemm(x, y, trans_a, trans_b, out_dtype), a, b, grad)
    for name, x, y in zip(("out", "a.grad", "b.grad"), eager, op):
        assert x.dtype == y.dtype, name
        torch.testing.assert_close(y, x, msg=lambda s, name=name: f"{name}: {s}")


def _fp8_op_call(trans_a, trans_b, out_dtype, cfg):
    return lambda x, y: torch.ops.turbo_dispatch.gemm_fp8(
        x, y, trans_a, trans_b, out_dtype, cfg.format.value, cfg.granularity.value, cfg.block_size,
        cfg.scale_dtype.value)


@pytest.mark.parametrize("fmt_gran", [("E4M3", "tensorwise"), ("HYBRID", "rowwise"), ("E4M3", "blockwise128"),
                                      ("E5M2", "blockwise32"), ("HYBRID", "mx32")], ids="-".join)
@pytest.mark.parametrize("trans_a,trans_b", TRANS, ids=TRANS_IDS)
def test_gemm_fp8_custom_op_matches_eager(device, trans_a, trans_b, fmt_gran):
    fmt, gran_id = fmt_gran
    cfg = Float8QuantConfig(format=fmt, **GRANULARITIES[gran_id])
    a, b = operands(64, 160, 256, trans_a, trans_b, BF16, device, requires_grad=False)
    grad = randn((64, 160), BF16, device)
    eager_fn = lambda x, y: turbo.ops.gemm_fp8(x, y, trans_a, trans_b, None, cfg)  # noqa: E731
    op_fn = _fp8_op_call(trans_a, trans_b, None, cfg)
    if mx_unsupported_here(device, cfg):
        for fn in (eager_fn, op_fn):
            with pytest.raises((BackendUnsupportedError, NoBackendError), match="MX"):
                fn(a, b)
        return
    eager, op = _grads_of(eager_fn, a, b, grad), _grads_of(op_fn, a, b, grad)
    for name, x, y in zip(("out", "a.grad", "b.grad"), eager, op):
        assert x.dtype == y.dtype, name
        torch.testing.assert_close(y, x, msg=lambda s, name=name: f"{name}: {s}")


# -- pre-quantised operands: the GEMM alone -------------------------------------------------------
def _quantized_along_k(x, trans, is_a, cfg):
    """``x`` quantised as gemm_fp8 would quantise it: along K, 2-D tiles for a BLOCKWISE b."""
    from turbo_dispatch.low_precision import quantize
    k_axis = (0 if trans else 1) if is_a else (1 if trans else 0)
    two_d = not is_a and cfg.granularity is G.BLOCKWISE
    return quantize(x, cfg.format.fwd_dtype(), cfg.granularity, axis=k_axis, block_size=cfg.block_size,
                    block_2d=two_d)


@pytest.mark.parametrize("which", ["a", "b", "both"])
@pytest.mark.parametrize("gran_id", ["tensorwise", "rowwise", "blockwise128"])
@pytest.mark.parametrize("trans_a,trans_b", TRANS, ids=TRANS_IDS)
def test_gemm_fp8_prequantized_operands(device, trans_a, trans_b, gran_id, which):
    """A QuantizedTensor operand is multiplied as given: the output matches the float64 product of
    the dequantised operands, eager and compiled (fullgraph) alike."""
    from turbo_dispatch.low_precision import dequantize
    cfg = Float8QuantConfig(format=Format.E4M3, **GRANULARITIES[gran_id])
    m, n, k = 65, 160, 256
    a, b = operands(m, n, k, trans_a, trans_b, BF16, device, requires_grad=False)
    qa = _quantized_along_k(a, trans_a, True, cfg) if which in ("a", "both") else a
    qb = _quantized_along_k(b, trans_b, False, cfg) if which in ("b", "both") else b
    out = turbo.ops.gemm_fp8(qa, qb, trans_a, trans_b, BF16, cfg)
    assert_written("out", out, (m, n), BF16)
    # Where an operand stays in bf16, the op quantises it; the reference does the same so the
    # comparison is of the GEMM, not of the recipe's rounding.
    da = dequantize(qa if which != "b" else _quantized_along_k(a, trans_a, True, cfg)).double().cpu()
    db = dequantize(qb if which != "a" else _quantized_along_k(b, trans_b, False, cfg)).double().cpu()
    ref = (da.t() if trans_a else da) @ (db.t() if trans_b else db)
    assert rel_error(out, ref) < 1e-2, rel_error(out, ref)
    torch._dynamo.reset()  # every case compiles the same lambda: keep under dynamo's recompile limit
    compiled = torch.compile(lambda x, y: turbo.ops.gemm_fp8(x, y, trans_a, trans_b, BF16, cfg), fullgraph=True,
                             backend="aot_eager")
    torch.testing.assert_close(compiled(qa, qb), out, rtol=0, atol=0)


def test_gemm_fp8_prequantized_refuses_a_gradient():
    cfg = Float8QuantConfig(granularity=G.ROWWISE)
    a, b = operands(16, 24, 32, False, True, BF16, "cpu", requires_grad=True)
    qb = _quantized_along_k(b.detach(), True, False, cfg)
    with pytest.raises(ValueError, match="a requires grad.*QuantizedTensor"):
        turbo.ops.gemm_fp8(a, qb, trans_b=True, config=cfg)
    with torch.no_grad():
        assert turbo.ops.gemm_fp8(a, qb, trans_b=True, config=cfg).shape == (16, 24)


@pytest.mark.parametrize("case", ["wrong-axis", "wrong-recipe", "no-out_dtype"])
def test_gemm_fp8_prequantized_bad_operand(case):
    from turbo_dispatch.low_precision import quantize
    cfg = Float8QuantConfig(granularity=G.ROWWISE)
    a, b = operands(16, 24, 32, False, True, BF16, "cpu", requires_grad=False)
    qa = _quantized_along_k(a, False, True, cfg)
    if case == "wrong-axis":
        call, match = (lambda: gemm_fp8(a, quantize(b, E4M3, G.ROWWISE, axis=0), trans_b=True, config=cfg),
                       "pre-quantised b has its scales along dim 0")
    elif case == "wrong-recipe":
        call, match = (lambda: gemm_fp8(a, quantize(b, E4M3, G.TENSORWISE), trans_b=True, config=cfg),
                       "pre-quantised b is")
    else:
        call, match = lambda: gemm_fp8(qa, b, trans_b=True, config=cfg), "out_dtype is required"
    with pytest.raises((ValueError, TypeError), match=match):
        call()


opcheck = getattr(torch.library, "opcheck", None)


@pytest.mark.skipif(opcheck is None, reason="this torch has no torch.library.opcheck")
@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("trans_a,trans_b", TRANS, ids=TRANS_IDS)
def test_opcheck_gemm(device, trans_a, trans_b, dtype_id):
    dtype, out_dtype = DTYPES[dtype_id]
    a, b = operands(5, 7, 9, trans_a, trans_b, dtype, device)
    opcheck(torch.ops.turbo_dispatch.gemm.default, (a, b, trans_a, trans_b, out_dtype))


@pytest.mark.skipif(opcheck is None, reason="this torch has no torch.library.opcheck")
@pytest.mark.parametrize("fmt_gran", [("E4M3", "tensorwise"), ("HYBRID", "rowwise"), ("E4M3", "blockwise128"),
                                      ("E5M2", "blockwise32"), ("E4M3", "mx32")], ids="-".join)
@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (True, False)], ids=["NT", "TN"])
def test_opcheck_gemm_fp8(device, trans_a, trans_b, fmt_gran):
    fmt, gran_id = fmt_gran
    cfg = Float8QuantConfig(format=fmt, **GRANULARITIES[gran_id])
    if mx_unsupported_here(device, cfg):
        pytest.skip("MX_BLOCKWISE is refused on this GPU (checked by test_gemm_fp8_snr)")
    a, b = operands(16, 32, 48, trans_a, trans_b, BF16, device)
    args = (a, b, trans_a, trans_b, None, cfg.format.value, cfg.granularity.value, cfg.block_size,
            cfg.scale_dtype.value)
    opcheck(torch.ops.turbo_dispatch.gemm_fp8.default, args)


# -- bad input: the exception type and a message that names the argument -------------------------
def _t(requires_grad):
    def make(*shape, dtype=FP32, device="cpu"):
        x = randn(shape, dtype, device) if dtype.is_floating_point else torch.randint(1, 5, shape, dtype=dtype)
        return x.requires_grad_(requires_grad and dtype.is_floating_point)
    return make


gemm, gemm_fp8 = turbo.ops.gemm, turbo.ops.gemm_fp8
I32, F64, E4M3 = torch.int32, torch.float64, torch.float8_e4m3fn

BAD_INPUTS = {
    # gemm
    "gemm-mismatched-k": (lambda t: gemm(t(4, 8), t(7, 3)), ValueError, "inner dimensions"),
    "gemm-mismatched-k-trans": (lambda t: gemm(t(8, 4), t(3, 4), trans_a=True, trans_b=True), ValueError,
                                "inner dimensions"),
    "gemm-int32": (lambda t: gemm(t(4, 8, dtype=I32), t(8, 3, dtype=I32)), TypeError, "a.dtype"),
    "gemm-float64": (lambda t: gemm(t(4, 8, dtype=F64), t(8, 3, dtype=F64)), TypeError, "a.dtype"),
    "gemm-mixed-dtypes": (lambda t: gemm(t(4, 8), t(8, 3, dtype=BF16)), TypeError, "same dtype"),
    "gemm-a-3d": (lambda t: gemm(t(2, 4, 8), t(8, 3)), ValueError, "a must be a 2-D"),
    "gemm-b-1d": (lambda t: gemm(t(4, 8), t(8)), ValueError, "b must be a 2-D"),
    "gemm-a-not-tensor": (lambda t: gemm([[1.0, 2.0]], t(2, 3)), TypeError, "a must be a torch.Tensor"),
    "gemm-trans_a-int": (lambda t: gemm(t(4, 8), t(8, 3), trans_a=1), TypeError, "trans_a"),
    "gemm-trans_b-str": (lambda t: gemm(t(4, 8), t(3, 8), trans_b="yes"), TypeError, "trans_b"),
    "gemm-trans_b-none": (lambda t: gemm(t(4, 8), t(3, 8), trans_b=None), TypeError, "trans_b"),
    "gemm-out_dtype-int8": (lambda t: gemm(t(4, 8), t(8, 3), out_dtype=torch.int8), TypeError, "out_dtype"),
    "gemm-out_dtype-str": (lambda t: gemm(t(4, 8), t(8, 3), out_dtype="float32"), TypeError, "out_dtype"),
    "gemm-out_dtype-fp8": (lambda t: gemm(t(4, 8), t(8, 3), out_dtype=E4M3), TypeError, "out_dtype"),
    # a and b on different devices, runnable without a GPU: "meta" is a device of its own
    "gemm-devices-cpu-meta": (lambda t: gemm(t(4, 8), t(8, 3).to("meta")), ValueError, "same device"),
    "gemm-devices-meta-cpu": (lambda t: gemm(t(4, 8).to("meta"), t(8, 3)), ValueError, "same device"),
    # gemm_fp8
    "fp8-mismatched-k": (lambda t: gemm_fp8(t(4, 8), t(7, 3)), ValueError, "inner dimensions"),
    "fp8-int32-a": (lambda t: gemm_fp8(t(4, 8, dtype=I32), t(8, 3)), TypeError, "a.dtype"),
    "fp8-int32-b": (lambda t: gemm_fp8(t(4, 8), t(8, 3, dtype=I32)), TypeError, "b.dtype"),
    "fp8-a-3d": (lambda t: gemm_fp8(t(2, 4, 8), t(8, 3)), ValueError, "a must be a 2-D"),
    "fp8-trans_a-int": (lambda t: gemm_fp8(t(8, 4), t(8, 3), trans_a=1), TypeError, "trans_a"),
    "fp8-trans_b-str": (lambda t: gemm_fp8(t(4, 8), t(3, 8), trans_b="T"), TypeError, "trans_b"),
    "fp8-out_dtype-fp8": (lambda t: gemm_fp8(t(4, 8), t(8, 3), out_dtype=E4M3), TypeError, "out_dtype"),
    "fp8-out_dtype-int32": (lambda t: gemm_fp8(t(4, 8), t(8, 3), out_dtype=I32), TypeError, "out_dtype"),
    "fp8-devices-cpu-meta": (lambda t: gemm_fp8(t(4, 8), t(8, 3).to("meta")), ValueError, "same device"),
    "fp8-config-str": (lambda t: gemm_fp8(t(4, 8), t(8, 3), config="e4m3"), TypeError, "config"),
    "fp8-config-dict": (lambda t: gemm_fp8(t(4, 8), t(8, 3), config={"format": "e4m3"}), TypeError, "config"),
    "fp8-config-enum": (lambda t: gemm_fp8(t(4, 8), t(8, 3), config=G.ROWWISE), TypeError, "config"),
    # invalid Float8QuantConfig
    "cfg-blockwise-no-block_size": (lambda t: gemm_fp8(t(4, 8), t(8, 3), config=Float8QuantConfig(
        granularity=G.BLOCKWISE)), ValueError, "block_size"),
    "cfg-blockwise-block_size-0": (lambda t: Float8QuantConfig(granularity=G.BLOCKWISE, block_size=0),
                                   ValueError, "block_size"),
    "cfg-mx-block16": (lambda t: Float8QuantConfig(granularity=G.MX_BLOCKWISE, block_size=16, scale_dtype="e8m0"),
                       ValueError, "block_size"),
    "cfg-mx-fp32-scales": (lambda t: Float8QuantConfig(granularity=G.MX_BLOCKWISE), ValueError, "scale_dtype"),
    "cfg-rowwise-block_size": (lambda t: Float8QuantConfig(granularity=G.ROWWISE, block_size=128), ValueError,
                               "block_size"),
    "cfg-unknown-format": (lambda t: Float8QuantConfig(format="e3m4"), ValueError, "format"),
    # modules
    "linear-fp8_config-str": (lambda t: turbo.modules.Linear(8, 4, fp8_config="e4m3"), TypeError, "fp8_config"),
}


@pytest.mark.parametrize("requires_grad", [False, True], ids=["nograd", "grad"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input(case, requires_grad):
    call, exc, match = BAD_INPUTS[case]
    with pytest.raises(exc, match=match):
        call(_t(requires_grad))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gemm", "gemm_fp8"])
def test_bad_input_devices_differ(op):
    fn = getattr(turbo.ops, op)
    a, b = randn((4, 8), BF16, "cpu"), randn((8, 3), BF16, "cuda")
    for x, y in ((a, b), (b.t().contiguous(), a.t().contiguous())):
        with pytest.raises(ValueError, match="same device"):
            fn(x, y)


# -- modules.Linear vs torch.nn.Linear -----------------------------------------------------------
def _linear_pair(device, dtype, bias, fp8_config=None):
    ref = torch.nn.Linear(64, 48, bias=bias, device=device, dtype=dtype)
    mod = turbo.modules.Linear(64, 48, bias=bias, device=device, dtype=dtype, fp8_config=fp8_config)
    mod.load_state_dict(ref.state_dict())
    return mod, ref


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_linear_matches_nn_linear(device, dtype, bias):
    mod, ref = _linear_pair(device, dtype, bias)
    x = randn((3, 8, 64), dtype, device, requires_grad=True)  # [B, S, in]
    x_ref = x.detach().clone().requires_grad_()
    poison(device)
    out, out_ref = mod(x), ref(x_ref)
    assert_written("out", out, (3, 8, 48), dtype)
    grad = randn(out.shape, dtype, device)
    out.backward(grad)
    out_ref.backward(grad)
    pairs = [("out", out, out_ref), ("input.grad", x.grad, x_ref.grad), ("weight.grad", mod.weight.grad,
                                                                        ref.weight.grad)]
    if bias:
        pairs.append(("bias.grad", mod.bias.grad, ref.bias.grad))
    tol = rel_tol(dtype, device)
    for name, got, want in pairs:
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.isfinite(got).all(), name
        err = rel_error(got, want)
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


def test_linear_fp8_matches_nn_linear(device):
    cfg = Float8QuantConfig(format=Format.E4M3, granularity=G.ROWWISE)
    mod, _ = _linear_pair(device, BF16, True, fp8_config=cfg)
    ref = torch.nn.Linear(64, 48, dtype=torch.float64)
    ref.load_state_dict({name: p.detach().cpu().double() for name, p in mod.state_dict().items()})
    signal, noise = [0.0] * 4, [0.0] * 4
    for _ in range(4):  # 4 x 3 x 8 tokens: enough samples for a stable SNR (module doc)
        mod.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x = randn((3, 8, 64), BF16, device, requires_grad=True)
        x_ref = x.detach().cpu().double().requires_grad_()
        poison(device)
        out = mod(x)
        assert_written("out", out, (3, 8, 48), BF16)
        out_ref = ref(x_ref)
        grad = randn(out.shape, BF16, device)
        out.backward(grad)
        out_ref.backward(grad.cpu().double())
        pairs = [(out, out_ref), (x.grad, x_ref.grad), (mod.weight.grad, ref.weight.grad),
                 (mod.bias.grad, ref.bias.grad)]
        for i, (got, want) in enumerate(pairs):
            assert torch.isfinite(got).all() and got.shape == want.shape
            signal[i] += float(want.detach().pow(2).sum())
            noise[i] += float((got.detach().cpu().double() - want.detach()).pow(2).sum())
    snrs = dict(zip(("out", "input.grad", "weight.grad", "bias.grad"), map(snr_db, signal, noise)))
    assert min(snrs.values()) >= 25.0, snrs


@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_linear_state_dict_round_trip(device, bias, fp8):
    cfg = Float8QuantConfig(granularity=G.ROWWISE) if fp8 else None
    src = torch.nn.Linear(32, 16, bias=bias, device=device)
    mod = turbo.modules.Linear(32, 16, bias=bias, device=device, fp8_config=cfg)
    mod.load_state_dict(src.state_dict())  # strict: same keys, same shapes
    back = torch.nn.Linear(32, 16, bias=bias, device=device)
    back.load_state_dict(mod.state_dict())
    assert list(mod.state_dict()) == list(src.state_dict()) == list(back.state_dict())
    for name, value in src.state_dict().items():
        assert torch.equal(mod.state_dict()[name], value) and torch.equal(back.state_dict()[name], value), name
    x = randn((4, 32, 32), FP32, device)  # 2048 outputs: a stable SNR for the fp8 case
    with torch.no_grad():
        want, got = src(x), mod(x)
    if fp8:
        assert snr_db(float(want.double().pow(2).sum()), float((got - want).double().pow(2).sum())) >= 25.0
    else:
        assert rel_error(got, want) <= rel_tol(FP32, device)


def test_doctests():
    """The public API's docstring examples run (gemm, gemm_fp8, pre-quantised operands included)."""
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module("turbo_dispatch.ops.gemm"))
    assert result.attempted >= 3 and result.failed == 0, result
