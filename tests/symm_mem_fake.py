"""In-process stand-ins for the SYMM_MEM backend's arenas: W "ranks" in one process, each arena a
CPU tensor, and a lockstep driver that runs W phase generators up to each barrier in turn. With
TRITON_INTERPRET=1 the backend's own kernels then run on the CPU exactly as they would over NVLink:
a peer's buffer is reached through its distance from the local one."""
from __future__ import annotations

import torch

from turbo_dispatch.backends.symm_mem.arena import BARRIER, MIN_HALF_BYTES, Grow


class FakeFabric:
    """The W arenas of one simulated group."""

    def __init__(self, world: int):
        self.world = world
        self.buffers = [torch.zeros(0, dtype=torch.uint8)] * world
        self.arenas = [FakeArena(self, r) for r in range(world)]
        self.grows = 0

    def grow(self, nbytes: int) -> None:
        half = max(MIN_HALF_BYTES, 2 * self.arenas[0].half_bytes)
        while half < nbytes:
            half *= 2
        # poison, not zeros: a row the protocol forgot to write must not read as a right answer
        self.buffers = [torch.full((2 * half,), 0xA5, dtype=torch.uint8) for _ in range(self.world)]
        for a in self.arenas:
            a.half_bytes = half
        self.grows += 1


class FakeArena:
    """One rank's arena: the interface the backend's phases use (see SymmetricArena)."""

    def __init__(self, fabric: FakeFabric, rank: int):
        self.fabric, self.rank, self.world = fabric, rank, fabric.world
        self.device = torch.device("cpu")
        self.phase = torch.zeros(1, dtype=torch.int64)
        self.all_rows = torch.full((1,), 1 << 62, dtype=torch.int64)
        self.me_rows = torch.full((self.world,), rank, dtype=torch.int64)
        self.half_bytes = 0

    def local(self, dtype: torch.dtype) -> torch.Tensor:
        return self.fabric.buffers[self.rank].view(dtype)

    def peer_delta(self, dtype: torch.dtype) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        base = self.fabric.buffers[self.rank].data_ptr()
        deltas = [b.data_ptr() - base for b in self.fabric.buffers]
        assert all(d % 64 == 0 for d in deltas), deltas  # the kernels' alignment hint relies on it
        return torch.tensor([d // size for d in deltas], dtype=torch.int64)


def lockstep(fabric: FakeFabric, generators: list) -> list:
    """Runs one phase generator per rank; each round every rank runs up to its next yield, which
    must be the same step on all ranks (a barrier, or a growth of the same size)."""
    results = [None] * len(generators)
    live = list(range(len(generators)))
    sends = [None] * len(generators)
    while live:
        steps = {}
        for r in live:
            try:
                steps[r] = generators[r].send(sends[r])
            except StopIteration as stop:
                results[r] = stop.value
        done = [r for r in live if r not in steps]
        assert not done or len(done) == len(live), f"ranks {done} finished while others wait at {steps}"
        live = [r for r in live if r in steps]
        if not live:
            break
        kinds = set(steps.values())
        assert len(kinds) == 1, f"ranks disagree on the next step: {steps}"
        step = kinds.pop()
        if isinstance(step, Grow):
            fabric.grow(step.nbytes)
        else:
            assert step == BARRIER, step
    return results
