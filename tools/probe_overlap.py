"""Probe: can the blockwise step's quantisers run beside its GEMMs, on SMs the GEMM leaves free?

The blockwise fp8 step runs its quantisers (memory-bound) and its GEMMs (tensor-core bound, and
under sustained load at the 700 W cap, round 126) one after the other: the GPU never idles inside
a step, but the quantisers are 10-35% of it (round 112). Every persistent GEMM takes all 132 SMs
and fills their shared memory, so a quantiser on another stream only starts as the GEMM's last
wave drains. This probe caps the GEMM's persistent programs at P (``num_programs`` of the two
warp-specialised kernels patched) and measures, per shape, each as a CUDA graph replayed back to
back (no host time), in turns:

* each GEMM of the step alone (forward, dgrad, wgrad) at P programs;
* each quantiser alone (the activation's and the gradient's token runs, the weight's tiles);
* a GEMM at P programs launched first, a quantiser of another tensor on a second stream after it:
  ``hidden`` = (GEMM + quantiser - pair) / quantiser, the share of the quantiser the pair hid.

It also checks that a capped GEMM's output is bit-identical to the uncapped one's. Timing only:
nothing in the library changes.

    cd tools && python3 probe_overlap.py --out $OUT/overlap.jsonl
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from probe_record import Jsonl, capture_graph, event_ms  # noqa: E402  (sibling in tools/)
from probe_triton_grouped import bench_routing  # noqa: E402
from turbo_dispatch import BackendType, GlobalBackendManager  # noqa: E402
from turbo_dispatch.backends.quantizer import quantize_runs_both, quantize_tiles_both  # noqa: E402
from turbo_dispatch.backends.triton import dual_quantize_gluon as DQG  # noqa: E402
from turbo_dispatch.backends.triton import fp8_blockwise_gluon_ws as GWS  # noqa: E402
from turbo_dispatch.backends.triton import fp8_blockwise_wgrad_ws as GWW  # noqa: E402
from turbo_dispatch.low_precision import Float8QuantConfig  # noqa: E402
from turbo_dispatch.ops.grouped_gemm import _eager_fp8_mms  # noqa: E402

#: name -> (local experts, tokens, N, K) of the step's forward ``x [T, K] @ w[g]^T -> [T, N]``.
SHAPES = {"dsv3_up_ep32": (8, 32768, 4096, 7168), "dsv3_down_ep32": (8, 32768, 7168, 2048),
          "qwen3_up_ep8": (16, 65536, 1536, 2048), "qwen3_down_ep8": (16, 65536, 2048, 768)}
CFG = Float8QuantConfig(granularity="blockwise", block_size=128)


def cap_programs(p: int | None) -> None:
    """Persistent programs of the two warp-specialised GEMM kernels: ``p``, or the SM count."""
    from turbo_dispatch.backends.triton.gemm_kernels import num_programs

    GWS.num_programs = num_programs if p is None else (lambda _idx: p)
    GWW.num_programs = num_programs if p is None else (lambda _idx: p)


def pair(first, second):
    """``first`` on the current stream, then ``second`` on a side stream (launched after it)."""
    side = torch.cuda.Stream()

    def run():
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        first()
        with torch.cuda.stream(side):
            second()
        cur.wait_stream(side)
    return run


def in_turns(graphs: dict, rounds: int = 5, reps: int = 10) -> dict:
    """Median ms per replay of each graph, timed in turns."""
    times = {k: [] for k in graphs}
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for k, g in graphs.items():
            times[k].append(event_ms(g.replay, reps))
    return {k: statistics.median(v) for k, v in times.items()}


def operands(shape: str):
    g, t, n, k = SHAPES[shape]
    lens = torch.tensor(bench_routing("balanced", t, g), dtype=torch.int64, device="cuda")
    offs = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    torch.manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    return g, t, n, k, lens, offs, x, w, dy


def probe_shape(shape: str, caps: list[int], pair_caps: list[int], log: Jsonl) -> None:
    g, t, n, k, lens, offs, x, w, dy = operands(shape)
    fwd8, bwd8 = CFG.format.fwd_dtype(), CFG.format.bwd_dtype()
    x_rows, x_cols = quantize_runs_both(x, fwd8, 128)
    w_fwd, w_bwd = quantize_tiles_both(w, fwd8, 128)
    dy_rows, dy_cols = quantize_runs_both(dy, bwd8, 128)
    mm8, mm8_k = _eager_fp8_mms(CFG)
    gemms = {
        "fwd": lambda: mm8(x_rows, w_fwd, lens, offs, True, torch.bfloat16, fwd8, fwd8, True),
        "dgrad": lambda: mm8(dy_rows, w_bwd, lens, offs, False, torch.bfloat16, bwd8, fwd8, True),
        "wgrad": lambda: mm8_k(dy_cols, x_cols, lens, offs, torch.bfloat16, bwd8, fwd8),
    }
    # Quantisers of other tensors of the step's sizes, so that a pair has no data dependence.
    x2, w2, dy2 = x.clone(), w.clone(), dy.clone()
    quants = {"q_x": lambda: quantize_runs_both(x2, fwd8, 128), "q_dy": lambda: quantize_runs_both(dy2, bwd8, 128),
              "q_w": lambda: quantize_tiles_both(w2, fwd8, 128)}
    flops = 2.0 * t * n * k
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    cap_programs(None)
    ref = {name: fn().clone() for name, fn in gemms.items()}
    for p in caps:
        cap_programs(p)
        graphs = {name: capture_graph(fn, warmups=1) for name, fn in gemms.items()}
        same = {}
        for name, fn in gemms.items():
            same[name] = bool(torch.equal(fn(), ref[name]))
        ms = in_turns(graphs)
        for name in gemms:
            log({"probe": "gemm", "shape": shape, "gemm": name, "programs": p, "ms": ms[name],
                 "tflops": flops / ms[name] * 1e-9, "bits_equal_uncapped": same[name]})
        del graphs
    cap_programs(None)

    tma_runs = DQG.TMA_RUNS
    for form in ("tma", "per_tile"):
        DQG.TMA_RUNS = tma_runs if form == "tma" else None
        graphs = {name: capture_graph(fn, warmups=1) for name, fn in quants.items()}
        ms = in_turns(graphs)
        moved = {"q_x": x.numel() * 4, "q_dy": dy.numel() * 4, "q_w": w.numel() * 4}
        for name in quants:
            log({"probe": "quantiser", "shape": shape, "quantiser": name, "form": form, "ms": ms[name],
                 "tbs": moved[name] / ms[name] * 1e-9})
        del graphs
    DQG.TMA_RUNS = tma_runs

    # The pairs the step's data flow would allow with a pipeline: the forward beside the next
    # chunk's activation/weight quantisers, the dgrad and wgrad beside the gradient's.
    combos = [("fwd", "q_x"), ("fwd", "q_w"), ("dgrad", "q_dy"), ("wgrad", "q_dy")]
    for form in ("tma", "per_tile"):
        DQG.TMA_RUNS = tma_runs if form == "tma" else None
        for p in pair_caps:
            cap_programs(p)
            for gname, qname in combos:
                graphs = {"gemm": capture_graph(gemms[gname], warmups=1),
                          "quant": capture_graph(quants[qname], warmups=1),
                          "pair": capture_graph(pair(gemms[gname], quants[qname]), warmups=1)}
                ms = in_turns(graphs)
                hidden = (ms["gemm"] + ms["quant"] - ms["pair"]) / ms["quant"]
                log({"probe": "pair", "shape": shape, "gemm": gname, "quantiser": qname, "form": form,
                     "programs": p, "free_sms": sms - p, "gemm_ms": ms["gemm"], "quant_ms": ms["quant"],
                     "pair_ms": ms["pair"], "serial_ms": ms["gemm"] + ms["quant"], "hidden": hidden})
                del graphs
        cap_programs(None)
    DQG.TMA_RUNS = tma_runs
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--caps", default="132,124,116,108,100")
    ap.add_argument("--pair-caps", default="132,116,100")
    args = ap.parse_args(argv)
    log = Jsonl(args.out, gpu=torch.cuda.get_device_name())
    GlobalBackendManager.reset()
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="fp8")
    caps = [int(c) for c in args.caps.split(",")]
    pair_caps = [int(c) for c in args.pair_caps.split(",")]
    for shape in args.shapes.split(","):
        probe_shape(shape, caps, pair_caps, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
