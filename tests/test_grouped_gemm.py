"""Correctness of turbo_dispatch.ops.grouped_gemm / grouped_gemm_fp8 and modules.GroupedLinear.

Conventions as in test_gemm.py: the reference is the same math per group in float64 on the
upcast inputs (for fp8: the *unquantized* inputs), differentiated by torch.autograd; inputs and
output gradients are random (never zeros); freed memory is poisoned with NaN before each op call
and every output and gradient must be finite (fully written). Group lengths include empty groups
(first, middle and last), skewed sizes and a single group; K and N include odd sizes.

Gates: relative error <= 1e-5 for fp32 on CPU (5e-3 on GPU, where TF32 may be on), 5e-3 for
fp16, 1e-2 for bf16; fp8 by SNR >= 25 dB (E4M3) / 20 dB (HYBRID) for the output and both
gradients. An empty group's weight gradient must be exactly zero.
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch.low_precision import Float8QuantConfig, Format, ScalingGranularity
from turbo_dispatch.resolver import resolve
from turbo_dispatch.ops.grouped_gemm import grouped_gemm, grouped_gemm_fp8

gg_module = importlib.import_module("turbo_dispatch.ops.grouped_gemm")  # ops.grouped_gemm is the function
G = ScalingGranularity
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

#: id -> group lengths
LENS = {
    "empty-groups": [0, 3, 0, 5, 9, 0],
    "skewed": [1, 0, 0, 57, 2, 0, 3],
    "single": [23],
}
#: (K, N): odd sizes (the loop everywhere) and sizes divisible by 8/16 (the GPU fast paths)
KN = [(33, 17), (64, 48)]
DTYPES = {"fp32": FP32, "bf16": BF16, "fp16": FP16}

FP8_LENS = [40, 0, 88, 1, 127]  # 256 tokens, an empty group, a one-token group
FP8_K, FP8_N = 256, 160  # K: two 128-blocks; N: a partial 128-tile; both divisible by 16
FP8_GRANULARITIES = {
    "tensorwise": dict(granularity=G.TENSORWISE),
    "rowwise": dict(granularity=G.ROWWISE),
    "blockwise128": dict(granularity=G.BLOCKWISE, block_size=128),
    "blockwise32": dict(granularity=G.BLOCKWISE, block_size=32),
}
MIN_SNR_DB = {Format.E4M3: 25.0, Format.HYBRID: 20.0}


# -- helpers ---------------------------------------------------------------------------------------
def randn(shape, dtype, device, requires_grad=False) -> torch.Tensor:
    x = torch.randn(shape, device=device)
    x = torch.where(x == 0, torch.ones_like(x), x).to(dtype)
    return x.requires_grad_(requires_grad)


def lens_tensor(lens, device) -> torch.Tensor:
    return torch.tensor(lens, dtype=torch.int64, device=device)


def operands(lens, k, n, trans_b, dtype, device, requires_grad=True):
    a = randn((sum(lens), k), dtype, device, requires_grad)
    b = randn((len(lens), n, k) if trans_b else (len(lens), k, n), dtype, device, requires_grad)
    return a, b


def poison(device) -> None:
    junk = torch.full((1 << 16,), float("nan"), device=device)
    del junk


def reference(a, b, lens, trans_b, grad):
    """float64 output and gradients, per group, via torch.autograd on CPU copies."""
    a64 = a.detach().cpu().double().requires_grad_()
    b64 = b.detach().cpu().double().requires_grad_()
    pieces, start = [], 0
    for i, length in enumerate(lens):
        pieces.append(a64[start:start + length] @ (b64[i].t() if trans_b else b64[i]))
        start += length
    out = torch.cat(pieces)
    out.backward(grad.detach().cpu().double())
    return out.detach(), a64.grad, b64.grad


def rel_error(x, ref) -> float:
    ref = ref.detach().cpu().double()
    return float((x.detach().cpu().double() - ref).norm() / ref.norm())


def rel_tol(dtype, device) -> float:
    if dtype == BF16:
        return 1e-2
    if dtype == FP16:
        return 5e-3
    return 1e-5 if device == "cpu" else 5e-3


def assert_written(name, x, shape, dtype) -> None:
    assert tuple(x.shape) == tuple(shape), f"{name}: shape {tuple(x.shape)}, expected {tuple(shape)}"
    assert x.dtype == dtype, f"{name}: dtype {x.dtype}, expected {dtype}"
    assert torch.isfinite(x).all(), f"{name}: has NaN/inf (unwritten or overflowed elements)"


def assert_empty_groups_zero(grad_b, lens) -> None:
    for i, length in enumerate(lens):
        if length == 0:
            assert torch.equal(grad_b[i], torch.zeros_like(grad_b[i])), f"grad_b[{i}] of an empty group is not zero"


def snr_db(signal: float, noise: float) -> float:
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


# -- grouped_gemm: forward and backward against float64 ----------------------------------------------
@pytest.mark.parametrize("dtype_id", list(DTYPES))
@pytest.mark.parametrize("trans_b", [False, True], ids=["NN", "NT"])
@pytest.mark.parametrize("k,n", KN, ids=[f"k{k}n{n}" for k, n in KN])
@pytest.mark.parametrize("lens_id", list(LENS))
def test_grouped_gemm_matches_fp64(device, lens_id, k, n, trans_b, dtype_id):
    lens, dtype = LENS[lens_id], DTYPES[dtype_id]
    a, b = operands(lens, k, n, trans_b, dtype, device)
    group_lens = lens_tensor(lens, device)
    poison(device)
    out = grouped_gemm(a, b, group_lens, trans_b=trans_b)
    assert_written("out", out, (sum(lens), n), dtype)
    grad = randn(out.shape, dtype, device)
    poison(device)
    out.backward(grad)
    assert_written("a.grad", a.grad, a.shape, dtype)
    assert_written("b.grad", b.grad, b.shape, dtype)
    assert_empty_groups_zero(b.grad, lens)
    for name, x, ref in zip(("out", "a.grad", "b.grad"), (out, a.grad, b.grad), reference(a, b, lens, trans_b, grad)):
        err, tol = rel_error(x, ref), rel_tol(dtype, device)
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"

    # The no-grad path and an explicit group_offs give the same numbers.
    offs = torch.nn.functional.pad(group_lens.cumsum(0), (1, 0))
    with torch.no_grad():
        plain = grouped_gemm(a, b, group_lens, offs, trans_b=trans_b)
    torch.testing.assert_close(plain, out.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("trans_b", [False, True], ids=["NN", "NT"])
def test_grouped_gemm_256_groups(device, trans_b):
    """The loop (and, on a GPU in bf16, torch._grouped_mm) with G=256, most groups empty or tiny."""
    gen = torch.Generator().manual_seed(7)
    lens = torch.randint(0, 4, (256,), generator=gen) * torch.randint(0, 2, (256,), generator=gen)
    lens[100] = 40
    lens = lens.tolist()
    for dtype in (FP32, BF16):
        a, b = operands(lens, 16, 24, trans_b, dtype, device)
        out = grouped_gemm(a, b, lens_tensor(lens, device), trans_b=trans_b)
        grad = randn(out.shape, dtype, device)
        out.backward(grad)
        assert_empty_groups_zero(b.grad, lens)
        for name, x, ref in zip(("out", "a.grad", "b.grad"), (out, a.grad, b.grad),
                                reference(a, b, lens, trans_b, grad)):
            assert rel_error(x, ref) <= rel_tol(dtype, device), (name, dtype)


@pytest.mark.parametrize("trans_b", [False, True], ids=["NN", "NT"])
def test_grouped_gemm_no_tokens(device, trans_b):
    """M_total = 0: an empty output, and an exactly-zero weight gradient for every group."""
    lens = [0, 0, 0]
    a, b = operands(lens, 16, 8, trans_b, FP32, device)
    out = grouped_gemm(a, b, lens_tensor(lens, device), trans_b=trans_b)
    assert out.shape == (0, 8)
    out.backward(torch.empty_like(out))
    assert a.grad.shape == (0, 16)
    assert torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("trans_b", [False, True], ids=["NN", "NT"])
def test_grouped_gemm_non_contiguous(device, trans_b):
    lens, k, n = LENS["empty-groups"], 32, 24
    a_full = randn((sum(lens), 2 * k), FP32, device, True)
    b_full = randn((len(lens), n, 2 * k) if trans_b else (len(lens), k, 2 * n), FP32, device, True)
    a, b = a_full[:, ::2], b_full[:, :, ::2]
    assert not a.is_contiguous() and not b.is_contiguous()
    out = grouped_gemm(a, b, lens_tensor(lens, device), trans_b=trans_b)
    grad = randn(out.shape, FP32, device)
    out.backward(grad)
    ref, ref_ga, ref_gb = reference(a, b, lens, trans_b, grad)
    tol = rel_tol(FP32, device)
    assert rel_error(out, ref) <= tol
    assert rel_error(a_full.grad[:, ::2], ref_ga) <= tol and rel_error(b_full.grad[:, :, ::2], ref_gb) <= tol
    assert not a_full.grad[:, 1::2].any() and not b_full.grad[:, :, 1::2].any()


@pytest.mark.parametrize("which", ["a", "b"])
def test_grouped_gemm_grad_of_one_operand(device, which):
    lens = LENS["skewed"]
    a, b = operands(lens, 33, 17, True, FP32, device, requires_grad=False)
    (a if which == "a" else b).requires_grad_()
    out = grouped_gemm(a, b, lens_tensor(lens, device), trans_b=True)
    grad = randn(out.shape, FP32, device)
    out.backward(grad)
    _, ref_ga, ref_gb = reference(a, b, lens, True, grad)
    if which == "a":
        assert b.grad is None and rel_error(a.grad, ref_ga) <= rel_tol(FP32, device)
    else:
        assert a.grad is None and rel_error(b.grad, ref_gb) <= rel_tol(FP32, device)


# -- fp8: granularity x format x layout, output and both gradients by SNR ------------------------
def fp8_snrs(device, lens, k, n, trans_b, cfg, dtype=BF16, out_dtype=None) -> dict[str, float]:
    a, b = operands(lens, k, n, trans_b, dtype, device)
    group_lens = lens_tensor(lens, device)
    poison(device)
    out = grouped_gemm_fp8(a, b, group_lens, trans_b=trans_b, out_dtype=out_dtype, config=cfg)
    assert_written("out", out, (sum(lens), n), out_dtype or dtype)
    grad = randn(out.shape, out.dtype, device)
    poison(device)
    out.backward(grad)
    assert_written("a.grad", a.grad, a.shape, dtype)
    assert_written("b.grad", b.grad, b.shape, dtype)
    assert_empty_groups_zero(b.grad, lens)
    snrs = {}
    for name, x, ref in zip(("out", "a.grad", "b.grad"), (out, a.grad, b.grad), reference(a, b, lens, trans_b, grad)):
        snrs[name] = snr_db(float(ref.pow(2).sum()), float((x.detach().cpu().double() - ref).pow(2).sum()))
    return snrs


@pytest.mark.parametrize("gran_id", list(FP8_GRANULARITIES))
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID], ids=["E4M3", "HYBRID"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["NN", "NT"])
def test_grouped_gemm_fp8_snr(device, trans_b, fmt, gran_id):
    cfg = Float8QuantConfig(format=fmt, **FP8_GRANULARITIES[gran_id])
    snrs = fp8_snrs(device, FP8_LENS, FP8_K, FP8_N, trans_b, cfg)
    gate = MIN_SNR_DB[fmt]
    shown = {name: round(db, 2) for name, db in snrs.items()}
    assert min(snrs.values()) >= gate, f"{cfg.tag()}: SNR below {gate} dB: {shown}"


@pytest.mark.parametrize("gran_id", ["tensorwise", "rowwise", "blockwise128"])
@pytest.mark.parametrize("dtype,out_dtype", [(BF16, FP32), (FP32, None), (FP32, BF16)],
                         ids=["bf16_to_fp32", "fp32", "fp32_to_bf16"])
def test_grouped_gemm_fp8_dtypes(device, dtype, out_dtype, gran_id):
    cfg = Float8QuantConfig(format=Format.E4M3, **FP8_GRANULARITIES[gran_id])
    snrs = fp8_snrs(device, FP8_LENS, FP8_K, FP8_N, True, cfg, dtype=dtype, out_dtype=out_dtype)
    assert min(snrs.values()) >= MIN_SNR_DB[Format.E4M3], snrs


def test_grouped_gemm_fp8_odd_shapes(device):
    cfg = Float8QuantConfig(format="hybrid", granularity=G.BLOCKWISE, block_size=32)
    snrs = fp8_snrs(device, [0, 70, 3, 0, 55], 97, 45, True, cfg)
    assert min(snrs.values()) >= MIN_SNR_DB[Format.HYBRID], snrs


def test_grouped_gemm_fp8_mx_is_refused():
    cfg = Float8QuantConfig(granularity=G.MX_BLOCKWISE, scale_dtype="e8m0")
    a, b = operands([4, 4], 32, 16, True, BF16, "cpu")
    with pytest.raises(ValueError, match="MX_BLOCKWISE is not supported for grouped"):
        grouped_gemm_fp8(a, b, lens_tensor([4, 4], "cpu"), config=cfg)
    with pytest.raises(ValueError, match="MX_BLOCKWISE is not supported for grouped"):
        turbo.explain("grouped_gemm_fp8", a, b, lens_tensor([4, 4], "cpu"), config=cfg)
    with pytest.raises(ValueError, match="MX_BLOCKWISE is not supported for grouped"):
        torch.ops.turbo_dispatch.grouped_gemm_fp8(a, b, lens_tensor([4, 4], "cpu"), None, True, None, "e4m3",
                                                  "mx_blockwise", 32, "e8m0")


# -- the custom-op (torch.compile) path agrees with the eager fast path ------------------------------
def _grads_of(fn, a, b, grad):
    a, b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    out = fn(a, b)
    out.backward(grad)
    return out.detach(), a.grad, b.grad


def assert_same(eager, op, device) -> None:
    """Identical on the CPU (same code, same order); on a GPU within assert_close's default
    tolerance, in case a kernel's reduction order is not bitwise reproducible."""
    exact = dict(rtol=0, atol=0) if device == "cpu" else {}
    for name, x, y in zip(("out", "a.grad", "b.grad"), eager, op):
        assert x.dtype == y.dtype, name
        torch.testing.assert_close(y, x, **exact, msg=lambda s, name=name: f"{name}: {s}")


@pytest.mark.parametrize("dtype_id", ["fp32", "bf16"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["NN", "NT"])
def test_custom_op_matches_eager(device, trans_b, dtype_id):
    lens, dtype = LENS["skewed"], DTYPES[dtype_id]
    a, b = operands(lens, 64, 48, trans_b, dtype, device, requires_grad=False)
    group_lens = lens_tensor(lens, device)
    grad = randn((sum(lens), 48), dtype, device)
    eager = _grads_of(lambda x, y: grouped_gemm(x, y, group_lens, trans_b=trans_b), a, b, grad)
    op = _grads_of(lambda x, y: torch.ops.turbo_dispatch.grouped_gemm(x, y, group_lens, None, trans_b), a, b, grad)
    assert_same(eager, op, device)


@pytest.mark.parametrize("fmt_gran", [("E4M3", "tensorwise"), ("HYBRID", "rowwise"), ("E4M3", "blockwise128"),
                                      ("HYBRID", "blockwise32")], ids="-".join)
@pytest.mark.parametrize("trans_b", [False, True], ids=["NN", "NT"])
def test_fp8_custom_op_matches_eager(device, trans_b, fmt_gran):
    fmt, gran_id = fmt_gran
    cfg = Float8QuantConfig(format=fmt, **FP8_GRANULARITIES[gran_id])
    a, b = operands(FP8_LENS, FP8_K, FP8_N, trans_b, BF16, device, requires_grad=False)
    group_lens = lens_tensor(FP8_LENS, device)
    grad = randn((sum(FP8_LENS), FP8_N), BF16, device)
    eager = _grads_of(lambda x, y: grouped_gemm_fp8(x, y, group_lens, None, trans_b, None, cfg), a, b, grad)
    op = _grads_of(lambda x, y: torch.ops.turbo_dispatch.grouped_gemm_fp8(
        x, y, group_lens, None, trans_b, None, cfg.format.value, cfg.granularity.value, cfg.block_size,
        cfg.scale_dtype.value), a, b, grad)
    assert_same(eager, op, device)


@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)], ids=["both", "a", "b"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["NN", "NT"])
def test_fp8_blockwise_step_op_matches_eager(device, trans_b, needs, fmt, monkeypatch):
    """The compiled path's blockwise step (grouped_gemm_fp8_step: each operand quantised once,
    the backward's GEMMs on pre-quantised operands) against the eager step, and both against the
    per-GEMM quantisation they replace: the same values, so the same bits on the CPU."""
    from turbo_dispatch.ops import grouped_gemm_autograd

    cfg = Float8QuantConfig(format=fmt, granularity="blockwise", block_size=32)
    a0, b0 = operands(FP8_LENS, FP8_K, FP8_N, trans_b, BF16, device, requires_grad=False)
    group_lens = lens_tensor(FP8_LENS, device)
    offs = torch.nn.functional.pad(group_lens.cumsum(0), (1, 0))
    grad = randn((sum(FP8_LENS), FP8_N), BF16, device)

    def run(fn):
        a, b = a0.detach().clone().requires_grad_(needs[0]), b0.detach().clone().requires_grad_(needs[1])
        out = fn(a, b)
        out.backward(grad)
        return out.detach(), a.grad, b.grad

    def step_op(x, y):
        return torch.ops.turbo_dispatch.grouped_gemm_fp8_step(x, y, group_lens, offs, trans_b, None, cfg.format.value,
                                                              cfg.block_size, cfg.scale_dtype.value, *needs)[0]

    eager = run(lambda x, y: grouped_gemm_fp8(x, y, group_lens, None, trans_b, None, cfg))
    op = run(step_op)
    monkeypatch.setattr(grouped_gemm_autograd, "step_reuses_quantization", lambda c: False)
    per_gemm = run(lambda x, y: grouped_gemm_fp8(x, y, group_lens, None, trans_b, None, cfg))
    for name, x, y, z in zip(("out", "a.grad", "b.grad"), eager, op, per_gemm):
        assert (x is None) == (y is None) == (z is None), name
        if x is not None:
            assert torch.equal(x, y) and torch.equal(x, z), name


def test_fp8_blockwise_step_saves_fp8_not_the_inputs():
    """What the reusing step keeps for the backward: a's token runs and b's dgrad-order tiles in
    fp8 (with their scales), not bf16 a and b."""
    cfg = Float8QuantConfig(granularity="blockwise", block_size=32)
    a, b = operands(FP8_LENS, FP8_K, FP8_N, True, BF16, "cpu", requires_grad=True)
    out = grouped_gemm_fp8(a, b, lens_tensor(FP8_LENS, "cpu"), None, True, None, cfg)
    saved = out.grad_fn.saved_tensors
    fp8 = [t for t in saved if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 2 and not any(t.dtype == BF16 and t.dim() > 1 for t in saved)
    a_data, b_data = fp8
    assert a_data.shape == a.shape and a_data.stride(0) == 1  # token-contiguous, as the wgrad reads it
    assert b_data.shape == b.shape and b_data.stride(1) == 1  # stored [G, K, N]: K-major for the dgrad


opcheck = getattr(torch.library, "opcheck", None)


@pytest.mark.skipif(opcheck is None, reason="this torch has no torch.library.opcheck")
@pytest.mark.parametrize("trans_b", [False, True], ids=["NN", "NT"])
def test_opcheck(device, trans_b):
    lens = [3, 0, 5]
    a, b = operands(lens, 16, 8, trans_b, FP32, device)
    group_lens = lens_tensor(lens, device)
    offs = torch.nn.functional.pad(group_lens.cumsum(0), (1, 0))
    ops = torch.ops.turbo_dispatch
    opcheck(ops.grouped_gemm.default, (a, b, group_lens, offs, trans_b))
    opcheck(ops.grouped_gemm.default, (a, b, group_lens, None, trans_b))
    x, y = randn((8, 16), FP32, device), randn((8, 24), FP32, device)
    opcheck(ops.grouped_gemm_variable_k.default, (x, y, group_lens, offs))
    a8, b8 = operands(lens, 32, 16, trans_b, BF16, device)
    opcheck(ops.grouped_gemm_fp8.default, (a8, b8, group_lens, offs, trans_b, None, "hybrid", "blockwise", 16, "fp32"))
    opcheck(ops.grouped_gemm_fp8_raw.default, (x.to(BF16), y.to(BF16), group_lens, offs, False, True, BF16,
                                               torch.float8_e4m3fn, torch.float8_e5m2, "rowwise", None, False))
    a16 = a8.detach().requires_grad_()
    b16 = b8.detach().requires_grad_()
    # Not test_aot_dispatch_dynamic: it multiplies every output by a bf16 cotangent, and the fp8
    # outputs (saved for the backward, non-differentiable) refuse that promotion. The compiled
    # forward + backward is compared with the eager one in test_compiled_matches_eager.
    opcheck(ops.grouped_gemm_fp8_step.default, (a16, b16, group_lens, offs, trans_b, None, "hybrid", 16, "fp32",
                                                True, True),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    opcheck(ops.fp8_quantize_both.default, (a8.detach(), torch.float8_e4m3fn, 16, False))
    opcheck(ops.fp8_quantize_both.default, (b8.detach(), torch.float8_e5m2, 16, True))


# -- torch.compile(fullgraph=True) -----------------------------------------------------------------
COMPILE_CASES = {
    "fp32-NN-aot_eager": (FP32, False, None, "aot_eager"),
    "bf16-NT-aot_eager": (BF16, True, None, "aot_eager"),
    "fp8-rowwise-NT-aot_eager": (BF16, True, Float8QuantConfig(granularity=G.ROWWISE), "aot_eager"),
    "fp8-hybrid-blockwise32-NN-aot_eager": (BF16, False, Float8QuantConfig(format="hybrid", granularity=G.BLOCKWISE,
                                                                           block_size=32), "aot_eager"),
    "fp32-NT-inductor": (FP32, True, None, "inductor"),
    # The blockwise step's custom op under inductor: its fp8 side outputs saved for the backward.
    "fp8-blockwise32-NT-inductor": (BF16, True, Float8QuantConfig(granularity=G.BLOCKWISE, block_size=32), "inductor"),
}


def _step(fn, a, b, group_lens, grad):
    a, b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    out = fn(a, b, group_lens)
    out.backward(grad)
    return out.detach(), a.grad, b.grad


@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_compiled_matches_eager(device, case, fresh_dynamo):
    dtype, trans_b, cfg, backend = COMPILE_CASES[case]
    k, n = 32, 48

    def fn(a, b, group_lens):
        if cfg is None:
            return grouped_gemm(a, b, group_lens, trans_b=trans_b)
        return grouped_gemm_fp8(a, b, group_lens, trans_b=trans_b, config=cfg)

    compiled = torch.compile(fn, fullgraph=True, backend=backend)  # fullgraph: a graph break raises
    for lens in (LENS["empty-groups"], [2, 9, 0, 0, 4, 2]):  # same G and M_total, new routing: no recompile needed
        a, b = operands(lens, k, n, trans_b, dtype, device, requires_grad=False)
        group_lens = lens_tensor(lens, device)
        grad = randn((sum(lens), n), dtype, device)
        want = _step(fn, a, b, group_lens, grad)
        got = _step(compiled, a, b, group_lens, grad)
        for name, x, y in zip(("out", "a.grad", "b.grad"), want, got):
            assert y.dtype == x.dtype and y.shape == x.shape, name
            torch.testing.assert_close(y, x, msg=lambda s, name=name: f"{name}: {s}")


@pytest.mark.parametrize("case", [c for c in COMPILE_CASES if c.endswith("aot_eager")])
def test_no_graph_break(case, fresh_dynamo):
    dtype, trans_b, cfg, _ = COMPILE_CASES[case]
    layer = turbo.modules.GroupedLinear(4, 32, 16, dtype=dtype, fp8_config=cfg)
    x = randn((20, 32), dtype, "cpu", True)

    def step(x, group_lens):
        return torch.nn.functional.gelu(layer(x, group_lens)).sum()

    explanation = torch._dynamo.explain(step)(x, lens_tensor([5, 0, 12, 3], "cpu"))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


# -- group_lens values: checked eagerly, never in the key, skipped while compiling/capturing --------
def test_key_ignores_group_lens_values():
    a, b = operands([3, 5], 16, 8, False, FP32, "cpu", requires_grad=False)
    d1 = turbo.explain("grouped_gemm", a, b, lens_tensor([3, 5], "cpu"))
    d2 = turbo.explain("grouped_gemm", a, b, lens_tensor([8, 0], "cpu"))
    assert d1.problem == d2.problem
    assert "g=2,m=8,n=8,k=16" in str(d1)


def test_value_check_skipped_while_compiling(monkeypatch):
    bad = lens_tensor([3, 6], "cpu")  # more tokens than rows (fewer is a padded buffer, which is fine)
    gg_module.check_group_lens_values("grouped_gemm", lens_tensor([3, 4], "cpu"), None, 8)
    with pytest.raises(ValueError, match="sum to at most M_total"):
        gg_module.check_group_lens_values("grouped_gemm", bad, None, 8)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    gg_module.check_group_lens_values("grouped_gemm", bad, None, 8)  # no device read, no error


def test_loop_path_checks_lengths_even_without_the_value_check():
    """The custom op does not run the eager value check; the loop's own host copy still catches it."""
    a, b = operands([3, 5], 16, 8, False, FP32, "cpu", requires_grad=False)
    with pytest.raises(ValueError, match="sum to at most 8"):
        torch.ops.turbo_dispatch.grouped_gemm(a, b, lens_tensor([3, 6], "cpu"), None, False)


def test_explain_shows_path():
    a, b = operands([3, 5], 16, 8, False, FP32, "cpu", requires_grad=False)
    note = " ".join(turbo.explain("grouped_gemm", a, b, lens_tensor([3, 5], "cpu")).notes)
    assert "per-group torch.mm loop" in note and "reads group_lens on the host" in note
    cfg = Float8QuantConfig(granularity=G.ROWWISE)
    a8, b8 = operands([3, 5], 32, 16, True, BF16, "cpu", requires_grad=False)
    note = " ".join(turbo.explain("grouped_gemm_fp8", a8, b8, lens_tensor([3, 5], "cpu"), config=cfg).notes)
    assert "dequantise" in note


def test_autotune_gates_and_picks_torch():
    """Autotuning synthesises group lengths from the key (make_inputs), checks against the
    float64 reference and stores the winner, for the forward, dgrad and wgrad keys alike."""
    turbo.GlobalBackendManager.set_auto_tune(True)
    lens = [3, 0, 9]
    a, b = operands(lens, 16, 8, True, FP32, "cpu")
    out = grouped_gemm(a, b, lens_tensor(lens, "cpu"), trans_b=True)
    out.backward(torch.randn_like(out))
    group_lens = lens_tensor(lens, "cpu")
    assert turbo.explain("grouped_gemm", a, b, group_lens, trans_b=True).source == "autotune"
    dgrad = gg_module.grouped_gemm_problem(out.detach(), b.detach(), group_lens, None, False)
    wgrad = gg_module.variable_k_problem(out.detach(), a.detach(), group_lens)
    for p in (dgrad, wgrad):
        assert resolve(gg_module.GROUPED_GEMM, p).source == "autotune", p
    a8, b8 = operands(lens, 32, 16, True, BF16, "cpu")
    out8 = grouped_gemm_fp8(a8, b8, lens_tensor(lens, "cpu"), config=Float8QuantConfig(granularity="rowwise"))
    out8.backward(torch.randn_like(out8))
    cfg = Float8QuantConfig(granularity="rowwise")
    assert turbo.explain("grouped_gemm_fp8", a8, b8, lens_tensor(lens, "cpu"), config=cfg).source == "autotune"


# -- bad input: the exception type and a message that names the argument ---------------------------
def _t(*shape, dtype=FP32):
    return randn(shape, dtype, "cpu") if dtype.is_floating_point else torch.randint(1, 5, shape, dtype=dtype)


def L(*lens, dtype=torch.int64):  # noqa: N802 - reads like a literal in the table below
    return torch.tensor(lens, dtype=dtype)


I32, F64, E4M3 = torch.int32, torch.float64, torch.float8_e4m3fn
gg, gg8 = grouped_gemm, grouped_gemm_fp8

BAD_INPUTS = {
    "lens-sum-too-large": (lambda: gg(_t(7, 8), _t(2, 8, 4), L(5, 3)), ValueError,
                           "sum to at most M_total = a.shape.0. = 7"),
    "lens-negative": (lambda: gg(_t(7, 8), _t(2, 8, 4), L(9, -2)), ValueError, "non-negative"),
    "lens-int32": (lambda: gg(_t(7, 8), _t(2, 8, 4), L(3, 4, dtype=I32)), TypeError, "group_lens must be an int64"),
    "lens-float": (lambda: gg(_t(7, 8), _t(2, 8, 4), L(3, 4, dtype=FP32)), TypeError, "group_lens must be an int64"),
    "lens-list": (lambda: gg(_t(7, 8), _t(2, 8, 4), [3, 4]), TypeError, "group_lens must be a torch.Tensor"),
    "lens-2d": (lambda: gg(_t(7, 8), _t(2, 8, 4), L(3, 4)[None]), ValueError, "group_lens must be a 1-D"),
    "b-wrong-G": (lambda: gg(_t(7, 8), _t(3, 8, 4), L(3, 4)), ValueError, "b has G=3 groups"),
    "k-mismatch": (lambda: gg(_t(7, 8), _t(2, 9, 4), L(3, 4)), ValueError, "inner dimensions"),
    "k-mismatch-trans": (lambda: gg(_t(7, 8), _t(2, 8, 4), L(3, 4), trans_b=True), ValueError, "inner dimensions"),
    "b-2d": (lambda: gg(_t(7, 8), _t(8, 4), L(3, 4)), ValueError, "b must be a 3-D"),
    "b-4d": (lambda: gg(_t(7, 8), _t(1, 2, 8, 4), L(3, 4)), ValueError, "b must be a 3-D"),
    "a-3d": (lambda: gg(_t(1, 7, 8), _t(2, 8, 4), L(3, 4)), ValueError, "a must be a 2-D"),
    "a-int32": (lambda: gg(_t(7, 8, dtype=I32), _t(2, 8, 4, dtype=I32), L(3, 4)), TypeError, "a.dtype"),
    "a-float64": (lambda: gg(_t(7, 8, dtype=F64), _t(2, 8, 4, dtype=F64), L(3, 4)), TypeError, "a.dtype"),
    "mixed-dtypes": (lambda: gg(_t(7, 8), _t(2, 8, 4, dtype=BF16), L(3, 4)), TypeError, "same dtype"),
    "trans_b-int": (lambda: gg(_t(7, 8), _t(2, 8, 4), L(3, 4), trans_b=0), TypeError, "trans_b"),
    "offs-wrong-length": (lambda: gg(_t(7, 8), _t(2, 8, 4), L(3, 4), L(0, 7)), ValueError, "G . 1 = 3 entries"),
    "offs-float": (lambda: gg(_t(7, 8), _t(2, 8, 4), L(3, 4), L(0, 3, 7, dtype=FP32)), TypeError,
                   "group_offs must be an int32 or int64"),
    "offs-int32-inconsistent": (lambda: gg(_t(7, 8), _t(2, 8, 4), L(3, 4), L(0, 4, 7, dtype=I32)), ValueError,
                                "prefix sums"),
    "offs-inconsistent": (lambda: gg(_t(7, 8), _t(2, 8, 4), L(3, 4), L(0, 4, 7)), ValueError, "prefix sums"),
    # fp8
    "fp8-lens-sum": (lambda: gg8(_t(7, 32), _t(2, 16, 32), L(5, 3)), ValueError, "sum to at most M_total"),
    "fp8-lens-int32": (lambda: gg8(_t(7, 32), _t(2, 16, 32), L(3, 4, dtype=I32)), TypeError, "int64"),
    "fp8-b-wrong-G": (lambda: gg8(_t(7, 32), _t(3, 16, 32), L(3, 4)), ValueError, "b has G=3 groups"),
    "fp8-k-mismatch": (lambda: gg8(_t(7, 32), _t(2, 16, 31), L(3, 4)), ValueError, "inner dimensions"),
    "fp8-b-2d": (lambda: gg8(_t(7, 32), _t(16, 32), L(3, 4)), ValueError, "b must be a 3-D"),
    "fp8-int32-a": (lambda: gg8(_t(7, 32, dtype=I32), _t(2, 16, 32), L(3, 4)), TypeError, "a.dtype"),
    "fp8-out_dtype-fp8": (lambda: gg8(_t(7, 32), _t(2, 16, 32), L(3, 4), out_dtype=E4M3), TypeError, "out_dtype"),
    "fp8-config-str": (lambda: gg8(_t(7, 32), _t(2, 16, 32), L(3, 4), config="e4m3"), TypeError, "config"),
    # module
    "module-fp8_config-str": (lambda: turbo.modules.GroupedLinear(2, 8, 4, fp8_config="e4m3"), TypeError,
                              "fp8_config"),
    "module-zero-groups": (lambda: turbo.modules.GroupedLinear(0, 8, 4), ValueError, "num_groups"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input(case):
    call, exc, match = BAD_INPUTS[case]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.gpu
def test_bad_input_devices_gpu(monkeypatch):
    a, b = randn((7, 8), BF16, "cuda"), randn((2, 8, 4), BF16, "cuda")
    with pytest.raises(ValueError, match="group_lens must be on a's device"):
        grouped_gemm(a, b, L(3, 4))
    with pytest.raises(ValueError, match="same device"):
        grouped_gemm(a, b.cpu(), L(3, 4).cuda())
    # On a GPU the value check costs a sync, so it is opt-in. A sum below M_total is a padded
    # buffer (valid); above it, rows would be read past the end.
    monkeypatch.setenv("PRIMUS_TURBO_VALIDATE_GROUP_LENS", "1")
    with pytest.raises(ValueError, match="sum to at most M_total"):
        grouped_gemm(a, b, L(4, 4).cuda())


# -- modules.GroupedLinear vs per-group nn.functional.linear ------------------------------------------
def per_group_linear(x, weight, lens):
    pieces, start = [], 0
    for i, length in enumerate(lens):
        pieces.append(torch.nn.functional.linear(x[start:start + length], weight[i]))
        start += length
    return torch.cat(pieces)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_grouped_linear_matches_per_group_linear(device, dtype):
    lens = LENS["skewed"]
    layer = turbo.modules.GroupedLinear(len(lens), 40, 24, device=device, dtype=dtype)
    assert layer.weight.shape == (len(lens), 24, 40)
    assert float(layer.weight.detach().abs().max()) <= 1.01 / math.sqrt(40)  # nn.Linear's bound (+ rounding)
    weight_ref = layer.weight.detach().clone().requires_grad_()
    x = randn((sum(lens), 40), dtype, device, True)
    x_ref = x.detach().clone().requires_grad_()
    out = layer(x, lens_tensor(lens, device))
    out_ref = per_group_linear(x_ref, weight_ref, lens)
    grad = randn(out.shape, dtype, device)
    out.backward(grad)
    out_ref.backward(grad)
    tol = rel_tol(dtype, device)
    for name, got, want in (("out", out, out_ref), ("x.grad", x.grad, x_ref.grad),
                            ("weight.grad", layer.weight.grad, weight_ref.grad)):
        assert_written(name, got, want.shape, dtype)
        err = rel_error(got, want)
        assert err <= tol, f"{name}: relative error vs per-group F.linear {err:.3e} > {tol:.0e}"
    assert_empty_groups_zero(layer.weight.grad, lens)


def test_grouped_linear_fp8(device):
    cfg = Float8QuantConfig(format="hybrid", granularity=G.BLOCKWISE, block_size=128)
    layer = turbo.modules.GroupedLinear(len(FP8_LENS), FP8_K, FP8_N, device=device, dtype=BF16, fp8_config=cfg)
    assert "fp8=hybrid/blockwise128" in repr(layer)
    x = randn((sum(FP8_LENS), FP8_K), BF16, device, True)
    out = layer(x, lens_tensor(FP8_LENS, device))
    grad = randn(out.shape, BF16, device)
    out.backward(grad)
    ref, ref_gx, ref_gw = reference(x, layer.weight, FP8_LENS, True, grad)
    for name, got, want in (("out", out, ref), ("x.grad", x.grad, ref_gx), ("weight.grad", layer.weight.grad, ref_gw)):
        db = snr_db(float(want.pow(2).sum()), float((got.detach().cpu().double() - want).pow(2).sum()))
        assert db >= MIN_SNR_DB[Format.HYBRID], (name, db)


# -- GPU only: the sync-free fast paths, capture, and plain torch side by side ------------------------
def _note(op, *args, **kwargs) -> str:
    return " ".join(turbo.explain(op, *args, **kwargs).notes)


def _sm90_or_sm100() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)


@pytest.mark.gpu
@pytest.mark.parametrize("trans_b", [False, True], ids=["NN", "NT"])
def test_gpu_bf16_matches_plain_torch(trans_b):
    """bf16 on the GPU: ours vs plain torch (per-group matmul autograd in bf16, and torch._grouped_mm)."""
    lens = [0, 300, 5, 0, 1200, 17, 0]
    a, b = operands(lens, 512, 256, trans_b, BF16, "cuda")
    group_lens = lens_tensor(lens, "cuda")
    if _sm90_or_sm100():
        assert "torch._grouped_mm" in _note("grouped_gemm", a, b, group_lens, trans_b=trans_b)
    out = grouped_gemm(a, b, group_lens, trans_b=trans_b)
    grad = randn(out.shape, BF16, "cuda")
    out.backward(grad)
    a_t, b_t = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    out_t = per_group_linear(a_t, b_t, lens) if trans_b else per_group_linear(a_t, b_t.transpose(1, 2), lens)
    out_t.backward(grad)
    for name, got, want in (("out", out, out_t), ("a.grad", a.grad, a_t.grad), ("b.grad", b.grad, b_t.grad)):
        assert rel_error(got, want) <= 1e-2, name
    assert_empty_groups_zero(b.grad, lens)
    if hasattr(torch, "_grouped_mm") and _sm90_or_sm100():
        offs = torch.cumsum(group_lens, 0).to(torch.int32)
        direct = torch._grouped_mm(a.detach(), b.detach().transpose(1, 2) if trans_b else b.detach(), offs=offs)
        assert rel_error(out, direct) <= 1e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay_with_new_routing():
    """The bf16 fast path syncs nothing: forward + backward are captured once, then replayed with a
    different routing (same G and M_total) written into the same group_lens tensor."""
    if not _sm90_or_sm100() or not hasattr(torch, "_grouped_mm"):
        pytest.skip("needs torch._grouped_mm on sm_90/sm_100")
    lens1, lens2 = [64, 0, 128, 64], [0, 200, 8, 48]
    a, b = operands(lens1, 128, 256, True, BF16, "cuda")
    grad = randn((256, 256), BF16, "cuda")
    group_lens = lens_tensor(lens1, "cuda")

    def step():
        out = grouped_gemm(a, b, group_lens, trans_b=True)
        ga, gb = torch.autograd.grad(out, (a, b), grad)
        return out, ga, gb

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up (resolves decisions) on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for lens in (lens1, lens2):
        group_lens.copy_(lens_tensor(lens, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(a, b, lens, True, grad)
        for name, got, want in zip(("out", "a.grad", "b.grad"), captured, ref):
            assert rel_error(got, want) <= 1e-2, (lens, name)
        assert_empty_groups_zero(captured[2], lens)


@pytest.mark.gpu
def test_gpu_fp8_scaled_grouped_mm_is_used():
    """Rowwise/tensorwise e4m3 forward with the TORCH backend pinned runs torch._scaled_grouped_mm
    (not the emulation) on sm_90. (Unpinned, the dispatcher now prefers the TRITON kernels.)"""
    from turbo_dispatch.backends.torch import grouped_gemm as backend

    if not _sm90_or_sm100() or not hasattr(torch, "_scaled_grouped_mm"):
        pytest.skip("needs torch._scaled_grouped_mm on sm_90/sm_100")
    turbo.GlobalBackendManager.set_grouped_gemm_backend("TORCH", precision="fp8")
    try:
        for gran in ("rowwise", "tensorwise"):
            cfg = Float8QuantConfig(granularity=gran)
            a, b = operands(FP8_LENS, FP8_K, FP8_N, True, BF16, "cuda")
            assert "torch._scaled_grouped_mm" in _note("grouped_gemm_fp8", a, b, lens_tensor(FP8_LENS, "cuda"),
                                                       config=cfg)
            snrs = fp8_snrs("cuda", FP8_LENS, FP8_K, FP8_N, True, cfg)
            assert not backend._SCALED_REFUSED, backend._SCALED_REFUSED
            assert min(snrs.values()) >= 25.0, snrs
    finally:
        turbo.GlobalBackendManager.set_grouped_gemm_backend(None, precision="fp8")


@pytest.mark.gpu
def test_gpu_loop_path_refuses_capture():
    """fp32 runs the per-group loop; under CUDA graph capture it says why instead of a CUDA error."""
    lens = [3, 5]
    a, b = operands(lens, 16, 8, False, FP32, "cuda", requires_grad=False)
    group_lens = lens_tensor(lens, "cuda")
    grouped_gemm(a, b, group_lens)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        with torch.cuda.graph(graph):
            grouped_gemm(a, b, group_lens)


def test_doctests():
    import doctest

    for name in ("turbo_dispatch.ops.grouped_gemm", "turbo_dispatch.modules.grouped_linear"):
        result = doctest.testmod(importlib.import_module(name))
        assert result.attempted > 0 and result.failed == 0, (name, result)


def test_scaled_grouped_refusal_is_per_key_and_device_failures_raise(monkeypatch):
    """A run-time rejection by torch._scaled_grouped_mm emulates that key only; an OOM or CUDA
    error is raised, never turned into a silent slow path."""
    from turbo_dispatch.backends.torch import grouped_gemm as backend
    from turbo_dispatch.low_precision import quantize

    monkeypatch.setattr(backend, "_SCALED_REFUSED", {})
    from turbo_dispatch.ops.grouped_gemm import GroupedGemmFp8Problem

    e4m3 = torch.float8_e4m3fn
    p1 = GroupedGemmFp8Problem(2, 6, 8, 32, True, False, BF16, BF16, BF16, e4m3, e4m3, G.ROWWISE, None, False, "cuda")
    p2 = p1._replace(m=7)
    qa = quantize(torch.randn(6, 32), torch.float8_e4m3fn, "rowwise", axis=1)
    qb = quantize(torch.randn(2, 8, 32), torch.float8_e4m3fn, "rowwise", axis=2)
    offs = torch.tensor([0, 3, 6])

    def refuse(*args, **kwargs):
        raise RuntimeError("Expected mat_b to be column-major")

    monkeypatch.setattr(torch, "_scaled_grouped_mm", refuse, raising=False)
    assert backend._scaled_grouped(p1, qa, qb, offs) is None
    assert list(backend._SCALED_REFUSED) == [p1] and "column-major" in backend._SCALED_REFUSED[p1]
    assert p2 not in backend._SCALED_REFUSED  # another key is not affected

    def crash(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch, "_scaled_grouped_mm", crash, raising=False)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        backend._scaled_grouped(p2, qa, qb, offs)
    assert p2 not in backend._SCALED_REFUSED


@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64])
def test_group_offs_int32_and_int64_give_the_same_result_and_grads(offs_dtype):
    """group_offs may be int32 (what the op computes itself and torch._grouped_mm reads) or int64;
    forward and both gradients are the same either way, and equal the computed-offsets call."""
    torch.manual_seed(3)
    lens = torch.tensor([5, 0, 9, 3])
    a = torch.randn(17, 12, dtype=torch.float64).float().requires_grad_()
    b = torch.randn(4, 7, 12).requires_grad_()
    offs = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(offs_dtype)
    grad = torch.randn(17, 7)
    out = turbo.ops.grouped_gemm(a, b, lens, group_offs=offs, trans_b=True)
    da, db = torch.autograd.grad(out, (a, b), grad)
    out_ref = turbo.ops.grouped_gemm(a, b, lens, trans_b=True)
    da_ref, db_ref = torch.autograd.grad(out_ref, (a, b), grad)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    torch.testing.assert_close(da, da_ref, rtol=0, atol=0)
    torch.testing.assert_close(db, db_ref, rtol=0, atol=0)
    assert db[1].abs().max() == 0  # the empty group's weight gets an exact zero gradient


def test_computed_offsets_are_int32_when_the_tokens_fit():
    from turbo_dispatch.ops.grouped_gemm_routing import offsets

    lens = torch.tensor([4, 0, 6])
    offs = offsets(lens, 10)
    assert offs.dtype == torch.int32 and offs.tolist() == [0, 4, 4, 10]
    assert offsets(lens, 2**31).dtype == torch.int64
