"""Rank consensus: with PRIMUS_TURBO_TUNE_CONSENSUS=1 every rank picks the same backend for a key,
even when each rank on its own would pick a different one (gloo, 2 processes)."""
import os
import socket
import sys
import textwrap
from pathlib import Path

import pytest
import torch.multiprocessing as mp

HERE = Path(__file__).parent

PLUGINS = textwrap.dedent("""
    version: 1
    ops:
      gemm:
        backends:
          - name: FAST_ON_RANK0
            adapter: fixture_backends:FastOnRank0
            platforms: [cpu]
          - name: FAST_ON_RANK1
            adapter: fixture_backends:FastOnRank1
            platforms: [cpu]
    """)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, registry, consensus, results):
    sys.path.insert(0, str(HERE))
    # Memory-only tuning: with a shared DB file a rank that finishes first would hand its winner
    # to the other through the file, which is not what this test is about.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PRIMUS_TURBO_EXTRA_REGISTRY=registry,
                      PRIMUS_TURBO_TUNE_CONSENSUS="1" if consensus else "0", FIXTURE_RANK=str(rank),
                      PRIMUS_TURBO_TUNE_DB="off")
    import torch
    import torch.distributed as dist

    import turbo_dispatch as turbo
    import turbo_dispatch.backends.torch.gemm as torch_gemm

    torch_gemm.TorchGemm.supports = lambda self, p: "disabled in this test"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        turbo.GlobalBackendManager.set_auto_tune(True)
        picks = [turbo.explain("gemm", torch.randn(m, 8), torch.randn(8, 8)).backend for m in (8, 16)]
        results[rank] = picks
    finally:
        dist.destroy_process_group()


def run_ranks(worker, world: int, *args) -> dict:
    """Runs ``worker(rank, world, port, *args, results)`` in ``world`` spawned processes and returns
    what each put in ``results`` under its rank; every process must exit cleanly."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = _free_port()
        procs = [ctx.Process(target=worker, args=(r, world, port, *args, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        return dict(results)


@pytest.mark.parametrize("consensus", [False, True])
def test_ranks_agree_only_with_consensus(tmp_path, consensus):
    registry = tmp_path / "plugins.yaml"
    registry.write_text(PLUGINS)
    picks = run_ranks(_worker, 2, str(registry), consensus)
    if consensus:
        assert picks[0] == picks[1]
    else:  # each rank's own fastest differs: the hazard consensus exists for
        assert picks[0] == ["FAST_ON_RANK0"] * 2 and picks[1] == ["FAST_ON_RANK1"] * 2
