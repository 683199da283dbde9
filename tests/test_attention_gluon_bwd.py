"""The Gluon Hopper attention backward (backends/triton/attention_gluon_bwd.py) and its use by TRITON.

CPU (no marker): the gate's reasons, each condition forced with monkeypatch on a machine made to
look like an sm_90 host (test_attention_gluon's ``sm90`` fixture): the switch
(``PRIMUS_TURBO_ATTN_GLUON_BWD``, on unless set to a false value), the package-wide Gluon
switch and the machine, every problem and tensor the kernels leave to the plain-Triton backward;
the variants' switches (``PRIMUS_TURBO_ATTN_GLUON_BWD_HEAVY_FIRST``, ``..._OVERLAP``: off unless
set, read per call, each setting its own tuning identity), the heavy-first grids and the
launcher's two paths (in turn, or side by side on two streams) with the kernels replaced by
recorders; and the adapter's wiring: the eager and the compiled backward take the Gluon launcher
exactly when the gate says None, else the plain-Triton kernels. The sm_90 compile (registers, spills,
shared memory) is checked by tests/test_compile_sm90.py (families ``attention_gluon_bwd`` and
``attention_gluon_bwd_window``). Sliding windows: served unless the forward's window switch
(``PRIMUS_TURBO_ATTN_GLUON_WINDOW``) is off, both kernels launched with ``WINDOW`` and the bounds.

GPU (``@pytest.mark.gpu``, sm_90 only): dq, dk, dv of
the kernels against a float32 reference on random non-zero inputs, SNR >= 40 dB, over head dims
64/128, full and causal masks, MHA/GQA/MQA, Sq == Sk and Sq != Sk (rows that attend nothing
get dq = 0), odd lengths, bf16 and fp16, bit-identical over two runs; every variant over the
same cases, bit-identical to the default (they reorder programs and streams, never a sum); the
backward captured in a CUDA graph with and without the side stream; strided q, k, v and dout;
and the op pinned to TRITON running its backward on the Gluon kernels, eager and compiled, in
the default and in the variants; sliding windows (the forward's window cases) against the
windowed reference, deterministic, in every variant.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from test_attention import ZERO_GRAD_TOL, assert_close
from test_attention_gluon import GPU_CASES as FORWARD_CASES
from test_attention_gluon import WINDOW_CASES, _window_id, windowed_problems
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
            # The heavy-first order is a causal variant: full-mask programs all weigh the same.
            assert AGB.dkdv_config(d, causal, True).heavy_first is AGB.dq_config(d, causal, True).heavy_first is causal
            assert not dkdv.heavy_first and not dq.heavy_first


# -- the variants' switches -----------------------------------------------------------------------------
def _variant_switches():
    AGB = _agb()
    return {AGB.ATTN_GLUON_BWD_HEAVY_FIRST_ENV: AGB.heavy_first_setting,
            AGB.ATTN_GLUON_BWD_OVERLAP_ENV: AGB.overlap_setting}


@pytest.mark.parametrize("var", ["PRIMUS_TURBO_ATTN_GLUON_BWD_HEAVY_FIRST", "PRIMUS_TURBO_ATTN_GLUON_BWD_OVERLAP"])
def test_variant_switches_are_on_by_default_and_read_per_call(monkeypatch, var):
    setting = _variant_switches()[var]
    monkeypatch.delenv(var, raising=False)
    assert setting() is True
    for value in ("1", "true", "on", "yes"):
        monkeypatch.setenv(var, value)
        assert setting() is True
    for value in ("0", "false", "off", "no"):
        monkeypatch.setenv(var, value)
        assert setting() is False
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ConfigError, match=var):
        setting()


def test_variant_switches_leave_the_gate_alone(switched_on, monkeypatch):
    """The variants change how the kernels run, not whether they serve."""
    for var in _variant_switches():
        monkeypatch.setenv(var, "0")
    assert switched_on.gluon_backward_refusal(_problem()) is None
    assert switched_on.variant_tag() == "+no-heavy-first+no-overlap"


def _launch_tensors(b=2, sq=300, sk=500, hq=8, hk=2, d=128, dtype=BF16):
    q, dout, dq = (torch.zeros(b, sq, hq, d, dtype=dtype) for _ in range(3))
    k, v, dk, dv = (torch.zeros(b, sk, hk, d, dtype=dtype) for _ in range(4))
    lse2, delta = torch.zeros(b, hq, sq), torch.zeros(b, hq, sq)
    return q, k, v, dout, dq, dk, dv, lse2, delta


@pytest.mark.parametrize("causal", [False, True])
def test_heavy_first_grids(causal):
    """Heavy-first launches put the heads on the grid's first dimension (so a block of every head
    starts before the next block of any head), causal calls only; the default grid is the
    forward's ``(blocks, B * H)``."""
    AGB = _agb()
    if AGB.gluon is None:
        pytest.skip("triton.experimental.gluon is missing")
    q, k, v, dout, dq, dk, dv, lse2, delta = _launch_tensors()
    for heavy_first in (False, True):
        grid, _, kwargs = AGB.dkdv_launch_args(q, k, v, dout, dk, dv, lse2, delta, 0.1, causal, heavy_first)
        swapped = heavy_first and causal
        assert grid == ((2 * 2, 4) if swapped else (4, 2 * 2)) and kwargs["HEAVY_FIRST"] is swapped
        grid, _, kwargs = AGB.dq_launch_args(q, k, v, dout, dq, lse2, delta, 0.1, causal, heavy_first)
        assert grid == ((2 * 8, 3) if swapped else (3, 2 * 8)) and kwargs["HEAVY_FIRST"] is swapped


def test_heavy_first_keeps_the_default_grid_past_its_limit(monkeypatch):
    """More blocks than the grid's second dimension holds: the default order."""
    AGB = _agb()
    if AGB.gluon is None:
        pytest.skip("triton.experimental.gluon is missing")
    monkeypatch.setattr(AGB, "_GRID_Y", 2)
    q, k, v, dout, dq, dk, dv, lse2, delta = _launch_tensors()
    grid, _, kwargs = AGB.dkdv_launch_args(q, k, v, dout, dk, dv, lse2, delta, 0.1, True, True)
    assert grid == (4, 4) and kwargs["HEAVY_FIRST"] is False
    grid, _, kwargs = AGB.dq_launch_args(q, k, v, dout, dq, lse2, delta, 0.1, True, True)
    assert grid == (3, 16) and kwargs["HEAVY_FIRST"] is False


class _Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **kwargs)`` appends ``(name, grid,
    kwargs)`` to ``log``."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.name, grid, kwargs))


@pytest.fixture
def recorded_launches(switched_on, monkeypatch):
    """``attend_backward`` with its three kernels and ``side_by_side`` replaced by recorders and
    ``overlappable`` answering True (CPU tensors): ``(AGB, log)``."""
    AGB = switched_on
    if AGB.gluon is None:
        pytest.skip("triton.experimental.gluon is missing")
    log = []
    monkeypatch.setattr(AGB.AK, "attn_bwd_preprocess_kernel", _Recorder("preprocess", log))
    monkeypatch.setattr(AGB, "attn_bwd_dkdv_gluon_kernel", _Recorder("dkdv", log))
    monkeypatch.setattr(AGB, "attn_bwd_dq_gluon_kernel", _Recorder("dq", log))
    monkeypatch.setattr(AGB, "overlappable", lambda t: True)

    def side_by_side(first, second, device):
        # The real one runs ``second`` on the side stream first, then ``first`` on the current one.
        log.append(("fork", device))
        second_out = second()
        first_out = first()
        log.append(("join", device))
        return first_out, second_out

    monkeypatch.setattr(AGB, "side_by_side", side_by_side)
    for var in (*_variant_switches(), AGB.ATTN_GLUON_BWD_SELF_DELTA_ENV):
        monkeypatch.delenv(var, raising=False)
    return AGB, log


def _launch_backward(AGB, causal=True):
    from turbo_dispatch.ops.attention import attention_problem

    q, k, v, dout, *_ = _launch_tensors()
    p = attention_problem(q, k, v, causal=causal, return_lse=True)
    out, lse = torch.zeros_like(q), torch.zeros(2, 8, 300)
    dq, dk, dv = AGB.attend_backward(p, q, k, v, out, lse, dout)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_backward_overlaps_heaviest_first_by_default(recorded_launches):
    AGB, log = recorded_launches
    _launch_backward(AGB)
    assert [entry[0] for entry in log] == ["preprocess", "fork", "dkdv", "dq", "join"]
    assert log[2][2]["HEAVY_FIRST"] and log[3][2]["HEAVY_FIRST"]


def test_backward_switched_off_runs_its_kernels_in_turn(recorded_launches, monkeypatch):
    AGB, log = recorded_launches
    for var in _variant_switches():
        monkeypatch.setenv(var, "0")
    _launch_backward(AGB)
    assert [entry[0] for entry in log] == ["preprocess", "dkdv", "dq"]
    assert not log[1][2]["HEAVY_FIRST"] and not log[2][2]["HEAVY_FIRST"]


def test_backward_overlap_forks_the_dkdv_kernel_first(recorded_launches, monkeypatch):
    """With the overlap switch on: the dK/dV kernel on the side stream, launched first, then the
    dQ kernel, between one fork and one join; off again, in turn (read per call)."""
    AGB, log = recorded_launches
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_OVERLAP_ENV, "1")
    _launch_backward(AGB)
    assert [entry[0] for entry in log] == ["preprocess", "fork", "dkdv", "dq", "join"]
    monkeypatch.setattr(AGB, "overlappable", lambda t: False)  # traced or not a plain CUDA tensor
    log.clear()
    _launch_backward(AGB)
    assert [entry[0] for entry in log] == ["preprocess", "dkdv", "dq"]
    monkeypatch.setattr(AGB, "overlappable", lambda t: True)
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_OVERLAP_ENV, "0")
    log.clear()
    _launch_backward(AGB)
    assert [entry[0] for entry in log] == ["preprocess", "dkdv", "dq"]


@pytest.mark.parametrize("causal", [False, True])
def test_backward_heavy_first_switch_reaches_both_kernels(recorded_launches, monkeypatch, causal):
    AGB, log = recorded_launches
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_HEAVY_FIRST_ENV, "1")
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_OVERLAP_ENV, "0")
    _launch_backward(AGB, causal)
    (_, dkdv_grid, dkdv_kw), (_, dq_grid, dq_kw) = log[1:]
    assert dkdv_kw["HEAVY_FIRST"] is dq_kw["HEAVY_FIRST"] is causal
    assert (dkdv_grid, dq_grid) == (((4, 4), (16, 3)) if causal else ((4, 4), (3, 16)))


def test_self_delta_switch_is_off_by_default_and_read_per_call(monkeypatch):
    AGB = _agb()
    var = AGB.ATTN_GLUON_BWD_SELF_DELTA_ENV
    monkeypatch.delenv(var, raising=False)
    assert AGB.self_delta_setting() is False
    for value, want in (("1", True), ("on", True), ("0", False), ("no", False)):
        monkeypatch.setenv(var, value)
        assert AGB.self_delta_setting() is want
    monkeypatch.setenv(var, "maybe")
    with pytest.raises(ConfigError, match=var):
        AGB.self_delta_setting()


def test_self_delta_moves_the_preprocess_onto_the_side_stream(recorded_launches, monkeypatch):
    """With the switch on and the overlap running: the preprocess and the dK/dV kernel on the side
    stream, the dQ kernel (its ``SELF_DELTA`` variant) on the current one; without the overlap the
    switch changes nothing."""
    AGB, log = recorded_launches
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_SELF_DELTA_ENV, "1")
    _launch_backward(AGB)
    assert [entry[0] for entry in log] == ["fork", "preprocess", "dkdv", "dq", "join"]
    assert log[3][2]["SELF_DELTA"] is True
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_OVERLAP_ENV, "0")
    log.clear()
    _launch_backward(AGB)
    assert [entry[0] for entry in log] == ["preprocess", "dkdv", "dq"]
    assert log[2][2]["SELF_DELTA"] is False


def test_self_delta_launch_reads_the_forwards_out_and_lse():
    """The SELF_DELTA launch passes the natural-log lse where the default passes lse2, and a
    descriptor over out where the default's stands in with dout's."""
    AGB = _agb()
    if AGB.gluon is None:
        pytest.skip("triton.experimental.gluon is missing")
    q, k, v, dout, *_ = _launch_tensors()
    dq = torch.empty_like(q)
    lse2, delta, lse = (torch.empty(2, 8, 300) for _ in range(3))
    out = torch.empty_like(q)
    _, plain, plain_kw = AGB.dq_launch_args(q, k, v, dout, dq, lse2, delta, 0.1, True)
    _, own, own_kw = AGB.dq_launch_args(q, k, v, dout, dq, lse2, delta, 0.1, True, self_delta=(out, lse))
    assert plain_kw["SELF_DELTA"] is False and own_kw["SELF_DELTA"] is True
    assert plain[5].base is dout and own[5].base is out
    assert plain[6] is lse2 and own[6] is lse and plain[7] is own[7] is delta


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

    def gluon(p, q, k, v, out, lse, dout, cu_q=None, cu_k=None):
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


def _reference(q, k, v, dout, causal, scale, window=(-1, -1)):
    """float32 (out, lse, [dq, dk, dv]) on the CPU."""
    from test_attention import ref_attention

    leaves = [x.detach().cpu().float().requires_grad_() for x in (q, k, v)]
    out, lse = ref_attention(*leaves, scale=scale, causal=causal, window=window)
    out.backward(dout.detach().cpu().float())
    return out.detach(), lse.detach(), [x.grad for x in leaves]


def _check_case(AGB, q, k, v, dout, causal, scale=None, variants=None, monkeypatch=None, window=(-1, -1)):
    """Runs the Gluon backward twice from the reference's out and lse; checks SNR and determinism.
    With ``variants`` (name -> switch settings, set through ``monkeypatch``), the same for each
    setting, whose gradients must also equal the first setting's bit for bit. Returns ``(p,
    the first setting's gradients)``."""
    from turbo_dispatch.ops.attention import attention_problem

    p = attention_problem(q, k, v, causal=causal, softmax_scale=scale, window_size=window, return_lse=True)
    ref_out, ref_lse, ref = _reference(q, k, v, dout, causal, p.softmax_scale, window)
    out, lse = ref_out.to(q.dtype).cuda(), ref_lse.float().cuda()
    assert AGB.gluon_backward_refusal(p, q, k, v, out, dout) is None
    baseline = None
    for variant, settings in (variants or {"as set": {}}).items():
        for var, value in settings.items():
            monkeypatch.setenv(var, value)
        first = AGB.attend_backward(p, q, k, v, out, lse, dout)
        second = AGB.attend_backward(p, q, k, v, out, lse, dout)
        torch.cuda.synchronize()
        for name, got, again, want, like in zip(("dq", "dk", "dv"), first, second, ref, (q, k, v)):
            assert got.shape == like.shape and got.dtype == like.dtype, (variant, name)
            assert torch.isfinite(got).all(), (variant, name)
            assert torch.equal(got, again), f"{variant}: {name} differs between two runs"
            assert_close(f"{variant}: {name}", got.float(), want, like.dtype)
            if baseline is not None:
                assert torch.equal(got, baseline[name]), f"{variant}: {name} differs from the default's"
        if baseline is None:
            baseline = dict(zip(("dq", "dk", "dv"), first))
    return p, tuple(baseline.values())


#: Every setting of the backward variants' switches, the default first.
VARIANTS = {
    "default": {"PRIMUS_TURBO_ATTN_GLUON_BWD_HEAVY_FIRST": "0", "PRIMUS_TURBO_ATTN_GLUON_BWD_OVERLAP": "0"},
    "heavy-first": {"PRIMUS_TURBO_ATTN_GLUON_BWD_HEAVY_FIRST": "1", "PRIMUS_TURBO_ATTN_GLUON_BWD_OVERLAP": "0"},
    "overlap": {"PRIMUS_TURBO_ATTN_GLUON_BWD_HEAVY_FIRST": "0", "PRIMUS_TURBO_ATTN_GLUON_BWD_OVERLAP": "1"},
    "heavy-first+overlap": {"PRIMUS_TURBO_ATTN_GLUON_BWD_HEAVY_FIRST": "1",
                            "PRIMUS_TURBO_ATTN_GLUON_BWD_OVERLAP": "1"},
}


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
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_variants_match_reference_and_default(case, gpu, monkeypatch):
    """Every variant (heavy-first order, side-stream overlap, both) against the float32
    reference, deterministic, and bit-identical to the default: they change when and where
    programs run, never what a program sums or in which order. The overlap settings go through
    ``side_by_side`` (eager CUDA tensors)."""
    from test_attention import randn

    b, sq, sk, hq, hk, d, dtype, causal = case
    q, k, v = (randn(s, dtype).cuda() for s in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)))
    dout = randn((b, sq, hq, d), dtype).cuda()
    forks = count_calls(monkeypatch, gpu, "side_by_side")
    _, (dq, _, _) = _check_case(gpu, q, k, v, dout, causal, variants=VARIANTS, monkeypatch=monkeypatch)
    assert len(forks) == 2 * 2  # two settings with the overlap on, two runs each
    if causal and sq > sk:
        assert (dq[:, :sq - sk] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_self_delta_matches_reference_and_keeps_dk_dv(case, gpu, monkeypatch):
    """The dQ kernel's own delta (with the overlap): every gradient against the float32
    reference, deterministic; dk and dv bit-identical to the default's (the preprocess still
    feeds the dK/dV kernel), dq within rounding of the default's (delta summed in another order)."""
    from test_attention import randn

    b, sq, sk, hq, hk, d, dtype, causal = case
    q, k, v = (randn(s, dtype).cuda() for s in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)))
    dout = randn((b, sq, hq, d), dtype).cuda()
    monkeypatch.setenv(gpu.ATTN_GLUON_BWD_OVERLAP_ENV, "1")
    monkeypatch.setenv(gpu.ATTN_GLUON_BWD_SELF_DELTA_ENV, "0")
    p, default = _check_case(gpu, q, k, v, dout, causal)
    launches, dq_launch_args = [], gpu.dq_launch_args

    def recorded(*args, **kwargs):
        launches.append(kwargs.get("self_delta"))
        return dq_launch_args(*args, **kwargs)

    monkeypatch.setattr(gpu, "dq_launch_args", recorded)
    monkeypatch.setenv(gpu.ATTN_GLUON_BWD_SELF_DELTA_ENV, "1")
    _, own = _check_case(gpu, q, k, v, dout, causal)
    assert launches and all(own_args is not None for own_args in launches)
    assert torch.equal(own[1], default[1]) and torch.equal(own[2], default[2])
    scale = float(default[0].float().abs().max()) or 1.0
    assert float((own[0].float() - default[0].float()).abs().max()) <= 2 * torch.finfo(dtype).eps * scale


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_backward_captures_in_a_cuda_graph(gpu, monkeypatch, variant):
    """The backward (with the overlap: its fork and join) captured in a CUDA graph and replayed
    gives the eager gradients, bit for bit."""
    from test_attention import randn

    from turbo_dispatch.ops.attention import attention_problem

    for var, value in VARIANTS[variant].items():
        monkeypatch.setenv(var, value)
    q, k, v = (randn(s, BF16).cuda() for s in ((2, 1000, 8, 128), (2, 1000, 2, 128), (2, 1000, 2, 128)))
    dout = randn((2, 1000, 8, 128), BF16).cuda()
    p = attention_problem(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse, _ = _reference(q, k, v, dout, True, p.softmax_scale)
    out, lse = ref_out.to(BF16).cuda(), ref_lse.float().cuda()
    eager = gpu.attend_backward(p, q, k, v, out, lse, dout)
    warm = torch.cuda.Stream()  # the capture's own warm-up, on a side stream as PyTorch advises
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        gpu.attend_backward(p, q, k, v, out, lse, dout)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gpu.attend_backward(p, q, k, v, out, lse, dout)
    for g in captured:
        g.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, captured))


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
@pytest.mark.parametrize("variant", ["default", "heavy-first+overlap"])
def test_gpu_op_runs_its_backward_on_gluon(gpu, monkeypatch, fresh_dynamo, variant):
    """ops.flash_attn_func pinned to TRITON runs its backward on the Gluon kernels, eager and under
    torch.compile, in the default and in the variants; without the switch the same call runs the
    plain-Triton backward, with the same gradients to within rounding."""
    from test_attention import randn
    from test_triton_attention import _snr

    import turbo_dispatch as turbo

    for var, value in VARIANTS[variant].items():
        monkeypatch.setenv(var, value)
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
    """Timings taken with the pipelined forward forced on or off, the Gluon backward switched
    off, or a backward variant switched off, are stored under another identity than the defaults'
    (a tuning DB never mixes them); a variant switched on explicitly is the default."""
    from turbo_dispatch.backends.triton import attention_gluon as AG
    from turbo_dispatch.backends.triton import attention_gluon_bwd as AGB
    from turbo_dispatch.backends.triton.attention import TritonAttention

    variants = (AGB.ATTN_GLUON_BWD_HEAVY_FIRST_ENV, AGB.ATTN_GLUON_BWD_OVERLAP_ENV)
    for var in (AG.ATTN_GLUON_PIPELINE_ENV, AGB.ATTN_GLUON_BWD_ENV, *variants):
        monkeypatch.delenv(var, raising=False)
    default = TritonAttention().identity()
    assert AGB.KERNEL_REVISION in default and AG.KERNEL_REVISION in default
    seen = {default}
    for pipeline in ("1", "0"):
        monkeypatch.setenv(AG.ATTN_GLUON_PIPELINE_ENV, pipeline)
        seen.add(TritonAttention().identity())
    monkeypatch.delenv(AG.ATTN_GLUON_PIPELINE_ENV)
    for heavy_first, overlap in ((1, 0), (0, 1), (0, 0)):
        monkeypatch.setenv(variants[0], str(heavy_first))
        monkeypatch.setenv(variants[1], str(overlap))
        seen.add(TritonAttention().identity())
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_ENV, "0")
    plain_backward = TritonAttention().identity()
    assert len(seen | {plain_backward}) == 7 and AGB.KERNEL_REVISION not in plain_backward
    monkeypatch.delenv(AGB.ATTN_GLUON_BWD_ENV)
    for var in variants:
        monkeypatch.setenv(var, "1")
    assert TritonAttention().identity() == default
    for var in variants:
        monkeypatch.delenv(var)
    assert TritonAttention().identity() == default
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_SELF_DELTA_ENV, "1")
    assert TritonAttention().identity() not in seen | {plain_backward}
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_SELF_DELTA_ENV, "0")
    assert TritonAttention().identity() == default


# -- sliding windows --------------------------------------------------------------------------------------
def test_window_switch_gates_the_backward(switched_on, monkeypatch):
    """Windowed calls follow the forward's window switch: served while it is unset or on, refused
    naming it when off."""
    from turbo_dispatch.backends.triton.attention_gluon import ATTN_GLUON_WINDOW_ENV as env

    AGB = switched_on
    for p in windowed_problems() + served_problems():
        assert AGB.gluon_backward_refusal(p) is None, p
    monkeypatch.setenv(env, "0")
    for p in windowed_problems():
        assert env in (AGB.gluon_backward_refusal(p) or ""), p


@pytest.mark.parametrize("causal, window", [(True, (100, 0)), (False, (-1, 16)), (False, (33, 7))])
def test_window_reaches_both_kernels(recorded_launches, monkeypatch, causal, window):
    """A windowed call launches both kernels with WINDOW and its bounds (-1 as UNBOUNDED); the
    heavy-first order still follows ``causal``."""
    from turbo_dispatch.ops.attention import attention_problem

    AGB, log = recorded_launches
    monkeypatch.setenv("PRIMUS_TURBO_ATTN_GLUON_WINDOW", "1")
    q, k, v, dout, *_ = _launch_tensors()
    p = attention_problem(q, k, v, causal=causal, window_size=window, return_lse=True)
    AGB.attend_backward(p, q, k, v, torch.zeros_like(q), torch.zeros(2, 8, 300), dout)
    launches = [entry for entry in log if entry[0] in ("dkdv", "dq")]
    assert len(launches) == 2 and all(kw["WINDOW"] is True and kw["HEAVY_FIRST"] is causal for *_, kw in launches)
    monkeypatch.setattr(AGB, "descriptor", lambda x, rows: rows)
    lse2 = delta = torch.zeros(2, 8, 300)
    bounds = AGB.window_bounds(p.window_left, p.window_right)
    _, args, kwargs = AGB.dkdv_launch_args(q, k, v, dout, k, v, lse2, delta, 0.1, causal, True, window)
    assert args[-2:] == bounds and kwargs["WINDOW"] is True
    _, args, kwargs = AGB.dq_launch_args(q, k, v, dout, q, lse2, delta, 0.1, causal, True, window)
    assert args[-2:] == bounds and kwargs["WINDOW"] is True
    log.clear()
    _launch_backward(AGB, causal)
    assert all(entry[2]["WINDOW"] is False for entry in log if entry[0] in ("dkdv", "dq"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", WINDOW_CASES, ids=_window_id)
def test_gpu_window_backward_matches_reference(case, gpu, monkeypatch):
    """dq, dk, dv of the WINDOW kernels from the reference's out and lse, against the float32
    windowed reference, deterministic, in every variant (bit-identical to the default)."""
    from test_attention import randn

    monkeypatch.setenv("PRIMUS_TURBO_ATTN_GLUON_WINDOW", "1")
    b, sq, sk, hq, hk, d, dtype, window, causal = case
    q, k, v = (randn(s, dtype).cuda() for s in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)))
    dout = randn((b, sq, hq, d), dtype).cuda()
    _check_case(gpu, q, k, v, dout, causal, variants=VARIANTS, monkeypatch=monkeypatch, window=window)


def test_window_mask_of_the_dkdv_kernel_is_one_unsigned_compare():
    """The dK/dV kernel masks a window with ``uint32(i - (r - right)) <= uint32(left) +
    uint32(right)`` (r: the key's diagonal row): the same as ``r - right <= i <= r + left`` for
    every bound ``window_bounds`` gives, unbounded sides included."""
    import numpy as np

    from turbo_dispatch.backends.triton.attention_gluon import window_bounds

    rng = np.random.default_rng(0)
    i = rng.integers(0, 1 << 20, 4000).astype(np.int32)
    r = (i.astype(np.int64) + rng.integers(-3000, 3000, 4000)).astype(np.int32)
    for left, right in ((-1, -1), (-1, 0), (0, -1), (0, 0), (5, 7), (2000, -1), (-1, 2000), (1 << 20, 3)):
        lo, hi = window_bounds(left, right)
        want = (i.astype(np.int64) >= r.astype(np.int64) - hi) & (i.astype(np.int64) <= r.astype(np.int64) + lo)
        off = (i - (r - np.int32(hi))).view(np.uint32)
        width = np.uint32(lo) + np.uint32(hi)
        assert np.array_equal(off <= width, want), (left, right)


# -- varlen -----------------------------------------------------------------------------------------------
def test_varlen_problems_are_served(switched_on):
    from test_attention_gluon import varlen_problems

    for p in varlen_problems():
        assert switched_on.gluon_backward_refusal(p) is None, p


class _ArgsRecorder:
    """``_Recorder`` that also keeps the positional arguments: ``(name, grid, args, kwargs)``."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.name, grid, args, kwargs))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_backward_launches(switched_on, monkeypatch, causal, head_dim):
    """A varlen backward: the preprocess kernel on the packed layout, both Gluon kernels with
    ``VARLEN``, the packed tensors and both cu_seqlens (never read on the host), grids over the
    longest sequences, lse2/delta ``[Hq, Tq]`` (batch stride 0), the gradients' token strides for
    the masked tail stores, and each gradient's tokens past the last sequence handed to the tail
    fill with its own cu_seqlens."""
    from test_attention_gluon import _packed, _varlen_problem

    AGB = switched_on
    if AGB.gluon is None:
        pytest.skip("triton.experimental.gluon is missing")
    log, fills = [], []
    monkeypatch.setattr(AGB.AK, "attn_bwd_preprocess_kernel", _ArgsRecorder("preprocess", log))
    monkeypatch.setattr(AGB, "attn_bwd_dkdv_gluon_kernel", _ArgsRecorder("dkdv", log))
    monkeypatch.setattr(AGB, "attn_bwd_dq_gluon_kernel", _ArgsRecorder("dq", log))
    monkeypatch.setattr(AGB, "descriptor", lambda x, rows: (tuple(x.shape), rows))
    monkeypatch.setattr(AGB, "zero_tokens_past", lambda x, cu: fills.append((x, cu)))
    monkeypatch.setenv(AGB.ATTN_GLUON_BWD_OVERLAP_ENV, "0")
    lens_q, lens_k = [17, 0, 300, 1029, 64], [5, 40, 0, 1029, 700]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, d=head_dim)
    p = _varlen_problem(q, k, v, cu_q, cu_k, lens_q, lens_k, causal=causal)
    out, lse, dout = torch.zeros_like(q), torch.zeros(8, q.shape[0]), torch.zeros_like(q)
    dq, dk, dv = AGB.attend_backward(p, q, k, v, out, lse, dout, cu_q, cu_k)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    (_, pre_grid, pre_args, pre_kw), (_, kv_grid, kv_args, kv_kw), (_, q_grid, q_args, q_kw) = log
    assert pre_kw["VARLEN"] is True and pre_args[5] is cu_q and pre_grid == (5 * 8, -(-1029 // AGB.PRE_BLOCK_M))
    assert kv_kw["VARLEN"] is True and q_kw["VARLEN"] is True
    assert kv_args[8] is cu_q and kv_args[9] is cu_k and kv_args[10] is dk and kv_args[11] is dv
    assert kv_args[12] == 2 * head_dim and kv_args[13:17] == (1029, 1029, 2, 4) and kv_args[17:19] == (0, 1410)
    assert q_args[8] is cu_q and q_args[9] is cu_k and q_args[10] is dq  # [5] is the (unread) out descriptor
    assert q_args[11] == 8 * head_dim and q_args[12:16] == (1029, 1029, 8, 4) and q_args[16:18] == (0, 1410)
    blocks = -(-1029 // AGB.BLOCK)
    assert kv_grid == ((5 * 2, blocks) if causal else (blocks, 5 * 2))
    assert q_grid == ((5 * 8, blocks) if causal else (blocks, 5 * 8))
    assert [(x is g, c is want) for (x, c), g, want in zip(fills, (dq, dk, dv), (cu_q, cu_k, cu_k))] == [(True,) * 2] * 3


#: The forward's varlen cases (test_attention_gluon.VARLEN_CASES).
from test_attention_gluon import VARLEN_CASES, _varlen_id  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("case", VARLEN_CASES, ids=_varlen_id)
def test_gpu_varlen_backward_matches_reference(case, gpu, monkeypatch):
    """dq, dk, dv of the ``VARLEN`` kernels from the reference's out and lse, against a float32
    reference per sequence: SNR >= 40 dB, zero where a sequence has no queries or no keys and on
    the tokens past the last sequence, bit-identical over two runs and across the variants."""
    from test_attention_gluon import _packed, _varlen_problem, varlen_reference32
    from test_triton_attention import _snr

    lens_q, lens_k, hq, hk, d, dtype, causal, tail = case
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, hq, hk, d, dtype, tail, "cuda")
    dout = torch.randn(q.shape, device="cuda").to(dtype)
    p = _varlen_problem(q, k, v, cu_q, cu_k, lens_q, lens_k, causal=causal)
    ref_out, ref_lse, ref = varlen_reference32(q, k, v, cu_q, cu_k, causal, p.softmax_scale, dout=dout)
    out, lse = ref_out.to(dtype).cuda(), ref_lse.cuda()
    assert gpu.gluon_backward_refusal(p, q, k, v, out, dout) is None
    baseline = None
    for variant, settings in VARIANTS.items():
        for var, value in settings.items():
            monkeypatch.setenv(var, value)
        first = gpu.attend_backward(p, q, k, v, out, lse, dout, cu_q, cu_k)
        second = gpu.attend_backward(p, q, k, v, out, lse, dout, cu_q, cu_k)
        torch.cuda.synchronize()
        for name, got, again, want, like in zip(("dq", "dk", "dv"), first, second, ref, (q, k, v)):
            assert got.shape == like.shape and got.dtype == like.dtype, (variant, name)
            assert torch.isfinite(got).all(), (variant, name)
            assert torch.equal(got, again), f"{variant}: {name} differs between two runs"
            assert _snr(got.float(), want) >= 40.0, (variant, name, _snr(got.float(), want))
            # Rows whose reference is all zero (tokens of no sequence, sequences without keys or
            # queries, and a causal row's first key alone, where the softmax gradient vanishes):
            # nothing beyond rounding.
            zero_rows = got[(want == 0).all(-1).all(-1).cuda()]
            assert zero_rows.numel() == 0 or float(zero_rows.abs().max()) <= ZERO_GRAD_TOL, (variant, name)
            if baseline is not None:
                assert torch.equal(got, baseline[name]), f"{variant}: {name} differs from the default's"
        if baseline is None:
            baseline = dict(zip(("dq", "dk", "dv"), first))


@pytest.mark.gpu
def test_gpu_varlen_window_backward_matches_reference(gpu, monkeypatch):
    """A sliding window on packed sequences, forward and backward on the Gluon kernels."""
    from test_attention_gluon import VARLEN_WINDOW_CASES, _packed, _varlen_problem, varlen_reference32
    from test_triton_attention import _snr

    monkeypatch.setenv("PRIMUS_TURBO_ATTN_GLUON_WINDOW", "1")
    for lens_q, lens_k, d, causal, window in VARLEN_WINDOW_CASES:
        q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 8, 2, d, BF16, 0, "cuda")
        dout = torch.randn(q.shape, device="cuda").to(BF16)
        p = _varlen_problem(q, k, v, cu_q, cu_k, lens_q, lens_k, causal=causal, window_size=window)
        ref_out, ref_lse, ref = varlen_reference32(q, k, v, cu_q, cu_k, causal, p.softmax_scale, window, dout)
        assert gpu.gluon_backward_refusal(p, q, k, v) is None
        grads = gpu.attend_backward(p, q, k, v, ref_out.to(BF16).cuda(), ref_lse.cuda(), dout, cu_q, cu_k)
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
            assert _snr(got.float(), want) >= 40.0, (window, name, _snr(got.float(), want))


@pytest.mark.gpu
def test_gpu_varlen_backward_captures_in_a_cuda_graph(gpu, monkeypatch):
    """The varlen backward (overlap on: its fork and join) captured in a CUDA graph and replayed on
    new lengths (same token counts) equals the eager backward on those lengths."""
    from test_attention import cu
    from test_attention_gluon import _packed, _varlen_problem

    monkeypatch.setenv(gpu.ATTN_GLUON_BWD_OVERLAP_ENV, "1")
    lens_a, lens_b = [300, 0, 1029, 17], [1029, 17, 300, 0]
    q, k, v, cu_q, cu_k = _packed(lens_a, lens_a, 8, 2, 128, BF16, 0, "cuda")
    dout = torch.randn(q.shape, device="cuda").to(BF16)
    p = _varlen_problem(q, k, v, cu_q, cu_k, lens_a, lens_a, causal=True)
    out, lse = torch.randn_like(q), torch.randn(8, q.shape[0], device="cuda")
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        gpu.attend_backward(p, q, k, v, out, lse, dout, cu_q, cu_k)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gpu.attend_backward(p, q, k, v, out, lse, dout, cu_q, cu_k)
    cu_q.copy_(cu(lens_b).cuda())
    cu_k.copy_(cu(lens_b).cuda())
    graph.replay()
    torch.cuda.synchronize()
    eager = gpu.attend_backward(p, q, k, v, out, lse, dout, cu_q, cu_k)
    assert all(torch.equal(a, b) for a, b in zip(eager, captured))
