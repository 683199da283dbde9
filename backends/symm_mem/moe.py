"""SYMM_MEM: moe_dispatch / moe_combine over torch's symmetric memory, rows pushed by our kernels.

Every rank maps every peer's arena (``arena.SymmetricArena``), so a send is a store over NVLink
straight into the row where the receiver wants it: the sender knows that row because the first
phase all-gathers every rank's per-destination counts.

Dispatch, two phases:
  1. counts: each rank writes its row ``[rows per destination (W) | rows per global expert (E) |
     min id | max id]`` into row ``me`` of every peer's count table; barrier; every rank now holds
     the full table. Without ``num_worst_tokens`` the host reads it (the op's one sync: receive
     size, ``tokens_per_expert``, the collective bad-id check, buffer sizes).
  2. rows: token ``t`` goes to rank ``r`` at row ``sum_{s < me} C[s, r] + (its rank among this
     rank's tokens for r)``, which is the contract's order (source rank, then source token); its
     metadata (local expert ids, probabilities) goes to the same row of a metadata region; barrier;
     each rank copies its rows out of the arena (the arena is reused by the next phase, so results
     cannot be views of it).
Combine, one phase: each received row is pushed back to its source, into the slot the source
assigned to that (token, destination) pair; barrier; each source sums its slots per token in rank
order (fp32 for bf16/fp16, fp64 for fp64), so results match the TORCH backend bit for bit.
A cached dispatch (``dispatch_rows``) is phase 2 again with the handle's row map.

Under ``num_worst_tokens = N`` nothing is read on the host: buffers and the rows kept (the first N
in receive order, as the TORCH backend keeps) follow from N, counts stay on the device, and every
step is a kernel or a barrier on the current stream, so the whole round trip can be captured in a
CUDA graph after one eager call has sized the arena.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Generator, Optional

import torch

from turbo_dispatch.adapter import Adapter
from turbo_dispatch.ops.moe import check_id_ranges, dispatch_layout

from .arena import BARRIER, Grow, align_up

#: Row copies move at most this many elements per loop step (one program per row).
_BLOCK = 4096
_NUM_WARPS = 8
_ALIGN_ELEMS = 16


@dataclass(frozen=True)
class SymmMemLayout:
    """SYMM_MEM's part of a MoeHandle: where every row went and where it comes back."""

    arena: Any
    pair_src: torch.Tensor  # [T * W] int64: source token of pair (t, r) = t
    pair_rank: torch.Tensor  # [T * W] int64: destination rank of pair (t, r) = r
    dst_row: torch.Tensor  # [T * W] int64: receive row of pair (t, r) on rank r, -1 if not sent (or dropped)
    back_rank: torch.Tensor  # [recv_rows] int64: source rank of each received row
    back_dst: torch.Tensor  # [recv_rows] int64: its landing slot on the source, -1 for padding
    slot: torch.Tensor  # [T, W] int64: landing slot of pair (t, r) on this rank, -1 if nothing comes back
    n_valid: torch.Tensor  # [1] int64: real rows of the receive buffers
    num_tokens: int
    num_recv: "int | torch.Tensor"
    recv_rows: int
    rows_cap: int  # rows of the largest receive buffer in the group (rank-uniform)
    land_cap: int  # landing slots of the largest sender in the group (rank-uniform)


# -- kernel launches ------------------------------------------------------------------------------------
def _word(nbytes: int) -> torch.dtype:
    return torch.int32 if nbytes % 4 == 0 else torch.uint8


def _push(arena, src_bytes: torch.Tensor, pair_src: torch.Tensor, pair_rank: torch.Tensor, pair_dst: torch.Tensor,
          dst_offset: int, dst_stride: int) -> None:
    """Rows of ``src_bytes`` ([rows, nbytes] uint8, contiguous) into peers' current arena halves."""
    from .kernels import push_rows_kernel

    nbytes = src_bytes.shape[1]
    if not pair_dst.numel() or not nbytes or not src_bytes.shape[0]:
        return
    word = _word(nbytes)
    size = torch.empty((), dtype=word).element_size()
    src = src_bytes.view(word)
    push_rows_kernel[(pair_dst.numel(),)](
        src, src.stride(0), nbytes // size, pair_src, pair_rank, pair_dst, arena.local(word), arena.peer_delta(word),
        arena.phase, arena.half_bytes // size, dst_offset // size, dst_stride // size,
        BLOCK=min(_BLOCK, _pow2(nbytes // size)), ALIGN=_ALIGN_ELEMS, num_warps=_NUM_WARPS)


def _copy_out(arena, rows: int, nbytes: int, src_offset: int, src_stride: int, n_valid: torch.Tensor) -> torch.Tensor:
    """Rows ``[0, rows)`` of a region of this rank's current half as a new [rows, nbytes] uint8
    tensor; rows at or past ``n_valid`` come out as zeros."""
    from .kernels import copy_out_kernel

    out = torch.empty((rows, nbytes), dtype=torch.uint8, device=arena.device)
    if not rows or not nbytes:
        return out
    word = _word(nbytes)
    size = torch.empty((), dtype=word).element_size()
    dst = out.view(word)
    copy_out_kernel[(rows,)](arena.local(word), arena.phase, arena.half_bytes // size, src_offset // size,
                             src_stride // size, dst, dst.stride(0), nbytes // size, n_valid,
                             BLOCK=min(_BLOCK, _pow2(nbytes // size)), num_warps=_NUM_WARPS)
    return out


def _sum_landed(arena, slot: torch.Tensor, num_tokens: int, hidden: int, dtype: torch.dtype,
                land_stride: int) -> torch.Tensor:
    import triton
    import triton.language as tl

    from .kernels import sum_landed_kernel

    out = torch.empty((num_tokens, hidden), dtype=dtype, device=arena.device)
    if not out.numel():
        return out
    size = out.element_size()
    block = min(2048, _pow2(hidden))
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    sum_landed_kernel[(num_tokens, triton.cdiv(hidden, block))](
        arena.local(dtype), arena.phase, arena.half_bytes // size, 0, land_stride // size, slot, out, out.stride(0),
        hidden, WORLD=slot.shape[1], ACC=acc, BLOCK=block, num_warps=4)
    return out


def _pow2(n: int) -> int:
    return 1 << max(4, (max(n, 1) - 1).bit_length())


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """[N, C] of any dtype -> [N, C * itemsize] uint8 (a view of a contiguous copy)."""
    if not rows.numel():
        return torch.empty((rows.shape[0], rows.shape[1] * rows.element_size()), dtype=torch.uint8, device=rows.device)
    return rows.contiguous().view(torch.uint8)


def _bytes_as(columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return columns.clone(memory_format=torch.contiguous_format).view(dtype)


def _advance(arena) -> None:
    arena.phase.add_(1)


# -- the phases -------------------------------------------------------------------------------------------
def dispatch_phases(arena, p, x: torch.Tensor, token_indices: torch.Tensor, token_probs: Optional[torch.Tensor]
                    ) -> Generator[Any, None, tuple]:
    """moe_dispatch on one rank, as a phase generator (see ``arena.drive``)."""
    world, me, t, k, n = p.world_size, arena.rank, x.shape[0], p.topk, p.num_worst_tokens
    experts = p.num_experts
    local = experts // world
    device = x.device
    ranks = torch.arange(world, dtype=torch.int64, device=device)

    # -- phase 1: counts, all-gathered ------------------------------------------------------------------
    to_rank, per_expert, in_rank = dispatch_layout(token_indices, experts, world)
    if token_indices.numel():
        ends = torch.stack([token_indices.min(), token_indices.max()])
    else:
        ends = torch.full((2,), -1, dtype=torch.int64, device=device)
    msg = torch.cat([to_rank, per_expert, ends])
    msg_bytes = msg.numel() * 8
    msg_stride = align_up(msg_bytes)
    if world * msg_stride > arena.half_bytes:
        yield Grow(world * msg_stride)
    _push(arena, msg.view(torch.uint8)[None], torch.zeros_like(ranks), ranks, torch.full_like(ranks, me), 0,
          msg_stride)
    yield BARRIER
    table = _copy_out(arena, world, msg_bytes, 0, msg_stride, arena.all_rows).view(torch.int64)  # [W, W + E + 2]
    _advance(arena)

    counts = table[:, :world]  # counts[s, r]: rows rank s sends to rank r
    if n:
        recv_rows = rows_cap = n
        land_cap = world * n
        num_recv = counts[:, me].sum()
        n_valid = torch.clamp(num_recv, max=n).reshape(1)
        tokens_per_expert = None
    else:
        host = table.tolist()
        check_id_ranges([(row[world + experts], row[world + experts + 1]) for row in host], experts, me)
        host_counts = [row[:world] for row in host]
        num_recv = recv_rows = sum(row[me] for row in host_counts)
        rows_cap = max(sum(row[r] for row in host_counts) for r in range(world))
        land_cap = max(sum(row) for row in host_counts)
        n_valid = arena.all_rows
        tokens_per_expert = [sum(row[world + me * local + e] for row in host) for e in range(local)]

    # -- where every row goes, and where it comes back ----------------------------------------------------
    within = torch.cumsum(in_rank.to(torch.int64), 0) - 1  # [T, W]: rank of t among this rank's rows for r
    dst = counts[:me].sum(0) + within
    kept = in_rank & (dst < n) if n else in_rank
    none = torch.full((), -1, dtype=torch.int64, device=device)
    dst_row = torch.where(kept, dst, none).reshape(-1)
    pair_src = torch.arange(t, dtype=torch.int64, device=device).repeat_interleave(world)
    pair_rank = ranks.repeat(t)

    from_src = counts[:, me]
    recv_end = torch.cumsum(from_src, 0)
    i = torch.arange(recv_rows, dtype=torch.int64, device=device)
    back_rank = torch.clamp(torch.searchsorted(recv_end, i, right=True), max=world - 1)
    j = i - (recv_end - from_src)[back_rank]  # row i is the j-th row its source sent here
    if n:
        land = me * n + j
        slot = torch.where(kept, ranks * n + within, none)
    else:
        send_base = torch.cumsum(counts, 1) - counts  # [s, r]: rows s sends to ranks before r
        land = send_base[back_rank, me] + j
        slot = torch.where(in_rank, send_base[me] + within, none)
    back_dst = torch.where(i < n_valid, land, none)

    # -- phase 2: rows and their metadata -----------------------------------------------------------------
    ids = token_indices[:, None, :] - (ranks * local)[None, :, None]  # [T, W, k]
    is_local = (ids >= 0) & (ids < local)
    meta = [_as_bytes(torch.where(is_local, ids, none).reshape(t * world, k))]
    if token_probs is not None:
        probs = torch.where(is_local, token_probs[:, None, :], torch.zeros((), dtype=token_probs.dtype, device=device))
        meta.append(_as_bytes(probs.reshape(t * world, k)))
    meta = torch.cat(meta, 1)
    meta_bytes, row_bytes = meta.shape[1], x.shape[1] * x.element_size()
    meta_stride, row_stride = align_up(meta_bytes), align_up(row_bytes)
    data_offset = align_up(rows_cap * meta_stride)
    need = data_offset + rows_cap * row_stride
    if need > arena.half_bytes:
        yield Grow(need)
    _push(arena, _as_bytes(x), pair_src, pair_rank, dst_row, data_offset, row_stride)
    _push(arena, meta, torch.arange(t * world, dtype=torch.int64, device=device), pair_rank, dst_row, 0, meta_stride)
    yield BARRIER
    recv_x = _copy_out(arena, recv_rows, row_bytes, data_offset, row_stride, n_valid).view(x.dtype)
    recv_meta = _copy_out(arena, recv_rows, meta_bytes, 0, meta_stride, n_valid)
    _advance(arena)

    recv_idx = _bytes_as(recv_meta[:, : 8 * k], torch.int64)
    recv_probs = None if token_probs is None else _bytes_as(recv_meta[:, 8 * k:], token_probs.dtype)
    if n:
        recv_idx = torch.where((i < n_valid)[:, None], recv_idx, none)
        tokens_per_expert = torch.zeros(local + 1, dtype=torch.int64, device=device)
        named = torch.where(recv_idx >= 0, recv_idx, local).reshape(-1)
        tokens_per_expert.scatter_add_(0, named, torch.ones_like(named))
        tokens_per_expert = tokens_per_expert[:local]
    layout = SymmMemLayout(arena, pair_src, pair_rank, dst_row, back_rank, back_dst, slot, n_valid, t, num_recv,
                           recv_rows, rows_cap, land_cap)
    return recv_x, recv_idx, recv_probs, tokens_per_expert, layout


def dispatch_rows_phases(layout: SymmMemLayout, rows: torch.Tensor) -> Generator[Any, None, torch.Tensor]:
    """[T, C] -> [recv_rows, C] along the handle's row map (a cached dispatch), as a phase generator."""
    arena = layout.arena
    row_bytes = rows.shape[1] * rows.element_size()
    stride = align_up(row_bytes)
    if layout.rows_cap * stride > arena.half_bytes:
        yield Grow(layout.rows_cap * stride)
    _push(arena, _as_bytes(rows), layout.pair_src, layout.pair_rank, layout.dst_row, 0, stride)
    yield BARRIER
    out = _copy_out(arena, layout.recv_rows, row_bytes, 0, stride, layout.n_valid).view(rows.dtype)
    _advance(arena)
    return out


def combine_phases(layout: SymmMemLayout, y: torch.Tensor) -> Generator[Any, None, torch.Tensor]:
    """[recv_rows, H] -> [T, H]: rows back to their sources, summed per token, as a phase generator."""
    arena = layout.arena
    row_bytes = y.shape[1] * y.element_size()
    stride = align_up(row_bytes)
    if layout.land_cap * stride > arena.half_bytes:
        yield Grow(layout.land_cap * stride)
    i = torch.arange(y.shape[0], dtype=torch.int64, device=y.device)
    _push(arena, _as_bytes(y), i, layout.back_rank, layout.back_dst, 0, stride)
    yield BARRIER
    out = _sum_landed(arena, layout.slot, layout.num_tokens, y.shape[1], y.dtype, stride)
    _advance(arena)
    return out


# -- the adapter --------------------------------------------------------------------------------------------
_ARENAS: dict = {}


def _arena(group: Any, device: torch.device):
    import torch.distributed as dist

    from .arena import SymmetricArena

    group = group if group is not None else dist.group.WORLD
    key = (group.group_name, device)
    if key not in _ARENAS:
        _ARENAS[key] = SymmetricArena(group, device)
    return _ARENAS[key]


class SymmMemMoeDispatchCombine(Adapter):
    """moe_dispatch / moe_combine through symmetric memory: one push kernel per direction over NVLink."""

    library = "torch.distributed._symmetric_memory"

    def version(self) -> str:
        try:
            import triton

            return f"{torch.__version__}+triton-{triton.__version__}"
        except ImportError:
            return torch.__version__

    def available(self) -> str | None:
        import torch.distributed as dist

        if not dist.is_available():
            return "this torch build has no torch.distributed"
        if not torch.cuda.is_available():
            return "no CUDA device: symmetric memory maps peer GPUs' memory"
        try:
            importlib.import_module("torch.distributed._symmetric_memory")
        except ImportError as e:
            return f"this torch build has no symmetric memory ({e})"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed (the push/copy/sum kernels are Triton kernels)"
        return None

    def supports(self, p) -> str | None:
        if p.platform != "cuda":
            return f"symmetric memory needs CUDA GPUs of one host; platform is {p.platform}"
        return None

    def describe(self, p) -> str:
        sync = ("no host read (CUDA-graph capturable after one eager call)" if p.num_worst_tokens
                else "one host read of the all-gathered count table")
        return (f"rows pushed by Triton kernels into peers' symmetric-memory buffers over NVLink, one barrier per "
                f"phase; {sync}")

    def run(self, problem, *tensors, config=None):
        raise NotImplementedError("SymmMemMoeDispatchCombine is driven through dispatch()/combine() with a process "
                                  "group, not run()")

    def dispatch(self, p, x: torch.Tensor, token_indices: torch.Tensor, token_probs: Optional[torch.Tensor],
                 group: Any):
        from .arena import drive

        arena = _arena(group, x.device)
        return drive(dispatch_phases(arena, p, x, token_indices, token_probs), arena)

    def dispatch_rows(self, layout: SymmMemLayout, rows: torch.Tensor, group: Any) -> torch.Tensor:
        from .arena import drive

        return drive(dispatch_rows_phases(layout, rows), layout.arena)

    def combine(self, layout: SymmMemLayout, y: torch.Tensor, group: Any) -> torch.Tensor:
        from .arena import drive

        return drive(combine_phases(layout, y), layout.arena)
