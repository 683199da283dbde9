"""Online autotuning with rank consensus over NCCL, every rank writing one shared tuning DB.

Run under torchrun on a machine with several GPUs (one process per GPU)::

    PRIMUS_TURBO_TUNE_DB=/tmp/shared.jsonl torchrun --nproc_per_node 2 benchmarks/probes/probe_nccl_consensus.py

Each rank turns autotuning and ``PRIMUS_TURBO_TUNE_CONSENSUS`` on, then runs the same calls: a
bf16 GEMM, an fp8 rowwise GEMM and a bf16 grouped GEMM (one key each, the same on every rank).
Rank ``r`` multiplies its timings by ``--skew`` except for the candidates whose place in the
key's candidate order is ``r`` modulo the world size, so that without consensus the ranks would
crown different winners; with it (each candidate's worst time over the ranks), every rank must
pick the same backend and config. With one rank the skew is a no-op and agreement trivial: the
probe then only shows the NCCL collectives and the shared DB working. Grouped GEMM keys are left out of consensus by design
(their token counts vary across ranks), so there the skew should split the ranks: the control.
Then every rank calls ``turbo_dispatch.sync_tuning()``, after which every key, the grouped
control included, must have one choice on every rank. Rank 0 prints one JSON line per key with
every rank's choice before and after the sync (``"agree"``, ``"agree_after_sync"``) and the shared
DB's entry count, and the probe exits 1 when a consensus key disagrees, any key disagrees after
the sync, or the DB holds fewer entries than keys. The CPU tests cover the same with gloo
(tests/test_rank_consensus.py); this is the NCCL form on GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root


def _skew_timings(rank: int, skew: float) -> None:
    """Makes rank ``rank`` time every candidate of a key ``skew`` times slower except those whose
    place in the key's candidate order is ``rank`` mod the world size, so that each rank alone
    would crown another winner. Every rank plans the same candidates in the same order, so the
    places line up across ranks."""
    from turbo_dispatch import autotune

    world = dist.get_world_size()
    time_ms, profile = autotune._time_ms, autotune.profile
    place = [0]

    def skewed_time_ms(*args, **kwargs):
        ms = time_ms(*args, **kwargs)
        factor = 1.0 if place[0] % world == rank else skew
        place[0] += 1
        return ms * factor

    def counted_profile(*args, **kwargs):
        place[0] = 0
        return profile(*args, **kwargs)

    autotune._time_ms, autotune.profile = skewed_time_ms, counted_profile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # (no option may start like one of torchrun's: it reads "--m" as an abbreviation of its own)
    parser.add_argument("--rows", type=int, default=4096, help="the dense GEMMs' M")
    parser.add_argument("--hidden", type=int, default=4096, help="the dense GEMMs' N and K")
    parser.add_argument("--tokens-per-group", type=int, default=1024, help="the grouped GEMM's (8 groups, K 2048, N 1536)")
    parser.add_argument("--skew", type=float, default=3.0, help="slow-down of the other ranks' places")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: gloo and the CPU backends (the CPU tests run the probe's plumbing so)")
    args = parser.parse_args()

    os.environ["PRIMUS_TURBO_AUTO_TUNE"] = "1"
    os.environ["PRIMUS_TURBO_TUNE_CONSENSUS"] = "1"
    # The DBs shipped in the package hold some of these keys (the H100's holds the 4096^3 GEMMs),
    # and a stored result is used without profiling: only the shared DB may serve here.
    os.environ["PRIMUS_TURBO_TUNE_DB_SHIPPED"] = "0"
    from turbo_dispatch.cli.tune import init_distributed

    gpu = args.device == "cuda"
    init_distributed(gpu)  # torchrun's environment, this rank's GPU, an NCCL group: as `tune --distributed`
    rank, world = dist.get_rank(), dist.get_world_size()

    _skew_timings(rank, args.skew)
    import turbo_dispatch as turbo
    from turbo_dispatch.low_precision import Float8QuantConfig, ScalingGranularity

    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    m, h, t = args.rows, args.hidden, args.tokens_per_group
    a = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
    w = torch.randn(h, h, device=dev, dtype=torch.bfloat16)
    x = torch.randn(8 * t, 2048, device=dev, dtype=torch.bfloat16)
    gw = torch.randn(8, 1536, 2048, device=dev, dtype=torch.bfloat16)
    lens = torch.full((8,), t, device=dev, dtype=torch.int64)
    rowwise = Float8QuantConfig(granularity=ScalingGranularity.ROWWISE)

    # (call, explain's arguments, whether consensus applies). Grouped GEMM keys vary across ranks
    # under MoE routing, so consensus skips them by design (docs/tuning-db.md): under the skew the
    # ranks should then disagree, the control that shows the skew would split the others too.
    calls = {
        "gemm": (lambda: turbo.ops.gemm(a, w, trans_b=True), ("gemm", a, w), dict(trans_b=True), True),
        "gemm_fp8": (lambda: turbo.ops.gemm_fp8(a, w, trans_b=True, config=rowwise), ("gemm_fp8", a, w),
                     dict(trans_b=True, config=rowwise), True),
        "grouped_gemm": (lambda: turbo.ops.grouped_gemm(x, gw, lens, trans_b=True), ("grouped_gemm", x, gw, lens),
                         dict(trans_b=True), False),
    }
    def every_ranks_choices() -> list[dict]:
        mine = {}
        for name, (_, explain_args, explain_kwargs, _) in calls.items():
            decision = turbo.explain(*explain_args, **explain_kwargs)
            mine[name] = f"{decision.backend}[{decision.config}]"
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        return gathered

    sources = {}
    for name, (call, explain_args, explain_kwargs, _) in calls.items():
        call()  # tunes the key (a collective under consensus) and runs the winner
        if gpu:
            torch.cuda.synchronize()
        sources[name] = turbo.explain(*explain_args, **explain_kwargs).source
    gathered = every_ranks_choices()
    # Then the agreement that covers keys varying across ranks too: after it every key, the grouped
    # control included, must have one choice on every rank.
    report = turbo.sync_tuning()
    synced = every_ranks_choices()
    dist.barrier()
    status = 0
    if rank == 0:
        from turbo_dispatch.tuning.report import inspect

        db = os.environ.get("PRIMUS_TURBO_TUNE_DB")
        entries = len(inspect(db).rows) if db and os.path.exists(db) else None
        for name, (*_, consensus) in calls.items():
            choices = [g[name] for g in gathered]
            agree = len(set(choices)) == 1
            if consensus:
                status |= not agree
            after = [g[name] for g in synced]
            agree_after_sync = len(set(after)) == 1
            status |= not agree_after_sync
            print(json.dumps({"probe": "nccl_consensus", "key": name, "world": world, "consensus": consensus,
                              "choices": choices, "source_rank0": sources[name], "agree": agree,
                              "after_sync_tuning": after, "agree_after_sync": agree_after_sync,
                              "db_entries": entries, "device": torch.cuda.get_device_name(dev) if gpu else "cpu"}))
        print(json.dumps({"probe": "nccl_consensus", "sync_tuning_rank0": str(report)}))
        if db and (entries is None or entries < len(calls)):
            print(f"shared DB {db} holds {entries} entries, expected at least {len(calls)}")
            status = 1
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
