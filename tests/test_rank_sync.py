"""sync_tuning: one collective at a point every rank reaches makes every rank run the same choice
for every key any rank tuned, even where the ranks met different keys (the grouped GEMM case that
online consensus must skip). The agreement rule on its own, then 2 gloo processes."""
import math
import os
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from test_rank_consensus import PLUGINS, run_ranks

from turbo_dispatch.autotune import TuneRecord
from turbo_dispatch.tuning.rank_sync import agree

HERE = Path(__file__).parent
INF = math.inf


class Key(NamedTuple):
    """A problem key as the ops build them (a NamedTuple), reduced to a name."""
    name: str


def profiled(*times: tuple[str, float]) -> TuneRecord:
    """A record as one rank's profiling leaves it: its own winner, every candidate's time."""
    measured = tuple((name, None, ms) for name, ms in times)
    finite = [(ms, name) for name, ms in times if math.isfinite(ms)]
    ms, name = min(finite) if finite else (INF, None)
    return TuneRecord(name, None, ms, timings=tuple(times), measured=measured)


def stored(backend: str) -> TuneRecord:
    return TuneRecord(backend, (64, 64), 1.0, source="tuned-db")


def agreed_backends(per_rank) -> dict:
    return {problem.name: record.backend for (_, problem), record in agree(per_rank).items()}


def test_profiled_by_several_ranks_each_candidate_counts_at_its_worst_rank():
    rank0 = [("gemm", Key("k"), profiled(("FAST0", 0.1), ("FAST1", 3.0), ("STEADY", 1.0)))]
    rank1 = [("gemm", Key("k"), profiled(("FAST0", 3.0), ("FAST1", 0.1), ("STEADY", 1.1)))]
    record = agree([rank0, rank1])[("gemm", Key("k"))]
    assert (record.backend, record.time_ms) == ("STEADY", 1.1)
    assert dict(record.timings) == {"FAST0": 3.0, "FAST1": 3.0, "STEADY": 1.1}
    assert "2 rank(s)" in record.note


def test_the_agreed_winner_keeps_the_peer_comparison_of_a_rank_that_chose_it():
    peer = dict(peer_op="gemm", peer_backend="TORCH", peer_ms=2.0, peer_winner_ms=1.5)
    rank0 = [("gemm_fp8", Key("k"), TuneRecord("A", None, 1.0, timings=(("A", 1.0), ("B", 1.2)),
                                               measured=(("A", None, 1.0), ("B", None, 1.2)), peer_op="gemm",
                                               peer_backend="TORCH", peer_ms=9.0, peer_winner_ms=1.0))]
    rank1 = [("gemm_fp8", Key("k"), TuneRecord("B", None, 1.1, timings=(("A", 3.0), ("B", 1.1)),
                                               measured=(("A", None, 3.0), ("B", None, 1.1)), **peer))]
    record = agree([rank0, rank1])[("gemm_fp8", Key("k"))]
    assert record.backend == "B"  # A at its worst rank's 3.0
    assert (record.peer_op, record.peer_backend, record.peer_ms, record.peer_winner_ms) == ("gemm", "TORCH", 2.0, 1.5)
    rank1 = [("gemm_fp8", Key("k"), TuneRecord("B", None, 1.1, timings=(("A", 3.0), ("B", 1.1)),
                                               measured=(("A", None, 3.0), ("B", None, 1.1))))]
    assert agree([rank0, rank1])[("gemm_fp8", Key("k"))].peer_ms is None  # rank 0's is about A


def test_a_key_one_rank_profiled_is_adopted_by_the_others_and_db_hits_follow_the_lowest_rank():
    rank0 = [("g", Key("only0"), profiled(("A", 1.0), ("B", 2.0))), ("g", Key("db"), stored("X"))]
    rank1 = [("g", Key("only1"), profiled(("A", 2.0), ("B", 1.0))), ("g", Key("db"), stored("Y"))]
    assert agreed_backends([rank0, rank1]) == {"only0": "A", "only1": "B", "db": "X"}
    assert agreed_backends([rank1, rank0])["db"] == "Y"  # by rank, not by name


def test_a_measurement_outranks_another_ranks_db_hit():
    rank0 = [("g", Key("k"), stored("X"))]
    rank1 = [("g", Key("k"), profiled(("X", 2.0), ("Y", 1.0)))]
    assert agreed_backends([rank0, rank1]) == {"k": "Y"}


def test_a_candidate_must_pass_on_every_rank_that_profiled_the_key():
    rank0 = [("g", Key("k"), profiled(("WRONG_ON_1", 0.1), ("OK", 1.0)))]
    rank1 = [("g", Key("k"), profiled(("WRONG_ON_1", INF), ("OK", 1.2)))]
    rank2 = [("g", Key("k"), profiled(("OK", 0.9), ("ONLY_ON_2", 0.1)))]  # WRONG_ON_1 not planned there
    record = agree([rank0, rank1, rank2])[("g", Key("k"))]
    assert record.backend == "OK" and record.time_ms == 1.2
    assert dict(record.timings)["ONLY_ON_2"] == INF


def test_no_candidate_passing_everywhere_is_an_agreed_failure():
    rank0 = [("g", Key("k"), profiled(("A", 1.0), ("B", INF)))]
    rank1 = [("g", Key("k"), profiled(("A", INF), ("B", 1.0)))]
    record = agree([rank0, rank1])[("g", Key("k"))]
    assert record.backend is None and "no candidate passed on every rank" in record.note


def _worker(rank, world, port, registry, results):
    sys.path.insert(0, str(HERE))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PRIMUS_TURBO_EXTRA_REGISTRY=registry,
                      PRIMUS_TURBO_TUNE_CONSENSUS="0", FIXTURE_RANK=str(rank),
                      # a DB per rank (one per node, say): with one shared file a rank would read the
                      # other's winner for a key both meet, and agree by luck of timing
                      PRIMUS_TURBO_TUNE_DB=f"{os.environ['PRIMUS_TURBO_TUNE_DB']}.rank{rank}")
    import torch
    import torch.distributed as dist

    import turbo_dispatch as turbo
    import turbo_dispatch.backends.torch.gemm as torch_gemm

    torch_gemm.TorchGemm.supports = lambda self, p: "disabled in this test"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        turbo.GlobalBackendManager.set_auto_tune(True)

        def pick(m):
            return turbo.explain("gemm", torch.randn(m, 8), torch.randn(8, 8)).backend

        met = (8, 16) if rank == 0 else (16, 32)  # the ranks meet different keys, as under EP
        before = [pick(m) for m in met]
        report = turbo.sync_tuning()
        after = {m: pick(m) for m in (8, 16, 32)}
        calls = turbo.autotune.STATS["keys_profiled"]
        results[rank] = (before, after, report, calls)
    finally:
        dist.destroy_process_group()


def test_ranks_that_met_different_keys_agree_after_sync(tmp_path):
    registry = tmp_path / "plugins.yaml"
    registry.write_text(PLUGINS + "      - name: STEADY\n        adapter: fixture_backends:SteadyOnEveryRank\n"
                        "        platforms: [cpu]\n")
    results = run_ranks(_worker, 2, str(registry))
    (before0, after0, report0, calls0), (before1, after1, report1, calls1) = results[0], results[1]
    assert before0 == ["FAST_ON_RANK0"] * 2 and before1 == ["FAST_ON_RANK1"] * 2  # each alone: its own
    # m=16 both profiled: STEADY is the fastest at its worst rank; m=8 and m=32 each rank's own pick.
    assert after0 == after1 == {8: "FAST_ON_RANK0", 16: "STEADY", 32: "FAST_ON_RANK1"}
    assert (report0.keys, report0.adopted, report0.changed, report0.failed) == (3, 1, 1, 0)
    assert (report1.keys, report1.adopted, report1.changed, report1.failed) == (3, 1, 1, 0)
    assert calls0 == calls1 == 2  # the adopted key was not profiled again


def test_sync_tuning_needs_an_initialised_process_group():
    import turbo_dispatch as turbo

    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        turbo.sync_tuning()


def test_the_nccl_probe_runs_its_checks_on_two_gloo_ranks(tmp_path):
    """benchmarks/probes/probe_nccl_consensus.py (the GPU check of consensus and sync_tuning) on the
    CPU: only its plumbing can be shown here (one CPU backend per op, so nothing to disagree on),
    and that plumbing is what would otherwise first break on a GPU machine's scarce time."""
    import json
    import subprocess

    env = {**os.environ, "PRIMUS_TURBO_TUNE_DB": str(tmp_path / "shared.jsonl")}
    probe = HERE.parent / "benchmarks" / "probes" / "probe_nccl_consensus.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(probe), "--device", "cpu", "--rows", "64", "--hidden", "128", "--tokens-per-group", "16"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    keys = {line["key"]: line for line in lines if "key" in line}
    assert set(keys) == {"gemm", "gemm_fp8", "grouped_gemm"}
    assert all(line["agree_after_sync"] and line["db_entries"] == 3 for line in keys.values())
    assert any("SyncReport(ranks=2, keys=3" in line.get("sync_tuning_rank0", "") for line in lines)
