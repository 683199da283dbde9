"""A DeepEP-style ``Buffer`` facade over :func:`turbo_dispatch.ops.moe.moe_dispatch` / ``moe_combine``.

Code written against ``deep_ep.Buffer``'s normal (high-throughput) mode can swap in this class:

    buffer = Buffer(ep_group)
    n_rank, _, n_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    y, y_weights, _ = buffer.combine(expert_out, handle, topk_weights=recv_w)

How far it maps (everything else is documented per method):

* the backend is whatever the resolver picks for ``moe_dispatch_combine`` (TORCH by default);
  results are the same as DeepEP's: receive order by source rank then token, local expert ids with
  -1 for remote experts, zero weights where the id is -1, counts per local expert as a list;
* ``num_nvl_bytes`` / ``num_rdma_bytes`` are recorded and unused (no pre-registered buffers);
  ``config``, ``previous_event``, ``async_finish`` and ``allocate_on_comm_stream`` are accepted and
  have no effect: the work is synchronous on the current stream and the returned event is ``None``
  (DeepEP returns an ``EventOverlap``; code that calls ``event.current_stream_wait()`` must check
  for None);
* the layout tensors passed to ``dispatch`` are not read: the backend recomputes the layout from
  ``topk_idx`` (reading them back would cost a host sync);
* the handle is a :class:`~turbo_dispatch.ops.moe.MoeHandle`, not DeepEP's tuple of tensors;
* ``dispatch(num_worst_tokens=N)`` makes no host sync (fixed N-row outputs, counts on the device);
* ``num_tokens_per_rdma_rank`` is always None (there is no RDMA tier);
* low-latency mode (``low_latency_mode=True``, ``low_latency_dispatch``/``combine``) is not
  provided: the constructor raises NotImplementedError for it;
* everything is differentiable (DeepEP's buffer is not autograd-aware; wrapping it by hand is no
  longer needed here).
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from .ops.moe import (MoeHandle, _group_size, dispatch_layout, moe_combine, moe_dispatch, moe_dispatch_cached)
from .ops.moe_fp8 import fp8_payload, pack_rows, unpack_rows

log = logging.getLogger("turbo_dispatch.moe_buffer")


def _ignored(method: str, **flags: Any) -> None:
    used = {k: v for k, v in flags.items() if v not in (None, False)}
    if used and log.isEnabledFor(logging.DEBUG):
        log.debug("Buffer.%s: %s accepted for DeepEP compatibility and ignored (synchronous on the current stream)",
                  method, ", ".join(f"{k}={v!r}" for k, v in used.items()))


class Buffer:
    """Expert-parallel dispatch/combine with ``deep_ep.Buffer``'s normal-mode interface."""

    #: DeepEP's SM budget for its kernels; recorded only (the TORCH backend uses collectives).
    num_sms: int = 20

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False) -> None:
        if low_latency_mode:
            raise NotImplementedError("Buffer: low_latency_mode is not provided by turbo_dispatch's Buffer facade "
                                      "(no IBGDA/NVSHMEM transport); use the normal-mode dispatch/combine")
        import torch.distributed as dist

        self.group_size = _group_size("Buffer", group)
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = False
        self.explicitly_destroy = explicitly_destroy

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Recorded for compatibility; the collectives behind this facade do not take an SM budget."""
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> None:
        """No tuning config exists for the collective backends; ``dispatch(config=None)`` is the default."""
        return None

    @staticmethod
    def get_combine_config(num_ranks: int) -> None:
        return None

    @staticmethod
    def capture() -> None:
        """DeepEP returns an event on the current stream; work here is already in stream order."""
        return None

    def destroy(self) -> None:
        """Nothing to free (no pre-registered buffers)."""

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """``(num_tokens_per_rank [W] int32, None, num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool,
        None)``, with no communication and no host sync."""
        _ignored("get_dispatch_layout", previous_event=previous_event, async_finish=async_finish,
                 allocate_on_comm_stream=allocate_on_comm_stream)
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
            raise TypeError("Buffer.get_dispatch_layout: topk_idx must be a [num_tokens, topk] int64 tensor; got "
                            f"{getattr(topk_idx, 'dtype', type(topk_idx).__name__)} "
                            f"{tuple(getattr(topk_idx, 'shape', ()))}")
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % self.group_size:
            raise ValueError(f"Buffer.get_dispatch_layout: num_experts must be a positive multiple of the group size "
                             f"{self.group_size}; got {num_experts!r}")
        per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, self.group_size)
        return per_rank.to(torch.int32), None, per_expert.to(torch.int32), in_rank, None

    def dispatch(self, x, handle: Optional[MoeHandle] = None, num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Any = None, previous_event: Any = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, None)``.

        ``x`` is a tensor or DeepEP's ``(fp8 data, scales)`` tuple (recv_x then is a tuple too).
        Without ``handle``: ``topk_idx`` and ``num_tokens_per_expert`` (whose length gives
        num_experts) are required, the other layout tensors are accepted and not read. With
        ``handle`` (cached mode): only ``x`` moves, along the handle's layout, and the call returns
        ``(recv_x, None, None, None, None, None)`` as DeepEP does. The counts are rounded up to
        ``expert_alignment``; with ``num_worst_tokens`` > 0 the dispatch makes no host sync and the
        counts are an int64 device tensor (DeepEP returns an empty list there).
        """
        _ignored("dispatch", config=config, previous_event=previous_event, async_finish=async_finish,
                 allocate_on_comm_stream=allocate_on_comm_stream)
        data, scales = x if isinstance(x, tuple) else (x, None)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("Buffer.dispatch: with a handle (cached mode) topk_idx and topk_weights must be None")
            if scales is None:
                return moe_dispatch_cached(data, self.group, handle), None, None, None, None, None
            # one exchange: the fp8 rows and their scales side by side (as moe_dispatch sends them)
            payload = fp8_payload("Buffer.dispatch", (data, scales))
            rows = moe_dispatch_cached(pack_rows(payload.data, payload.scale), self.group, handle)
            return unpack_rows(rows, data.shape[1], scales), None, None, None, None, None
        if topk_idx is None or num_tokens_per_expert is None:
            raise ValueError("Buffer.dispatch: without a handle, topk_idx and num_tokens_per_expert (from "
                             "get_dispatch_layout; its length is num_experts) are required")
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ValueError(f"Buffer.dispatch: expert_alignment must be a positive int; got {expert_alignment!r}")
        num_experts = int(num_tokens_per_expert.numel())
        recv_x, recv_idx, recv_w, counts, new_handle = moe_dispatch(
            x, topk_idx, topk_weights, num_experts, self.group, num_worst_tokens=num_worst_tokens)
        if expert_alignment > 1:
            if isinstance(counts, torch.Tensor):
                counts = (counts + expert_alignment - 1) // expert_alignment * expert_alignment
            else:
                counts = [-(-c // expert_alignment) * expert_alignment for c in counts]
        return recv_x, recv_idx, recv_w, counts, new_handle, None

    def combine(self, x: torch.Tensor, handle: MoeHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: "torch.Tensor | Sequence[torch.Tensor] | None" = None, config: Any = None,
                previous_event: Any = None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """``(combined_x, combined_topk_weights or None, None)``: rows summed back onto their source
        tokens; ``topk_weights`` ([R, topk] float32, e.g. the dispatch's recv_topk_weights) are summed
        the same way, which restores each token's weights of the experts that were dispatched; ``bias``
        (one [T, H] tensor or up to two) is added to the combined rows, as in DeepEP."""
        _ignored("combine", config=config, previous_event=previous_event, async_finish=async_finish,
                 allocate_on_comm_stream=allocate_on_comm_stream)
        combined = moe_combine(x, self.group, handle)
        weights = None if topk_weights is None else moe_combine(topk_weights, self.group, handle)
        if bias is not None:
            for b in (bias if isinstance(bias, (tuple, list)) else (bias,)):
                if b is not None:
                    if not isinstance(b, torch.Tensor) or b.shape != combined.shape:
                        raise ValueError(f"Buffer.combine: bias must be [{handle.num_tokens}, {combined.shape[1]}] "
                                         f"tensors; got {tuple(getattr(b, 'shape', ()))}")
                    combined = combined + b.to(combined.dtype)
        return combined, weights, None
