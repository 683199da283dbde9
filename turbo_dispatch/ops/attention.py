"""flash_attn_func and flash_attn_varlen_func: validation, problem keys, custom ops and autograd.

Semantics follow FlashAttention (>= 2.1):

* dense layout ``q [B, Sq, Hq, Dqk]``, ``k [B, Sk, Hkv, Dqk]``, ``v [B, Sk, Hkv, Dv]``; packed
  ("THD") layout for varlen, ``q [Tq, Hq, Dqk]`` with ``cu_seqlens_q`` int32 ``[B + 1]``;
* GQA/MQA when ``Hkv`` divides ``Hq`` (query head ``h`` reads kv head ``h // (Hq // Hkv)``);
* masks are aligned to the bottom-right corner: query ``i`` of a sequence with ``sq`` queries and
  ``sk`` keys sits at key position ``i + sk - sq`` and may attend key ``j`` when
  ``i + sk - sq - left <= j <= i + sk - sq + right`` (``window_size=(left, right)``, -1 =
  unbounded); ``causal=True`` sets ``right = 0`` (and overrides a right window, as FlashAttention
  does);
* a query row that may attend no key at all (causal with ``sq > sk``, say) outputs zeros, gets
  zero gradients and an lse of ``-inf`` (FlashAttention writes ``+inf`` there; ``-inf`` is the
  log of an empty sum and makes lse-weighted merging of partial results come out right);
* ``return_lse=True`` also returns the float32 log-sum-exp of the scaled scores, ``[B, Hq, Sq]``
  (dense) or ``[Hq, Tq]`` (varlen, FlashAttention 2's packed layout). Like FlashAttention's, the
  lse is not differentiable: no gradient flows back through it;
* ``sink`` (keyword, Primus-Turbo's name): one learnable logit per query head that joins every
  row's softmax denominator and contributes no value (GPT-OSS; see ``attention_sink``). The lse
  then includes it, a row that may attend no key has lse ``sink[h]``, and ``sink`` gets its
  gradient through autograd;
* fp8 (``flash_attn_fp8_func`` in ``attention_fp8``): the same call with q, k, v quantised to
  float8 e4m3 inside the backend (problem fields ``fp8`` and ``fp8_block``).

Backends and autograd. The backend is resolved once per call, in the forward. An attention
adapter exposes ``forward(problem, q, k, v, cu_q, cu_k, config) -> (out, lse | None, saved)`` and
``backward(problem, saved, grad_out, config) -> (dq, dk, dv)``, and may add the compiled path's
pair ``compiled_forward(problem, q, k, v, cu_q, cu_k, config) -> (out, lse | None)`` (no
autograd; an lse whenever its kernel returns one, asked for or not) and
``compiled_backward(problem, (q, k, v, cu_q, cu_k, out, lse), grad_out, config) -> (dq, dk, dv)``,
which lets the backward start from the forward's out and lse instead of recomputing them.
A call with a sink passes ``sink=`` to ``forward`` / ``compiled_forward`` / ``compiled_backward``
(never to a call without one), and ``backward`` / ``compiled_backward`` then return
``(dq, dk, dv, dsink)``. An adapter declares what it serves beyond plain attention in
``attention_features`` (``"sink"``, ``"fp8"``): its ``supports()`` refuses the rest by reason,
and a backend chosen for a sink or fp8 call without declaring the feature is an error, never a
call that silently drops the sink or the quantisation.
Adapters built on differentiable torch ops (``native_autograd = True``: TORCH and CUDNN) are
simply called with the autograd-tracked inputs in eager mode, so the backward is the autograd
graph their forward built (the backward node of the kernel that ran the forward; retain_graph,
checkpointing and saved-tensor hooks work as for any torch op). Other adapters go through ``_AttentionFunction``,
which keeps the deciding adapter in ``ctx`` and calls its ``backward``. Under torch.compile the
public functions call the custom ops ``turbo_dispatch::flash_attn_fwd`` / ``::flash_attn_bwd``.
The forward op always returns a float32 lse in the API's layout (the kernel's, or NaN when its
kernel returned none), and the backward op gets q, k, v, out and that lse; adapters without the
compiled pair get ``backward(problem, (q, k, v, cu_q, cu_k), ...)``, which recomputes. The
backward op resolves the forward's problem key again, which returns the forward's (cached)
decision unless backend settings were changed between the forward and the backward.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch

from ..backend_type import PrecisionType
from ..device_platform import platform_of
from ..errors import BackendUnsupportedError
from ..op_spec import OpSpec, precision_of_dtype, register_op
from ..resolver import resolve
from ._common import HIGH_PRECISION, check_rel, check_snr, require_bool, require_dtype, require_tensor
from .attention_sink import check_sink
from .attention_tuning import run_training_call
from .varlen_checks import check_cu_seqlens_values

MAX_HEAD_DIM = 256
#: The autotuner's correctness gate for fp8 attention against the high-precision reference: e4m3
#: keeps 3 mantissa bits, so the quantised products sit near 30 dB; 20 dB leaves margin.
FP8_GATE_DB = 20.0


class AttentionProblem(NamedTuple):
    """Key of one attention call; host-side facts only (never the cu_seqlens values).

    Dense calls: ``seqlen_q``/``seqlen_k`` are Sq/Sk and ``total_q = batch * seqlen_q``. Varlen
    calls: ``seqlen_q``/``seqlen_k`` are the caller's max_seqlen values and ``total_q``/``total_k``
    the packed token counts. The window is normalised: ``causal`` sets ``window_right = 0``,
    windows that cannot exclude any key become -1, and ``causal`` is True exactly when
    ``window_right == 0``. ``sink``: the call passes one (its values stay on the device). ``fp8``:
    q, k, v are quantised to e4m3 in the backend, with one scale per ``fp8_block`` tokens of one
    head (0: one scale per tensor).
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    total_q: int
    total_k: int
    heads_q: int
    heads_kv: int
    head_dim_qk: int
    head_dim_v: int
    dtype: torch.dtype
    causal: bool
    window_left: int
    window_right: int
    dropout_p: float
    softmax_scale: float
    deterministic: bool
    return_lse: bool
    varlen: bool
    platform: str
    sink: bool = False
    fp8: bool = False
    fp8_block: int = 0


# -- validation ------------------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def _window(op: str, window_size) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"{op}: window_size must be a pair (left, right) of ints >= -1; got {window_size!r}")
    left, right = window_size
    if not (_is_int(left) and _is_int(right)) or left < -1 or right < -1:
        raise ValueError(f"{op}: window_size must be a pair (left, right) of ints >= -1 (-1 = unbounded); "
                         f"got {window_size!r}")
    return int(left), int(right)


def _dropout(op: str, dropout_p) -> float:
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{op}: dropout_p must be a float in [0, 1); got {dropout_p!r}")
    return float(dropout_p)


def _scale(op: str, softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool) \
            or not math.isfinite(softmax_scale):
        raise TypeError(f"{op}: softmax_scale must be None or a finite float; got {softmax_scale!r}")
    return float(softmax_scale)


def _finish(op, q, k, v, batch, sq, sk, tq, tk, hq, hk, hv, dq, dk, dv, dropout_p, softmax_scale, causal,
            window_size, deterministic, return_lse, varlen, sink, fp8_block) -> AttentionProblem:
    """Checks shared by the dense and varlen calls; returns the normalised problem.
    ``fp8_block`` is None for a high-precision call."""
    require_dtype(op, "q.dtype", q.dtype, HIGH_PRECISION if fp8_block is None else (torch.bfloat16, torch.float16))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{op}: q, k and v must share one dtype; got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{op}: q, k and v must be on one device; got q on {q.device}, k on {k.device}, "
                         f"v on {v.device}")
    if hk != hv:
        raise ValueError(f"{op}: k and v must have the same number of heads; got k {hk}, v {hv}")
    if min(hq, hk) < 1 or hq % hk:
        raise ValueError(f"{op}: the heads of q ({hq}) must be a positive multiple of the heads of k/v ({hk}) "
                         "(GQA/MQA need Hkv to divide Hq)")
    if dk != dq:
        raise ValueError(f"{op}: q and k must have the same head dim; got q {dq}, k {dk}")
    if not (1 <= dq <= MAX_HEAD_DIM and 1 <= dv <= MAX_HEAD_DIM):
        raise ValueError(f"{op}: head dims must be in [1, {MAX_HEAD_DIM}]; got q/k {dq}, v {dv}")
    if min(batch, sq, sk, tq, tk) < 1:
        raise ValueError(f"{op}: batch, sequence lengths and token counts must be >= 1; got batch={batch}, "
                         f"seqlen_q={sq}, seqlen_k={sk}, tokens_q={tq}, tokens_k={tk}")
    require_bool(op, "causal", causal)
    require_bool(op, "deterministic", deterministic)
    require_bool(op, "return_lse", return_lse)
    left, right = _window(op, window_size)
    if causal:
        right = 0
    # Drop window sides that cannot exclude a key for any row (exact for every sequence, since
    # seqlen_q/seqlen_k bound each sequence's lengths): the key stays canonical.
    if left >= sk:
        left = -1
    if right >= sq - 1:
        right = -1
    return AttentionProblem(int(batch), int(sq), int(sk), int(tq), int(tk), int(hq), int(hk), int(dq), int(dv),
                            q.dtype, right == 0, left, right, _dropout(op, dropout_p),
                            _scale(op, softmax_scale, dq), deterministic, return_lse, varlen,
                            platform_of(q.device.type), check_sink(op, sink, hq, q.device), fp8_block is not None,
                            int(fp8_block or 0))


def attention_problem(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                      deterministic=False, return_lse=False, sink=None, fp8_block=None,
                      op="flash_attn_func") -> AttentionProblem:
    """Validates flash_attn_func's arguments and returns its problem key; ``fp8_block`` (None:
    not fp8) comes from ``flash_attn_fp8_func``, which names itself as ``op``."""
    require_tensor(op, "q", q, 4, "[batch, seqlen_q, heads_q, head_dim]")
    require_tensor(op, "k", k, 4, "[batch, seqlen_k, heads_kv, head_dim]")
    require_tensor(op, "v", v, 4, "[batch, seqlen_k, heads_kv, head_dim_v]")
    b, sq, hq, dq = q.shape
    bk, sk, hk, dk = k.shape
    bv, skv, hv, dv = v.shape
    if bk != b or bv != b:
        raise ValueError(f"{op}: q, k and v must have the same batch size; got q {b}, k {bk}, v {bv}")
    if skv != sk:
        raise ValueError(f"{op}: k and v must have the same seqlen_k; got k {sk}, v {skv}")
    return _finish(op, q, k, v, b, sq, sk, b * sq, b * sk, hq, hk, hv, dq, dk, dv, dropout_p, softmax_scale,
                   causal, window_size, deterministic, return_lse, False, sink, fp8_block)


def attention_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                             softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False,
                             return_lse=False, sink=None) -> AttentionProblem:
    """Validates flash_attn_varlen_func's arguments and returns its problem key.

    Only the shapes of cu_seqlens are read, never their values (that would sync the host). The
    caller promises what FlashAttention's contract says: ``cu_seqlens_*`` non-decreasing from 0 to
    the token count, and ``max_seqlen_*`` >= every sequence's length.
    """
    op = "flash_attn_varlen_func"
    require_tensor(op, "q", q, 3, "[total_q, heads_q, head_dim]")
    require_tensor(op, "k", k, 3, "[total_k, heads_kv, head_dim]")
    require_tensor(op, "v", v, 3, "[total_k, heads_kv, head_dim_v]")
    require_tensor(op, "cu_seqlens_q", cu_seqlens_q, 1, "[batch + 1] (int32 prefix sums)")
    require_tensor(op, "cu_seqlens_k", cu_seqlens_k, 1, "[batch + 1] (int32 prefix sums)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        require_dtype(op, f"{name}.dtype", cu.dtype, (torch.int32,))
        if cu.device != q.device:
            raise ValueError(f"{op}: {name} must be on q's device {q.device}; got {cu.device}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0] or cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"{op}: cu_seqlens_q and cu_seqlens_k must both have batch + 1 >= 2 entries; got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(value):
            raise TypeError(f"{op}: {name} must be a Python int (a host value, not a tensor); got {value!r}")
    tq, hq, dq = q.shape
    tk, hk, dk = k.shape
    tv, hv, dv = v.shape
    if tv != tk:
        raise ValueError(f"{op}: k and v must have the same number of tokens; got k {tk}, v {tv}")
    return _finish(op, q, k, v, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k, tq, tk, hq, hk, hv, dq, dk,
                   dv, dropout_p, softmax_scale, causal, window_size, deterministic, return_lse, True, sink, None)


def _out_shapes(p: AttentionProblem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if p.varlen:
        return (p.total_q, p.heads_q, p.head_dim_v), (p.heads_q, p.total_q)
    return (p.batch, p.seqlen_q, p.heads_q, p.head_dim_v), (p.batch, p.heads_q, p.seqlen_q)


# -- op spec (what the resolver and autotuner know) ---------------------------------------------------
def _even_cu_seqlens(total: int, batch: int, max_len: int, device) -> torch.Tensor:
    base, extra = divmod(total, batch)
    if base + (extra > 0) > max_len:
        raise ValueError(f"attention: {total} tokens in {batch} sequences cannot all be <= max_seqlen {max_len}")
    lens = [base + (i < extra) for i in range(batch)]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _make_inputs(p: AttentionProblem, device: torch.device):
    """Fresh random inputs for a key (autotuning works from keys alone): q, k, v, then
    cu_seqlens_q, cu_seqlens_k (varlen: the tokens split evenly over the sequences), then the
    float32 sink (calls with one)."""
    inputs = _make_attention_inputs(p, device)
    return (*inputs, torch.randn(p.heads_q, device=device)) if p.sink else inputs


def _make_attention_inputs(p: AttentionProblem, device: torch.device):
    if p.varlen:
        shapes = (p.total_q, p.heads_q, p.head_dim_qk), (p.total_k, p.heads_kv, p.head_dim_qk), \
                 (p.total_k, p.heads_kv, p.head_dim_v)
    else:
        shapes = (p.batch, p.seqlen_q, p.heads_q, p.head_dim_qk), (p.batch, p.seqlen_k, p.heads_kv, p.head_dim_qk), \
                 (p.batch, p.seqlen_k, p.heads_kv, p.head_dim_v)
    q, k, v = (torch.randn(s, device=device, dtype=p.dtype) for s in shapes)
    if not p.varlen:
        return q, k, v
    return (q, k, v, _even_cu_seqlens(p.total_q, p.batch, p.seqlen_q, device),
            _even_cu_seqlens(p.total_k, p.batch, p.seqlen_k, device))


def _reference_dense(p: AttentionProblem, q, k, v, sink=None) -> torch.Tensor:
    """Naive softmax(q k^T * scale + mask) v, one batch entry and query block at a time; a sink
    is one more (value-less) column of each row's softmax."""
    sq, sk = q.shape[1], k.shape[1]
    rep = p.heads_q // p.heads_kv
    out = q.new_zeros(q.shape[0], sq, p.heads_q, v.shape[-1])
    j = torch.arange(sk, device=q.device)
    step = max(1, (1 << 24) // max(1, p.heads_q * sk))
    for b in range(q.shape[0]):
        kb = k[b].repeat_interleave(rep, dim=1)
        vb = v[b].repeat_interleave(rep, dim=1)
        for s in range(0, sq, step):
            qb = q[b, s:s + step]
            scores = torch.einsum("qhd,khd->hqk", qb, kb) * p.softmax_scale
            diag = torch.arange(s, s + qb.shape[0], device=q.device)[:, None] + (sk - sq)
            allowed = torch.ones_like(scores[0], dtype=torch.bool)
            if p.window_right >= 0:
                allowed &= j[None] <= diag + p.window_right
            if p.window_left >= 0:
                allowed &= j[None] >= diag - p.window_left
            scores = scores.masked_fill(~allowed, float("-inf"))
            if sink is None:
                rows = allowed.any(-1, keepdim=True)
                probs = torch.softmax(scores.masked_fill(~rows, 0.0), -1) * rows
            else:
                column = sink.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
                probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
            out[b, s:s + step] = torch.einsum("hqk,khd->qhd", probs, vb)
    return out


def _reference(p: AttentionProblem, inputs) -> torch.Tensor:
    """float64 on the CPU (float32 on a GPU) reference of the output; varlen reads cu_seqlens on
    the host (this is test/tuning code, never the hot path)."""
    q, k, v = (x.double() if x.device.type == "cpu" else x.float() for x in inputs[:3])
    sink = inputs[-1].to(q.dtype) if p.sink else None
    if not p.varlen:
        return _reference_dense(p, q, k, v, sink)
    cu_q, cu_k = inputs[3].tolist(), inputs[4].tolist()
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for b in range(p.batch):
        (q0, q1), (k0, k1) = cu_q[b:b + 2], cu_k[b:b + 2]
        if q1 > q0:
            out[q0:q1] = _reference_dense(p, q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], sink)[0]
    return out


def _check(p: AttentionProblem, out, ref):
    if p.fp8:
        return check_snr(FP8_GATE_DB)(out, ref)
    return check_rel(out, ref) if p.dtype == torch.float32 else check_snr(40.0)(out, ref)


def _flops(p: AttentionProblem) -> float:
    """Forward FLOPs of the two matmuls over the unmasked (bottom-right causal: about half) scores;
    for varlen an upper bound from the max_seqlen values."""
    pairs = p.batch * p.seqlen_q * p.seqlen_k
    if p.causal and p.window_left < 0:
        pairs /= 2
    return 2.0 * pairs * p.heads_q * (p.head_dim_qk + p.head_dim_v)


def _problem_from_call(*args, **kwargs) -> AttentionProblem:
    """explain("attention", q, k, v, ...) for flash_attn_func's arguments, or, when the fourth
    argument (or keyword cu_seqlens_q) is given, flash_attn_varlen_func's."""
    if "cu_seqlens_q" in kwargs or (len(args) > 3 and isinstance(args[3], torch.Tensor)):
        return attention_varlen_problem(*args, **kwargs)
    return attention_problem(*args, **kwargs)


ATTENTION = register_op(OpSpec(
    name="attention",
    problem_type=AttentionProblem,
    precision_of=lambda p: PrecisionType.FP8 if p.fp8 else precision_of_dtype(p.dtype),
    make_inputs=_make_inputs,
    reference=_reference,
    check=_check,
    flops=_flops,
    problem_from_call=_problem_from_call,
    run=run_training_call,
))


# -- eager path --------------------------------------------------------------------------------------
def _sink_kw(p: AttentionProblem, sink: Optional[torch.Tensor]) -> dict:
    """``sink=`` for the adapter calls of a call with a sink, nothing otherwise: adapters that
    serve no sinks keep their signatures."""
    return {"sink": sink} if p.sink else {}


def _decision(p: AttentionProblem):
    """The resolver's decision for ``p``, refused when its backend does not declare the sink or
    fp8 feature the call needs (an adapter written before the feature would ignore it)."""
    decision = resolve(ATTENTION, p)
    served = getattr(decision.entry.adapter, "attention_features", ())
    missing = [name for name, wanted in (("sink", p.sink), ("fp8", p.fp8)) if wanted and name not in served]
    if missing:
        raise BackendUnsupportedError(
            f"attention backend {decision.backend} ({decision.source}) cannot serve a call with "
            f"{' and '.join(missing)}: its adapter does not declare {missing} in attention_features; "
            "pin a backend that does (TRITON)")
    return decision


class _AttentionFunction(torch.autograd.Function):
    """Autograd for adapters with an explicit backward: the forward's adapter runs the backward."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, sink, problem, adapter, config):
        out, lse, saved = adapter.forward(problem, q, k, v, cu_q, cu_k, config=config, **_sink_kw(problem, sink))
        ctx.problem, ctx.adapter, ctx.config, ctx.saved = problem, adapter, config, saved
        if lse is None:
            return out
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, *_grad_lse):
        grads = ctx.adapter.backward(ctx.problem, ctx.saved, grad_out, config=ctx.config)
        dsink = grads[3] if ctx.problem.sink else None
        return grads[0], grads[1], grads[2], None, None, dsink, None, None, None


def _run_eager(p: AttentionProblem, q, k, v, cu_q, cu_k, sink=None):
    decision = _decision(p)
    adapter = decision.entry.adapter
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, sink))
    if needs_grad and not getattr(adapter, "native_autograd", False):
        return _AttentionFunction.apply(q, k, v, cu_q, cu_k, sink, p, adapter, decision.config)
    out, lse, _ = adapter.forward(p, q, k, v, cu_q, cu_k, config=decision.config, **_sink_kw(p, sink))
    return (out, lse) if p.return_lse else out


# -- custom ops (the torch.compile path) ---------------------------------------------------------------
def _op_problem(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, wl, wr, deterministic,
                return_lse, sink, fp8, fp8_block) -> AttentionProblem:
    if cu_q is None:
        return attention_problem(q, k, v, dropout_p, softmax_scale, causal, (wl, wr), deterministic, return_lse, sink,
                                 fp8_block if fp8 else None, "flash_attn_fp8_func" if fp8 else "flash_attn_func")
    return attention_varlen_problem(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal,
                                    (wl, wr), deterministic, return_lse, sink)


def _no_compiled_dropout(p: AttentionProblem) -> None:
    if p.dropout_p > 0:
        raise NotImplementedError(
            "flash_attn: dropout_p > 0 is not supported under torch.compile: the compiled backward "
            "recomputes the forward and would draw a different dropout mask; run this call eagerly")


# The ops were renamed (from flash_attn / flash_attn_backward) when the backward op gained out and
# lse: torch's compiled-graph caches key a graph by the ops it calls, not by their registered
# autograd, so a warm cache would otherwise replay a backward graph built for the old arguments.
# For the same reason every call passes every argument (sink and the fp8 pair included): a graph
# traced before an argument existed never matches a graph traced after.
@torch.library.custom_op("turbo_dispatch::flash_attn_fwd", mutates_args=())
def _flash_attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                   cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                   softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                   deterministic: bool, return_lse: bool, sink: Optional[torch.Tensor], fp8: bool,
                   fp8_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    p = _op_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                    causal, window_left, window_right, deterministic, return_lse, sink, fp8, fp8_block)
    _no_compiled_dropout(p)
    decision = _decision(p)
    adapter = decision.entry.adapter
    with torch.no_grad():
        if hasattr(adapter, "compiled_forward"):
            out, lse = adapter.compiled_forward(p, q, k, v, cu_seqlens_q, cu_seqlens_k, config=decision.config,
                                                **_sink_kw(p, sink))
        else:
            out, lse, _ = adapter.forward(p, q, k, v, cu_seqlens_q, cu_seqlens_k, config=decision.config)
    if lse is None:
        # No lse came with this forward: NaN rather than uninitialised memory, so that a backward
        # that expected one (backend settings changed in between) gives NaN gradients, not
        # plausible wrong ones.
        lse = q.new_full(_out_shapes(p)[1], float("nan"), dtype=torch.float32)
    return out.contiguous(), lse.contiguous()


@_flash_attn_op.register_fake
def _flash_attn_fake(*args):
    p = _op_problem(*args)
    _no_compiled_dropout(p)
    out_shape, lse_shape = _out_shapes(p)
    return args[0].new_empty(out_shape), args[0].new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("turbo_dispatch::flash_attn_bwd", mutates_args=())
def _flash_attn_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                            cu_seqlens_k: Optional[torch.Tensor], sink: Optional[torch.Tensor], max_seqlen_q: int,
                            max_seqlen_k: int, dropout_p: float, softmax_scale: Optional[float], causal: bool,
                            window_left: int, window_right: int, deterministic: bool, return_lse: bool, fp8: bool,
                            fp8_block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink); dsink is an empty tensor for a call without a sink. An adapter that
    declares ``"sink"`` has the compiled pair (the recomputing fallback gets no sink)."""
    p = _op_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                    causal, window_left, window_right, deterministic, return_lse, sink, fp8, fp8_block)
    decision = _decision(p)  # the forward's key: its cached decision
    adapter = decision.entry.adapter
    if hasattr(adapter, "compiled_backward"):
        saved = (q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse)
        grads = adapter.compiled_backward(p, saved, grad_out, config=decision.config, **_sink_kw(p, sink))
    else:
        grads = adapter.backward(p, (q, k, v, cu_seqlens_q, cu_seqlens_k), grad_out, config=decision.config)
    dsink = grads[3] if p.sink else q.new_zeros(0)
    return grads[0].contiguous(), grads[1].contiguous(), grads[2].contiguous(), dsink


@_flash_attn_backward_op.register_fake
def _flash_attn_backward_fake(grad_out, q, k, v, out, lse, cu_q, cu_k, sink, *args):
    dsink = torch.empty_like(sink) if sink is not None else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


def _flash_attn_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k = inputs[:5]
    sink = inputs[14]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sink)
    ctx.args = inputs[5:14] + inputs[15:]
    ctx.has_sink = sink is not None
    ctx.mark_non_differentiable(lse)


def _flash_attn_backward(ctx, grad_out, _grad_lse):
    dq, dk, dv, dsink = torch.ops.turbo_dispatch.flash_attn_bwd(grad_out, *ctx.saved_tensors, *ctx.args)
    return (dq, dk, dv) + (None,) * 11 + (dsink if ctx.has_sink else None, None, None)


_flash_attn_op.register_autograd(_flash_attn_backward, setup_context=_flash_attn_setup)


# -- public API ----------------------------------------------------------------------------------------
def dense_attention(op: str, q, k, v, dropout_p, softmax_scale, causal, window_size, deterministic, return_lse,
                    sink, fp8_block):
    """flash_attn_func's work, shared with flash_attn_fp8_func (``fp8_block`` not None): the
    custom op under torch.compile, else the eager path."""
    if torch.compiler.is_compiling():
        left, right = _window(op, window_size)
        out, lse = torch.ops.turbo_dispatch.flash_attn_fwd(q, k, v, None, None, 0, 0, dropout_p, softmax_scale, causal,
                                                           left, right, deterministic, return_lse, sink,
                                                           fp8_block is not None, fp8_block or 0)
        return (out, lse) if return_lse else out
    p = attention_problem(q, k, v, dropout_p, softmax_scale, causal, window_size, deterministic, return_lse, sink,
                          fp8_block, op)
    return _run_eager(p, q, k, v, None, None, sink)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), deterministic: bool = False, return_lse: bool = False,
                    *, sink: Optional[torch.Tensor] = None):
    """Attention over dense batches, forward and backward, on the backend the resolver picks.

    ``q [B, Sq, Hq, Dqk]``, ``k [B, Sk, Hkv, Dqk]``, ``v [B, Sk, Hkv, Dv]`` (bf16/fp16/fp32,
    head dims <= 256, ``Hkv`` dividing ``Hq``); returns ``out [B, Sq, Hq, Dv]``, and with
    ``return_lse`` also the float32 ``lse [B, Hq, Sq]``. ``softmax_scale`` defaults to
    ``Dqk ** -0.5``; masks are bottom-right aligned (see the module docstring).
    ``deterministic=True`` asks for a backward without atomics (the TORCH backend then runs
    PyTorch's math kernel on GPUs; CUDNN refuses it). ``sink`` (``[Hq]`` float32/bf16/fp16,
    keyword only) adds one learnable logit per query head to every row's softmax denominator
    (GPT-OSS attention sinks); it gets a gradient like any input, the lse includes it, and the
    TRITON backend serves it (TORCH and CUDNN refuse it with their reason).

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> q, k, v = torch.randn(2, 5, 4, 16), torch.randn(2, 7, 2, 16), torch.randn(2, 7, 2, 8)
        >>> turbo.ops.flash_attn_func(q, k, v, causal=True).shape
        torch.Size([2, 5, 4, 8])
    """
    return dense_attention("flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, deterministic,
                           return_lse, sink, None)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), deterministic: bool = False,
                           return_lse: bool = False, *, sink: Optional[torch.Tensor] = None):
    """Attention over packed variable-length sequences ("THD"), forward and backward.

    ``q [Tq, Hq, Dqk]``, ``k [Tk, Hkv, Dqk]``, ``v [Tk, Hkv, Dv]``; sequence ``b`` holds tokens
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q (int32 prefix sums, ``[B + 1]``), likewise for
    k/v; ``max_seqlen_*`` are host ints >= every sequence's length. Masks are aligned per
    sequence. Returns ``out [Tq, Hq, Dv]`` and, with ``return_lse``, ``lse [Hq, Tq]`` float32.
    The problem key uses only host facts (token counts, B, max_seqlen values), never the
    cu_seqlens values, so this call never syncs the host to build its key. ``sink`` is
    flash_attn_func's (one logit per query head, shared by every sequence).

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        >>> q = k = v = torch.randn(8, 2, 16)
        >>> turbo.ops.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True).shape
        torch.Size([8, 2, 16])
    """
    if torch.compiler.is_compiling():
        left, right = _window("flash_attn_varlen_func", window_size)
        out, lse = torch.ops.turbo_dispatch.flash_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                           max_seqlen_k, dropout_p, softmax_scale, causal, left, right,
                                                           deterministic, return_lse, sink, False, 0)
        return (out, lse) if return_lse else out
    p = attention_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                 softmax_scale, causal, window_size, deterministic, return_lse, sink)
    check_cu_seqlens_values("flash_attn_varlen_func", cu_seqlens_q, cu_seqlens_k, p.total_q, p.total_k,
                            max_seqlen_q, max_seqlen_k)
    return _run_eager(p, q, k, v, cu_seqlens_q, cu_seqlens_k, sink)
