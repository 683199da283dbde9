"""flash_attn_fp8_func: attention with q, k, v quantised to float8 e4m3 (TRITON).

References, float64 on the CPU from the same rounded inputs the kernels see (random, never zero):
the exact attention of the bf16/fp16 inputs, and the attention of the dequantised inputs (what
the fp8 products approximate; only the probabilities' and v's rounding separate it from the
kernel). Gates: out and dq, dk, dv >= 20 dB against the exact reference (e4m3 keeps 3 mantissa
bits: about 24 dB is what the recipe gives), lse >= 40 dB; against the dequantised reference
the lse >= 90 dB (the scores' fp8 products are exact in fp32) and out >= 22 dB.

CPU (no marker): the quantisers, the recipe mapping (``fp8_block_of``), refusals and the problem
key in torch; the TRITON kernels under the Triton interpreter, whose ``tl.dot`` takes fp8
operands (triton 3.9; it does not enforce the GPU's K >= 32 for 8-bit dots, so the checks use
the GPU's tiles), in one subprocess: blockwise (32, 64) and per-tensor scaling, MHA/GQA, causal
with rows that attend no key, odd sizes, a head dim of 16 (padded to 32), a sink, the public op eager and compiled (the
compiled backward quantises the saved inputs again: bit-identical gradients) and the module.

GPU (``@pytest.mark.gpu``, TRITON, sm_89+): SNR against the bf16 TRITON path and against the
float64 reference, recorded as JUnit properties (``snr_*_db``) and asserted >= 20 dB.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_attention import randn, ref_grads
from test_triton_attention import PLUGIN_NAME, _emit, _snr, interpreter_adapter, interpreter_suite

import turbo_dispatch as turbo
from turbo_dispatch import NoBackendError, PrecisionType
from turbo_dispatch.low_precision import Float8QuantConfig
from turbo_dispatch.op_spec import format_key
from turbo_dispatch.ops import attention as A
from turbo_dispatch.ops.attention_fp8 import dequantize_tokens, fp8_block_of, quantize_tokens

BF16, FP16, E4M3 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
GRAD_NAMES = ("dq", "dk", "dv", "dsink")


# -- torch only ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [16, 64, 0], ids=["block16", "block64", "tensorwise"])
def test_quantize_tokens(block):
    """Scales are amax / 448 per block of tokens of one (batch, head) (or per tensor); every
    element round-trips within e4m3's rounding; odd lengths pad the last block; an all-zero
    block gets scale 1; ``token_contiguous`` puts the tokens innermost."""
    b, s, h, d = 2, 37, 3, 24
    x = randn((b, s, h, d), BF16)
    x[1, :, 2] = 0  # an all-zero (batch, head): every block of it
    data, descale = quantize_tokens(x, block)
    assert data.dtype == E4M3 and data.shape == x.shape and descale.dtype == torch.float32
    xf = x.float()
    if block:
        assert descale.shape == (b, h, -(-s // block))
        for j in range(descale.shape[2]):
            amax = xf[:, j * block:(j + 1) * block].abs().amax(dim=(1, 3))
            assert torch.equal(descale[:, :, j], torch.where(amax > 0, amax / 448, torch.ones_like(amax)))
        assert (descale[1, 2] == 1).all()
    else:
        assert descale.shape == (b, h, 1) and descale.stride()[:2] == (0, 0)
        assert descale[0, 0, 0] == xf.abs().max() / 448
    back = dequantize_tokens(data, descale, block, torch.float32)
    assert back.is_contiguous() and back.dtype == torch.float32
    per_token = back / torch.where(xf == 0, torch.ones_like(xf), xf)
    big = xf.abs() > 0.1  # well inside e4m3's normal range at these scales
    assert ((per_token[big] - 1).abs() <= 2 ** -4).all()
    assert (back[xf == 0] == 0).all()
    v8, v_scale = quantize_tokens(x, block, token_contiguous=True)
    assert v8.stride(1) == 1 and torch.equal(v8.float(), data.float()) and torch.equal(v_scale, descale)


def test_fp8_block_of_maps_the_recipe():
    op = "flash_attn_fp8_func"
    assert fp8_block_of(op, None) == 64
    assert fp8_block_of(op, Float8QuantConfig(granularity="blockwise", block_size=128)) == 128
    assert fp8_block_of(op, Float8QuantConfig(format="hybrid", granularity="blockwise", block_size=32)) == 32
    assert fp8_block_of(op, Float8QuantConfig()) == 0  # TENSORWISE
    for cfg, match in ((Float8QuantConfig(format="e5m2"), "E5M2"), (Float8QuantConfig(granularity="rowwise"), "ROWWISE"),
                       (Float8QuantConfig(granularity="mx_blockwise", scale_dtype="e8m0"), "MX_BLOCKWISE")):
        with pytest.raises(ValueError, match=match):
            fp8_block_of(op, cfg)
    with pytest.raises(TypeError, match="Float8QuantConfig"):
        fp8_block_of(op, "blockwise")


def test_problem_key_refusals_and_cpu():
    """The key carries fp8 and its block, the precision is FP8; TORCH refuses fp8 by reason, so
    the CPU has no backend for it; fp32 inputs are refused by the op."""
    q = randn((1, 8, 2, 16), BF16)
    p = A.attention_problem(q, q, q, fp8_block=64, op="flash_attn_fp8_func")
    assert p.fp8 and p.fp8_block == 64 and "fp8=1,fp8_block=64" in format_key(p)
    assert A.ATTENTION.precision_of(p) is PrecisionType.FP8
    assert A.ATTENTION.precision_of(p._replace(fp8=False)) is PrecisionType.BF16
    with pytest.raises(NoBackendError, match="fp8 attention"):
        turbo.ops.flash_attn_fp8_func(q, q, q)
    with pytest.raises(TypeError, match="flash_attn_fp8_func: q.dtype must be one of bfloat16, float16"):
        turbo.ops.flash_attn_fp8_func(q.float(), q.float(), q.float())


def test_triton_supports_and_tiles():
    """TRITON serves fp8 on NVIDIA (dense), refuses ROCm, varlen and scale blocks under 32 by
    reason; its fp8 tiles keep a key block inside one scale block and at least 32 keys long (an
    fp8 tl.dot's smallest K), short sequences included."""
    from turbo_dispatch.backends.triton.attention import TritonAttention

    ad = TritonAttention()
    base = A.AttentionProblem(2, 4096, 4096, 8192, 8192, 32, 8, 128, 128, BF16, True, -1, 0, 0.0, 128 ** -0.5, False,
                              False, False, "cuda", False, True, 64)
    if not torch.cuda.is_available():
        assert ad.supports(base) is None
    assert "NVIDIA" in ad.supports(base._replace(platform="rocm"))
    assert "dense" in ad.supports(base._replace(varlen=True))
    assert "bf16/fp16" in ad.supports(base._replace(dtype=torch.float32))
    assert "block_size >= 32" in ad.supports(base._replace(fp8_block=16))
    for block in (32, 64, 128, 0):
        for sq, sk in ((4096, 4096), (7, 9)):
            cfgs = ad.configs(base._replace(fp8_block=block, seqlen_q=sq, seqlen_k=sk))
            assert cfgs and all(32 <= bn <= (block or 1 << 30) for _, bn, _, _ in cfgs), (block, cfgs)
    assert "fp8 e4m3 forward (64-token blocks)" in ad.describe(base)


# -- the interpreter side (runs in the subprocess) ----------------------------------------------------
#: id -> (B, Sq, Sk, Hq, Hkv, D, dtype, block, kwargs)
DENSE_TINY = {
    "mha-block32": (2, 37, 37, 2, 2, 64, BF16, 32, {}),
    "d16-padded-to-32-tensorwise": (1, 20, 23, 2, 2, 16, FP16, 0, {}),
    "gqa-causal-sq>sk-block64": (1, 41, 20, 4, 2, 32, FP16, 64, dict(causal=True)),  # rows 0..20 attend no key
    "tensorwise-window-d48": (1, 33, 40, 2, 1, 48, BF16, 0, dict(window_size=(9, 4))),
    "sink-block32": (1, 33, 33, 4, 2, 32, BF16, 32, dict(causal=True, sink=True)),
}
#: fp8 tiles: an fp8 tl.dot reduces over at least 32 keys (BLOCK_N); the GPU enforces it.
FP8_TILE = (16, 32, 4, 1)


def _interpreter_checks() -> None:  # pragma: no cover - runs in the subprocess
    torch.manual_seed(2468)
    ad = interpreter_adapter()

    for name, (b, sq, sk, hq, hk, d, dtype, block, kw) in DENSE_TINY.items():
        kw = dict(kw)
        q, k, v, g = (randn(s, dtype) for s in [(b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, hq, d)])
        sink = randn((hq,)) if kw.pop("sink", False) else None
        ref_kw = dict(scale=kw.get("softmax_scale"), causal=kw.get("causal", False),
                      window=kw.get("window_size", (-1, -1)))
        exact = ref_grads(q, k, v, g, sink=sink, **ref_kw)
        dequantised = [dequantize_tokens(*quantize_tokens(x, block), block, torch.float64) for x in (q, k, v)]
        deq = ref_grads(*dequantised, g, sink=sink, **ref_kw)
        p = A.attention_problem(q, k, v, return_lse=True, sink=sink, fp8_block=block, op="flash_attn_fp8_func", **kw)
        extra = {"sink": sink} if sink is not None else {}
        out, lse, saved = ad.forward(p, q, k, v, None, None, config=FP8_TILE, **extra)
        grads = ad.backward(p, saved, g)
        vals = {"out": _snr(out, exact[0]), "lse": _snr(lse, exact[1])}
        vals.update({n: _snr(x, r) for n, x, r in zip(GRAD_NAMES, grads, exact[2])})
        deq_vals = {"out": _snr(out, deq[0]), "lse": _snr(lse, deq[1])}
        ok = (min(vals["out"], *(vals[n] for n in GRAD_NAMES[:len(grads)])) >= 20 and vals["lse"] >= 40
              and deq_vals["lse"] >= 90 and deq_vals["out"] >= 22 and out.dtype == dtype)
        detail = {"exact": {n: round(x, 1) for n, x in vals.items()},
                  "dequantised": {n: round(x, 1) for n, x in deq_vals.items()}}
        _emit(f"dense[{name}]", ok, str(detail))

    # The public op through the plugin entry, eager then compiled: the same bits (the compiled
    # backward quantises the saved inputs again), and the module.
    turbo.GlobalBackendManager.set_attn_backend(PLUGIN_NAME)
    try:
        cfg = Float8QuantConfig(granularity="blockwise", block_size=32)
        q, k, v, g = (randn(s, BF16) for s in [(2, 21, 4, 32), (2, 29, 2, 32), (2, 29, 2, 32), (2, 21, 4, 32)])
        sink = randn((4,))

        def call(q_, k_, v_, s_):
            return turbo.ops.flash_attn_fp8_func(q_, k_, v_, causal=True, return_lse=True, fp8_config=cfg, sink=s_)

        runs = []
        for fn in (call, torch.compile(call, fullgraph=True, backend="aot_eager")):
            xs = [x.clone().requires_grad_() for x in (q, k, v, sink)]
            out, lse = fn(*xs)
            out.backward(g)
            runs.append([out.detach(), lse] + [x.grad for x in xs])
        exact = ref_grads(q, k, v, g, sink=sink, causal=True)
        vals = {n: _snr(x, r) for n, x, r in zip(("out", "lse") + GRAD_NAMES, runs[0], (exact[0], exact[1], *exact[2]))}
        _emit("op-eager", min(vals.values()) >= 20, str({n: round(x, 1) for n, x in vals.items()}))
        same = [torch.equal(a, b) for a, b in zip(*runs)]
        _emit("op-compiled-same-bits", all(same), str(same))
        module = turbo.modules.TurboAttention(causal=True, fp8_config=cfg)
        _emit("module-fp8", torch.equal(module(q, k, v), call(q, k, v, None)[0]))
    finally:
        turbo.GlobalBackendManager.set_attn_backend(None)


_CPU_NAMES = [f"dense[{n}]" for n in DENSE_TINY] + ["op-eager", "op-compiled-same-bits", "module-fp8"]


_interpreter_results, test_interpreter = interpreter_suite(__file__, _CPU_NAMES)

if __name__ == "__main__" and "--interpreter-checks" in sys.argv:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _interpreter_checks()


# -- GPU -------------------------------------------------------------------------------------------
#: (B, S, Hq, Hkv, D, dtype, fp8_config kwargs, call kwargs)
GPU_CASES = {
    "b2-s1024-h8-d128-block64": (2, 1024, 8, 8, 128, BF16, dict(granularity="blockwise", block_size=64), {}),
    "b2-s1024-h8-d128-block64-causal": (2, 1024, 8, 8, 128, BF16, dict(granularity="blockwise", block_size=64),
                                        dict(causal=True)),
    "gqa-s1000-d128-block128-causal": (1, 1000, 16, 2, 128, BF16, dict(granularity="blockwise", block_size=128),
                                       dict(causal=True)),
    "s777-d64-tensorwise-fp16": (2, 777, 8, 4, 64, FP16, {}, {}),
    "s512-d256-block64-window": (1, 512, 4, 4, 256, BF16, dict(granularity="blockwise", block_size=64),
                                 dict(window_size=(128, 0))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_fp8_snr(case, record_property):
    """fp8 forward and backward against the bf16 TRITON path and the float64 reference."""
    b, s, hq, hk, d, dtype, cfg_kw, kw = GPU_CASES[case]
    cfg = Float8QuantConfig(**cfg_kw)
    q, k, v, g = (randn(sh, dtype) for sh in [(b, s, hq, d), (b, s, hk, d), (b, s, hk, d), (b, s, hq, d)])
    turbo.GlobalBackendManager.set_attn_backend("TRITON")
    try:
        runs = {}
        for name, fn in (("fp8", turbo.ops.flash_attn_fp8_func), ("bf16", turbo.ops.flash_attn_func)):
            xs = [x.cuda().requires_grad_() for x in (q, k, v)]
            extra = dict(fp8_config=cfg) if name == "fp8" else {}
            out, lse = fn(*xs, return_lse=True, **kw, **extra)
            out.backward(g.cuda())
            runs[name] = [out.detach(), lse] + [x.grad for x in xs]
        assert turbo.explain("attention", q.cuda(), k.cuda(), v.cuda(), **kw).backend == "TRITON"
    finally:
        turbo.GlobalBackendManager.set_attn_backend(None)
    names = ("out", "lse", "dq", "dk", "dv")
    vs_bf16 = {n: _snr(x, r) for n, x, r in zip(names, runs["fp8"], runs["bf16"])}
    ro, rl, rg = ref_grads(q, k, v, g, causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)))
    vs_ref = {n: _snr(x, r) for n, x, r in zip(names, runs["fp8"], (ro, rl, *rg))}
    for label, vals in (("bf16", vs_bf16), ("ref", vs_ref)):
        for n, db in vals.items():
            record_property(f"snr_{n}_vs_{label}_db", round(db, 1))
    print(f"{case}: SNR dB vs bf16 TRITON {({n: round(x, 1) for n, x in vs_bf16.items()})}, "
          f"vs float64 {({n: round(x, 1) for n, x in vs_ref.items()})}")
    assert runs["fp8"][0].dtype == dtype
    assert min(vs_bf16.values()) >= 20 and min(vs_ref.values()) >= 20, (vs_bf16, vs_ref)
