#!/usr/bin/env python3
"""Correctness of moe_dispatch / moe_combine / Buffer over NCCL: 2 processes, one GPU each.

Runs every check of tests/moe_checks.py (the same ones the gloo tests run) plus larger shapes
(hidden 1024, top-8, 32 experts, a few hundred tokens per rank), prints a short report to stdout
and exits 1 if any check failed. NVLink multicast (NVLS) is switched off for the run.

Usage: python3 benchmarks/probes/moe_gpu_check.py [--world 2] [--backend SYMM_MEM]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # moe_checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="processes (one GPU each); default 2")
    parser.add_argument("--backend", default=None,
                        help="pin this moe_dispatch_combine backend on every rank (e.g. SYMM_MEM); default: the "
                             "platform default")
    args = parser.parse_args()
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if args.backend:  # set before the workers spawn, so every rank (and moe_checks.PINNED) sees it
        os.environ["PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND"] = args.backend

    import torch

    import moe_checks

    gpus = torch.cuda.device_count()
    print(f"moe_gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL "
          f"{'.'.join(map(str, torch.cuda.nccl.version())) if gpus else '-'}, {gpus} GPU(s)"
          + (f" ({torch.cuda.get_device_name(0)})" if gpus else ""))
    if gpus < args.world:
        print(f"moe_gpu_check: SKIPPED: needs {args.world} GPUs, found {gpus}")
        return 2
    start = time.time()
    results = moe_checks.spawn(args.world, "nccl", checks="gpu", timeout=400)
    names = list(dict(moe_checks.CHECKS, **moe_checks.GPU_EXTRA))
    failed, passed = 0, 0
    for name in names + ["__process__"]:
        per_rank = {r: res.get(name, "missing" if name != "__process__" else "ok") for r, res in results.items()}
        ok = all(v == "ok" for v in per_rank.values())
        if name == "__process__" and ok:
            continue
        failed += not ok
        passed += ok
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
        for r, v in per_rank.items():
            if v != "ok":
                print(f"        rank {r}: " + v.replace("\n", "\n        "))
    print(f"moe_gpu_check: {passed} passed, {failed} failed ({args.world} ranks, NCCL, backend "
          f"{args.backend or 'default'}, "
          f"{time.time() - start:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
