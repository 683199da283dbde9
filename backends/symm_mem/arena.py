"""The symmetric arena: one buffer per rank from torch's symmetric memory, mapped by every peer.

An arena has two equal halves. Each communication phase (peers write into this rank's current
half, a barrier, this rank reads it) uses the half named by the parity of the device counter
``phase``, and the reading rank advances the counter when it is done. A peer that races ahead into
the next phase therefore writes the other half, while this rank may still be reading; it can only
come back to this half after a barrier that this rank joins after its read. That is what lets a
phase end with one barrier instead of two.

``Phases`` drive the backend's operations, written as generators that yield ``BARRIER`` where all
ranks must meet and ``Grow(nbytes)`` where the arena must be enlarged (a collective: every rank
reaches it at the same point with the same size, because sizes come from facts every rank holds).
``drive`` runs one rank's generator against a real arena; the tests run several generators in
lockstep against in-process arenas with the same interface.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Generator, TypeVar

import torch

#: Every offset, stride and peer distance the kernels see is a multiple of this many bytes, so the
#: kernels' alignment hint (16 elements of up to 4 bytes) holds.
ALIGN_BYTES = 64
#: Arena halves grow to at least this many bytes, then by doubling: few collective reallocations.
MIN_HALF_BYTES = 1 << 20

BARRIER = "barrier"
#: Element types the kernels address the arena in (row words, int64 metadata, payload types).
DELTA_DTYPES = (torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Grow:
    """Yielded by a phase generator: the arena's halves must hold ``nbytes`` each."""

    nbytes: int


def align_up(nbytes: int, to: int = ALIGN_BYTES) -> int:
    return -(-nbytes // to) * to


class SymmetricArena:
    """This rank's arena over ``group`` on ``device`` (torch.distributed._symmetric_memory).

    ``phase`` is the device counter whose parity picks the half; ``local(dtype)`` views the whole
    arena in ``dtype``; ``peer_delta(dtype)`` is an int64 device tensor of each rank's arena start
    minus this rank's, in ``dtype`` elements; ``half_bytes`` is the size of one half. Allocation
    and rendezvous are host-synchronous collectives, so they happen only in ``grow`` (first use,
    or a larger need), never in a steady-state call or a captured graph.
    """

    def __init__(self, group: Any, device: torch.device):
        import torch.distributed as dist

        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.phase = torch.zeros(1, dtype=torch.int64, device=device)
        #: ``n_valid`` for copies that keep every row (the synchronising path knows its row counts)
        self.all_rows = torch.full((1,), 1 << 62, dtype=torch.int64, device=device)
        #: this rank's row in every peer's count table, once per peer
        self.me_rows = torch.full((self.world,), self.rank, dtype=torch.int64, device=device)
        self.half_bytes = 0
        self._buffer: torch.Tensor | None = None
        self._handle: Any = None
        self._ptrs: list[int] = []
        self._deltas: dict[torch.dtype, torch.Tensor] = {}

    def grow(self, nbytes: int) -> None:
        """Collective: every rank of the group calls it with the same ``nbytes``."""
        import torch.distributed._symmetric_memory as symm_mem

        half = max(MIN_HALF_BYTES, 2 * self.half_bytes)
        while half < nbytes:
            half *= 2
        half = align_up(half, 1 << 16)
        # peers may still have kernels in flight that touch the old buffers; each rank drains its
        # own device before the collective rendezvous, so no rank frees memory a peer still writes
        torch.cuda.synchronize(self.device)
        group_name = self.group.group_name
        with warnings.catch_warnings():  # required before torch 2.9, a deprecated no-op since
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
        try:
            buffer = symm_mem.empty(2 * half, dtype=torch.uint8, device=self.device)
            handle = symm_mem.rendezvous(buffer, group_name)
        except RuntimeError as exc:
            raise RuntimeError(f"SYMM_MEM: could not map {2 * half} bytes of symmetric memory over the group "
                               f"({exc}); the GPUs need peer access to each other (NVLink, or PCIe P2P). Pin the "
                               "TORCH backend: PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND=TORCH") from exc
        ptrs = [int(p) for p in handle.buffer_ptrs]
        base = ptrs[self.rank]
        if any((p - base) % ALIGN_BYTES for p in ptrs):
            raise RuntimeError(f"SYMM_MEM: peer buffers are not {ALIGN_BYTES}-byte aligned relative to this "
                               f"rank's ({[hex(p) for p in ptrs]}); pin the TORCH backend")
        self._buffer, self._handle, self._ptrs = buffer, handle, ptrs
        self.half_bytes = half
        self._deltas.clear()
        # made here, not on first use: a host-to-device copy cannot run inside a CUDA graph capture
        for dtype in DELTA_DTYPES:
            self.peer_delta(dtype)

    def local(self, dtype: torch.dtype) -> torch.Tensor:
        assert self._buffer is not None, "grow() first"
        return self._buffer.view(dtype)

    def peer_delta(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._deltas:
            size = dtype.itemsize
            base = self._ptrs[self.rank]
            self._deltas[dtype] = torch.tensor([(p - base) // size for p in self._ptrs], dtype=torch.int64,
                                               device=self.device)
        return self._deltas[dtype]

    def barrier(self) -> None:
        self._handle.barrier(channel=0)


R = TypeVar("R")


def drive(phases: Generator[Any, None, R], arena: SymmetricArena) -> R:
    """Runs one rank's phase generator: barriers on the arena's signal pads, growth collectively."""
    try:
        step = next(phases)
        while True:
            if step == BARRIER:
                arena.barrier()
            elif isinstance(step, Grow):
                arena.grow(step.nbytes)
            else:  # pragma: no cover - a programming error in a phase generator
                raise TypeError(f"unknown phase step {step!r}")
            step = phases.send(None)
    except StopIteration as stop:
        return stop.value
