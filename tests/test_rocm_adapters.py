"""Contract tests of the ROCm adapters (AITER, CK, HIPBLASLT's ROCm rules) on a CPU-only machine.

What these check is OUR side of each library's contract: which entry point an adapter calls,
the argument layouts and scale shapes it passes, how it re-encodes fp8 for MI300, and what it does
with the result (lse convention, autograd, restoring torch's process-global preferences). They do
NOT check AMD's kernels: the AITER library here is a stand-in (tests/fake_aiter/amd/aiter)
written in plain torch from AITER's documented semantics, the CK paths run torch's CPU kernels with
the CK preference set, and the platform check is replaced by a pretend ROCm GPU (gfx942 or
gfx950). Every result is compared with a float64 reference.

Also on the CPU: PyPI's unrelated ``aiter`` package is refused with that reason, and
``turbo-dispatch backends`` lists AITER and CK for every op they cover with the reason they cannot
run here.

``gpu``-marked tests at the end run the same checks against the real libraries on a ROCm machine
(``qa/rocm.sh``); they skip elsewhere. None of them has run yet: no AMD GPU was available.
"""
from __future__ import annotations

import importlib.util
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from turbo_dispatch.backends.aiter import attention as aiter_attention
from turbo_dispatch.backends.aiter import gemm as aiter_gemm
from turbo_dispatch.backends.aiter import grouped_gemm as aiter_grouped
from turbo_dispatch.backends.aiter import library
from turbo_dispatch.backends.blaslt import gemm as blaslt
from turbo_dispatch.backends.blaslt import rocm
from turbo_dispatch.backends.ck import attention as ck_attention
from turbo_dispatch.backends.ck import gemm as ck_gemm
from turbo_dispatch.backends.torch.attention import TorchAttention
from turbo_dispatch.cli import main
from turbo_dispatch.low_precision import ScalingGranularity, dequantize, quantize
from turbo_dispatch.ops._common import rel_error
from turbo_dispatch.ops.attention import ATTENTION, attention_problem, attention_varlen_problem
from turbo_dispatch.ops.gemm import gemm_fp8_problem, gemm_problem
from turbo_dispatch.ops.grouped_gemm import grouped_gemm_problem
from turbo_dispatch.ops.grouped_gemm_problem import variable_k_problem
from turbo_dispatch.ops.grouped_gemm_routing import offsets
from turbo_dispatch.ops.grouped_gemm_spec import grouped_reference

FAKE = Path(__file__).parent / "fake_aiter"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TW, RW, BW = ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE, ScalingGranularity.BLOCKWISE
ON_ROCM = bool(getattr(torch.version, "hip", None))


def _drop_aiter_modules() -> None:
    for name in [n for n in sys.modules if n == "aiter" or n.startswith("aiter.")]:
        del sys.modules[name]


@pytest.fixture
def pretend_rocm(monkeypatch):
    """Makes the adapters see a ROCm build with one GPU of ``arch`` (gfx942 unless called again)."""
    def use(arch: str = "gfx942") -> None:
        monkeypatch.setattr(rocm, "rocm_unavailable", lambda: None)
        monkeypatch.setattr(rocm, "gfx_arch", lambda: arch)
    use()
    return use


@pytest.fixture
def fake_aiter(monkeypatch, pretend_rocm):
    """``install(kind, arch)`` puts tests/fake_aiter/<kind> first on sys.path (``amd``: the AITER
    stand-in, returned with its fp8 dtype set for ``arch``; ``pypi``: PyPI's unrelated package)."""
    def install(kind: str = "amd", arch: str = "gfx942"):
        _drop_aiter_modules()
        library.reset()
        monkeypatch.syspath_prepend(str(FAKE / kind))
        monkeypatch.setattr(aiter_gemm, "_hipb_created", False)
        pretend_rocm(arch)
        if kind != "amd":
            return None
        import aiter

        aiter.dtypes.fp8 = torch.float8_e4m3fnuz if arch == "gfx942" else E4M3
        aiter.CALLS.clear()
        return aiter
    yield install
    _drop_aiter_modules()
    library.reset()


def _rocm(p):
    return p._replace(platform="rocm")


def _called(aiter) -> list[str]:
    return [name for name, _ in aiter.CALLS]


# -- availability and the CLI ---------------------------------------------------------------------------
ADAPTERS = {"gemm": aiter_gemm.AiterGemm, "gemm_fp8": aiter_gemm.AiterGemmFp8,
            "grouped_gemm": aiter_grouped.AiterGroupedGemm, "attention": aiter_attention.AiterAttention}


@pytest.mark.skipif(ON_ROCM, reason="checks the reason given on a CPU/CUDA build")
def test_on_a_cpu_or_cuda_build_every_rocm_adapter_says_it_needs_rocm():
    for adapter in [*(cls() for cls in ADAPTERS.values()), ck_gemm.CkGemm(), ck_attention.CkAttention()]:
        assert adapter.available().startswith("needs a ROCm build of torch; this is a "), adapter


def test_pypi_aiter_impostor_is_refused_with_that_reason(fake_aiter):
    fake_aiter("pypi")
    for cls in ADAPTERS.values():
        why = cls().available()
        assert "PyPI's unrelated asyncio-iterator package 'aiter'" in why and "amd-aiter" in why, why
    assert "aiter" not in sys.modules or not hasattr(sys.modules["aiter"], "gemm_a8w8")


def test_missing_aiter_is_refused_with_the_package_to_install(pretend_rocm, monkeypatch):
    _drop_aiter_modules()
    library.reset()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aiter" else real_find_spec(name, *a))
    try:
        why = aiter_gemm.AiterGemm().available()
    finally:
        library.reset()
    assert why.startswith("aiter is not installed") and "amd-aiter" in why


def test_missing_entry_point_is_named(fake_aiter, monkeypatch):
    aiter = fake_aiter()
    monkeypatch.delattr(aiter, "flash_attn_varlen_func")
    library.reset()
    assert "has no aiter.flash_attn_varlen_func" in aiter_attention.AiterAttention().available()


@pytest.mark.skipif(ON_ROCM, reason="checks the listing of a machine that is not ROCm")
def test_cli_lists_aiter_and_ck_for_every_op_they_cover_with_the_reason(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    covered = [("AITER", op) for op in ADAPTERS] + [("CK", "gemm"), ("CK", "attention")]
    for name, op in covered:
        line = re.search(rf"^.*\s{op}\s+{name}\s+rocm\s.*$", out, re.M)
        assert line, (name, op, out)
        assert "needs a ROCm build of torch" in line.group(0), line.group(0)


# -- AITER gemm ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (False, False), (True, False), (True, True)])
def test_aiter_gemm_passes_kmajor_operands_to_tgemm(fake_aiter, dtype, trans_a, trans_b):
    aiter = fake_aiter()
    m, n, k = 48, 40, 72
    a = torch.randn((k, m) if trans_a else (m, k), dtype=dtype)
    b = torch.randn((n, k) if trans_b else (k, n), dtype=dtype)
    p = _rocm(gemm_problem(a, b, trans_a, trans_b))
    ad = aiter_gemm.AiterGemm()
    assert ad.available() is None and ad.supports(p) is None
    out = ad.run(p, a, b)
    ref = (a.t() if trans_a else a).double() @ (b.t() if trans_b else b).double()
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_error(out, ref) < 5e-3
    assert _called(aiter) == ["tgemm.mm"]


def test_aiter_gemm_refusals(fake_aiter):
    fake_aiter()
    ad = aiter_gemm.AiterGemm()
    a, b = torch.randn(16, 32, dtype=BF16), torch.randn(32, 8, dtype=BF16)
    p = _rocm(gemm_problem(a, b))
    assert "bf16/fp16" in ad.supports(p._replace(a_dtype=torch.float32, b_dtype=torch.float32))
    assert "writes the input dtype" in ad.supports(p._replace(out_dtype=torch.float32))
    assert "platform is cuda" in ad.supports(p._replace(platform="cuda"))
    fake_aiter(arch="gfx90a")
    assert "gfx942/gfx950" in ad.supports(p) and "gfx90a" in ad.supports(p)


# -- AITER gemm_fp8 --------------------------------------------------------------------------------------
def _fp8_case(gran, trans_a=False, trans_b=True, a_2d=False, b_2d=False, m=64, n=256, k=384, out=BF16):
    a = torch.randn((k, m) if trans_a else (m, k), dtype=BF16)
    b = torch.randn((n, k) if trans_b else (k, n), dtype=BF16)
    block = 128 if gran is BW else None
    p = _rocm(gemm_fp8_problem(a, b, trans_a, trans_b, out, E4M3, E4M3, gran, block, a_2d, b_2d))
    return p, a, b


def _fp8_reference(p, a, b) -> torch.Tensor:
    """float64 product of the operands quantised as the recipe says (the reference quantiser)."""
    lhs = a.t() if p.trans_a else a
    rhs = b if p.trans_b else b.t()
    qa = quantize(lhs, p.a_fp8, p.granularity, axis=1, block_size=p.block_size, block_2d=p.a_2d)
    qb = quantize(rhs, p.b_fp8, p.granularity, axis=1, block_size=p.block_size, block_2d=p.b_2d)
    return dequantize(qa).double() @ dequantize(qb).double().t()


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("gran,entry,scales", [
    (TW, "hipb_mm", None),
    (RW, "gemm_a8w8", {"x_scale": (64, 1), "w_scale": (256, 1)}),
    (BW, "gemm_a8w8_blockscale", {"x_scale": (64, 3), "w_scale": (2, 3)}),
])
@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (True, False)])
def test_aiter_gemm_fp8_layouts_and_scales(fake_aiter, arch, gran, entry, scales, trans_a, trans_b):
    aiter = fake_aiter(arch=arch)
    p, a, b = _fp8_case(gran, trans_a, trans_b, b_2d=gran is BW)
    ad = aiter_gemm.AiterGemmFp8()
    assert ad.available() is None and ad.supports(p) is None, ad.supports(p)
    out = ad.run(p, a, b)
    assert out.dtype == BF16 and out.shape == (p.m, p.n)
    # The stand-in computes in float64 from what it was given: a wrong scale layout, a missed
    # fnuz re-encoding or a transposed operand would show as an error far above bf16 rounding.
    assert rel_error(out, _fp8_reference(p, a, b)) < 2e-3
    (name, details), = aiter.CALLS
    assert name == entry
    if scales:
        assert {key: details[key] for key in scales} == scales
    else:
        assert details["solution_index"] == -1
        assert details["mat2_strides"] == (1, p.k)  # wq [N, K] row-major, seen as column-major [K, N]
    assert ("e4m3fnuz" in ad.describe(p)) == (arch == "gfx942")


def test_aiter_gemm_fp8_tiled_first_operand_runs_swapped(fake_aiter):
    aiter = fake_aiter()
    p, a, b = _fp8_case(BW, trans_a=False, trans_b=False, a_2d=True, b_2d=False, m=256, n=64)
    ad = aiter_gemm.AiterGemmFp8()
    assert ad.supports(p) is None
    out = ad.run(p, a, b)
    assert rel_error(out, _fp8_reference(p, a, b)) < 2e-3
    (name, details), = aiter.CALLS
    assert name == "gemm_a8w8_blockscale" and details == {"x_scale": (64, 3), "w_scale": (2, 3)}


def test_aiter_gemm_fp8_takes_a_prequantised_operand(fake_aiter):
    fake_aiter()
    p, a, b = _fp8_case(RW)
    qa = quantize(a, E4M3, RW, axis=1)
    pq = gemm_fp8_problem(qa, b, False, True, BF16, E4M3, E4M3, RW, None, False, False)._replace(platform="rocm")
    assert pq.a_dtype == E4M3
    out = aiter_gemm.AiterGemmFp8().run(pq, qa, b)
    assert rel_error(out, _fp8_reference(p, a, b)) < 2e-3


def test_aiter_gemm_fp8_refusals(fake_aiter):
    fake_aiter()
    ad = aiter_gemm.AiterGemmFp8()
    p, _, _ = _fp8_case(RW)
    assert "e4m3 operands only" in ad.supports(p._replace(b_fp8=E5M2))
    assert "bf16/fp16" in ad.supports(p._replace(out_dtype=torch.float32))
    assert "divisible by 16" in ad.supports(p._replace(k=100))
    assert "MX_BLOCKWISE" in ad.supports(p._replace(granularity=ScalingGranularity.MX_BLOCKWISE, block_size=32)) \
        or "mx_blockwise" in ad.supports(p._replace(granularity=ScalingGranularity.MX_BLOCKWISE, block_size=32))
    pb, _, _ = _fp8_case(BW, b_2d=True)
    assert "1x128 blocks on one operand" in ad.supports(pb._replace(b_2d=False))
    assert "128-element blocks" in ad.supports(pb._replace(block_size=64))
    assert "divisible by 128" in ad.supports(pb._replace(k=200))
    pt, _, _ = _fp8_case(TW)
    assert ad.supports(pt._replace(out_dtype=torch.float32)) is None


def test_fnuz_reencoding_is_exact_for_every_e4m3fn_value():
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = bits.view(E4M3)
    finite = values[torch.isfinite(values.float())]
    q = quantize(torch.zeros(1, finite.numel()), E4M3, TW)  # a QuantizedTensor to carry them
    q = type(q)(data=finite.reshape(1, -1), scale=torch.tensor(0.75), granularity=TW, axis=1, block_size=None,
                block_2d=False)
    data, scale = aiter_gemm.device_operand(q, torch.float8_e4m3fnuz)
    assert data.dtype == torch.float8_e4m3fnuz and float(scale) == 1.5
    assert torch.equal(data.float() * scale, finite.reshape(1, -1).float() * 0.75)


# -- AITER grouped_gemm ----------------------------------------------------------------------------------
LENS = [5, 0, 17, 9]


@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("k,n", [(24, 40), (32, 32)])
@pytest.mark.parametrize("config", ["gmm", "gmm_work_stealing"])
def test_aiter_grouped_gemm_fixed_k(fake_aiter, trans_b, k, n, config):
    aiter = fake_aiter()
    lens = torch.tensor(LENS, dtype=torch.int64)
    a = torch.randn(int(lens.sum()), k, dtype=BF16)
    b = torch.randn((len(LENS), n, k) if trans_b else (len(LENS), k, n), dtype=BF16)
    p = _rocm(grouped_gemm_problem(a, b, lens, None, trans_b))
    ad = aiter_grouped.AiterGroupedGemm()
    assert ad.available() is None and ad.supports(p) is None
    out = ad.run(p, a, b, lens, offsets(lens, a.shape[0]), config=config)
    assert rel_error(out, grouped_reference(p, (a, b, lens))) < 5e-3
    (name, details), = aiter.CALLS
    assert name == "gmm" and details["work_stealing"] == (config == "gmm_work_stealing")
    # trans_b and the K == N case go through the library's unambiguous "transposed layout 1".
    assert details["layout"] == ("layout1" if trans_b or k == n else "non-transposed")


@pytest.mark.parametrize("config", ["ptgmm", "nptgmm"])
def test_aiter_grouped_gemm_wgrad(fake_aiter, config):
    aiter = fake_aiter()
    lens = torch.tensor(LENS, dtype=torch.int64)
    x, y = torch.randn(int(lens.sum()), 24, dtype=FP16), torch.randn(int(lens.sum()), 40, dtype=FP16)
    p = _rocm(variable_k_problem(x, y, lens))
    ad = aiter_grouped.AiterGroupedGemm()
    assert ad.configs(p) == ["ptgmm", "nptgmm"]
    out = ad.run(p, x, y, lens, None, config=config)
    assert out.shape == (4, 24, 40) and torch.count_nonzero(out[1]) == 0  # the empty group: zeros
    assert rel_error(out, grouped_reference(p, (x, y, lens))) < 5e-3
    assert aiter.CALLS == [(config, {"layout": "layout1"})]


def test_aiter_grouped_gemm_no_tokens_and_refusals(fake_aiter):
    aiter = fake_aiter()
    ad = aiter_grouped.AiterGroupedGemm()
    lens = torch.zeros(3, dtype=torch.int64)
    a, b = torch.randn(0, 16, dtype=BF16), torch.randn(3, 16, 8, dtype=BF16)
    p = _rocm(grouped_gemm_problem(a, b, lens))
    assert ad.run(p, a, b, lens).shape == (0, 8)
    pv = _rocm(variable_k_problem(a, torch.randn(0, 8, dtype=BF16), lens))
    assert torch.count_nonzero(ad.run(pv, a, torch.randn(0, 8, dtype=BF16), lens)) == 0
    assert aiter.CALLS == []  # the library asserts a non-empty problem: not called
    assert "bf16/fp16" in ad.supports(p._replace(dtype=torch.float32))
    with pytest.raises(ValueError, match="unknown config"):
        ad.run(p, a, b, lens, config="ptgmm")


# -- AITER attention -------------------------------------------------------------------------------------
def _reference_grads(p, inputs, grad_out):
    leaves = [t.detach().double().requires_grad_() for t in inputs[:3]]
    out = ATTENTION.reference(p, (*leaves, *inputs[3:]))
    return out.detach(), torch.autograd.grad(out, leaves, grad_out.double())


def _reference_lse(p, inputs) -> torch.Tensor:
    """The TORCH adapter's float32 lse pass (independent of the stand-in), -inf where no key."""
    q, k, v = (t.float() for t in inputs[:3])
    return TorchAttention().forward(p._replace(dtype=torch.float32, platform="cpu", return_lse=True), q, k, v,
                                    *inputs[3:])[1]


ATTN_CASES = {
    "causal_gqa": dict(b=2, sq=24, sk=24, hq=4, hk=2, d=32, causal=True),
    "causal_sq_gt_sk": dict(b=1, sq=20, sk=12, hq=2, hk=2, d=16, causal=True),  # rows with no key
    "window": dict(b=2, sq=16, sk=28, hq=2, hk=1, d=64, window=(5, 3)),
    "dv_differs": dict(b=1, sq=18, sk=18, hq=2, hk=2, d=48, dv=32),
}


def _attn_inputs(case: dict, varlen: bool, dtype=BF16, requires_grad=True):
    b, sq, sk, hq, hk, d = (case[x] for x in ("b", "sq", "sk", "hq", "hk", "d"))
    dv = case.get("dv", d)
    kwargs = dict(causal=case.get("causal", False), window_size=case.get("window", (-1, -1)), return_lse=True)
    if varlen:
        lq, lk = [sq - 3, sq][:b] if b > 1 else [sq], [sk, sk - 5][:b] if b > 1 else [sk]
        cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
        cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
        shapes = (sum(lq), hq, d), (sum(lk), hk, d), (sum(lk), hk, dv)
        q, k, v = (torch.randn(s, dtype=dtype).requires_grad_(requires_grad) for s in shapes)
        p = attention_varlen_problem(q, k, v, cu_q, cu_k, max(lq), max(lk), **kwargs)
        return _rocm(p), (q, k, v, cu_q, cu_k)
    shapes = (b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv)
    q, k, v = (torch.randn(s, dtype=dtype).requires_grad_(requires_grad) for s in shapes)
    return _rocm(attention_problem(q, k, v, **kwargs)), (q, k, v, None, None)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_aiter_attention_forward_lse_and_backward(fake_aiter, case, varlen):
    aiter = fake_aiter()
    p, inputs = _attn_inputs(ATTN_CASES[case], varlen)
    ad = aiter_attention.AiterAttention()
    assert ad.available() is None and ad.supports(p) is None
    out, lse, _ = ad.forward(p, *inputs)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)  # the library's autograd: its backward calls mha_bwd / mha_varlen_bwd
    ref_out, ref_grads = _reference_grads(p, inputs, grad_out)
    assert rel_error(out.detach(), ref_out) < 1e-2
    for t, g in zip(inputs[:3], ref_grads):
        assert rel_error(t.grad, g) < 2e-2
    ref_lse = _reference_lse(p, inputs)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)  # the library's +inf rows become our -inf
    assert torch.allclose(lse[~empty], ref_lse[~empty], atol=1e-3)
    fwd = "flash_attn_varlen_func" if varlen else "flash_attn_func"
    assert _called(aiter) == [fwd, "mha_varlen_bwd" if varlen else "mha_bwd"]
    details = aiter.CALLS[0][1]
    assert details["window_size"] == (p.window_left, p.window_right, 0) and details["causal"] == p.causal


def test_aiter_attention_asks_for_the_lse_only_when_needed(fake_aiter):
    aiter = fake_aiter()
    p, inputs = _attn_inputs(ATTN_CASES["causal_gqa"], False)
    p = p._replace(return_lse=False)
    ad = aiter_attention.AiterAttention()
    out, lse, _ = ad.forward(p, *inputs)  # grad needed: the library's forward must be asked for its lse
    assert lse is None and aiter.CALLS[-1][1]["return_lse"] is True
    with torch.no_grad():
        ad.forward(p, *inputs)
    assert aiter.CALLS[-1][1]["return_lse"] is False


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_aiter_attention_recomputing_backward(fake_aiter, varlen):
    """``backward`` (the compiled path's) re-runs the forward through the library's autograd."""
    fake_aiter()
    p, inputs = _attn_inputs(ATTN_CASES["window"], varlen, requires_grad=False)
    ad = aiter_attention.AiterAttention()
    with torch.no_grad():
        out = ad.forward(p, *inputs)[0]
    grad_out = torch.randn_like(out)
    grads = ad.backward(p, inputs, grad_out)
    _, ref_grads = _reference_grads(p, inputs, grad_out)
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r) < 2e-2
    with pytest.raises(NotImplementedError, match="dropout"):
        ad.backward(p._replace(dropout_p=0.1), inputs, grad_out)


def test_aiter_attention_refusals(fake_aiter):
    fake_aiter()
    p, _ = _attn_inputs(ATTN_CASES["causal_gqa"], False)
    ad = aiter_attention.AiterAttention()
    assert "bf16/fp16" in ad.supports(p._replace(dtype=torch.float32))
    assert "up to 256" in ad.supports(p._replace(head_dim_v=512))
    assert "platform is cpu" in ad.supports(p._replace(platform="cpu"))


# -- CK ----------------------------------------------------------------------------------------------------
def _blas_preference():
    return torch._C._get_blas_preferred_backend()


@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (True, False)])
def test_ck_gemm_sets_the_ck_blas_preference_for_the_call_only(pretend_rocm, monkeypatch, trans_a, trans_b):
    before = _blas_preference()
    seen = []
    real_matmul = torch.matmul

    def spy(x, y):
        seen.append(_blas_preference())
        return real_matmul(x, y)

    ad = ck_gemm.CkGemm()
    assert ad.available() is None  # sets CK once and reads it back
    assert _blas_preference() == before
    a = torch.randn((24, 16) if trans_a else (16, 24), dtype=BF16)
    b = torch.randn((8, 24) if trans_b else (24, 8), dtype=BF16)
    p = _rocm(gemm_problem(a, b, trans_a, trans_b))
    assert ad.supports(p) is None
    monkeypatch.setattr(torch, "matmul", spy)
    out = ad.run(p, a, b)
    assert seen == [torch._C._BlasBackend.Ck] and _blas_preference() == before
    ref = (a.t() if trans_a else a).double() @ (b.t() if trans_b else b).double()
    assert rel_error(out, ref) < 5e-3


def test_ck_gemm_configs_and_refusals(pretend_rocm, monkeypatch):
    ad = ck_gemm.CkGemm()
    a, b = torch.randn(16, 32, dtype=FP16), torch.randn(32, 8, dtype=FP16)
    p = _rocm(gemm_problem(a, b))
    assert ad.configs(p) == (["blas"] if ck_gemm.ck4inductor_reason() else ["blas", "inductor"])
    monkeypatch.setattr(ck_gemm, "ck4inductor_reason", lambda: None)
    assert ad.configs(p) == ["blas", "inductor"]
    assert "input dtype" in ad.supports(p._replace(out_dtype=torch.float32))
    assert "bf16/fp16" in ad.supports(p._replace(a_dtype=torch.float32, b_dtype=torch.float32))
    pretend_rocm("gfx1100")
    assert "gfx1100" in ad.supports(p)
    with pytest.raises(ValueError, match="unknown config"):
        ad.run(p, a, b, config="cublas")


def test_preference_switches_are_restored_under_concurrency():
    """Two threads switching torch's BLAS preference at once (CK and hipBLAS here) each see their
    own choice inside their call, and the process-global value ends as it started."""
    before = _blas_preference()
    kind = torch._C._BlasBackend
    seen: dict = {}
    barrier = threading.Barrier(2)

    def work(library: str, target):
        barrier.wait()
        for _ in range(20):
            def body():
                time.sleep(0.001)
                seen.setdefault(library, set()).add(_blas_preference())
            blaslt.run_with_preferred_blas(library, body)

    threads = [threading.Thread(target=work, args=("ck", kind.Ck)), threading.Thread(target=work, args=("hipblas", kind.Cublas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"ck": {kind.Ck}, "hipblas": {kind.Cublas}}
    assert _blas_preference() == before


@pytest.fixture
def ck_attention_here(pretend_rocm, monkeypatch):
    """CK attention's availability on the pretend ROCm machine (this CPU torch has no CK SDPA)."""
    monkeypatch.setattr(torch.backends.cuda, "is_ck_sdpa_available", lambda: True, raising=False)
    ck_attention._unavailable.cache_clear()
    yield ck_attention.CkAttention()
    ck_attention._unavailable.cache_clear()


def test_ck_attention_runs_sdpa_flash_with_the_ck_preference(ck_attention_here, monkeypatch):
    ad = ck_attention_here
    assert ad.available() is None
    before = torch._C._get_rocm_fa_preferred_backend()
    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch._C._get_rocm_fa_preferred_backend())
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    case = dict(b=2, sq=16, sk=16, hq=2, hk=2, d=32, causal=True)
    p, inputs = _attn_inputs(case, False, requires_grad=False)
    p = p._replace(return_lse=False)
    assert ad.supports(p) is None and not ad.native_autograd
    out, lse, saved = ad.forward(p, *inputs)
    assert lse is None and torch._C._get_rocm_fa_preferred_backend() == before
    grad_out = torch.randn_like(out)
    grads = ad.backward(p, saved, grad_out)  # recomputes the forward under the switch
    assert seen == [torch._C._ROCmFABackend.Ck] * 2 and torch._C._get_rocm_fa_preferred_backend() == before
    ref_out, ref_grads = _reference_grads(p, inputs, grad_out)
    assert rel_error(out, ref_out) < 1e-2
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r) < 2e-2


def test_ck_attention_refusals(ck_attention_here):
    ad = ck_attention_here
    p, _ = _attn_inputs(dict(b=1, sq=16, sk=16, hq=2, hk=2, d=32, causal=True), False)
    assert ad.supports(p) is None
    refusals = {
        "GQA/MQA": p._replace(heads_kv=1),
        "sliding window": p._replace(window_left=4, causal=False, window_right=2),
        "top-left aligned": p._replace(seqlen_k=20),
        "varlen": p._replace(varlen=True),
        "dropout": p._replace(dropout_p=0.1),
        "deterministic": p._replace(deterministic=True),
        "multiples of 8": p._replace(head_dim_qk=36, head_dim_v=36),
        "bf16/fp16": p._replace(dtype=torch.float32),
    }
    for expected, q in refusals.items():
        assert expected in ad.supports(q), (expected, ad.supports(q))


# -- HIPBLASLT's ROCm rules -------------------------------------------------------------------------------
def test_hipblaslt_rowwise_needs_mi300(pretend_rocm, monkeypatch):
    """Rowwise torch._scaled_mm on ROCm is hipBLASLt's per-row scale mode (gfx942/gfx950), and the
    op's OCP fp8 recipes need gfx950's encodings: rowwise is offered on gfx950 only."""
    monkeypatch.setattr(blaslt, "_platform_reason", lambda platform: None)
    monkeypatch.setattr(blaslt, "_scaled_mm_unsupported", lambda p: None)  # torch's own checks: CUDA-only here
    p, _, _ = _fp8_case(RW)
    ad = blaslt.BlasLtGemmFp8()
    pretend_rocm("gfx950")
    assert ad.supports(p) is None
    pretend_rocm("gfx942")
    assert "fnuz" in ad.supports(p)
    pretend_rocm("gfx1201")
    assert "rowwise torch._scaled_mm" in ad.supports(p) and "gfx1201" in ad.supports(p)


# -- on a ROCm machine, against the real libraries ---------------------------------------------------------
def _real(adapter) -> None:
    if not ON_ROCM or not torch.cuda.is_available():
        pytest.skip("needs a ROCm build of torch and an AMD GPU")
    why = adapter.available()
    if why is not None:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (False, False), (True, False)])
@pytest.mark.parametrize("cls", [aiter_gemm.AiterGemm, ck_gemm.CkGemm])
def test_gpu_rocm_gemm(cls, trans_a, trans_b):
    ad = cls()
    _real(ad)
    m, n, k = 512, 384, 1024
    a = torch.randn((k, m) if trans_a else (m, k), dtype=BF16, device="cuda")
    b = torch.randn((n, k) if trans_b else (k, n), dtype=BF16, device="cuda")
    p = gemm_problem(a, b, trans_a, trans_b)
    if ad.supports(p) is not None:
        pytest.skip(ad.supports(p))
    ref = (a.t() if trans_a else a).double() @ (b.t() if trans_b else b).double()
    for config in ad.configs(p):
        assert rel_error(ad.run(p, a, b, config=config), ref) < 1e-2, config


@pytest.mark.gpu
@pytest.mark.parametrize("gran", [TW, RW, BW])
def test_gpu_aiter_gemm_fp8(gran):
    ad = aiter_gemm.AiterGemmFp8()
    _real(ad)
    a, b = torch.randn(512, 1024, dtype=BF16, device="cuda"), torch.randn(768, 1024, dtype=BF16, device="cuda")
    p = gemm_fp8_problem(a, b, False, True, BF16, E4M3, E4M3, gran, 128 if gran is BW else None, False, gran is BW)
    if ad.supports(p) is not None:
        pytest.skip(ad.supports(p))
    assert rel_error(ad.run(p, a, b), _fp8_reference(p, a.cpu(), b.cpu()).cuda()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("trans_b", [True, False])
def test_gpu_aiter_grouped_gemm(trans_b):
    ad = aiter_grouped.AiterGroupedGemm()
    _real(ad)
    lens = torch.tensor([300, 0, 517, 211], dtype=torch.int64, device="cuda")
    a = torch.randn(int(lens.sum()), 512, dtype=BF16, device="cuda")
    b = torch.randn((4, 256, 512) if trans_b else (4, 512, 256), dtype=BF16, device="cuda")
    p = grouped_gemm_problem(a, b, lens, None, trans_b)
    ref = grouped_reference(p, (a.cpu(), b.cpu(), lens.cpu()))
    for config in ad.configs(p):
        assert rel_error(ad.run(p, a, b, lens, config=config).cpu(), ref) < 1e-2, config
    x, y = torch.randn(int(lens.sum()), 256, dtype=BF16, device="cuda"), torch.randn(int(lens.sum()), 128,
                                                                                     dtype=BF16, device="cuda")
    pv = variable_k_problem(x, y, lens)
    ref = grouped_reference(pv, (x.cpu(), y.cpu(), lens.cpu()))
    for config in ad.configs(pv):
        assert rel_error(ad.run(pv, x, y, lens, config=config).cpu(), ref) < 1e-2, config


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("case", list(ATTN_CASES))
@pytest.mark.parametrize("cls", [aiter_attention.AiterAttention, ck_attention.CkAttention])
def test_gpu_rocm_attention(cls, case, varlen):
    ad = cls()
    _real(ad)
    p, inputs = _attn_inputs(ATTN_CASES[case], varlen)
    inputs = tuple(t if t is None else (t.detach().cuda().requires_grad_(t.requires_grad)) for t in inputs)
    p = p._replace(platform="rocm")
    if ad.supports(p) is not None:
        pytest.skip(ad.supports(p))
    out, lse, saved = ad.forward(p, *inputs)
    grad_out = torch.randn_like(out)
    if ad.native_autograd:
        out.backward(grad_out)
        grads = [t.grad for t in inputs[:3]]
    else:
        grads = ad.backward(p, saved, grad_out)
    cpu = tuple(t if t is None else t.detach().cpu() for t in inputs)
    ref_out, ref_grads = _reference_grads(p, cpu, grad_out.cpu())
    assert rel_error(out.cpu(), ref_out) < 2e-2
    for g, r in zip(grads, ref_grads):
        assert rel_error(g.cpu(), r) < 5e-2


# -- the Triton adapters on CDNA (their compiled fit: tests/test_compile_rocm.py) ------------------------
def test_triton_configs_offered_on_rocm_fit_the_lds(pretend_rocm, monkeypatch):
    from turbo_dispatch.backends.triton import configs as C
    from turbo_dispatch.backends.triton import gemm as TG
    from turbo_dispatch.backends.triton import grouped_gemm as GG
    from turbo_dispatch.ops.grouped_gemm_problem import GroupedGemmFp8Problem

    a, b = torch.empty(4096, 4096, dtype=BF16), torch.empty(7168, 4096, dtype=BF16)
    p = gemm_problem(a, b, False, True)
    for arch in ("gfx942", "gfx950"):
        pretend_rocm(arch)
        offered = TG.TritonGemm().configs(_rocm(p))
        assert offered and all(C.rocm_lds_bytes(c, 2, 2, arch) <= C.ROCM_LDS_LIMIT[arch] for c in offered)
    pretend_rocm("gfx942")
    # Hopper's default (128 x 256 x 64, 3 stages: 96 KiB of LDS on gfx942) is offered with 2 stages.
    assert TG.TritonGemm().configs(p)[0] == (128, 256, 64, 8, 3, 8)
    assert TG.TritonGemm().configs(_rocm(p))[0] == (128, 256, 64, 8, 2, 8)
    assert C.rocm_fit([(512, 512, 128, 8, 3, 8, 1)], 2, 2, "gfx942") == []  # cannot fit even at 2 stages
    assert "tf32x3" in TG.TritonGemm().supports(_rocm(p)._replace(a_dtype=FP32, b_dtype=FP32, out_dtype=FP32))
    monkeypatch.setattr(TG, "_rocm_ocp_fp8", lambda: False)
    gp = GroupedGemmFp8Problem(8, 4096, 2048, 1024, True, False, BF16, BF16, BF16, E4M3, E4M3, RW, None, False,
                               "rocm")
    assert "gfx950" in GG.TritonGroupedGemmFp8().supports(gp)

