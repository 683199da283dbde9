"""gemm_fp8 saves its activation quantised for the backward, not a bf16 copy.

The forward keeps only op(a)^T quantised along M (the wgrad's reduction dim) plus its scale;
the wgrad takes it pre-quantised (its key carries the fp8 dtype as a_dtype/b_dtype). Checked
here, on the CPU unless marked ``gpu``:

* the saved operand is bit-identical to what the wgrad's backend quantised from the bf16 ``a``
  before, so the gradients are too (they are compared with float64 products of the same
  quantised operands, for every granularity and layout, odd sizes);
* what autograd keeps (saved_tensors_hooks) in eager and in torch.compile(fullgraph=True):
  an fp8 tensor of a's size and a small scale, never a high-precision copy of a;
* keys (a pre-quantised operand's key round-trips through the tuning-DB codec), autotuning of
  such a key, and ``tuning.keys`` producing the key the backward looks up;
* on a GPU: peak memory of Linear fwd+bwd, fp8 <= bf16.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch.low_precision import Float8QuantConfig, QuantizedTensor, ScalingGranularity as G
from turbo_dispatch.low_precision import dequantize, quantize

from turbo_dispatch.ops.gemm_fp8_step import wgrad_operand
from turbo_dispatch.ops.gemm_grads import fp8_grads
from turbo_dispatch.ops.gemm_problem import GemmFp8Problem, gemm_fp8_problem
from turbo_dispatch.ops.gemm_spec import GEMM_FP8

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {
    "tensorwise": Float8QuantConfig(granularity=G.TENSORWISE),
    "rowwise": Float8QuantConfig(granularity=G.ROWWISE),
    "blockwise128": Float8QuantConfig(granularity=G.BLOCKWISE, block_size=128),
    "blockwise32-hybrid": Float8QuantConfig(format="hybrid", granularity=G.BLOCKWISE, block_size=32),
    "rowwise-hybrid": Float8QuantConfig(format="hybrid", granularity=G.ROWWISE),
}
LAYOUTS = list(itertools.product([False, True], [False, True]))
M, K, N = 131, 256, 200  # odd M (a partial 1x128 run along M in the wgrad), K a block multiple


def _inputs(trans_a: bool, trans_b: bool, dtype=torch.float32, device="cpu"):
    a = torch.randn((K, M) if trans_a else (M, K), dtype=dtype, device=device) * 3
    b = torch.randn((N, K) if trans_b else (K, N), dtype=dtype, device=device)
    a[0].zero_()  # a zero row/column: scale 1 groups
    return a.requires_grad_(), b.requires_grad_()


def _ref_mm8(cfg: Float8QuantConfig):
    """One fp8 GEMM as the backends define it: each high-precision operand quantised along its K
    with the role's dtype and tiles, then the float64 product of the dequantised values."""
    def mm8(x, y, ta, tb, od, xf, yf, x2d, y2d):
        assert not isinstance(x, QuantizedTensor) and not isinstance(y, QuantizedTensor)
        qx = quantize(x.detach(), xf, cfg.granularity, axis=0 if ta else 1, block_size=cfg.block_size, block_2d=x2d)
        qy = quantize(y.detach(), yf, cfg.granularity, axis=1 if tb else 0, block_size=cfg.block_size, block_2d=y2d)
        dx, dy = dequantize(qx, torch.float64), dequantize(qy, torch.float64)
        return (dx.t() if ta else dx) @ (dy.t() if tb else dy)
    return mm8


@pytest.mark.parametrize("trans_a,trans_b", LAYOUTS)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_saved_operand_is_what_the_wgrad_quantised(recipe, trans_a, trans_b):
    """Bit for bit: the saved [K, M] operand is the transpose of quantising a along M, which is what
    every backend's wgrad did with the bf16 a (the adapters' quantisers agree bit for bit)."""
    cfg = RECIPES[recipe]
    a, _ = _inputs(trans_a, trans_b, dtype=torch.bfloat16)
    saved = wgrad_operand(a.detach(), trans_a, cfg)
    old = quantize(a.detach(), cfg.format.fwd_dtype(), cfg.granularity, axis=1 if trans_a else 0,
                   block_size=cfg.block_size)
    old_kmajor = old if trans_a else old.t()
    assert saved.data.shape == (K, M) and saved.data.is_contiguous() and saved.axis == 1
    assert torch.equal(saved.data.view(torch.uint8), old_kmajor.data.view(torch.uint8))
    assert torch.equal(saved.scale, old_kmajor.scale)


@pytest.mark.parametrize("trans_a,trans_b", LAYOUTS)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_grads_match_float64_of_the_quantised_operands(recipe, trans_a, trans_b):
    """dA and dB of the op (which now saves a quantised) against today's recipe computed in float64:
    the same quantised operands, so only the fp32 accumulation of the CPU emulation differs."""
    cfg = RECIPES[recipe]
    a, b = _inputs(trans_a, trans_b)
    grad = torch.randn(M, N)
    out = turbo.ops.gemm_fp8(a, b, trans_a=trans_a, trans_b=trans_b, config=cfg)
    out.backward(grad)
    ref_a, ref_b = fp8_grads(_ref_mm8(cfg), a.detach(), b.detach(), grad, trans_a, trans_b,
                             cfg.format.fwd_dtype(), cfg.format.bwd_dtype(), cfg.granularity, True, True)
    for name, got, ref in (("dA", a.grad, ref_a), ("dB", b.grad, ref_b)):
        assert got.shape == ref.shape and got.dtype == torch.float32
        err = float((got.double() - ref).norm() / ref.norm())
        assert err < 1e-6, f"{name}: relative error {err:.2e} vs the float64 product of the quantised operands"


@pytest.mark.parametrize("need", ["both", "a_only", "b_only"])
def test_grads_when_one_operand_needs_none(need):
    """Only what the needed gradients read is kept, and each gradient is still right."""
    cfg = RECIPES["rowwise"]
    a, b = _inputs(False, True)
    a.requires_grad_(need != "b_only")
    b.requires_grad_(need != "a_only")
    grad = torch.randn(M, N)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = turbo.ops.gemm_fp8(a, b, trans_b=True, config=cfg)
    out.backward(grad)
    ref_a, ref_b = fp8_grads(_ref_mm8(cfg), a.detach(), b.detach(), grad, False, True,
                             cfg.format.fwd_dtype(), cfg.format.bwd_dtype(), cfg.granularity, True, True)
    assert [t.dtype for t in saved] == {"both": [E4, torch.float32, torch.float32], "a_only": [torch.float32],
                                        "b_only": [E4, torch.float32]}[need]
    if need != "b_only":
        assert float((a.grad.double() - ref_a).norm() / ref_a.norm()) < 1e-6
    if need != "a_only":
        assert float((b.grad.double() - ref_b).norm() / ref_b.norm()) < 1e-6


def _assert_only_quantised_a(saved: list[tuple[torch.dtype, tuple]], a: torch.Tensor, b: torch.Tensor) -> None:
    high = (torch.bfloat16, torch.float16, torch.float32)
    a_sized_hp = [s for s in saved if s[0] in high and s[1] in (tuple(a.shape), tuple(a.shape)[::-1])]
    assert not a_sized_hp, f"a high-precision tensor of a's size was saved: {saved}"
    fp8 = [s for s in saved if s[0] in (E4, E5)]
    assert fp8 == [(E4, (K, M))], saved
    small = [s for s in saved if s[0] in high and s[1] != tuple(b.shape)]
    assert all(torch.Size(s[1]).numel() <= K * M // 32 for s in small), f"only small scales besides b: {saved}"


def _collect_saved(fn):
    saved: list[tuple[torch.dtype, tuple]] = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise128"])
def test_eager_saves_fp8_not_bf16(recipe):
    cfg = RECIPES[recipe]
    a, b = _inputs(False, True, dtype=torch.bfloat16)
    layer = turbo.modules.Linear(K, N, bias=False, dtype=torch.bfloat16, fp8_config=cfg)
    x = a.detach().requires_grad_()
    out, saved = _collect_saved(lambda: layer(x))
    _assert_only_quantised_a(saved, x, layer.weight)
    out.float().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise128"])
def test_compiled_saves_fp8_not_bf16(recipe, fresh_dynamo):
    """torch.compile(fullgraph=True): the custom op's setup saves the same fp8 operand (through
    turbo_dispatch::fp8_quantize_rows) and the grads equal the eager ones bit for bit."""
    cfg = RECIPES[recipe]
    a, b = _inputs(False, True, dtype=torch.bfloat16)
    grad = torch.randn(M, N, dtype=torch.bfloat16)
    fn = lambda x, y: turbo.ops.gemm_fp8(x, y, trans_b=True, config=cfg)  # noqa: E731
    fn(a, b).backward(grad)
    eager = (a.grad.clone(), b.grad.clone())
    a.grad = b.grad = None
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out, saved = _collect_saved(lambda: compiled(a, b))
    _assert_only_quantised_a(saved, a, b)
    out.backward(grad)
    assert torch.equal(a.grad, eager[0]) and torch.equal(b.grad, eager[1])


def test_prequantised_key_round_trips_and_names_fp8():
    from turbo_dispatch.tuning.codec import decode_key, encode_key

    cfg = RECIPES["blockwise128"]
    a = torch.randn(M, K)
    qa = wgrad_operand(a, False, cfg)
    grad = torch.randn(M, N, dtype=torch.bfloat16)
    p = gemm_fp8_problem(qa, grad, False, False, torch.bfloat16, E4, E4, cfg.granularity, 128, False, False)
    assert (p.m, p.n, p.k, p.a_dtype, p.b_dtype) == (K, N, M, E4, torch.bfloat16)
    enc = encode_key(p)
    assert enc["a_dtype"] == "e4m3" and enc["b_dtype"] == "bf16"
    assert decode_key(GemmFp8Problem, enc) == p


def test_prequantised_operand_mismatch_is_a_clear_error():
    cfg = RECIPES["rowwise"]
    qa = wgrad_operand(torch.randn(M, K), False, cfg)  # [K, M] along dim 1
    grad = torch.randn(M, N)
    with pytest.raises(ValueError, match="along dim 0, but this GEMM's reduction dim of a is dim 1"):
        gemm_fp8_problem(qa.t(), torch.randn(K, N), False, False, torch.float32, E4, E4, G.ROWWISE, None,
                         False, False)
    with pytest.raises(ValueError, match="pre-quantised a is"):
        gemm_fp8_problem(qa, grad, False, False, torch.float32, E5, E4, G.ROWWISE, None, False, False)
    with pytest.raises(TypeError, match="out_dtype is required"):
        gemm_fp8_problem(qa, grad, False, False, None, E4, E4, G.ROWWISE, None, False, False)


def test_training_step_keys_carry_the_prequantised_wgrad():
    from turbo_dispatch import presets
    from turbo_dispatch.tuning import keys as K_

    shape = presets.LinearShape("t", 256, 128, 384)
    ks = [p for op, p in K_._linear_fp8_keys(shape, torch.bfloat16, "blockwise")]
    assert len(ks) == 3
    wgrad = ks[2]  # Linear: y = x @ W^T, so dW [N, K] = dy^T @ x, x arriving as the saved [K, M] fp8
    assert (wgrad.a_dtype, wgrad.b_dtype, wgrad.b_fp8) == (torch.bfloat16, E4, E4)
    assert (wgrad.m, wgrad.n, wgrad.k, wgrad.trans_a, wgrad.trans_b) == (shape.n, shape.k, shape.m, True, True)


def test_autotune_profiles_a_prequantised_key():
    """make_inputs / reference of gemm_fp8 build pre-quantised operands for such keys."""
    turbo.GlobalBackendManager.set_auto_tune(True)
    cfg = RECIPES["rowwise"]
    a, b = _inputs(False, True)
    turbo.ops.gemm_fp8(a, b, trans_b=True, config=cfg).sum().backward()
    qa = wgrad_operand(a.detach(), False, cfg)
    p = gemm_fp8_problem(qa, torch.randn(M, N), False, False, torch.float32, E4, E4, G.ROWWISE, None,
                         False, False)
    decision = turbo.explain("gemm_fp8", a, b, trans_b=True, config=cfg)
    assert decision is not None
    from turbo_dispatch.resolver import resolve

    d = resolve(GEMM_FP8, p)
    assert d.source in ("autotune", "tuned-db"), d


# -- GPU: peak memory of Linear fwd+bwd -------------------------------------------------------------
def _linear_peak_mib(fp8_config, m: int, k: int, n: int) -> float:
    """Peak allocated over fwd+bwd, above what is live before, with the Linear's input an
    intermediate activation (as in a network): only what autograd saves keeps it alive, so a bf16
    copy saved for the backward costs its full size, the fp8 one half of it."""
    layer = turbo.modules.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16, fp8_config=fp8_config)
    x0 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step():
        layer(x0 * 1.0).backward(dy)  # x0 * 1.0: the activation, referenced by nothing else

    step()  # warm-up: workspaces, decisions, Triton compiles
    x0.grad = None
    layer.weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


#: The one (recipe, backend) whose peak is known to exceed the bar, and why. A strict xfail: if it
#: stops exceeding it, the test fails and this entry must go. (H200: TORCH blockwise 387
#: MiB against bf16's 224; TORCH tensorwise and rowwise 224.0 and 224.1, within the bar, so they are
#: asserted like the others. On 2026-11-23 they measured 320 MiB and were xfailed unconditionally.)
_PEAK_OVER_BF16 = {
    ("blockwise128", "TORCH"): "TORCH's reference blockwise quantizer holds float32 temporaries of the gradient",
}


def _peak_cases():
    for backend in ("TORCH", "TRITON", "CUBLASLT"):
        for recipe in ("tensorwise", "rowwise", "blockwise128"):
            reason = _PEAK_OVER_BF16.get((recipe, backend))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(recipe, backend, marks=marks, id=f"{recipe}-{backend}")


@pytest.mark.gpu
@pytest.mark.parametrize(("recipe", "backend"), list(_peak_cases()))
def test_gpu_fp8_linear_peak_memory_not_above_bf16(recipe, backend):
    """The issue's bar: the fp8 Linear's fwd+bwd peak is no higher than the bf16 Linear's."""
    m, k, n = 8192, 4096, 4096
    bf16 = _linear_peak_mib(None, m, k, n)
    torch.cuda.empty_cache()
    turbo.GlobalBackendManager.set_gemm_backend(backend, precision="fp8")
    fp8 = _linear_peak_mib(RECIPES[recipe], m, k, n)
    print(f"Linear {m}x{k}x{n} fwd+bwd peak: bf16 {bf16:.1f} MiB, fp8 {recipe} on {backend} {fp8:.1f} MiB")
    # Here the peak falls after the Linear's backward (activation grad, input grad, output, weight
    # grad), which both recipes share; fp8 may exceed it only by its scale tensors (H100: +0 MiB
    # tensorwise/rowwise, +3-4 MiB blockwise of 224 MiB).
    assert fp8 <= bf16 * 1.02, f"fp8 {recipe} on {backend}: peak {fp8:.1f} MiB > bf16 {bf16:.1f} MiB + 2%"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TORCH", "TRITON", "CUBLASLT"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise128"])
@pytest.mark.parametrize("trans_a,trans_b", LAYOUTS)
def test_gpu_prequantised_wgrad_matches_float64(backend, recipe, trans_a, trans_b):
    """Every fp8 adapter takes the saved operand in the wgrad: the gradient equals (SNR) the float64
    product of the same quantised operands."""
    cfg = RECIPES[recipe]
    m, k, n = 264, 384, 512
    a = torch.randn((k, m) if trans_a else (m, k), device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    qa = wgrad_operand(a, trans_a, cfg)
    p = (gemm_fp8_problem(grad, qa, True, True, torch.float32, E4, E4, cfg.granularity, cfg.block_size,
                          False, False) if trans_b else
         gemm_fp8_problem(qa, grad, False, False, torch.float32, E4, E4, cfg.granularity, cfg.block_size,
                          False, False))
    from turbo_dispatch.registry import get_registry

    entry = get_registry().get("gemm_fp8", backend)
    reason = entry.check(p, "cuda")
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    args = (grad, qa) if trans_b else (qa, grad)
    out = entry.adapter.run(p, *args)
    qg = quantize(grad, E4, cfg.granularity, axis=0, block_size=cfg.block_size)
    dqa = dequantize(qa, torch.float64)
    ref = (dqa @ dequantize(qg, torch.float64)) if not trans_b else (dequantize(qg, torch.float64).t() @ dqa.t())
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 1e-3, (backend, p, err)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise128"])
def test_opcheck_prequantised_custom_ops(recipe):
    """The compile path's two ops: fp8_quantize_rows (fake shapes = real) and gemm_fp8_raw with a
    pre-quantised operand passed as (data, scale)."""
    from torch.library import opcheck

    # test_schema is left out: its mutation check multiplies tensors, which fp8 on the CPU lacks.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    cfg = RECIPES[recipe]
    a = torch.randn(M, K)
    opcheck(torch.ops.turbo_dispatch.fp8_quantize_rows.default, (a.t(), E4, cfg.granularity.value, cfg.block_size),
            test_utils=utils)
    qa = wgrad_operand(a, False, cfg)
    grad = torch.randn(M, N)
    args = (grad, qa.data, True, True, torch.float32, E4, E4, cfg.granularity.value, cfg.block_size, False, False,
            None, qa.scale)
    opcheck(torch.ops.turbo_dispatch.gemm_fp8_raw.default, args, test_utils=utils)
    out = torch.ops.turbo_dispatch.gemm_fp8_raw(*args)
    ref = fp8_grads(_ref_mm8(cfg), a, None, grad, False, True, E4, E4, cfg.granularity, False, True,
                    b_dtype=torch.float32)[1]
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-6
