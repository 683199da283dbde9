"""Registry loading and validation."""
import textwrap

import pytest

from turbo_dispatch.errors import RegistryError
from turbo_dispatch.registry import builtin_registry_path, load_registry


def write(tmp_path, text, name="extra.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_builtin_registry_loads_and_defaults_resolve():
    reg = load_registry(extra_files=[])
    assert builtin_registry_path().is_file()
    # fp8 on NVIDIA defaults to the fused-quantisation backends (faster, and the reference
    # quantizer's float32 temporaries would lift the fp8 Linear's peak memory above bf16's).
    expected = {("gemm_fp8", "cuda"): "CUBLASLT", ("grouped_gemm_fp8", "cuda"): "TRITON"}
    for op in ("gemm", "gemm_fp8", "grouped_gemm", "grouped_gemm_fp8"):
        assert reg.get(op, "TORCH") is not None
        for platform in ("cuda", "rocm", "cpu"):
            name = reg.default(op, platform)
            assert name == expected.get((op, platform), "TORCH"), (op, platform)
            assert platform in reg.get(op, name).platforms
    # what cuBLASLt refuses (HYBRID blockwise grads: e5m2) goes to TRITON, not TORCH's emulation
    assert reg.default_chain("gemm_fp8", "cuda") == ("CUBLASLT", "TRITON")


def test_extra_registry_adds_plugin_backend(tmp_path):
    extra = write(tmp_path, """
        version: 1
        ops:
          gemm:
            backends:
              - name: nn_only
                adapter: fixture_backends:NNOnlyGemm
                platforms: [cpu]
        """)
    reg = load_registry(extra_files=[extra])
    entry = reg.get("gemm", "NN_ONLY")
    assert entry is not None and entry.platforms == ("cpu",)
    names = [e.name for e in reg.backends("gemm")]
    assert names[0] == "TORCH" and names[-1] == "NN_ONLY"  # built-ins first, then plugins, in file order


def test_a_default_may_be_a_chain_whose_head_is_the_default(tmp_path):
    extra = write(tmp_path, """
        version: 1
        ops:
          gemm:
            defaults: {cpu: [nn_only, TORCH]}
            backends:
              - name: nn_only
                adapter: fixture_backends:NNOnlyGemm
                platforms: [cpu]
        """)
    reg = load_registry(extra_files=[extra])
    assert reg.default_chain("gemm", "cpu") == ("NN_ONLY", "TORCH") and reg.default("gemm", "cpu") == "NN_ONLY"
    assert reg.default_chain("gemm", "cuda") == (reg.default("gemm", "cuda"),)
    assert reg.default_chain("no_such_op", "cpu") == () and reg.default("no_such_op", "cpu") is None


@pytest.mark.parametrize("body, message", [
    ("""
        ops:
          gemmm:
            backends: []
     """, "unknown op 'gemmm'"),
    ("""
        ops:
          gemm:
            backends:
              - name: X
                adapter: no_such_module_xyz:Thing
                platforms: [cpu]
     """, "failed to import"),
    ("""
        ops:
          gemm:
            backends:
              - name: X
                adapter: not-a-path
                platforms: [cpu]
     """, "must look like 'package.module:ClassName'"),
    ("""
        ops:
          gemm:
            backends:
              - name: TORCH
                adapter: fixture_backends:SlowGemm
                platforms: [cpu]
     """, "duplicate backend 'TORCH'"),
    ("""
        ops:
          gemm:
            backends:
              - name: X
                adapter: fixture_backends:SlowGemm
                platforms: [tpu]
     """, "invalid platforms"),
    ("""
        ops:
          gemm:
            backends:
              - name: X
                adapter: fixture_backends:NoSuchClass
                platforms: [cpu]
     """, "has no attribute 'NoSuchClass'"),
    ("""
        ops:
          gemm:
            defaults: {cpu: MISSING}
     """, "is not a backend registered"),
    ("""
        ops:
          gemm:
            defaults: {cpu: [TORCH, MISSING]}
     """, "default 'MISSING' is not a backend registered"),
    ("""
        ops:
          gemm:
            defaults: {cpu: []}
     """, "a non-empty list of names"),
])
def test_bad_registry_is_a_clear_error_naming_the_line(tmp_path, body, message):
    extra = write(tmp_path, body)
    with pytest.raises(RegistryError) as info:
        load_registry(extra_files=[extra])
    text = str(info.value)
    assert message in text
    if "registered" not in message:  # defaults are checked after loading; the rest name file:line
        assert f"{extra}:" in text and text.split(f"{extra}:")[1].split(":")[0].isdigit()


def test_invalid_yaml_is_a_registry_error(tmp_path):
    extra = write(tmp_path, "ops: [unclosed\n")
    with pytest.raises(RegistryError, match="invalid YAML"):
        load_registry(extra_files=[extra])


def test_entry_point_plugins_are_loaded(monkeypatch, tmp_path):
    from importlib import metadata

    import turbo_dispatch.registry as registry_module

    doc = {"ops": {"gemm": {"backends": [
        {"name": "EP_SLOW", "adapter": "fixture_backends:SlowGemm", "platforms": ["cpu"]}]}}}

    class FakeEntryPoint:
        name, value = "fixture", "fixture_backends:doc"

        def load(self):
            return lambda: doc

    monkeypatch.setattr(registry_module.metadata, "entry_points",
                        lambda group: [FakeEntryPoint()] if group == "turbo_dispatch.backends" else [])
    reg = load_registry(extra_files=[])
    assert reg.get("gemm", "EP_SLOW") is not None
    assert metadata  # the real module stays importable


def test_kernel_modules_are_named_in_the_registry_and_imported_on_first_use(tmp_path, monkeypatch):
    """The core reaches kernel modules by name (registry.yaml ``kernels``); a plugin registry may
    point a name elsewhere; a missing name or a module that does not import gives None and why."""
    from turbo_dispatch import registry

    reg = load_registry(extra_files=[])
    assert reg.kernels == {"fp8_quantize": "turbo_dispatch.backends.triton.quantize",
                           "fp8_dual_quantize": "turbo_dispatch.backends.triton.dual_quantize",
                           "fused_fp8_producers": "turbo_dispatch.backends.triton.fused_producers",
                           "rotary": "turbo_dispatch.backends.triton.rotary"}
    extra = write(tmp_path, """
        version: 1
        ops: {}
        kernels:
          fp8_quantize: json
          broken: no_such_module_anywhere
        """)
    monkeypatch.setenv("PRIMUS_TURBO_EXTRA_REGISTRY", extra)
    try:
        registry.reload_registry()
        module, why = registry.kernel_module("fp8_quantize")
        assert module is __import__("json") and why == ""
        assert registry.kernel_module("fp8_quantize")[0] is module  # cached
        module, why = registry.kernel_module("broken")
        assert module is None and "no_such_module_anywhere is not importable" in why
        module, why = registry.kernel_module("nothing")
        assert module is None and "no kernel module 'nothing'" in why
    finally:
        monkeypatch.delenv("PRIMUS_TURBO_EXTRA_REGISTRY")
        registry.reload_registry()
    assert registry.kernel_module("fp8_quantize")[0] is not __import__("json")


def test_a_kernel_must_name_a_module(tmp_path):
    extra = write(tmp_path, """
        version: 1
        ops: {}
        kernels:
          fp8_quantize: "package.module:function"
        """)
    with pytest.raises(RegistryError, match="kernel 'fp8_quantize' must name a module"):
        load_registry(extra_files=[extra])
