"""Stand-in for AITER's flash attention (aiter/ops/mha.py): ``flash_attn_func`` and
``flash_attn_varlen_func`` as autograd functions whose backward calls ``mha_bwd`` /
``mha_varlen_bwd``, with FlashAttention's semantics: bottom-right aligned causal masks and
windows ``(left, right, sink)``, GQA, a float32 lse with ``+inf`` on rows that attend no key, and
the forward's assertion that the lse is asked for whenever a gradient will be needed."""
from __future__ import annotations

import torch

_NEG = -1e300  # a finite "minus infinity" for float64 scores, so masked rows keep finite gradients


def _record(name: str, **details) -> None:
    from aiter import CALLS

    CALLS.append((name, details))


def _window(causal: bool, window_size) -> tuple[int, int]:
    assert len(window_size) == 3, f"window_size is (left, right, sink); got {window_size!r}"
    left, right, sink = (int(x) for x in window_size)
    assert sink == 0, "the stand-in implements no sink tokens"
    return left, 0 if causal else right


def _one(q, k, v, scale, left, right):
    """(out [Sq, Hq, Dv], lse [Hq, Sq]) of one sequence in float64; lse +inf where no key is allowed."""
    sq, hq, _ = q.shape
    sk, hk, _ = k.shape
    rep = hq // hk
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        allowed &= j <= i + right
    if left >= 0:
        allowed &= j >= i - left
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
    rows = allowed.any(-1)
    probs = torch.softmax(scores.masked_fill(~allowed, _NEG), -1) * rows[None, :, None]
    out = torch.einsum("hqk,khd->qhd", probs, vv)
    with torch.no_grad():
        lse = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), -1)
        lse = lse.masked_fill(~rows[None], float("inf"))
    return out, lse


def _dense(q, k, v, scale, left, right):
    outs, lses = zip(*(_one(q[b], k[b], v[b], scale, left, right) for b in range(q.shape[0])))
    return torch.stack(outs), torch.stack(lses)


def _varlen(q, k, v, cu_q, cu_k, scale, left, right):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        o, lse = _one(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], scale, left, right)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _grads(fn, dout, q, k, v):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out, _ = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, dout.double())
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


def mha_bwd(dout, q, k, v, out, softmax_lse, dropout_p, softmax_scale, is_causal, window_size_left,
            window_size_right, deterministic, dq=None, dk=None, dv=None, dbias=None, bias=None, alibi_slopes=None,
            rng_state=None, gen=None, sink=None, d_sink=None):
    assert dropout_p == 0.0, "the stand-in implements no dropout"
    right = 0 if is_causal else window_size_right
    _record("mha_bwd", causal=is_causal, window=(window_size_left, right))
    grads = _grads(lambda q, k, v: _dense(q, k, v, softmax_scale, window_size_left, right), dout, q, k, v)
    return (*grads, None)


def mha_varlen_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, softmax_scale, zero_tensors, is_causal, window_size_left, window_size_right,
                   deterministic, dq=None, dk=None, dv=None, alibi_slopes=None, rng_state=None, gen=None,
                   cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, sink=None, d_sink=None):
    assert dropout_p == 0.0, "the stand-in implements no dropout"
    right = 0 if is_causal else window_size_right
    _record("mha_varlen_bwd", causal=is_causal, window=(window_size_left, right))
    fn = lambda q, k, v: _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_size_left, right)  # noqa: E731
    grads = _grads(fn, dout, q, k, v)
    return (*grads, None)


class _FlashAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window_size, deterministic,
                return_lse, is_grad):
        assert dropout_p == 0.0, "the stand-in implements no dropout"
        assert isinstance(deterministic, bool)
        if is_grad:
            assert return_lse, "the library's forward saves the lse for its backward: return_lse must be True"
        left, right = _window(causal, window_size)
        if scale is None:
            scale = q.shape[-1] ** -0.5
        args = (q.double(), k.double(), v.double())
        with torch.no_grad():
            if cu_q is None:
                out, lse = _dense(*args, scale, left, right)
            else:
                out, lse = _varlen(*args, cu_q, cu_k, scale, left, right)
        out = out.to(q.dtype)
        lse = lse.float()
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, causal, left, right, deterministic)
        return (out, lse) if return_lse else out

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, causal, left, right, deterministic = ctx.args
        if cu_q is None:
            dq, dk, dv, _ = mha_bwd(dout, q, k, v, out, lse, 0.0, scale, causal, left, right, deterministic)
        else:
            dq, dk, dv, _ = mha_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, scale, False,
                                           causal, left, right, deterministic)
        return (dq, dk, dv) + (None,) * 11


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1, 0), bias=None,
                    alibi_slopes=None, deterministic=True, return_lse=False, return_attn_probs=False,
                    how_v3_bf16_cvt=1, cu_seqlens_q=None, cu_seqlens_kv=None, sink_ptr=None, num_splits=0):
    """q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv] -> out [B, Sq, Hq, Dv] (, lse [B, Hq, Sq])."""
    assert q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "flash_attn_func takes BSHD tensors"
    assert q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
    assert bias is None and alibi_slopes is None and not return_attn_probs
    _record("flash_attn_func", causal=causal, window_size=tuple(window_size), return_lse=return_lse,
            deterministic=deterministic)
    is_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _FlashAttn.apply(q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, softmax_scale, causal,
                            window_size, deterministic, return_lse, is_grad)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_q=0,
                           dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0, causal=False,
                           window_size=(-1, -1, 0), bias=None, alibi_slopes=None, deterministic=False,
                           return_lse=False, return_attn_probs=False, how_v3_bf16_cvt=1, block_table=None, out=None,
                           cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, sink_ptr=None):
    """q [Tq, Hq, D], k [Tk, Hk, D], v [Tk, Hk, Dv], int32 cu_seqlens [B + 1] -> out [Tq, Hq, Dv]
    (, lse [Hq, Tq])."""
    assert q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "flash_attn_varlen_func takes THD tensors"
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
    assert min_seqlen_q == 0 and logits_soft_cap == 0.0, "min_seqlen_q / logits_soft_cap were set (positional misuse?)"
    assert isinstance(dropout_p, float) and (softmax_scale is None or isinstance(softmax_scale, float))
    assert bias is None and alibi_slopes is None and not return_attn_probs and block_table is None and out is None
    _record("flash_attn_varlen_func", causal=causal, window_size=tuple(window_size), return_lse=return_lse,
            deterministic=deterministic)
    is_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _FlashAttn.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                            softmax_scale, causal, window_size, deterministic, return_lse, is_grad)
