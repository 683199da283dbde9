"""Quantise a weight once for several micro-batches: ``reuse_quantized_weights``.

With gradient accumulation a weight stays the same from one optimizer step to the next while
every micro-batch's forward quantises it again. In a blockwise fp8 MoE step with few tokens per
expert the experts' weights are several times the size of the activations, so that quantisation
is most of the forward.

Inside ``with reuse_quantized_weights():`` the eager blockwise ``grouped_gemm_fp8`` step keeps each
weight's fp8 tiles (the forward's copy and the dgrad's) and hands them to later calls with the same
weight. The caller promises what the name says: the weights do not change inside the block. Two
checks back the promise up, and a call that fails either quantises afresh:

* the same tensor object (held by a weak reference, so a freed weight's address reused by another
  tensor never matches), with the same shape, strides, dtype and device;
* the same version counter: an in-place update of the weight itself (``w.add_``, an optimizer's
  step) bumps it. Writes through ``w.data`` or a detached alias do not; a weight changed that way
  inside the block keeps its old tiles, which is why the block, not the version, is the contract.

The tiles live until the block ends or the weight is freed: one byte per weight element for each
of the two copies, plus scales. Not used while torch.compile traces (its custom ops quantise per
call), under a dispatch mode or tensor subclass, or while a CUDA graph is captured (tiles made in a
capture live in the graph's memory pool).

>>> import torch, turbo_dispatch as turbo
>>> from turbo_dispatch.low_precision import Float8QuantConfig, reuse_quantized_weights
>>> w = torch.randn(2, 256, 128, requires_grad=True)
>>> lens = torch.tensor([100, 156])
>>> cfg = Float8QuantConfig(granularity="blockwise", block_size=128)
>>> with reuse_quantized_weights() as scope:
...     for _ in range(3):  # three micro-batches, one weight
...         x = torch.randn(256, 128, requires_grad=True)
...         turbo.ops.grouped_gemm_fp8(x, w, lens, config=cfg).sum().backward()
>>> scope.hits, scope.misses
(2, 1)
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

_LOCAL = threading.local()


@dataclass
class WeightReuseScope:
    """The tiles one ``reuse_quantized_weights`` block keeps, and how often they served a call
    (``hits``) or had to be made (``misses``)."""

    hits: int = 0
    misses: int = 0
    _entries: dict = field(default_factory=dict, repr=False)

    def _key(self, w: torch.Tensor, dtype: torch.dtype, block: int) -> tuple:
        return (id(w), tuple(w.shape), tuple(w.stride()), w.dtype, w.device, dtype, block)

    def lookup(self, w: torch.Tensor, dtype: torch.dtype, block: int) -> Optional[tuple]:
        entry = self._entries.get(self._key(w, dtype, block))
        if entry is not None and entry[0]() is w and entry[1] == w._version:
            self.hits += 1
            return entry[2]
        self.misses += 1
        return None

    def keep(self, w: torch.Tensor, dtype: torch.dtype, block: int, tiles: tuple) -> None:
        key = self._key(w, dtype, block)
        entries = self._entries
        # A freed weight's tiles go with it (and its id may then name another tensor).
        ref = weakref.ref(w, lambda _, key=key: entries.pop(key, None))
        entries[key] = (ref, w._version, tiles)


def active_scope() -> Optional[WeightReuseScope]:
    """The innermost ``reuse_quantized_weights`` block of this thread, or None."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def reuse_quantized_weights() -> Iterator[WeightReuseScope]:
    """Within the block, the eager blockwise fp8 grouped GEMM step quantises each weight once and
    reuses its tiles while the weight stays the same tensor at the same version (see the module
    docstring for the contract and the memory it holds). Yields the block's ``WeightReuseScope``.

    >>> with reuse_quantized_weights() as scope:  # doctest: +SKIP
    ...     for micro_batch in micro_batches:
    ...         loss_fn(model(micro_batch)).backward()
    >>> optimizer.step()  # doctest: +SKIP
    """
    scope = WeightReuseScope()
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(scope)
    try:
        yield scope
    finally:
        stack.pop()
        scope._entries.clear()


def _reusable(w: torch.Tensor) -> bool:
    from turbo_dispatch.tracing import tracing

    if tracing() or type(w) not in (torch.Tensor, torch.nn.Parameter):
        return False
    return not (w.is_cuda and torch.cuda.is_current_stream_capturing())


def lookup(w: torch.Tensor, dtype: torch.dtype, block: int) -> Optional[tuple]:
    """The tiles an enclosing ``reuse_quantized_weights`` block kept for weight ``w`` at its
    current version (quantised to ``dtype`` with ``block``), else None (no block, a weight it may
    not keep, or a first or changed weight: then ``keep`` the tiles made for it)."""
    scope = active_scope()
    if scope is None or not _reusable(w):
        return None
    return scope.lookup(w, dtype, block)


def keep(w: torch.Tensor, dtype: torch.dtype, block: int, tiles: tuple) -> None:
    """Hand ``tiles`` made for ``w`` to the enclosing ``reuse_quantized_weights`` block, if any."""
    scope = active_scope()
    if scope is not None and _reusable(w):
        scope.keep(w, dtype, block, tiles)


__all__ = ["WeightReuseScope", "active_scope", "keep", "lookup", "reuse_quantized_weights"]
