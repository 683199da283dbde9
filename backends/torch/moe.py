"""TORCH adapter for moe_dispatch_combine: torch.distributed.all_to_all_single (NCCL on GPUs, gloo on CPUs).

Without ``num_worst_tokens`` one dispatch is three all_to_all_single calls:

1. counts: each rank sends every rank a row ``[rows for you, rows per each of your experts,
   my min expert id, my max expert id]``; the ``.tolist()`` of what was sent and received is the
   ONE host synchronisation of a dispatch (split sizes and receive-buffer size must be known on the
   host). The min/max columns let every rank see every rank's id range, so a bad id makes all ranks
   raise together instead of leaving some of them waiting in the next collective;
2. the token rows (as raw bytes, so every dtype, fp8 included, travels on NCCL and gloo alike);
3. the per-row metadata: local expert ids (int64) and probabilities (float32), packed as bytes.

The send order (by destination rank, then token index) is computed with a stable sort, not with
``nonzero``/boolean indexing, which would each add a host sync on GPUs. Combine and the cached
dispatch reuse the layout (send permutation + split sizes): one all_to_all each, no host sync.
Combine sums the rows that come back per destination-rank chunk (each chunk holds every token at
most once), so the floating-point summation order is fixed: rank order, on every device.

With ``num_worst_tokens = N > 0`` nothing is read back to the host (``TorchMoeFixedLayout``): every
rank sends every peer a fixed block of N row slots (a peer may be sent up to N rows, the most a
receiver keeps), so ``all_to_all_single`` runs with equal splits and no host split list, at the
cost of N rows per peer on the wire. There are two exchanges (rows, then metadata) and no separate
count exchange: a received slot is a real row iff one of its local expert ids is >= 0 (a token is
sent only to ranks that hold one of its experts), ``tokens_per_expert`` is counted on the device
from the received ids, and each metadata row also carries its sender's row count for this rank. The receiver compacts
the slots into its N rows in (source rank, token) order; rows past N are dropped (DeepEP leaves
that case undefined) and ``layout.num_recv``, a device scalar summed from the row counts each
slot carries, tells how many rows were meant for this rank. Ids outside ``[-1, num_experts)`` are routed nowhere
instead of raised on, since detecting them would need a host read. Combine sums in the same rank
order as the synchronising path, so both paths give bit-identical results.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from turbo_dispatch.adapter import Adapter
from turbo_dispatch.ops.moe import dispatch_layout

_ACC = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


@dataclass(frozen=True)
class TorchMoeLayout:
    """The TORCH backend's part of a MoeHandle."""

    send_tokens: torch.Tensor  # [S] int64: source token of each sent row, ordered by (dest rank, token)
    send_splits: tuple  # rows sent to each rank
    recv_splits: tuple  # rows received from each rank
    num_tokens: int  # T: rows of the dispatched x
    num_recv: int  # R = sum(recv_splits), also the rows of the returned buffers

    @property
    def recv_rows(self) -> int:
        return self.num_recv


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """[N, C] of any dtype -> [N, C * itemsize] uint8 (a view of a contiguous copy)."""
    if not rows.numel():  # an empty tensor counts as contiguous whatever its strides, which view() rejects
        return torch.empty((rows.shape[0], rows.shape[1] * rows.element_size()), dtype=torch.uint8, device=rows.device)
    return rows.contiguous().view(torch.uint8)


def _exchange(rows: torch.Tensor, out_rows: int, in_splits, out_splits, group: Any) -> torch.Tensor:
    """all_to_all_single of byte rows; returns [out_rows, C * itemsize] uint8."""
    import torch.distributed as dist

    send = _as_bytes(rows)
    out = torch.empty((out_rows, send.shape[1]), dtype=torch.uint8, device=send.device)
    dist.all_to_all_single(out, send, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits),
                           group=group)
    return out


@dataclass(frozen=True)
class TorchMoeFixedLayout:
    """The TORCH backend's layout under ``num_worst_tokens``: fixed-size per-peer slots, device-only."""

    slot_token: torch.Tensor  # [W * N] int64: source token of each sent slot, T for an empty slot
    recv_pos: torch.Tensor  # [W * N] int64: row of the returned buffers per received slot, N if unused/dropped
    num_tokens: int  # T
    num_recv: torch.Tensor  # 0-d int64 on the device: rows the senders had for this rank, dropped ones included
    recv_rows: int  # N


def _fixed_exchange(rows: torch.Tensor, group: Any) -> torch.Tensor:
    """Equal-split all_to_all_single of byte rows ([W * N, C] -> [W * N, C * itemsize] uint8)."""
    import torch.distributed as dist

    send = _as_bytes(rows)
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send, group=group)
    return out


def _with_zero_row(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` plus one trailing zero row, the target of every empty slot's gather index."""
    return torch.cat([rows, rows.new_zeros((1,) + tuple(rows.shape[1:]))])


class TorchMoeDispatchCombine(Adapter):
    """moe_dispatch / moe_combine over torch.distributed.all_to_all_single."""

    library = "torch.distributed"

    def version(self) -> str:
        return torch.__version__

    def available(self) -> str | None:
        import torch.distributed as dist

        return None if dist.is_available() else "this torch build has no torch.distributed"

    def describe(self, p) -> str:
        if getattr(p, "num_worst_tokens", 0):
            return ("all_to_all_single over the group's backend with fixed num_worst_tokens-row blocks per peer; no "
                    "host read (what CUDA-graph capture needs); synchronous on the current stream")
        return ("all_to_all_single over the group's backend (NCCL on GPUs, gloo on CPUs); one host sync per "
                "dispatch (the count exchange); synchronous on the current stream")

    def run(self, problem, *tensors, config=None):
        raise NotImplementedError("TorchMoeDispatchCombine is driven through dispatch()/combine() with a process "
                                  "group, not run()")

    # -- dispatch ------------------------------------------------------------------------------------
    def dispatch(self, p, x: torch.Tensor, token_indices: torch.Tensor, token_probs: Optional[torch.Tensor],
                 group: Any):
        if p.num_worst_tokens:
            return self._dispatch_fixed(p, x, token_indices, token_probs, group)
        import torch.distributed as dist

        world, num_experts, t, k = p.world_size, p.num_experts, x.shape[0], p.topk
        local = num_experts // world
        device = x.device

        # 1. counts (+ each rank's id range for the collective validity check): the one host sync
        to_rank, per_expert, in_rank = dispatch_layout(token_indices, num_experts, world)
        if token_indices.numel():
            lo, hi = token_indices.min().reshape(1), token_indices.max().reshape(1)
        else:
            lo = hi = torch.full((1,), -1, dtype=torch.int64, device=device)
        msg = torch.cat([to_rank[:, None], per_expert.view(world, local), lo.expand(world, 1), hi.expand(world, 1)], 1)
        got = torch.empty_like(msg)
        dist.all_to_all_single(got, msg, group=group)
        host = torch.cat([to_rank, got.reshape(-1)]).tolist()
        send_splits = tuple(host[:world])
        rows = [host[world + r * (local + 3): world + (r + 1) * (local + 3)] for r in range(world)]
        bad = [(r, row[local + 1], row[local + 2]) for r, row in enumerate(rows)
               if row[local + 1] < -1 or row[local + 2] >= num_experts]
        if bad:
            me = dist.get_rank(group)
            where = "; ".join(f"rank {r}{' (this rank)' if r == me else ''} passed ids in [{lo_}, {hi_}]"
                              for r, lo_, hi_ in bad)
            raise ValueError(f"moe_dispatch: token_indices must hold expert ids in [-1, num_experts={num_experts}); "
                             f"{where} (every rank of the group raises this)")
        recv_splits = tuple(row[0] for row in rows)
        tokens_per_expert = [sum(row[1 + e] for row in rows) for e in range(local)]
        num_send, num_recv = sum(send_splits), sum(recv_splits)

        # 2. send order: (destination rank, token); a stable sort keeps token order within a rank
        flat = in_rank.t().reshape(-1)  # position r * T + t
        order = torch.argsort((~flat).to(torch.uint8), stable=True)[:num_send]
        send_tokens = order % t if t else order
        send_rank = order // t if t else order

        # 3. token rows, straight into the receive buffer
        recv_x = _exchange(x.index_select(0, send_tokens), num_recv, send_splits, recv_splits, group).view(x.dtype)

        # 4. metadata: local expert ids and probabilities of every sent row
        ids = token_indices.index_select(0, send_tokens) - (send_rank * local)[:, None]
        is_local = (ids >= 0) & (ids < local)
        send_ids = torch.where(is_local, ids, torch.full((), -1, dtype=ids.dtype, device=device))
        meta = _exchange(_meta_bytes(send_ids, is_local, token_probs, send_tokens), num_recv, send_splits,
                         recv_splits, group)
        recv_idx, recv_probs = _split_meta(meta, k, token_probs)

        layout = TorchMoeLayout(send_tokens, send_splits, recv_splits, t, num_recv)
        return recv_x, recv_idx, recv_probs, tokens_per_expert, layout

    def _dispatch_fixed(self, p, x: torch.Tensor, token_indices: torch.Tensor, token_probs: Optional[torch.Tensor],
                        group: Any):
        """The ``num_worst_tokens`` dispatch: two equal-split exchanges (rows, metadata), no host read."""
        world, t, k, n = p.world_size, x.shape[0], p.topk, p.num_worst_tokens
        local = p.num_experts // world
        device = x.device

        # each (token, destination) pair gets slot r * N + (its rank among the tokens sent to r), or the
        # spill slot W * N when it is not sent or its slot is past N; the spill slot is cut off below
        to_rank, _, in_rank = dispatch_layout(token_indices, p.num_experts, world)
        within = torch.cumsum(in_rank.to(torch.int64), 0) - 1
        base = torch.arange(world, dtype=torch.int64, device=device) * n
        slot = torch.where(in_rank & (within < n), base + within, world * n).t().reshape(-1)
        token = torch.arange(t, dtype=torch.int64, device=device).repeat(world)
        slot_token = torch.full((world * n + 1,), t, dtype=torch.int64, device=device)
        slot_token.scatter_(0, slot, token)  # real slots are written once; only the spill slot repeats
        slot_token = slot_token[: world * n]
        slot_rank = torch.arange(world * n, dtype=torch.int64, device=device) // n

        recv = _fixed_exchange(_with_zero_row(_as_bytes(x)).index_select(0, slot_token), group)
        ids = _with_zero_row(token_indices).index_select(0, slot_token) - (slot_rank * local)[:, None]
        is_local = (ids >= 0) & (ids < local) & (slot_token < t)[:, None]
        send_ids = torch.where(is_local, ids, torch.full((), -1, dtype=ids.dtype, device=device))
        probs = None if token_probs is None else _with_zero_row(token_probs)
        # every slot also carries how many rows its sender has for this peer (slots past N included)
        sent = _as_bytes(to_rank.index_select(0, slot_rank)[:, None])
        meta = _fixed_exchange(torch.cat([sent, _meta_bytes(send_ids, is_local, probs, slot_token)], 1), group)
        slot_idx, slot_probs = _split_meta(meta[:, 8:], k, token_probs)
        num_recv = _bytes_as(meta[:, :8], torch.int64).view(world, n)[:, 0].sum()

        real = (slot_idx >= 0).any(1)
        pos = torch.cumsum(real.to(torch.int64), 0) - 1
        recv_pos = torch.where(real & (pos < n), pos, n)
        recv_x = _scatter_rows(recv, recv_pos, n, 0).view(x.dtype)
        recv_idx = _scatter_rows(slot_idx, recv_pos, n, -1)
        recv_probs = None if slot_probs is None else _scatter_rows(slot_probs, recv_pos, n, 0)
        per_expert = torch.zeros(local + 1, dtype=torch.int64, device=device)
        kept_ids = torch.where(recv_idx >= 0, recv_idx, local).reshape(-1)
        per_expert.scatter_add_(0, kept_ids, torch.ones_like(kept_ids))
        layout = TorchMoeFixedLayout(slot_token, recv_pos, t, num_recv, n)
        return recv_x, recv_idx, recv_probs, per_expert[:local], layout

    # -- cached dispatch / combine ---------------------------------------------------------------------
    def dispatch_rows(self, layout: "TorchMoeLayout | TorchMoeFixedLayout", rows: torch.Tensor,
                      group: Any) -> torch.Tensor:
        """[T, C] -> [recv_rows, C]: the handle's dispatch again, for other rows of the same tokens."""
        if isinstance(layout, TorchMoeFixedLayout):
            recv = _fixed_exchange(_with_zero_row(_as_bytes(rows)).index_select(0, layout.slot_token), group)
            return _scatter_rows(recv, layout.recv_pos, layout.recv_rows, 0).view(rows.dtype)
        return _exchange(rows.index_select(0, layout.send_tokens), layout.num_recv, layout.send_splits,
                         layout.recv_splits, group).view(rows.dtype)

    def combine(self, layout: "TorchMoeLayout | TorchMoeFixedLayout", y: torch.Tensor, group: Any) -> torch.Tensor:
        """[recv_rows, H] -> [T, H]: rows back to their sources, summed per source token."""
        acc = _ACC.get(y.dtype, y.dtype)
        if isinstance(layout, TorchMoeFixedLayout):
            back = _fixed_exchange(_with_zero_row(y).index_select(0, layout.recv_pos), group).view(y.dtype)
            world = back.shape[0] // layout.recv_rows if layout.recv_rows else 0
            splits, tokens, rows = (layout.recv_rows,) * world, layout.slot_token, layout.num_tokens + 1
        else:
            back = _exchange(y[: layout.num_recv], sum(layout.send_splits), layout.recv_splits, layout.send_splits,
                             group).view(y.dtype)
            splits, tokens, rows = layout.send_splits, layout.send_tokens, layout.num_tokens
        out = torch.zeros((rows, y.shape[1]), dtype=acc, device=y.device)
        back = back.to(acc)
        start = 0
        for n in splits:  # a chunk names every real token at most once (empty slots: row T): a fixed order
            if n:
                out.index_add_(0, tokens[start: start + n], back[start: start + n])
            start += n
        out = out[: layout.num_tokens]  # the fixed layout's empty slots land on the extra row T
        return out if acc == y.dtype else out.to(y.dtype)


def _meta_bytes(send_ids: torch.Tensor, is_local: torch.Tensor, token_probs: Optional[torch.Tensor],
                send_tokens: torch.Tensor) -> torch.Tensor:
    """Each sent row's metadata as one byte row: local ids (int64), then its probabilities where local, else 0."""
    parts = [_as_bytes(send_ids)]
    if token_probs is not None:
        probs = token_probs.index_select(0, send_tokens)
        parts.append(_as_bytes(torch.where(is_local, probs, torch.zeros((), dtype=probs.dtype, device=probs.device))))
    return torch.cat(parts, 1)


def _split_meta(meta: torch.Tensor, k: int, token_probs: Optional[torch.Tensor]):
    """The inverse of ``_meta_bytes`` on received byte rows: ``(ids [R, k] int64, probs [R, k] or None)``."""
    ids = _bytes_as(meta[:, : 8 * k], torch.int64)
    probs = None if token_probs is None else _bytes_as(meta[:, 8 * k:], token_probs.dtype)
    return ids, probs


def _bytes_as(columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Byte columns of wider rows reinterpreted as ``dtype``, through a compact copy: ``contiguous()``
    keeps a one-row slice's row stride, which ``view`` to a wider dtype rejects."""
    return columns.clone(memory_format=torch.contiguous_format).view(dtype)


def _scatter_rows(slots: torch.Tensor, pos: torch.Tensor, rows: int, fill) -> torch.Tensor:
    """Received slots placed at rows ``pos`` of a [rows, ...] buffer filled with ``fill``; pos == rows drops a slot."""
    out = torch.full((rows + 1,) + tuple(slots.shape[1:]), fill, dtype=slots.dtype, device=slots.device)
    out.index_copy_(0, pos, slots)
    return out[:rows]
