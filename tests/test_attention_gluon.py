"""The Gluon Hopper attention forward (backends/triton/attention_gluon.py) and its use by TRITON.

CPU (no marker): the gate's reasons, each condition forced with monkeypatch (no GPU needed): the
env switch, Gluon missing, an unchecked Triton release, the interpreter, no GPU, not sm_90, every
problem and tensor layout it leaves to the plain-Triton kernel; the pipelined variant's switch
(``PRIMUS_TURBO_ATTN_GLUON_PIPELINE``: the launch's ``PIPELINE`` constexpr and ring, unset the
default variant's) and the off-by-default variant switches (``VARIANT_SWITCHES``: three math
warpgroups, the folded scale, the emulated exponentials; each reaches the launch and the adapter's
identity); the sliding-window switch (``PRIMUS_TURBO_ATTN_GLUON_WINDOW``: on by default, windowed
calls refused naming it when off, ``-window`` in the identity then, the ``WINDOW`` launch on two
math warpgroups) and the window's block arithmetic (the kernels' span helpers, whose host mirrors
are held equal to them expression for expression, against a brute-force mask on random cases);
and the adapter's wiring: the eager and the compiled forward take the Gluon
launcher exactly when the gate says None, else the plain-Triton one. The kernel's sm_90 compile
(registers, spills, shared memory) is checked by tests/test_compile_sm90.py through
tools/compile_sm90.py (families ``attention_gluon_fwd``, ``attention_gluon_fwd_pipelined`` and
``attention_gluon_fwd_variants``).

GPU (``@pytest.mark.gpu``, sm_90 only): out and lse of the kernel itself, each variant (default,
pipelined, three warpgroups, and the softmax options on each), against a float32 reference
(materialised softmax) on random non-zero inputs, SNR >= 40 dB, over head dims 64/128, full and
causal masks, MHA/GQA/MQA, Sq == Sk and Sq != Sk (rows that attend nothing included), odd lengths,
bf16 and fp16; gradients through ``ops.flash_attn_func`` pinned to TRITON (the backward starts from
this kernel's out and lse) against the float64 reference; and that the call
went through the Gluon kernel, or not with ``PRIMUS_TURBO_ATTN_GLUON=0``; sliding windows (left
only, right only, both, with causal, Sq != Sk, odd lengths, windows narrower than a block and
wider than the sequence, rows that attend nothing) on every variant a windowed call can run, and
their gradients through the op.
"""
from __future__ import annotations

import pytest
import torch

from turbo_dispatch.errors import ConfigError

BF16, FP16 = torch.bfloat16, torch.float16


def _ag():
    from turbo_dispatch.backends.triton import attention_gluon as AG

    return AG


def _problem(**changes):
    from turbo_dispatch.ops.attention import AttentionProblem

    base = AttentionProblem(2, 1000, 1000, 2000, 2000, 8, 2, 128, 128, BF16, True, -1, 0, 0.0, 128 ** -0.5, False,
                            True, False, "cuda")
    return base._replace(**changes)


@pytest.fixture
def sm90(monkeypatch):
    """The machine made to look like an sm_90 host with a checked Triton release, so the problem
    and tensor reasons can be asked on the CPU."""
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon as GB

    AG = _ag()
    if AG.gluon is None:
        pytest.skip("triton.experimental.gluon is missing")
    for var in (AG.ATTN_GLUON_ENV, GB.GLUON_ENV, "TRITON_INTERPRET", AG.ATTN_GLUON_PIPELINE_ENV,
                AG.ATTN_GLUON_WINDOW_ENV, *(env for env, _, _ in AG.VARIANT_SWITCHES.values())):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(GB, "_triton_release", lambda: GB.GLUON_TRITON_RELEASES[0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    _clear_device_caches(GB)
    yield AG
    _clear_device_caches(GB)


def _clear_device_caches(GB) -> None:
    """The Gluon gate keeps its device answers per process; cleared around a forced machine."""
    for name in ("_device_refusal", "_machine_refusal"):
        cached = getattr(GB, name, None)
        if cached is not None:
            cached.cache_clear()


# -- the gate --------------------------------------------------------------------------------------------
def test_machine_reasons(sm90, monkeypatch):
    """Each machine condition that refuses names itself, the package-wide Gluon switch included;
    an sm_90 host with a checked release serves."""
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon as GB

    AG = sm90
    assert AG.machine_refusal() is None
    monkeypatch.setenv(GB.GLUON_ENV, "0")
    assert GB.GLUON_ENV in AG.machine_refusal()
    monkeypatch.delenv(GB.GLUON_ENV)
    for cc in ((8, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, cc=cc: cc)
        _clear_device_caches(GB)
        assert f"sm_{cc[0]}{cc[1]}" in AG.machine_refusal()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _clear_device_caches(GB)
    assert "NVIDIA GPU" in AG.machine_refusal()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in AG.machine_refusal()
    monkeypatch.setattr(GB, "_triton_release", lambda: "3.7")
    why = AG.machine_refusal()
    assert "checked on triton 3.6" in why and "this is triton 3.7" in why
    monkeypatch.setattr(GB, "gluon", None)
    assert "gluon is missing" in AG.machine_refusal()


@pytest.mark.parametrize("value", ["0", "false", "off", "no"])
def test_env_switch_turns_it_off(sm90, monkeypatch, value):
    monkeypatch.setenv(sm90.ATTN_GLUON_ENV, value)
    assert f"switched off ({sm90.ATTN_GLUON_ENV}={value})" in sm90.gluon_forward_refusal(_problem())


@pytest.mark.parametrize("value", ["1", "on", "true"])
def test_env_switch_on_is_the_default(sm90, monkeypatch, value):
    assert sm90.gluon_forward_refusal(_problem()) is None
    monkeypatch.setenv(sm90.ATTN_GLUON_ENV, value)
    assert sm90.gluon_forward_refusal(_problem()) is None


def test_env_switch_bad_value_names_the_variable(sm90, monkeypatch):
    monkeypatch.setenv(sm90.ATTN_GLUON_ENV, "maybe")
    with pytest.raises(ConfigError, match=sm90.ATTN_GLUON_ENV):
        sm90.gluon_forward_refusal(_problem())


def served_problems() -> list:
    """Problems the Gluon kernels serve (forward and backward alike)."""
    return [_problem(), _problem(causal=False, window_right=-1), _problem(head_dim_qk=64, head_dim_v=64),
            _problem(dtype=FP16), _problem(seqlen_q=77, seqlen_k=1000), _problem(seqlen_q=1000, seqlen_k=257),
            _problem(heads_kv=1), _problem(heads_kv=8), _problem(softmax_scale=0.05), _problem(deterministic=True),
            _problem(return_lse=False), _problem(batch=1, seqlen_q=1, seqlen_k=1), *varlen_problems()]


def varlen_problems() -> list:
    """Varlen problems (``seqlen_*`` the max_seqlen values, ``total_*`` the token counts) the
    Gluon kernels serve: causal and full, GQA, d64, fp16, Sq != Sk."""
    v = dict(varlen=True, batch=5, seqlen_q=1029, seqlen_k=1029, total_q=1410, total_k=1410)
    return [_problem(**v), _problem(**v, causal=False, window_right=-1), _problem(**v, heads_kv=1),
            _problem(**v, head_dim_qk=64, head_dim_v=64, dtype=FP16),
            _problem(**dict(v, seqlen_k=77, total_k=300))]


def refused_problems() -> dict:
    """Problems the Gluon kernels refuse, keyed by a phrase of the reason they give."""
    return {
        "empty": _problem(varlen=True, total_q=0),
        "empty batch": _problem(varlen=True, total_k=0),
        "fp8": _problem(fp8=True, fp8_block=128),
        "sinks": _problem(sink=True),
        "dropout": _problem(dropout_p=0.1),
        "bf16/fp16": _problem(dtype=torch.float32),
        "q/k 96": _problem(head_dim_qk=96, head_dim_v=96),
        "q/k 192, v 128": _problem(head_dim_qk=192, head_dim_v=128),
        "q/k 128, v 64": _problem(head_dim_v=64),
        "q/k 256": _problem(head_dim_qk=256, head_dim_v=256),
        "empty batch or sequence": _problem(seqlen_k=0),
        "65535": _problem(batch=1024, heads_q=128, heads_kv=128),
    }


def test_problem_reasons(sm90):
    """What the kernel serves is accepted; everything else is refused with its reason."""
    for p in served_problems():
        assert sm90.gluon_forward_refusal(p) is None, p
    for reason, p in refused_problems().items():
        assert reason in (sm90.gluon_forward_refusal(p) or ""), (reason, sm90.gluon_forward_refusal(p))


@pytest.mark.parametrize("value, head_dim, pipelined", [
    (None, 64, False), (None, 128, True), ("0", 64, False), ("0", 128, False), ("off", 128, False),
    ("1", 64, True), ("on", 128, True)])
def test_pipeline_switch_selects_the_variant(sm90, monkeypatch, value, head_dim, pipelined):
    """PRIMUS_TURBO_ATTN_GLUON_PIPELINE, read per call, hands the launch the PIPELINE constexpr and
    that variant's ring: on or off for every head dim where set, unset the pipelined variant at
    d128 only (PIPELINED_HEAD_DIMS); the unpipelined variant's tiles are unchanged. (Three
    warpgroups, which never pipeline, are switched off here.)"""
    AG = sm90
    monkeypatch.setenv(AG.ATTN_GLUON_WG3_ENV, "0")
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs))

    monkeypatch.setattr(AG, "attn_fwd_gluon_kernel", Recorder())
    monkeypatch.setattr(AG, "descriptor", lambda x, rows: rows)
    if value is None:
        monkeypatch.delenv(AG.ATTN_GLUON_PIPELINE_ENV, raising=False)
    else:
        monkeypatch.setenv(AG.ATTN_GLUON_PIPELINE_ENV, value)
    p = _problem(head_dim_qk=head_dim, head_dim_v=head_dim, seqlen_q=300, seqlen_k=300, batch=1)
    q = torch.randn(1, 300, 8, head_dim, dtype=BF16)
    kv = torch.randn(1, 300, 2, head_dim, dtype=BF16)
    AG.attend(p, q, kv, kv)
    (grid, kwargs), = launches
    block_n, stages = (AG.PIPELINED_TILES if pipelined else AG.TILES)[head_dim]
    assert kwargs["PIPELINE"] is pipelined and (kwargs["BLOCK_N"], kwargs["STAGES"]) == (block_n, stages)
    assert grid == (3, 8) and kwargs["num_warps"] == 4 and kwargs["maxnreg"] == AG.MAXNREG
    if not pipelined:
        assert AG.TILES == {64: (128, 3), 128: (128, 2)}  # the GPU-verified default variant's tiles


def test_pipeline_switch_bad_value_names_the_variable(sm90, monkeypatch):
    monkeypatch.setenv(sm90.ATTN_GLUON_PIPELINE_ENV, "maybe")
    with pytest.raises(ConfigError, match=sm90.ATTN_GLUON_PIPELINE_ENV):
        sm90.pipelined(128)


def _recorded_launch(AG, monkeypatch, head_dim: int, causal: bool = True, scale: float = 0.125,
                     seqlen: int = 300) -> tuple:
    """``(grid, kwargs, descriptor rows)`` of the one launch ``AG.attend`` makes for a call of head
    dim ``head_dim`` (kernel and descriptors replaced by recorders, so it runs on the CPU)."""
    launches, rows = [], []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs))

    monkeypatch.setattr(AG, "attn_fwd_gluon_kernel", Recorder())
    monkeypatch.setattr(AG, "descriptor", lambda x, r: rows.append(r) or r)
    p = _problem(head_dim_qk=head_dim, head_dim_v=head_dim, seqlen_q=seqlen, seqlen_k=seqlen, batch=1,
                 causal=causal, softmax_scale=scale)
    q = torch.randn(1, seqlen, 8, head_dim, dtype=BF16)
    kv = torch.randn(1, seqlen, 2, head_dim, dtype=BF16)
    AG.attend(p, q, kv, kv)
    (grid, kwargs), = launches
    return grid, kwargs, rows


def _set_switches(AG, monkeypatch, **on):
    """Sets each named variant switch (``VARIANT_SWITCHES`` keys, plus ``pipeline``) to its value."""
    envs = {key: env for key, (env, _, _) in AG.VARIANT_SWITCHES.items()} | {"pipeline": AG.ATTN_GLUON_PIPELINE_ENV}
    for key, value in on.items():
        monkeypatch.setenv(envs[key], value)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_variant_switches_off_give_the_two_warpgroup_launch(sm90, monkeypatch, head_dim):
    """Set to 0 the variant switches give the plain two-warpgroup launch: no folded scale, no
    emulated exponentials; unset, the defaults (VARIANT_SWITCHES): the folded scale everywhere and
    three warpgroups at d64."""
    AG = sm90
    _set_switches(AG, monkeypatch, wg3="0", fold_scale="off", exp2_emu="false")
    grid, kwargs, rows = _recorded_launch(AG, monkeypatch, head_dim)
    assert (kwargs["MATH_WGS"], kwargs["FOLD"], kwargs["EMU"], kwargs["BLOCK_M"]) == (2, False, False, 128)
    assert (kwargs["MATH_REGS"], kwargs["LOAD_REGS"], kwargs["maxnreg"]) == (AG.MATH_REGS, AG.LOAD_REGS, AG.MAXNREG)
    assert grid == (3, 8) and rows == [64, 128, 128, 64]
    assert AG.variant_tag() == "+no-wg3+no-fold"
    for env, _, _ in AG.VARIANT_SWITCHES.values():
        monkeypatch.delenv(env)
    kwargs = _recorded_launch(AG, monkeypatch, head_dim)[1]
    assert (kwargs["MATH_WGS"], kwargs["FOLD"], kwargs["EMU"]) == (3 if head_dim == 64 else 2, True, False)
    assert AG.variant_tag() == ""


def test_wg3_switch_runs_three_warpgroups_at_d64(sm90, monkeypatch):
    """PRIMUS_TURBO_ATTN_GLUON_WG3=1: d64 calls launch 192-row programs of three unpipelined math
    warpgroups (64-row q/out blocks, four ring slots, the four-warpgroup register split), whatever
    the pipeline switch says; d128 calls keep their variant."""
    AG = sm90
    _set_switches(AG, monkeypatch, wg3="1", pipeline="1")
    grid, kwargs, rows = _recorded_launch(AG, monkeypatch, 64)
    assert grid == (2, 8) and rows == [64, 128, 128, 64]
    assert (kwargs["MATH_WGS"], kwargs["BLOCK_M"], kwargs["PIPELINE"]) == (3, 192, False)
    assert (kwargs["BLOCK_N"], kwargs["STAGES"]) == AG.WG3_TILES[64]
    assert (kwargs["MATH_REGS"], kwargs["LOAD_REGS"], kwargs["maxnreg"]) == AG.WG3_REGS
    assert not AG.pipelined(64) and AG.pipelined(128)
    grid, kwargs, _ = _recorded_launch(AG, monkeypatch, 128)
    assert (kwargs["MATH_WGS"], kwargs["BLOCK_M"], kwargs["PIPELINE"], grid) == (2, 128, True, (3, 8))


def test_wg3_register_split_fills_four_warpgroups(sm90):
    """Three math warpgroups and the loader's (a warpgroup of registers) share the 64K registers of
    the cap: what the default partition is left equals the workers' share."""
    AG = sm90
    math, load, cap = AG.WG3_REGS
    assert cap * 4 * 128 <= 65536 and 4 * cap - 2 * math - load == math and math % 8 == 0 and load >= 24
    assert AG.config_for(64, True, wg3=True).warps == 13 and AG.config_for(128, True, wg3=True).math_wgs == 2


@pytest.mark.parametrize("scale, folded", [(0.125, True), (1e-6, True), (-0.125, False), (0.0, False)])
def test_fold_scale_switch_needs_a_positive_scale(sm90, monkeypatch, scale, folded):
    """PRIMUS_TURBO_ATTN_GLUON_FOLD_SCALE=1 folds the scale only where it is positive (the row
    maximum of the raw scores is the scaled one's only then); other scales run unfolded."""
    AG = sm90
    _set_switches(AG, monkeypatch, fold_scale="1", wg3="0")
    for head_dim in (64, 128):
        kwargs = _recorded_launch(AG, monkeypatch, head_dim, scale=scale)[1]
        assert kwargs["FOLD"] is folded and kwargs["EMU"] is False and kwargs["MATH_WGS"] == 2


def test_exp2_emu_switch_reaches_every_variant(sm90, monkeypatch):
    """PRIMUS_TURBO_ATTN_GLUON_EXP2_EMU=1 sets EMU on the pipelined, unpipelined and
    three-warpgroup launches alike."""
    AG = sm90
    _set_switches(AG, monkeypatch, exp2_emu="yes")
    assert _recorded_launch(AG, monkeypatch, 128)[1]["EMU"] is True
    assert _recorded_launch(AG, monkeypatch, 64)[1]["EMU"] is True
    _set_switches(AG, monkeypatch, wg3="1")
    kwargs = _recorded_launch(AG, monkeypatch, 64, causal=False)[1]
    assert kwargs["EMU"] is True and kwargs["MATH_WGS"] == 3 and kwargs["CAUSAL"] is False


@pytest.mark.parametrize("key", ["wg3", "fold_scale", "exp2_emu"])
def test_variant_switch_bad_value_names_the_variable(sm90, monkeypatch, key):
    env = sm90.VARIANT_SWITCHES[key][0]
    monkeypatch.setenv(env, "maybe")
    with pytest.raises(ConfigError, match=env):
        sm90.call_config(64, True)


def test_each_variant_setting_has_its_own_identity(sm90, monkeypatch):
    """The adapter's identity names every variant switch set away from its default (timings under
    one never stand for another's in a tuning DB); set to its default it is the unset identity,
    since the kernel is the same."""
    from turbo_dispatch.backends.triton.attention import TritonAttention

    AG = sm90
    seen = {TritonAttention().identity()}
    for key, (env, tag, default) in AG.VARIANT_SWITCHES.items():
        before = TritonAttention().identity()
        monkeypatch.setenv(env, "1" if default else "0")
        assert TritonAttention().identity() == before
        monkeypatch.setenv(env, "0" if default else "1")
        ident = TritonAttention().identity()
        assert f"+{'' if not default else 'no-'}{tag}" in ident and ident not in seen
        seen.add(ident)
    assert AG.variant_tag() == "+no-wg3+no-fold+emu"


def test_tensor_reasons(sm90):
    """The TMA reads need each token's heads packed, 16-byte aligned bases and batch/token
    strides, and CUDA tensors (the layout is judged first, so these run on the CPU)."""
    AG = sm90
    q = torch.randn(2, 33, 8, 64, dtype=BF16)
    kv = torch.randn(2, 33, 2, 64, dtype=BF16)
    assert "q is on cpu" in AG.tensor_refusal(q=q, k=kv, v=kv)
    heads_major = torch.randn(2, 8, 33, 64, dtype=BF16).transpose(1, 2)
    assert "heads must be packed" in AG.tensor_refusal(q=heads_major)
    padded = torch.randn(2, 33, 8, 72, dtype=BF16)[..., :64]
    assert "heads must be packed" in AG.tensor_refusal(q=padded)
    odd_tokens = torch.randn(2, 33 * 8 * 64 + 8, dtype=BF16)[:, 4:4 + 33 * 8 * 64].view(2, 33, 8, 64)
    assert "16-byte aligned" in AG.tensor_refusal(q=odd_tokens)
    qkv = torch.randn(2, 33, 3, 8, 64, dtype=BF16)  # packed qkv: strided tokens, heads still packed
    assert "is on cpu" in AG.tensor_refusal(q=qkv[:, :, 0])


def test_the_real_gate_refuses_on_this_cpu_machine():
    """Without an sm_90 GPU (or under the interpreter) the gate always has a reason."""
    AG = _ag()
    if torch.cuda.is_available() and AG.machine_refusal() is None:
        pytest.skip("this host runs the kernel")
    assert AG.gluon_forward_refusal(_problem()) is not None


# -- the adapter's wiring -----------------------------------------------------------------------------------
@pytest.fixture
def launchers(monkeypatch):
    """The adapter with both forward launchers replaced by recorders returning tagged results,
    and the gate's answer settable: ``(adapter, calls, set_refusal)``."""
    from turbo_dispatch.backends.triton import attention as TA

    AG = _ag()
    calls = []

    def plain(p, q, k, v, cu_q, cu_k, tile, sink=None, scales=None):
        calls.append("plain")
        return q.new_full(q.shape, 1.0), torch.full((p.batch, p.heads_q, p.seqlen_q), 1.0)

    def gluon(p, q, k, v, cu_q=None, cu_k=None):
        calls.append("gluon")
        return q.new_full(q.shape, 2.0), torch.full((p.batch, p.heads_q, p.seqlen_q), 2.0)

    answer = {"why": None}
    monkeypatch.setattr(TA, "attend", plain)
    monkeypatch.setattr(AG, "attend", gluon)
    monkeypatch.setattr(AG, "gluon_forward_refusal", lambda p, q=None, k=None, v=None: answer["why"])
    return TA.TritonAttention(), calls, lambda why: answer.update(why=why)


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_adapter_takes_gluon_when_the_gate_allows(launchers, path):
    from turbo_dispatch.ops.attention import attention_problem

    ad, calls, set_refusal = launchers
    q, k, v = torch.randn(1, 9, 4, 64, dtype=BF16), torch.randn(1, 9, 2, 64, dtype=BF16), torch.randn(
        1, 9, 2, 64, dtype=BF16)
    p = attention_problem(q, k, v, causal=True, return_lse=True)

    def forward():
        if path == "eager":
            out, lse, saved = ad.forward(p, q, k, v)
            assert saved[5] is not out and torch.equal(saved[5], out) and torch.equal(saved[6], lse)
            return out, lse
        return ad.compiled_forward(p, q, k, v)

    out, lse = forward()
    assert calls == ["gluon"] and (out == 2).all() and (lse == 2).all()
    set_refusal("the Gluon attention forward is switched off")
    out, lse = forward()
    assert calls == ["gluon", "plain"] and (out == 1).all() and (lse == 1).all()


def test_adapter_keeps_fp8_and_bad_configs_on_the_plain_path(launchers):
    """fp8 calls never reach the Gluon launcher (they quantise first), and a malformed pinned
    config is still an error even where the Gluon kernel would serve."""
    from turbo_dispatch.ops.attention import attention_problem

    ad, calls, _ = launchers
    q = torch.randn(1, 9, 4, 64, dtype=BF16)
    p = attention_problem(q, q, q)
    with pytest.raises(ValueError, match="BLOCK_M, BLOCK_N"):
        ad.forward(p, q, q, q, config=(64, 64))
    assert calls == []


def test_describe_names_the_gluon_forward(sm90):
    from turbo_dispatch.backends.triton.attention import TritonAttention

    assert "Gluon" in TritonAttention().describe(_problem())
    assert "Gluon" in TritonAttention().describe(_problem(varlen=True))
    assert "Gluon" not in TritonAttention().describe(_problem(head_dim_qk=96, head_dim_v=96))


def test_configs_offer_one_tile_where_the_gluon_forward_serves(sm90, monkeypatch):
    """The Gluon forward ignores the tile, so the tuner gets one TRITON candidate there (dense and
    varlen); where the plain kernel runs (switched off, a head dim it leaves) every tile of the
    table is offered."""
    from turbo_dispatch.backends.triton.attention import TritonAttention

    ad = TritonAttention()
    assert len(ad.configs(_problem())) == 1
    assert len(ad.configs(_problem(varlen=True))) == 1
    assert len(ad.configs(_problem(head_dim_qk=96, head_dim_v=96))) > 1
    monkeypatch.setenv(sm90.ATTN_GLUON_ENV, "0")
    every = ad.configs(_problem())
    assert len(every) > 1 and every[0] == TritonAttention().configs(_problem(varlen=True))[0]


# -- GPU --------------------------------------------------------------------------------------------------
def _gpu_gate():
    AG = _ag()
    why = AG.machine_refusal()
    if why is not None:
        pytest.skip(f"the Gluon attention forward does not run here: {why}")
    return AG


def _inputs(b, sq, sk, hq, hk, d, dtype):
    from test_attention import randn

    return [randn(s, dtype).cuda() for s in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d))]


#: (B, Sq, Sk, Hq, Hkv, D, dtype, causal)
GPU_CASES = [
    (2, 1000, 1000, 8, 8, 128, BF16, False),
    (2, 1000, 1000, 8, 2, 128, BF16, True),
    (1, 257, 1000, 8, 2, 128, FP16, True),
    (1, 1000, 257, 8, 2, 128, BF16, True),  # rows 0..742 attend nothing
    (2, 77, 257, 8, 1, 128, FP16, False),
    (1, 1, 77, 4, 4, 128, BF16, True),
    (2, 1000, 1000, 8, 2, 64, BF16, False),
    (2, 1000, 1000, 8, 8, 64, FP16, True),
    (1, 257, 77, 8, 2, 64, BF16, False),
    (1, 77, 1000, 4, 1, 64, BF16, True),
    (2, 128, 128, 4, 4, 64, FP16, True),
    (1, 129, 255, 8, 2, 128, FP16, False),
    (1, 1000, 257, 8, 2, 64, FP16, True),  # rows 0..742 attend nothing; whole warpgroups skip every block
    (1, 700, 700, 4, 1, 64, BF16, True),  # three-warpgroup programs whose warpgroups' spans differ
]

#: Variant name -> the switches it sets (``PRIMUS_TURBO_ATTN_GLUON_PIPELINE`` and
#: ``VARIANT_SWITCHES`` by key); the softmax options run together on each ring shape.
VARIANTS = {
    "default": dict(pipeline="0", wg3="0"),
    "pipelined": dict(pipeline="1", wg3="0"),
    "wg3": dict(wg3="1"),
    "fold-emu": dict(pipeline="0", wg3="0", fold_scale="1", exp2_emu="1"),
    "pipelined-fold-emu": dict(pipeline="1", wg3="0", fold_scale="1", exp2_emu="1"),
    "wg3-fold-emu": dict(wg3="1", fold_scale="1", exp2_emu="1"),
}


def _variant_gate(monkeypatch, variant: str, head_dim: int):
    """The GPU gate, with ``variant``'s switches set; skips a three-warpgroup variant at a head dim
    it does not serve (the call would run another variant, tested under its own name)."""
    AG = _gpu_gate()
    wg3 = VARIANTS[variant].get("wg3") == "1"
    if wg3 and head_dim not in AG.WG3_TILES:
        pytest.skip(f"three math warpgroups serve head dims {sorted(AG.WG3_TILES)}")
    _set_switches(AG, monkeypatch, **VARIANTS[variant])
    cfg = AG.call_config(head_dim, True)
    assert cfg.pipeline is (VARIANTS[variant].get("pipeline") == "1") and cfg.math_wgs == (3 if wg3 else 2)
    return AG


def _case_id(c):
    b, sq, sk, hq, hk, d, dtype, causal = c
    return f"b{b}-{sq}x{sk}-h{hq}/{hk}-d{d}-{str(dtype)[6:]}-{'causal' if causal else 'full'}"


def _reference(q, k, v, causal, scale):
    from test_attention import ref_attention

    return ref_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), scale=scale, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_forward_matches_reference(case, variant, monkeypatch):
    """out and lse of the kernel (the variant set through its switches) against a float32
    materialised softmax: SNR >= 40 dB, and the rows that attend nothing exactly 0 / -inf."""
    from test_triton_attention import _snr

    from turbo_dispatch.ops.attention import attention_problem

    AG = _variant_gate(monkeypatch, variant, case[5])
    b, sq, sk, hq, hk, d, dtype, causal = case
    q, k, v = _inputs(b, sq, sk, hq, hk, d, dtype)
    p = attention_problem(q, k, v, causal=causal, return_lse=True)
    assert AG.gluon_forward_refusal(p, q, k, v) is None
    out, lse = AG.attend(p, q, k, v)
    torch.cuda.synchronize()
    ref_out, ref_lse = _reference(q, k, v, causal, p.softmax_scale)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert _snr(out.float(), ref_out) >= 40.0, _snr(out.float(), ref_out)
    assert _snr(lse, ref_lse) >= 40.0, _snr(lse, ref_lse)  # -inf rows must match exactly
    if causal and sq > sk:
        empty = sq - sk
        assert (out[:, :empty] == 0).all() and torch.isneginf(lse[:, :, :empty]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("scale", [0.37, 4.0, -0.37])
def test_gpu_forward_any_scale_and_strided_qkv(scale, head_dim, variant, monkeypatch):
    """Softmax scales other than 1/sqrt(d) (a large one, whose exponents fall far below -125, where
    the emulated exponential clamps; a negative one, which runs unfolded), and q, k, v sliced from
    one packed qkv tensor (token stride 3 * H * D): read in place through the descriptors."""
    from test_triton_attention import _snr

    from turbo_dispatch.ops.attention import attention_problem

    AG = _variant_gate(monkeypatch, variant, head_dim)
    qkv = torch.randn(2, 333, 3, 8, head_dim, device="cuda").to(BF16)
    q, k, v = qkv.unbind(2)
    for causal in (False, True):
        p = attention_problem(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
        assert AG.gluon_forward_refusal(p, q, k, v) is None
        out, lse = AG.attend(p, q, k, v)
        ref_out, ref_lse = _reference(q, k, v, causal, scale)
        assert _snr(out.float(), ref_out) >= 40.0 and _snr(lse, ref_lse) >= 40.0, (causal, _snr(out.float(), ref_out))


def count_calls(monkeypatch, module, name: str) -> list:
    """Wraps ``module.name`` so that each call appends to the returned list, then calls it."""
    calls = []
    launch = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.fixture
def counted(monkeypatch):
    """TRITON pinned, and the Gluon launcher wrapped to count its calls: ``(turbo, calls)``."""
    import turbo_dispatch as turbo

    calls = count_calls(monkeypatch, _gpu_gate(), "attend")
    turbo.GlobalBackendManager.set_attn_backend("TRITON")
    yield turbo, calls
    turbo.GlobalBackendManager.set_attn_backend(None)


#: (B, Sq, Sk, Hq, Hkv, D, dtype, causal) for the gradient checks (reference in float64 on the CPU)
GRAD_CASES = [
    (1, 1000, 1000, 8, 2, 128, BF16, True),
    (2, 257, 257, 8, 8, 128, FP16, False),
    (1, 77, 257, 8, 2, 64, BF16, True),
    (1, 257, 77, 4, 1, 64, FP16, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GRAD_CASES, ids=_case_id)
def test_gpu_gradients_from_the_gluon_forward(case, counted):
    """ops.flash_attn_func pinned to TRITON runs its forward on the Gluon kernel and its backward
    from that out and lse: out, lse, dq, dk, dv against the float64 reference."""
    from test_attention import assert_result, ref_grads, run_op

    turbo, calls = counted
    b, sq, sk, hq, hk, d, dtype, causal = case
    q, k, v = _inputs(b, sq, sk, hq, hk, d, dtype)
    grad = torch.randn(b, sq, hq, d, device="cuda").to(dtype)
    ref = ref_grads(q, k, v, grad, causal=causal)
    got = run_op(turbo.ops.flash_attn_func, q, k, v, grad, causal=causal, return_lse=True)
    assert calls, "the forward did not run on the Gluon kernel"
    assert_result(got, ref, dtype, True)


@pytest.mark.gpu
def test_gpu_gluon_path_taken_and_switch(counted, monkeypatch, fresh_dynamo):
    """A d128 call on sm_90 runs the Gluon forward, eager and under torch.compile (the custom op);
    PRIMUS_TURBO_ATTN_GLUON=0 sends the same call to the plain-Triton kernel, with the same result
    to within rounding."""
    from turbo_dispatch.ops._common import snr_db

    turbo, calls = counted
    q, k, v = _inputs(2, 512, 512, 16, 4, 128, BF16)

    def call(q, k, v):
        return turbo.ops.flash_attn_func(q, k, v, causal=True, return_lse=True)

    out, lse = call(q, k, v)
    assert len(calls) == 1
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    c_out, c_lse = compiled(q, k, v)
    assert len(calls) == 2 and torch.equal(c_out, out) and torch.equal(c_lse, lse)
    monkeypatch.setenv("PRIMUS_TURBO_ATTN_GLUON", "0")
    plain_out, plain_lse = call(q, k, v)
    assert len(calls) == 2
    assert snr_db(out.float().cpu(), plain_out.float().cpu()) > 40 and snr_db(lse.cpu(), plain_lse.cpu()) > 60


# -- sliding windows --------------------------------------------------------------------------------------
def windowed_problems() -> list:
    """Problems with a sliding window (normalised as ``attention_problem`` leaves them)."""
    return [_problem(window_left=128), _problem(causal=False, window_right=16),
            _problem(causal=False, window_left=64, window_right=64), _problem(causal=False, window_left=0),
            _problem(seqlen_q=77, seqlen_k=1000, window_left=5), _problem(head_dim_qk=64, head_dim_v=64,
                                                                          window_left=1024)]


def test_window_switch_gates_windowed_problems(sm90, monkeypatch):
    """Windowed calls are served while PRIMUS_TURBO_ATTN_GLUON_WINDOW is unset or true and refused
    with the switch's name when false, read per call; full and causal calls are served either
    way, and the other refusals stand."""
    AG = sm90
    for value in (None, "1", "on"):
        if value is not None:
            monkeypatch.setenv(AG.ATTN_GLUON_WINDOW_ENV, value)
        for p in windowed_problems() + served_problems():
            assert AG.gluon_forward_refusal(p) is None, (value, p)
        for reason, p in refused_problems().items():
            if not reason.startswith("window"):
                assert reason in (AG.gluon_forward_refusal(p) or ""), reason
    for value in ("0", "off"):
        monkeypatch.setenv(AG.ATTN_GLUON_WINDOW_ENV, value)
        for p in windowed_problems():
            assert AG.ATTN_GLUON_WINDOW_ENV in (AG.gluon_forward_refusal(p) or ""), (value, p)
        assert all(AG.gluon_forward_refusal(p) is None for p in served_problems())
    monkeypatch.setenv(AG.ATTN_GLUON_WINDOW_ENV, "maybe")
    with pytest.raises(ConfigError, match=AG.ATTN_GLUON_WINDOW_ENV):
        AG.gluon_forward_refusal(windowed_problems()[0])


def test_window_switch_enters_the_identity(sm90, monkeypatch):
    from turbo_dispatch.backends.triton.attention import TritonAttention

    AG = sm90
    on = TritonAttention().identity()
    assert "-window" not in on and AG.window_tag() == ""
    monkeypatch.setenv(AG.ATTN_GLUON_WINDOW_ENV, "0")
    off = TritonAttention().identity()
    assert on != off and off.replace("-window", "") == on


def _window_launch(AG, monkeypatch, p) -> tuple:
    """``(grid, args, kwargs)`` of the one launch ``AG.attend`` makes for problem ``p`` (kernel and
    descriptors replaced by recorders)."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(AG, "attn_fwd_gluon_kernel", Recorder())
    monkeypatch.setattr(AG, "descriptor", lambda x, rows: rows)
    q = torch.randn(p.batch, p.seqlen_q, p.heads_q, p.head_dim_qk, dtype=BF16)
    kv = torch.randn(p.batch, p.seqlen_k, p.heads_kv, p.head_dim_qk, dtype=BF16)
    AG.attend(p, q, kv, kv)
    launch, = launches
    return launch


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("pipeline", [None, "0", "1"])
def test_window_launch_runs_two_warpgroups_with_the_bounds(sm90, monkeypatch, head_dim, pipeline):
    """A windowed call launches the WINDOW kernel on two math warpgroups (three warpgroups, on by
    default at d64, do not take windows), pipelined as the pipeline switch or PIPELINED_HEAD_DIMS
    says, the folded scale as set, and the window's bounds as LEFT/RIGHT (-1 unbounded); a full or
    causal call with the switch on launches what it launched before."""
    AG = sm90
    monkeypatch.setenv(AG.ATTN_GLUON_WINDOW_ENV, "1")
    if pipeline is not None:
        monkeypatch.setenv(AG.ATTN_GLUON_PIPELINE_ENV, pipeline)
    want_pipe = head_dim in AG.PIPELINED_HEAD_DIMS if pipeline is None else pipeline == "1"
    for left, right, causal in ((100, 0, True), (-1, 16, False), (0, 300, False)):
        p = _problem(batch=1, seqlen_q=300, seqlen_k=500, head_dim_qk=head_dim, head_dim_v=head_dim, causal=causal,
                     window_left=left, window_right=right)
        grid, args, kwargs = _window_launch(AG, monkeypatch, p)
        assert kwargs["WINDOW"] is True and kwargs["MATH_WGS"] == 2 and kwargs["BLOCK_M"] == 128
        assert kwargs["PIPELINE"] is want_pipe and kwargs["CAUSAL"] is causal and kwargs["FOLD"] is True
        assert (kwargs["BLOCK_N"], kwargs["STAGES"]) == (AG.PIPELINED_TILES if want_pipe else AG.TILES)[head_dim]
        assert args[-2:] == (AG.UNBOUNDED if left < 0 else left, AG.UNBOUNDED if right < 0 else right)
        assert grid == (3, 8)
    _, args, kwargs = _window_launch(AG, monkeypatch, _problem(batch=1, seqlen_q=300, seqlen_k=300,
                                                                head_dim_qk=head_dim, head_dim_v=head_dim))
    assert kwargs["WINDOW"] is False and kwargs["MATH_WGS"] == (3 if head_dim == 64 and pipeline is None else
                                                                kwargs["MATH_WGS"])
    assert AG.config_for(64, True, wg3=True, window=True).math_wgs == 2


def test_window_bounds_map_unbounded_sides():
    AG = _ag()
    assert AG.window_bounds(-1, -1) == (AG.UNBOUNDED, AG.UNBOUNDED)
    assert AG.window_bounds(0, -1) == (0, AG.UNBOUNDED) and AG.window_bounds(7, 0) == (7, 0)
    assert AG.UNBOUNDED + (1 << 29) < 2 ** 31  # row + shift (below 2^29 in size) +- UNBOUNDED fits int32


def _body(fn, renames=()) -> list:
    """The statements of ``fn`` (a plain function or a jit function's ``.fn``) after its
    docstring, unparsed, with ``gl.maximum``/``gl.minimum`` read as ``max``/``min`` and each
    ``(old, new)`` of ``renames`` applied."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    text = [ast.unparse(stmt).replace("gl.maximum(", "max(").replace("gl.minimum(", "min(") for stmt in body]
    for old, new in renames:
        text = [t.replace(old, new) for t in text]
    return text


def test_span_host_mirrors_match_the_kernels_helpers():
    """The host mirrors the brute-force tests check are the kernels' span helpers, expression for
    expression."""
    AG = _ag()
    if AG.gluon is None:
        pytest.skip("triton.experimental.gluon is missing")
    from turbo_dispatch.backends.triton import attention_gluon_bwd as AGB

    assert _body(AG.block_span.fn) == _body(AG.block_span_host)
    assert _body(AG.window_key_span.fn) == _body(AG.window_key_span_host, [("block_span_host(", "block_span(")])
    assert _body(AGB._window_query_span.fn) == _body(AGB.window_query_span_host,
                                                      [("block_span_host(", "block_span(")])


def _allowed(sq: int, sk: int, left: int, right: int) -> torch.Tensor:
    """``[sq, sk]``: may query ``i`` attend key ``j`` (the op's bottom-right window, -1 unbounded)."""
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _walk(start, full_start, full_end, end, block: int, pipeline: bool) -> list:
    """``(block start, masked)`` in the order the forward / dQ kernels visit them under ``WINDOW``:
    the pipelined variant runs the first block masked, then its three loops from the second."""
    if pipeline:
        second = start + block
        runs = [(second, full_start, True), (max(full_start, second), full_end, False),
                (max(full_end, second), end, True)]
        return [(start, True)] + [(n, m) for lo, hi, m in runs for n in range(lo, hi, block)]
    runs = [(start, full_start, True), (full_start, full_end, False), (full_end, end, True)]
    return [(n, m) for lo, hi, m in runs for n in range(lo, hi, block)]


def _random_windows(seed: int, count: int):
    """``(sq, sk, left, right)``: odd and even lengths, Sq above and below Sk, windows of 0, narrower
    than a block, wider than the sequence, one side or both, causal (right 0)."""
    import random

    rng = random.Random(seed)
    for _ in range(count):
        sq, sk = rng.choice([1, 2, 63, 64, 65, 127, 128, 129, 200, 257, 300, 511]), rng.randint(1, 520)
        side = lambda: rng.choice([-1, 0, 1, 3, 17, 64, 100, 127, 128, 129, 300, 1000])  # noqa: E731
        left, right = side(), side()
        if left < 0 and right < 0:
            right = 0
        yield sq, sk, left, right


@pytest.mark.parametrize("seed", range(4))
def test_window_key_span_is_exact(seed):
    """For each query program: the key blocks the forward (and the dQ kernel) visit are exactly
    those holding a key some row of the program may attend (none loaded that no row needs), each
    once, in order; every unmasked one is attended whole by every real row; the pipelined variant
    visits one fully masked block where no row attends anything."""
    AG = _ag()
    for sq, sk, left, right in _random_windows(seed, 120):
        allowed = _allowed(sq, sk, left, right)
        L, R = AG.window_bounds(left, right)
        for block_m, block_n in ((128, 128), (128, 64), (64, 128)):
            for m0 in range(0, sq, block_m):
                rows = allowed[m0:m0 + block_m]
                needed = [n for n in range(0, sk, block_n) if rows[:, n:n + block_n].any()]
                for pipeline in (False, True):
                    span = AG.window_key_span_host(m0, sq, sk, L, R, block_m, block_n, pipeline)
                    visits = _walk(*span, block_n, pipeline)
                    starts = [n for n, _ in visits]
                    case = (sq, sk, left, right, block_m, block_n, m0, pipeline, span)
                    if pipeline and not needed:
                        assert len(starts) == 1 and 0 <= starts[0] < sk, case
                    else:
                        assert starts == needed, case
                    for n, masked in visits:
                        if not masked:
                            assert n + block_n <= sk and rows[:, n:n + block_n].all(), case


@pytest.mark.parametrize("seed", range(4))
def test_window_query_span_is_exact(seed):
    """For each dK/dV program: the query blocks it walks are exactly those holding a row that may
    attend one of its keys (an empty span where none does)."""
    AG = _ag()
    from turbo_dispatch.backends.triton import attention_gluon_bwd as AGB

    for sq, sk, left, right in _random_windows(100 + seed, 120):
        allowed = _allowed(sq, sk, left, right)
        L, R = AG.window_bounds(left, right)
        for block_m, block_n in ((64, 128), (128, 128)):
            for n0 in range(0, sk, block_n):
                cols = allowed[:, n0:n0 + block_n]
                needed = [m for m in range(0, sq, block_m) if cols[m:m + block_m].any()]
                start, end = AGB.window_query_span_host(n0, sq, sk, L, R, block_m, block_n)
                assert list(range(start, end, block_m)) == needed, (sq, sk, left, right, block_m, n0, start, end)


def test_window_rows_that_attend_nothing_need_the_right_bound():
    """Only a right bound leaves rows with no key (i + Sk - Sq + right < 0); a left window alone
    never does, so such rows only arise where the causal kernels already met them."""
    for sq, sk, left, right in _random_windows(7, 300):
        empty = ~_allowed(sq, sk, left, right).any(1)
        if right < 0:
            assert not empty.any()
        else:
            assert empty.sum().item() == max(0, min(sq, sq - sk - right))


# -- sliding windows on the GPU ---------------------------------------------------------------------------
#: (B, Sq, Sk, Hq, Hkv, D, dtype, (window_left, window_right), causal)
WINDOW_CASES = [
    (1, 1000, 1000, 8, 2, 128, BF16, (256, -1), True),  # left window with causal
    (1, 1000, 1000, 8, 8, 128, FP16, (100, -1), False),  # left only
    (1, 1000, 1000, 8, 2, 128, BF16, (-1, 200), False),  # right only
    (2, 777, 777, 8, 2, 128, BF16, (130, 70), False),  # both, odd length
    (1, 257, 1000, 8, 2, 128, FP16, (300, -1), True),  # Sq < Sk
    (1, 1000, 257, 8, 2, 128, BF16, (64, -1), True),  # Sq > Sk: rows 0..742 attend nothing
    (1, 1000, 257, 4, 1, 128, BF16, (40, 30), False),  # rows 0..712 attend nothing
    (1, 513, 513, 8, 2, 128, BF16, (5, 3), False),  # narrower than a block
    (1, 300, 300, 8, 2, 128, BF16, (0, 0), False),  # the diagonal alone
    (1, 700, 300, 8, 2, 128, BF16, (5000, -1), True),  # wider than the sequence (normalised away)
    (1, 1000, 1000, 8, 2, 64, BF16, (256, -1), True),
    (2, 777, 500, 8, 8, 64, FP16, (130, 70), False),
    (1, 1000, 257, 8, 2, 64, BF16, (33, 2), False),
    (1, 129, 1000, 4, 1, 64, BF16, (7, -1), True),
]

#: The variants a windowed call can run (two math warpgroups), by the switches they set.
WINDOW_VARIANTS = {
    "default": dict(pipeline="0"),
    "pipelined": dict(pipeline="1"),
    "fold-emu": dict(pipeline="0", fold_scale="1", exp2_emu="1"),
    "pipelined-fold-emu": dict(pipeline="1", fold_scale="1", exp2_emu="1"),
    "no-fold": dict(fold_scale="0"),
}


def _window_id(c):
    b, sq, sk, hq, hk, d, dtype, (left, right), causal = c
    return f"b{b}-{sq}x{sk}-h{hq}/{hk}-d{d}-{str(dtype)[6:]}-w{left},{right}{'-causal' if causal else ''}"


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(WINDOW_VARIANTS))
@pytest.mark.parametrize("case", WINDOW_CASES, ids=_window_id)
def test_gpu_window_forward_matches_reference(case, variant, monkeypatch):
    """out and lse of the WINDOW kernel against the float32 windowed reference: SNR >= 40 dB, rows
    that attend nothing exactly 0 / -inf."""
    from test_attention import ref_attention
    from test_triton_attention import _snr

    from turbo_dispatch.ops.attention import attention_problem

    AG = _gpu_gate()
    monkeypatch.setenv(AG.ATTN_GLUON_WINDOW_ENV, "1")
    _set_switches(AG, monkeypatch, **WINDOW_VARIANTS[variant])
    b, sq, sk, hq, hk, d, dtype, window, causal = case
    q, k, v = _inputs(b, sq, sk, hq, hk, d, dtype)
    p = attention_problem(q, k, v, causal=causal, window_size=window, return_lse=True)
    assert AG.gluon_forward_refusal(p, q, k, v) is None
    out, lse = AG.attend(p, q, k, v)
    torch.cuda.synchronize()
    ref_out, ref_lse = ref_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), scale=p.softmax_scale,
                                     causal=causal, window=window)
    assert torch.isfinite(out).all()
    assert _snr(out.float(), ref_out) >= 40.0, _snr(out.float(), ref_out)
    assert _snr(lse, ref_lse) >= 40.0, _snr(lse, ref_lse)
    empty = ~_allowed(sq, sk, p.window_left, p.window_right).any(1)
    assert (out[:, empty.cuda()] == 0).all() and torch.isneginf(lse[:, :, empty.cuda()]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("case", WINDOW_CASES[::2], ids=_window_id)
def test_gpu_window_gradients_through_the_op(case, counted, monkeypatch):
    """ops.flash_attn_func pinned to TRITON with the window switch on runs a windowed call's
    forward on the Gluon kernel (and its backward on the Gluon backward): out, lse, dq, dk, dv
    against the float64 reference."""
    from test_attention import assert_result, ref_grads, run_op

    turbo, calls = counted
    monkeypatch.setenv(_ag().ATTN_GLUON_WINDOW_ENV, "1")
    b, sq, sk, hq, hk, d, dtype, window, causal = case
    q, k, v = _inputs(b, sq, sk, hq, hk, d, dtype)
    grad = torch.randn(b, sq, hq, d, device="cuda").to(dtype)
    ref = ref_grads(q, k, v, grad, causal=causal, window=window)
    got = run_op(turbo.ops.flash_attn_func, q, k, v, grad, causal=causal, window_size=window, return_lse=True)
    assert calls, "the forward did not run on the Gluon kernel"
    assert_result(got, ref, dtype, True)


# -- varlen -----------------------------------------------------------------------------------------------
def _packed(lens_q, lens_k, hq=8, hk=2, d=128, dtype=BF16, tail=0, device="cpu"):
    """Packed q ``[Tq, Hq, D]``, k, v ``[Tk, Hkv, D]`` (random, non-zero) with ``tail`` tokens past
    the last sequence of each, and int32 cu_seqlens on ``device``."""
    from test_attention import cu, randn

    tq, tk = sum(lens_q) + tail, sum(lens_k) + tail
    q, k, v = (randn(s, dtype).to(device) for s in ((tq, hq, d), (tk, hk, d), (tk, hk, d)))
    return q, k, v, cu(lens_q).to(device), cu(lens_k).to(device)


def _varlen_problem(q, k, v, cu_q, cu_k, lens_q, lens_k, **kw):
    from turbo_dispatch.ops.attention import attention_varlen_problem

    return attention_varlen_problem(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True,
                                    **kw)._replace(platform="cuda")


def test_varlen_problems_are_served_with_the_dense_rules(sm90, monkeypatch):
    """Varlen calls take the Gluon forward where a dense call of the same dtype, head dims and mask
    would; a batch without query or key tokens is refused; windows follow their switch."""
    for p in varlen_problems():
        assert sm90.gluon_forward_refusal(p) is None, p
    v = dict(varlen=True, batch=3, total_q=10, total_k=10, seqlen_q=7, seqlen_k=7)
    assert "empty batch or sequence" in sm90.gluon_forward_refusal(_problem(**dict(v, total_q=0)))
    assert "empty batch or sequence" in sm90.gluon_forward_refusal(_problem(**dict(v, seqlen_k=0)))
    assert "q/k 96" in sm90.gluon_forward_refusal(_problem(**v, head_dim_qk=96, head_dim_v=96))
    assert sm90.gluon_forward_refusal(_problem(**v, window_left=16)) is None
    monkeypatch.setenv(sm90.ATTN_GLUON_WINDOW_ENV, "0")
    assert sm90.ATTN_GLUON_WINDOW_ENV in sm90.gluon_forward_refusal(_problem(**v, window_left=16))


def test_varlen_tensor_reasons_read_packed_tensors_as_one_batch(sm90):
    """Packed ``[T, H, D]`` tensors pass the layout rules as the one batch the descriptors read."""
    q = torch.randn(33, 8, 64, dtype=BF16)
    assert sm90.as_batch(q).shape == (1, 33, 8, 64) and sm90.as_batch(q[None]).shape == (1, 33, 8, 64)
    assert "q is on cpu" in sm90.tensor_refusal(q=q, k=q, v=q)
    assert "heads must be packed" in sm90.tensor_refusal(q=torch.randn(8, 33, 64, dtype=BF16).transpose(0, 1))


def _recorded_varlen_launch(AG, monkeypatch, p, q, k, v, cu_q, cu_k):
    """``(grid, args, kwargs, fills, out, lse)`` of ``AG.attend``'s varlen call with the kernel,
    the descriptors and the tail fill replaced by recorders (runs on the CPU)."""
    launches, fills = [], []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(AG, "attn_fwd_gluon_kernel", Recorder())
    monkeypatch.setattr(AG, "descriptor", lambda x, rows: (tuple(x.shape), rows))
    monkeypatch.setattr(AG, "zero_tokens_past", lambda x, cu: fills.append((x, cu)))
    out, lse = AG.attend(p, q, k, v, cu_q, cu_k)
    (grid, args, kwargs), = launches
    return grid, args, kwargs, fills, out, lse


@pytest.mark.parametrize("variant", ["default", "pipelined", "wg3"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_launch(sm90, monkeypatch, variant, head_dim):
    """One ``VARLEN`` launch over the longest query sequence's blocks for every (batch, head), the
    packed tensors and both cu_seqlens passed through (never read on the host), out's token stride
    for the masked tail stores, the lse ``[Hq, Tq]`` (batch stride 0) filled with -inf first, and
    out's tokens past the last sequence handed to the tail fill."""
    AG = sm90
    _set_switches(AG, monkeypatch, **VARIANTS[variant])
    lens_q, lens_k = [17, 0, 300, 1029, 64], [5, 40, 0, 1029, 700]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, d=head_dim, tail=3)
    p = _varlen_problem(q, k, v, cu_q, cu_k, lens_q, lens_k, causal=True)
    grid, args, kwargs, fills, out, lse = _recorded_varlen_launch(AG, monkeypatch, p, q, k, v, cu_q, cu_k)
    cfg = AG.call_config(head_dim, True, varlen=True)
    assert cfg.varlen and kwargs["VARLEN"] is True and kwargs["BLOCK_M"] == cfg.block_m
    assert grid == (-(-1029 // cfg.block_m), 5 * 8)
    rows = cfg.block_m // cfg.math_wgs
    assert args[0] == ((1413, 8, head_dim), rows) and args[1] == ((1777, 2, head_dim), cfg.block_n)
    assert args[4] is lse and args[5] is cu_q and args[6] is cu_k and args[7] is out and args[8] == 8 * head_dim
    assert args[9:13] == (1029, 1029, 8, 4) and args[13:15] == (0, 1413)
    assert lse.shape == (8, 1413) and torch.isneginf(lse).all() and out.shape == q.shape
    assert len(fills) == 1 and fills[0][0] is out and fills[0][1] is cu_q


def test_varlen_launch_args_check_the_config(sm90):
    """A varlen config launched without cu_seqlens (or the other way round) is an error naming both."""
    AG = sm90
    q = torch.randn(2, 64, 8, 128, dtype=BF16)
    lse = torch.empty(2, 8, 64)
    with pytest.raises(ValueError, match="cfg.varlen=True but cu_seqlens not given"):
        AG.launch_args(q, q, q, q, lse, 0.1, AG.config_for(128, True, varlen=True))
    cu = torch.tensor([0, 64, 128], dtype=torch.int32)
    with pytest.raises(ValueError, match="cfg.varlen=False but cu_seqlens given"):
        AG.launch_args(q[0], q[0], q[0], q[0], lse[0], 0.1, AG.config_for(128, True), cu_seqlens=(cu, cu),
                       max_seqlens=(64, 64))


def test_adapter_passes_cu_seqlens_to_the_gluon_forward(sm90, monkeypatch):
    """A varlen call the gate accepts runs the Gluon forward with the call's own cu_seqlens, eager
    and compiled."""
    from turbo_dispatch.backends.triton import attention as TA

    seen = []

    def gluon(p, q, k, v, cu_q=None, cu_k=None):
        seen.append((cu_q, cu_k))
        return torch.zeros_like(q), torch.zeros(p.heads_q, p.total_q)

    monkeypatch.setattr(sm90, "attend", gluon)
    monkeypatch.setattr(TA, "attend", lambda *a, **kw: pytest.fail("the plain forward ran"))
    monkeypatch.setattr(sm90, "tensor_refusal", lambda **t: None)
    lens = [5, 0, 7]
    q, k, v, cu_q, cu_k = _packed(lens, lens, hq=4, hk=2, d=64)
    p = _varlen_problem(q, k, v, cu_q, cu_k, lens, lens, causal=True)
    ad = TA.TritonAttention()
    ad.forward(p, q, k, v, cu_q, cu_k)
    ad.compiled_forward(p, q, k, v, cu_q, cu_k)
    assert len(seen) == 2 and all(a is cu_q and b is cu_k for a, b in seen)


_ZERO_TAIL_SCRIPT = """
import torch
from turbo_dispatch.backends.triton.attention_gluon import zero_tokens_past

torch.manual_seed(0)
for tokens, ends, row in ((40, [0, 17, 17, 33], (3, 8)), (16, [0, 16], (2, 4)), (700, [0, 5, 600], (1, 520)),
                          (9, [0, 0], (4,))):
    x = torch.randn(tokens, *row)
    before = x.clone()
    cu = torch.tensor(ends, dtype=torch.int32)
    assert zero_tokens_past(x, cu) is x
    end = ends[-1]
    assert torch.equal(x[:end], before[:end]), (tokens, ends)
    assert (x[end:] == 0).all(), (tokens, ends)
print("ok")
"""


def test_zero_tokens_past_writes_only_the_tokens_past_the_last_sequence(interpreter_refusal):
    """``attention_gluon.zero_tokens_past`` under the Triton interpreter: the tokens past
    ``cu_seqlens[-1]`` become zeros, every other token keeps its own (across program and column
    blocks, and with no sequence tokens at all)."""
    import os
    import subprocess
    import sys

    if interpreter_refusal:
        pytest.skip(interpreter_refusal)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", _ZERO_TAIL_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


#: (lens_q, lens_k, Hq, Hkv, D, dtype, causal, tail): packed sequences with odd and empty lengths,
#: Sq != Sk per sequence (a query sequence without keys among them), and ``tail`` tokens past the
#: last sequence.
VARLEN_CASES = [
    ([17, 0, 300, 1029, 64], [17, 0, 300, 1029, 64], 8, 2, 128, BF16, True, 0),
    ([17, 0, 300, 1029, 64], [17, 0, 300, 1029, 64], 8, 8, 64, FP16, False, 5),
    ([17, 0, 300, 1029, 64], [40, 5, 0, 1029, 700], 8, 2, 128, BF16, True, 3),
    ([128, 256, 1, 129], [1, 300, 128, 64], 4, 1, 64, FP16, True, 0),
    ([1000, 77, 0], [77, 1000, 9], 8, 4, 64, BF16, False, 0),
    ([1024] * 4, [1024] * 4, 8, 2, 128, FP16, False, 0),
]


def _varlen_id(c):
    lens_q, lens_k, hq, hk, d, dtype, causal, tail = c
    return (f"q{'-'.join(map(str, lens_q))}_k{'-'.join(map(str, lens_k))}-h{hq}/{hk}-d{d}-{str(dtype)[6:]}-"
            f"{'causal' if causal else 'full'}{f'-tail{tail}' if tail else ''}")


def varlen_reference32(q, k, v, cu_q, cu_k, causal, scale, window=(-1, -1), dout=None):
    """float32 (out ``[Tq, Hq, D]``, lse ``[Hq, Tq]``[, (dq, dk, dv)]) of packed sequences, each
    attended on its own (materialised softmax on the CPU); tokens outside every sequence and rows
    that attend no key: out 0, lse -inf, zero gradients. ``dout``: also the gradients."""
    from test_attention import ref_attention

    q32, k32, v32 = (x.detach().cpu().float().requires_grad_(dout is not None) for x in (q, k, v))
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    grads = [torch.zeros(x.shape) for x in (q, k, v)]
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cu_q) - 1):
        sq_, sk_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] == cu_q[b] or cu_k[b + 1] == cu_k[b]:
            continue
        leaves = [x[sq_ if i == 0 else sk_].detach().clone().requires_grad_(dout is not None)
                  for i, x in enumerate((q32, k32, v32))]
        o, l_ = ref_attention(*(x[None] for x in leaves), scale=scale, causal=causal, window=window)
        out[sq_], lse[:, sq_] = o[0].detach(), l_[0]
        if dout is not None:
            o.backward(dout[sq_].cpu().float()[None])
            grads[0][sq_] = leaves[0].grad
            grads[1][sk_] += leaves[1].grad
            grads[2][sk_] += leaves[2].grad
    return (out, lse) if dout is None else (out, lse, grads)


def _check_varlen_forward(AG, case, window=(-1, -1)):
    from test_triton_attention import _snr

    lens_q, lens_k, hq, hk, d, dtype, causal, tail = case
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, hq, hk, d, dtype, tail, "cuda")
    p = _varlen_problem(q, k, v, cu_q, cu_k, lens_q, lens_k, causal=causal, window_size=window)
    assert AG.gluon_forward_refusal(p, q, k, v) is None
    out, lse = AG.attend(p, q, k, v, cu_q, cu_k)
    torch.cuda.synchronize()
    ref_out, ref_lse = varlen_reference32(q, k, v, cu_q, cu_k, causal, p.softmax_scale, window)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (hq, q.shape[0])
    assert torch.isfinite(out).all()
    assert _snr(out.float(), ref_out) >= 40.0, _snr(out.float(), ref_out)
    assert _snr(lse, ref_lse) >= 40.0, _snr(lse, ref_lse)  # -inf rows (no keys, the tail) must match exactly
    empty = torch.isneginf(ref_lse).all(0)
    assert (out[empty.cuda()] == 0).all()
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["default", "pipelined", "wg3", "pipelined-fold-emu"])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=_varlen_id)
def test_gpu_varlen_forward_matches_reference(case, variant, monkeypatch):
    """out and lse of the ``VARLEN`` kernel (each variant) against a float32 reference per
    sequence: SNR >= 40 dB, rows of query sequences without keys and tokens past the last sequence
    exactly 0 / -inf, nothing written into another sequence's rows."""
    AG = _variant_gate(monkeypatch, variant, case[4])
    _check_varlen_forward(AG, case)


#: (lens_q, lens_k, D, causal, (window_left, window_right))
VARLEN_WINDOW_CASES = [
    ([17, 0, 300, 1029, 64], [17, 0, 300, 1029, 64], 128, True, (100, 0)),
    ([300, 1029, 5], [200, 1029, 77], 64, False, (33, 7)),
    ([300, 1029, 5], [200, 1029, 77], 128, False, (-1, 16)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["0", "1"])
@pytest.mark.parametrize("case", VARLEN_WINDOW_CASES, ids=str)
def test_gpu_varlen_window_forward_matches_reference(case, pipeline, monkeypatch):
    """Sliding windows on packed sequences (served unless ``PRIMUS_TURBO_ATTN_GLUON_WINDOW=0``)."""
    AG = _gpu_gate()
    monkeypatch.setenv(AG.ATTN_GLUON_WINDOW_ENV, "1")
    monkeypatch.setenv(AG.ATTN_GLUON_PIPELINE_ENV, pipeline)
    lens_q, lens_k, d, causal, window = case
    _check_varlen_forward(AG, (lens_q, lens_k, 8, 2, d, BF16, causal, 2), window)


@pytest.mark.gpu
def test_gpu_varlen_forward_captures_in_a_cuda_graph():
    """The varlen forward reads cu_seqlens on the device only: captured in a CUDA graph and replayed
    on new lengths (same token counts), it matches the eager call on those lengths."""
    from test_attention import cu

    AG = _gpu_gate()
    lens_a, lens_b = [300, 0, 1029, 17], [1029, 17, 300, 0]
    q, k, v, cu_q, cu_k = _packed(lens_a, lens_a, 8, 2, 128, BF16, 0, "cuda")
    p = _varlen_problem(q, k, v, cu_q, cu_k, lens_a, lens_a, causal=True)
    AG.attend(p, q, k, v, cu_q, cu_k)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = AG.attend(p, q, k, v, cu_q, cu_k)
    cu_q.copy_(cu(lens_b).cuda())
    cu_k.copy_(cu(lens_b).cuda())
    graph.replay()
    torch.cuda.synchronize()
    eager_out, eager_lse = AG.attend(p, q, k, v, cu_q, cu_k)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(*VARLEN_CASES[i][:7], 0) for i in (0, 2, 3, 4)], ids=_varlen_id)
def test_gpu_varlen_gradients_through_the_op(case, monkeypatch):
    """ops.flash_attn_varlen_func pinned to TRITON runs both directions on the Gluon kernels: out,
    lse, dq, dk, dv against the float64 reference per sequence."""
    import turbo_dispatch as turbo
    from test_attention import assert_result, run_op, varlen_reference

    from turbo_dispatch.backends.triton import attention_gluon_bwd as AGB

    AG = _gpu_gate()
    if AGB.machine_refusal():
        pytest.skip(AGB.machine_refusal())
    fwd_calls = count_calls(monkeypatch, AG, "attend")
    bwd_calls = count_calls(monkeypatch, AGB, "attend_backward")
    lens_q, lens_k, hq, hk, d, dtype, causal, tail = case
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, hq, hk, d, dtype, tail, "cuda")
    grad = torch.randn(q.shape[0], hq, d, device="cuda").to(dtype)
    turbo.GlobalBackendManager.set_attn_backend("TRITON")
    try:
        got = run_op(turbo.ops.flash_attn_varlen_func, q, k, v, grad, cu_q, cu_k, max(lens_q), max(lens_k),
                     causal=causal, return_lse=True)
    finally:
        turbo.GlobalBackendManager.set_attn_backend(None)
    assert fwd_calls and bwd_calls, "the call did not run on the Gluon kernels"
    ref = varlen_reference(q, k, v, grad, cu_q.cpu(), cu_k.cpu(), dict(causal=causal))
    assert_result(got, ref, dtype, True)
