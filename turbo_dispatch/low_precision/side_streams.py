"""Two pieces of GPU work side by side: one on the current stream, one on a side stream.

The blockwise fp8 step uses this for pairs of kernels neither of which fills the GPU alone: the
activation's and the weight's quantisers (memory-bound), and the backward's dgrad and wgrad (each
one's last wave shares the GPU with the other's programs). Only in eager execution on real CUDA
tensors (``overlappable``); everywhere else the work runs in turn.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

import torch

from ..tracing import tracing


@functools.lru_cache(maxsize=None)
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index)


#: Per device: every stream a ``side_by_side`` call started from, in eager execution, by stream id.
_FORK_CALLERS: dict[int, dict[int, torch.cuda.Stream]] = {}
#: Per thread: per device, the (fork, join) events of the eager fast path (``_eager_side_by_side``).
_EVENTS = threading.local()
#: Stream objects for the current streams the eager fast path met, by (device, stream id): making one
#: per call is most of ``torch.cuda.current_stream``'s host time. Bounded (``_MAX_STREAMS``).
_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}
_MAX_STREAMS = 256


def _wait_for_callers(side: torch.cuda.Stream, current: torch.cuda.Stream, device_index: int) -> None:
    """Makes ``side`` wait for ``current`` and, outside a CUDA-graph capture, for every stream an
    earlier fork on this device started from.

    Why the earlier ones: the side stream's outputs come from its own pool of the caching
    allocator and are not ``record_stream``-ed on the caller's stream (the allocator's event
    bookkeeping would hold their blocks back while the GPU lags, and a step's allocations would
    then cost host time). A block a caller frees goes back to that pool at once; it is next handed
    out inside a later fork, whose side-stream work must then follow every caller-stream use of
    the block. Those uses were queued before the free, so waiting on each caller stream at the
    fork covers them, including a caller that since switched streams. Uses on other streams follow
    PyTorch's rule (the user's ``record_stream``). While capturing, the side stream joins the
    capture and allocates from the graph's private pool, so the eager streams are not waited on
    (an eager stream cannot be waited on inside a capture)."""
    side.wait_stream(current)
    if torch.cuda.is_current_stream_capturing():
        return
    for caller in _earlier_callers(current, device_index):
        side.wait_stream(caller)


def _earlier_callers(current: torch.cuda.Stream, device_index: int) -> list[torch.cuda.Stream]:
    """Records ``current`` among the streams forks on this device started from (eager) and
    returns the others."""
    callers = _FORK_CALLERS.setdefault(device_index, {})
    callers.setdefault(current.stream_id, current)
    return [caller for stream_id, caller in callers.items() if stream_id != current.stream_id]


def overlappable(t: torch.Tensor) -> bool:
    """Whether work on ``t`` may be split over two streams (``side_by_side``): a real CUDA tensor
    in eager execution. Not while anything traces it (torch.compile, AOT autograd, opcheck, fake
    or proxy tensors: any active dispatch mode or tensor subclass), where the streams would be
    recorded into the graph."""
    return t.is_cuda and type(t) is torch.Tensor and not tracing()


def side_by_side(first: Callable[[], object], second: Callable[[], object], device: torch.device
                 ) -> tuple[object, object]:
    """``(first(), second())``, ``second`` on a side stream of CUDA ``device`` while ``first`` runs
    on the current stream; the current stream waits for both before anything queued after the
    call. Each call's outputs may be used on the current stream at once; ``second``'s come from
    the side stream's pool of the caching allocator, safe to free and reuse as any tensor made on
    the current stream (``_wait_for_callers`` says why no ``record_stream`` is needed). Capturable
    in a CUDA graph (the fork and join are stream waits).

    >>> side_by_side(lambda: 1, lambda: 2, torch.device("cuda"))  # doctest: +SKIP
    (1, 2)
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index == torch._C._cuda_getDevice() and not torch._C._cuda_isCurrentStreamCapturing():
        return _eager_side_by_side(first, second, index)
    current = torch.cuda.current_stream(device)
    side = _side_stream(index)
    _wait_for_callers(side, current, index)  # second's inputs are ready, its pool's blocks free
    with torch.cuda.stream(side):
        second_out = second()
    first_out = first()
    current.wait_stream(side)
    return first_out, second_out


def _eager_side_by_side(first: Callable[[], object], second: Callable[[], object], index: int
                        ) -> tuple[object, object]:
    """``side_by_side`` outside a capture, on the current device ``index``: the same stream waits
    as ``_wait_for_callers`` and the join, through torch's C calls and two events per thread and
    device recorded again on every call (a stream wait takes the event's state when it is queued,
    so a later record cannot change an earlier wait). The generic path makes an event per wait
    and several Python layers per stream lookup and switch: host time on every step."""
    stream_id, device_index, device_type = torch._C._cuda_getCurrentStream(index)
    current = _STREAMS.get((index, stream_id))
    if current is None:
        if len(_STREAMS) >= _MAX_STREAMS:
            _STREAMS.clear()
        current = _STREAMS[(index, stream_id)] = torch.cuda.Stream(
            stream_id=stream_id, device_index=device_index, device_type=device_type)
    side = _side_stream(index)
    fork, join = _events(index)
    record, wait = torch._C._CudaEventBase.record, torch._C._CudaEventBase.wait
    for caller in (current, *_earlier_callers(current, index)):
        record(fork, caller)
        wait(fork, side)
    set_stream = torch._C._cuda_setStream
    set_stream(stream_id=side.stream_id, device_index=side.device_index, device_type=side.device_type)
    try:
        second_out = second()
    finally:
        set_stream(stream_id=stream_id, device_index=device_index, device_type=device_type)
    first_out = first()
    record(join, side)
    wait(join, current)
    return first_out, second_out


def _events(index: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    per_device = getattr(_EVENTS, "pairs", None)
    if per_device is None:
        per_device = _EVENTS.pairs = {}
    pair = per_device.get(index)
    if pair is None:
        pair = per_device[index] = (torch.cuda.Event(), torch.cuda.Event())
    return pair
