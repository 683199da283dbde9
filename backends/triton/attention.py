"""TRITON adapter for attention: our own flash attention kernels (attention_kernels.py).

Serves dense and varlen calls, bf16/fp16, head dims up to 256 (Dqk and Dv independently; dims
that are not powers of two run padded to the next one), MHA/GQA/MQA, bottom-right causal masks
and sliding windows, Sq != Sk, any softmax scale, with the lse; attention sinks (dense and varlen)
and fp8 (dense, ``flash_attn_fp8_func``; ``attention_features``). Refused, each with its reason:
fp32 inputs, dropout, platforms without a GPU (the CPU only under ``TRITON_INTERPRET=1``), fp8 on
ROCm (its kernels are checked on NVIDIA only) and on NVIDIA GPUs older than sm_89.

Sinks: the forward kernel opens each row's online softmax with the sink's term; the backward
kernels run unchanged from the forward's lse, and the sink's gradient is computed here in torch
from that lse and the backward's ``delta`` (``turbo_dispatch.ops.attention_sink.sink_grad``).

fp8: q, k, v are quantised here (``turbo_dispatch.ops.attention_fp8.quantize_tokens``; v with its
tokens innermost, the layout the PV product wants for an fp8 operand) and the forward kernel runs
both products on fp8 operands. The backward runs the high-precision kernels on the dequantised
q, k, v: the eager path saves the fp8 tensors and scales (half the bytes of bf16 copies) and
dequantises them, the compiled path quantises the saved inputs again (the same values). Forward
key blocks must lie inside one scale block and an fp8 ``tl.dot`` reduces over at least 32
elements, so fp8 tiles have ``32 <= BLOCK_N <= block_size`` (block sizes below 32 are refused)
and the q/k head dim is padded to at least 32.

The backward is deterministic by construction (no atomics; a GQA group's dK/dV are summed
in-kernel, or as partial sums added in a fixed order when the group is split over programs), so
``deterministic=True`` is always honoured and costs nothing.

Adapter protocol (turbo_dispatch/ops/attention.py): ``forward`` returns ``(out, lse | None,
saved)`` with ``saved = (q, k, v, cu_q, cu_k, out, lse, sink, scales)`` (fp8: q, k, v quantised and
their scales; else ``scales`` None); ``backward`` starts from that out and lse (nothing is
recomputed), and so does ``compiled_backward`` from the forward op's out and lse, which
``compiled_forward`` always returns. No call reads cu_seqlens on the host or syncs it, so
every call can be captured in a CUDA graph.

On sm_90 the dense and varlen bf16/fp16 forward with head dims 64 or 128 and no mask or a causal
one runs on the warp-specialised Gluon kernel of attention_gluon.py (TMA, wgmma), which writes the
same out and lse (varlen: cu_seqlens read on the device only), and the backward on those of
attention_gluon_bwd.py; ``attention_gluon.gluon_forward_refusal`` and
``attention_gluon_bwd.gluon_backward_refusal`` name every call they leave to the plain-Triton
kernels, and ``PRIMUS_TURBO_ATTN_GLUON=0`` (or ``PRIMUS_TURBO_GLUON_KERNELS=0``) switches the
forward off. The forward configs below then apply to the calls it refuses only.

Configs are forward tiles ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``, a few per head dim
(``configs()``, the first being the default); the autotuner times the forward (``run``). The
backward's tiles come from ``BWD_TILES`` per head dim.
"""
from __future__ import annotations

import functools
from typing import Hashable, Optional, Sequence

import torch

from turbo_dispatch.adapter import Adapter
from turbo_dispatch.ops.attention_fp8 import dequantize_tokens, quantize_tokens
from turbo_dispatch.ops.attention_sink import sink_grad

from . import attention_gluon as AG
from . import attention_gluon_bwd as AGB
from . import attention_kernels as AK

_HALF = (torch.bfloat16, torch.float16)

#: Forward tiles ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` offered per class of padded head
#: dims ``(q/k, v)`` (``_table_key``), first = default; NVIDIA and ROCm (64 KiB of LDS) apart.
#: The NVIDIA defaults were the fastest of a sweep on an H100 (B2 S4096 H32 bf16); the ROCm tables
#: are compile-checked for gfx942 only (no spills, LDS within 64 KiB).
FWD_TILES = {
    "cuda": {(64, 64): [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
             (128, 128): [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 32, 4, 3)],
             (256, 128): [(64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2)],
             (256, 256): [(128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 2), (64, 64, 4, 2)]},
    "rocm": {(64, 64): [(128, 64, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2)],
             (128, 128): [(128, 64, 4, 2), (64, 64, 4, 2), (128, 32, 4, 2)],
             (256, 128): [(64, 32, 4, 1), (64, 64, 4, 1), (32, 32, 4, 1)],
             (256, 256): [(64, 32, 4, 1), (64, 64, 4, 1), (32, 32, 4, 1)]},
}
#: Backward tiles per head-dim class: ``(dK/dV kernel, dQ kernel)``, each
#: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``. The dK/dV kernel holds BLOCK_N keys and walks
#: BLOCK_M queries at a time; the dQ kernel the other way round.
BWD_TILES = {
    "cuda": {(64, 64): ((32, 64, 4, 3), (128, 64, 8, 3)),
             (128, 128): ((32, 128, 8, 3), (128, 64, 8, 3)),
             (256, 128): ((16, 128, 8, 2), (128, 32, 8, 2)),
             (256, 256): ((32, 32, 4, 2), (128, 32, 8, 2))},
    "rocm": {(64, 64): ((32, 64, 4, 1), (64, 32, 4, 1)),
             (128, 128): ((32, 64, 4, 1), (64, 32, 4, 1)),
             (256, 128): ((16, 32, 4, 1), (32, 16, 4, 1)),
             (256, 256): ((16, 32, 4, 1), (32, 16, 4, 1))},
}
_MIN_BLOCK = 16  # tl.dot's smallest M/N/K
_MIN_FP8_K = 32  # tl.dot's smallest K for 8-bit operands (the head dim of QK^T, BLOCK_N of PV)
#: The SCALE_BLOCK of a per-tensor fp8 scale: longer than any sequence, so every token reads block 0.
_TENSOR_SCALE_BLOCK = 1 << 30


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def block_dim(d: int) -> int:
    """The padded head dim the kernels tile with: the next power of two, at least 16."""
    return max(_MIN_BLOCK, _pow2(d))


def _table_key(p) -> tuple[int, int]:
    """The tile tables' head-dim class: the padded (q/k, v) dims, at least 64; a pair without an
    entry of its own (v wider than q/k, say) takes the square class of the larger."""
    qk, v = (max(64, block_dim(d)) for d in (p.head_dim_qk, p.head_dim_v))
    return (qk, v) if (qk, v) in FWD_TILES["cuda"] else (max(qk, v),) * 2


def _family(p) -> str:
    return "rocm" if p.platform == "rocm" else "cuda"


def _fit(tile: tuple, sq: int, sk: int, min_n: int = _MIN_BLOCK) -> tuple:
    """``tile`` with its query (BLOCK_M) and key (BLOCK_N, at least ``min_n``) blocks no larger
    than the sequences need (short sequences would otherwise compute mostly padding)."""
    bm, bn, *rest = tile
    return (max(_MIN_BLOCK, min(bm, _pow2(sq))), max(min_n, min(bn, _pow2(sk))), *rest)


def _check_tile(config) -> tuple[int, int, int, int]:
    try:
        bm, bn, warps, stages = (int(x) for x in config)
    except (TypeError, ValueError):
        raise ValueError(f"TRITON attention config must be (BLOCK_M, BLOCK_N, num_warps, num_stages); "
                         f"got {config!r}") from None
    for name, b in (("BLOCK_M", bm), ("BLOCK_N", bn)):
        if b < _MIN_BLOCK or b & (b - 1):
            raise ValueError(f"TRITON attention config: {name}={b} must be a power of two >= {_MIN_BLOCK}")
    if warps not in (1, 2, 4, 8, 16) or stages < 1:
        raise ValueError(f"TRITON attention config: num_warps={warps}, num_stages={stages} are out of range")
    return bm, bn, warps, stages


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs_target(device: torch.device) -> int:
    """Programs that fill the device about twice over (a fixed small count under the interpreter,
    so its tests exercise split GQA groups)."""
    if device.type != "cuda":
        return 8
    return 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def gqa_splits(batch: int, heads_kv: int, group: int, key_blocks: int, target: int) -> int:
    """Programs per kv head of the dK/dV kernel: 1 (each program sums its whole GQA group) unless
    the grid would leave the device idle; then the largest divisor of the group that brings the
    grid near ``target`` programs."""
    programs = max(1, batch * heads_kv * key_blocks)
    want = -(-target // programs)
    return max(d for d in range(1, group + 1) if group % d == 0 and d <= max(1, want))


def _dims(x: torch.Tensor, varlen: bool) -> tuple[int, int, int, int]:
    """(batch, sequence, head, dim) strides of a dense [B, S, H, D] or packed [T, H, D] tensor."""
    return (0, *x.stride()) if varlen else tuple(x.stride())


def _lse_dims(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    """(batch, head) strides of a dense [B, H, S] or packed [H, T] lse (unit stride along tokens)."""
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def _window_args(p) -> dict:
    return dict(LEFT=max(p.window_left, 0), RIGHT=max(p.window_right, 0), HAS_LEFT=p.window_left >= 0,
                HAS_RIGHT=p.window_right >= 0)


def _upcast(dtype: torch.dtype) -> bool:
    return AK.interpreting() and dtype == torch.bfloat16


def _cu(cu: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    # Dense calls pass no cu_seqlens; the kernels never read the stand-in (VARLEN is off).
    return cu if cu is not None else like


def _fresh(p, shape, like: torch.Tensor, dtype=None, fill: float = 0.0) -> torch.Tensor:
    """An output buffer. Varlen ones start filled (0, or ``fill``): tokens past cu_seqlens[-1]
    (outside FlashAttention's contract) then read a defined value, not uninitialised memory."""
    if p.varlen:
        return torch.full(shape, fill, device=like.device, dtype=dtype or like.dtype)
    return torch.empty(shape, device=like.device, dtype=dtype or like.dtype)


def _scale_block(p) -> int:
    return (p.fp8_block or _TENSOR_SCALE_BLOCK) if p.fp8 else 1


def attend(p, q, k, v, cu_q, cu_k, tile, sink: Optional[torch.Tensor] = None,
           scales: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out shaped like q with v's head dim in the problem's dtype, float32 lse in the API's
    layout). ``sink``: the ``[Hq]`` logits of a call with sinks. ``scales``: fp8 calls' (q, k, v)
    dequantisation scales from ``quantize_tokens``, with q, k, v its e4m3 data."""
    bm, bn, warps, stages = tile
    out = _fresh(p, (*q.shape[:-1], p.head_dim_v), q, p.dtype)
    lse_shape = (p.heads_q, p.total_q) if p.varlen else (p.batch, p.heads_q, p.seqlen_q)
    lse = _fresh(p, lse_shape, q, torch.float32, fill=float("-inf"))
    scale_block = _scale_block(p)
    if p.fp8 and (scale_block % bn or bn < _MIN_FP8_K):
        raise ValueError(f"TRITON fp8 attention: BLOCK_N={bn} must be >= {_MIN_FP8_K} and divide the scale block "
                         f"{scale_block}")
    qs, ks, vs = scales if scales is not None else (lse,) * 3  # stand-ins: read under FP8 only
    sink = sink.contiguous() if sink is not None else lse  # a stand-in, never read without HAS_SINK
    grid = (p.batch * p.heads_q, _cdiv(p.seqlen_q, bm))
    AK.attn_fwd_kernel[grid](
        q, k, v, out, lse, _cu(cu_q, lse), _cu(cu_k, lse), sink, qs, ks, vs,
        *_dims(q, p.varlen), *_dims(k, p.varlen), *_dims(v, p.varlen), *_dims(out, p.varlen),
        *_lse_dims(lse, p.varlen), *(st for x in (qs, ks, vs) for st in x.stride()[:2]),
        p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_q // p.heads_kv,
        p.softmax_scale * AK.LOG2E, VARLEN=p.varlen, D_QK=p.head_dim_qk, D_V=p.head_dim_v,
        BLOCK_DQK=max(block_dim(p.head_dim_qk), _MIN_FP8_K if p.fp8 else 0), BLOCK_DV=block_dim(p.head_dim_v),
        BLOCK_M=bm, BLOCK_N=bn, REVERSE=p.window_right >= 0, UPCAST=_upcast(q.dtype), HAS_SINK=p.sink, FP8=p.fp8,
        SCALE_BLOCK=scale_block,
        num_warps=warps, num_stages=stages, **_window_args(p))
    return out, lse


def quantize_operands(p, q, k, v) -> tuple[tuple, tuple]:
    """((q8, k8, v8), (q, k, v scales)) of an fp8 call."""
    pairs = [quantize_tokens(x, p.fp8_block, token_contiguous=x is v) for x in (q, k, v)]
    return tuple(d for d, _ in pairs), tuple(sc for _, sc in pairs)


def attend_backward(p, q, k, v, cu_q, cu_k, out, lse, grad_out, tiles,
                    splits: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, delta) from the forward's out and lse; ``delta = rowsum(dO * O)`` in the lse's
    layout (what a sink's gradient needs). ``splits`` (programs per kv head of the dK/dV kernel)
    defaults to ``gqa_splits``'s choice."""
    (m1, n1, w1, s1), (m2, n2, w2, s2) = tiles
    group = p.heads_q // p.heads_kv
    grad_out = grad_out.to(q.dtype)
    lse = lse.contiguous()
    # Rows outside every sequence (varlen): +inf / 0 make their gradient contributions 0.
    lse2, delta = _fresh(p, lse.shape, lse, fill=float("inf")), _fresh(p, lse.shape, lse)
    cu_q, cu_k = _cu(cu_q, lse), _cu(cu_k, lse)
    lse_dims = _lse_dims(lse, p.varlen)
    common = dict(VARLEN=p.varlen, D_QK=p.head_dim_qk, D_V=p.head_dim_v, BLOCK_DQK=block_dim(p.head_dim_qk),
                  BLOCK_DV=block_dim(p.head_dim_v), UPCAST=_upcast(q.dtype))
    AK.attn_bwd_preprocess_kernel[(p.batch * p.heads_q, _cdiv(p.seqlen_q, m2))](
        out, grad_out, lse, lse2, delta, cu_q, *_dims(out, p.varlen), *_dims(grad_out, p.varlen), *lse_dims,
        p.seqlen_q, p.heads_q, VARLEN=p.varlen, D_V=p.head_dim_v, BLOCK_DV=block_dim(p.head_dim_v), BLOCK_M=m2)

    key_blocks = _cdiv(p.seqlen_k, n1)
    if splits is None:
        splits = gqa_splits(p.batch, p.heads_kv, group, key_blocks, _programs_target(q.device))
    if splits == 1:
        dk, dv = _fresh(p, k.shape, k), _fresh(p, v.shape, v)
        dk_part, dv_part, part_stride = dk, dv, (0, 0)
    else:
        dk_part = _fresh(p, (splits, *k.shape), k, torch.float32)
        dv_part = _fresh(p, (splits, *v.shape), v, torch.float32)
        part_stride = (dk_part.stride(0), dv_part.stride(0))
    scale2 = p.softmax_scale * AK.LOG2E
    AK.attn_bwd_dkdv_kernel[(p.batch * p.heads_kv * splits, key_blocks)](
        q, k, v, grad_out, dk_part, dv_part, lse2, delta, cu_q, cu_k,
        *_dims(q, p.varlen), *_dims(k, p.varlen), *_dims(v, p.varlen), *_dims(grad_out, p.varlen),
        part_stride[0], *_dims(dk_part[0] if splits > 1 else dk_part, p.varlen),
        part_stride[1], *_dims(dv_part[0] if splits > 1 else dv_part, p.varlen), *lse_dims,
        p.seqlen_q, p.seqlen_k, p.heads_kv, group, splits, scale2, p.softmax_scale,
        BLOCK_M=m1, BLOCK_N=n1, num_warps=w1, num_stages=s1, **common, **_window_args(p))
    if splits > 1:
        # A fixed-order reduction over the splits: the result does not depend on scheduling.
        dk, dv = dk_part.sum(0).to(k.dtype), dv_part.sum(0).to(v.dtype)

    dq = _fresh(p, q.shape, q)
    AK.attn_bwd_dq_kernel[(p.batch * p.heads_q, _cdiv(p.seqlen_q, m2))](
        q, k, v, grad_out, dq, lse2, delta, cu_q, cu_k,
        *_dims(q, p.varlen), *_dims(k, p.varlen), *_dims(v, p.varlen), *_dims(grad_out, p.varlen),
        *_dims(dq, p.varlen), *lse_dims, p.seqlen_q, p.seqlen_k, p.heads_q, group, scale2, p.softmax_scale,
        BLOCK_M=m2, BLOCK_N=n2, REVERSE=p.window_right >= 0, num_warps=w2, num_stages=s2, **common,
        **_window_args(p))
    return dq, dk, dv, delta


def _fp8_dot_reason() -> Optional[str]:
    """Why this process's GPU cannot run fp8 dots (None: it can, or the interpreter runs them)."""
    if AK.interpreting() or not torch.cuda.is_available() or torch.version.hip is not None:
        return None
    major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
    if (major, minor) < (8, 9):
        return f"fp8 attention needs fp8 tensor cores (sm_89 or newer); this GPU is sm_{major}{minor}"
    return None


class TritonAttention(Adapter):
    """Flash attention forward and backward in plain Triton; deterministic backward always."""

    library = "triton"
    attention_features = frozenset({"sink", "fp8"})

    def available(self) -> Optional[str]:
        if AK.triton is None:
            return "triton is not installed"
        if AK.interpreting():
            return None
        if not torch.cuda.is_available():
            return "no GPU (torch.cuda.is_available() is False) and TRITON_INTERPRET is not set"
        if torch.version.hip is None:
            major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
            if major < 8:
                return f"the kernels' bf16/fp16 dots need sm_80 or newer; this GPU is sm_{major}{minor}"
        return None

    def version(self) -> str:
        return AK.triton.__version__ if AK.triton is not None else "absent"

    def identity(self, config: Hashable = None) -> str:
        suffix = "" if config is None else f"/{tuple(config)}"
        # Both forward kernels' revisions (the timed forward is the Gluon one where it serves) and
        # the switches that change which Gluon kernels run, so that timings taken under one
        # setting never stand for another's in a tuning DB.
        pipeline = {None: "", True: "+pipelined", False: "+unpipelined"}[AG.pipeline_setting()]
        backward = "+plain-bwd" if AGB.switch_refusal() else f"+{AGB.KERNEL_REVISION}{AGB.variant_tag()}"
        return (f"triton-{self.version()}:{type(self).__name__}/{AK.KERNEL_REVISION}+{AG.KERNEL_REVISION}{pipeline}"
                f"{AG.variant_tag()}{AG.window_tag()}{backward}{suffix}")

    def supports(self, p) -> Optional[str]:
        if p.platform not in ("cuda", "rocm") and not (p.platform == "cpu" and AK.interpreting()):
            return f"Triton kernels run on cuda/rocm GPUs (platform is {p.platform}; TRITON_INTERPRET=1 runs them on cpu)"
        if p.dtype not in _HALF:
            return f"the Triton attention kernels take bf16/fp16 (dtype is {p.dtype}); TORCH serves fp32"
        if p.dropout_p > 0:
            return "dropout is not implemented in the Triton attention kernels"
        if max(p.head_dim_qk, p.head_dim_v) > 256:
            return f"head dims q/k {p.head_dim_qk}, v {p.head_dim_v}: the Triton kernels take up to 256"
        if p.fp8:
            if p.platform == "rocm":
                return "fp8 attention: the Triton fp8 kernels are checked on NVIDIA GPUs only (ROCm's e4m3 is fnuz)"
            if p.varlen:
                return "fp8 attention serves dense batches (its per-block scales follow each sequence's tokens)"
            if 0 < p.fp8_block < _MIN_FP8_K:
                return (f"fp8 attention takes block_size >= {_MIN_FP8_K}: an fp8 product reduces over at least "
                        f"{_MIN_FP8_K} keys and a key block must lie inside one scale block")
            if p.platform == "cuda":
                return _fp8_dot_reason()
        return None

    def configs(self, p) -> Sequence[Hashable]:
        tiles = FWD_TILES[_family(p)][_table_key(p)]
        if not p.fp8:
            fitted = list(dict.fromkeys(_fit(t, p.seqlen_q, p.seqlen_k) for t in tiles))
            # The Gluon forward ignores the tile: one candidate, so the tuner spends its time on
            # the backends instead of timing one kernel under several names.
            return fitted[:1] if AG.gluon_forward_refusal(p) is None else fitted
        # A key block lies inside one scale block and is at least an fp8 product's K.
        tiles = [(bm, max(_MIN_FP8_K, min(bn, _scale_block(p))), *rest) for bm, bn, *rest in tiles]
        return list(dict.fromkeys(_fit(t, p.seqlen_q, p.seqlen_k, _MIN_FP8_K) for t in tiles))

    def backward_tiles(self, p) -> tuple[tuple, tuple]:
        """(dK/dV tile, dQ tile) of this problem's backward."""
        dkdv, dq = BWD_TILES[_family(p)][_table_key(p)]
        return _fit(dkdv, p.seqlen_q, p.seqlen_k), _fit(dq, p.seqlen_q, p.seqlen_k)

    def _tile(self, p, config) -> tuple[int, int, int, int]:
        return self.configs(p)[0] if config is None else _check_tile(config)

    def describe(self, p) -> str:
        bm, bn, warps, stages = self.configs(p)[0]
        dkdv, dq = self.backward_tiles(p)
        layout = "packed varlen tokens (cu_seqlens read on the device)" if p.varlen else "the dense batch"
        parts = [f"Triton flash attention (FlashAttention-2 algorithm) on {layout}; forward tile {bm}x{bn}, "
                 f"{warps} warps, {stages} stages by default; backward dK/dV {dkdv[:2]}, dQ {dq[:2]}"]
        if AG.gluon_forward_refusal(p) is None:
            parts.append("forward on the warp-specialised Gluon kernel (TMA, wgmma) where q, k, v suit its TMA reads")
        if p.window_left < 0 and p.window_right == 0:
            parts.append("causal: key blocks past the diagonal skipped")
        elif p.window_left >= 0 or p.window_right >= 0:
            parts.append(f"window ({p.window_left}, {p.window_right}): key blocks outside it skipped")
        if p.heads_kv != p.heads_q:
            parts.append(f"GQA {p.heads_q}/{p.heads_kv}: dK/dV summed over each group in-kernel")
        pads = [f"{d}->{block_dim(d)}" for d in dict.fromkeys((p.head_dim_qk, p.head_dim_v)) if block_dim(d) != d]
        if pads:
            parts.append("head dims padded " + ", ".join(pads))
        if p.sink:
            parts.append("attention sinks: in the forward's softmax, their gradient from lse and delta")
        if p.fp8:
            scaling = f"{p.fp8_block}-token blocks" if p.fp8_block else "one scale per tensor"
            parts.append(f"fp8 e4m3 forward ({scaling}), backward in {str(p.dtype).replace('torch.', '')} from the "
                         "dequantised q, k, v")
        parts.append("deterministic backward (no atomics)")
        return "; ".join(parts)

    # -- the attention adapter protocol ---------------------------------------------------------------
    def _attend(self, p, q, k, v, cu_q, cu_k, config, sink) -> tuple:
        """(out, lse, the operands the backward keeps: (q, k, v, scales))."""
        tile = self._tile(p, config)
        if not p.fp8:
            if AG.gluon_forward_refusal(p, q, k, v) is None:
                return (*AG.attend(p, q, k, v, cu_q, cu_k), (q, k, v, None))
            return (*attend(p, q, k, v, cu_q, cu_k, tile, sink), (q, k, v, None))
        operands, scales = quantize_operands(p, q, k, v)
        return (*attend(p, *operands, cu_q, cu_k, tile, sink, scales), (*operands, scales))

    def _grads(self, p, q, k, v, cu_q, cu_k, out, lse, sink, grad_out) -> tuple:
        """(dq, dk, dv) and, for a call with a sink, dsink, from high-precision q, k, v; on the
        Gluon backward (attention_gluon_bwd.py) where its gate allows (never with a sink)."""
        if AGB.gluon_backward_refusal(p, q, k, v, out, grad_out) is None:
            return AGB.attend_backward(p, q, k, v, out, lse, grad_out, cu_q, cu_k)
        dq, dk, dv, delta = attend_backward(p, q, k, v, cu_q, cu_k, out, lse, grad_out, self.backward_tiles(p))
        return (dq, dk, dv, sink_grad(sink, lse, delta)) if p.sink else (dq, dk, dv)

    def forward(self, p, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, config=None, sink=None):
        """(out, lse if asked for, saved). ``saved`` holds detached out and lse: the op's autograd
        node keeps it, and the returned tensors themselves would point back at that node."""
        out, lse, (q_, k_, v_, scales) = self._attend(p, q, k, v, cu_seqlens_q, cu_seqlens_k, config, sink)
        saved = (q_, k_, v_, cu_seqlens_q, cu_seqlens_k, out.detach(), lse.detach(), sink, scales)
        return out, (lse if p.return_lse else None), saved

    def backward(self, p, saved, grad_out, config=None):
        """(dq, dk, dv[, dsink]) from ``saved = (q, k, v, cu_q, cu_k, out, lse, sink, scales)``."""
        q, k, v, cu_q, cu_k, out, lse, sink, scales = saved
        if scales is not None:
            q, k, v = (dequantize_tokens(x, sc, p.fp8_block, p.dtype) for x, sc in zip((q, k, v), scales))
        return self._grads(p, q, k, v, cu_q, cu_k, out, lse, sink, grad_out)

    def compiled_forward(self, p, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, config=None, sink=None):
        """(out, lse): the lse always, for the backward op."""
        return self._attend(p, q, k, v, cu_seqlens_q, cu_seqlens_k, config, sink)[:2]

    def compiled_backward(self, p, saved, grad_out, config=None, sink=None):
        """(dq, dk, dv[, dsink]) from the forward op's ``(q, k, v, cu_q, cu_k, out, lse)``; fp8 calls
        quantise q, k, v again and run on the dequantised values, as the eager backward does."""
        q, k, v, cu_q, cu_k, out, lse = saved
        if p.fp8:
            operands, scales = quantize_operands(p, q, k, v)
            q, k, v = (dequantize_tokens(x, sc, p.fp8_block, p.dtype) for x, sc in zip(operands, scales))
        return self._grads(p, q, k, v, cu_q, cu_k, out, lse, sink, grad_out)

    def run(self, p, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, config=None, sink=None):
        return self.compiled_forward(p, q, k, v, cu_seqlens_q, cu_seqlens_k, config, sink)[0]
