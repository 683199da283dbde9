"""Replayed CUDA graphs for SYMM_MEM's no-host-read calls.

Under ``num_worst_tokens`` a dispatch or a combine is a fixed sequence of kernels and barriers whose
shapes follow from host facts alone, so it can be captured once per shape and replayed. A replay
costs the host one launch instead of one per kernel, op and allocation, which is what bounds a
small (decode-sized) dispatch.

A graph bakes in the addresses it saw while capturing, so a ``GraphedCall`` keeps static copies of
its inputs and, after each replay, hands out fresh copies of its outputs: a caller may hold a
dispatch's outputs and handle while later calls of the same shape run (a model's layers do, and
their backward passes use the handles in reverse order). Outputs are copied per storage, so views
that share one buffer (the handle's maps) still share one afterwards.

A shape's first calls run eagerly: the first compiles the kernels and sizes the arena, neither of
which may happen inside a capture, and a capture (which synchronises the device, as torch's graph
context does) is only worth it for a shape that recurs, so it comes on the shape's
``CAPTURE_AFTER``-th call. The arena only grows, so a later capture of that shape never needs to
grow it; a growth (for another shape) moves the arena, and every graph captured before is dropped.
A shape whose graph was evicted (more recurring shapes than ``MAX_GRAPHS``, e.g. a decode loop's
ever-changing token counts) runs eagerly from then on, and an arena captures at most
``MAX_CAPTURES`` graphs in all, so shapes that churn never pay a capture per call. Calls made while
the caller is itself capturing a graph run eagerly into the caller's graph.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

log = logging.getLogger("turbo_dispatch.backends.symm_mem.graphs")

#: Graphs kept per arena; the least recently used is dropped beyond it (and its shape runs eagerly).
MAX_GRAPHS = 16
#: Calls of one shape before it is captured (the first runs eagerly to compile and size the arena).
CAPTURE_AFTER = 3
#: Captures per arena in all; past it every new shape runs eagerly.
MAX_CAPTURES = 64
#: Shapes whose calls are counted before capture; the counts start over beyond it.
MAX_SEEN = 4096
#: Inputs above this many bytes run eagerly: their static copies would cost memory and copy time,
#: and at that size the kernels, not the host, bound the call.
MAX_INPUT_BYTES = 32 << 20


def _nbytes(tensors: Sequence[Optional[torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def fresh_copies(tensors: Sequence[Optional[torch.Tensor]]) -> list:
    """Copies of ``tensors`` in new memory, one new buffer per distinct storage, so tensors that
    were views of one buffer are views of one new buffer (same offsets, sizes, strides)."""
    by_storage: dict = {}
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in by_storage:
            by_storage[key] = storage.clone()
        out.append(torch.empty(0, dtype=t.dtype, device=t.device).set_(
            by_storage[key], t.storage_offset(), t.size(), t.stride()))
    return out


def copy_storages(dst: Sequence[Optional[torch.Tensor]], src: Sequence[Optional[torch.Tensor]]) -> None:
    """Copies the whole storage behind each ``src`` tensor into the one behind its ``dst`` (once
    per distinct pair): the way back into a graph's static copies made by ``fresh_copies``."""
    done = set()
    for d, s in zip(dst, src):
        if d is None:
            continue
        ds, ss = d.untyped_storage(), s.untyped_storage()
        if ds.data_ptr() in done:
            continue
        done.add(ds.data_ptr())
        if ds.nbytes() != ss.nbytes():
            raise ValueError(f"graph input storage of {ss.nbytes()} bytes where {ds.nbytes()} were captured")
        ds.copy_(ss)


class _Captured:
    __slots__ = ("graph", "inputs", "layout_inputs", "outputs")

    def __init__(self, graph, inputs, layout_inputs, outputs):
        self.graph, self.inputs, self.layout_inputs, self.outputs = graph, inputs, layout_inputs, outputs


class GraphedCalls:
    """One arena's captured calls, by key.

    ``run(key, call, inputs, layout_inputs, flatten, rebuild)``: ``call(*inputs, *layout_inputs)``
    runs the operation eagerly (a phase generator driven to its end); ``flatten(result)`` lists the
    result's tensors and ``rebuild(result, tensors)`` puts new ones in their places. ``inputs`` are
    the caller's tensors (copied tensor by tensor into the graph's static ones); ``layout_inputs``
    are tensors this backend made earlier (a handle's maps, copied storage by storage)."""

    def __init__(self, arena: Any, limit: int = MAX_GRAPHS):
        self.arena = arena
        self.limit = limit
        self._graphs: "OrderedDict[Hashable, _Captured]" = OrderedDict()
        self._seen: dict = {}  # calls per key not (or no longer) captured
        self._eager: set = set()  # keys whose capture failed or whose graph was evicted
        self.capture_after, self.max_captures = CAPTURE_AFTER, MAX_CAPTURES
        self.captures = 0
        self._half_bytes = arena.half_bytes

    def eligible(self, inputs: Sequence[Optional[torch.Tensor]]) -> bool:
        return (self.arena.device.type == "cuda" and not torch.cuda.is_current_stream_capturing()
                and _nbytes(inputs) <= MAX_INPUT_BYTES)

    def run(self, key: Hashable, call: Callable[..., Any], inputs: Sequence[Optional[torch.Tensor]],
            layout_inputs: Sequence[Optional[torch.Tensor]], flatten: Callable[[Any], list],
            rebuild: Callable[[Any, list], Any]) -> Any:
        if self._half_bytes != self.arena.half_bytes:  # the arena moved: every captured address is stale
            self._graphs.clear()
            self._half_bytes = self.arena.half_bytes
        captured = self._graphs.get(key)
        if captured is None:
            if len(self._seen) >= MAX_SEEN:  # counts of shapes that never recurred enough: start over
                self._seen.clear()
            calls = self._seen[key] = self._seen.get(key, 0) + 1
            if calls < self.capture_after or key in self._eager or self.captures >= self.max_captures:
                return call(*inputs, *layout_inputs)
            try:
                self.captures += 1
                captured = self._capture(key, call, inputs, layout_inputs, flatten)
            except Exception as exc:  # capturing runs nothing, so this call can still run eagerly
                self._eager.add(key)
                log.warning("SYMM_MEM: could not capture %s as a CUDA graph (%s: %s); it runs eagerly from now on",
                            key[0], type(exc).__name__, exc)
                return call(*inputs, *layout_inputs)
            self._graphs[key] = captured
            self._seen.pop(key, None)
            if len(self._graphs) > self.limit:
                evicted, _ = self._graphs.popitem(last=False)
                self._eager.add(evicted)
        else:
            self._graphs.move_to_end(key)
        for static, t in zip(captured.inputs, inputs):
            if static is not None:
                static.copy_(t)
        copy_storages(captured.layout_inputs, layout_inputs)
        captured.graph.replay()
        result, tensors = captured.outputs
        return rebuild(result, fresh_copies(tensors))

    def _capture(self, key, call, inputs, layout_inputs, flatten) -> _Captured:
        static = [None if t is None else torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
                  for t in inputs]
        static_layout = fresh_copies(layout_inputs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = call(*static, *static_layout)
        return _Captured(graph, static, static_layout, (result, flatten(result)))
