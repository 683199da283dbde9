"""TORCH adapter for moe_dispatch_combine: torch.distributed.all_to_all_single (NCCL on GPUs, gloo on CPUs).

One dispatch is three all_to_all_single calls:

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
    num_recv: int  # R = sum(recv_splits)
    recv_rows: int  # rows of the returned buffers: R, or num_worst_tokens when padding


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """[N, C] of any dtype -> [N, C * itemsize] uint8 (a view of a contiguous copy)."""
    return rows.contiguous().view(torch.uint8)


def _exchange(rows: torch.Tensor, out_rows: int, in_splits, out_splits, group: Any,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """all_to_all_single of byte rows; returns [out_rows, C * itemsize] uint8 (or fills ``out``)."""
    import torch.distributed as dist

    send = _as_bytes(rows)
    if out is None:
        out = torch.empty((out_rows, send.shape[1]), dtype=torch.uint8, device=send.device)
    dist.all_to_all_single(out, send, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits),
                           group=group)
    return out


def _pad_rows(t: torch.Tensor, rows: int, value) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = torch.full((rows,) + tuple(t.shape[1:]), value, dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


class TorchMoeDispatchCombine(Adapter):
    """moe_dispatch / moe_combine over torch.distributed.all_to_all_single."""

    library = "torch.distributed"

    def version(self) -> str:
        return torch.__version__

    def available(self) -> str | None:
        import torch.distributed as dist

        return None if dist.is_available() else "this torch build has no torch.distributed"

    def describe(self, p) -> str:
        return ("all_to_all_single over the group's backend (NCCL on GPUs, gloo on CPUs); one host sync per "
                "dispatch (the count exchange); synchronous on the current stream")

    def run(self, problem, *tensors, config=None):
        raise NotImplementedError("TorchMoeDispatchCombine is driven through dispatch()/combine() with a process "
                                  "group, not run()")

    # -- dispatch ------------------------------------------------------------------------------------
    def dispatch(self, p, x: torch.Tensor, token_indices: torch.Tensor, token_probs: Optional[torch.Tensor],
                 group: Any):
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

        recv_rows = p.num_worst_tokens or num_recv
        # 3. token rows, straight into the (possibly padded) receive buffer; a padded tail is zeroed
        x_out = torch.empty((max(recv_rows, num_recv), p.hidden * x.element_size()), dtype=torch.uint8, device=device)
        x_out[num_recv:].zero_()
        _exchange(x.index_select(0, send_tokens), num_recv, send_splits, recv_splits, group, out=x_out[:num_recv])
        recv_x = x_out.view(x.dtype)

        # 4. metadata: local expert ids and probabilities of every sent row
        ids = token_indices.index_select(0, send_tokens) - (send_rank * local)[:, None]
        is_local = (ids >= 0) & (ids < local)
        send_ids = torch.where(is_local, ids, torch.full((), -1, dtype=ids.dtype, device=device))
        parts = [_as_bytes(send_ids)]
        if token_probs is not None:
            probs = token_probs.index_select(0, send_tokens)
            parts.append(_as_bytes(torch.where(is_local, probs, torch.zeros((), dtype=probs.dtype, device=device))))
        meta = _exchange(torch.cat(parts, 1), num_recv, send_splits, recv_splits, group)
        recv_idx = meta[:, : 8 * k].contiguous().view(torch.int64)
        recv_probs = meta[:, 8 * k:].contiguous().view(torch.float32) if token_probs is not None else None

        if p.num_worst_tokens and num_recv > p.num_worst_tokens:
            # raised after the exchanges, so the other ranks are not left waiting in a collective
            raise ValueError(f"moe_dispatch: this rank received {num_recv} rows, more than "
                             f"num_worst_tokens={p.num_worst_tokens}")
        if recv_rows > num_recv:
            recv_idx = _pad_rows(recv_idx, recv_rows, -1)
            if recv_probs is not None:
                recv_probs = _pad_rows(recv_probs, recv_rows, 0.0)
        layout = TorchMoeLayout(send_tokens, send_splits, recv_splits, t, num_recv, recv_rows)
        return recv_x, recv_idx, recv_probs, tokens_per_expert, layout

    # -- cached dispatch / combine ---------------------------------------------------------------------
    def dispatch_rows(self, layout: TorchMoeLayout, rows: torch.Tensor, group: Any) -> torch.Tensor:
        """[T, C] -> [recv_rows, C]: the handle's dispatch again, for other rows of the same tokens."""
        width = rows.shape[1] * rows.element_size()
        out = torch.empty((layout.recv_rows, width), dtype=torch.uint8, device=rows.device)
        if layout.recv_rows > layout.num_recv:
            out[layout.num_recv:].zero_()
        _exchange(rows.index_select(0, layout.send_tokens), layout.num_recv, layout.send_splits, layout.recv_splits,
                  group, out=out[: layout.num_recv])
        return out.view(rows.dtype)

    def combine(self, layout: TorchMoeLayout, y: torch.Tensor, group: Any) -> torch.Tensor:
        """[recv_rows, H] -> [T, H]: rows back to their sources, summed per source token."""
        back = _exchange(y[: layout.num_recv], sum(layout.send_splits), layout.recv_splits, layout.send_splits,
                         group).view(y.dtype)
        acc = _ACC.get(y.dtype, y.dtype)
        out = torch.zeros((layout.num_tokens, y.shape[1]), dtype=acc, device=y.device)
        back = back.to(acc)
        start = 0
        for n in layout.send_splits:  # each chunk names every token at most once: a fixed summation order
            if n:
                out.index_add_(0, layout.send_tokens[start: start + n], back[start: start + n])
            start += n
        return out if acc == y.dtype else out.to(y.dtype)
