"""Child-process entry points for the tuning-DB tests (run as ``python tunedb_worker.py MODE ...``).

Each mode is something that must happen in a *separate process* to prove a property: concurrent
writers, a writer killed mid-write, a second job that finds its keys already tuned.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _result(writer: int, index: int, time_ms: float = 1.0):
    from turbo_dispatch.tuning import store
    from turbo_dispatch.tuning.stamp import current_stamp

    stamp = current_stamp("cpu")
    key = {"m": writer + 1, "n": index + 1, "k": 8, "trans_a": False, "trans_b": False, "a_dtype": "fp32",
           "b_dtype": "fp32", "out_dtype": "fp32", "platform": "cpu"}
    return stamp, store.Result(stamp.id, "gemm", key, "TORCH", None, "x", time_ms)


def write_many(path: str, writer: int, count: int) -> None:
    """One locked merge per result, as many online-tuning ranks would do."""
    from turbo_dispatch.tuning import store

    for index in range(count):
        stamp, result = _result(writer, index)
        contents = store.Contents()
        contents.stamps[stamp.id] = stamp
        contents.add_result(result)
        store.update(path, contents)


def write_forever(path: str, size: int) -> None:
    """Rewrites a large DB over and over (the parent SIGKILLs this process at a random moment)."""
    from turbo_dispatch.tuning import store

    contents = store.Contents()
    for index in range(size):
        stamp, result = _result(0, index)
        contents.stamps[stamp.id] = stamp
        contents.add_result(result)
    generation = 0
    print("ready", flush=True)
    while True:
        generation += 1
        bumped = store.Contents()
        stamp, result = _result(1, generation % size, time_ms=float(generation))
        bumped.stamps[stamp.id] = stamp
        bumped.add_result(result)
        bumped.merge(contents)
        store.update(path, bumped)


def run_gemms(shapes_json: str) -> None:
    """Autotune on (env), run gemm on each shape, then print the profiling counters and decisions."""
    import torch

    import turbo_dispatch as turbo
    from turbo_dispatch import autotune

    sources = []
    for m, n, k in json.loads(shapes_json):
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = turbo.ops.gemm(a, b)
        assert torch.allclose(out, a @ b, rtol=1e-4, atol=1e-4)
        decision = turbo.explain("gemm", a, b)
        sources.append([decision.source, decision.backend, list(decision.notes)])
    print(json.dumps({"stats": dict(autotune.STATS), "decisions": sources}))


def decide_while_capturing(shapes_json: str) -> None:
    """Simulates CUDA-graph capture on the CPU: profiling reports itself blocked, as it does
    while ``torch.cuda.is_current_stream_capturing()``; prints each decision."""
    import torch

    import turbo_dispatch as turbo
    from turbo_dispatch import autotune

    autotune.profiling_blocked = lambda: "a CUDA graph is being captured"
    out = []
    for m, n, k in json.loads(shapes_json):
        a, b = torch.randn(m, k), torch.randn(k, n)
        decision = turbo.explain("gemm", a, b)
        out.append([decision.source, decision.backend, decision.provisional])
    print(json.dumps({"stats": dict(autotune.STATS), "decisions": out}))


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "write_many":
        write_many(args[0], int(args[1]), int(args[2]))
    elif mode == "write_forever":
        write_forever(args[0], int(args[1]))
    elif mode == "run_gemms":
        run_gemms(args[0])
    elif mode == "decide_while_capturing":
        decide_while_capturing(args[0])
    else:
        raise SystemExit(f"unknown mode {mode}")
