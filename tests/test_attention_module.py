"""TurboAttention (turbo_dispatch.modules): the attention op as an nn.Module.

CPU: the module against the float64 reference of test_attention (TORCH backend, fp32: relative
error <= 1e-5 on out, lse and the gradients), Primus-Turbo's constructor called as its users call
it, the arguments it refuses, its sink parameter, and its docstring example. The module with a
learnable sink runs the TRITON kernels under the interpreter in tests/test_attention_sink.py
(``module-sink``). GPU: sink and fp8 modules pinned to TRITON equal the functional calls.
"""
from __future__ import annotations

import pytest
import torch
from test_attention import FP32, assert_close, assert_lse, randn, ref_grads

import turbo_dispatch as turbo
from turbo_dispatch import NoBackendError
from turbo_dispatch.low_precision import Float8QuantConfig
from turbo_dispatch.modules import TurboAttention


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(3, 2), softmax_scale=0.2), {}],
                         ids=["causal", "window-scale", "full"])
def test_module_matches_reference(kw):
    attn = TurboAttention(**kw, return_lse=True)
    q, k, v, g = randn((2, 9, 4, 16)), randn((2, 11, 2, 16)), randn((2, 11, 2, 8)), randn((2, 9, 4, 8))
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = attn(*xs)
    out.backward(g)
    ref_out, ref_lse, ref_g = ref_grads(q, k, v, g, scale=kw.get("softmax_scale"), causal=kw.get("causal", False),
                                        window=kw.get("window_size", (-1, -1)))
    assert_close("out", out.detach(), ref_out, FP32)
    assert_lse(lse, ref_lse, FP32)
    for name, x, r in zip(("dq", "dk", "dv"), xs, ref_g):
        assert_close(name, x.grad, r, FP32)


def test_primus_turbo_constructor():
    """Primus-Turbo's positional order and keywords; non-contiguous [B, S, H, D] views work."""
    attn = TurboAttention(0.0, None, True, (-1, -1), None, False, False, False, None, None, None)
    assert attn.causal and attn.sink is None and list(attn.parameters()) == []
    qkv = randn((2, 7, 3, 4, 16))
    q, k, v = qkv.unbind(2)
    assert torch.equal(attn(q, k, v, None), turbo.ops.flash_attn_func(q, k, v, causal=True))
    assert "causal=True" in repr(attn)


@pytest.mark.parametrize("kwargs, match", [
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
    (dict(return_attn_probs=True), "return_attn_probs"),
    (dict(ulysses_group=object()), "context parallelism"),
    (dict(fp8_config=Float8QuantConfig(format="e5m2")), "E5M2"),
    (dict(fp8_config=Float8QuantConfig(granularity="rowwise")), "ROWWISE"),
    (dict(sink_heads=0), "sink_heads"),
    (dict(sink_heads=True), "sink_heads"),
])
def test_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TurboAttention(**kwargs)


def test_sink_parameter_and_forward_sink():
    """sink_heads makes a float32 zeros parameter (in the state dict, trained like any other);
    forward's sink is for modules without one; sinks need a backend that serves them (not TORCH,
    the CPU's only one)."""
    attn = TurboAttention(causal=True, sink_heads=4)
    assert isinstance(attn.sink, torch.nn.Parameter) and attn.sink.dtype == torch.float32
    assert torch.equal(attn.sink, torch.zeros(4)) and list(attn.state_dict()) == ["sink"]
    assert "sink_heads=4" in repr(attn)
    q = randn((1, 5, 4, 8))
    with pytest.raises(ValueError, match="own sink"):
        attn(q, q, q, sink=torch.zeros(4))
    with pytest.raises(ValueError, match="bias"):
        attn(q, q, q, bias=torch.zeros(1))
    for call in (lambda: attn(q, q, q), lambda: TurboAttention()(q, q, q, sink=torch.zeros(4))):
        with pytest.raises(NoBackendError, match="attention sinks"):
            call()


def test_doctest():
    import doctest

    import turbo_dispatch.modules.attention as mod

    result = doctest.testmod(mod)
    assert result.attempted >= 2 and result.failed == 0


# -- GPU -------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_module_sink_and_fp8_match_the_ops():
    """Pinned to TRITON: the sink module equals flash_attn_func with its sink (gradients into the
    parameter), the fp8 module equals flash_attn_fp8_func with its config."""
    turbo.GlobalBackendManager.set_attn_backend("TRITON")
    try:
        q, k, v, g = (randn(s, torch.bfloat16).cuda() for s in [(2, 200, 8, 128), (2, 200, 2, 128), (2, 200, 2, 128),
                                                                (2, 200, 8, 128)])
        attn = TurboAttention(causal=True, sink_heads=8, device="cuda")
        with torch.no_grad():
            attn.sink.normal_()
        out = attn(q, k, v)
        out.backward(g)
        sink = attn.sink.detach().clone().requires_grad_()
        want = turbo.ops.flash_attn_func(q, k, v, causal=True, sink=sink)
        want.backward(g)
        assert torch.equal(out, want) and torch.equal(attn.sink.grad, sink.grad)
        cfg = Float8QuantConfig(granularity="blockwise", block_size=64)
        fp8 = TurboAttention(causal=True, fp8_config=cfg)
        assert torch.equal(fp8(q, k, v), turbo.ops.flash_attn_fp8_func(q, k, v, causal=True, fp8_config=cfg))
    finally:
        turbo.GlobalBackendManager.set_attn_backend(None)
