"""Attention sinks (GPT-OSS): ``sink=`` on flash_attn_func / flash_attn_varlen_func.

Reference: test_attention's float64 attention with the sink as one more, value-less column of each
row's softmax, gradients (dsink included) from torch.autograd, computed from the same rounded
inputs the kernels see. Inputs, sinks and output gradients are random, never zero. Gate: SNR >=
40 dB on out, lse (rows that attend no key included: their lse is the sink), dq, dk, dv, dsink.

CPU (no marker):

* torch only: ``sink_grad`` against autograd, argument checks, the problem key, TORCH and CUDNN
  refusing sinks with their reason, and the op refusing a backend that does not declare sinks;
* the TRITON kernels under the Triton interpreter, in one subprocess (``--interpreter-checks``,
  as tests/test_triton_attention.py does): MHA/GQA/MQA, causal (with rows that attend no key),
  windows, odd sizes and head dims, varlen with empty sequences, and the public op eager
  (autograd into ``sink``) and compiled (custom ops, fullgraph), dense and varlen, and the
  TurboAttention module with a learnable sink.

GPU (``@pytest.mark.gpu``): shapes pinned to TRITON against the float64 reference; each test
records its SNRs as JUnit properties (``snr_*_db``), the figures the GPU run reports.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import test_attention
from test_attention import cu, randn, ref_grads, varlen_reference
from test_triton_attention import (INTERP_TILE, PLUGIN_NAME, _emit, _gate, _ref_kwargs, _snr, interpreter_adapter,
                                   interpreter_suite)

import turbo_dispatch as turbo
from turbo_dispatch import BackendUnsupportedError, NoBackendError
from turbo_dispatch.op_spec import format_key
from turbo_dispatch.ops import attention as A
from turbo_dispatch.ops.attention_sink import sink_grad

BF16, FP16 = torch.bfloat16, torch.float16
GRAD_NAMES = ("dq", "dk", "dv", "dsink")


def snrs(out, lse, grads, ref) -> dict:
    """SNR in dB of out, lse (when given) and each gradient against ``ref_grads``'s triple."""
    ref_out, ref_lse, ref_g = ref
    vals = {"out": _snr(out, ref_out)}
    if lse is not None:
        vals["lse"] = _snr(lse, ref_lse)
    vals.update({n: _snr(x, r) for n, x, r in zip(GRAD_NAMES, grads, ref_g)})
    return vals


# -- torch only ---------------------------------------------------------------------------------------
def test_sink_grad_matches_autograd():
    """dsink = -sum_rows exp(sink - lse) * rowsum(dO * O), dense and packed, rows with lse -inf
    (packed tokens outside every sequence) skipped."""
    b, sq, hq, d = 2, 7, 3, 8
    q, k, v, g = randn((b, sq, hq, d)), randn((b, 5, hq, d)), randn((b, 5, hq, d)), randn((b, sq, hq, d))
    sink = randn((hq,))
    out, lse, grads = ref_grads(q, k, v, g, sink=sink, causal=True)  # rows 0 and 1 attend no key
    delta = (out * g.double()).sum(-1).transpose(1, 2)
    got = sink_grad(sink.double(), lse, delta)
    assert torch.allclose(got, grads[3], rtol=1e-12, atol=1e-12)
    packed_lse = torch.cat([lse[0], torch.full((hq, 2), float("-inf"), dtype=lse.dtype)], 1)
    packed_delta = torch.cat([delta[0], torch.zeros(hq, 2, dtype=delta.dtype)], 1)
    expected = -(torch.exp(sink.double()[:, None] - lse[0]) * delta[0]).sum(1)
    assert torch.allclose(sink_grad(sink.double(), packed_lse, packed_delta), expected, rtol=1e-12)
    assert sink_grad(sink.bfloat16(), lse, delta).dtype == BF16


def test_problem_key_and_argument_checks():
    q, k = randn((1, 6, 4, 8)), randn((1, 9, 2, 8))
    sink = randn((4,))
    p = A.attention_problem(q, k, k, causal=True, sink=sink)
    assert p.sink and not p.fp8 and "sink=1" in format_key(p)
    assert "sink=0" in turbo.explain("attention", q, k, k).key
    bad = [(randn((3,)), ValueError, r"shape \[heads_q\] = \[4\]"), (randn((4, 1)), ValueError, "shape"),
           (torch.zeros(4, dtype=torch.int32), TypeError, "sink.dtype"), ([0.0] * 4, TypeError, "torch.Tensor")]
    for value, exc, match in bad:
        with pytest.raises(exc, match=match):
            turbo.ops.flash_attn_func(q, k, k, sink=value)
    with pytest.raises(TypeError):
        turbo.ops.flash_attn_func(q, k, k, 0.0, None, False, (-1, -1), False, False, sink)  # keyword only


def test_sdpa_backends_refuse_sinks_with_reason():
    """TORCH and CUDNN have no sink term: they refuse by reason, so on the CPU (TORCH only) a
    sink call has no backend and says why; pinning TORCH names the reason."""
    from turbo_dispatch.backends.cudnn.attention import CudnnAttention
    from turbo_dispatch.backends.torch.attention import TorchAttention

    base = A.AttentionProblem(2, 256, 256, 512, 512, 8, 8, 128, 128, BF16, False, -1, -1, 0.0, 128 ** -0.5, False,
                              False, False, "cuda")
    for adapter in (TorchAttention(), CudnnAttention()):
        assert adapter.supports(base) is None
        assert "sink" in adapter.supports(base._replace(sink=True))
        assert "fp8" in adapter.supports(base._replace(fp8=True, fp8_block=64))
    q = randn((1, 5, 2, 8))
    with pytest.raises(NoBackendError, match="attention sinks"):
        turbo.ops.flash_attn_func(q, q, q, sink=randn((2,)))
    turbo.GlobalBackendManager.set_attn_backend("TORCH")
    try:
        with pytest.raises(BackendUnsupportedError, match="attention sinks"):
            turbo.ops.flash_attn_func(q, q, q, sink=randn((2,)))
    finally:
        turbo.GlobalBackendManager.set_attn_backend(None)


def test_backend_without_the_feature_is_refused(monkeypatch):
    """An adapter that accepts a sink call in supports() but does not declare "sink" (one written
    before sinks existed) is an error at the call, never a result without the sink."""
    from turbo_dispatch.backends.torch.attention import TorchAttention

    monkeypatch.setattr(TorchAttention, "supports", lambda self, p: None)
    q = randn((1, 5, 2, 8))
    with pytest.raises(BackendUnsupportedError, match="does not declare"):
        turbo.ops.flash_attn_func(q, q, q, sink=randn((2,)))


def test_op_spec_inputs_reference_and_training_call():
    """What the autotuner uses: inputs end with a float32 sink, the reference includes it (dense
    and varlen), and a candidate's training call gets it as ``sink=``."""
    from turbo_dispatch.ops.attention_tuning import run_training_call

    q, k = randn((2, 6, 4, 8)), randn((2, 9, 2, 8))
    p = A.attention_problem(q, k, k, causal=True, sink=randn((4,)))
    inputs = A.ATTENTION.make_inputs(p, torch.device("cpu"))
    assert len(inputs) == 4 and inputs[3].shape == (4,) and inputs[3].dtype == torch.float32
    want, _ = test_attention.ref_attention(*(x.double() for x in inputs[:3]), causal=True, sink=inputs[3].double())
    assert torch.allclose(A.ATTENTION.reference(p, inputs), want, rtol=1e-12, atol=1e-12)
    c = cu([2, 4])
    pv = A.attention_varlen_problem(q[0], k[0, :6], k[0, :6], c, c, 4, 4, sink=randn((4,)))
    inputs = A.ATTENTION.make_inputs(pv, torch.device("cpu"))
    assert len(inputs) == 6 and inputs[5].shape == (4,)
    ref_v = varlen_reference(*inputs[:3], torch.ones_like(inputs[0]), inputs[3].tolist(), inputs[4].tolist(), {},
                             sink=inputs[5])[0]
    assert torch.allclose(A.ATTENTION.reference(pv, inputs), ref_v, rtol=1e-12, atol=1e-12)

    calls = []

    class Recorder:
        def forward(self, problem, q, k, v, cu_q, cu_k, config=None, sink=None):
            calls.append(("forward", sink))
            return q * 1, None, "saved"

        def backward(self, problem, saved, grad_out, config=None):
            calls.append(("backward", saved))

    run_training_call(Recorder(), pv, inputs, None)
    assert calls[0][0] == "forward" and calls[0][1] is inputs[5] and calls[1] == ("backward", "saved")


# -- the interpreter side (runs in the subprocess) ----------------------------------------------------
#: id -> (B, Sq, Sk, Hq, Hkv, Dqk, Dv, dtype, kwargs)
DENSE_TINY = {
    "mha": (1, 17, 17, 2, 2, 32, 32, FP16, {}),
    "gqa-causal-sq>sk": (1, 33, 17, 4, 2, 32, 32, FP16, dict(causal=True)),  # rows 0..15 attend no key
    "mqa-window-bf16-48/24": (1, 19, 23, 4, 1, 48, 24, BF16, dict(window_size=(5, 3))),
    "odd-d24-causal-scale": (2, 9, 13, 2, 2, 24, 24, FP16, dict(causal=True, softmax_scale=0.3)),
}
#: id -> (lens_q, lens_k, Hq, Hkv, D, max_pad, dtype, kwargs)
VARLEN_TINY = {
    "empty-seqs-causal-gqa": ([3, 0, 17, 5], [5, 2, 20, 0], 4, 2, 32, 1, FP16, dict(causal=True)),
}


def _interpreter_checks() -> None:  # pragma: no cover - runs in the subprocess
    torch.manual_seed(4321)
    ad = interpreter_adapter()

    def leaves(*shapes, dtype):
        return [randn(s).to(dtype) for s in shapes]

    for name, (b, sq, sk, hq, hk, d, dv, dtype, kw) in DENSE_TINY.items():
        q, k, v, g = leaves((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv), (b, sq, hq, dv), dtype=dtype)
        sink = randn((hq,))
        ref = ref_grads(q, k, v, g, sink=sink, **_ref_kwargs(kw))
        p = A.attention_problem(q, k, v, return_lse=True, sink=sink, **kw)
        out, lse, saved = ad.forward(p, q, k, v, None, None, config=INTERP_TILE, sink=sink)
        _emit(f"dense[{name}]", *_gate(snrs(out, lse, ad.backward(p, saved, g), ref)))

    for name, (lq, lk, hq, hk, d, pad, dtype, kw) in VARLEN_TINY.items():
        c_q, c_k = cu(lq), cu(lk)
        q, k, v, g = leaves((sum(lq), hq, d), (sum(lk), hk, d), (sum(lk), hk, d), (sum(lq), hq, d), dtype=dtype)
        sink = randn((hq,)).bfloat16()
        ref = varlen_reference(q, k, v, g, c_q, c_k, kw, sink=sink)
        p = A.attention_varlen_problem(q, k, v, c_q, c_k, max(lq) + pad, max(lk) + pad, return_lse=True, sink=sink,
                                       **kw)
        out, lse, saved = ad.forward(p, q, k, v, c_q, c_k, config=INTERP_TILE, sink=sink)
        grads = ad.backward(p, saved, g)
        ok, detail = _gate(snrs(out, lse, grads, ref))
        _emit(f"varlen[{name}]", ok and grads[3].dtype == BF16, detail)

    # The public op through the plugin entry: eager (autograd reaches the sink), then compiled.
    turbo.GlobalBackendManager.set_attn_backend(PLUGIN_NAME)
    try:
        q, k, v, g = leaves((2, 21, 4, 32), (2, 29, 2, 32), (2, 29, 2, 32), (2, 21, 4, 32), dtype=FP16)
        sink = randn((4,))
        kw = dict(causal=True, window_size=(9, -1))
        ref = ref_grads(q, k, v, g, sink=sink, **_ref_kwargs(kw))

        def step(fn):
            xs = [x.clone().requires_grad_() for x in (q, k, v, sink)]
            o, lse_ = fn(*xs)
            o.backward(g)
            return snrs(o, lse_, [x.grad for x in xs], ref), lse_.requires_grad

        def call(q_, k_, v_, s_):
            return turbo.ops.flash_attn_func(q_, k_, v_, return_lse=True, sink=s_, **kw)

        vals, lse_grad = step(call)
        ok, detail = _gate(vals)
        _emit("op-eager", ok and not lse_grad, detail)
        vals, _ = step(torch.compile(call, fullgraph=True, backend="aot_eager"))
        _emit("op-compiled", *_gate(vals))

        c_q, c_k = cu([5, 0, 16]), cu([7, 3, 16])
        qv, kv, vv, gv = leaves((21, 4, 32), (26, 2, 32), (26, 2, 32), (21, 4, 32), dtype=FP16)
        ref_v = varlen_reference(qv, kv, vv, gv, c_q, c_k, dict(causal=True), sink=sink)
        xs = [x.clone().requires_grad_() for x in (qv, kv, vv, sink)]
        fn = torch.compile(lambda a, b_, c, s_: turbo.ops.flash_attn_varlen_func(a, b_, c, c_q, c_k, 16, 16,
                                                                                  causal=True, sink=s_),
                           fullgraph=True, backend="aot_eager")
        o = fn(*xs)
        o.backward(gv)
        _emit("op-compiled-varlen", *_gate(snrs(o, None, [x.grad for x in xs], ref_v)))

        # TurboAttention with a learnable sink: the module's parameter gets the sink gradient.
        module = turbo.modules.TurboAttention(causal=True, sink_heads=4)
        with torch.no_grad():
            module.sink.copy_(sink)
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        o = module(*xs)
        o.backward(g)
        ref_m = ref_grads(q, k, v, g, sink=sink, causal=True)
        _emit("module-sink", *_gate(snrs(o, None, [x.grad for x in xs] + [module.sink.grad], ref_m)))
    finally:
        turbo.GlobalBackendManager.set_attn_backend(None)


_CPU_NAMES = ([f"dense[{n}]" for n in DENSE_TINY] + [f"varlen[{n}]" for n in VARLEN_TINY]
              + ["op-eager", "op-compiled", "op-compiled-varlen", "module-sink"])


_interpreter_results, test_interpreter = interpreter_suite(__file__, _CPU_NAMES)

if __name__ == "__main__" and "--interpreter-checks" in sys.argv:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _interpreter_checks()


# -- GPU -------------------------------------------------------------------------------------------
@pytest.fixture
def pinned():
    turbo.GlobalBackendManager.set_attn_backend("TRITON")
    yield turbo
    turbo.GlobalBackendManager.set_attn_backend(None)


def _run(fn, q, k, v, sink, grad, *args, **kw):
    """(out, lse, [dq, dk, dv, dsink]) of one call on fresh CUDA leaves."""
    xs = [x.detach().cuda().requires_grad_() for x in (q, k, v, sink)]
    out, lse = fn(*xs[:3], *args, return_lse=True, sink=xs[3], **kw)
    out.backward(grad.cuda())
    return out.detach(), lse, [x.grad for x in xs]


def _record(record_property, vals: dict) -> None:
    for name, db in vals.items():
        record_property(f"snr_{name}_db", round(db, 1))
    print("SNR dB vs float64:", {k: round(x, 1) for k, x in vals.items()})
    assert min(vals.values()) >= 40.0, vals


#: (B, Sq, Sk, Hq, Hkv, Dqk, Dv, dtype, kwargs)
GPU_GRID = [
    (2, 257, 257, 8, 8, 128, 128, BF16, {}),
    (2, 257, 257, 8, 8, 128, 128, FP16, dict(causal=True)),
    (1, 331, 200, 8, 2, 64, 64, BF16, dict(causal=True)),  # rows that attend no key: lse = sink
    (1, 300, 300, 8, 2, 128, 128, BF16, dict(window_size=(64, 0))),
    (1, 257, 257, 4, 4, 192, 128, BF16, dict(causal=True)),
    (1, 200, 200, 4, 4, 80, 80, BF16, {}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_GRID, ids=lambda c: "-".join(map(str, c[:7])) + f"-{c[7]}-{c[8]}".replace(" ", ""))
def test_gpu_sink_grid(case, pinned, record_property):
    b, sq, sk, hq, hk, d, dv, dtype, kw = case
    q, k, v, g = (randn(s, dtype) for s in [(b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv), (b, sq, hq, dv)])
    sink = randn((hq,))
    ref = ref_grads(q, k, v, g, sink=sink, **_ref_kwargs(kw))
    out, lse, grads = _run(pinned.ops.flash_attn_func, q, k, v, sink, g, **kw)
    assert grads[3].dtype == torch.float32 and grads[3].shape == (hq,)
    _record(record_property, snrs(out, lse, grads, ref))


@pytest.mark.gpu
def test_gpu_sink_varlen(pinned, record_property):
    lq, lk, hq, hk = [100, 0, 257, 33], [120, 7, 250, 0], 8, 2
    c_q, c_k = cu(lq), cu(lk)
    q, k, v, g = (randn(s, BF16) for s in [(sum(lq), hq, 128), (sum(lk), hk, 128), (sum(lk), hk, 128),
                                           (sum(lq), hq, 128)])
    sink = randn((hq,))
    ref = varlen_reference(q, k, v, g, c_q, c_k, dict(causal=True), sink=sink)
    got = _run(pinned.ops.flash_attn_varlen_func, q, k, v, sink, g, c_q.cuda(), c_k.cuda(), max(lq), max(lk),
               causal=True)
    _record(record_property, snrs(*got, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["aot_eager", "inductor"])
def test_gpu_sink_compile_fullgraph(mode, pinned, fresh_dynamo):
    """Compiled (custom ops) and eager calls with a sink agree, gradients of q, k, v, sink included."""
    q, k, v, g = (randn(s, BF16).cuda() for s in [(2, 256, 8, 128), (2, 256, 2, 128), (2, 256, 2, 128),
                                                  (2, 256, 8, 128)])
    sink = randn((8,)).cuda()

    def call(*xs):
        return pinned.ops.flash_attn_func(*xs[:3], causal=True, sink=xs[3])

    results = []
    for fn in (call, torch.compile(call, fullgraph=True, backend=mode)):
        xs = [x.clone().requires_grad_() for x in (q, k, v, sink)]
        out = fn(*xs)
        out.backward(g)
        results.append([out.detach()] + [x.grad for x in xs])
    for got, want in zip(*results):
        assert _snr(got.float(), want.float()) > 60
