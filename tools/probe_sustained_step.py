"""Probe: the blockwise fp8 grouped step against bf16 as the bench times it and under sustained load.

Round 126 (``probe_power_clocks.py``) found every GEMM of the step at the H100's 700 W cap when
run back to back, the fp8 ones further below their short-burst rates than bf16's. The bench
times each call after an L2 flush and a GPU spin sized to the call's host time (harness.Timer),
and the fp8 step's host time is longer, so its timed calls may start on a cooler, faster clocked
GPU. This probe measures, per shape and in the same process:

* ``bench``: ``harness.Timer.time_interleaved`` on the eager steps, as bench_grouped_gemm.py does;
* ``sustained``: each step captured in a CUDA graph and replayed back to back in alternating
  segments (bf16, fp8, bf16, ...) of ``--seconds``, timed over each segment's second half, with
  nvidia-smi sampling power and SM clock.

fp8 is ``turbo_dispatch.ops.grouped_gemm_fp8`` (blockwise 1x128 / 128x128) with TRITON pinned and
its default configs; bf16 is the bench's ``torch._grouped_mm`` autograd function.

    cd tools && python3 probe_sustained_step.py --out $OUT/sustained.jsonl
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import bench_grouped_gemm as B  # noqa: E402
import harness as H  # noqa: E402
import turbo_dispatch as turbo  # noqa: E402
from probe_record import Jsonl, Smi, capture_graph  # noqa: E402
from turbo_dispatch.low_precision import Float8QuantConfig  # noqa: E402

SHAPES = ("deepseek-v3/up_gate/EP8/4096tpe/balanced", "deepseek-v3/up_gate/EP32/16384tpe/balanced",
          "deepseek-v3/down/EP8/4096tpe/balanced", "qwen3-30b-a3b/down/EP8/4096tpe/balanced",
          "mixtral-8x7b/up_gate/EP8/4096tpe/balanced")


def find_case(label: str) -> B.Case:
    model, _, ep, tpe, routing = label.split("/")
    cases, _ = B.collect_cases([model], [int(ep[2:])], [int(tpe[:-3])], [routing])
    for c in cases:
        if c.label == label:
            return c
    raise SystemExit(f"no bench case {label!r}")


def sustained(graph: torch.cuda.CUDAGraph, seconds: float) -> dict:
    """Replay back to back for ``seconds``; time the second half; sample power and clocks."""
    with Smi("power.draw,clocks.sm") as smi:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds / 2:
            graph.replay()
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 0
        start.record()
        while time.perf_counter() - t0 < seconds:
            for _ in range(4):
                graph.replay()
            n += 4
            torch.cuda.synchronize()
        end.record()
        end.synchronize()
    return {"ms": start.elapsed_time(end) / n, "replays": n, "power_w": smi.median(0), "sm_mhz": smi.median(1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--segments", type=int, default=3, help="segments per backend, alternating")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    cfg = Float8QuantConfig(granularity="blockwise", block_size=128)
    emit = Jsonl(args.out, gpu=torch.cuda.get_device_name())

    for label in args.shapes.split(","):
        c = find_case(label)
        a = torch.randn(c.m, c.k, device=device, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(c.g, c.n, c.k, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(c.m, c.n, device=device, dtype=torch.bfloat16)
        lens = B.group_lens(c.routing, c.g, c.m, device)
        offs_end = torch.cumsum(lens, 0, dtype=torch.int32)
        offs = torch.nn.functional.pad(offs_end, (1, 0))
        steps = {
            "bf16": (lambda: torch.autograd.grad(B.TorchGroupedMM.apply(a, b, offs_end), (a, b), grad), B.plain),
            "fp8": (lambda: torch.autograd.grad(turbo.ops.grouped_gemm_fp8(a, b, lens, group_offs=offs, trans_b=True,
                                                                           config=cfg), (a, b), grad),
                    B.pin("TRITON")),
        }
        flops = 3 * 2.0 * c.m * c.n * c.k
        timer = H.make_timer(device, False, 60.0)
        bench = timer.time_interleaved([s for s, _ in steps.values()], [e for _, e in steps.values()])
        emit({"probe": "bench", "shape": label, "bf16_ms": bench[0], "fp8_ms": bench[1],
              "ratio": bench[0] / bench[1], "host_ms": timer.last_host_ms})
        graphs = {}
        for name, (step, enter) in steps.items():
            enter()
            graphs[name] = capture_graph(step, warmups=3)
        B.plain()
        seg = {name: [] for name in graphs}
        for i in range(args.segments * len(graphs)):
            name = list(graphs)[i % len(graphs)]
            r = sustained(graphs[name], args.seconds)
            seg[name].append(r)
            emit({"probe": "segment", "shape": label, "backend": name, **r,
                  "step_tflops": flops / r["ms"] / 1e9})
        med = {name: statistics.median(r["ms"] for r in rs) for name, rs in seg.items()}
        emit({"probe": "sustained", "shape": label, "bf16_ms": med["bf16"], "fp8_ms": med["fp8"],
              "ratio": med["bf16"] / med["fp8"],
              "bf16_sm_mhz": statistics.median(r["sm_mhz"] for r in seg["bf16"] if r["sm_mhz"]),
              "fp8_sm_mhz": statistics.median(r["sm_mhz"] for r in seg["fp8"] if r["sm_mhz"])})
        graphs = steps = a = b = grad = None  # free this case's tensors before the next one's
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
