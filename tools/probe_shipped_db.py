"""What the tuned DB shipped in the package gives a user who tunes nothing (GPU probe).

For each MoE preset case of the grouped GEMM bench at one expert parallelism and token count
(balanced routing), the whole training step through the public op (forward, dgrad, wgrad;
quantisation included for fp8) is timed in turns, in one process, three ways:

* ``shipped``: no backend pinned, autotune off, the package's DBs on: what ``pip install`` gives;
* ``default``: the same with the package's DBs off (the platform default, as before they held
  grouped GEMM keys);
* ``bf16``: the bench's bf16 peer on ``torch._grouped_mm`` (for fp8, the bar of issue 6).

The user DB is off, so no result is ever profiled or remembered: ``shipped`` can only come from
the package's files. Each way's three GEMM decisions are recorded (backend, config, source), and
the ``shipped`` step's output and gradients pass the bench's correctness gate against its float32
reference.

With ``--db FILE``, ``shipped`` is that file instead, read as the only DB (a read-only layer;
the package's DBs off in both ways): how a DB a user made (e.g. ``turbo-dispatch tune --step``)
does against the default.

Usage (repo installed): ``python3 tools/probe_shipped_db.py --dtype fp8 --ep 8 --tokens-per-expert 4096
[--db FILE] [--out FILE]``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ["PRIMUS_TURBO_TUNE_DB"] = "off"  # before turbo_dispatch reads its settings
os.environ.pop("PRIMUS_TURBO_AUTO_TUNE", None)

import torch  # noqa: E402

from turbo_dispatch import GlobalBackendManager  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_grouped_step as P  # noqa: E402  (sibling in tools/)
from bench_grouped_gemm import TorchGroupedMM, plain, references  # noqa: E402

import harness as H  # noqa: E402  (benchmarks/harness.py: the bench's correctness gate)


DB: list = []  # --db FILE, when given


def _setting(shipped: bool):
    def prepare() -> None:
        plain()  # the bench's unpinned, autotune-off setting
        if DB:
            GlobalBackendManager.set_shipped_tune_db(False)
            GlobalBackendManager.set_tune_db_path(DB if shipped else [])
        else:
            GlobalBackendManager.set_shipped_tune_db(shipped)
    return prepare


def _step_decisions(step) -> list[str]:
    """The backend, config and source of each GEMM one call of ``step`` resolves (forward, dgrad,
    wgrad), recorded around the op module's resolver call."""
    seen = []
    resolve = P._grouped.resolve

    def recording(spec, problem):
        d = resolve(spec, problem)
        seen.append(d.backend + ("" if d.config is None else f"{list(d.config)}") + f" ({d.source})")
        return d

    P._grouped.resolve = recording
    try:
        step()
        torch.cuda.synchronize()
    finally:
        P._grouped.resolve = resolve
    return seen


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=["bf16", "fp8"], default="fp8")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--tokens-per-expert", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--db", default=None, help="a DB file to measure instead of the package's")
    ap.add_argument("--routing", choices=["balanced", "near-balanced"], default="balanced",
                    help="the bench's balanced routing (equal groups), or the near-balanced routing the tuners "
                         "time on (each group within 25%% of an even share, seeded)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.out:
        P.OUT.append(open(args.out, "w"))
    if args.db:
        DB.append(args.db)
    P.emit(gpu=torch.cuda.get_device_name(), torch=torch.__version__, dtype=args.dtype, ep=args.ep,
           tokens_per_expert=args.tokens_per_expert, db=args.db or "shipped", routing=args.routing)
    shipped_vs_default, shipped_vs_bf16, default_vs_bf16 = [], [], []
    for shape in P.preset_shapes(f"presets:{args.ep}:{args.tokens_per_expert}"):
        t, n, k, lens, offs, a, w, grad, cfg = P.step_operands(shape)
        if args.routing == "near-balanced":
            torch.manual_seed(1)
            lens = P._grouped._near_balanced_lens(t, lens.numel()).cuda()
            offs = P._grouped._offsets(lens, t)  # int32, as step_operands gives it
        cfg = None if args.dtype == "bf16" else cfg
        ends = offs[1:].contiguous()
        step = P.step_fn(a, w, lens, offs, cfg, grad)

        def bf16_step(a=a, w=w, ends=ends, grad=grad):
            a.grad = w.grad = None
            TorchGroupedMM.apply(a, w, ends).backward(grad)

        _setting(True)()
        shipped_decisions = _step_decisions(step)
        out = step()
        refs = references(a, w, lens.tolist(), grad, a.device)
        check = H.gate([("out", out, refs[0]), ("dgrad", a.grad, refs[1]), ("wgrad", w.grad, refs[2])],
                       min_snr_db=None if cfg is None else 25.0)
        del out, refs
        _setting(False)()
        default_decisions = _step_decisions(step)
        med = P.medians_in_turns({"shipped": (_setting(True), step), "default": (_setting(False), step),
                                  "bf16": (P._nothing, bf16_step)}, args.rounds, args.reps)
        flops = 3 * 2.0 * t * n * k
        P.emit(probe="shipped_db", shape=shape, check=check.status, snr_db=check.snr_db, shipped_ms=med["shipped"],
               default_ms=med["default"], bf16_ms=med["bf16"], shipped_vs_default=med["default"] / med["shipped"],
               shipped_vs_bf16=med["bf16"] / med["shipped"], default_vs_bf16=med["bf16"] / med["default"],
               shipped_tflops=flops / med["shipped"] * 1e-9, shipped_gemms=shipped_decisions,
               default_gemms=default_decisions)
        shipped_vs_default.append(med["default"] / med["shipped"])
        shipped_vs_bf16.append(med["bf16"] / med["shipped"])
        default_vs_bf16.append(med["bf16"] / med["default"])
        del a, w, grad, step, bf16_step
        torch.cuda.empty_cache()
    GlobalBackendManager.reset()
    if shipped_vs_default:
        P.emit(probe="shipped_db_geomean", dtype=args.dtype, ep=args.ep, tokens_per_expert=args.tokens_per_expert,
               cases=len(shipped_vs_default), shipped_vs_default=statistics.geometric_mean(shipped_vs_default),
               shipped_vs_bf16=statistics.geometric_mean(shipped_vs_bf16),
               default_vs_bf16=statistics.geometric_mean(default_vs_bf16))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
