"""A fresh process reusing a tuning DB: it must profile nothing, and we measure what the DB costs.

Run after ``turbo-dispatch tune`` with the same model/ops and the DB in PRIMUS_TURBO_TUNE_DB:

    PRIMUS_TURBO_TUNE_DB=db.jsonl PRIMUS_TURBO_AUTO_TUNE=1 python tools/db_reuse_check.py --model llama3.1-8b --ops gemm,gemm_fp8

Prints, per key: the decision's source and backend, the first-call decision time (DB read and
validation included), and the warm per-call host time of the public op against calling the
chosen adapter directly (enqueue time of 50 calls, no sync in between). Exits 1 if anything was
profiled or a key was not served from the DB.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import turbo_dispatch as turbo
from turbo_dispatch import autotune
from turbo_dispatch.low_precision import Float8QuantConfig
from turbo_dispatch.op_spec import format_key, get_op_spec
from turbo_dispatch.resolver import resolve
from turbo_dispatch.tuning.keys import model_keys


def _enqueue_us(fn, calls: int = 50, rounds: int = 7) -> float:
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3.1-8b")
    parser.add_argument("--ops", default="gemm,gemm_fp8")
    parser.add_argument("--fp8", default="tensorwise,rowwise,blockwise")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    keys = model_keys(args.model, args.ops.split(","), "cuda", fp8_granularities=args.fp8.split(","))
    rows = []
    for op, problem in keys:
        spec = get_op_spec(op)
        t0 = time.perf_counter()
        decision = resolve(spec, problem)
        first_ms = (time.perf_counter() - t0) * 1e3
        rows.append({"op": op, "key": format_key(problem), "source": decision.source, "backend": decision.backend,
                     "config": repr(decision.config), "first_call_ms": round(first_ms, 3)})
    # Warm overhead on the forward keys the public ops build (Linear: y = x @ W^T).
    overhead = []
    for op, problem in keys:
        if problem.trans_a or not problem.trans_b:
            continue
        a = torch.randn(problem.m, problem.k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(problem.n, problem.k, device="cuda", dtype=torch.bfloat16)
        decision = resolve(get_op_spec(op), problem)
        adapter, config = decision.entry.adapter, decision.config
        if op == "gemm":
            public = lambda: turbo.ops.gemm(a, b, trans_b=True)
        else:
            cfg = Float8QuantConfig(granularity=problem.granularity, block_size=problem.block_size)
            public = lambda: turbo.ops.gemm_fp8(a, b, trans_b=True, config=cfg)
        direct = lambda: adapter.run(problem, a, b, config=config)
        public(), direct()
        overhead.append({"op": op, "key": format_key(problem), "public_us": round(_enqueue_us(public), 1),
                         "direct_us": round(_enqueue_us(direct), 1)})
    print(f"{'OP':9s} {'SOURCE':9s} {'BACKEND':9s} {'FIRST MS':>8s}  CONFIG / KEY")
    for r in rows:
        print(f"{r['op']:9s} {r['source']:9s} {r['backend']:9s} {r['first_call_ms']:8.3f}  {r['config']}  {r['key']}")
    print("\nwarm per-call enqueue time, public op vs the chosen adapter called directly (us):")
    for o in overhead:
        print(f"  {o['op']:9s} public {o['public_us']:8.1f}  direct {o['direct_us']:8.1f}  "
              f"overhead {o['public_us'] - o['direct_us']:+6.1f}  {o['key']}")
    stats = dict(autotune.STATS)
    print(f"\nprofiling in this process: {stats}")
    first = [r["first_call_ms"] for r in rows]
    print(f"first-call decision time: median {statistics.median(first):.3f} ms, max {max(first):.3f} ms "
          f"over {len(rows)} keys")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"decisions": rows, "overhead": overhead, "stats": stats}, f, indent=1)
    not_db = [r for r in rows if r["source"] != "tuned-db"]
    if stats.get("candidate_runs", 0) or not_db:
        print(f"FAIL: {stats.get('candidate_runs', 0)} candidate runs; {len(not_db)} keys not from the DB",
              file=sys.stderr)
        return 1
    print("PASS: every key came from the tuning DB, nothing was profiled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
