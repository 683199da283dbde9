"""Correctness of turbo_dispatch.ops.flash_attn_func / flash_attn_varlen_func (TORCH and CUDNN).

Reference: the naive softmax(q k^T * scale + mask) v in float64 on the CPU, written here
independently of the library (bottom-right aligned masks, FlashAttention semantics), with
gradients from torch.autograd on float64 copies. Rows that may attend no key output 0, get zero
gradients and an lse of -inf. Inputs and output gradients are random (never zero).

Gates: fp32 on the CPU, relative error ||x - ref|| / ||ref|| <= 1e-5 for out, lse, dq, dk, dv;
bf16/fp16 on GPUs, SNR = 10 log10(||ref||^2 / ||ref - x||^2) >= 40 dB for each of them.
"""
from __future__ import annotations

import math

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch import BackendUnsupportedError
from turbo_dispatch.ops import attention as attn_mod
from turbo_dispatch.backends.torch import attention as torch_attn
from turbo_dispatch.ops._common import rel_error, snr_db

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
#: The largest entry a gradient may have where the reference's is exactly zero (rounding only;
#: the tests' gradients are of order 1).
ZERO_GRAD_TOL = 1e-3
flash_attn_func = turbo.ops.flash_attn_func
flash_attn_varlen_func = turbo.ops.flash_attn_varlen_func


# -- reference -------------------------------------------------------------------------------------
def randn(shape, dtype=FP32, device="cpu", requires_grad=False):
    x = torch.randn(shape, device=device)
    x = torch.where(x == 0, torch.ones_like(x), x).to(dtype)
    return x.requires_grad_(requires_grad)


def ref_attention(q, k, v, scale=None, causal=False, window=(-1, -1), sink=None):
    """float64 out [B, Sq, Hq, Dv] and lse [B, Hq, Sq] of dense attention; differentiable. A
    ``sink`` [Hq] is one more, value-less, column of every row's softmax (GPT-OSS)."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    k = k.repeat_interleave(hq // hk, dim=2)
    v = v.repeat_interleave(hq // hk, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diag = i + sk - sq
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        allowed &= j <= diag + right
    if left >= 0:
        allowed &= j >= diag - left
    rows = allowed.any(-1, keepdim=True)
    masked = scores.masked_fill(~allowed, float("-inf"))
    if sink is not None:
        masked = torch.cat([masked, sink[None, :, None, None].expand(b, hq, sq, 1)], -1)
        return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(masked, -1)[..., :-1], v), \
            torch.logsumexp(masked.detach(), -1)
    lse = torch.logsumexp(masked.detach(), -1)
    probs = torch.softmax(masked.masked_fill(~rows, 0.0), -1) * rows
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def ref_grads(q, k, v, grad, sink=None, **kw):
    """float64 (out, lse, [dq, dk, dv]) of ``ref_attention``; with a ``sink``, dsink ends the list."""
    leaves = [x.detach().cpu().double().requires_grad_() for x in (q, k, v) + ((sink,) if sink is not None else ())]
    out, lse = ref_attention(*leaves[:3], sink=leaves[3] if sink is not None else None, **kw)
    out.backward(grad.detach().cpu().double())
    return out.detach(), lse, [x.grad for x in leaves]


def run_op(fn, q, k, v, grad, *args, **kw):
    """out, lse (or None) and (dq, dk, dv) of one call, inputs as fresh leaves."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    result = fn(*leaves, *args, **kw)
    out, lse = result if isinstance(result, tuple) else (result, None)
    out.backward(grad)
    return out.detach(), lse, [x.grad for x in leaves]


def assert_close(name, got, ref, dtype):
    assert got is not None and got.shape == ref.shape, (name, getattr(got, "shape", None), ref.shape)
    assert torch.isfinite(got).all(), f"{name} has NaN/inf"
    if dtype == FP32:
        tol = 1e-5 if got.device.type == "cpu" else 1e-4  # GPU kernels sum in other orders
        err = rel_error(got.cpu(), ref)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"
    elif not ref.any():
        # An exactly zero gradient (say dq where every row attends one key) has no scale for an SNR:
        # the kernel's rounding must stay far below any real gradient's size instead.
        worst = float(got.abs().max()) if got.numel() else 0.0
        assert worst <= ZERO_GRAD_TOL, f"{name}: {worst:.2e} where the reference is exactly 0"
    else:
        db = snr_db(got.cpu(), ref)
        assert db >= 40.0, f"{name}: SNR {db:.1f} dB < 40 dB"


def assert_result(result, ref, dtype, with_lse):
    """``run_op``'s (out, lse, grads) against the float64 reference's (out, lse, grads): out, the
    lse where the call asked for it, and every gradient."""
    (out, lse, grads), (ref_out, ref_lse, ref_g) = result, ref
    assert_close("out", out.float(), ref_out, dtype)
    if with_lse:
        assert_lse(lse, ref_lse, dtype)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_g):
        assert_close(name, g.float(), r, dtype)


def assert_lse(got, ref, dtype):
    """lse: same -inf rows, finite values within the gate (relative error, or SNR on GPUs)."""
    assert got.dtype == torch.float32 and got.shape == ref.shape
    got = got.cpu().double()
    assert torch.equal(torch.isinf(got), torch.isinf(ref)), "rows with -inf lse differ"
    assert (got[torch.isinf(got)] < 0).all()
    finite = torch.isfinite(ref)
    assert_close("lse", got[finite], ref[finite], dtype if dtype == FP32 else BF16)


# -- dense cases -----------------------------------------------------------------------------------
#: id -> (B, Sq, Sk, Hq, Hkv, Dqk, Dv, kwargs)
DENSE = {
    "plain": (2, 17, 17, 4, 4, 32, 32, {}),
    "causal": (2, 17, 17, 4, 4, 32, 32, dict(causal=True)),
    "sq<sk": (2, 13, 29, 4, 4, 32, 32, {}),
    "sq<sk-causal": (2, 13, 29, 4, 4, 32, 32, dict(causal=True)),
    "sq>sk-causal": (1, 29, 13, 2, 2, 16, 16, dict(causal=True)),  # rows 0..15 attend nothing
    "sq>sk": (1, 29, 13, 2, 2, 16, 16, {}),
    "gqa-causal": (2, 19, 23, 4, 2, 32, 32, dict(causal=True)),
    "mqa": (2, 11, 11, 4, 1, 16, 16, {}),
    "mqa-window": (1, 21, 21, 4, 1, 16, 16, dict(window_size=(3, 0))),
    "window30": (2, 21, 21, 2, 2, 16, 16, dict(window_size=(3, 0))),
    "window22": (2, 21, 21, 2, 2, 16, 16, dict(window_size=(2, 2))),
    "window22-sq<sk": (1, 9, 21, 2, 2, 16, 16, dict(window_size=(2, 2))),
    "window-left-only": (1, 15, 15, 2, 2, 16, 16, dict(window_size=(4, -1))),
    "window-right-only-sq>sk": (1, 20, 7, 2, 2, 16, 16, dict(window_size=(-1, 3))),
    "causal+window": (1, 17, 25, 4, 2, 16, 16, dict(causal=True, window_size=(5, 7))),  # causal overrides right
    "dv!=dqk": (2, 15, 15, 4, 4, 48, 32, dict(causal=True)),
    "mla-192/128": (1, 9, 9, 2, 2, 192, 128, dict(causal=True)),
    "head-dim-256": (1, 7, 9, 2, 1, 256, 256, {}),
    "scale": (1, 10, 12, 2, 2, 8, 8, dict(softmax_scale=0.37)),
    "sq=1-causal": (3, 1, 9, 2, 2, 16, 16, dict(causal=True)),
}


def ref_kwargs(kw):
    return dict(scale=kw.get("softmax_scale"), causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)))


@pytest.mark.parametrize("case", list(DENSE))
def test_dense_fwd_bwd_lse(case):
    b, sq, sk, hq, hk, d, dv, kw = DENSE[case]
    q, k, v = randn((b, sq, hq, d)), randn((b, sk, hk, d)), randn((b, sk, hk, dv))
    grad = randn((b, sq, hq, dv))
    ref_out, ref_lse, ref_g = ref_grads(q, k, v, grad, **ref_kwargs(kw))
    out, lse, grads = run_op(flash_attn_func, q, k, v, grad, return_lse=True, **kw)
    assert out.shape == (b, sq, hq, dv)
    assert_close("out", out, ref_out, FP32)
    assert_lse(lse, ref_lse, FP32)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_g):
        assert_close(name, g, r, FP32)
    # Without return_lse and without grad: the same output.
    with torch.no_grad():
        plain = flash_attn_func(q, k, v, **kw)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)


@pytest.mark.parametrize("case", ["sq>sk-causal", "window22-sq<sk", "causal+window", "window-right-only-sq>sk",
                                  "gqa-causal"])
def test_lse_in_small_blocks(case, monkeypatch):
    """The lse pass in blocks of a few rows, each reading only the keys its rows may attend."""

    monkeypatch.setattr(torch_attn, "_LSE_BLOCK", 1)  # one query row per block
    b, sq, sk, hq, hk, d, dv, kw = DENSE[case]
    q, k, v = randn((b, sq, hq, d)), randn((b, sk, hk, d)), randn((b, sk, hk, dv))
    _, ref_lse = ref_attention(q.double(), k.double(), v.double(), **ref_kwargs(kw))
    _, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
    assert_lse(lse, ref_lse, FP32)


def test_empty_rows_are_zero_with_zero_grads():
    q, k, v = randn((1, 8, 2, 16)), randn((1, 3, 2, 16)), randn((1, 3, 2, 16))
    out, lse, (dq, _, _) = run_op(flash_attn_func, q, k, v, randn((1, 8, 2, 16)), causal=True, return_lse=True)
    assert (out[:, :5] == 0).all() and (dq[:, :5] == 0).all()
    assert torch.isneginf(lse[:, :, :5]).all() and torch.isfinite(lse[:, :, 5:]).all()


def test_non_contiguous_inputs():
    """q, k, v as slices of one packed qkv tensor (strided heads), as in fused QKV projections."""
    qkv = randn((2, 13, 3, 4, 16))
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    grad = randn((2, 13, 4, 16))
    ref_out, _, ref_g = ref_grads(q, k, v, grad, causal=True)
    out, _, grads = run_op(flash_attn_func, q, k, v, grad, causal=True)
    assert_result((out, None, grads), (ref_out, None, ref_g), FP32, False)


def test_dropout_runs_and_backward_matches_its_mask():
    """dropout_p > 0 (TORCH: SDPA's dropout): different from p=0, reproducible under one seed,
    and the eager backward is SDPA's own, i.e. uses the mask the forward drew (checked against
    torch's SDPA with the same seed)."""
    q, k, v = randn((1, 16, 2, 16)), randn((1, 16, 2, 16)), randn((1, 16, 2, 16))
    grad = randn((1, 16, 2, 16))
    torch.manual_seed(7)
    out, _, grads = run_op(flash_attn_func, q, k, v, grad, dropout_p=0.3)
    torch.manual_seed(7)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in leaves), dropout_p=0.3)
    want.transpose(1, 2).backward(grad)
    assert torch.equal(out, want.transpose(1, 2).detach())
    for g, w in zip(grads, leaves):
        assert torch.equal(g, w.grad)
    assert not torch.allclose(out, flash_attn_func(q, k, v))


# -- varlen ----------------------------------------------------------------------------------------
#: id -> (lens_q, lens_k, Hq, Hkv, Dqk, Dv, max_pad, kwargs); max_pad is added to the true max.
VARLEN = {
    "plain": ([5, 1, 7, 3], [5, 1, 7, 3], 4, 4, 16, 16, 0, {}),
    "causal-sq!=sk": ([5, 1, 7, 3], [9, 4, 7, 2], 4, 2, 16, 16, 0, dict(causal=True)),
    "window-mqa": ([6, 11, 2], [6, 11, 2], 4, 1, 16, 16, 3, dict(window_size=(2, 1))),
    "dv!=dqk-window30": ([4, 9], [7, 9], 2, 2, 48, 32, 0, dict(window_size=(3, 0))),
    "empty-k-and-q": ([3, 0, 4], [0, 2, 5], 2, 2, 16, 16, 1, dict(causal=True)),
}


def cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def varlen_reference(q, k, v, grad, cu_q, cu_k, kw, sink=None):
    """float64 (out [Tq, Hq, Dv], lse [Hq, Tq], [dq, dk, dv(, dsink)]) of packed sequences, each
    attended on its own by ``ref_grads``; a sequence without queries contributes nothing."""
    ref_out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    ref_lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    ref_g = [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v) + ((sink,) if sink is not None else ())]
    for b in range(len(cu_q) - 1):
        sq_, sk_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] == cu_q[b]:
            continue
        o, l_, g = ref_grads(q[None, sq_], k[None, sk_], v[None, sk_], grad[None, sq_], sink=sink, **ref_kwargs(kw))
        ref_out[sq_], ref_lse[:, sq_] = o[0], l_[0]
        ref_g[0][sq_] = g[0][0]
        ref_g[1][sk_] += g[1][0]
        ref_g[2][sk_] += g[2][0]
        if sink is not None:
            ref_g[3] += g[3]
    return ref_out, ref_lse, ref_g


@pytest.mark.parametrize("case", list(VARLEN))
def test_varlen_matches_per_sequence_reference(case):
    lens_q, lens_k, hq, hk, d, dv, pad, kw = VARLEN[case]
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = randn((tq, hq, d)), randn((tk, hk, d)), randn((tk, hk, dv))
    grad = randn((tq, hq, dv))
    out, lse, grads = run_op(flash_attn_varlen_func, q, k, v, grad, cu_q, cu_k, max(lens_q) + pad,
                             max(lens_k) + pad, return_lse=True, **kw)
    assert out.shape == (tq, hq, dv) and lse.shape == (hq, tq)
    ref_out, ref_lse, ref_g = varlen_reference(q, k, v, grad, cu_q, cu_k, kw)
    assert_close("out", out, ref_out, FP32)
    assert_lse(lse, ref_lse, FP32)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_g):
        assert_close(name, g, r, FP32)


def test_varlen_key_uses_host_facts_only():
    q = randn((12, 2, 16))
    key_a = turbo.explain("attention", q, q, q, cu([5, 7]), cu([5, 7]), 8, 8).key
    key_b = turbo.explain("attention", q, q, q, cu([1, 11]), cu([6, 6]), 8, 8).key
    assert key_a == key_b and "varlen=1" in key_a and "total_q=12" in key_a and "seqlen_q=8" in key_a


# -- the explicit forward/backward protocol and the problem key -------------------------------------------
def test_explicit_backward_protocol_matches(monkeypatch):
    """Adapters without native autograd go through _AttentionFunction, which calls the forward's
    adapter's backward (TORCH's: recomputation); results must match the reference."""
    from turbo_dispatch.backends.torch.attention import TorchAttention

    monkeypatch.setattr(TorchAttention, "native_autograd", False)
    calls = []
    original = TorchAttention.backward
    monkeypatch.setattr(TorchAttention, "backward", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    q, k, v = randn((2, 9, 4, 16)), randn((2, 12, 2, 16)), randn((2, 12, 2, 8))
    grad = randn((2, 9, 4, 8))
    ref_out, ref_lse, ref_g = ref_grads(q, k, v, grad, causal=True, window=(4, -1))
    out, lse, grads = run_op(flash_attn_func, q, k, v, grad, causal=True, window_size=(4, -1), return_lse=True)
    assert calls == [1]
    assert not lse.requires_grad
    assert_close("out", out, ref_out, FP32)
    assert_lse(lse, ref_lse, FP32)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_g):
        assert_close(name, g, r, FP32)


def test_problem_key_normalisation():
    q = randn((1, 6, 2, 8))
    k = randn((1, 10, 2, 8))
    p = turbo.explain("attention", q, k, k, causal=True, window_size=(20, 3)).problem
    assert (p.causal, p.window_left, p.window_right) == (True, -1, 0)  # causal overrides right; 20 >= Sk
    p = turbo.explain("attention", q, k, k, window_size=(-1, 0)).problem
    assert p.causal  # a (-1, 0) window is causal
    p = turbo.explain("attention", q, k, k, window_size=(2, 5)).problem
    assert (p.causal, p.window_left, p.window_right) == (False, 2, -1)  # right >= Sq - 1 excludes nothing
    p = turbo.explain("attention", randn((1, 1, 2, 8)), k, k, causal=True).problem
    assert not p.causal  # a single bottom-right query attends every key
    assert math.isclose(p.softmax_scale, 8 ** -0.5)


def test_autotune_cpu_dense_and_varlen():
    """The op spec's make_inputs/reference/check work: autotuning on the CPU picks TORCH."""
    turbo.GlobalBackendManager.set_attn_backend(auto_tune=True)
    q, k, v = randn((1, 9, 2, 16)), randn((1, 9, 2, 16)), randn((1, 9, 2, 16))
    d = turbo.explain("attention", q, k, v, causal=True)
    assert d.backend == "TORCH" and d.source == "autotune", d
    c = cu([4, 5])
    d = turbo.explain("attention", q[0], k[0], v[0], c, c, 5, 5, causal=True)
    assert d.backend == "TORCH" and d.source == "autotune", d


def test_cudnn_supports_reasons():
    """CUDNN's supports() names a reason for each case it refuses (checked on synthetic keys, no GPU)."""
    from turbo_dispatch.backends.cudnn.attention import CudnnAttention

    base = attn_mod.AttentionProblem(2, 256, 256, 512, 512, 8, 8, 128, 128, BF16, False, -1, -1, 0.0,
                                     128 ** -0.5, False, False, False, "cuda")
    adapter = CudnnAttention()
    assert adapter.supports(base) is None
    assert adapter.supports(base._replace(causal=True, window_right=0)) is None
    assert adapter.supports(base._replace(return_lse=True)) is None  # through the kernel's aten op
    assert "lse from the kernel" in adapter.describe(base._replace(return_lse=True))
    refused = {
        "platform": base._replace(platform="cpu"),
        "bf16/fp16": base._replace(dtype=FP32),
        "head dim": base._replace(head_dim_qk=256, head_dim_v=256),
        "multiples of 8": base._replace(head_dim_qk=60, head_dim_v=60),
        "v head dim": base._replace(head_dim_v=64),
        "varlen": base._replace(varlen=True),
        "sliding window": base._replace(window_left=3, window_right=0, causal=True),
        "bottom-right": base._replace(seqlen_q=128, causal=True, window_right=0),
        "dropout": base._replace(dropout_p=0.1),
        "deterministic": base._replace(deterministic=True),
    }
    for word, p in refused.items():
        reason = adapter.supports(p)
        assert reason is not None and word in reason, (word, reason)


def test_cudnn_gqa_from_torch_2_11(monkeypatch):
    """GQA/MQA goes to cuDNN on the torch releases the GPU grid checked it on, and is refused,
    naming the release, before them."""
    from turbo_dispatch.backends.cudnn import attention as cudnn_attention
    from turbo_dispatch.backends.cudnn.attention import CudnnAttention

    gqa = attn_mod.AttentionProblem(2, 256, 256, 512, 512, 8, 2, 128, 128, BF16, True, -1, 0, 0.0,
                                    128 ** -0.5, False, True, False, "cuda")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert CudnnAttention().supports(gqa) is None
    assert CudnnAttention().supports(gqa._replace(heads_kv=1)) is None
    monkeypatch.setattr(torch, "__version__", "2.10.1")
    reason = CudnnAttention().supports(gqa)
    assert "GQA/MQA" in reason and cudnn_attention.GQA_FROM_TORCH in reason and "2.10.1" in reason


def test_cudnn_pinned_on_cpu_is_an_error():
    turbo.GlobalBackendManager.set_attn_backend("CUDNN")
    q = randn((1, 4, 2, 8))
    with pytest.raises(BackendUnsupportedError, match="CUDNN"):
        flash_attn_func(q, q, q)


# -- bad input -------------------------------------------------------------------------------------
def _bad_dense():
    q, k, v = randn((2, 5, 4, 16)), randn((2, 7, 2, 16)), randn((2, 7, 2, 16))
    return [
        ("heads", (q, randn((2, 7, 3, 16)), randn((2, 7, 3, 16))), {}, ValueError, "multiple of the heads"),
        ("kv-heads", (q, k, randn((2, 7, 1, 16))), {}, ValueError, "same number of heads"),
        ("head-dim-qk", (q, randn((2, 7, 2, 8)), v), {}, ValueError, "same head dim"),
        ("ndim", (q[0], k, v), {}, ValueError, "4-D"),
        ("batch", (q, randn((3, 7, 2, 16)), randn((3, 7, 2, 16))), {}, ValueError, "batch size"),
        ("seqlen-kv", (q, k, randn((2, 6, 2, 16))), {}, ValueError, "seqlen_k"),
        ("head-dim>256", (randn((1, 2, 1, 264)),) * 3, {}, ValueError, r"\[1, 256\]"),
        ("window-type", (q, k, v), dict(window_size=5), TypeError, "window_size"),
        ("window-value", (q, k, v), dict(window_size=(-2, 0)), ValueError, "window_size"),
        ("window-len", (q, k, v), dict(window_size=(1, 2, 3)), TypeError, "window_size"),
        ("window-float", (q, k, v), dict(window_size=(1.5, 0)), ValueError, "window_size"),
        ("dtype", (q.double(), k.double(), v.double()), {}, TypeError, "q.dtype"),
        ("mixed-dtype", (q, k.bfloat16(), v), {}, TypeError, "share one dtype"),
        ("causal-type", (q, k, v), dict(causal=1), TypeError, "causal"),
        ("dropout", (q, k, v), dict(dropout_p=1.0), ValueError, "dropout_p"),
        ("scale", (q, k, v), dict(softmax_scale="x"), TypeError, "softmax_scale"),
        ("not-a-tensor", (q.tolist(), k, v), {}, TypeError, "torch.Tensor"),
    ]


@pytest.mark.parametrize("case", _bad_dense(), ids=lambda c: c[0])
def test_bad_dense_input(case):
    _, args, kw, exc, match = case
    with pytest.raises(exc, match=match):
        flash_attn_func(*args, **kw)


def test_bad_varlen_input():
    q = randn((12, 2, 16))
    c = cu([5, 7])
    with pytest.raises(TypeError, match="int32"):
        flash_attn_varlen_func(q, q, q, c.long(), c, 7, 7)
    with pytest.raises(ValueError, match="batch \\+ 1"):
        flash_attn_varlen_func(q, q, q, c, cu([5, 4, 3]), 7, 7)
    with pytest.raises(TypeError, match="max_seqlen_q"):
        flash_attn_varlen_func(q, q, q, c, c, torch.tensor(7), 7)
    with pytest.raises(ValueError, match="3-D"):
        flash_attn_varlen_func(q[None], q, q, c, c, 7, 7)
    with pytest.raises(ValueError, match="same number of tokens"):
        flash_attn_varlen_func(q, q, q[:11], c, c, 7, 7)


# -- torch.compile ---------------------------------------------------------------------------------
COMPILE_CASES = {
    "causal-gqa-lse-aot_eager": (dict(causal=True, return_lse=True), "aot_eager"),
    "window-aot_eager": (dict(window_size=(3, 1)), "aot_eager"),
    "plain-inductor": ({}, "inductor"),
}


@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_compile_fullgraph_dense(case, fresh_dynamo):
    kw, backend = COMPILE_CASES[case]
    q, k, v = randn((2, 11, 4, 16)), randn((2, 13, 2, 16)), randn((2, 13, 2, 16))
    grad = randn((2, 11, 4, 16))

    def step(q, k, v):
        result = flash_attn_func(q, k, v, **kw)
        out = result[0] if isinstance(result, tuple) else result
        return out * 2.0, result

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    doubled, result = compiled(*leaves)
    doubled.backward(grad)
    ref_out, ref_lse, ref_g = ref_grads(q, k, v, 2.0 * grad, **ref_kwargs(kw))
    assert_close("out", doubled.detach() / 2, ref_out, FP32)
    if kw.get("return_lse"):
        assert_lse(result[1].detach(), ref_lse, FP32)
    for name, g, r in zip(("dq", "dk", "dv"), (x.grad for x in leaves), ref_g):
        assert_close(name, g, r, FP32)


def test_compile_fullgraph_varlen(fresh_dynamo):
    c_q, c_k = cu([3, 6]), cu([5, 6])
    q, k, v = randn((9, 2, 16)), randn((11, 1, 16)), randn((11, 1, 8))
    grad = randn((9, 2, 8))
    compiled = torch.compile(lambda *a: flash_attn_varlen_func(*a, causal=True), fullgraph=True, backend="aot_eager")
    out_c, _, grads_c = run_op(compiled, q, k, v, grad, c_q, c_k, 6, 6)
    out_e, _, grads_e = run_op(flash_attn_varlen_func, q, k, v, grad, c_q, c_k, 6, 6, causal=True)
    assert_close("out", out_c, out_e.double(), FP32)
    for name, g, r in zip(("dq", "dk", "dv"), grads_c, grads_e):
        assert_close(name, g, r.double(), FP32)


def test_compile_dropout_is_refused(fresh_dynamo):
    q = randn((1, 4, 2, 8), requires_grad=True)
    compiled = torch.compile(lambda q: flash_attn_func(q, q, q, dropout_p=0.1), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="dropout_p > 0 is not supported under torch.compile"):
        compiled(q)


# -- GPU -------------------------------------------------------------------------------------------
@pytest.fixture
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def gpu_check(backend, b, sq, sk, hq, hk, d, dv, dtype, **kw):
    if backend is not None:
        turbo.GlobalBackendManager.set_attn_backend(backend)
    # Inputs rounded to ``dtype`` first: the reference sees exactly what the kernel sees.
    q, k, v = randn((b, sq, hq, d), dtype), randn((b, sk, hk, d), dtype), randn((b, sk, hk, dv), dtype)
    grad = randn((b, sq, hq, dv), dtype)
    ref_out, ref_lse, ref_g = ref_grads(q, k, v, grad, **ref_kwargs(kw))
    cuda = [x.to("cuda") for x in (q, k, v, grad)]
    out, lse, grads = run_op(flash_attn_func, *cuda[:3], cuda[3], **kw)
    assert out.dtype == dtype
    assert_result((out, lse, grads), (ref_out, ref_lse, ref_g), dtype, kw.get("return_lse"))
    return turbo.explain("attention", *cuda[:3], **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TORCH", "CUDNN"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_bf16_b2_s256_h8_d128(backend, causal):
    d = gpu_check(backend, 2, 256, 256, 8, 8, 128, 128, BF16, causal=causal)
    assert d.backend == backend and d.source == "code"


#: (B, Sq, Sk, Hq, Hkv, Dqk, Dv, dtype, kwargs): the grid CUDNN's supports() is judged on; every
#: case it accepts must be correct, and every TORCH case too.
GPU_GRID = [
    (2, 256, 256, 8, 8, 128, 128, BF16, {}),
    (2, 256, 256, 8, 8, 128, 128, FP16, dict(causal=True)),
    (1, 200, 200, 4, 4, 64, 64, BF16, dict(causal=True)),
    (2, 129, 129, 4, 4, 64, 64, BF16, {}),
    (1, 96, 320, 4, 4, 128, 128, BF16, {}),
    (1, 128, 384, 4, 4, 128, 128, BF16, dict(causal=True)),
    (1, 128, 384, 8, 2, 128, 128, BF16, dict(causal=True)),
    (1, 128, 384, 8, 2, 96, 64, BF16, dict(causal=True)),
    (1, 384, 128, 4, 4, 64, 64, BF16, dict(causal=True)),
    (2, 256, 256, 8, 2, 128, 128, BF16, dict(causal=True)),
    (2, 256, 256, 8, 2, 128, 128, BF16, dict(causal=True, return_lse=True)),
    (2, 256, 256, 8, 1, 64, 64, BF16, {}),
    (1, 200, 200, 8, 1, 64, 64, FP16, dict(return_lse=True)),
    (3, 129, 129, 6, 3, 128, 128, BF16, dict(causal=True, return_lse=True)),
    (1, 256, 256, 4, 4, 128, 128, BF16, dict(window_size=(64, 0))),
    (1, 256, 256, 4, 4, 128, 128, BF16, dict(window_size=(32, 32))),
    (1, 128, 128, 4, 4, 192, 128, BF16, dict(causal=True)),
    (1, 128, 128, 4, 4, 256, 256, BF16, {}),
    (1, 128, 128, 4, 4, 40, 40, BF16, {}),
    (1, 128, 128, 4, 4, 128, 128, BF16, dict(return_lse=True, causal=True)),
    (1, 256, 256, 4, 4, 128, 128, BF16, dict(window_size=(64, 0), return_lse=True)),
    (1, 128, 384, 8, 2, 128, 128, BF16, dict(causal=True, return_lse=True)),
    (1, 384, 128, 4, 4, 64, 64, BF16, dict(causal=True, return_lse=True)),
    (2, 129, 129, 4, 4, 64, 64, BF16, dict(return_lse=True)),
    (2, 256, 256, 8, 8, 128, 128, FP16, dict(causal=True, return_lse=True)),
    (1, 128, 128, 4, 4, 64, 64, FP32, {}),
    (1, 128, 128, 4, 2, 64, 64, FP32, dict(causal=True, window_size=(16, 0))),
    (2, 128, 128, 4, 4, 64, 64, BF16, dict(deterministic=True, causal=True)),
    (1, 128, 128, 4, 4, 64, 64, BF16, dict(softmax_scale=0.05)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TORCH", "CUDNN"])
@pytest.mark.parametrize("case", GPU_GRID, ids=lambda c: "-".join(map(str, c[:7])) + f"-{c[7]}-{c[8]}".replace(" ", ""))
def test_gpu_grid(backend, case, no_tf32):
    *shape, dtype, kw = case
    q = torch.empty((shape[0], shape[1], shape[3], shape[5]), device="cuda", dtype=dtype)
    k = torch.empty((shape[0], shape[2], shape[4], shape[5]), device="cuda", dtype=dtype)
    v = torch.empty((shape[0], shape[2], shape[4], shape[6]), device="cuda", dtype=dtype)
    from turbo_dispatch.backends.cudnn.attention import CudnnAttention

    reason = CudnnAttention().supports(attn_mod.attention_problem(q, k, v, **kw))
    if backend == "CUDNN" and reason is not None:
        turbo.GlobalBackendManager.set_attn_backend("CUDNN")
        with pytest.raises(BackendUnsupportedError, match="CUDNN") as info:
            flash_attn_func(q, k, v, **kw)
        assert reason in str(info.value)
        return
    gpu_check(backend, *shape, dtype, **kw)


@pytest.mark.gpu
def test_gpu_cudnn_pinned_unsupported_raises_with_reason():
    turbo.GlobalBackendManager.set_attn_backend("CUDNN")
    q = randn((2, 64, 8, 128), BF16, "cuda")
    k = randn((2, 64, 2, 128), BF16, "cuda")
    with pytest.raises(BackendUnsupportedError, match="bottom-right"):
        flash_attn_func(q[:, :32], k, k, causal=True)
    with pytest.raises(BackendUnsupportedError, match="sliding window"):
        flash_attn_func(q, q, q, window_size=(16, 0))


@pytest.mark.gpu
def test_gpu_varlen_torch_bf16():
    lens_q, lens_k = [100, 7, 250, 33], [120, 7, 250, 20]
    c_q, c_k = cu(lens_q).cuda(), cu(lens_k).cuda()
    q, k, v = randn((390, 8, 128), BF16), randn((397, 2, 128), BF16), randn((397, 2, 128), BF16)
    grad = randn((390, 8, 128), BF16)
    cuda = [x.to("cuda") for x in (q, k, v, grad)]
    out, lse, grads = run_op(flash_attn_varlen_func, *cuda[:3], cuda[3], c_q, c_k, 250, 250, causal=True,
                             return_lse=True)
    cq, ck = cu(lens_q), cu(lens_k)
    for b in range(4):
        sq_, sk_ = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o, l_, g = ref_grads(q[None, sq_], k[None, sk_], v[None, sk_], grad[None, sq_], causal=True)
        assert_close("out", out[sq_].float(), o[0], BF16)
        assert_lse(lse[:, sq_], l_[0], BF16)
        assert_close("dq", grads[0][sq_].float(), g[0][0], BF16)


# -- the TORCH adapter's FlashAttention path ----------------------------------------------------------
@pytest.fixture
def flash_kernels_present(monkeypatch):
    """Judge the gate as on a torch build with FlashAttention kernels (the CPU build has none)."""
    from turbo_dispatch.backends.torch import flash_native

    monkeypatch.setattr(flash_native, "_unavailable", lambda: None)
    return flash_native


def test_flash_gate_names_each_reason(flash_kernels_present, monkeypatch):
    """Which calls the TORCH adapter hands to the FlashAttention kernels, and why not the rest
    (decided from the problem alone, so describe() reports it without tensors)."""
    from turbo_dispatch.backends.torch.attention import TorchAttention

    # Where SDPA's cuDNN kernel can return a dense call's lse (a GPU host) it takes that call
    # before FlashAttention is asked (test_cudnn_lse_gate); here it is switched off, as a CPU
    # build has it, so the flash gate is judged alone on any machine.
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)

    adapter = TorchAttention()
    q = randn((12, 4, 16), BF16)
    c = cu([5, 7])
    varlen = attn_mod.attention_varlen_problem(q, q, q, c, c, 7, 7, causal=True)._replace(platform="cuda")
    qd, kd = randn((2, 9, 4, 16), BF16), randn((2, 9, 2, 16), BF16)
    dense = attn_mod.attention_problem(qd, kd, kd, causal=True)._replace(platform="cuda")
    taken = {
        "varlen": varlen,
        "dense lse": dense._replace(return_lse=True),
        "dense window": dense._replace(window_left=4),
        "dense causal sq>sk": dense._replace(seqlen_q=20),
    }
    for name, p in taken.items():
        assert adapter._flash_reason(p) is None, name
        assert "FlashAttention (aten._flash_attention_forward/backward)" in adapter.describe(p), name
    assert "lse from the kernel" in adapter.describe(taken["dense lse"])
    assert "window (4, 0) in the kernel" in adapter.describe(taken["dense window"])
    assert "GQA 4/2 in the kernel" in adapter.describe(dense._replace(return_lse=True))
    # SDPA's own flash/cuDNN kernels serve plain and causal calls without an lse as they are.
    assert "SDPA serves it" in adapter._flash_reason(dense)
    assert adapter.describe(dense).startswith("SDPA, is_causal")
    refused = {
        "platform is cpu": varlen._replace(platform="cpu"),
        "bf16/fp16": varlen._replace(dtype=FP32),
        "head dims": varlen._replace(head_dim_v=8),
        "multiples of 8": varlen._replace(head_dim_qk=20, head_dim_v=20),
        "dropout": varlen._replace(dropout_p=0.1),
        "restricted": varlen._replace(deterministic=True),
    }
    for why, p in refused.items():
        got = adapter._flash_reason(p)
        assert got is not None and why in got, (why, got)
        assert why in adapter.describe(p)
        assert "padded" in adapter.describe(p)
    lse_fp32 = taken["dense lse"]._replace(dtype=FP32)
    assert "not FlashAttention: FlashAttention takes bf16/fp16" in adapter.describe(lse_fp32)
    assert "lse by a separate float32 pass" in adapter.describe(lse_fp32)


def test_flash_gate_honours_flash_sdp_switch(flash_kernels_present, monkeypatch):
    q = randn((12, 4, 16), BF16)
    c = cu([5, 7])
    p = attn_mod.attention_varlen_problem(q, q, q, c, c, 7, 7)._replace(platform="cuda")
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: False)
    assert "enable_flash_sdp(False)" in flash_kernels_present.reason(p, None)


def test_cudnn_lse_gate(flash_kernels_present, monkeypatch):
    """Dense lse calls that the CUDNN backend has verified take SDPA's cuDNN kernel op (it
    returns the lse, and beat FlashAttention-2 on an H100), GQA included; windows and fp32 do not."""
    from turbo_dispatch.backends.cudnn import attention as cudnn_attention
    from turbo_dispatch.backends.torch.attention import TorchAttention

    monkeypatch.setattr(cudnn_attention, "_unavailable", lambda: None)
    adapter = TorchAttention()
    q = randn((2, 9, 4, 16), BF16)
    causal_lse = attn_mod.attention_problem(q, q, q, causal=True, return_lse=True)._replace(platform="cuda")
    assert adapter._cudnn_lse_reason(causal_lse) is None
    assert adapter.describe(causal_lse).startswith("SDPA's cuDNN kernel (aten._scaled_dot_product_cudnn_attention), "
                                                   "is_causal; lse from the kernel")
    assert "cuDNN kernel returns" in adapter._flash_reason(causal_lse)
    assert adapter._cudnn_lse_reason(causal_lse._replace(return_lse=False)) == "no lse asked for"
    assert adapter._cudnn_lse_reason(causal_lse._replace(heads_kv=2)) is None
    for name, p, word in (("dv", causal_lse._replace(head_dim_v=8), "v head dim"),
                          ("window", causal_lse._replace(window_left=4), "sliding window"),
                          ("fp32", causal_lse._replace(dtype=FP32), "bf16/fp16")):
        assert word in adapter._cudnn_lse_reason(p), name
        assert not adapter.describe(p).startswith("SDPA's cuDNN kernel"), name
    assert adapter.describe(causal_lse._replace(window_left=4)).startswith("FlashAttention")
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
    assert "enable_cudnn_sdp(False)" in adapter._cudnn_lse_reason(causal_lse)


def test_flash_gate_without_kernels():
    """On a torch build without FlashAttention kernels (this CPU build) nothing takes the path."""
    from turbo_dispatch.backends.torch import flash_native

    q = randn((12, 4, 16), BF16)
    c = cu([5, 7])
    p = attn_mod.attention_varlen_problem(q, q, q, c, c, 7, 7)._replace(platform="cuda")
    if flash_native._unavailable() is None:
        pytest.skip("this torch build has FlashAttention kernels")
    assert flash_native.reason(p, None) == flash_native._unavailable()


def _emulated_sequence(q, k, v, g, scale, left, right):
    """One sequence of attention in float64, as the emulated kernels compute it: out [Sq, Hq, D],
    lse [Hq, Sq] (+inf on empty rows) and, given g, the gradients by the closed-form softmax
    backward: no autograd, which a custom op's implementation (the compiled path) runs without."""
    sq, hq, sk, hk = q.shape[0], q.shape[1], k.shape[0], k.shape[1]
    ke, ve = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    diag = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        allowed &= j <= diag + right
    if left >= 0:
        allowed &= j >= diag - left
    scores = torch.einsum("qhd,khd->hqk", q, ke).mul(scale).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # empty rows: all 0
    out = torch.einsum("hqk,khd->qhd", probs, ve)
    lse = lse.masked_fill(torch.isinf(lse), float("inf"))
    if g is None:
        return out, lse, None
    dv = torch.einsum("hqk,qhd->khd", probs, g)
    dp = torch.einsum("qhd,khd->hqk", g, ve)
    ds = probs * (dp - (g * out).sum(-1).t()[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, ke) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q) * scale
    fold = lambda t: t.view(sk, hk, hq // hk, t.shape[-1]).sum(2)  # noqa: E731
    return out, lse, (dq, fold(dk), fold(dv))


def _emulated_flash_kernels(monkeypatch, calls):
    """Stand-ins for aten's FlashAttention forward/backward that keep their contract (dense
    [B, S, H, D] without cu_seqlens or packed [T, H, D] with int32 cu_seqlens, unit last stride,
    the raw lse [B, Hq, Sq] or [Hq, Tq] with +inf on rows that attend nothing, the forward's
    out/lse handed to the backward) and compute in float64, so the adapter's side of the calls
    runs on a CPU."""
    from turbo_dispatch.backends.torch import flash_native

    made = []

    def per_sequence(p, x, grad_out=None):
        """(out, lse, grads) in the kernels' layouts: dense [B, S, H, D] with lse [B, Hq, Sq],
        or packed [T, H, D] with lse [Hq, Tq]."""
        dense = x.cu_q is None
        q, k, v = (t.double() for t in (x.q, x.k, x.v))
        cu_q, cu_k = x.cu_q, x.cu_k
        if dense:
            b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
            cu_q, cu_k = torch.arange(b + 1) * sq, torch.arange(b + 1) * sk
            grad_out = grad_out.flatten(0, 1) if grad_out is not None else None
        out = torch.zeros(q.shape[:2] + v.shape[2:], dtype=torch.float64)
        lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float64)
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for i in range(p.batch):
            sq_, sk_ = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            if cu_q[i + 1] == cu_q[i]:
                continue
            g = grad_out[sq_].double() if grad_out is not None else None
            o, l_, gr = _emulated_sequence(q[sq_], k[sk_], v[sk_], g, p.softmax_scale, p.window_left, p.window_right)
            out[sq_], lse[:, sq_] = o, l_
            for acc, part, sl in zip(grads, gr or (), (sq_, sk_, sk_)):
                acc[sl] += part
        if dense:
            out, grads = out.view(b, sq, *out.shape[1:]), [g.view(t.shape) for g, t in zip(grads, (x.q, x.k, x.v))]
            lse = lse.view(-1, b, sq).transpose(0, 1)
        return out, lse, grads

    def forward(p, x):
        if x.cu_q is None:
            assert x.cu_k is None and not p.varlen and all(t.dim() == 4 for t in (x.q, x.k, x.v))
        else:
            assert p.varlen and all(t.dim() == 3 for t in (x.q, x.k, x.v))
            assert x.cu_q.dtype == x.cu_k.dtype == torch.int32
            assert len(x.cu_q) == len(x.cu_k) == p.batch + 1
        assert all(t.stride(-1) == 1 for t in (x.q, x.k, x.v))
        out, lse, _ = per_sequence(p, x)
        calls.append("forward")
        made.append((out.to(x.q.dtype), lse.float()))
        return made[-1] + (None, None)

    def backward(p, x, out, lse, rng_state, unused, grad_out):
        assert grad_out.shape == out.shape and (lse[torch.isinf(lse)] > 0).all()  # the raw lse
        # The backward starts from the last forward's out and raw lse, not a recomputation's.
        assert [torch.equal(got, want) for got, want in zip((out, lse), made[-1])] == [True, True]
        _, _, grads = per_sequence(p, x, grad_out)
        calls.append("backward")
        return tuple(g.to(t.dtype) for g, t in zip(grads, (x.q, x.k, x.v)))

    monkeypatch.setattr(flash_native, "reason", lambda p, kernels: None)
    monkeypatch.setattr(flash_native, "_forward_raw", forward)
    monkeypatch.setattr(flash_native, "_backward_raw", backward)


#: id -> (shape, kwargs, whether eager calls take the FlashAttention path; compiled calls always
#: do here, since it returns the lse their backward starts from)
FLASH_WIRING = {
    "dense-gqa-causal-lse": ((2, 19, 23, 4, 2, 16), dict(causal=True, return_lse=True), True),
    "dense-sq>sk-causal-lse": ((1, 29, 13, 2, 2, 16), dict(causal=True, return_lse=True), True),
    "dense-window-lse": ((2, 21, 21, 2, 1, 16), dict(window_size=(3, 2), return_lse=True), True),
    "dense-window": ((1, 9, 21, 2, 2, 16), dict(window_size=(2, 2)), True),
    "dense-gqa-causal": ((2, 17, 17, 4, 2, 16), dict(causal=True), False),
    "varlen-causal-lse": (([5, 0, 9], [7, 2, 9], 4, 2, 16), dict(causal=True, return_lse=True), True),
    "varlen-window": (([6, 11], [6, 11], 2, 2, 16), dict(window_size=(2, 0)), True),
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", list(FLASH_WIRING))
def test_flash_path_operands_on_cpu(case, compiled, monkeypatch, fresh_dynamo):
    """The FlashAttention path's operands (dense and packed), lse layouts and -inf rows, and both
    backwards (eager autograd; the compiled path's backward op from the forward op's out and lse),
    with the two kernels emulated in float64: out, lse and every gradient against the reference.
    SDPA is taken to pick FlashAttention, so compiled calls take it wherever eager ones take SDPA."""
    calls = []
    _emulated_flash_kernels(monkeypatch, calls)
    monkeypatch.setattr(torch_attn, "_sdpa_choice", lambda *a: torch_attn.SDP_FLASH)
    shape, kw, eager_flash = FLASH_WIRING[case]
    if case.startswith("dense"):
        b, sq, sk, hq, hk, d = shape
        q, k, v, grad = randn((b, sq, hq, d)), randn((b, sk, hk, d)), randn((b, sk, hk, d)), randn((b, sq, hq, d))
        fn, args = flash_attn_func, ()
        ref_out, ref_lse, ref_g = ref_grads(q, k, v, grad, **ref_kwargs(kw))
    else:
        lens_q, lens_k, hq, hk, d = shape
        c_q, c_k = cu(lens_q), cu(lens_k)
        q, k, v = randn((sum(lens_q), hq, d)), randn((sum(lens_k), hk, d)), randn((sum(lens_k), hk, d))
        grad = randn((sum(lens_q), hq, d))
        fn, args = flash_attn_varlen_func, (c_q, c_k, max(lens_q), max(lens_k))
        ref_out, ref_lse, ref_g = varlen_reference(q, k, v, grad, c_q, c_k, kw)
    call = torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn
    turbo.GlobalBackendManager.set_attn_backend("TORCH")
    try:
        out, lse, grads = run_op(call, q, k, v, grad, *args, **kw)
    finally:
        turbo.GlobalBackendManager.set_attn_backend(None)
    assert_result((out, lse, grads), (ref_out, ref_lse, ref_g), FP32, kw.get("return_lse"))
    # One forward, one backward from its out and lse; eager calls SDPA serves well stay on SDPA.
    assert calls == (["forward", "backward"] if compiled or eager_flash else [])


@pytest.mark.parametrize("choice", ["efficient", "cudnn-unverified"])
def test_compiled_sdpa_path_recomputes_on_cpu(choice, monkeypatch, fresh_dynamo):
    """A compiled unmasked call whose SDPA kernel neither saving path runs (SDPA would pick the
    memory-efficient kernel, or cuDNN on a call the CUDNN backend has not verified: GQA) stays on
    SDPA and recomputes: no FlashAttention call, gradients right."""
    calls = []
    _emulated_flash_kernels(monkeypatch, calls)
    answer = 2 if choice == "efficient" else torch_attn.SDP_CUDNN
    monkeypatch.setattr(torch_attn, "_sdpa_choice", lambda *a: answer)
    q, grad = randn((2, 13, 4, 16)), randn((2, 13, 4, 16))
    k, v = randn((2, 13, 2, 16)), randn((2, 13, 2, 16))
    ref_out, _, ref_g = ref_grads(q, k, v, grad, causal=True)
    turbo.GlobalBackendManager.set_attn_backend("TORCH")
    try:
        call = torch.compile(flash_attn_func, fullgraph=True, backend="aot_eager")
        out, _, grads = run_op(call, q, k, v, grad, causal=True)
    finally:
        turbo.GlobalBackendManager.set_attn_backend(None)
    assert calls == []
    assert_result((out, None, grads), (ref_out, None, ref_g), FP32, False)


def test_sdpa_choice_names_the_kernel():
    """``_sdpa_choice`` asks torch which kernel SDPA runs for unmasked dense calls, names
    FlashAttention for the lower-right causal bias, and cannot say for explicit masks."""
    q, k = randn((2, 9, 4, 16)), randn((2, 9, 2, 16))
    plain = attn_mod.attention_problem(q, k, k, causal=True)
    want = torch._fused_sdp_choice(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), is_causal=True,
                                   scale=plain.softmax_scale, enable_gqa=True)
    assert torch_attn._sdpa_choice(plain, q, k, k) == want
    lower_right = attn_mod.attention_problem(q[:, :5], k, k, causal=True)
    assert torch_attn._sdpa_choice(lower_right, q[:, :5], k, k) == torch_attn.SDP_FLASH
    window = attn_mod.attention_problem(q, k, k, window_size=(2, 0))
    assert torch_attn._sdpa_choice(window, q, k, k) is None


def _emulated_cudnn_kernels(monkeypatch, calls):
    """Stand-ins for SDPA's cuDNN kernel op and its backward op that keep their contract ([B, H, S, D]
    views, out laid out like q, the lse as [B, H, Sq, 1], the output gradient laid out like the
    output) and compute in float64, so the compiled path's cuDNN side runs on a CPU."""
    from turbo_dispatch.backends.torch import cudnn_lse

    made = []

    def forward(p, qt, kt, vt):
        assert all(t.dim() == 4 for t in (qt, kt, vt)) and qt.shape[1] == p.heads_q
        outs, lses = zip(*(_emulated_sequence(*(t[b].transpose(0, 1).double() for t in (qt, kt, vt)), None,
                                              p.softmax_scale, p.window_left, p.window_right)[:2]
                           for b in range(p.batch)))
        out = torch.stack(outs).to(qt.dtype).transpose(1, 2)  # [B, H, S, D] over [B, S, H, D] memory
        made.append((out, torch.stack(lses).float()[..., None]))
        calls.append("forward")
        return made[-1]

    def backward(p, gt, qt, kt, vt, ot, lse):
        assert gt.stride() == ot.stride() and lse.shape == (p.batch, p.heads_q, p.seqlen_q, 1)
        assert [torch.equal(got, want) for got, want in zip((ot, lse), made[-1])] == [True, True]
        grads = [_emulated_sequence(*(t[b].transpose(0, 1).double() for t in (qt, kt, vt, gt)), p.softmax_scale,
                                    p.window_left, p.window_right)[2] for b in range(p.batch)]
        calls.append("backward")
        return tuple(torch.stack(g).to(t.dtype).transpose(1, 2) for g, t in zip(zip(*grads), (qt, kt, vt)))

    monkeypatch.setattr(cudnn_lse, "reason", lambda p: None)
    monkeypatch.setattr(cudnn_lse, "_forward_raw", forward)
    monkeypatch.setattr(cudnn_lse, "_backward_raw", backward)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(return_lse=True), dict(causal=True, return_lse=True)],
                         ids=["causal", "full-lse", "causal-lse"])
def test_compiled_cudnn_path_on_cpu(kw, monkeypatch, fresh_dynamo):
    """The compiled path's cuDNN side (asked for an lse or not): one kernel forward, one kernel
    backward from its out and lse, with both ops emulated in float64; out, lse and every gradient
    against the reference. SDPA is taken to pick cuDNN for the call without an lse."""
    calls = []
    _emulated_cudnn_kernels(monkeypatch, calls)
    monkeypatch.setattr(torch_attn, "_sdpa_choice", lambda *a: torch_attn.SDP_CUDNN)
    q, k, v, grad = (randn((2, 13, 3, 16)) for _ in range(4))
    ref_out, ref_lse, ref_g = ref_grads(q, k, v, grad, **ref_kwargs(kw))
    turbo.GlobalBackendManager.set_attn_backend("TORCH")
    try:
        call = torch.compile(flash_attn_func, fullgraph=True, backend="aot_eager")
        out, lse, grads = run_op(call, q, k, v, grad, **kw)
    finally:
        turbo.GlobalBackendManager.set_attn_backend(None)
    assert_result((out, lse, grads), (ref_out, ref_lse, ref_g), FP32, kw.get("return_lse"))
    assert calls == ["forward", "backward"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["varlen-causal-gqa", "varlen-window", "varlen-sq>sk-causal-empty-rows",
                                  "varlen-full-fp16-mqa", "dense-sq<sk-causal-gqa", "dense-window",
                                  "dense-sq>sk-causal", "dense-window-sq<sk-fp16"])
def test_gpu_flash_native_matches_reference(case):
    """The FlashAttention path (the TORCH adapter's pick for these calls on NVIDIA GPUs) against
    the float64 reference: out, lse (-inf where a row attends nothing) and every gradient."""
    from turbo_dispatch.backends.torch.attention import TorchAttention

    varlen = {
        "varlen-causal-gqa": ([100, 7, 250, 33], [120, 7, 250, 20], 8, 2, BF16, dict(causal=True)),
        "varlen-window": ([64, 200, 1], [64, 180, 3], 4, 4, BF16, dict(window_size=(16, 8))),
        "varlen-sq>sk-causal-empty-rows": ([40, 0, 17], [9, 5, 17], 4, 4, BF16, dict(causal=True)),
        "varlen-full-fp16-mqa": ([31, 129], [31, 129], 4, 1, FP16, {}),
    }
    dense = {  # (B, Sq, Sk, Hq, Hkv, dtype, kwargs)
        "dense-sq<sk-causal-gqa": (2, 200, 300, 8, 2, BF16, dict(causal=True)),
        "dense-window": (2, 257, 257, 4, 4, BF16, dict(window_size=(32, 5))),
        "dense-sq>sk-causal": (1, 300, 100, 4, 4, BF16, dict(causal=True)),
        "dense-window-sq<sk-fp16": (2, 96, 320, 4, 2, FP16, dict(window_size=(20, 20))),
    }
    if case in varlen:
        lens_q, lens_k, hq, hk, dtype, kw = varlen[case]
        c_q, c_k = cu(lens_q), cu(lens_k)
        q, k, v = randn((sum(lens_q), hq, 64), dtype), randn((sum(lens_k), hk, 64), dtype), \
            randn((sum(lens_k), hk, 64), dtype)
        grad = randn((sum(lens_q), hq, 64), dtype)
        fn, args = flash_attn_varlen_func, (c_q.cuda(), c_k.cuda(), max(lens_q), max(lens_k))
        ref_out, ref_lse, ref_g = varlen_reference(q, k, v, grad, c_q, c_k, kw)
        p = attn_mod.attention_varlen_problem(q.cuda(), k.cuda(), v.cuda(), *args, return_lse=True, **kw)
    else:
        b, sq, sk, hq, hk, dtype, kw = dense[case]
        q, k, v = randn((b, sq, hq, 64), dtype), randn((b, sk, hk, 64), dtype), randn((b, sk, hk, 64), dtype)
        grad = randn((b, sq, hq, 64), dtype)
        fn, args = flash_attn_func, ()
        ref_out, ref_lse, ref_g = ref_grads(q, k, v, grad, **ref_kwargs(kw))
        p = attn_mod.attention_problem(q.cuda(), k.cuda(), v.cuda(), return_lse=True, **kw)
    why = TorchAttention()._flash_reason(p)
    if why is not None:
        pytest.skip(f"the FlashAttention path does not serve it here: {why}")
    turbo.GlobalBackendManager.set_attn_backend("TORCH")
    try:
        out, lse, grads = run_op(fn, q.cuda(), k.cuda(), v.cuda(), grad.cuda(), *args, return_lse=True, **kw)
    finally:
        turbo.GlobalBackendManager.set_attn_backend(None)
    assert_result((out, lse, grads), (ref_out, ref_lse, ref_g), BF16, True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["varlen-causal", "dense-window-lse"])
def test_gpu_compile_flash_native(case, fresh_dynamo):
    """torch.compile (fullgraph, aot_eager) of calls the FlashAttention path serves: the forward
    and the backward (the kernel backward from the forward op's out and lse) against eager calls."""
    if case == "varlen-causal":
        c = cu([100, 7, 250, 33]).cuda()
        q, k, v, grad = (randn((390, 4, 64), BF16, "cuda") for _ in range(4))
        kw = dict(causal=True)

        def call(q, k, v):
            return flash_attn_varlen_func(q, k, v, c, c, 250, 250, **kw)
    else:
        q, k, v, grad = (randn((2, 200, 4, 64), BF16, "cuda") for _ in range(4))
        kw = dict(window_size=(32, 4), return_lse=True)

        def call(q, k, v):
            return flash_attn_func(q, k, v, **kw)
    out_c, lse_c, grads_c = run_op(torch.compile(call, fullgraph=True, backend="aot_eager"), q, k, v, grad)
    out_e, lse_e, grads_e = run_op(call, q, k, v, grad)
    assert snr_db(out_c.float(), out_e.float()) > 60
    if lse_e is not None:
        assert torch.equal(lse_c, lse_e)
    for g, r in zip(grads_c, grads_e):
        assert snr_db(g.float(), r.float()) > 40


def _count_kernel_calls(monkeypatch, module, calls):
    """Wraps a path's two raw kernel calls so a test sees how often each ran."""
    for name in ("_forward_raw", "_backward_raw"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))


#: id -> (dense shape (B, Sq, Sk, Hq, Hkv) or varlen lengths, kwargs, the path a compiled call takes)
COMPILED_SAVING = {
    "dense-causal": ((2, 256, 256, 8, 8), dict(causal=True), "cudnn"),
    "dense-full-lse": ((2, 200, 200, 4, 4), dict(return_lse=True), "cudnn"),
    "dense-gqa-causal-lse": ((2, 256, 256, 8, 2), dict(causal=True, return_lse=True), "cudnn"),
    "dense-gqa-window": ((2, 300, 300, 8, 2), dict(window_size=(64, 0)), "flash"),
    "dense-sq>sk-causal": ((1, 300, 100, 4, 4), dict(causal=True), "flash"),
    "dense-sq<sk-causal": ((2, 100, 300, 4, 4), dict(causal=True), "flash"),
    "varlen-causal-lse": (([100, 0, 250, 33], [120, 7, 250, 20]), dict(causal=True, return_lse=True), "flash"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(COMPILED_SAVING))
def test_gpu_compiled_backward_starts_from_saved(case, monkeypatch, fresh_dynamo):
    """Compiled (fullgraph, inductor) TORCH calls on the kernels that return the lse: against the
    float64 reference (out, lse, every gradient), with one kernel forward and one kernel backward
    per step, so nothing was recomputed."""
    from turbo_dispatch.backends.torch import cudnn_lse, flash_native
    from turbo_dispatch.backends.torch.attention import TorchAttention

    shape, kw, path = COMPILED_SAVING[case]
    if case.startswith("varlen"):
        lens_q, lens_k = shape
        c_q, c_k = cu(lens_q), cu(lens_k)
        q = randn((sum(lens_q), 4, 64), BF16)
        k, v = randn((sum(lens_k), 2, 64), BF16), randn((sum(lens_k), 2, 64), BF16)
        grad = randn((sum(lens_q), 4, 64), BF16)
        args = (c_q.cuda(), c_k.cuda(), max(lens_q), max(lens_k))
        ref_out, ref_lse, ref_g = varlen_reference(q, k, v, grad, c_q, c_k, kw)
        fn = flash_attn_varlen_func
        p = attn_mod.attention_varlen_problem(q.cuda(), k.cuda(), v.cuda(), *args, **kw)
    else:
        b, sq, sk, hq, hk = shape
        q, k, v = randn((b, sq, hq, 128), BF16), randn((b, sk, hk, 128), BF16), randn((b, sk, hk, 128), BF16)
        grad = randn((b, sq, hq, 128), BF16)
        args = ()
        ref_out, ref_lse, ref_g = ref_grads(q, k, v, grad, **ref_kwargs(kw))
        fn = flash_attn_func
        p = attn_mod.attention_problem(q.cuda(), k.cuda(), v.cuda(), **kw)
    taken = TorchAttention()._saving_path(p, q.cuda(), k.cuda(), v.cuda())
    if taken != path:
        pytest.skip(f"the compiled call takes the {taken} path here, not {path}")
    calls = []
    _count_kernel_calls(monkeypatch, cudnn_lse if path == "cudnn" else flash_native, calls)
    turbo.GlobalBackendManager.set_attn_backend("TORCH")
    try:
        call = torch.compile(lambda q, k, v: fn(q, k, v, *args, **kw), fullgraph=True)
        out, lse, grads = run_op(call, q.cuda(), k.cuda(), v.cuda(), grad.cuda())
    finally:
        turbo.GlobalBackendManager.set_attn_backend(None)
    assert calls == ["_forward_raw", "_backward_raw"]
    assert_result((out, lse, grads), (ref_out, ref_lse, ref_g), BF16, kw.get("return_lse"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense-causal-lse", "varlen-causal"])
def test_gpu_compile_reduce_overhead(case, fresh_dynamo):
    """torch.compile(mode="reduce-overhead"): the forward and backward ops replayed as CUDA graphs
    (three steps, new inputs each) give eager's out, lse and gradients."""
    if case == "varlen-causal":
        c = cu([100, 7, 250, 33]).cuda()

        def call(q, k, v):
            return flash_attn_varlen_func(q, k, v, c, c, 250, 250, causal=True)

        shape = (390, 4, 64)
    else:
        def call(q, k, v):
            return flash_attn_func(q, k, v, causal=True, return_lse=True)

        shape = (2, 256, 8, 128)
    compiled = torch.compile(call, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        q, k, v, grad = (randn(shape, BF16, "cuda") for _ in range(4))
        out_c, lse_c, grads_c = run_op(compiled, q, k, v, grad)
        out_c, lse_c = out_c.clone(), (lse_c.clone() if lse_c is not None else None)
        out_e, lse_e, grads_e = run_op(call, q, k, v, grad)
        assert snr_db(out_c.float(), out_e.float()) > 60
        if lse_e is not None:
            assert snr_db(lse_c, lse_e) > 60
        for g, r in zip(grads_c, grads_e):
            assert snr_db(g.float(), r.float()) > 40


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    """Nothing in the forward syncs the host: dense (windowed, with lse) and varlen calls are
    captured in a CUDA graph, and replays recompute with new inputs."""
    lens = [100, 7, 250, 33]
    c = cu(lens).cuda()
    qv, kv, vv = (randn((390, 4, 64), BF16, "cuda") for _ in range(3))
    qd, kd, vd = (randn((2, 200, 4, 64), BF16, "cuda") for _ in range(3))

    def calls():
        return (flash_attn_varlen_func(qv, kv, vv, c, c, 250, 250, causal=True, return_lse=True),
                flash_attn_func(qd, kd, vd, window_size=(32, 0), return_lse=True))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls()  # warm-up on the capture stream: resolves the decisions, loads kernels
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = calls()
    for x in (qv, kv, vv, qd, kd, vd):
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    for (got_out, got_lse), (want_out, want_lse) in zip(captured, calls()):
        assert torch.equal(got_out, want_out)
        assert torch.equal(got_lse, want_lse)


@pytest.mark.gpu
def test_gpu_compile_cudnn(fresh_dynamo):
    turbo.GlobalBackendManager.set_attn_backend("CUDNN")
    q, k, v = (randn((2, 256, 8, 128), BF16, "cuda") for _ in range(3))
    grad = randn((2, 256, 8, 128), BF16, "cuda")
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True,
                             backend="aot_eager")
    out_c, _, grads_c = run_op(compiled, q, k, v, grad)
    out_e, _, grads_e = run_op(flash_attn_func, q, k, v, grad, causal=True)
    assert snr_db(out_c.float(), out_e.float()) > 60
    for g, r in zip(grads_c, grads_e):
        assert snr_db(g.float(), r.float()) > 40


def test_doctests():
    import doctest

    for module in (attn_mod, __import__("turbo_dispatch.backends.cudnn.attention", fromlist=["x"])):
        result = doctest.testmod(module)
        assert result.failed == 0, module.__name__
    assert doctest.testmod(attn_mod).attempted >= 2


def test_snr_db_of_an_all_zero_reference():
    """No ValueError on a zero signal: an exact match is inf, any error -inf (no ratio to give)."""
    zero = torch.zeros(4)
    assert snr_db(zero, zero) == math.inf
    assert snr_db(torch.full((4,), 1e-6), zero) == -math.inf
    assert snr_db(torch.ones(4), torch.ones(4) * 1.01) > 39.0
