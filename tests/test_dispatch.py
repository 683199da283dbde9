"""Env grammar, GlobalBackendManager, and the resolver's priority chain with its known hazards."""
import threading

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch import BackendType, GlobalBackendManager, autotune, resolver
from turbo_dispatch.backend_type import BackendChoice
from turbo_dispatch.env import parse_backend_setting
from turbo_dispatch.errors import BackendUnsupportedError, ConfigError, NoBackendError
from turbo_dispatch.low_precision import Float8QuantConfig, Format, ScalingGranularity
from turbo_dispatch.registry import reload_registry


PLUGINS = """
version: 1
ops:
  gemm:
    {defaults}
    backends:
      - name: NN_ONLY
        adapter: fixture_backends:NNOnlyGemm
        platforms: [cpu]
      - name: SLOW
        adapter: fixture_backends:SlowGemm
        platforms: [cpu]
      - name: WRONG_FAST
        adapter: fixture_backends:WrongFastGemm
        platforms: [cpu]
      - name: GONE
        adapter: fixture_backends:Unavailable
        platforms: [cpu]
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Registers the fixture backends for gemm; returns a function to re-register with a cpu default."""

    def install(default=None):
        path = tmp_path / "plugins.yaml"
        defaults = f"defaults: {{cpu: {default}}}" if default else ""
        path.write_text(PLUGINS.format(defaults=defaults))
        monkeypatch.setenv("PRIMUS_TURBO_EXTRA_REGISTRY", str(path))
        reload_registry()
        GlobalBackendManager.reset()

    install()
    yield install
    monkeypatch.undo()  # drop the env vars first: the settings re-read them on reset
    reload_registry()
    GlobalBackendManager.reset()


def setenv(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    GlobalBackendManager.reset()  # the environment is snapshotted; reset re-reads it


def ab(m=8, n=6, k=5, dtype=torch.float32):
    return torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)


# -- env grammar ---------------------------------------------------------------------------------
def test_env_grammar_forms():
    plugins = {"MYLIB"}
    assert parse_backend_setting("triton", "V", plugins) == {"*": BackendType.TRITON}
    assert parse_backend_setting("fp8:triton,bf16:CUBLASLT", "V", plugins) == {
        "fp8": BackendType.TRITON, "bf16": BackendType.CUBLASLT}
    assert parse_backend_setting("fp8:autotune,other:torch", "V", plugins) == {
        "fp8": BackendType.AUTOTUNE, "*": BackendType.TORCH}
    assert parse_backend_setting(" FP16 : native , mylib ", "V", plugins) == {"fp16": BackendType.TORCH, "*": "MYLIB"}
    assert parse_backend_setting("blaslt", "V", plugins) == {"*": BackendType.BLASLT}
    assert parse_backend_setting("bf16_fp16_fp32:triton,other:torch", "V", plugins) == {
        "bf16": BackendType.TRITON, "fp16": BackendType.TRITON, "fp32": BackendType.TRITON, "*": BackendType.TORCH}


@pytest.mark.parametrize("value, message", [
    ("bogus", "unknown backend 'bogus'; valid backends: AITER, AUTOTUNE"),
    ("fp7:torch", "unknown precision 'fp7'; valid precisions: bf16, fp16, fp32, fp8, bf16_fp16_fp32, other"),
    ("fp8:torch,fp8:triton", "is set twice"),
    ("bf16:torch,bf16_fp16_fp32:triton", "precision 'bf16' is set twice"),
    ("fp4:torch", "precision FP4 cannot be set: turbo_dispatch has no FP4 ops"),
])
def test_env_grammar_errors_list_valid_values(value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_backend_setting(value, "PRIMUS_TURBO_GEMM_BACKEND", set())


@pytest.mark.parametrize("var", ["PRIMUS_TURBO_GEMM_BACKEND", "PRIMUS_TURBO_GROUPED_GEMM_BACKEND",
                                 "PRIMUS_TURBO_ATTN_BACKEND", "PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND"])
def test_unknown_backend_in_any_env_var_errors_on_use(monkeypatch, var):
    monkeypatch.setenv(var, "nonesuch")
    with pytest.raises(ConfigError, match=f"{var}='nonesuch': unknown backend"):
        GlobalBackendManager.reset()


def test_auto_tune_env_values(monkeypatch):
    setenv(monkeypatch, "PRIMUS_TURBO_AUTO_TUNE", "1")
    assert GlobalBackendManager.get_auto_tune() is True
    setenv(monkeypatch, "PRIMUS_TURBO_AUTO_TUNE", "off")
    assert GlobalBackendManager.get_auto_tune() is False
    monkeypatch.setenv("PRIMUS_TURBO_AUTO_TUNE", "maybe")
    with pytest.raises(ConfigError, match="PRIMUS_TURBO_AUTO_TUNE='maybe'"):
        GlobalBackendManager.reset()


# -- priority chain --------------------------------------------------------------------------------
def test_default_then_env_then_code(plugins, monkeypatch):
    a, b = ab()
    assert turbo.explain("gemm", a, b).source == "default"
    setenv(monkeypatch, "PRIMUS_TURBO_GEMM_BACKEND", "slow")
    d = turbo.explain("gemm", a, b)
    assert (d.backend, d.source) == ("SLOW", "env")
    GlobalBackendManager.set_gemm_backend("NN_ONLY")
    d = turbo.explain("gemm", a, b)
    assert (d.backend, d.source) == ("NN_ONLY", "code")
    out = turbo.ops.gemm(a, b)
    torch.testing.assert_close(out, a @ b)


def test_pinned_backend_that_cannot_serve_raises_with_reason(plugins, monkeypatch):
    a, b = ab()
    GlobalBackendManager.set_gemm_backend("GONE")
    with pytest.raises(BackendUnsupportedError, match="GONE pinned by GlobalBackendManager.*fixture library is not installed"):
        turbo.ops.gemm(a, b)
    GlobalBackendManager.set_gemm_backend(None)
    setenv(monkeypatch, "PRIMUS_TURBO_GEMM_BACKEND", "cudnn")  # a known name with no gemm adapter
    with pytest.raises(BackendUnsupportedError, match="CUDNN is not registered for gemm"):
        turbo.ops.gemm(a, b)


def test_blaslt_alias_has_no_cpu_library(monkeypatch):
    setenv(monkeypatch, "PRIMUS_TURBO_GEMM_BACKEND", "blaslt")
    with pytest.raises(BackendUnsupportedError, match="platform cpu has none"):
        turbo.ops.gemm(*ab())


def test_hazard_cached_decision_rechecks_supports_for_new_flags(plugins):
    """A decision cached for NN must not serve an NT call the backend cannot do."""
    a, b = ab()
    GlobalBackendManager.set_gemm_backend("NN_ONLY")
    turbo.ops.gemm(a, b)
    with pytest.raises(BackendUnsupportedError, match="fixture supports only the NN layout"):
        turbo.ops.gemm(a, b.t().contiguous(), trans_b=True)
    # Not pinned: the default NN_ONLY serves NN, and NT falls back (logged) to a backend that can.
    GlobalBackendManager.set_gemm_backend(None)
    plugins(default="NN_ONLY")
    assert turbo.explain("gemm", a, b).backend == "NN_ONLY"
    d = turbo.explain("gemm", a, b.t().contiguous(), trans_b=True)
    assert (d.backend, d.source) == ("TORCH", "fallback")
    assert any("NN layout" in note for note in d.notes)
    torch.testing.assert_close(turbo.ops.gemm(a, b.t().contiguous(), trans_b=True), a @ b)


def test_hazard_precision_setting_leaves_env_for_other_precisions(plugins, monkeypatch):
    setenv(monkeypatch, "PRIMUS_TURBO_GEMM_BACKEND", "SLOW")
    a, b = ab()
    GlobalBackendManager.set_gemm_backend(BackendType.TORCH, precision="fp8")
    cfg = Float8QuantConfig()
    assert (turbo.explain("gemm_fp8", a, b, config=cfg).source, turbo.explain("gemm_fp8", a, b).backend) == ("code", "TORCH")
    d = turbo.explain("gemm", a, b)  # fp32: the env var still rules
    assert (d.backend, d.source) == ("SLOW", "env")
    d = turbo.explain("gemm", a.bfloat16(), b.bfloat16())
    assert (d.backend, d.source) == ("SLOW", "env")


def test_hazard_set_none_really_unsets(plugins, monkeypatch):
    setenv(monkeypatch, "PRIMUS_TURBO_GEMM_BACKEND", "SLOW")
    a, b = ab()
    GlobalBackendManager.set_gemm_backend("NN_ONLY")
    assert turbo.explain("gemm", a, b).backend == "NN_ONLY"
    GlobalBackendManager.set_gemm_backend(None)
    assert GlobalBackendManager.get_gemm_backend().source == "env"  # the code setting is gone
    assert turbo.explain("gemm", a, b).source == "env"
    GlobalBackendManager.set_gemm_backend("NN_ONLY", precision="fp32")
    GlobalBackendManager.set_gemm_backend("TORCH", precision="bf16")
    GlobalBackendManager.set_gemm_backend(None, precision="fp32")  # only fp32 is unset
    assert GlobalBackendManager.get_gemm_backend("fp32") == BackendChoice("SLOW", source="env")
    assert GlobalBackendManager.get_gemm_backend("bf16").backend is BackendType.TORCH
    assert turbo.explain("gemm", a, b).source == "env"


def test_setter_rejects_unknown_backend_and_precision():
    with pytest.raises(ConfigError, match="unknown backend 'nope'.*valid backends"):
        GlobalBackendManager.set_gemm_backend("nope")
    with pytest.raises(ValueError, match="unknown precision 'fp7'"):
        GlobalBackendManager.set_attn_backend("TORCH", precision="fp7")
    with pytest.raises(ValueError, match="precision FP4 cannot be set: turbo_dispatch has no FP4 ops"):
        GlobalBackendManager.set_attn_backend("TORCH", precision="fp4")
    with pytest.raises(ValueError, match="not both"):
        GlobalBackendManager.set_grouped_gemm_backend("TORCH", auto_tune=True)


def test_manager_is_thread_safe():
    errors = []

    def worker(i):
        try:
            for j in range(200):
                precision = ("bf16", "fp16", "fp32", "fp8")[(i + j) % 4]
                GlobalBackendManager.set_gemm_backend("TORCH", precision=precision)
                GlobalBackendManager.set_moe_dispatch_combine_backend(None)
                turbo.ops.gemm(torch.randn(2, 2), torch.randn(2, 2))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for precision in ("bf16", "fp16", "fp32", "fp8"):
        assert GlobalBackendManager.get_gemm_backend(precision).backend is BackendType.TORCH


# -- autotune and its hazards ---------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["env-family", "env-precision", "code-family", "code-precision", "global-code", "global-env"])
def test_hazard_autotune_value_is_honoured_for_every_op(plugins, monkeypatch, how):
    a, b = ab(16, 16, 16)
    if how == "env-family":
        setenv(monkeypatch, "PRIMUS_TURBO_GEMM_BACKEND", "autotune")
    elif how == "env-precision":
        setenv(monkeypatch, "PRIMUS_TURBO_GEMM_BACKEND", "fp32:autotune,fp8:autotune,other:torch")
    elif how == "code-family":
        GlobalBackendManager.set_gemm_backend(auto_tune=True)
    elif how == "code-precision":
        GlobalBackendManager.set_gemm_backend(BackendType.AUTOTUNE, precision="fp32")
        GlobalBackendManager.set_gemm_backend(BackendType.AUTOTUNE, precision="fp8")
    elif how == "global-code":
        GlobalBackendManager.set_auto_tune(True)
    else:
        setenv(monkeypatch, "PRIMUS_TURBO_AUTO_TUNE", "1")
    assert turbo.explain("gemm", a, b).source == "autotune"
    assert turbo.explain("gemm_fp8", a, b).source == "autotune"


def test_wrong_but_fast_backend_never_wins(plugins):
    GlobalBackendManager.set_auto_tune(True)
    d = turbo.explain("gemm", *ab(32, 32, 32))
    assert d.backend in ("TORCH", "NN_ONLY")  # both correct; SLOW is slower, WRONG_FAST is wrong
    record = autotune.lookup("gemm", d.problem)
    rejected = dict(record.rejected)
    assert "correctness gate" in rejected["WRONG_FAST"]
    assert "GONE" not in rejected  # unavailable backends are not candidates at all


def test_hazard_failed_tuning_is_remembered(monkeypatch):
    import turbo_dispatch.backends.torch.gemm as torch_gemm

    monkeypatch.setattr(torch_gemm.TorchGemm, "run", lambda self, p, a, b, config=None: torch.zeros(p.m, p.n))
    GlobalBackendManager.set_auto_tune(True)
    a, b = ab()
    before = autotune.STATS["keys_profiled"]
    d = turbo.explain("gemm", a, b)
    assert d.source == "default" and any("failed" in n for n in d.notes)
    resolver.clear_cache()  # force a new resolution; the failure must come from memory
    d = turbo.explain("gemm", a, b)
    assert any("remembered, not retried" in n for n in d.notes)
    assert autotune.STATS["keys_profiled"] == before + 1


def test_hazard_graph_capture_uses_tuned_results_and_never_profiles(plugins, monkeypatch):
    GlobalBackendManager.set_auto_tune(True)
    a, b = ab(24, 24, 24)
    tuned = turbo.explain("gemm", a, b)
    assert tuned.source == "autotune"
    profiled = autotune.STATS["keys_profiled"]
    # Simulate capture (no GPU here): the decision cache is dropped so the tuned store must answer.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    resolver.clear_cache()
    during = turbo.explain("gemm", a, b)
    assert (during.backend, during.source) == (tuned.backend, "autotune")
    # An untuned key during capture: no profiling, a provisional default that is not cached.
    fresh = turbo.explain("gemm", *ab(40, 40, 40))
    assert fresh.provisional and fresh.source == "default"
    assert any("CUDA graph is being captured" in n for n in fresh.notes)
    assert autotune.STATS["keys_profiled"] == profiled
    monkeypatch.undo()
    plugins()  # re-register (undo dropped the env var) and reset
    GlobalBackendManager.set_auto_tune(True)
    assert turbo.explain("gemm", *ab(40, 40, 40)).source == "autotune"


def test_hazard_keys_hold_every_flag_that_changes_the_kernel():
    a, b = torch.randn(32, 32), torch.randn(32, 32)
    keys = {turbo.explain("gemm", a, b, trans_a=ta, trans_b=tb, out_dtype=od).key
            for ta in (False, True) for tb in (False, True) for od in (None, torch.bfloat16)}
    assert len(keys) == 8
    cfgs = [Float8QuantConfig(format=f, granularity=g, block_size=bs)
            for f in (Format.E4M3, Format.E5M2, Format.HYBRID)
            for g, bs in ((ScalingGranularity.TENSORWISE, None), (ScalingGranularity.ROWWISE, None),
                          (ScalingGranularity.BLOCKWISE, 128), (ScalingGranularity.BLOCKWISE, 32))]
    fp8_keys = {turbo.explain("gemm_fp8", a, b, config=c).key for c in cfgs}
    # HYBRID's forward is E4M3 on both operands, so it shares E4M3's forward key (same kernel).
    assert len(fp8_keys) == 8
    assert "granularity=blockwise" in next(iter(k for k in fp8_keys if "blockwise" in k))


def test_no_backend_error_lists_every_reason(monkeypatch):
    import turbo_dispatch.backends.torch.gemm as torch_gemm

    monkeypatch.setattr(torch_gemm.TorchGemm, "supports", lambda self, p: "fixture says no")
    with pytest.raises(NoBackendError, match="TORCH: fixture says no"):
        turbo.ops.gemm(*ab())


def test_explain_prints_source_and_rejections(plugins):
    d = turbo.explain("gemm", *ab())
    text = str(d)
    assert "backend: TORCH" in text and "source:  default" in text
    assert "GONE" in text and "fixture library is not installed" in text
    assert "can serve; not chosen" in text


def test_warm_path_is_cached():
    a, b = ab()
    first = turbo.explain("gemm", a, b)
    assert turbo.explain("gemm", a, b) is first
    GlobalBackendManager.set_gemm_backend("TORCH")
    assert turbo.explain("gemm", a, b) is not first


def test_grad_path_uses_autograd_function_unless_backend_is_uniform(plugins, monkeypatch):
    """Default TORCH: torch autograd records the matmul directly; an autotuned or plugin choice
    goes through turbo's autograd.Function so each backward GEMM is dispatched on its own."""
    a = torch.randn(8, 5, requires_grad=True)
    b = torch.randn(5, 6, requires_grad=True)
    out = turbo.ops.gemm(a, b)
    assert "Mm" in type(out.grad_fn).__name__
    GlobalBackendManager.set_gemm_backend("SLOW")
    out = turbo.ops.gemm(a, b)
    assert "GemmFunction" in type(out.grad_fn).__name__
    out.sum().backward()
    torch.testing.assert_close(b.grad, a.detach().t() @ torch.ones(8, 6))
    GlobalBackendManager.set_gemm_backend(None)
    GlobalBackendManager.set_auto_tune(True)
    assert "GemmFunction" in type(turbo.ops.gemm(a, b).grad_fn).__name__
