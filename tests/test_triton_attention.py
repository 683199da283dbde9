"""TRITON attention: our flash attention kernels (backends/triton/attention_kernels.py) and adapter.

Reference: test_attention's float64 softmax(q k^T * scale + mask) v on the CPU (bottom-right
masks, FlashAttention semantics) with autograd gradients, computed from the same (rounded) inputs
the kernels see. Gate: SNR >= 40 dB on out, lse (finite rows; -inf rows must match), dq, dk, dv.

CPU (no marker):

* the kernels under the Triton interpreter (``TRITON_INTERPRET=1``, which must be set before
  triton is imported): one subprocess (``_interpreter_results``) runs ``_interpreter_checks()``
  and prints one JSON line per check, each parametrized test asserts its line. Tiny shapes with
  16 x 16 tiles, so every sequence spans several blocks and each kind of block run (masked edges,
  whole blocks, empty spans) is taken: MHA/GQA/MQA, causal with Sq > Sk (rows that attend
  nothing), windows (left, right, both), Dqk != Dv, non-power-of-two and 256 head dims, varlen
  with empty sequences, strided inputs, a bitwise-repeatable backward, and the op's eager
  (autograd) and compiled (custom ops) paths through a plugin registry entry that serves the
  adapter on the CPU. The interpreter's bf16 ``tl.dot`` is wrong (triton 3.9), so bf16 runs with
  ``UPCAST`` (operands converted to fp32 after their bf16 rounding);
* host-side facts: ``supports()`` reasons, the registry entry, ``configs()``, the GQA split rule;
* offline compiles of the default tiles for AMD MI300 (``gfx942``) and NVIDIA Hopper (sm_90) in a
  subprocess, reading registers, spills and shared memory (LDS) from the compiled kernels.

GPU (``@pytest.mark.gpu``): a grid of dense shapes pinned to TRITON (odd lengths, every mask kind,
head dims 64/80/128/192-128/256, bf16/fp16), varlen with empty sequences, bitwise-identical
repeated backwards, torch.compile (fullgraph) and CUDA-graph capture through the public op.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from subprocess_results import assert_check_passed, collect_results
from test_compile_sm90 import _nvidia_toolchain

from turbo_dispatch.ops._common import snr_db

ROOT = Path(__file__).resolve().parents[1]
BF16, FP16 = torch.bfloat16, torch.float16
PLUGIN_NAME = "TRITON_INTERP"  # the adapter served on the CPU, for the interpreter's op-level checks
PLUGIN_REGISTRY = f"""
version: 1
ops:
  attention:
    backends:
      - name: {PLUGIN_NAME}
        adapter: turbo_dispatch.backends.triton.attention:TritonAttention
        platforms: [cpu]
"""
INTERP_TILE = (16, 16, 4, 1)


# -- shared helpers ---------------------------------------------------------------------------------
def _snr(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``snr_db`` over the finite entries of ``ref``; -inf when ``got`` has infinities elsewhere."""
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite], ref[~finite]):
        return -math.inf
    return snr_db(got[finite], ref[finite])


def _ref_kwargs(kw: dict) -> dict:
    return dict(scale=kw.get("softmax_scale"), causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)))


#: id -> (B, Sq, Sk, Hq, Hkv, Dqk, Dv, dtype, kwargs) for the interpreter
DENSE_TINY = {
    "mha": (1, 17, 17, 2, 2, 64, 64, FP16, {}),
    "gqa-causal-sq>sk": (1, 33, 17, 4, 2, 64, 64, FP16, dict(causal=True)),  # rows 0..15 attend nothing
    "mqa-window-sq<sk": (1, 17, 33, 4, 1, 64, 64, FP16, dict(window_size=(5, 3))),
    "causal+left-bf16-48/24": (1, 33, 33, 2, 2, 48, 24, BF16, dict(causal=True, window_size=(7, -1))),
    "right-only-sq>sk": (1, 20, 7, 2, 2, 16, 16, FP16, dict(window_size=(-1, 3))),
    "both-sides-sq<sk": (1, 9, 21, 2, 2, 16, 16, FP16, dict(window_size=(2, 2))),
    "mla-192/128": (1, 9, 9, 2, 2, 192, 128, FP16, dict(causal=True)),
    "d256-mqa": (1, 7, 9, 2, 1, 256, 256, FP16, {}),
    "scale-d8": (2, 10, 12, 2, 2, 8, 8, FP16, dict(softmax_scale=0.37)),
}
#: id -> (lens_q, lens_k, Hq, Hkv, D, max_pad, dtype, kwargs)
VARLEN_TINY = {
    "empty-seqs-causal-gqa": ([3, 0, 4, 17], [0, 2, 5, 20], 4, 2, 32, 1, FP16, dict(causal=True)),
    "window-mqa": ([6, 19, 2], [6, 19, 2], 4, 1, 16, 3, FP16, dict(window_size=(2, 1))),
    "full-bf16": ([17, 33], [33, 17], 2, 2, 64, 0, BF16, {}),
}


# -- the interpreter side (runs in the subprocess) ----------------------------------------------------
def _emit(name: str, ok: bool, detail: str = "") -> None:
    print("RESULT " + json.dumps({"name": name, "ok": bool(ok), "detail": detail}), flush=True)


def _gate(values: dict) -> tuple[bool, str]:
    return min(values.values()) >= 40.0, json.dumps({k: round(v, 1) for k, v in values.items()})


def interpreter_adapter():
    """The TRITON adapter for interpreter checks, with 16 x 16 backward tiles too, so the
    backward's spans cross blocks like the forward's (INTERP_TILE)."""
    from turbo_dispatch.backends.triton import attention as TA

    for family in TA.BWD_TILES.values():
        for key in family:
            family[key] = (INTERP_TILE, INTERP_TILE)
    return TA.TritonAttention()


def _interpreter_checks() -> None:  # pragma: no cover - runs in the subprocess
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_attention import cu, ref_grads, varlen_reference

    import turbo_dispatch as turbo
    from turbo_dispatch.backends.triton import attention as TA
    from turbo_dispatch.ops import attention as A

    torch.manual_seed(1234)
    ad = interpreter_adapter()

    def leaves(*shapes, dtype):
        return [torch.randn(s).to(dtype) for s in shapes]

    for name, (b, sq, sk, hq, hk, d, dv, dtype, kw) in DENSE_TINY.items():
        q, k, v, g = leaves((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv), (b, sq, hq, dv), dtype=dtype)
        ro, rl, rg = ref_grads(q, k, v, g, **_ref_kwargs(kw))
        p = A.attention_problem(q, k, v, return_lse=True, **kw)
        out, lse, saved = ad.forward(p, q, k, v, None, None, config=INTERP_TILE)
        grads = ad.backward(p, saved, g)
        vals = {"out": _snr(out, ro), "lse": _snr(lse, rl)}
        vals.update({n: _snr(x, r) for n, x, r in zip(("dq", "dk", "dv"), grads, rg)})
        _emit(f"dense[{name}]", *_gate(vals))

    for name, (lq, lk, hq, hk, d, pad, dtype, kw) in VARLEN_TINY.items():
        c_q, c_k = cu(lq), cu(lk)
        q, k, v, g = leaves((sum(lq), hq, d), (sum(lk), hk, d), (sum(lk), hk, d), (sum(lq), hq, d), dtype=dtype)
        ro, rl, rg = varlen_reference(q, k, v, g, c_q, c_k, kw)
        p = A.attention_varlen_problem(q, k, v, c_q, c_k, max(lq) + pad, max(lk) + pad, return_lse=True, **kw)
        out, lse, saved = ad.forward(p, q, k, v, c_q, c_k, config=INTERP_TILE)
        grads = ad.backward(p, saved, g)
        vals = {"out": _snr(out, ro), "lse": _snr(lse, rl)}
        vals.update({n: _snr(x, r) for n, x, r in zip(("dq", "dk", "dv"), grads, rg)})
        _emit(f"varlen[{name}]", *_gate(vals))

    # Rows that attend nothing: exactly 0 out, -inf lse, 0 gradients (causal, Sq > Sk).
    q, k, v, g = leaves((1, 24, 2, 16), (1, 5, 2, 16), (1, 5, 2, 16), (1, 24, 2, 16), dtype=FP16)
    p = A.attention_problem(q, k, v, causal=True, return_lse=True)
    out, lse, saved = ad.forward(p, q, k, v, None, None, config=INTERP_TILE)
    dq, _, _ = ad.backward(p, saved, g)
    ok = bool((out[:, :19] == 0).all() and torch.isneginf(lse[:, :, :19]).all() and (dq[:, :19] == 0).all()
              and torch.isfinite(lse[:, :, 19:]).all())
    _emit("empty-rows", ok, f"lse[:, :, 17:21]={lse[0, 0, 17:21].tolist()}")

    # The backward twice, bit for bit, also where a GQA group is split over programs.
    q, k, v, g = leaves((1, 33, 8, 32), (1, 33, 2, 32), (1, 33, 2, 32), (1, 33, 8, 32), dtype=FP16)
    p = A.attention_problem(q, k, v, causal=True, deterministic=True)
    out, lse, saved = ad.forward(p, q, k, v, None, None, config=INTERP_TILE)
    runs = [TA.attend_backward(p, *saved[:7], g, ad.backward_tiles(p), splits=s)[:3] for s in (1, 1, 2, 2, 4)]
    same = [all(torch.equal(a, b) for a, b in zip(runs[i], runs[i + 1])) for i in (0, 2)]
    close = min(_snr(x, r) for run in runs[2:] for x, r in zip(run, runs[0]))
    _emit("deterministic", all(same) and close > 60, f"repeat equal={same}, split vs whole SNR {close:.1f}")

    # Strided q/k/v: slices of one packed qkv tensor.
    qkv = torch.randn(2, 19, 3, 4, 32).to(FP16)
    q, k, v = qkv.unbind(2)
    g = torch.randn(2, 19, 4, 32).to(FP16)
    ro, rl, rg = ref_grads(q, k, v, g, causal=True)
    p = A.attention_problem(q, k, v, causal=True, return_lse=True)
    out, lse, saved = ad.forward(p, q, k, v, None, None, config=INTERP_TILE)
    grads = ad.backward(p, saved, g)
    vals = {"out": _snr(out, ro), "lse": _snr(lse, rl)}
    vals.update({n: _snr(x, r) for n, x, r in zip(("dq", "dk", "dv"), grads, rg)})
    _emit("strided-qkv", *_gate(vals))

    # The public op, eager (autograd through _AttentionFunction) and compiled (the custom ops,
    # fullgraph), with the adapter served on the CPU under the plugin name.
    turbo.GlobalBackendManager.set_attn_backend(PLUGIN_NAME)
    q, k, v, g = leaves((2, 21, 4, 32), (2, 29, 2, 32), (2, 29, 2, 32), (2, 21, 4, 32), dtype=FP16)
    kw = dict(causal=True, window_size=(9, -1))
    ro, rl, rg = ref_grads(q, k, v, g, **_ref_kwargs(kw))

    def step(fn):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        o, lse_ = fn(*xs)
        o.backward(g)
        vals = {"out": _snr(o, ro), "lse": _snr(lse_, rl)}
        vals.update({n: _snr(x.grad, r) for n, x, r in zip(("dq", "dk", "dv"), xs, rg)})
        return vals, lse_.requires_grad

    def call(*xs):
        return turbo.ops.flash_attn_func(*xs, return_lse=True, **kw)

    try:
        decision = turbo.explain("attention", q, k, v, **kw)
        vals, lse_grad = step(call)
        ok, detail = _gate(vals)
        _emit("op-eager", ok and not lse_grad and decision.backend == PLUGIN_NAME, f"{detail} {decision.backend}")
        vals, _ = step(torch.compile(call, fullgraph=True, backend="aot_eager"))
        _emit("op-compiled", *_gate(vals))
        c_q, c_k = cu([5, 0, 16]), cu([7, 3, 16])
        qv, kv, vv, gv = leaves((21, 4, 32), (26, 2, 32), (26, 2, 32), (21, 4, 32), dtype=FP16)
        ro_v, _, rg_v = varlen_reference(qv, kv, vv, gv, c_q, c_k, dict(causal=True))
        xs = [x.clone().requires_grad_() for x in (qv, kv, vv)]
        fn = torch.compile(lambda a, b_, c: turbo.ops.flash_attn_varlen_func(a, b_, c, c_q, c_k, 16, 16, causal=True),
                           fullgraph=True, backend="aot_eager")
        o = fn(*xs)
        o.backward(gv)
        vals = {"out": _snr(o, ro_v)}
        vals.update({n: _snr(x.grad, r) for n, x, r in zip(("dq", "dk", "dv"), xs, rg_v)})
        _emit("op-compiled-varlen", *_gate(vals))
    finally:
        turbo.GlobalBackendManager.set_attn_backend(None)


_CPU_NAMES = ([f"dense[{n}]" for n in DENSE_TINY] + [f"varlen[{n}]" for n in VARLEN_TINY]
              + ["empty-rows", "deterministic", "strided-qkv", "op-eager", "op-compiled", "op-compiled-varlen"])


def interpreter_results(script: str, tmp_path_factory) -> dict:
    """``script`` run with ``--interpreter-checks`` under the Triton interpreter, with the TRITON
    adapter served on the CPU as ``PLUGIN_NAME``: its RESULT lines by name (``script_results``)."""
    registry = tmp_path_factory.mktemp("plugin") / "registry.yaml"
    registry.write_text(PLUGIN_REGISTRY)
    return script_results(script, "--interpreter-checks", TRITON_INTERPRET="1",
                          PRIMUS_TURBO_EXTRA_REGISTRY=str(registry))


def script_results(script: str, *args: str, **env: str) -> dict:
    """``script`` run with ``args``: its RESULT lines by name, and ``__crash__`` (the stderr's end)
    when it failed. TRITON_INTERPRET is dropped unless ``env`` sets it."""
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, script, *args], env={**full, **env}, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    return collect_results(proc)


def _results(*args: str, **env: str) -> dict:
    return script_results(__file__, *args, **env)


def interpreter_suite(script: str, names: list[str]):
    """``(fixture, test)`` for a test module whose ``script`` prints the RESULT lines ``names``
    under ``--interpreter-checks``: bind them as ``_interpreter_results, test_interpreter``. The
    fixture runs the script once per module (``interpreter_results``) and skips where this
    triton's interpreter cannot run the kernels; the test asserts one named check."""

    @pytest.fixture(scope="module", name="_interpreter_results")
    def results(interpreter_refusal, tmp_path_factory) -> dict:
        if interpreter_refusal:
            pytest.skip(interpreter_refusal)
        return interpreter_results(script, tmp_path_factory)

    @pytest.mark.parametrize("name", names)
    def test_interpreter(_interpreter_results, name):
        assert_check_passed(_interpreter_results, name)

    return results, test_interpreter


_interpreter_results, test_interpreter = interpreter_suite(__file__, _CPU_NAMES)


# -- host-side facts ----------------------------------------------------------------------------------
def _problem(**changes):
    from turbo_dispatch.ops.attention import AttentionProblem

    base = AttentionProblem(2, 4096, 4096, 8192, 8192, 32, 8, 128, 128, BF16, True, -1, 0, 0.0, 128 ** -0.5, False,
                            False, False, "cuda")
    return base._replace(**changes)


def test_supports_reasons(monkeypatch):
    """Every refusal names its reason; what the kernels serve is accepted, deterministic included."""
    from turbo_dispatch.backends.triton.attention import TritonAttention

    ad = TritonAttention()
    served = [_problem(), _problem(platform="rocm"), _problem(deterministic=True), _problem(varlen=True),
              _problem(head_dim_qk=192, head_dim_v=128), _problem(head_dim_qk=256, head_dim_v=256, dtype=FP16),
              _problem(heads_kv=1, causal=False, window_left=1024, window_right=-1), _problem(return_lse=True),
              _problem(seqlen_q=17, seqlen_k=4099, head_dim_qk=80, head_dim_v=80)]
    for p in served:
        assert ad.supports(p) is None, p
    refused = {"bf16/fp16": _problem(dtype=torch.float32), "dropout": _problem(dropout_p=0.1),
               "up to 256": _problem(head_dim_qk=320, head_dim_v=320)}
    for reason, p in refused.items():
        assert reason in (ad.supports(p) or ""), (reason, ad.supports(p))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in ad.supports(_problem(platform="cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ad.supports(_problem(platform="cpu")) is None
    assert "deterministic backward" in ad.describe(_problem(deterministic=True))
    assert "192->256" in ad.describe(_problem(head_dim_qk=192, head_dim_v=128))


def test_registry_lists_triton_for_attention():
    from turbo_dispatch.backends.triton.attention import TritonAttention
    from turbo_dispatch.registry import load_registry

    reg = load_registry(extra_files=[])
    entry = reg.get("attention", "TRITON")
    assert entry is not None and isinstance(entry.adapter, TritonAttention)
    assert set(entry.platforms) == {"cuda", "rocm"}
    for platform in ("cuda", "rocm"):
        names = [e.name for e in reg.backends("attention", platform)]
        assert names[0] == "TORCH" and "TRITON" in names, names  # TORCH stays the default and first fallback
        assert reg.default("attention", platform) == "TORCH"


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128), (256, 256), (80, 80)])
@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_configs(dims, platform):
    """A few forward tiles per head dim, the first the default; blocks never exceed what short
    sequences need; backward tiles exist for every head dim; identities tell configs apart."""
    from turbo_dispatch.backends.triton import attention as TA

    ad = TA.TritonAttention()
    p = _problem(head_dim_qk=dims[0], head_dim_v=dims[1], platform=platform)
    cfgs = ad.configs(p)
    assert 2 <= len(cfgs) <= 8 and len(set(cfgs)) == len(cfgs)
    for bm, bn, warps, stages in cfgs:
        assert TA._check_tile((bm, bn, warps, stages)) == (bm, bn, warps, stages)
    assert cfgs[0] == TA.FWD_TILES[platform][TA._table_key(p)][0]
    assert ad.identity(cfgs[0]) != ad.identity(cfgs[1]) and TA.AK.KERNEL_REVISION in ad.identity(cfgs[0])
    short = ad.configs(p._replace(seqlen_q=17, seqlen_k=5))
    assert all(bm <= 32 and bn == 16 for bm, bn, _, _ in short)
    dkdv, dq = ad.backward_tiles(p)
    assert len(dkdv) == len(dq) == 4
    with pytest.raises(ValueError, match="power of two"):
        TA._check_tile((96, 64, 4, 2))
    with pytest.raises(ValueError, match="BLOCK_M, BLOCK_N"):
        TA._check_tile((64, 64))
    assert TA._check_tile([64, 32, 4, 2]) == (64, 32, 4, 2)  # a config read back from a JSON tuning DB


def test_gqa_split_rule():
    """dK/dV programs per kv head: 1 when the grid fills the device, else a divisor of the group."""
    from turbo_dispatch.backends.triton.attention import block_dim, gqa_splits

    assert gqa_splits(2, 8, 8, 64, 264) == 1  # GQA 64/8 at S 8192: 1024 programs
    assert gqa_splits(1, 1, 32, 16, 264) == 16  # MQA, one short sequence: 16 programs
    assert gqa_splits(1, 2, 6, 4, 264) == 6
    assert gqa_splits(1, 1, 1, 1, 264) == 1
    assert [block_dim(d) for d in (8, 16, 48, 64, 80, 128, 192, 256)] == [16, 16, 64, 64, 128, 128, 256, 256]


# -- offline compiles: AMD MI300 (gfx942) and NVIDIA Hopper (sm_90) ---------------------------------
def _compile_defaults(backend: str) -> None:  # pragma: no cover - runs in the subprocess
    """Compiles the default tiles' kernels (forward, dK/dV, dQ) for every head-dim class, dense
    and causal, through a stand-in driver that names the target; prints one RESULT line each with
    registers, spills and shared memory."""
    os.environ.pop("TRITON_INTERPRET", None)
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from turbo_dispatch.backends.triton import attention as TA
    from turbo_dispatch.backends.triton import attention_kernels as AK
    from turbo_dispatch.ops.attention import attention_problem

    target = GPUTarget("hip", "gfx942", 64) if backend == "hip" else GPUTarget("cuda", 90, 32)
    platform = "rocm" if backend == "hip" else "cuda"

    class _Offline:
        def __init__(self):
            self.target = target

        def is_active(self):
            return True

        def get_current_target(self):
            return self.target

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    def resources(compiled) -> dict:
        if backend == "hip":
            gcn = compiled.asm["amdgcn"]
            return {"vgpr": int(re.search(r"; NumVgprs: (\d+)", gcn).group(1)),
                    "agpr": int(re.search(r"; NumAgprs: (\d+)", gcn).group(1)),
                    "scratch": int(re.search(r"; ScratchSize: (\d+)", gcn).group(1)),
                    "lds": int(compiled.metadata.shared)}
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(compiled.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
        return {"regs": int(re.search(r"REG:(\d+)", usage).group(1)),
                "stack": int(re.search(r"STACK:(\d+)", usage).group(1)), "smem": int(compiled.metadata.shared)}

    previous = getattr(driver, "_active", None)
    driver.set_active(_Offline())
    try:
        for dqk, dv in ((64, 64), (128, 128), (192, 128), (256, 256)):
            b, s, hq, hk = 2, 4096, 32, 8
            q, k = torch.empty(b, s, hq, dqk, dtype=BF16), torch.empty(b, s, hk, dqk, dtype=BF16)
            v, out = torch.empty(b, s, hk, dv, dtype=BF16), torch.empty(b, s, hq, dv, dtype=BF16)
            lse = torch.empty(b, hq, s)
            p = attention_problem(q, k, v, causal=True)._replace(platform=platform)
            ad = TA.TritonAttention()
            fwd = ad.configs(p)[0]
            (m1, n1, w1, s1), (m2, n2, w2, s2) = ad.backward_tiles(p)
            common = dict(VARLEN=False, D_QK=dqk, D_V=dv, BLOCK_DQK=TA.block_dim(dqk), BLOCK_DV=TA.block_dim(dv),
                          UPCAST=False, HAS_LEFT=False, HAS_RIGHT=True, LEFT=0, RIGHT=0, grid=(1,))
            st = lambda x: tuple(x.stride())  # noqa: E731
            ls = (lse.stride(0), lse.stride(1))

            def forward(q, k, v, tile, HAS_SINK=False, FP8=False, SCALE_BLOCK=1):
                return AK.attn_fwd_kernel.warmup(
                    q, k, v, out, lse, lse, lse, lse, lse, lse, lse, *st(q), *st(k), *st(v), *st(out), *ls, *(ls * 3),
                    s, s, hq, hq // hk, 0.1, BLOCK_M=tile[0], BLOCK_N=tile[1], REVERSE=True, HAS_SINK=HAS_SINK,
                    FP8=FP8, SCALE_BLOCK=SCALE_BLOCK, num_warps=tile[2], num_stages=tile[3], **common)
            kernels = {
                "fwd": (fwd, lambda: forward(q, k, v, fwd)),
                "dkdv": ((m1, n1, w1, s1), lambda: AK.attn_bwd_dkdv_kernel.warmup(
                    q, k, v, out, k, v, lse, lse, lse, lse, *st(q), *st(k), *st(v), *st(out), 0, *st(k), 0, *st(v),
                    *ls, s, s, hk, hq // hk, 1, 0.1, 0.1, BLOCK_M=m1, BLOCK_N=n1, num_warps=w1, num_stages=s1,
                    **common)),
                "dq": ((m2, n2, w2, s2), lambda: AK.attn_bwd_dq_kernel.warmup(
                    q, k, v, out, q, lse, lse, lse, lse, *st(q), *st(k), *st(v), *st(out), *st(q), *ls, s, s, hq,
                    hq // hk, 0.1, 0.1, BLOCK_M=m2, BLOCK_N=n2, REVERSE=True, num_warps=w2, num_stages=s2, **common)),
            }
            if dqk == 128:  # the sink and fp8 (NVIDIA only) variants of the forward, in one head-dim class
                kernels["fwd-sink"] = (fwd, lambda: forward(q, k, v, fwd, HAS_SINK=True))
                if backend == "cuda":
                    f8 = torch.float8_e4m3fn
                    tile8 = ad.configs(p._replace(fp8=True, fp8_block=64))[0]
                    kernels["fwd-fp8"] = (tile8, lambda: forward(q.to(f8), k.to(f8), v.to(f8), tile8, FP8=True,
                                                                 SCALE_BLOCK=64))
            for kind, (tile, build) in kernels.items():
                name = f"{backend}:{kind}[{dqk}/{dv}]"
                try:
                    row = resources(build())
                except Exception as exc:  # noqa: BLE001 - a compile failure is a result
                    _emit(name, False, f"{type(exc).__name__}: {str(exc)[:400]}")
                    continue
                _emit(name, True, json.dumps({"tile": list(tile), **row}))
    finally:
        driver._active = previous


def _hip_toolchain() -> str | None:
    try:
        import triton.backends.amd.compiler  # noqa: F401
        from triton._C.libtriton import amd
    except ImportError as exc:
        return f"this triton has no AMD backend ({exc})"
    if not hasattr(amd, "link_hsaco"):
        return "this triton's AMD backend has no built-in linker (amd.link_hsaco); it needs ROCm's ld.lld"
    return None


def _compile_rows(backend: str) -> dict:
    rows = _results("--compile", backend)
    assert "__crash__" not in rows and rows, rows.get("__crash__")
    return rows


@pytest.mark.skipif(_hip_toolchain() is not None, reason=str(_hip_toolchain()))
def test_compiles_for_mi300_gfx942():
    """The plain-Triton kernels compile for AMD MI300 (gfx942, wave64) on a CPU-only machine with
    triton's AMD backend (its built-in linker makes the hsaco): default tiles of every head-dim
    class fit the 64 KiB of LDS and spill nothing to scratch."""
    rows = _compile_rows("hip")
    assert len(rows) == 13
    for name, r in rows.items():
        assert r["ok"], (name, r["detail"])
        res = json.loads(r["detail"])
        assert res["lds"] <= 64 * 1024 and res["scratch"] == 0, (name, res)


@pytest.mark.skipif(_nvidia_toolchain() is not None, reason=str(_nvidia_toolchain()))
def test_compiles_for_hopper_sm90():
    """The same kernels compile for sm_90 and their default tiles fit its shared memory (227 KiB),
    the fp8 forward (e4m3 dots) included."""
    rows = _compile_rows("cuda")
    assert len(rows) == 14
    for name, r in rows.items():
        assert r["ok"], (name, r["detail"])
        assert json.loads(r["detail"])["smem"] <= 227 * 1024, (name, r["detail"])


if __name__ == "__main__" and "--interpreter-checks" in sys.argv:
    _interpreter_checks()
if __name__ == "__main__" and "--compile" in sys.argv:
    _compile_defaults(sys.argv[sys.argv.index("--compile") + 1])


# -- GPU -------------------------------------------------------------------------------------------
@pytest.fixture
def pinned():
    import turbo_dispatch as turbo

    turbo.GlobalBackendManager.set_attn_backend("TRITON")
    yield turbo
    turbo.GlobalBackendManager.set_attn_backend(None)


def _gpu_inputs(shapes, dtype):
    from test_attention import randn

    return [randn(s, dtype) for s in shapes]


#: (B, Sq, Sk, Hq, Hkv, Dqk, Dv, dtype, kwargs), every case with the lse
GPU_GRID = [
    (2, 257, 257, 8, 8, 128, 128, BF16, {}),
    (2, 257, 257, 8, 8, 128, 128, FP16, dict(causal=True)),
    (1, 200, 331, 8, 2, 64, 64, BF16, dict(causal=True)),
    (1, 331, 200, 8, 1, 64, 64, BF16, dict(causal=True)),  # rows that attend nothing
    (1, 300, 300, 4, 4, 128, 128, BF16, dict(window_size=(64, 0))),
    (1, 300, 300, 8, 2, 128, 128, BF16, dict(window_size=(32, 32))),
    (1, 300, 300, 4, 4, 64, 64, BF16, dict(window_size=(-1, 16))),
    (1, 100, 300, 4, 2, 64, 64, FP16, dict(window_size=(20, 20))),
    (1, 300, 100, 4, 4, 64, 64, BF16, dict(window_size=(-1, 3))),
    (1, 257, 257, 4, 4, 192, 128, BF16, dict(causal=True)),
    (1, 129, 129, 4, 4, 256, 256, BF16, {}),
    (1, 129, 200, 4, 2, 256, 256, FP16, dict(causal=True)),
    (1, 200, 200, 4, 4, 80, 80, BF16, {}),
    (1, 128, 128, 4, 4, 64, 64, BF16, dict(softmax_scale=0.05)),
    (2, 128, 128, 4, 4, 64, 64, BF16, dict(deterministic=True, causal=True)),
    (3, 1, 77, 4, 4, 128, 128, BF16, dict(causal=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["default", "plain"])
@pytest.mark.parametrize("case", GPU_GRID, ids=lambda c: "-".join(map(str, c[:7])) + f"-{c[7]}-{c[8]}".replace(" ", ""))
def test_gpu_grid(case, kernels, pinned, monkeypatch):
    """Each case as the adapter runs it (on Hopper the Gluon kernels take what they serve) and with
    every Gluon kernel switched off, so the plain-Triton kernels are checked on every GPU."""
    from test_attention import assert_result, ref_grads, run_op

    if kernels == "plain":
        monkeypatch.setenv("PRIMUS_TURBO_GLUON_KERNELS", "0")
    b, sq, sk, hq, hk, d, dv, dtype, kw = case
    q, k, v, grad = _gpu_inputs([(b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv), (b, sq, hq, dv)], dtype)
    ref = ref_grads(q, k, v, grad, **_ref_kwargs(kw))
    got = run_op(pinned.ops.flash_attn_func, q.cuda(), k.cuda(), v.cuda(), grad.cuda(), return_lse=True, **kw)
    assert got[0].dtype == dtype
    assert_result(got, ref, dtype, True)
    assert pinned.explain("attention", q.cuda(), k.cuda(), v.cuda(), **kw).backend == "TRITON"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal-gqa-empty", "window-mqa", "full-fp16"])
def test_gpu_varlen(case, pinned):
    from test_attention import assert_result, cu, run_op, varlen_reference

    lq, lk, hq, hk, dtype, kw = {
        "causal-gqa-empty": ([100, 0, 257, 33], [120, 7, 250, 0], 8, 2, BF16, dict(causal=True)),
        "window-mqa": ([64, 200, 1], [64, 180, 3], 4, 1, BF16, dict(window_size=(16, 8))),
        "full-fp16": ([31, 129], [31, 129], 4, 4, FP16, {}),
    }[case]
    c_q, c_k = cu(lq), cu(lk)
    q, k, v, grad = _gpu_inputs([(sum(lq), hq, 128), (sum(lk), hk, 128), (sum(lk), hk, 128), (sum(lq), hq, 128)],
                                dtype)
    ref = varlen_reference(q, k, v, grad, c_q, c_k, kw)
    args = (c_q.cuda(), c_k.cuda(), max(lq), max(lk))
    got = run_op(pinned.ops.flash_attn_varlen_func, q.cuda(), k.cuda(), v.cuda(), grad.cuda(), *args,
                 return_lse=True, **kw)
    assert_result(got, ref, dtype, True)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 8), (16, 2), (32, 1)], ids=["mha", "gqa", "mqa"])
def test_gpu_backward_is_bitwise_repeatable(heads, pinned):
    """deterministic=True is honoured by construction: two backwards give identical bits, also
    where the dK/dV kernel splits a GQA group over programs (MQA at this size)."""
    from test_attention import run_op

    hq, hk = heads
    q, k, v, grad = (x.cuda() for x in _gpu_inputs([(1, 1000, hq, 128), (1, 1000, hk, 128), (1, 1000, hk, 128),
                                                    (1, 1000, hq, 128)], BF16))
    runs = [run_op(pinned.ops.flash_attn_func, q, k, v, grad, causal=True, deterministic=True) for _ in range(2)]
    for a, b in zip(runs[0][2], runs[1][2]):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["aot_eager", "inductor", "reduce-overhead"])
def test_gpu_compile_fullgraph(mode, pinned, fresh_dynamo):
    """torch.compile (fullgraph) through the custom ops: the backward op starts from the forward
    op's out and lse; "reduce-overhead" replays both as CUDA graphs (three steps, new inputs)."""
    from test_attention import cu, snr_db

    c = cu([100, 7, 250, 33]).cuda()

    def call(q, k, v, qv, kv, vv):
        out, lse = pinned.ops.flash_attn_func(q, k, v, causal=True, return_lse=True)
        return out, lse, pinned.ops.flash_attn_varlen_func(qv, kv, vv, c, c, 250, 250, window_size=(32, 0))

    kwargs = dict(backend=mode) if mode != "reduce-overhead" else dict(mode=mode)
    compiled = torch.compile(call, fullgraph=True, **kwargs)
    shapes = [(2, 256, 8, 128), (2, 256, 2, 128), (2, 256, 2, 128), (390, 4, 64), (390, 4, 64), (390, 4, 64)]
    for _ in range(3 if mode == "reduce-overhead" else 1):
        xs = [x.cuda().requires_grad_() for x in _gpu_inputs(shapes, BF16)]
        ys = [x.detach().clone().requires_grad_() for x in xs]
        gd, gv = torch.randn_like(xs[0]), torch.randn_like(xs[3])
        got, want = compiled(*xs), call(*ys)
        for g, w in zip(got, want):
            assert snr_db(g.float(), w.float()) > 60
        got_grads = torch.autograd.grad((got[0], got[2]), xs, (gd, gv))
        want_grads = torch.autograd.grad((want[0], want[2]), ys, (gd, gv))
        for g, w in zip(got_grads, want_grads):
            assert snr_db(g.float(), w.float()) > 60


@pytest.mark.gpu
def test_gpu_cuda_graph_capture(pinned):
    """No host sync in the forward or backward: a dense windowed call with lse and a varlen call,
    forward and backward, captured in one CUDA graph; replays with new inputs match eager."""
    from test_attention import cu

    c = cu([100, 7, 250, 33]).cuda()
    shapes = [(2, 200, 4, 64)] * 3 + [(390, 4, 64)] * 3
    xs = [x.cuda().requires_grad_() for x in _gpu_inputs(shapes, BF16)]
    gd, gv = torch.randn(2, 200, 4, 64, device="cuda", dtype=BF16), torch.randn(390, 4, 64, device="cuda", dtype=BF16)

    def step():
        out, lse = pinned.ops.flash_attn_func(*xs[:3], window_size=(32, 0), return_lse=True)
        packed = pinned.ops.flash_attn_varlen_func(*xs[3:], c, c, 250, 250, causal=True)
        grads = torch.autograd.grad((out, packed), xs, (gd, gv))
        return (out.detach(), lse, packed.detach()) + grads

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # resolves the decisions and compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for x in xs:
            x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_env_pin_and_autotune(monkeypatch):
    """PRIMUS_TURBO_ATTN_BACKEND=TRITON pins it; autotuning picks among TRITON, CUDNN and TORCH and
    always lands on a backend that serves the call (windows: not CUDNN)."""
    import turbo_dispatch as turbo

    q, k, v = (torch.randn(1, 512, 8, 128, device="cuda", dtype=BF16) for _ in range(3))
    monkeypatch.setenv("PRIMUS_TURBO_ATTN_BACKEND", "TRITON")
    turbo.GlobalBackendManager.reset()
    assert turbo.explain("attention", q, k, v, causal=True).backend == "TRITON"
    monkeypatch.delenv("PRIMUS_TURBO_ATTN_BACKEND")
    turbo.GlobalBackendManager.reset()
    turbo.GlobalBackendManager.set_attn_backend(auto_tune=True)
    d = turbo.explain("attention", q, k, v, window_size=(64, 0))
    assert d.source == "autotune" and d.backend in ("TRITON", "TORCH"), d
