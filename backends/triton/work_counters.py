"""Zeroed int32 work-item counters for persistent kernels that take their work items from a device
counter (``atomic_add``), handed out without an allocation and a memset launch per call.

A launch needs a counter that reads zero when its first program starts and that no launch running
beside it shares. ``torch.zeros(1)`` per launch gives that at the price of an allocation and a
fill launch on every call: host time in every eager training step. Here each (device, stream)
owns a buffer of ``SLOTS`` counters, zeroed once; launch ``i`` on that stream takes slot
``i mod SLOTS``, and the call that starts a new cycle queues one ``zero_()`` of the whole buffer
first. Stream order makes that sound: every launch that used a slot was queued on this stream
before the fill, and every later user after it. Slots are 16 bytes apart, so each keeps the
16-byte alignment Triton specialises pointers on.

While the current stream is being captured into a CUDA graph, a fresh ``torch.zeros(1)`` is
returned instead: a replay must zero its counter again, and the graph records that fill.
"""
from __future__ import annotations

import threading

import torch

#: Counters per (device, stream) buffer; one buffer fill per this many launches.
SLOTS = 4096
#: int32 elements between slots: 16 bytes.
_STRIDE = 4
#: Buffers kept at most (one per stream a kernel ran on); beyond it they start over. A dropped
#: buffer is freed to the caching allocator, which hands it to later work on its stream only.
_MAX_POOLS = 64


class _Pool:
    """One stream's buffer of counters and the index of the next free slot."""

    __slots__ = ("buffer", "views", "next", "lock")

    def __init__(self, device: torch.device, slots: int | None = None) -> None:
        slots = SLOTS if slots is None else slots
        self.buffer = torch.zeros(slots * _STRIDE, dtype=torch.int32, device=device)
        # Every slot's one-element view, made by one call here rather than one slicing per launch.
        self.views = self.buffer.view(slots, _STRIDE)[:, :1].unbind(0)
        self.next = 0
        self.lock = threading.Lock()

    def take(self) -> torch.Tensor:
        # The lock orders a new cycle's fill before any of its slots is handed out.
        with self.lock:
            i = self.next
            if i >= len(self.views):
                self.buffer.zero_()
                i = 0
            self.next = i + 1
        return self.views[i]


_pools: dict = {}
_pools_lock = threading.Lock()


def zeroed_counter(device: torch.device) -> torch.Tensor:
    """A one-element int32 CUDA tensor on ``device`` that reads zero for the next launch queued on
    ``device``'s current stream and is used by no other launch until that one finished. Valid for
    one launch, on the stream current at this call.

    >>> counter = zeroed_counter(torch.device("cuda"))  # doctest: +SKIP
    >>> counter.shape, counter.dtype  # doctest: +SKIP
    (torch.Size([1]), torch.int32)
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    key = (index, torch._C._cuda_getCurrentStream(index)[0])
    pool = _pools.get(key)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(key)
            if pool is None:
                if len(_pools) >= _MAX_POOLS:
                    _pools.clear()
                pool = _pools[key] = _Pool(torch.device("cuda", index))
    return pool.take()


__all__ = ["SLOTS", "zeroed_counter"]
