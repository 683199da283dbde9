"""The Gluon Hopper attention backward (backends/triton/attention_gluon_bwd.py) and its use by TRITON.

CPU (no marker): the gate's reasons, each condition forced with monkeypatch on a machine made to
look like an sm_90 host (test_attention_gluon's ``sm90`` fixture): the switch
(``PRIMUS_TURBO_ATTN_GLUON_BWD``, on unless set to a false value), the package-wide Gluon
switch and the machine, every problem and tensor the kernels leave to the plain-Triton backward;
and the adapter's wiring: the eager and the compiled backward take the Gluon launcher exactly
when the gate says None, else the plain-Triton kernels. The sm_90 compile (registers, spills,
shared memory) is checked by tests/test_compile_sm90.py (family ``attention_gluon_bwd``).

GPU (``@pytest.mark.gpu``, sm_90 only): dq, dk, dv of
the kernels against a float32 reference on random non-zero inputs, SNR >= 40 dB, over head dims
64/128, full and causal masks, MHA/GQA/MQA, Sq == Sk and Sq != Sk (rows that attend nothing
get dq = 0), odd lengths, bf16 and fp16, bit-identical over two runs; strided q, k, v and dout;
and the op pinned to TRITON running its backward on the Gluon kernels, eager and compiled.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from test_attention_gluon import GPU_CASES as FORWARD_CASES
from test_attention_gluon import (_case_id, _problem, count_calls, refused_problems,  # noqa: F401  (sm90: a fixture)
                                  served_problems, sm90)
from turbo_dispatch.errors import ConfigError

BF16, FP16 = torch.bfloat16, torch.float16
def _off(value: str) -> str:
    return f"the Gluon attention backward is switched off (PRIMUS_TURBO_ATTN_GLUON_BWD={value})"


def _agb():
    from turbo_dispatch.backends.triton import attention_gluon_bwd as AGB

    return AGB


@pytest.fixture
def switched_on(sm90, monkeypatch):  # noqa: F811
    """The forced sm_90 machine with the backward switched on: the module."""
    AGB = _agb()
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_ENV, "1")
    return AGB


# -- the gate ------------------------------------------------------------------------------------------
def test_on_by_default(sm90, monkeypatch):  # noqa: F811
    """Unset, the switch lets the kernels serve."""
    AGB = _agb()
    monkeypatch.delenv(AGB.ATTN_GLUON_BWD_ENV, raising=False)
    assert AGB.gluon_backward_refusal(_problem()) is None
    assert AGB.machine_refusal() is None


@pytest.mark.parametrize("value", ["0", "false", "off", "no"])
def test_switch_off_values_refuse(sm90, monkeypatch, value):  # noqa: F811
    monkeypatch.setenv(_agb().ATTN_GLUON_BWD_ENV, value)
    assert _agb().gluon_backward_refusal(_problem()) == _off(value)


@pytest.mark.parametrize("value", ["1", "true", "on", "yes"])
def test_switch_on_values_serve(sm90, monkeypatch, value):  # noqa: F811
    monkeypatch.setenv(_agb().ATTN_GLUON_BWD_ENV, value)
    assert _agb().gluon_backward_refusal(_problem()) is None


def test_switch_bad_value_names_the_variable(sm90, monkeypatch):  # noqa: F811
    AGB = _agb()
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_ENV, "maybe")
    with pytest.raises(ConfigError, match=AGB.ATTN_GLUON_BWD_ENV):
        AGB.gluon_backward_refusal(_problem())


def test_switch_is_read_per_call(switched_on, monkeypatch):
    assert switched_on.gluon_backward_refusal(_problem()) is None
    monkeypatch.setenv(switched_on.ATTN_GLUON_BWD_ENV, "0")
    assert switched_on.gluon_backward_refusal(_problem()) == _off("0")


def test_forward_switch_leaves_the_backward_alone(switched_on, monkeypatch):
    """PRIMUS_TURBO_ATTN_GLUON is the forward's switch; the backward has its own."""
    monkeypatch.setenv("PRIMUS_TURBO_ATTN_GLUON", "0")
    assert switched_on.gluon_backward_refusal(_problem()) is None


def test_machine_reasons(switched_on, monkeypatch):
    """With the switch on, each machine condition that refuses names itself."""
    from test_attention_gluon import _clear_device_caches

    from turbo_dispatch.backends.triton import fp8_blockwise_gluon as GB

    AGB = switched_on
    assert AGB.machine_refusal() is None
    monkeypatch.setenv(GB.GLUON_ENV, "0")
    assert GB.GLUON_ENV in AGB.machine_refusal()
    monkeypatch.delenv(GB.GLUON_ENV)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    _clear_device_caches(GB)
    assert "sm_80" in AGB.machine_refusal()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _clear_device_caches(GB)
    assert "NVIDIA GPU" in AGB.machine_refusal()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in AGB.machine_refusal()
    monkeypatch.setattr(GB, "_triton_release", lambda: "3.7")
    assert "this is triton 3.7" in AGB.machine_refusal()
    monkeypatch.setattr(GB, "gluon", None)
    assert "gluon is missing" in AGB.machine_refusal()


def test_problem_reasons(switched_on):
    """The forward's problems are served; everything else is refused with its reason."""
    for p in served_problems():
        assert switched_on.gluon_backward_refusal(p) is None, p
    for reason, p in {**refused_problems(), "empty q": _problem(seqlen_q=0)}.items():
        why = switched_on.gluon_backward_refusal(p)
        assert why is not None and reason.removesuffix(" q") in why, (reason, why)


def test_tensor_reasons(switched_on, monkeypatch):
    """q, k, v must suit the TMA reads (the forward's rules); out and dout must be CUDA tensors,
    whatever their layout (dout is copied where the descriptors cannot read it)."""
    AGB = switched_on
    p = _problem()
    q = torch.randn(2, 33, 8, 64, dtype=BF16)
    kv = torch.randn(2, 33, 2, 64, dtype=BF16)
    assert "q is on cpu" in AGB.gluon_backward_refusal(p, q, kv, kv, q, q)
    heads_major = torch.randn(2, 8, 33, 64, dtype=BF16).transpose(1, 2)
    assert "heads must be packed" in AGB.gluon_backward_refusal(p, heads_major, kv, kv, q, q)
    odd = torch.randn(2, 33 * 2 * 64 + 8, dtype=BF16)[:, 4:4 + 33 * 2 * 64].view(2, 33, 2, 64)
    assert "k: base and batch/token strides must be 16-byte aligned" in AGB.gluon_backward_refusal(p, q, odd, kv,
                                                                                                  q, q)
    monkeypatch.setattr(AGB, "tensor_refusal", lambda **tensors: None)
    assert AGB.gluon_backward_refusal(p, q, kv, kv, q, q) == "out is on cpu"
    on_cuda = SimpleNamespace(device=torch.device("cuda", 0))  # the gate reads only out's device
    assert AGB.gluon_backward_refusal(p, q, kv, kv, on_cuda, heads_major) == "dout is on cpu"
    assert AGB.gluon_backward_refusal(p, q, kv, kv, on_cuda, on_cuda) is None


def test_the_real_gate_refuses_on_this_cpu_machine(monkeypatch):
    """Without an sm_90 GPU the gate has a reason even when opted in."""
    AGB = _agb()
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_ENV, "1")
    if torch.cuda.is_available() and AGB.machine_refusal() is None:
        pytest.skip("this host runs the kernels")
    assert AGB.gluon_backward_refusal(_problem()) is not None


def test_configs_cover_the_forwards_head_dims():
    AGB = _agb()
    for d in (64, 128):
        for causal in (False, True):
            dkdv, dq = AGB.dkdv_config(d, causal), AGB.dq_config(d, causal)
            assert dkdv.kernel == "dkdv" and dq.kernel == "dq" and dkdv.head_dim == dq.head_dim == d
            # Two math warpgroups of 64 rows: keys in the dK/dV kernel, queries in the dQ kernel.
            assert dkdv.block_n == dq.block_m == 128 and dkdv.causal is dq.causal is causal


# -- the adapter's wiring -----------------------------------------------------------------------------------
@pytest.fixture
def backward_launchers(monkeypatch):
    """The adapter with both backward launchers replaced by recorders returning tagged gradients,
    and the Gluon gate's answer settable: ``(adapter, calls, set_refusal)``."""
    from turbo_dispatch.backends.triton import attention as TA

    AGB = _agb()
    calls = []

    def plain(p, q, k, v, cu_q, cu_k, out, lse, grad_out, tiles, splits=None):
        calls.append("plain")
        return q.new_full(q.shape, 1.0), k.new_full(k.shape, 1.0), v.new_full(v.shape, 1.0), lse

    def gluon(p, q, k, v, out, lse, dout):
        calls.append("gluon")
        return q.new_full(q.shape, 2.0), k.new_full(k.shape, 2.0), v.new_full(v.shape, 2.0)

    answer = {"why": None}
    asked = []

    def gate(p, q=None, k=None, v=None, out=None, dout=None):
        asked.append((q, k, v, out, dout))
        return answer["why"]

    monkeypatch.setattr(TA, "attend_backward", plain)
    monkeypatch.setattr(AGB, "attend_backward", gluon)
    monkeypatch.setattr(AGB, "gluon_backward_refusal", gate)
    return TA.TritonAttention(), calls, lambda why: answer.update(why=why), asked


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_adapter_takes_the_gluon_backward_when_the_gate_allows(backward_launchers, path):
    from turbo_dispatch.ops.attention import attention_problem

    ad, calls, set_refusal, asked = backward_launchers
    q = torch.randn(1, 9, 4, 64, dtype=BF16)
    k, v = torch.randn(1, 9, 2, 64, dtype=BF16), torch.randn(1, 9, 2, 64, dtype=BF16)
    out, lse, grad = torch.randn_like(q), torch.randn(1, 4, 9), torch.randn_like(q)
    p = attention_problem(q, k, v, causal=True, return_lse=True)

    def backward():
        if path == "eager":
            return ad.backward(p, (q, k, v, None, None, out, lse, None, None), grad)
        return ad.compiled_backward(p, (q, k, v, None, None, out, lse), grad)

    grads = backward()
    assert calls == ["gluon"] and len(grads) == 3 and all((g == 2).all() for g in grads)
    assert all(a is b for a, b in zip(asked[-1], (q, k, v, out, grad)))
    set_refusal(_off("0"))
    grads = backward()
    assert calls == ["gluon", "plain"] and len(grads) == 3 and all((g == 1).all() for g in grads)


def test_adapter_switched_off_runs_the_plain_backward(sm90, monkeypatch):  # noqa: F811
    """With the real gate on an sm_90 machine and PRIMUS_TURBO_ATTN_GLUON_BWD=0, the eager and
    the compiled backward run the plain-Triton kernels."""
    from turbo_dispatch.backends.triton import attention as TA
    from turbo_dispatch.ops.attention import attention_problem

    monkeypatch.setenv(_agb().ATTN_GLUON_BWD_ENV, "0")
    seen = []
    monkeypatch.setattr(TA, "attend_backward", lambda *a, **kw: seen.append(1) or (a[1], a[2], a[3], a[7]))
    monkeypatch.setattr(_agb(), "attend_backward", lambda *a, **kw: pytest.fail("the Gluon backward ran"))
    ad = TA.TritonAttention()
    q, lse = torch.randn(1, 9, 4, 64, dtype=BF16), torch.zeros(1, 4, 9)
    p = attention_problem(q, q, q, causal=True)._replace(platform="cuda")
    ad.backward(p, (q, q, q, None, None, q, lse, None, None), q)
    ad.compiled_backward(p, (q, q, q, None, None, q, lse), q)
    assert seen == [1, 1]


# -- GPU --------------------------------------------------------------------------------------------------
@pytest.fixture
def gpu(monkeypatch):
    """The backward switched on; skips where the kernels cannot run."""
    AGB = _agb()
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_ENV, "1")
    why = AGB.machine_refusal()
    if why is not None:
        pytest.skip(f"the Gluon attention backward does not run here: {why}")
    return AGB


#: (B, Sq, Sk, Hq, Hkv, D, dtype, causal): the forward's cases (each Sq > Sk causal case has rows
#: that attend nothing), with MQA at d128 causal and rows attending nothing at d64.
GPU_CASES = FORWARD_CASES + [(1, 1000, 1000, 8, 1, 128, FP16, True), (1, 1000, 77, 4, 1, 64, BF16, True)]


def _reference(q, k, v, dout, causal, scale):
    """float32 (out, lse, [dq, dk, dv]) on the CPU."""
    from test_attention import ref_attention

    leaves = [x.detach().cpu().float().requires_grad_() for x in (q, k, v)]
    out, lse = ref_attention(*leaves, scale=scale, causal=causal)
    out.backward(dout.detach().cpu().float())
    return out.detach(), lse.detach(), [x.grad for x in leaves]


def _check_case(AGB, q, k, v, dout, causal, scale=None):
    """Runs the Gluon backward twice from the reference's out and lse; checks SNR and determinism."""
    from test_triton_attention import _snr

    from turbo_dispatch.ops.attention import attention_problem

    p = attention_problem(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    ref_out, ref_lse, ref = _reference(q, k, v, dout, causal, p.softmax_scale)
    out, lse = ref_out.to(q.dtype).cuda(), ref_lse.float().cuda()
    assert AGB.gluon_backward_refusal(p, q, k, v, out, dout) is None
    first = AGB.attend_backward(p, q, k, v, out, lse, dout)
    second = AGB.attend_backward(p, q, k, v, out, lse, dout)
    torch.cuda.synchronize()
    for name, got, again, want, like in zip(("dq", "dk", "dv"), first, second, ref, (q, k, v)):
        assert got.shape == like.shape and got.dtype == like.dtype, name
        assert torch.isfinite(got).all(), name
        assert torch.equal(got, again), f"{name} differs between two runs"
        snr = _snr(got.float(), want)
        assert snr >= 40.0, (name, snr)
    return p, first


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_backward_matches_reference(case, gpu):
    from test_attention import randn

    b, sq, sk, hq, hk, d, dtype, causal = case
    q, k, v = (randn(s, dtype).cuda() for s in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)))
    dout = randn((b, sq, hq, d), dtype).cuda()
    _, (dq, _, _) = _check_case(gpu, q, k, v, dout, causal)
    if causal and sq > sk:
        assert (dq[:, :sq - sk] == 0).all()


@pytest.mark.gpu
def test_gpu_backward_strided_inputs_and_scale(gpu):
    """q, k, v sliced from one packed qkv tensor (read in place), a heads-major dout (copied to
    a layout the descriptors read) and a scale other than 1/sqrt(d)."""
    from test_attention import randn

    qkv = randn((2, 333, 3, 8, 128), BF16).cuda()
    q, k, v = qkv.unbind(2)
    dout = randn((2, 8, 333, 128), BF16).cuda().transpose(1, 2)
    _check_case(gpu, q, k, v, dout, True, scale=0.37)


@pytest.mark.gpu
def test_gpu_op_runs_its_backward_on_gluon(gpu, monkeypatch, fresh_dynamo):
    """ops.flash_attn_func pinned to TRITON runs its backward on the Gluon kernels, eager and under
    torch.compile; without the switch the same call runs the plain-Triton backward, with the same
    gradients to within rounding."""
    from test_attention import randn
    from test_triton_attention import _snr

    import turbo_dispatch as turbo

    calls = count_calls(monkeypatch, gpu, "attend_backward")
    turbo.GlobalBackendManager.set_attn_backend("TRITON")
    try:
        q, k, v = (randn(s, BF16).cuda() for s in ((2, 512, 16, 128), (2, 512, 4, 128), (2, 512, 4, 128)))
        grad = randn((2, 512, 16, 128), BF16).cuda()

        def grads(fn):
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            fn(*leaves).backward(grad)
            return [x.grad for x in leaves]

        def call(q, k, v):
            return turbo.ops.flash_attn_func(q, k, v, causal=True)

        eager = grads(call)
        assert len(calls) == 1
        compiled = grads(torch.compile(call, fullgraph=True, backend="aot_eager"))
        assert len(calls) == 2 and all(torch.equal(a, b) for a, b in zip(eager, compiled))
        monkeypatch.setenv(gpu.ATTN_GLUON_BWD_ENV, "0")
        plain = grads(call)
        assert len(calls) == 2
        assert all(_snr(a.float(), b.float()) > 40 for a, b in zip(eager, plain))
    finally:
        turbo.GlobalBackendManager.set_attn_backend(None)


def test_switch_settings_have_their_own_tuning_identity(monkeypatch):
    """Timings taken with the pipelined forward forced on or off, or the Gluon backward switched
    off, are stored under another identity than the defaults' (a tuning DB never mixes them)."""
    from turbo_dispatch.backends.triton import attention_gluon as AG
    from turbo_dispatch.backends.triton import attention_gluon_bwd as AGB
    from turbo_dispatch.backends.triton.attention import TritonAttention

    for var in (AG.ATTN_GLUON_PIPELINE_ENV, AGB.ATTN_GLUON_BWD_ENV):
        monkeypatch.delenv(var, raising=False)
    default = TritonAttention().identity()
    assert AGB.KERNEL_REVISION in default and AG.KERNEL_REVISION in default
    seen = {default}
    for pipeline in ("1", "0"):
        monkeypatch.setenv(AG.ATTN_GLUON_PIPELINE_ENV, pipeline)
        seen.add(TritonAttention().identity())
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_ENV, "0")
    plain_backward = TritonAttention().identity()
    assert len(seen | {plain_backward}) == 4 and AGB.KERNEL_REVISION not in plain_backward
    monkeypatch.delenv(AG.ATTN_GLUON_PIPELINE_ENV)
    monkeypatch.delenv(AGB.ATTN_GLUON_BWD_ENV)
    assert TritonAttention().identity() == default
