"""CUBLASLT / HIPBLASLT adapters (backends/blaslt/gemm.py).

CPU: registration, availability and supports() reasons (with the device capability faked where a
reason depends on it), config validation, the preferred-library switch's restore logic on a fake
switch, the quantizer choice, and where the keys cuBLASLt refuses go (the cuda default chain).
GPU (``gpu`` marker): results against a float64 reference over layouts, odd sizes, output dtypes,
configs and fp8 granularities; the real preferred-library switch restored after a call and after an
exception; the op pinned to CUBLASLT (and the BLASLT alias) forward and backward; an unpinned
HYBRID blockwise step with no GEMM on TORCH's emulation.
"""
from __future__ import annotations

import pytest
import torch
from cpu_caps import cpu_scaled_mm_takes

import turbo_dispatch as turbo
from turbo_dispatch.low_precision import fast_quantize as quantizer
from turbo_dispatch.backends.blaslt import gemm as blaslt
from turbo_dispatch.backends.torch import gemm as torch_gemm
from turbo_dispatch.low_precision import Float8QuantConfig, Format, ScalingGranularity
from turbo_dispatch.ops._common import REL_TOL, rel_error, snr_db
from turbo_dispatch.ops.gemm import GEMM_FP8, GemmFp8Problem, GemmProblem, gemm_fp8_problem, gemm_problem
from turbo_dispatch.ops.gemm_fp8_step import wgrad_operand_like
from turbo_dispatch.ops.gemm_grads import fp8_grads
from turbo_dispatch.ops.gemm_problem import forward_fp8_problem
from turbo_dispatch.registry import get_registry, load_registry
from turbo_dispatch.resolver import clear_cache, resolve

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TW, RW, BW, MX = (ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE, ScalingGranularity.BLOCKWISE,
                  ScalingGranularity.MX_BLOCKWISE)


def _p8(m=256, n=256, k=256, gran=TW, a_fp8=E4M3, b_fp8=E4M3, a_2d=False, b_2d=False, out=torch.bfloat16,
        platform="cuda", trans_a=False, trans_b=True):
    block = 128 if gran is BW else (32 if gran is MX else None)
    return GemmFp8Problem(m, n, k, trans_a, trans_b, torch.bfloat16, torch.bfloat16, out, a_fp8, b_fp8, gran, block,
                          a_2d, b_2d, platform)


@pytest.fixture
def fake_sm(monkeypatch):
    """Pretends the current CUDA device has a given capability (for reasons that depend on it)."""
    def set_capability(major: int, minor: int = 0) -> None:
        cap = lambda index: (major, minor)
        monkeypatch.setattr(blaslt, "_capability", cap)
        monkeypatch.setattr(torch_gemm, "_capability", cap)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(blaslt, "_is_rocm", lambda: False)
    return set_capability


# -- CPU -------------------------------------------------------------------------------------------
def test_registry_lists_blaslt_after_torch_with_platforms():
    reg = load_registry(extra_files=[])
    for op, cls in (("gemm", blaslt.BlasLtGemm), ("gemm_fp8", blaslt.BlasLtGemmFp8)):
        names = [e.name for e in reg.backends(op)]
        assert names.index("CUBLASLT") > names.index("TORCH")
        assert reg.get(op, "CUBLASLT").platforms == ("cuda",)
        assert reg.get(op, "HIPBLASLT").platforms == ("rocm",)
        assert type(reg.get(op, "CUBLASLT").adapter) is cls
        assert type(reg.get(op, "HIPBLASLT").adapter) is cls


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given without a GPU")
def test_unavailable_without_gpu_says_why():
    for adapter in (blaslt.BlasLtGemm(), blaslt.BlasLtGemmFp8()):
        reason = adapter.available()
        assert reason and ("CPU-only" in reason or "no GPU" in reason)


def test_cpu_problem_refused_with_reason():
    p = gemm_problem(torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, 3, dtype=torch.bfloat16))
    assert "GPUs only" in blaslt.BlasLtGemm().supports(p)
    assert "GPUs only" in blaslt.BlasLtGemmFp8().supports(_p8(platform="cpu"))


def test_gemm_supports_dtypes():
    ad = blaslt.BlasLtGemm()
    base = GemmProblem(64, 64, 64, False, True, torch.bfloat16, torch.bfloat16, torch.bfloat16, "cuda")
    assert ad.supports(base) is None
    assert ad.supports(base._replace(out_dtype=torch.float32)) is None
    assert ad.supports(base._replace(a_dtype=torch.float16, b_dtype=torch.float16, out_dtype=torch.float16)) is None
    fp32 = base._replace(a_dtype=torch.float32, b_dtype=torch.float32, out_dtype=torch.float32)
    assert "bf16/fp16" in ad.supports(fp32)
    assert "output" in ad.supports(base._replace(out_dtype=torch.float16))
    assert ad.configs(base) == ["cublaslt", "cublas"]
    assert ad.configs(base._replace(platform="rocm")) == ["hipblaslt", "hipblas"]


def test_gemm_rejects_unknown_config_before_running():
    p = GemmProblem(4, 4, 4, False, False, torch.bfloat16, torch.bfloat16, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="unknown config 'rocblas'"):
        blaslt.BlasLtGemm().run(p, torch.randn(4, 4), torch.randn(4, 4), config="rocblas")


def test_identity_names_library_version_revision_and_config():
    ident = blaslt.BlasLtGemmFp8().identity("fast_accum")
    assert ident.startswith(blaslt._library_name() + "-")
    assert f"torch-{torch.__version__}" in ident and f"rev{blaslt.KERNEL_REVISION}" in ident
    assert ident.endswith("/fast_accum")
    assert blaslt.BlasLtGemmFp8().identity("fp32_accum") != ident


@pytest.mark.parametrize("problem, needle", [
    (_p8(gran=MX), "sm_100"),
    (_p8(k=200), "divisible by 16"),
    (_p8(a_fp8=E5M2, b_fp8=E5M2), "e5m2 x e5m2"),
    (_p8(gran=RW, out=torch.float16), "fp16"),
    (_p8(gran=BW, k=384, n=200, b_2d=True), "divisible by 128"),
    (_p8(gran=BW, m=100, b_2d=True), "M divisible by 8"),
    (_p8(gran=BW, a_2d=True, b_2d=True), "one operand only"),
    # a tiled first operand runs swapped, so its M must meet the N rule
    (_p8(gran=BW, m=200, a_2d=True), "divisible by 128"),
    (_p8(gran=BW, b_fp8=E5M2, b_2d=True), "e4m3"),
])
def test_fp8_supports_reasons(fake_sm, problem, needle):
    fake_sm(9, 0)
    reason = blaslt.BlasLtGemmFp8().supports(problem)
    assert reason is not None and needle in reason, reason


def test_fp8_supported_recipes_and_configs(fake_sm):
    fake_sm(9, 0)
    ad = blaslt.BlasLtGemmFp8()
    for p in (_p8(), _p8(gran=RW), _p8(a_fp8=E5M2), _p8(gran=BW, b_2d=True), _p8(gran=BW), _p8(gran=BW, a_2d=True)):
        assert ad.supports(p) is None, p
    assert ad.configs(_p8()) == ["fp32_accum", "fast_accum"]
    assert ad.configs(_p8(gran=RW)) == ["fp32_accum", "fast_accum"]
    assert ad.configs(_p8(gran=BW, b_2d=True)) == [None]
    with pytest.raises(ValueError, match="not valid for blockwise"):
        ad._fast_accum(_p8(gran=BW, b_2d=True), "fast_accum")
    assert "CUTLASS" in ad.describe(_p8(gran=RW)) and "swapped" in ad.describe(_p8(gran=BW, a_2d=True))


def test_fp8_old_gpu_refused(fake_sm):
    fake_sm(8, 0)
    assert "sm_89" in blaslt.BlasLtGemmFp8().supports(_p8())


HYBRID_BLOCKWISE = Float8QuantConfig(format=Format.HYBRID, granularity=BW, block_size=128)


def _linear_step_keys(x: torch.Tensor, w: torch.Tensor, cfg: Float8QuantConfig) -> list:
    """The forward, dgrad and wgrad keys of modules.Linear's fp8 step (y = x @ w^T) under ``cfg``,
    built by the op's own problem builders and gradient formula (no GEMM runs)."""
    keys = [forward_fp8_problem(x, w, False, True, None, cfg)]

    def record(a, b, ta, tb, od, af, bf, a2d, b2d):
        keys.append(gemm_fp8_problem(a, b, ta, tb, od, af, bf, cfg.granularity, cfg.block_size, a2d, b2d))

    dy = x.new_empty(x.shape[0], w.shape[0])
    fp8_grads(record, wgrad_operand_like(x, False, cfg), w, dy, False, True, cfg.format.fwd_dtype(),
              cfg.format.bwd_dtype(), cfg.granularity, True, True, a_dtype=x.dtype)
    return keys


@pytest.mark.parametrize("m, n, k", [(8192, 28672, 4096), (1000, 384, 1000)])
def test_hybrid_blockwise_grads_default_to_triton_not_emulation(fake_sm, monkeypatch, m, n, k):
    """On sm_90, the HYBRID blockwise dgrad and wgrad, whose e5m2 gradient cuBLASLt's blockwise
    kernel refuses (and any key it refuses for its sizes), go to the next platform default,
    TRITON, never to TORCH's dequantise-then-matmul emulation."""
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon, fp8_blockwise_gluon_ws

    fake_sm(9, 0)
    for module in (fp8_blockwise_gluon, fp8_blockwise_gluon_ws):
        monkeypatch.setattr(module, "available", lambda *args, **kwargs: "faked sm_90 without a GPU")
    for name in ("CUBLASLT", "TRITON"):  # what a CUDA build with a GPU reports
        monkeypatch.setattr(get_registry().get("gemm_fp8", name), "_available", None)
    meta = dict(dtype=torch.bfloat16, device="meta")
    keys = [p._replace(platform="cuda")
            for p in _linear_step_keys(torch.empty(m, k, **meta), torch.empty(n, k, **meta), HYBRID_BLOCKWISE)]
    assert [(p.a_fp8, p.b_fp8) for p in keys] == [(E4M3, E4M3), (E5M2, E4M3), (E5M2, E4M3)]
    clear_cache()
    try:
        fwd, dgrad, wgrad = (resolve(GEMM_FP8, p) for p in keys)
    finally:
        clear_cache()
    aligned = m % 8 == 0 and n % 128 == 0 and k % 128 == 0
    assert (fwd.backend, fwd.source) == ("CUBLASLT" if aligned else "TRITON", "default")
    for d in (dgrad, wgrad):
        assert (d.backend, d.source) == ("TRITON", "default"), d
        assert any("platform default CUBLASLT rejected" in note for note in d.notes), d.notes


class _FakeSwitch:
    """Stands in for torch's preferred-BLAS switch (a CPU build refuses to set cuBLASLt)."""

    class Kind:
        Cublas, Cublaslt = "Cublas", "Cublaslt"

    def __init__(self, value):
        self.value, self.sets = value, 0

    def get(self):
        return self.value

    def put(self, value):
        self.value = value
        self.sets += 1


@pytest.mark.parametrize("start", ["Cublas", "Cublaslt"])
def test_preferred_library_restored_after_call_and_exception(monkeypatch, start):
    fake = _FakeSwitch(start)
    monkeypatch.setattr(blaslt, "_blas_switch", lambda: (fake.get, fake.put, _FakeSwitch.Kind))
    seen = []
    blaslt.run_with_preferred_blas("cublaslt", lambda: seen.append(fake.value))
    assert seen == ["Cublaslt"] and fake.value == start
    assert fake.sets == (0 if start == "Cublaslt" else 2)  # no switching when already preferred

    def boom():
        seen.append(fake.value)
        raise RuntimeError("inside")
    with pytest.raises(RuntimeError, match="inside"):
        blaslt.run_with_preferred_blas("cublas", boom)
    assert seen[-1] == "Cublas" and fake.value == start


def test_quantizer_falls_back_per_recipe_and_describe_says_so(monkeypatch):
    calls = []

    def fake_triton(x, dtype, granularity, *, axis, block_size, block_2d):
        if granularity is ScalingGranularity.BLOCKWISE and block_size == 128:
            raise NotImplementedError("no 2-D tiles yet")
        calls.append(granularity)
        return turbo.low_precision.quantize(x, dtype, granularity, axis=axis, block_size=block_size,
                                            block_2d=block_2d)

    monkeypatch.setattr(quantizer, "_triton_quantizer", lambda: (fake_triton, ""))
    monkeypatch.setattr(quantizer, "_TRITON_REFUSED", {})
    x = torch.randn(8, 256)
    q = quantizer.quantize_operand(x, E4M3, TW, 1, None, False)
    assert calls == [TW] and q.data.dtype == E4M3
    assert quantizer.quantizer_name(TW, False) == "Triton quantize_fp8"
    q = quantizer.quantize_operand(x, E4M3, BW, 1, 128, True)  # refused -> reference, remembered
    assert tuple(q.scale.shape) == (1, 2)
    assert "refused" in quantizer.quantizer_name(BW, True, 128) and "no 2-D tiles" in quantizer.quantizer_name(BW, True, 128)
    # The refusal is remembered for that block size only: 64 still goes to the Triton quantizer.
    assert quantizer.quantizer_name(BW, True, 64) == "Triton quantize_fp8"
    q = quantizer.quantize_operand(x, E4M3, BW, 1, 64, True)
    assert calls == [TW, BW] and tuple(q.scale.shape) == (1, 4)

    monkeypatch.setattr(quantizer, "_triton_quantizer", lambda: (None, "triton missing"))
    assert "reference" in quantizer.quantizer_name(TW, False) and "triton missing" in quantizer.quantizer_name(TW, False)


def test_real_triton_quantizer_probe_gives_function_or_reason():
    quantizer._triton_quantizer.cache_clear()
    fn, why = quantizer._triton_quantizer()
    assert (fn is None) == bool(why)


# -- GPU -------------------------------------------------------------------------------------------
def _ref(a, b, trans_a, trans_b):
    a64, b64 = a.double(), b.double()
    return (a64.t() if trans_a else a64) @ (b64.t() if trans_b else b64)


def _operands(m, n, k, trans_a, trans_b, dtype=torch.bfloat16):
    a = torch.randn((k, m) if trans_a else (m, k), device="cuda", dtype=dtype)
    b = torch.randn((n, k) if trans_b else (k, n), device="cuda", dtype=dtype)
    return a, b


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 16, 64), (77, 130, 96), (129, 67, 33), (512, 1024, 768)])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("dtype, out_dtype", [(torch.bfloat16, None), (torch.float16, None),
                                              (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("config", [None, "cublas"])
def test_gpu_gemm_matches_float64(m, n, k, trans_a, trans_b, dtype, out_dtype, config):
    a, b = _operands(m, n, k, trans_a, trans_b, dtype)
    p = gemm_problem(a, b, trans_a, trans_b, out_dtype)
    ad = blaslt.BlasLtGemm()
    assert ad.available() is None and ad.supports(p) is None
    before = torch._C._get_blas_preferred_backend()
    out = ad.run(p, a, b, config=config)
    assert torch._C._get_blas_preferred_backend() == before
    assert out.shape == (m, n) and out.dtype == p.out_dtype
    assert rel_error(out, _ref(a, b, trans_a, trans_b)) <= REL_TOL[p.out_dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("start", ["cublas", "cublaslt"])
def test_gpu_preferred_library_switched_and_restored(start):
    previous = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library(start)
        initial = torch._C._get_blas_preferred_backend()
        seen = []
        blaslt.run_with_preferred_blas("cublaslt", lambda: seen.append(torch._C._get_blas_preferred_backend()))
        assert seen == [torch._C._BlasBackend.Cublaslt]
        assert torch._C._get_blas_preferred_backend() == initial
        a = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
        bad = GemmProblem(8, 4, 16, False, False, torch.bfloat16, torch.bfloat16, torch.bfloat16, "cuda")
        with pytest.raises(RuntimeError):  # shapes torch.matmul refuses: raises inside the switch
            blaslt.BlasLtGemm().run(bad, a, torch.randn(5, 4, device="cuda", dtype=torch.bfloat16))
        assert torch._C._get_blas_preferred_backend() == initial
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


_FP8_CASES = [
    # gran, a_fp8, b_fp8, a_2d, b_2d, m, n, k
    (TW, E4M3, E4M3, False, False, 1, 32, 64),
    (TW, E4M3, E4M3, False, False, 200, 144, 304),
    (TW, E5M2, E4M3, False, False, 256, 512, 1024),
    (RW, E4M3, E4M3, False, False, 77, 96, 160),
    (RW, E4M3, E5M2, False, False, 512, 256, 2048),
    (BW, E4M3, E4M3, False, True, 256, 384, 512),
    (BW, E4M3, E4M3, False, False, 136, 256, 384),
    (BW, E4M3, E4M3, True, False, 256, 136, 384),
]


@pytest.mark.gpu
@pytest.mark.parametrize("gran, a_fp8, b_fp8, a_2d, b_2d, m, n, k", _FP8_CASES)
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False), (True, True)])
def test_gpu_fp8_matches_float64(gran, a_fp8, b_fp8, a_2d, b_2d, m, n, k, trans_a, trans_b):
    a, b = _operands(m, n, k, trans_a, trans_b)
    p = gemm_fp8_problem(a, b, trans_a, trans_b, None, a_fp8, b_fp8, gran, 128 if gran is BW else None, a_2d, b_2d)
    ad = blaslt.BlasLtGemmFp8()
    assert ad.supports(p) is None, ad.supports(p)
    gate = 20.0 if E5M2 in (a_fp8, b_fp8) else 25.0
    ref = _ref(a, b, trans_a, trans_b)
    for config in ad.configs(p):
        out = ad.run(p, a, b, config=config)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16 and out.is_contiguous()
        assert snr_db(out, ref) >= gate, (config, snr_db(out, ref), ad.describe(p))


@pytest.mark.gpu
def test_gpu_op_pinned_to_cublaslt_forward_and_backward():
    a = torch.randn(96, 160, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 160, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    turbo.GlobalBackendManager.set_gemm_backend("BLASLT")
    assert turbo.explain("gemm", a, w, trans_b=True).backend == "CUBLASLT"
    out = turbo.ops.gemm(a, w, trans_b=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    a64, w64, g64 = a.double(), w.double(), grad.double()
    assert rel_error(out, a64 @ w64.t()) <= REL_TOL[torch.bfloat16]
    assert rel_error(a.grad, g64 @ w64) <= REL_TOL[torch.bfloat16]
    assert rel_error(w.grad, g64.t() @ a64) <= REL_TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("gran", [TW, RW])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID])
def test_gpu_fp8_op_pinned_to_cublaslt_forward_and_backward(gran, fmt):
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cfg = Float8QuantConfig(format=fmt, granularity=gran)
    turbo.GlobalBackendManager.set_gemm_backend("CUBLASLT", precision="fp8")
    out = turbo.ops.gemm_fp8(a, w, trans_b=True, config=cfg)
    grad = torch.randn_like(out)
    out.backward(grad)
    a64, w64, g64 = a.double(), w.double(), grad.double()
    gate_bwd = 20.0 if fmt is Format.HYBRID else 25.0
    assert snr_db(out, a64 @ w64.t()) >= 25.0
    assert snr_db(a.grad, g64 @ w64) >= gate_bwd
    assert snr_db(w.grad, g64.t() @ a64) >= gate_bwd


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(512, 384, 1024), (200, 384, 1000)])
def test_gpu_hybrid_blockwise_step_never_emulates(m, n, k):
    """Unpinned, no GEMM of a HYBRID blockwise fp8 Linear step resolves to TORCH's emulation (the
    dgrad and wgrad go to TRITON where cuBLASLt refuses their e5m2 gradient), and the step matches
    float64."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for p in _linear_step_keys(x.detach(), w.detach(), HYBRID_BLOCKWISE):
        d = resolve(GEMM_FP8, p)
        assert d.backend != "TORCH" and not any("emulation" in note for note in d.notes), d
    out = turbo.ops.gemm_fp8(x, w, trans_b=True, config=HYBRID_BLOCKWISE)
    grad = torch.randn_like(out)
    out.backward(grad)
    x64, w64, g64 = x.detach().double(), w.detach().double(), grad.double()
    assert snr_db(out, x64 @ w64.t()) >= 25.0
    assert snr_db(x.grad, g64 @ w64) >= 20.0
    assert snr_db(w.grad, g64.t() @ x64) >= 20.0


@pytest.mark.gpu
def test_gpu_autotune_considers_cublaslt_configs():
    turbo.GlobalBackendManager.set_gemm_backend(auto_tune=True)
    a, b = _operands(1024, 1024, 1024, False, True)
    d = turbo.explain("gemm", a, b, trans_b=True)
    assert d.source == "autotune" and d.backend in {"TORCH", "CUBLASLT", "TRITON"}
    out = turbo.ops.gemm(a, b, trans_b=True)
    assert rel_error(out, _ref(a, b, False, True)) <= REL_TOL[torch.bfloat16]


@pytest.mark.skipif(not cpu_scaled_mm_takes(TW), reason="this torch has no CPU torch._scaled_mm")
@pytest.mark.parametrize("gran", [TW, RW])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("config", ["fp32_accum", "fast_accum"])
def test_fp8_run_operand_layouts_on_cpu_scaled_mm(gran, trans_a, trans_b, config):
    """run()'s operand/scale layouts for every trans flag, checked where torch has a CPU _scaled_mm
    (the GPU tests repeat this on cuBLASLt/CUTLASS)."""
    if not cpu_scaled_mm_takes(gran):
        pytest.skip(f"this torch's CPU torch._scaled_mm does not take {gran.value} scales")
    m, n, k = 40, 48, 96
    a = torch.randn((k, m) if trans_a else (m, k), dtype=torch.bfloat16)
    b = torch.randn((n, k) if trans_b else (k, n), dtype=torch.bfloat16)
    p = gemm_fp8_problem(a, b, trans_a, trans_b, None, E4M3, E4M3, gran, None, False, False)
    out = blaslt.BlasLtGemmFp8().run(p, a, b, config=config)
    ref = (a.double().t() if trans_a else a.double()) @ (b.double().t() if trans_b else b.double())
    assert out.shape == (m, n) and snr_db(out, ref) >= 25.0
