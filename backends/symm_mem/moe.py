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
     rank's tokens for r)``, which is the contract's order (source rank, then source token); the
     placement kernel stores its metadata (local expert ids, probabilities) into the same row of
     the receiver's metadata region, then its row is pushed; barrier; one receive kernel per row
     copies it out of the arena (reused by the next phase, so results cannot be views of it) and
     unpacks ids, probabilities, padding and, without a host read, the per-expert counts.
Combine, one phase: each received row is pushed back to its source, into the slot the source
assigned to that (token, destination) pair; barrier; each source sums its slots per token in rank
order (fp32 for bf16/fp16, fp64 for fp64), so results match the TORCH backend bit for bit.
A cached dispatch (``dispatch_rows``) is phase 2 again with the handle's row map.

Under ``num_worst_tokens = N`` nothing is read on the host: buffers and the rows kept (the first N
in receive order, as the TORCH backend keeps) follow from N, counts stay on the device, and every
step is a kernel or a barrier on the current stream, so the whole round trip can be captured in a
CUDA graph after one eager call has sized the arena; the adapter itself replays one per recurring
shape (``graphs.py``).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Generator, Optional

import torch

from turbo_dispatch.adapter import Adapter
from turbo_dispatch.ops.moe import check_id_ranges

from .arena import BARRIER, Grow, SymmetricArena, align_up, drive
from .graphs import GraphedCalls

#: Row copies move at most this many elements per loop step (one program per row).
_BLOCK = 4096
_NUM_WARPS = 8
_ALIGN_ELEMS = 16
#: Launch options of the small plan kernels.
_SMALL = dict(num_warps=4)


@dataclass(frozen=True)
class SymmMemLayout:
    """SYMM_MEM's part of a MoeHandle: where every row went and where it comes back."""

    arena: Any
    dst_row: torch.Tensor  # [T * W] int64: receive row of pair (t, r) on rank r, -1 if not sent (or dropped)
    back_rank: torch.Tensor  # [recv_rows] int64: source rank of each received row
    back_dst: torch.Tensor  # [recv_rows] int64: its landing slot on the source, -1 for padding
    slot: torch.Tensor  # [T * W] int64: landing slot of pair (t, r) on this rank, -1 if nothing comes back
    n_valid: torch.Tensor  # [1] int64: real rows of the receive buffers
    num_tokens: int
    num_recv: "int | torch.Tensor"
    recv_rows: int
    rows_cap: int  # rows of the largest receive buffer in the group (rank-uniform)
    land_cap: int  # landing slots of the largest sender in the group (rank-uniform)


# -- kernel launches ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _kernels() -> SimpleNamespace:
    """The kernels, each launched through a pre-bound plan per call shape (triton's per-launch
    argument binding is most of a small dispatch's host time); built on first use, since importing
    them needs triton."""
    from turbo_dispatch.backends.triton.prebound import PreboundKernel

    from . import kernels as K

    def bound(kernel, *per_call: str) -> PreboundKernel:
        return PreboundKernel(kernel, per_call=per_call)

    return SimpleNamespace(
        route_count=bound(K.route_count_kernel, "idx", "block_counts", "msg"),
        place=bound(K.place_kernel, "table", "idx", "probs", "block_counts", "dst_row", "slot", "local", "peer_delta",
                    "phase"),
        receive_plan=bound(K.receive_plan_kernel, "table", "back_rank", "back_dst", "num_recv", "n_valid"),
        push=bound(K.push_rows_kernel, "src", "pair_rank", "pair_dst", "local", "peer_delta", "phase"),
        copy_out=bound(K.copy_out_kernel, "local", "phase", "out", "n_valid"),
        receive=bound(K.receive_kernel, "local", "local_meta", "phase", "n_valid", "out", "recv_idx", "recv_probs",
                      "counts"),
        sum_landed=bound(K.sum_landed_kernel, "local", "phase", "slot", "out"),
        id_bias=K.ID_BIAS,
    )


def _word(nbytes: int) -> torch.dtype:
    return torch.int32 if nbytes % 4 == 0 else torch.uint8


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _fit(arena, nbytes: int) -> Generator[Any, None, None]:
    """Grows the arena (collectively) when a phase needs more than a half holds."""
    if nbytes > arena.half_bytes:
        yield Grow(nbytes)


def _push(arena, src_bytes: torch.Tensor, src_div: int, pair_dst: torch.Tensor, dst_offset: int, dst_stride: int,
          pair_rank: Optional[torch.Tensor] = None) -> None:
    """Pair p: row ``p // src_div`` of ``src_bytes`` ([rows, nbytes] uint8, contiguous) -> row
    ``pair_dst[p]`` of rank ``pair_rank[p]`` (default ``p % W``), current half, region ``dst_offset``."""
    nbytes = src_bytes.shape[1]
    if not pair_dst.numel() or not nbytes or not src_bytes.shape[0]:
        return
    word = _word(nbytes)
    size = word.itemsize
    src = src_bytes.view(word)
    _kernels().push.launch(
        (pair_dst.numel(),),
        (src, pair_dst if pair_rank is None else pair_rank, pair_dst, arena.local(word), arena.peer_delta(word),
         arena.phase),
        dict(src_stride=src.stride(0), row_words=nbytes // size, src_div=src_div, half_words=arena.half_bytes // size,
             dst_offset=dst_offset // size, dst_stride=dst_stride // size, WORLD=arena.world,
             RANKS_GIVEN=pair_rank is not None, BLOCK=min(_BLOCK, _pow2(nbytes // size)), ALIGN=_ALIGN_ELEMS),
        dict(num_warps=_NUM_WARPS))


def _copy_out(arena, rows: int, nbytes: int, src_offset: int, src_stride: int, n_valid: torch.Tensor) -> torch.Tensor:
    """Rows ``[0, rows)`` of a region of this rank's current half as a new [rows, nbytes] uint8
    tensor; rows at or past ``n_valid`` come out as zeros."""
    out = torch.empty((rows, nbytes), dtype=torch.uint8, device=arena.device)
    if not rows or not nbytes:
        return out
    word = _word(nbytes)
    size = word.itemsize
    dst = out.view(word)
    _kernels().copy_out.launch(
        (rows,), (arena.local(word), arena.phase, dst, n_valid),
        dict(half_words=arena.half_bytes // size, src_offset=src_offset // size, src_stride=src_stride // size,
             out_stride=dst.stride(0), row_words=nbytes // size, BLOCK=min(_BLOCK, _pow2(nbytes // size))),
        dict(num_warps=_NUM_WARPS))
    return out


def _sum_landed(arena, slot: torch.Tensor, num_tokens: int, hidden: int, dtype: torch.dtype,
                land_stride: int) -> torch.Tensor:
    import triton.language as tl

    out = torch.empty((num_tokens, hidden), dtype=dtype, device=arena.device)
    if not out.numel():
        return out
    size = out.element_size()
    block = min(2048, _pow2(hidden))
    _kernels().sum_landed.launch(
        (num_tokens, -(-hidden // block)), (arena.local(dtype), arena.phase, slot, out),
        dict(half_words=arena.half_bytes // size, land_offset=0, land_stride=land_stride // size,
             out_stride=out.stride(0), hidden=hidden, WORLD=arena.world,
             ACC=tl.float64 if dtype == torch.float64 else tl.float32, BLOCK=block),
        dict(num_warps=4))
    return out


def _receive(arena, rows: int, row_bytes: int, x_offset: int, x_stride: int, meta_stride: int, k: int,
             n_valid: torch.Tensor, probs_dtype: Optional[torch.dtype], counts: Optional[torch.Tensor],
             local_experts: int) -> tuple:
    """The received rows out of this rank's current half: ``(payload [rows, row_bytes] uint8,
    recv_idx [rows, k] int64, recv_probs [rows, k] or None)``; with ``counts`` the per-expert
    counts are added into it on the way (one kernel for all of it)."""
    out = torch.empty((rows, row_bytes), dtype=torch.uint8, device=arena.device)
    recv_idx = torch.empty((rows, k), dtype=torch.int64, device=arena.device)
    recv_probs = None if probs_dtype is None else torch.empty((rows, k), dtype=probs_dtype, device=arena.device)
    if not rows:
        return out, recv_idx, recv_probs
    word = _word(row_bytes)
    size = word.itemsize
    dst = out.view(word)
    _kernels().receive.launch(
        (rows,), (arena.local(word), arena.local(torch.int64), arena.phase, n_valid, dst, recv_idx,
                  recv_idx if recv_probs is None else recv_probs, recv_idx if counts is None else counts),
        dict(half_words=arena.half_bytes // size, half_meta=arena.half_bytes // 8, x_offset=x_offset // size,
             x_stride=x_stride // size, meta_stride=meta_stride // 8, out_stride=dst.stride(0),
             row_words=row_bytes // size, local_experts=local_experts, HAS_PROBS=recv_probs is not None,
             COUNT=counts is not None, TOPK=k, TOPK_P=_pow2(k, 2), BLOCK=min(_BLOCK, _pow2(row_bytes // size))),
        dict(num_warps=_NUM_WARPS))
    return out, recv_idx, recv_probs


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """[N, C] of any dtype -> [N, C * itemsize] uint8 (a view of a contiguous copy)."""
    if not rows.numel():
        return torch.empty((rows.shape[0], rows.shape[1] * rows.element_size()), dtype=torch.uint8, device=rows.device)
    return rows.contiguous().view(torch.uint8)


def _advance(arena) -> None:
    arena.phase.add_(1)


# -- the phases -------------------------------------------------------------------------------------------
def dispatch_phases(arena, p, x: torch.Tensor, token_indices: torch.Tensor, token_probs: Optional[torch.Tensor]
                    ) -> Generator[Any, None, tuple]:
    """moe_dispatch on one rank, as a phase generator (see ``arena.drive``)."""
    kern = _kernels()
    world, me, t, k, n = p.world_size, arena.rank, x.shape[0], p.topk, p.num_worst_tokens
    experts = p.num_experts
    local = experts // world
    device = x.device
    idx = token_indices.contiguous()
    world_p, topk_p = _pow2(world, 2), _pow2(k, 2)

    # -- phase 1: counts, all-gathered ------------------------------------------------------------------
    # one zeroed scratch holds the count message (built by atomics), the per-block counts and the
    # pair maps the handle keeps: one allocation and one fill instead of one per buffer
    block_t = max(16, 4096 // (topk_p * world_p))
    blocks = max(1, -(-t // block_t))
    n_msg = world + experts + 2
    scratch = torch.zeros(n_msg + blocks * world + 2 * t * world, dtype=torch.int64, device=device)
    msg = scratch[:n_msg]
    block_counts = scratch[n_msg: n_msg + blocks * world]
    dst_row = scratch[n_msg + blocks * world: n_msg + blocks * world + t * world]
    slot = scratch[n_msg + blocks * world + t * world:]
    sizes = dict(num_tokens=t, num_experts=experts, local_experts=local, TOPK=k, TOPK_P=topk_p, WORLD=world,
                 WORLD_P=world_p, BLOCK_T=block_t)
    kern.route_count.launch((blocks,), (idx, block_counts, msg), sizes, _SMALL)
    msg_bytes = n_msg * 8
    msg_stride = align_up(msg_bytes)
    yield from _fit(arena, world * msg_stride)
    _push(arena, msg.view(torch.uint8)[None], world, arena.me_rows, 0, msg_stride)
    yield BARRIER
    table = _copy_out(arena, world, msg_bytes, 0, msg_stride, arena.all_rows).view(torch.int64)  # [W, W + E + 2]
    _advance(arena)

    if n:
        recv_rows = rows_cap = n
        land_cap = world * n
        tokens_per_expert = None
    else:
        host = table.tolist()
        bias = kern.id_bias
        check_id_ranges([(bias - row[-2] if row[-2] else -1, row[-1] - bias if row[-1] else -1) for row in host],
                        experts, me)
        recv_rows = sum(row[me] for row in host)
        rows_cap = max(sum(row[r] for row in host) for r in range(world))
        land_cap = max(sum(row[:world]) for row in host)
        first = world + me * local
        tokens_per_expert = [sum(col) for col in zip(*(row[first: first + local] for row in host))]

    # -- phase 2: where every row goes (its metadata stored into the receiver on the way), the rows --------
    meta_bytes, row_bytes = 16 * k, x.shape[1] * x.element_size()
    meta_stride, row_stride = align_up(meta_bytes), align_up(row_bytes)
    data_offset = align_up(rows_cap * meta_stride)
    yield from _fit(arena, data_offset + rows_cap * row_stride)
    probs = token_probs.contiguous() if token_probs is not None else idx
    kern.place.launch(
        (blocks,), (table, idx, probs, block_counts, dst_row, slot, arena.local(torch.int64),
                    arena.peer_delta(torch.int64), arena.phase),
        dict(table_stride=table.stride(0), num_tokens=t, num_experts=experts, me=me, worst=n, local_experts=local,
             half_words=arena.half_bytes // 8, meta_stride=meta_stride // 8, HAS_PROBS=token_probs is not None,
             TOPK=k, TOPK_P=topk_p, WORLD=world, WORLD_P=world_p, BLOCK_T=block_t),
        _SMALL)
    # the receive plan (and, without a host read, the per-expert counts, which need zeros)
    plan = (torch.zeros if n else torch.empty)(2 * recv_rows + 2 + (local if n else 0), dtype=torch.int64,
                                                device=device)
    back_rank, back_dst = plan[:recv_rows], plan[recv_rows: 2 * recv_rows]
    num_recv_dev, n_valid = plan[2 * recv_rows: 2 * recv_rows + 1], plan[2 * recv_rows + 1: 2 * recv_rows + 2]
    kern.receive_plan.launch(
        (max(1, -(-recv_rows // 1024)),), (table, back_rank, back_dst, num_recv_dev, n_valid),
        dict(table_stride=table.stride(0), me=me, worst=n, recv_rows=recv_rows, WORLD=world, WORLD_P=world_p,
             BLOCK_R=1024), _SMALL)
    _push(arena, _as_bytes(x), world, dst_row, data_offset, row_stride)
    yield BARRIER
    if n:
        tokens_per_expert = plan[2 * recv_rows + 2:]  # counted by the receive kernel
    recv_x, recv_idx, recv_probs = _receive(arena, recv_rows, row_bytes, data_offset, row_stride, meta_stride, k,
                                            n_valid, token_probs.dtype if token_probs is not None else None,
                                            tokens_per_expert if n else None, local)
    _advance(arena)

    num_recv = num_recv_dev[0] if n else recv_rows
    layout = SymmMemLayout(arena, dst_row, back_rank, back_dst, slot, n_valid, t, num_recv, recv_rows, rows_cap,
                           land_cap)
    return recv_x.view(x.dtype), recv_idx, recv_probs, tokens_per_expert, layout


def dispatch_rows_phases(layout: SymmMemLayout, rows: torch.Tensor) -> Generator[Any, None, torch.Tensor]:
    """[T, C] -> [recv_rows, C] along the handle's row map (a cached dispatch), as a phase generator."""
    arena = layout.arena
    row_bytes = rows.shape[1] * rows.element_size()
    stride = align_up(row_bytes)
    yield from _fit(arena, layout.rows_cap * stride)
    _push(arena, _as_bytes(rows), arena.world, layout.dst_row, 0, stride)
    yield BARRIER
    out = _copy_out(arena, layout.recv_rows, row_bytes, 0, stride, layout.n_valid).view(rows.dtype)
    _advance(arena)
    return out


def combine_phases(layout: SymmMemLayout, y: torch.Tensor) -> Generator[Any, None, torch.Tensor]:
    """[recv_rows, H] -> [T, H]: rows back to their sources, summed per token, as a phase generator."""
    arena = layout.arena
    row_bytes = y.shape[1] * y.element_size()
    stride = align_up(row_bytes)
    yield from _fit(arena, layout.land_cap * stride)
    _push(arena, _as_bytes(y), 1, layout.back_dst, 0, stride, pair_rank=layout.back_rank)
    yield BARRIER
    out = _sum_landed(arena, layout.slot, layout.num_tokens, y.shape[1], y.dtype, stride)
    _advance(arena)
    return out


# -- the adapter --------------------------------------------------------------------------------------------
_ARENAS: dict = {}
#: Each arena's replayed graphs, keyed by the arena object (not its id, which a later object may reuse).
_GRAPHS: dict = {}


def _graphs(arena) -> GraphedCalls:
    graphs = _GRAPHS.get(arena)
    if graphs is None:
        graphs = _GRAPHS[arena] = GraphedCalls(arena)
    return graphs


_LAYOUT_TENSORS = ("dst_row", "back_rank", "back_dst", "slot", "n_valid")


def _dispatch_tensors(result: tuple) -> list:
    recv_x, recv_idx, recv_probs, counts, layout = result
    return [recv_x, recv_idx, recv_probs, counts, layout.num_recv, *(getattr(layout, f) for f in _LAYOUT_TENSORS)]


def _dispatch_rebuilt(result: tuple, tensors: list) -> tuple:
    layout = result[4]
    recv_x, recv_idx, recv_probs, counts, num_recv, *maps = tensors
    fields = dict(zip(_LAYOUT_TENSORS, maps), num_recv=num_recv)
    return recv_x, recv_idx, recv_probs, counts, dataclasses.replace(layout, **fields)


def _arena(group: Any, device: torch.device):
    import torch.distributed as dist

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
        if not p.intranode:
            return ("the group's ranks are not all on this host (symmetric memory maps the GPU memory of one "
                    "host's peers)")
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
        arena = _arena(group, x.device)
        call = lambda x, idx, probs: drive(dispatch_phases(arena, p, x, idx, probs), arena)  # noqa: E731
        inputs = (x, token_indices, token_probs)
        graphs = _graphs(arena)
        if not p.num_worst_tokens or not graphs.eligible(inputs):
            return call(*inputs)
        key = ("dispatch", p, x.shape[0], None if token_probs is None else token_probs.dtype)
        return graphs.run(key, call, inputs, (), _dispatch_tensors, _dispatch_rebuilt)

    def dispatch_rows(self, layout: SymmMemLayout, rows: torch.Tensor, group: Any) -> torch.Tensor:
        return drive(dispatch_rows_phases(layout, rows), layout.arena)

    def combine(self, layout: SymmMemLayout, y: torch.Tensor, group: Any) -> torch.Tensor:
        arena = layout.arena
        graphs = _graphs(arena)
        if not isinstance(layout.num_recv, torch.Tensor) or not graphs.eligible((y,)):
            return drive(combine_phases(layout, y), arena)
        maps = (layout.slot, layout.back_rank, layout.back_dst)

        def call(y, slot, back_rank, back_dst):
            return drive(combine_phases(dataclasses.replace(layout, slot=slot, back_rank=back_rank,
                                                            back_dst=back_dst), y), arena)

        key = ("combine", tuple(y.shape), y.dtype, layout.num_tokens, layout.recv_rows, layout.land_cap,
               tuple((m.untyped_storage().nbytes(), m.storage_offset(), m.numel()) for m in maps))
        return graphs.run(key, call, (y,), maps, lambda out: [out], lambda _, tensors: tensors[0])
