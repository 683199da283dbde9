"""TRITON adapter for attention: our own flash attention kernels (attention_kernels.py).

Serves dense and varlen calls, bf16/fp16, head dims up to 256 (Dqk and Dv independently; dims
that are not powers of two run padded to the next one), MHA/GQA/MQA, bottom-right causal masks
and sliding windows, Sq != Sk, any softmax scale, with the lse. Refused, each with its reason:
fp32 inputs, dropout, platforms without a GPU (the CPU only under ``TRITON_INTERPRET=1``).

The backward is deterministic by construction (no atomics; a GQA group's dK/dV are summed
in-kernel, or as partial sums added in a fixed order when the group is split over programs), so
``deterministic=True`` is always honoured and costs nothing.

Adapter protocol (turbo_dispatch/ops/attention.py): ``forward`` returns ``(out, lse | None,
saved)`` with ``saved = (q, k, v, cu_q, cu_k, out, lse)``; ``backward`` starts from that out and
lse (nothing is recomputed), and so does ``compiled_backward`` from the forward op's out and lse,
which ``compiled_forward`` always returns. No call reads cu_seqlens on the host or syncs it, so
every call can be captured in a CUDA graph.

Configs are forward tiles ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``, a few per head dim
(``configs()``, the first being the default); the autotuner times the forward (``run``). The
backward's tiles come from ``BWD_TILES`` per head dim.
"""
from __future__ import annotations

import functools
from typing import Hashable, Optional, Sequence

import torch

from turbo_dispatch.adapter import Adapter

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


def _fit(tile: tuple, sq: int, sk: int) -> tuple:
    """``tile`` with its query (BLOCK_M) and key (BLOCK_N) blocks no larger than the sequences
    need (short sequences would otherwise compute mostly padding)."""
    bm, bn, *rest = tile
    return (max(_MIN_BLOCK, min(bm, _pow2(sq))), max(_MIN_BLOCK, min(bn, _pow2(sk))), *rest)


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


def attend(p, q, k, v, cu_q, cu_k, tile) -> tuple[torch.Tensor, torch.Tensor]:
    """(out shaped like q with v's head dim, float32 lse in the API's layout)."""
    bm, bn, warps, stages = tile
    out = _fresh(p, (*q.shape[:-1], p.head_dim_v), q)
    lse_shape = (p.heads_q, p.total_q) if p.varlen else (p.batch, p.heads_q, p.seqlen_q)
    lse = _fresh(p, lse_shape, q, torch.float32, fill=float("-inf"))
    grid = (p.batch * p.heads_q, _cdiv(p.seqlen_q, bm))
    AK.attn_fwd_kernel[grid](
        q, k, v, out, lse, _cu(cu_q, lse), _cu(cu_k, lse),
        *_dims(q, p.varlen), *_dims(k, p.varlen), *_dims(v, p.varlen), *_dims(out, p.varlen),
        *_lse_dims(lse, p.varlen), p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_q // p.heads_kv,
        p.softmax_scale * AK.LOG2E, VARLEN=p.varlen, D_QK=p.head_dim_qk, D_V=p.head_dim_v,
        BLOCK_DQK=block_dim(p.head_dim_qk), BLOCK_DV=block_dim(p.head_dim_v), BLOCK_M=bm, BLOCK_N=bn,
        REVERSE=p.window_right >= 0, UPCAST=_upcast(q.dtype), num_warps=warps, num_stages=stages,
        **_window_args(p))
    return out, lse


def attend_backward(p, q, k, v, cu_q, cu_k, out, lse, grad_out, tiles,
                    splits: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the forward's out and lse. ``splits`` (programs per kv head of the dK/dV
    kernel) defaults to ``gqa_splits``'s choice."""
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
    return dq, dk, dv


class TritonAttention(Adapter):
    """Flash attention forward and backward in plain Triton; deterministic backward always."""

    library = "triton"

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
        return f"triton-{self.version()}:{type(self).__name__}/{AK.KERNEL_REVISION}{suffix}"

    def supports(self, p) -> Optional[str]:
        if p.platform not in ("cuda", "rocm") and not (p.platform == "cpu" and AK.interpreting()):
            return f"Triton kernels run on cuda/rocm GPUs (platform is {p.platform}; TRITON_INTERPRET=1 runs them on cpu)"
        if p.dtype not in _HALF:
            return f"the Triton attention kernels take bf16/fp16 (dtype is {p.dtype}); TORCH serves fp32"
        if p.dropout_p > 0:
            return "dropout is not implemented in the Triton attention kernels"
        if max(p.head_dim_qk, p.head_dim_v) > 256:
            return f"head dims q/k {p.head_dim_qk}, v {p.head_dim_v}: the Triton kernels take up to 256"
        return None

    def configs(self, p) -> Sequence[Hashable]:
        tiles = FWD_TILES[_family(p)][_table_key(p)]
        return list(dict.fromkeys(_fit(t, p.seqlen_q, p.seqlen_k) for t in tiles))

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
        if p.window_left < 0 and p.window_right == 0:
            parts.append("causal: key blocks past the diagonal skipped")
        elif p.window_left >= 0 or p.window_right >= 0:
            parts.append(f"window ({p.window_left}, {p.window_right}): key blocks outside it skipped")
        if p.heads_kv != p.heads_q:
            parts.append(f"GQA {p.heads_q}/{p.heads_kv}: dK/dV summed over each group in-kernel")
        pads = [f"{d}->{block_dim(d)}" for d in dict.fromkeys((p.head_dim_qk, p.head_dim_v)) if block_dim(d) != d]
        if pads:
            parts.append("head dims padded " + ", ".join(pads))
        parts.append("deterministic backward (no atomics)")
        return "; ".join(parts)

    # -- the attention adapter protocol ---------------------------------------------------------------
    def forward(self, p, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, config=None):
        """(out, lse if asked for, saved). ``saved`` holds detached out and lse: the op's autograd
        node keeps it, and the returned tensors themselves would point back at that node."""
        out, lse = attend(p, q, k, v, cu_seqlens_q, cu_seqlens_k, self._tile(p, config))
        saved = (q, k, v, cu_seqlens_q, cu_seqlens_k, out.detach(), lse.detach())
        return out, (lse if p.return_lse else None), saved

    def backward(self, p, saved, grad_out, config=None):
        """(dq, dk, dv) from ``saved = (q, k, v, cu_q, cu_k, out, lse)``."""
        return attend_backward(p, *saved, grad_out, self.backward_tiles(p))

    def compiled_forward(self, p, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, config=None):
        """(out, lse): the lse always, for the backward op."""
        return attend(p, q, k, v, cu_seqlens_q, cu_seqlens_k, self._tile(p, config))

    def compiled_backward(self, p, saved, grad_out, config=None):
        return self.backward(p, saved, grad_out, config)

    def run(self, p, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, config=None):
        return attend(p, q, k, v, cu_seqlens_q, cu_seqlens_k, self._tile(p, config))[0]
